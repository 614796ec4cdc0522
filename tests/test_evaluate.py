"""``captum-attention evaluate``: a data set explained and scored, resumable, on one or two processes.

A tiny BERT classifier and a word-level tokenizer are saved as a local checkpoint. The rows
of a run are checked against the metrics computed directly on each example alone; a run
killed with SIGKILL and resumed, and a run on two processes (gloo, through Accelerate), must
give exactly the rows of one uninterrupted single-process run.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers as tf

from conftest import SwallowsCtrlC, killed_part_way

from captum_attention import GradSAM
from captum_attention.capture.identity import weights_digest
from captum_attention.metrics import aopc, comprehensiveness, datamodeling_score, token_f1
from captum_attention.presentation import evaluate as ev
from captum_attention.presentation.cli import main
from captum_attention.presentation.explain import explain

WORDS = "the a film plot was is not very good bad dull superb acting story great awful".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("classifier")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = tf.BertTokenizerFast(vocab=str(vocab))
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, num_labels=2, initializer_range=0.3,
    )
    tf.BertForSequenceClassification(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _data(folder: Path, count: int = 23) -> Path:
    generator = torch.Generator().manual_seed(3)
    path = folder / "data.jsonl"
    with path.open("w") as file:
        for row in range(count):
            words = [WORDS[i] for i in torch.randint(len(WORDS), (int(torch.randint(3, 12, (1,), generator=generator)),), generator=generator)]
            file.write(json.dumps({"text": " ".join(words), "label": row % 2, "rationale": words[:2]}) + "\n")
    return path


def _run(*args: str) -> int:
    return main(["evaluate", *args])


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_rows_match_the_metrics_on_each_example_alone(checkpoint, tmp_path, capsys):
    data = _data(tmp_path)
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out"), "--methods", "grad_sam,raw",
                "--batch-size", "4") == 0
    rows = _rows(tmp_path / "out")
    examples, _ = ev.read_dataset(data)
    assert [(r["index"], r["method"]) for r in rows] == [(e.index, m) for e in examples for m in ("grad_sam", "raw")]
    summary = (tmp_path / "out" / "summary.md").read_text()
    directions = {"sufficiency": "↓", "decision_flip": "↓"}
    named = [f"{name} {directions.get(name, '↑')}" for name in ev.metric_names()]
    assert summary.splitlines()[0] == "| method | " + " | ".join(named) + " |"
    assert "↑: higher is better, ↓: lower is better" in summary
    assert "| grad_sam | " in capsys.readouterr().out

    model = tf.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(checkpoint)
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    for example in examples[:6]:
        encoded = tokenizer([example.text], return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        predicted = forward(ids, mask).argmax(-1)
        scores = GradSAM(forward, model=model).attribute(ids, target=predicted, additional_forward_args=(mask,))
        keep = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
        row = next(r for r in rows if r["index"] == example.index and r["method"] == "grad_sam")
        expected = aopc(comprehensiveness(forward, ids, mask, scores, predicted, keep=keep)).item()
        assert row["comprehensiveness"] == pytest.approx(expected, abs=1e-5)
        lds = datamodeling_score(forward, ids, mask, scores, predicted, keep=keep, per_example=True).item()  # its own draws
        assert (row["datamodeling"] is None) == math.isnan(lds)
        assert row["datamodeling"] is None or row["datamodeling"] == pytest.approx(lds, abs=1e-6)
        rationale = torch.tensor([[False] + [w in example.rationale for w in example.text.split()] + [False]])
        assert row["token_f1"] == pytest.approx(token_f1(scores, rationale, (mask == 1) & ~keep).item(), abs=1e-6)
        top = int(scores.masked_fill(~((mask == 1) & ~keep), float("-inf")).argmax())
        assert row["pointing_game"] == float(rationale[0, top])
        assert row["predicted"] == int(predicted)


def test_every_method_and_metric_gives_an_example_the_same_row_in_any_batch(checkpoint, tmp_path):
    """Every method a classifier takes, every metric: the rows of a run in batches of 4
    (length-sorted, padded) equal those of a run one example at a time, up to the
    batched arithmetic's rounding. No random draw may follow the batch's shape."""
    methods = [m for m in ev.evaluation_methods() if m != "alti_logit"]  # alti_logit explains a language model
    data = _data(tmp_path, 6)
    common = [str(data), "--model", str(checkpoint), "--methods", ",".join(methods), "--ig-steps", "8", "--shap-evals", "40"]
    assert _run(*common, "--batch-size", "4", "--output", str(tmp_path / "four")) == 0
    assert _run(*common, "--batch-size", "1", "--output", str(tmp_path / "one")) == 0
    batched, alone = _rows(tmp_path / "four"), _rows(tmp_path / "one")
    assert len(batched) == len(alone) == 6 * len(methods)
    for row, other in zip(sorted(batched, key=lambda r: (r["index"], r["method"])), sorted(alone, key=lambda r: (r["index"], r["method"]))):
        assert row.keys() == other.keys() and (row["index"], row["method"]) == (other["index"], other["method"])
        for metric in ev.metric_names():
            assert (row[metric] is None) == (other[metric] is None), (row["method"], metric)
            assert row[metric] is None or row[metric] == pytest.approx(other[metric], abs=1e-4), (row["method"], metric)


def test_texts_longer_than_the_model_takes_are_cut_and_said_so(checkpoint, tmp_path, capsys):
    """Texts past the model's 64 positions are explained and scored cut there, as explain
    cuts them, and one line says which (none for a data set that fits)."""
    data = tmp_path / "data.jsonl"
    texts = ["the film was good", " ".join(["the plot was dull"] * 20), " ".join(["superb acting"] * 40)]
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    assert _run(str(data), "--model", str(checkpoint), "--methods", "raw", "--metrics", "comprehensiveness",
                "--output", str(tmp_path / "out")) == 0
    error = capsys.readouterr().err
    assert f"{data}: 2 texts (line 2 and 1 more) longer than the 64 tokens the model takes, explained and scored cut there" in error
    assert len(_rows(tmp_path / "out")) == 3
    data.write_text(json.dumps({"text": texts[0]}) + "\n")
    assert _run(str(data), "--model", str(checkpoint), "--methods", "raw", "--output", str(tmp_path / "short")) == 0
    assert "longer than" not in capsys.readouterr().err


def test_a_decoder_classifier_padded_with_its_own_id_gives_each_example_its_row_alone(tmp_path):
    """GPT-2's classifier finds its last token by config.pad_token_id (1 here, not 0): the
    rows the metrics and the refined methods shorten by deletion are padded with it. Its
    positions are absolute: the batches are padded on the right although its tokenizer pads
    on the left (SHAP's values placed so too). A batch of 4 gives each example the row it
    gets alone, in ``evaluate`` and in ``explain``."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = tf.BertTokenizerFast(vocab=str(vocab), padding_side="left")
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=len(WORDS) + 5, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=1, num_labels=2)
    model = tf.GPT2ForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    methods = "grad_sam,attn_lrp_presence_calibrated,attn_lrp_half_contexts,attn_lrp_presence_greedy,shap"
    data = _data(tmp_path, 6)
    common = [str(data), "--model", str(folder), "--methods", methods, "--shap-evals", "40"]
    assert _run(*common, "--batch-size", "4", "--output", str(tmp_path / "four")) == 0
    assert _run(*common, "--batch-size", "1", "--output", str(tmp_path / "one")) == 0
    key = lambda row: (row["index"], row["method"])  # noqa: E731
    for row, other in zip(sorted(_rows(tmp_path / "four"), key=key), sorted(_rows(tmp_path / "one"), key=key)):
        assert key(row) == key(other)
        for metric in ev.metric_names():
            assert row[metric] is None or row[metric] == pytest.approx(other[metric], abs=1e-4), (row["method"], metric)
    texts = [e.text for e in ev.read_dataset(data)[0]]
    together = explain(model, tokenizer, texts, methods=["grad_sam", "attn_lrp"], batch_size=4).sentences
    for sentence in together:
        alone = explain(model, tokenizer, [sentence.text], methods=["grad_sam", "attn_lrp"]).sentences[0]
        assert sentence.probability == pytest.approx(alone.probability, abs=1e-5)
        for name, scores in sentence.scores.items():
            assert scores == pytest.approx(alone.scores[name], abs=1e-5), name


def test_a_classifiers_batches_are_padded_on_the_side_it_reads_them_alone(tmp_path):
    """GPT-2 on the right (its positions are absolute), XLNet on the left (it reads its last
    position), whatever side the tokenizer pads on; FNet, which mixes every position, is
    refused in one line: padded on either side, it reads another text."""
    from captum_attention.presentation.explain import classifier_inputs, classifier_padding_side

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    texts = [" ".join(WORDS[:2]), " ".join(WORDS[2:7])]
    sizes = dict(vocab_size=len(WORDS) + 5, pad_token_id=1, num_labels=2)
    torch.manual_seed(0)
    models = {
        "right": tf.GPT2ForSequenceClassification(tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **sizes)),
        "left": tf.XLNetForSequenceClassification(tf.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=48, **sizes)),
    }
    for default in ("left", "right"):
        tokenizer = tf.BertTokenizerFast(vocab=str(vocab), padding_side=default)
        for side, model in models.items():
            model.eval()
            assert classifier_padding_side(model, tokenizer, texts[0]) == side
            batch = classifier_inputs(model, tokenizer, texts)
            with torch.no_grad():
                together = model(**batch).logits
                for row, text in enumerate(texts):
                    alone = model(**tokenizer([text], return_tensors="pt")).logits
                    torch.testing.assert_close(together[row : row + 1], alone, atol=1e-5, rtol=1e-4)
    fnet = tf.FNetForSequenceClassification(tf.FNetConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=48, **sizes))
    with pytest.raises(ValueError, match="move when it is padded, by .* on the right and .* on the left: .* --batch-size 1"):
        classifier_padding_side(fnet.eval(), tokenizer, texts[0])


class _FaintlyPadded(tf.BertForSequenceClassification):
    """BERT whose logits move faintly with each column of padding: for one column by less
    than the rounding the check allows (1e-4 in probability), for five by more."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        output = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        output.logits = output.logits + 1.5e-4 * (attention_mask == 0).sum(dim=1, keepdim=True) * torch.tensor([1.0, -1.0])
        return output


def test_a_classifier_that_reads_a_batchs_padding_faintly_has_its_batches_refused(tmp_path):
    """The side is chosen on the batch's shortest text padded to its longest: BERT that reads
    the right padding faintly (and the left by its positions) is refused in one line."""
    from captum_attention.presentation.explain import classifier_inputs

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = tf.BertTokenizerFast(vocab=str(vocab))
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=len(WORDS) + 5, pad_token_id=1, num_labels=2, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=48)
    model = _FaintlyPadded(config).eval()
    texts = [" ".join(WORDS[2:12]), " ".join(WORDS[:2])]
    with pytest.raises(ValueError, match="move when it is padded, by .* on the right and .* on the left: .* --batch-size 1"):
        classifier_inputs(model, tokenizer, texts)


def test_a_killed_run_resumes_without_losing_or_repeating_rows(checkpoint, tmp_path):
    data = _data(tmp_path, 40)
    options = ["--model", str(checkpoint), "--methods", "grad_sam,integrated_gradients", "--ig-steps", "20", "--batch-size", "2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "captum_attention", "evaluate", str(data), *options]
    subprocess.run([*command, "--output", str(tmp_path / "whole")], env=environment, check=True, capture_output=True)

    done = killed_part_way([*command, "--output", str(tmp_path / "killed")], tmp_path / "killed" / "shards", 3, environment)
    assert 3 <= done < 20, "the run must be killed part way"
    assert not (tmp_path / "killed" / "results.jsonl").exists()
    resumed = subprocess.run([*command, "--output", str(tmp_path / "killed")], env=environment, check=True,
                             capture_output=True, text=True)
    assert f"resuming: {done} of 20 batches already done" in resumed.stdout
    assert (tmp_path / "killed" / "results.jsonl").read_bytes() == (tmp_path / "whole" / "results.jsonl").read_bytes()
    assert (tmp_path / "killed" / "summary.csv").read_bytes() == (tmp_path / "whole" / "summary.csv").read_bytes()


def test_two_processes_give_exactly_the_single_process_rows(checkpoint, tmp_path):
    pytest.importorskip("accelerate")
    data = _data(tmp_path, 30)
    options = ["--model", str(checkpoint), "--methods", "grad_sam,transformer_attribution,rollout", "--batch-size", "4"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    single = [sys.executable, "-m", "captum_attention", "evaluate", str(data), *options, "--output", str(tmp_path / "one")]
    subprocess.run(single, env=environment, check=True, capture_output=True)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]
    two = [*launcher, "-m", "captum_attention", "evaluate", str(data), *options, "--output", str(tmp_path / "two")]
    result = subprocess.run(two, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "two" / "results.jsonl").read_bytes() == (tmp_path / "one" / "results.jsonl").read_bytes()
    assert (tmp_path / "two" / "summary.csv").read_bytes() == (tmp_path / "one" / "summary.csv").read_bytes()
    assert len(list((tmp_path / "two" / "shards").glob("batch-*.jsonl"))) == 8


def test_csv_input_and_summary_confidence_intervals(checkpoint, tmp_path):
    data = tmp_path / "data.csv"
    data.write_text("text,label\nthe film was good,1\nthe plot was dull,0\n\"a superb, great story\",1\n")
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out"), "--methods", "rollout") == 0
    lines = (tmp_path / "out" / "summary.csv").read_text().splitlines()
    assert lines[0] == "method,metric,n,mean,low,high,best,difference,difference_low,difference_high"
    assert [line.split(",")[1] for line in lines[1:]] == [m for m in ev.metric_names() if m not in ev.rationale_metrics()]
    for line in lines[1:]:
        _, metric, n, mean, low, high, best, *difference = line.split(",")
        assert best == "rollout" and difference == ["", "", ""], "one method: the best of every metric"
        if metric != "decision_flip":
            assert int(n) == 3 and float(low) <= float(mean) <= float(high)


@pytest.mark.parametrize("name, content", [
    ("data.csv", "text,label\r\nthe film was good,1\r\nthe plot was dull,0\r\n"),  # Excel's "CSV UTF-8"
    ("data.jsonl", '{"text": "the film was good", "label": 1}\n{"text": "the plot was dull", "label": 0}\n'),
])
def test_a_byte_order_mark_is_not_part_of_the_data(tmp_path, name, content):
    """Some editors and spreadsheets write a byte-order mark first: the CSV's header was
    then not 'text' and the first JSON line not JSON; read as without it."""
    data = tmp_path / name
    data.write_bytes(b"\xef\xbb\xbf" + content.encode("utf-8"))
    examples, skipped = ev.read_dataset(data)
    assert [(e.text, e.label) for e in examples] == [("the film was good", 1), ("the plot was dull", 0)] and not skipped
    answers = tmp_path / "answers.jsonl"
    answers.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "the film", "answer": "was"}\n')
    assert [(e.text, e.answer) for e in ev.read_answers(answers)[0]] == [("the film", "was")]


def test_bootstrap_interval_is_seeded_and_covers_the_mean():
    rows = [{"method": "m", "index": v, "x": float(v)} for v in range(20)]
    first = ev.summarise(rows, ["m"], ["x"], bootstrap=500, seed=1)[0]
    assert first == ev.summarise(rows, ["m"], ["x"], bootstrap=500, seed=1)[0]
    assert first["mean"] == 9.5 and first["low"] < 9.5 < first["high"]
    assert 6.5 < first["low"] and first["high"] < 12.5  # the standard error is about 1.3


def test_paired_difference_to_the_best_sees_what_the_separate_intervals_hide():
    """b trails a by exactly 0.05 on every example: the separate intervals overlap, the
    paired one is [-0.05, -0.05]. Where a metric's lower values are better, the best is the
    lowest mean; an example without a value leaves the pairs it would be part of."""
    spread = [0.1 * k for k in range(10)]
    rows = []
    for index, value in enumerate(spread):
        rows.append({"method": "a", "index": index, "comprehensiveness": value, "sufficiency": value})
        rows.append({"method": "b", "index": index, "comprehensiveness": value - 0.05,
                     "sufficiency": None if index == 0 else value + 0.2 * (index % 2)})
    summary = ev.summarise(rows, ["a", "b"], ["comprehensiveness", "sufficiency"], bootstrap=400, seed=3)
    cell = {(e["method"], e["metric"]): e for e in summary}
    a, b = cell["a", "comprehensiveness"], cell["b", "comprehensiveness"]
    assert b["low"] < a["mean"] < b["high"], "the separate intervals overlap"
    assert a["best"] == b["best"] == "a" and a["difference"] is None
    assert b["difference"]["n"] == 10
    assert b["difference"]["mean"] == pytest.approx(-0.05) and b["difference"]["low"] == pytest.approx(-0.05)
    assert b["difference"]["high"] == pytest.approx(-0.05)
    suff_a, suff_b = cell["a", "sufficiency"], cell["b", "sufficiency"]
    assert suff_a["best"] == "a" and suff_b["n"] == 9 and suff_b["difference"]["n"] == 9
    odd = [0.2 * (index % 2) for index in range(1, 10)]
    assert suff_b["difference"]["mean"] == pytest.approx(sum(odd) / 9)
    assert 0 <= suff_b["difference"]["low"] < suff_b["difference"]["mean"] < suff_b["difference"]["high"] <= 0.2
    markdown = ev.summary_markdown(summary, ["comprehensiveness", "sufficiency"])
    assert "| method | comprehensiveness ↑ − best | sufficiency ↓ − best |" in markdown
    assert "| a | best | best |" in markdown and "| b | -0.050 [-0.050, -0.050] | +0.111 [" in markdown
    assert ev.summarise(rows, ["a", "b"], ["comprehensiveness", "sufficiency"], bootstrap=400, seed=3) == summary


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ("", ".jsonl", "has no example"),
        ('{"text": "good film"}\n{"text": \n', ".jsonl", "line 2: not JSON"),
        ('{"text": ""}\n', ".jsonl", "line 1: 'text' is missing or empty"),
        ('{"text": "good", "label": [1]}\n', ".jsonl", "line 1: 'label' must be a class index or a label's name"),
        ('{"text": "good", "label": "positive"}\n', ".jsonl", "line 1: 'label' 'positive' is not a label of this model (labels: 0=LABEL_0"),
        ("text,label\ngood,2\n", ".csv", "line 2: 'label' '2' is not a label of this model"),
        ('{"text": "good", "rationale": "good"}\n', ".jsonl", "line 1: 'rationale' must be a list of words"),
        ("sentence,label\ngood,1\n", ".csv", "header row with a 'text' column"),
        ("good film\n", ".txt", "give a .jsonl or .csv file"),
    ],
)
def test_bad_data_gets_one_clear_line(checkpoint, tmp_path, capsys, content, suffix, message):
    data = tmp_path / f"data{suffix}"
    data.write_text(content)
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out")) == 1
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists(), "nothing is written before the input is checked"


def test_labels_by_name_or_index_are_the_models_class_indices(checkpoint, tmp_path, capsys):
    """A label may name one of the model's labels, in any case (IMDB's CSVs say
    "positive"), or be its index, also as 1.0 (pandas' int column with gaps): each row holds
    the index; one the model does not have is skipped with --skip-malformed."""
    data = tmp_path / "data.jsonl"
    rows = [{"text": "good film", "label": "label_1"}, {"text": "dull plot", "label": "LABEL_0"}, {"text": "a film", "label": 1.0},
            {"text": "the plot", "label": "1"}, {"text": "the acting", "label": "neutral"}, {"text": "great story"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out"), "--methods", "raw", "--skip-malformed") == 0
    assert "skipped " + str(data) + ", line 5: 'label' 'neutral' is not a label of this model" in capsys.readouterr().err
    assert sorted((r["line"], r["label"]) for r in _rows(tmp_path / "out")) == [(1, 1), (2, 0), (3, 1), (4, 1), (6, None)]


def test_malformed_rows_can_be_skipped(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "good film", "label": 1}\nnot json\n{"text": "dull plot", "label": 0}\n')
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out"), "--methods", "raw",
                "--skip-malformed") == 0
    assert "skipped" in capsys.readouterr().err
    assert [(r["index"], r["line"]) for r in _rows(tmp_path / "out")] == [(0, 1), (1, 3)]


def test_unknown_methods_metrics_and_missing_rationales_are_refused(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "good film"}\n')
    base = [str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out")]
    assert _run(*base, "--methods", "gradsam") == 1
    assert "unknown method 'gradsam'" in capsys.readouterr().err
    assert _run(*base, "--metrics", "aopc2") == 1
    assert "unknown metric 'aopc2'" in capsys.readouterr().err
    assert _run(*base, "--methods", "raw,lime,shapley") == 1
    assert "unknown methods 'lime', 'shapley'; choose from grad_sam" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^no method given; choose from grad_sam"):
        ev.check_request([], ["comprehensiveness"], [])
    assert _run(*base, "--metrics", "token_f1") == 1
    assert "need a 'rationale' on every row; line 1 has none" in capsys.readouterr().err


def test_throughput_benchmark_runs(checkpoint):
    script = Path(__file__).parent.parent / "benchmarks" / "evaluate_throughput.py"
    rates = runpy.run_path(str(script))["main"](["--model", str(checkpoint), "--examples", "6", "--methods", "raw", "--processes", "1"])
    assert set(rates) == {1} and rates[1] > 0


@pytest.mark.skipif(not os.environ.get("FERRET_PYTHON"), reason="needs a ferret-xai environment: set FERRET_PYTHON")
def test_ferret_side_by_side_runs(checkpoint):
    script = Path(__file__).parent.parent / "benchmarks" / "ferret_side_by_side.py"
    rates = runpy.run_path(str(script))["main"](["--model", str(checkpoint), "--examples", "2"])
    assert len(rates) == 4 and min(rates.values()) > 0


def test_smoothgrad_and_shap_rows_are_reproducible(checkpoint, tmp_path):
    data = _data(tmp_path, 5)
    base = [str(data), "--model", str(checkpoint), "--methods", "smoothgrad,shap", "--shap-evals", "40",
            "--metrics", "comprehensiveness,token_f1"]
    for output in ("a", "again"):
        assert _run(*base, "--output", str(tmp_path / output)) == 0
    assert _run(*base, "--output", str(tmp_path / "other"), "--batch-size", "2") == 0
    first = _rows(tmp_path / "a")
    assert [(r["index"], r["method"]) for r in first] == [(i, m) for i in range(5) for m in ("smoothgrad", "shap")]
    assert all(r["comprehensiveness"] is not None and r["token_f1"] is not None for r in first)
    assert first == _rows(tmp_path / "again")
    for one, other in zip(first, _rows(tmp_path / "other")):  # each text explained alone: the batches do not matter
        assert one["comprehensiveness"] == pytest.approx(other["comprehensiveness"], abs=1e-5)


def test_smoothgrad_explains_each_text_alone_with_its_own_noise(checkpoint, tmp_path):
    """In a padded batch, each text's SmoothGrad scores are NoiseTunnel over Saliency on
    it alone: σ = 0.1 · its embeddings' spread, the noise seeded by the CRC-32 of its ids."""
    from captum.attr import NoiseTunnel, Saliency

    model = tf.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(checkpoint)
    texts = [e.text for e in ev.read_dataset(_data(tmp_path, 3))[0]]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    assert not bool(mask.all()), "a padded batch"
    targets = torch.tensor([0, 1, 1])
    state = torch.random.get_rng_state()
    scores = ev._smoothgrad(model, 4)(ids, mask, targets, texts)
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's random state is left as it was"
    tunnel = NoiseTunnel(Saliency(lambda e, m: model(inputs_embeds=e, attention_mask=m).logits))
    for row in range(3):
        length = int(mask[row].sum())
        embeddings = model.get_input_embeddings()(ids[row : row + 1, :length]).detach()
        torch.manual_seed(zlib.crc32(ids[row, :length].numpy().astype("int64").tobytes(), 0))
        expected = tunnel.attribute(embeddings, nt_type="smoothgrad", nt_samples=4, stdevs=0.1 * float(embeddings.std()),
                                    target=targets[row : row + 1], additional_forward_args=(mask[row : row + 1, :length],))
        torch.testing.assert_close(scores[row, :length], expected[0].sum(dim=-1))
        assert not scores[row, length:].any()


def _assert_comprehensiveness_rows(checkpoint: Path, data: Path, rows: list[dict], scorers: dict[str, Callable[..., Any]]) -> None:
    """Each method's row of each example holds the comprehensiveness of
    ``scorers[method](forward, model, ids, mask, predicted, keep)`` on that example alone."""
    model = tf.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(checkpoint)
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    for example in ev.read_dataset(data)[0]:
        encoded = tokenizer([example.text], return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        predicted, keep = forward(ids, mask).argmax(-1), torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
        for method, scored in scorers.items():
            scores = scored(forward, model, ids, mask, predicted, keep)
            row = next(r for r in rows if r["index"] == example.index and r["method"] == method)
            expected = aopc(comprehensiveness(forward, ids, mask, scores, predicted, keep=keep)).item()
            assert row["comprehensiveness"] == pytest.approx(expected, abs=1e-5)


def test_attn_lrp_at_a_presence_rows_are_its_scores_metrics(checkpoint, tmp_path, capsys):
    """``attn_lrp_presence``: AttnLRP with the words at ``--presence`` and [CLS]/[SEP] at 1;
    its rows are the metrics of those scores, not of AttnLRP's own; a presence outside
    (0, 1] is one line."""
    from captum_attention import AttnLRP

    data, output = _data(tmp_path, 6), tmp_path / "out"
    args = [str(data), "--model", str(checkpoint), "--methods", "attn_lrp,attn_lrp_presence", "--metrics", "comprehensiveness"]
    assert _run(*args, "--presence", "0.1", "--output", str(output)) == 0
    rows = _rows(output)
    _assert_comprehensiveness_rows(checkpoint, data, rows, {
        "attn_lrp": lambda forward, model, ids, mask, predicted, keep: AttnLRP(forward, model=model).attribute(
            ids, target=predicted, additional_forward_args=(mask,)),
        "attn_lrp_presence": lambda forward, model, ids, mask, predicted, keep: AttnLRP(forward, model=model).attribute(
            ids, target=predicted, additional_forward_args=(mask,), presence=torch.where(keep, 1.0, 0.1)),
    })
    by_method = {m: [r["comprehensiveness"] for r in rows if r["method"] == m] for m in ("attn_lrp", "attn_lrp_presence")}
    assert by_method["attn_lrp"] != by_method["attn_lrp_presence"], "the presence changes the scores"
    capsys.readouterr()
    assert _run(*args, "--presence", "0", "--output", str(tmp_path / "zero")) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "--presence must lie in (0, 1]" in error


@pytest.mark.parametrize("method, refine", [("attn_lrp_presence_calibrated", "calibrated_attribution"), ("attn_lrp_presence_greedy", "greedy_deletion")])
def test_refined_presence_rows_are_its_scores_metrics(checkpoint, tmp_path, monkeypatch, method, refine):
    """``attn_lrp_presence_calibrated`` and ``attn_lrp_presence_greedy``: AttnLRP at
    ``--presence`` refined on 8 removals by ``calibrated_attribution`` (random halves) or
    ``greedy_deletion``, the special tokens kept. Each example's removals are its own, so
    its rows equal the scores computed on it alone, whatever batch it came in; the
    presence's own row shares its backward, one a batch."""
    from captum_attention import AttnLRP, metrics
    from captum_attention.attr import attn_lrp

    presence_calls = []
    attribute = attn_lrp.AttnLRP.attribute
    monkeypatch.setattr(attn_lrp.AttnLRP, "attribute", lambda self, *a, **k: presence_calls.append(1) or attribute(self, *a, **k))
    data, output = _data(tmp_path, 6), tmp_path / "out"
    args = [str(data), "--model", str(checkpoint), "--methods", f"attn_lrp_presence,{method}",
            "--metrics", "comprehensiveness", "--batch-size", "4", "--presence", "0.1", "--output", str(output)]
    assert _run(*args) == 0
    assert len(presence_calls) == 2, "one presence backward for each of the two batches"
    monkeypatch.undo()
    rows = _rows(output)

    def refined(forward, model, ids, mask, predicted, keep):
        prior = AttnLRP(forward, model=model).attribute(
            ids, target=predicted, additional_forward_args=(mask,), presence=torch.where(keep, 1.0, 0.1))
        return getattr(metrics, refine)(forward, ids, mask, prior, predicted, keep=keep)

    _assert_comprehensiveness_rows(checkpoint, data, rows, {method: refined})
    by_method = {m: [r["comprehensiveness"] for r in rows if r["method"] == m] for m in ("attn_lrp_presence", method)}
    assert by_method["attn_lrp_presence"] != by_method[method], "the removals change the scores"


def test_half_contexts_rows_are_context_averaged_attributions_metrics(checkpoint, tmp_path, monkeypatch):
    """``attn_lrp_half_contexts``: AttnLRP at ``--presence`` beside AttnLRP in 8 random half
    contexts of the words (``context_averaged_attribution``, the special tokens kept), each
    example's contexts its own, so its rows equal the scores computed on it alone; one
    presence backward a batch, one call a context and one more (the first context with as
    much padding again: the check that padding leaves its scores alone)."""
    from captum_attention import AttnLRP, metrics
    from captum_attention.attr import attn_lrp

    calls = []
    attribute = attn_lrp.AttnLRP.attribute
    monkeypatch.setattr(attn_lrp.AttnLRP, "attribute", lambda self, *a, **k: calls.append("presence" in k) or attribute(self, *a, **k))
    data, output = _data(tmp_path, 6), tmp_path / "out"
    args = [str(data), "--model", str(checkpoint), "--methods", "attn_lrp_presence,attn_lrp_half_contexts",
            "--metrics", "comprehensiveness", "--batch-size", "4", "--presence", "0.1", "--output", str(output)]
    assert _run(*args) == 0
    assert sorted(calls) == [False] * 18 + [True] * 2, "8 contexts, the check and one presence backward for each of the two batches"
    monkeypatch.undo()
    rows = _rows(output)

    def in_half_contexts(forward, model, ids, mask, predicted, keep):
        lrp = AttnLRP(forward, model=model)
        prior = lrp.attribute(ids, target=predicted, additional_forward_args=(mask,), presence=torch.where(keep, 1.0, 0.1))
        in_context = lambda i, m: lrp.attribute(i, target=predicted, additional_forward_args=(m,))  # noqa: E731
        return metrics.context_averaged_attribution(in_context, ids, mask, prior, keep=keep)

    _assert_comprehensiveness_rows(checkpoint, data, rows, {"attn_lrp_half_contexts": in_half_contexts})
    by_method = {m: [r["comprehensiveness"] for r in rows if r["method"] == m] for m in ("attn_lrp_presence", "attn_lrp_half_contexts")}
    assert by_method["attn_lrp_presence"] != by_method["attn_lrp_half_contexts"], "the contexts change the scores"


def test_a_registered_method_outside_the_defaults_is_its_own_metrics(checkpoint, tmp_path, capsys):
    """``--methods`` takes any registered method: DecompX's and ALTI's rows are the metrics
    of their scores computed directly; ALTI-Logit (a next-token logit) is refused in one
    line before any work; Learned Attention's head weights belong to the run."""
    from captum_attention import HeadWeights
    from captum_attention.attr import REGISTRY

    data, output = _data(tmp_path, 4), tmp_path / "out"
    args = [str(data), "--model", str(checkpoint), "--methods", "decompx,alti", "--metrics", "comprehensiveness"]
    assert _run(*args, "--output", str(output)) == 0
    _assert_comprehensiveness_rows(checkpoint, data, _rows(output), {
        method: lambda forward, model, ids, mask, predicted, keep, cls=REGISTRY[method]: cls(forward, model=model).attribute(
            ids, target=predicted, additional_forward_args=(mask,))
        for method in ("decompx", "alti")
    })
    capsys.readouterr()
    assert _run(str(data), "--model", str(checkpoint), "--methods", "alti_logit", "--output", str(tmp_path / "logit")) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "alti_logit explains a language model's next-token logit, not a classifier's" in error
    assert not (tmp_path / "logit").exists(), "refused before any work"
    folder = tmp_path / "classifier"
    shutil.copytree(checkpoint, folder)
    learned = [str(data), "--model", str(folder), "--methods", "learned_attention", "--output", str(tmp_path / "learned")]
    assert _run(*learned) == 0
    assert "learned_attention weighs every layer and head alike" in capsys.readouterr().err
    HeadWeights(torch.rand(2, 4, generator=torch.Generator().manual_seed(0)), {}).save(folder)
    assert _run(*learned) == 1
    assert "head_weights: uniform there" in capsys.readouterr().err, "the fitted weights make another run"


@pytest.mark.parametrize(
    "change, named",
    [
        (["--methods", "grad_sam"], "methods: grad_sam,raw there, grad_sam now"),
        (["--batch-size", "3"], "batch_size: 4 there, 3 now"),
        (["--data", "other"], "data: "),
    ],
)
def test_a_rerun_into_the_same_output_resumes_only_the_same_run(checkpoint, tmp_path, capsys, change, named):
    data, output = _data(tmp_path, count=6), tmp_path / "out"
    args = ["--model", str(checkpoint), "--output", str(output), "--metrics", "token_f1"]
    assert _run(str(data), *args, "--methods", "grad_sam,raw", "--batch-size", "4") == 0
    first = (output / "results.jsonl").read_text()
    if change[0] == "--data":
        other = tmp_path / "other"
        other.mkdir()
        rerun = [str(_data(other, count=5)), *args, "--methods", "grad_sam,raw", "--batch-size", "4"]
    else:
        rerun = [str(data), *args, *(["--methods", "grad_sam,raw"] if change[0] != "--methods" else []), *change]
        rerun += [] if change[0] == "--batch-size" else ["--batch-size", "4"]
    capsys.readouterr()
    assert _run(*rerun) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and named in error and "name a new --output" in error
    assert (output / "results.jsonl").read_text() == first, "the earlier run's results stay as they were"
    assert _run(str(data), *args, "--methods", "grad_sam,raw", "--batch-size", "4") == 0
    assert "resuming: 2 of 2 batches" in capsys.readouterr().out


def test_rows_of_an_earlier_kind_are_not_resumed_into(checkpoint, tmp_path, capsys):
    data, output = _data(tmp_path, count=6), tmp_path / "out"
    args = [str(data), "--model", str(checkpoint), "--output", str(output), "--methods", "raw", "--metrics", "datamodeling"]
    assert _run(*args) == 0
    manifest = output / "manifest.json"
    recorded = json.loads(manifest.read_text())
    assert recorded["rows_version"] == ev.ROWS_VERSION
    del recorded["rows_version"]
    manifest.write_text(json.dumps(recorded))
    capsys.readouterr()
    assert _run(*args) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"rows_version: None there, {ev.ROWS_VERSION} now" in error


def test_a_model_trained_again_into_the_same_folder_is_another_run(checkpoint, tmp_path, capsys):
    folder, data, output = tmp_path / "classifier", _data(tmp_path, count=6), tmp_path / "out"
    shutil.copytree(checkpoint, folder)
    args = [str(data), "--model", str(folder), "--output", str(output), "--methods", "raw", "--metrics", "token_f1"]
    assert _run(*args) == 0
    first = (output / "results.jsonl").read_text()
    model = tf.AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 1e-3)
    model.save_pretrained(folder)
    capsys.readouterr()
    assert _run(*args) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "model: " in error and "name a new --output" in error
    assert (output / "results.jsonl").read_text() == first


def test_a_tokenizer_saved_again_is_another_run_and_a_report_written_beside_it_is_not(checkpoint, tmp_path, capsys):
    folder, data, output = tmp_path / "classifier", _data(tmp_path, count=6), tmp_path / "out"
    shutil.copytree(checkpoint, folder)
    args = [str(data), "--model", str(folder), "--output", str(output), "--methods", "raw", "--metrics", "token_f1"]
    assert _run(*args) == 0
    (folder / "report.html").write_text("<p>an explanation written into the model's folder</p>")
    capsys.readouterr()
    assert _run(*args) == 0 and "resuming: " in capsys.readouterr().out
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = 6  # reads fewer tokens of each text
    tokenizer.save_pretrained(folder)
    assert _run(*args) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "model: " in error and "name a new --output" in error


def test_the_weights_digest_reads_the_values_not_the_device_or_the_object():
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20)
    model = tf.BertModel(config).eval()
    same = tf.BertModel(config).eval()
    same.load_state_dict(model.state_dict())
    assert weights_digest(same) == weights_digest(model)
    with torch.no_grad():
        same.encoder.layer[0].output.dense.weight.mul_(1.0001)
    assert weights_digest(same) != weights_digest(model), "one tensor trained again"
    same.load_state_dict(model.state_dict())
    assert weights_digest(same.to(torch.bfloat16)) != weights_digest(model), "cast"
    assert weights_digest(torch.compile(model)) == weights_digest(model), "compiled: the same weights"
    with torch.device("meta"):
        offloaded = tf.BertModel(config)
    assert len(weights_digest(offloaded)) == 64


def test_a_run_names_weights_offloaded_whose_values_it_could_not_read():
    """A resume refused because other weights are offloaded says why, not only that the
    digests differ."""
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20)
    model = tf.BertModel(config).eval()
    assert "offloaded" not in ev.model_identity(model)
    dense = model.encoder.layer[0].output.dense
    dense.weight = torch.nn.Parameter(torch.empty_like(dense.weight, device="meta"))
    assert "(some offloaded, their values unread)" in ev.model_identity(model)


def test_a_row_with_no_token_to_rank_is_refused_before_any_work_or_skipped(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "good film"}\n{"text": "\U0001f642"}\n{"text": "dull plot"}\n')
    output = tmp_path / "out"
    base = [str(data), "--model", str(checkpoint), "--output", str(output), "--methods", "raw", "--metrics", "comprehensiveness"]
    assert _run(*base) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "line 2: no token to rank" in error and "--skip-malformed" in error
    assert not (output / "shards").exists(), "refused before any work"
    assert _run(*base, "--skip-malformed") == 0
    assert "skipped" in capsys.readouterr().err
    assert [(r["index"], r["line"]) for r in _rows(output)] == [(0, 1), (2, 3)]


def test_a_lone_surrogate_is_one_line_naming_its_row(checkpoint, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "good film"}\n{"text": "\\ud800 film"}\n')
    assert _run(str(data), "--model", str(checkpoint), "--output", str(tmp_path / "out")) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "line 2: 'text' holds a lone surrogate" in error


def test_ctrl_c_prints_one_line_and_the_rerun_resumes(checkpoint, tmp_path):
    data = _data(tmp_path, 400)  # 200 batches: seconds for the interrupt to land, even on a fast machine
    options = ["--model", str(checkpoint), "--methods", "grad_sam,integrated_gradients", "--ig-steps", "20", "--batch-size", "2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "captum_attention", "evaluate", str(data), *options, "--output", str(tmp_path / "out")]
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    shards = tmp_path / "out" / "shards"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(shards.glob("batch-*.jsonl"))) < 2:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    done = len(list(shards.glob("batch-*.jsonl")))
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1].split("\r")[-1]
    assert last == f"captum-attention: interrupted after {done} of 200 batches; rerun the same command to resume"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_whose_interrupt_python_swallowed_still_stops_the_run_after_its_batch(tmp_path):
    def rows_of(unit: int) -> list[dict]:
        if unit == 1:
            SwallowsCtrlC()
        return [{"unit": unit}]

    with pytest.raises(ev.EvaluationInterrupted) as stopped:
        ev.sharded(tmp_path, {"run": 1}, list(range(5)), rows_of, 0, 1, None, None)
    assert (stopped.value.done, stopped.value.total) == (2, 5)
    assert ev.sharded(tmp_path, {"run": 1}, list(range(5)), lambda unit: [{"unit": unit}], 0, 1, None, None) == 3


def test_output_defaults_to_a_folder_named_after_the_data(checkpoint, tmp_path, monkeypatch):
    data = _data(tmp_path, 4)
    monkeypatch.chdir(tmp_path)
    assert _run(str(data), "--model", str(checkpoint), "--methods", "raw", "--metrics", "comprehensiveness") == 0
    assert (tmp_path / f"{data.stem}_evaluation" / "results.jsonl").exists()


def test_a_launcher_that_started_fewer_processes_than_asked_is_named(checkpoint, tmp_path):
    pytest.importorskip("accelerate")
    data = _data(tmp_path, 4)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no"]
    command = [*launcher, "-m", "captum_attention", "evaluate", str(data), "--model", str(checkpoint),
               "--methods", "raw", "--metrics", "comprehensiveness", "--output", str(tmp_path / "out")]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "accelerate launch was asked for 2 processes but started 1: add --multi_gpu" in result.stderr


def _pair_types(ids: torch.Tensor, mask: torch.Tensor, separator: int) -> torch.Tensor:
    """Token type 1 from after each row's first separator on, written out row by row."""
    types = torch.zeros_like(ids)
    for row in range(len(ids)):
        positions = (ids[row] == separator).nonzero().flatten().tolist()
        if positions:
            types[row, positions[0] + 1 :] = 1
    return types * mask


def test_text_pairs_rows_are_the_metrics_of_each_pair_alone(checkpoint, tmp_path, capsys):
    """Rows with a ``text_pair`` (beside rows without one) are explained as the tokenizer
    pairs them, token types included, and the token removals keep each token's type; a
    rationale may name words of either text; SHAP, which masks one text, is refused."""
    from captum.attr import NoiseTunnel, Saliency

    data = tmp_path / "pairs.jsonl"
    rows = [{"text": "the film was dull", "text_pair": "the story is great", "rationale": ["great"]},
            {"text": "a good plot", "text_pair": "not bad", "rationale": ["good", "bad"]},
            {"text": "awful acting", "rationale": ["awful"]}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = [str(data), "--model", str(checkpoint), "--metrics", "comprehensiveness,token_f1", "--batch-size", "2"]
    assert _run(*args, "--methods", "grad_sam,smoothgrad", "--output", str(tmp_path / "out")) == 0
    written = _rows(tmp_path / "out")

    model = tf.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(checkpoint)

    def forward(ids, mask):
        return model(input_ids=ids, attention_mask=mask, token_type_ids=_pair_types(ids, mask, tokenizer.sep_token_id)).logits

    tunnel = NoiseTunnel(Saliency(lambda e, m, t: model(inputs_embeds=e, attention_mask=m, token_type_ids=t).logits))
    for index, row in enumerate(rows):
        encoded = tokenizer(row["text"], row.get("text_pair"), return_tensors="pt")
        ids, mask, types = encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]
        assert torch.equal(_pair_types(ids, mask, tokenizer.sep_token_id), types)
        probabilities = forward(ids, mask).detach().softmax(-1)
        predicted, keep = probabilities.argmax(-1), torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
        embeddings = model.get_input_embeddings()(ids).detach()
        torch.manual_seed(zlib.crc32(ids[0].numpy().astype("int64").tobytes(), 0))
        scores = {
            "grad_sam": GradSAM(forward, model=model).attribute(ids, target=predicted, additional_forward_args=(mask,)),
            "smoothgrad": tunnel.attribute(embeddings, nt_type="smoothgrad", nt_samples=10, stdevs=0.1 * float(embeddings.std()),
                                           target=predicted, additional_forward_args=(mask, types)).sum(-1),
        }
        words = tokenizer.convert_ids_to_tokens(ids[0].tolist())
        rationale = torch.tensor([[word in row["rationale"] for word in words]])
        for method, scored in scores.items():
            got = next(r for r in written if r["index"] == index and r["method"] == method)
            assert got["probability"] == pytest.approx(float(probabilities.max()), abs=1e-5)
            expected = aopc(comprehensiveness(forward, ids, mask, scored, predicted, keep=keep)).item()
            assert got["comprehensiveness"] == pytest.approx(expected, abs=1e-5)
            assert got["token_f1"] == pytest.approx(token_f1(scored, rationale, (mask == 1) & ~keep).item(), abs=1e-6)
    capsys.readouterr()
    assert _run(*args, "--methods", "grad_sam,shap", "--output", str(tmp_path / "shap")) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "shap masks one text and line 1 holds a pair" in error


def test_a_one_logit_classifier_is_scored_by_its_sigmoid_and_others_refused(tmp_path, capsys):
    """One logit (a binary classifier or reward model): its rows' probabilities and metrics
    read its sigmoid, as transformers' pipelines read it (a softmax over one logit is
    always 1, every metric 0); a regression or multi-label model, whose outputs are no
    class probabilities, is refused in one line before any work."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    sizes = dict(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                 max_position_embeddings=64, initializer_range=0.3)
    folders = {}
    for name, config in (("one", dict(num_labels=1)), ("regression", dict(num_labels=1, problem_type="regression")),
                         ("multi", dict(num_labels=3, problem_type="multi_label_classification"))):
        torch.manual_seed(0)
        folders[name] = tmp_path / name
        tf.BertForSequenceClassification(tf.BertConfig(**sizes, **config)).save_pretrained(folders[name])
        tf.BertTokenizerFast(vocab=str(vocab)).save_pretrained(folders[name])
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("the film was good", "a dull plot", "great acting")))
    assert _run(str(data), "--model", str(folders["one"]), "--methods", "grad_sam", "--metrics", "comprehensiveness",
                "--output", str(tmp_path / "out")) == 0
    model = tf.BertForSequenceClassification.from_pretrained(folders["one"]).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(folders["one"])
    as_two_classes = lambda ids, mask: torch.cat([model(input_ids=ids, attention_mask=mask).logits, torch.zeros(len(ids), 1)], -1)  # noqa: E731
    for example in ev.read_dataset(data)[0]:
        encoded = tokenizer([example.text], return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        keep = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
        scores = GradSAM(model).attribute(ids, target=0, additional_forward_args=(mask,))
        row = next(r for r in _rows(tmp_path / "out") if r["index"] == example.index)
        assert row["predicted"] == 0
        assert row["probability"] == pytest.approx(float(model(**encoded).logits.detach().sigmoid()), abs=1e-6)
        expected = aopc(comprehensiveness(as_two_classes, ids, mask, scores, 0, keep=keep)).item()
        assert row["comprehensiveness"] == pytest.approx(expected, abs=1e-6) and expected != 0
    capsys.readouterr()
    for name, says in (("regression", "a regression model's scores are no probabilities"),
                       ("multi", "a multi-label model's labels each have their own sigmoid")):
        assert _run(str(data), "--model", str(folders[name]), "--methods", "grad_sam", "--output", str(tmp_path / name / "out")) == 1
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and says in error and "problem_type" in error
        assert not (tmp_path / name / "out").exists()
