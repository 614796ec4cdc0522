"""``captum-attention fit-head-weights answers.jsonl --model DIR``: Learned Attention's head
weights fitted on a file of answers, equal to ``HeadWeights.fit`` on the same rows, saved
into the model's folder where ``explain`` and ``evaluate`` read them; an interrupted fit
resumes to the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from captum.attr import TextTokenInput

from captum_attention import HeadWeights, LearnedAttention, LLMAttentionAttribution
from captum_attention.loading import load_causal_lm
from captum_attention.metrics import head_weights
from captum_attention.presentation.cli import main

PROMPT = "the secret code is seven . what is the code ?"
SEGMENTS = ["the cat sat ", "on the mat . ", "where is the cat ?"]
ABLATIONS = 4


def _data(folder: Path) -> Path:
    """Three rows: a given answer, a generated one, and segments with a generated answer."""
    path = folder / "answers.jsonl"
    rows = [{"prompt": PROMPT, "answer": "seven"}, {"prompt": "the dog ran in the river . who ran ?"}, {"segments": SEGMENTS}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _expected(folder: Path) -> HeadWeights:
    """``HeadWeights.fit`` on the three rows built by hand: BOS never removed; the first two
    rows' prompt tokens each their own segment, the third's words in their segments."""
    model, tokenizer = load_causal_lm(folder)
    examples = []
    for text, answer in ((PROMPT, "seven"), ("the dog ran in the river . who ran ?", None), ("".join(SEGMENTS), None)):
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if answer is None:
            with torch.no_grad():
                generated = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=20, do_sample=False)
            answer_ids = generated[0, len(ids):]
        else:
            answer_ids = torch.tensor(tokenizer(answer, add_special_tokens=False).input_ids)
        if text == "".join(SEGMENTS):
            segments = torch.tensor([-1] + [k for k, segment in enumerate(SEGMENTS) for _ in segment.split()])
        else:
            segments = torch.cat([torch.tensor([-1]), torch.arange(1, len(ids))])
        examples.append((ids, answer_ids, segments))
    return HeadWeights.fit(model, examples, num_ablations=ABLATIONS, progress=False)


@pytest.fixture
def folder(llm, tmp_path) -> Path:
    copy = tmp_path / "llama"
    shutil.copytree(llm, copy)
    return copy


def test_the_fit_is_head_weights_fit_on_the_rows_and_explain_reads_it(folder, tmp_path, capsys):
    data = _data(tmp_path)
    assert main(["fit-head-weights", str(data), "--model", str(folder), "--ablations", str(ABLATIONS)]) == 0
    out = capsys.readouterr().out
    assert f"fitted on 3 answers, {ABLATIONS} ablations each) written to {folder / head_weights.WEIGHTS_FILE}" in out
    saved = HeadWeights.load(folder)
    torch.testing.assert_close(saved.weights, _expected(folder).weights, rtol=1e-6, atol=1e-7)
    assert not list(folder.glob("*.partial.safetensors")), "the checkpoint goes once the fit is saved"
    report = tmp_path / "learned.json"
    assert main(["explain", "--model", str(folder), PROMPT, "--target", "seven", "--methods", "learned_attention",
                 "--json", str(report)]) == 0
    assert "no head weights" not in capsys.readouterr().err
    model, tokenizer = load_causal_lm(folder)
    expected = LLMAttentionAttribution(LearnedAttention(model, weights=saved), tokenizer).attribute(
        TextTokenInput(PROMPT, tokenizer), target="seven"
    )
    written = json.loads(report.read_text(encoding="utf-8"))
    torch.testing.assert_close(torch.tensor(written["seq_attr"]["Learned Attention"]), expected.seq_attr)
    assert bool((saved.weights < 0).any()) and written["methods"]["Learned Attention"]["signed"], "a fit's scores take both signs"


def test_an_interrupted_fit_resumes_to_the_same_weights(folder, tmp_path, capsys, monkeypatch):
    data = _data(tmp_path)
    statistics, calls = head_weights._example_statistics, []

    def interrupted_at_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return statistics(*args, **kwargs)

    monkeypatch.setattr(head_weights, "_example_statistics", interrupted_at_the_second)
    command = ["fit-head-weights", str(data), "--model", str(folder), "--ablations", str(ABLATIONS)]
    assert main(command) == 130
    assert "interrupted; rerun the same command to resume the fit" in capsys.readouterr().err
    assert len(list(folder.glob("*.partial.safetensors"))) == 1 and not (folder / head_weights.WEIGHTS_FILE).exists()
    assert main(command) == 0
    assert len(calls) == 4, "the rerun sums the two answers the checkpoint lacks"
    torch.testing.assert_close(HeadWeights.load(folder).weights, _expected(folder).weights, rtol=1e-6, atol=1e-7)


def test_what_it_cannot_fit_is_refused_in_one_line(folder, seq2seq, tmp_path, capsys):
    data = _data(tmp_path)
    assert main(["fit-head-weights", str(data), "--model", str(seq2seq)]) == 1
    refusal = capsys.readouterr().err
    assert "fit-head-weights takes a decoder-only language model" in refusal and "holds a sequence-to-sequence model" in refusal
    assert main(["fit-head-weights", str(data), "--model", str(folder), "--ablations", "1"]) == 1
    assert "--ablations must be at least 2" in capsys.readouterr().err
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    pictured = tmp_path / "pictured.jsonl"
    pictured.write_text(json.dumps({"prompt": "the cat", "image": "cat.png"}) + "\n")
    assert main(["fit-head-weights", str(pictured), "--model", str(folder)]) == 1
    assert "rows name an 'image' (line 1)" in capsys.readouterr().err


def test_an_answer_with_no_tokens_is_named_by_its_line_in_the_fit_and_in_evaluate(folder, tmp_path, capsys, monkeypatch):
    from captum_attention.presentation import evaluate

    monkeypatch.setattr(evaluate, "_answer_ids", lambda *args: torch.zeros(0, dtype=torch.long))
    message = "line 1: the answer has no tokens (the model ended its answer at once): give the row an answer"
    assert main(["fit-head-weights", str(_data(tmp_path)), "--model", str(folder)]) == 1
    assert message in capsys.readouterr().err
    assert main(["evaluate", str(_data(tmp_path)), "--model", str(folder), "--methods", "raw", "--output", str(tmp_path / "out")]) == 1
    assert message in capsys.readouterr().err, "evaluate reads its rows through the same helper"


def test_head_weights_beside_a_model_trained_again_are_refused(folder, tmp_path, capsys):
    assert main(["fit-head-weights", str(_data(tmp_path)), "--model", str(folder), "--ablations", str(ABLATIONS)]) == 0
    model, _ = load_causal_lm(folder)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.001)
    model.save_pretrained(folder)
    capsys.readouterr()
    explain = ["explain", "--model", str(folder), PROMPT, "--target", "seven", "--methods", "learned_attention"]
    assert main(explain) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "fitted to another model" in error and "fit-head-weights" in error
    answers = tmp_path / "one.jsonl"
    answers.write_text(json.dumps({"prompt": PROMPT, "answer": "seven"}) + "\n", encoding="utf-8")
    output = tmp_path / "evaluation"
    evaluate = ["evaluate", str(answers), "--model", str(folder), "--methods", "learned_attention", "--output", str(output)]
    assert main(evaluate) == 1
    assert "fitted to another model" in capsys.readouterr().err
    assert not (output / "shards").exists(), "refused before any work"
