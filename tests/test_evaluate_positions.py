"""``evaluate`` on the models whose outputs are read at tokens: an extractive question
answerer (its answer's start and end), a token classifier (each labelled word's label) and
a masked language model (each mask's token). Each row's metrics are recomputed here from
the model's own outputs with the removed tokens replaced by the mask token (ERASER's
top-k shares by hand, Spearman's rho by SciPy), from the scores ``explain`` gives the
same row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers as tf
from scipy.stats import spearmanr
from test_cli import run_cli
from test_cli_question_answering import WORDS as QA_WORDS
from test_cli_question_answering import _tokenizer as qa_tokenizer
from test_cli_token_class import LABELS, TEXT, WORDS, _bert, _vocab, window_ids

from captum_attention.loading import load_masked_lm, load_question_answerer, load_token_classifier
from captum_attention.metrics.token_removal import DEFAULT_BINS, example_seeds, random_halves
from captum_attention.presentation.dataset import DatasetError, PositionExample, read_positions
from captum_attention.presentation.display import special_tokens
from captum_attention.presentation.evaluate import Options, merge
from captum_attention.presentation.position_evaluation import evaluate_positions
from captum_attention.presentation.question_answering import context_tokens, explain_question, question_inputs
from captum_attention.presentation.token_class import explain_masks, explain_token_labels

QA_ROWS = [
    {"question": "where did the cat sit", "context": "the cat did sit on the mat . a dog ran to the park"},
    {"question": "who ran to the park", "context": "a dog ran to the park . the cat sat on the mat", "answer": "a dog"},
    {"question": "where did the bird sit", "context": "the bird sat in the tree . it saw a cat",
     "answers": {"text": ["the tree"], "answer_start": [16]}},
]
LONG = " ".join(["ada lived in london ."] * 7)
"""With one more sentence, two windows of the tagger's and the masked model's 32 positions."""
TAG_ROWS = [{"text": TEXT}, {"text": "zoe sat on the mat in paris .", "word": "paris"},
            {"text": LONG + " zoe sat in paris .", "word": "paris"},
            {"tokens": ["zoe", "lived", "in", "paris", "."], "ner_tags": [1, 0, 0, 3, 0]}]  # CoNLL-2003's kind: read as its text
MASK_ROWS = [{"text": "ada lived in [MASK] with zoe ."}, {"text": "the cat sat on the [MASK] .", "target": "mat"},
             {"text": "[MASK] " + LONG + " a [MASK] sat ."}]
METHODS = "raw,attn_lrp,integrated_gradients"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A BERT question answerer, tagger and masked language model (token types), and a
    tagger that labels every word "O", saved with their tokenizers."""
    root = tmp_path_factory.mktemp("position_models")
    folders = {task: root / task for task in ("question-answering", "token-classification", "fill-mask", "outside")}
    torch.manual_seed(0)
    tf.BertForQuestionAnswering(tf.BertConfig(
        vocab_size=len(QA_WORDS) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, initializer_range=0.3,
    )).save_pretrained(folders["question-answering"])
    qa_tokenizer(root).save_pretrained(folders["question-answering"])
    _bert(LABELS).save_pretrained(folders["token-classification"])
    _bert(LABELS, o_bias=50.0).save_pretrained(folders["outside"])
    torch.manual_seed(3)
    tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=len(WORDS) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, initializer_range=0.3,
    )).save_pretrained(folders["fill-mask"])
    tagger_vocab = _vocab(root / "token-classification")
    for task in ("token-classification", "fill-mask", "outside"):
        tf.BertTokenizerFast(vocab=str(tagger_vocab)).save_pretrained(folders[task])
    return folders


def _data(folder: Path, rows: list[dict]) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _evaluated(model_folder: Path, data: Path, output: Path, *options: str) -> list[dict]:
    result = run_cli("evaluate", "--model", str(model_folder), str(data), "--output", str(output), "--methods", METHODS,
                     "--ig-steps", "4", *options)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]


def _probability(logits_of, ids: torch.Tensor, kept: torch.Tensor, mask_id: int, target: int) -> float:
    """p(target) with the tokens outside ``kept`` replaced by the mask token."""
    with torch.no_grad():
        return float(logits_of(ids.masked_fill(~kept, mask_id)).float().softmax(-1)[target])


def _top(scores: torch.Tensor, removable: torch.Tensor, share: float) -> torch.Tensor:
    """The top ⌈share·n⌉ removable tokens, with every token tied with the last one."""
    count = math.ceil(share * int(removable.sum()))
    ranked = scores.masked_fill(~removable, float("-inf"))
    cut = ranked.sort(descending=True).values[count - 1]
    return removable & (ranked >= cut)


def _reference(logits_of, ids: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor, mask_id: int, target: int) -> dict:
    """The three metrics of one logit, from ``logits_of(ids)`` (its classes' logits)."""
    removable = ~keep
    everything = torch.ones_like(keep)
    full = _probability(logits_of, ids, everything, mask_id, target)
    tops = [_top(scores, removable, bin / 100) for bin in DEFAULT_BINS]
    comprehensiveness = sum(full - _probability(logits_of, ids, ~top, mask_id, target) for top in tops) / len(tops)
    sufficiency = sum(full - _probability(logits_of, ids, top | keep, mask_id, target) for top in tops) / len(tops)
    halves = random_halves(removable[None], 32, 0, example_seeds(ids[None], None, 0))[0]
    summed = [float(scores.double()[half].sum()) for half in halves]
    actual = [_probability(logits_of, ids, half | keep, mask_id, target) for half in halves]
    return {"probability": full, "comprehensiveness": comprehensiveness, "sufficiency": sufficiency,
            "datamodeling": spearmanr(summed, actual).statistic}


def _check_row(row: dict, references: list[dict]) -> None:
    assert len(row["logits"]) == len(references)
    for logit, reference in zip(row["logits"], references):
        for name, value in reference.items():
            assert logit[name] == pytest.approx(value, abs=1e-5), (row["method"], logit["at"], name)
    for metric in ("comprehensiveness", "sufficiency", "datamodeling"):
        assert row[metric] == pytest.approx(sum(r[metric] for r in references) / len(references), abs=1e-5)


SHOWN = {"raw": "Raw Attention", "attn_lrp": "AttnLRP", "integrated_gradients": "Integrated Gradients"}


def test_a_question_answerers_answer_ends_are_scored_with_the_tokens_replaced_in_place(models, tmp_path):
    folder = models["question-answering"]
    rows = _evaluated(folder, _data(tmp_path, QA_ROWS), tmp_path / "out")
    assert [(row["index"], row["method"]) for row in rows] == [(i, m) for i in range(3) for m in METHODS.split(",")]
    model, tokenizer = load_question_answerer(folder)
    for row in rows:
        source = QA_ROWS[row["index"]]
        answer = source.get("answer", source.get("answers", {}).get("text", [None])[0])
        explanation = explain_question(model, tokenizer, source["question"], source["context"], answer, [row["method"]],
                                       ig_steps=4)
        assert row["explained"] == explanation.answer and (answer is None or explanation.answer == answer)
        encoded = question_inputs(tokenizer, source["question"], source["context"])
        ids, types = encoded["input_ids"][0], encoded["token_type_ids"]
        in_context = context_tokens(encoded, tokenizer)
        keep = special_tokens(ids, tokenizer)
        references = []
        for end, position in (("start", explanation.start), ("end", explanation.end)):
            def logits_of(replaced, end=end):
                out = model(input_ids=replaced[None], token_type_ids=types)
                return getattr(out, f"{end}_logits")[0].masked_fill(~in_context, float("-inf"))

            scores = torch.tensor(explanation.scores[SHOWN[row["method"]]][end])
            references.append(_reference(logits_of, ids, scores, keep, tokenizer.mask_token_id, position))
        assert [logit["position"] for logit in row["logits"]] == [explanation.start, explanation.end]
        assert references[0]["probability"] == pytest.approx(explanation.start_probability, abs=1e-6)
        _check_row(row, references)


@pytest.mark.parametrize("task", ["token-classification", "fill-mask"])
def test_a_taggers_words_and_a_masked_models_masks_are_scored_at_their_tokens(models, tmp_path, task):
    folder = models[task]
    data = TAG_ROWS if task == "token-classification" else MASK_ROWS
    rows = _evaluated(folder, _data(tmp_path, data), tmp_path / "out")
    model, tokenizer = (load_token_classifier if task == "token-classification" else load_masked_lm)(folder)
    explain = explain_token_labels if task == "token-classification" else explain_masks
    explained_some = windowed = False
    for row in rows:
        source = data[row["index"]]
        text = source.get("text") or " ".join(source["tokens"])
        explanation = explain(model, tokenizer, text, source.get("word", source.get("target")), [row["method"]], ig_steps=4)
        windows = window_ids(tokenizer, text, 32)  # the whole text where it fits
        references = []
        for word in explanation.words:
            ids = windows[word.window][0]
            keep = special_tokens(ids, tokenizer)
            target = model.config.label2id[word.label] if task == "token-classification" else \
                int(tokenizer.convert_tokens_to_ids(word.label))

            def logits_of(replaced, position=word.position):
                return model(input_ids=replaced[None]).logits[0, position]

            references.append(_reference(logits_of, ids, torch.tensor(word.scores[SHOWN[row["method"]]]), keep,
                                         tokenizer.mask_token_id, target))
        assert [(logit["window"], logit["position"]) for logit in row["logits"]] == \
            [(word.window, word.position) for word in explanation.words]
        windowed |= len(windows) > 1 and {word.window for word in explanation.words} >= {1}
        assert [logit["explained"] for logit in row["logits"]] == [word.label for word in explanation.words]
        if not references:
            assert all(row[m] is None for m in ("comprehensiveness", "sufficiency", "datamodeling"))
            continue
        explained_some = True
        _check_row(row, references)
    assert explained_some and windowed


def test_rows_are_the_same_resumed_and_split_over_two_processes(models, tmp_path):
    folder = models["question-answering"]
    data = _data(tmp_path, QA_ROWS)
    whole = (tmp_path / "whole")
    _evaluated(folder, data, whole)
    again = run_cli("evaluate", "--model", str(folder), str(data), "--output", str(whole), "--methods", METHODS, "--ig-steps", "4")
    assert again.returncode == 0 and "resuming: 3 of 3 examples already done" in again.stdout
    model, tokenizer = load_question_answerer(folder)
    examples = [PositionExample(i, i + 1, row["context"], row["question"], row.get("answer", row.get("answers", {}).get("text", [None])[0]))
                for i, row in enumerate(QA_ROWS)]
    split = tmp_path / "split"
    for process in (0, 1):
        evaluate_positions(model, tokenizer, "question-answering", examples, METHODS.split(","),
                           ["comprehensiveness", "sufficiency", "datamodeling"], split, Options(ig_steps=4), process, 2)
    merge(split, examples, ["comprehensiveness", "sufficiency", "datamodeling"])
    assert (split / "results.jsonl").read_text() == (whole / "results.jsonl").read_text()


def test_rows_the_model_cannot_explain_are_refused_in_one_line_or_skipped(models, tmp_path):
    folder = models["question-answering"]
    rows = [*QA_ROWS[:1], {"question": "who sat", "context": "the cat sat", "answer": "a dog"}, {"context": "no question here"}]
    data = _data(tmp_path, rows)
    refused = run_cli("evaluate", "--model", str(folder), str(data), "--output", str(tmp_path / "a"), "--methods", "raw")
    assert refused.returncode != 0 and "line 3: 'question' is missing" in refused.stderr
    rows = rows[:2]
    data = _data(tmp_path, rows)
    refused = run_cli("evaluate", "--model", str(folder), str(data), "--output", str(tmp_path / "b"), "--methods", "raw")
    assert refused.returncode != 0
    assert "line 2: 'answer' 'a dog' is not in the context" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    skipped = run_cli("evaluate", "--model", str(folder), str(data), "--output", str(tmp_path / "c"), "--methods", "raw",
                      "--skip-malformed")
    assert skipped.returncode == 0 and "skipped" in skipped.stderr and "line 2" in skipped.stderr
    assert [json.loads(line)["line"] for line in (tmp_path / "c" / "results.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("options, message", [
    (("--metrics", "token_f1"), "unknown metric 'token_f1'"),
    (("--methods", "attn_lrp_presence_calibrated"), "their removals of words move an answer's start and end"),
    (("--methods", "alti_logit"), "alti_logit explains a language model's next-token logit"),
])
def test_a_method_or_metric_that_cannot_score_a_logit_at_a_token_is_refused_before_the_model_loads(models, tmp_path, options, message):
    data = _data(tmp_path, QA_ROWS)
    result = run_cli("evaluate", "--model", str(models["question-answering"]), str(data), "--output", str(tmp_path / "o"), *options)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert not (tmp_path / "o").exists()


def test_a_text_whose_every_word_is_outside_the_entities_has_no_value(models, tmp_path):
    output = tmp_path / "out"
    rows = _evaluated(models["outside"], _data(tmp_path, TAG_ROWS[:1]), output)
    assert [row["logits"] for row in rows] == [[]] * 3
    assert all(row[metric] is None for row in rows for metric in ("comprehensiveness", "sufficiency", "datamodeling"))
    assert "| raw | n/a | n/a | n/a |" in (output / "summary.md").read_text()


def test_rows_are_read_from_jsonl_or_csv_with_squads_answers_or_refused_with_their_line(tmp_path):
    squad = tmp_path / "squad.csv"
    squad.write_text('question,context,answer\nwho ran,"a dog ran, fast",a dog\nwhere,the park,\n')
    examples, _ = read_positions(squad, "question-answering")
    assert examples == [PositionExample(0, 2, "a dog ran, fast", "who ran", "a dog"), PositionExample(1, 3, "the park", "where")]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "q", "context": "c", "answers": {"text": ["c"], "answer_start": [0]}}) + "\n")
    assert read_positions(rows, "question-answering")[0][0].target == "c"
    rows.write_text(json.dumps({"question": "q", "context": "c", "answers": {"text": [], "answer_start": []}}) + "\n")
    assert read_positions(rows, "question-answering")[0][0].target is None  # SQuAD 2's unanswerable: the prediction
    rows.write_text(json.dumps({"text": "ada sat", "word": 3}) + "\n" + json.dumps({"text": "ada"}) + "\n")
    with pytest.raises(DatasetError, match="line 1: 'word' must be a non-empty string"):
        read_positions(rows, "token-classification")
    examples, skipped = read_positions(rows, "token-classification", skip_malformed=True)
    assert [e.text for e in examples] == ["ada"] and skipped == ["line 1: 'word' must be a non-empty string (leave it out to "
                                                                 "explain the prediction)"]
    rows.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DatasetError, match="line 1: 'context' is missing or empty"):
        read_positions(rows, "question-answering")
    conll = {"id": "0", "tokens": ["EU", "rejects", "German", "call"], "ner_tags": [3, 0, 7, 0]}
    rows.write_text(json.dumps(conll) + "\n" + json.dumps({**conll, "tokens": ["EU", 7]}) + "\n")
    examples, skipped = read_positions(rows, "token-classification", skip_malformed=True)
    assert [e.text for e in examples] == ["EU rejects German call"]
    assert skipped == ["line 2: 'tokens' must be a non-empty list of words (strings), as CoNLL-2003's rows give them"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("task", ["question-answering", "token-classification", "fill-mask"])
def test_rows_on_a_gpu_equal_the_cpus(models, tmp_path, task):
    """The texts are tokenized on the CPU and read where the model's weights are."""
    load = {"question-answering": load_question_answerer, "token-classification": load_token_classifier, "fill-mask": load_masked_lm}
    model, tokenizer = load[task](models[task])
    rows = {"question-answering": QA_ROWS, "token-classification": TAG_ROWS, "fill-mask": MASK_ROWS}[task]
    examples = [PositionExample(i, i + 1, row.get("context", row.get("text")), row.get("question"),
                                row.get("answer", row.get("word", row.get("target")))) for i, row in enumerate(rows)]
    metrics = ["comprehensiveness", "sufficiency", "datamodeling"]
    for device in ("cpu", "cuda"):
        evaluate_positions(model.to(device), tokenizer, task, examples, ["raw", "attn_lrp"], metrics, tmp_path / device)
        merge(tmp_path / device, examples, metrics)
    cpu, gpu = ([json.loads(line) for line in (tmp_path / device / "results.jsonl").read_text().splitlines()] for device in ("cpu", "cuda"))
    for on_cpu, on_gpu in zip(cpu, gpu):
        assert on_cpu["explained"] == on_gpu["explained"]
        for metric in metrics:
            assert on_gpu[metric] == pytest.approx(on_cpu[metric], abs=1e-3)
