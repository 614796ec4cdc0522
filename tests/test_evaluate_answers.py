"""``captum-attention evaluate --model <causal LM> answers.jsonl``: each row's answer
(given or generated) explained over its prompt by every method and scored by the context
metrics; rows checked against the metrics computed directly; a killed run resumed, and two
processes (gloo, through Accelerate), give exactly the rows of one uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from conftest import killed_part_way
from lm_models import WORDS

from captum_attention import GradSAM
from captum_attention.metrics import linear_datamodeling_score, top_k_log_prob_drop
from captum_attention.presentation.cli import main
from captum_attention.presentation.dataset import DatasetError, read_answers


def _data(folder, count: int = 6):
    generator = torch.Generator().manual_seed(5)
    path = folder / "answers.jsonl"
    with path.open("w") as file:
        for row in range(count):
            words = [WORDS[int(i)] for i in torch.randint(3, len(WORDS), (int(torch.randint(4, 9, (1,), generator=generator)),), generator=generator)]
            if row % 3 == 0:
                file.write(json.dumps({"prompt": " ".join(words), "answer": "seven"}) + "\n")
            elif row % 3 == 1:
                file.write(json.dumps({"segments": [" ".join(words[:2]) + " ", " ".join(words[2:4]) + " ", " ".join(words[4:])]}) + "\n")
            else:
                file.write(json.dumps({"prompt": " ".join(words)}) + "\n")
    return path


def _rows(folder):
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def _check_report(path, rows, methods):
    """The report holds every method's summary, the best mean of each metric in bold, the
    differences to the best, and win counts that add up to at least one per example and metric."""
    import re
    from html import escape

    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    for method in methods:
        assert f"<td>{method}</td>" in page
    for row in rows:
        assert f'<td class="answer"><bdi>{escape(row["answer"])}</bdi></td>' in page, "the answers' column kept wide"
    assert ".rows td.answer { min-width:" in page
    assert "lds ↑" in page and page.count("<b>") >= 1
    assert page.count("<table") == page.count('<div class="scroll') == 4, "a table wider than the window widens the page"
    against = page.split("<h2>Against the best</h2>")[1].split("</table>")[0]
    assert against.count("<td>best</td>") >= 1 and against.count("<tr>") == len(methods) + 1
    wins = page.split("<h2>Wins</h2>")[1].split("</table>")[0]
    counts = [[int(n) for n in re.findall(r"<td>(\d+)</td>", line)] for line in wins.split("<tr>")[2:]]
    examples = len({row["index"] for row in rows})
    assert all(total >= examples for total in map(sum, zip(*counts)))


def test_rows_are_the_metrics_of_each_answer_alone(llm, tmp_path, capsys):
    data = _data(tmp_path)
    output = tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(llm), "--methods", "grad_sam,rollout", "--max-new-tokens", "3",
                 "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "| grad_sam |" in out and "lds ↑" in out
    rows = _rows(output)
    assert len(rows) == 6 * 2 and {row["method"] for row in rows} == {"grad_sam", "rollout"}
    _check_report(output / "report.html", rows, ["grad_sam", "rollout"])
    assert "report.html" in out
    assert [row["generated"] for row in rows if row["method"] == "grad_sam"] == [False, True, True] * 2
    from captum_attention.loading import load_causal_lm

    model, tokenizer = load_causal_lm(llm)
    examples, _ = read_answers(data)
    for example, row in zip(examples[:2], [r for r in rows if r["method"] == "grad_sam"][:2]):
        ids = tokenizer(example.text, return_tensors="pt").input_ids
        answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
        mask = torch.ones_like(ids)
        scores = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]
        segments = None
        if example.segments is not None:  # BOS kept; each word in the segment holding it
            words = example.text.split()
            bounds = [len(s.split()) for s in example.segments]
            segments = torch.tensor([[-1] + [sum(position >= sum(bounds[: k + 1]) for k in range(len(bounds))) for position in range(len(words))]])
        else:
            segments = torch.tensor([[-1] + list(range(1, ids.shape[1]))])  # each token its own, numbered by position
        assert row["lds"] == pytest.approx(_lds(model, ids, mask, answer, scores, segments), abs=1e-6)
        drop = top_k_log_prob_drop(model, ids, mask, answer, scores, (3,), segments)[0, 0]
        assert row["top_k_log_prob_drop"] == pytest.approx(float(drop), abs=1e-5)


def _estimates(model, ids, mask, answer, segments):
    """``leave_one_out_estimates`` over KnockoutGradient's and AttnLRP's spans."""
    from captum_attention import AttnLRP, KnockoutGradient
    from captum_attention.metrics import leave_one_out_estimates

    first_order, prior = (
        cls(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]] for cls in (KnockoutGradient, AttnLRP)
    )
    return leave_one_out_estimates(model, ids, mask, answer, first_order, prior, segments)


def _estimates_by_share(model, ids, mask, answer, segments):
    """``leave_one_out_estimates`` over KnockoutGradient's span alone, its 7 segments of
    largest effect over one minus their ``attention_shares`` deleted exactly."""
    from captum_attention import KnockoutGradient
    from captum_attention.metrics import attention_shares, leave_one_out_estimates

    first_order = KnockoutGradient(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]
    shares = attention_shares(model, ids, mask, answer, segments)
    return leave_one_out_estimates(model, ids, mask, answer, first_order, first_order, segments, exact=7, shares=shares)


def _knockout_lrp(model, ids, mask, answer, segments):
    from captum_attention import KnockoutLRP

    return KnockoutLRP(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]


def _attn_lrp_at_presence(model, ids, mask, answer, segments):
    """AttnLRP's span with the prompt's tokens at presence 0.05 (the default), BOS and the answer at 1."""
    from captum_attention import AttnLRP

    presence = torch.cat([torch.where(segments < 0, 1.0, 0.05), torch.ones(answer.shape)], dim=1)
    return AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask,), presence=presence)[:, : ids.shape[1]]


@pytest.mark.parametrize(
    "method, scored",
    [
        ("leave_one_out_estimates", _estimates), ("leave_one_out_estimates_by_share", _estimates_by_share),
        ("knockout_lrp", _knockout_lrp), ("attn_lrp_presence", _attn_lrp_at_presence),
    ],
)
def test_a_single_stack_method_of_the_answers_run_is_its_own_metrics(llm, seq2seq, tmp_path, capsys, method, scored):
    """Its rows are the metrics of its scores computed directly; an encoder-decoder refuses
    it in one line."""
    from captum_attention.loading import load_causal_lm

    data, output = _data(tmp_path, count=2), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(llm), "--methods", method, "--max-new-tokens", "3",
                 "--output", str(output)]) == 0
    rows = _rows(output)
    assert [row["method"] for row in rows] == [method] * 2
    model, tokenizer = load_causal_lm(llm)
    example = read_answers(data)[0][0]  # a prompt without segments: each token its own, BOS kept
    ids = tokenizer(example.text, return_tensors="pt").input_ids
    answer = tokenizer(rows[0]["answer"], add_special_tokens=False, return_tensors="pt").input_ids
    mask, segments = torch.ones_like(ids), torch.tensor([[-1] + list(range(1, ids.shape[1]))])
    scores = scored(model, ids, mask, answer, segments)
    assert rows[0]["lds"] == pytest.approx(_lds(model, ids, mask, answer, scores, segments), abs=1e-6)
    assert main(["evaluate", str(data), "--model", str(seq2seq), "--methods", method, "--output", str(tmp_path / "s2s")]) == 1
    assert f"{method} explains one self-attention stack" in capsys.readouterr().err


def test_integrated_gradients_of_the_answers_run_is_captums_llm_attribution(llm, seq2seq, tmp_path, capsys):
    """``--methods integrated_gradients``: the scores are the ``seq_attr`` of Captum's
    ``LLMGradientAttribution(LayerIntegratedGradients)`` (one run per answer token, summed),
    and the rows their metrics; an encoder-decoder's are ``answer_integrated_gradients``
    over its source (checked against autograd in ``test_seq2seq_answers.py``), which
    Captum's class does not take."""
    from captum.attr import LayerIntegratedGradients, LLMGradientAttribution, TextTokenInput

    from captum_attention.loading import load_causal_lm
    from captum_attention.presentation.explain import answer_integrated_gradients

    data, output = _data(tmp_path, count=3), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(llm), "--methods", "integrated_gradients", "--ig-steps", "8",
                 "--max-new-tokens", "3", "--output", str(output)]) == 0
    row = _rows(output)[2]  # a generated answer of 3 tokens
    model, tokenizer = load_causal_lm(llm)
    example = read_answers(data)[0][2]
    ids = tokenizer(example.text, return_tensors="pt").input_ids
    answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
    assert answer.shape[1] > 1, "several answer tokens: Captum's runs summed"
    captum = LLMGradientAttribution(LayerIntegratedGradients(model, model.get_input_embeddings()), tokenizer)
    expected = captum.attribute(TextTokenInput(example.text, tokenizer), target=answer[0], n_steps=8).seq_attr[None].float()
    torch.testing.assert_close(answer_integrated_gradients(model, ids, answer, 8), expected, rtol=1e-4, atol=1e-5)
    mask, segments = torch.ones_like(ids), torch.tensor([[-1] + list(range(1, ids.shape[1]))])
    assert row["lds"] == pytest.approx(_lds(model, ids, mask, answer, expected, segments), abs=1e-6)
    drop = top_k_log_prob_drop(model, ids, mask, answer, expected, (3,), segments)[0, 0]
    assert row["top_k_log_prob_drop"] == pytest.approx(float(drop), abs=1e-5)
    s2s = tmp_path / "s2s"
    assert main(["evaluate", str(data), "--model", str(seq2seq), "--methods", "integrated_gradients", "--ig-steps", "8",
                 "--max-new-tokens", "3", "--output", str(s2s)]) == 0
    row = _rows(s2s)[0]
    model, tokenizer = load_causal_lm(seq2seq, seq2seq=True)
    example = read_answers(data)[0][0]
    ids = tokenizer(example.text, return_tensors="pt").input_ids
    answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
    scores = answer_integrated_gradients(model, ids, answer, 8)
    segments = torch.tensor([[-1] + list(range(1, ids.shape[1]))])  # BOS kept, each token its own
    drop = top_k_log_prob_drop(model, ids, torch.ones_like(ids), answer, scores, (3,), segments)[0, 0]
    assert row["top_k_log_prob_drop"] == pytest.approx(float(drop), abs=1e-5)


def test_a_prompt_without_bos_keeps_its_first_token(llm, tmp_path):
    """A tokenizer that adds no BOS (GPT-2's, Qwen's) leaves a prompt no special token to
    keep: its first token is never removed, as the metrics keep it by default, for the
    metrics, the estimates and the head weights' fit (each stopped at "no prompt token that
    is never removed" before), its named segments included."""
    import shutil

    from lm_models import make_word_tokenizer

    from captum_attention.loading import load_causal_lm

    folder = tmp_path / "no_bos"
    shutil.copytree(llm, folder)
    make_word_tokenizer(bos=False).save_pretrained(folder)
    data, output = _data(tmp_path, count=2), tmp_path / "out"
    methods = ["grad_sam", "leave_one_out_estimates"]
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", ",".join(methods), "--max-new-tokens", "3",
                 "--output", str(output)]) == 0
    model, tokenizer = load_causal_lm(folder)
    for example in read_answers(data)[0]:
        ids = tokenizer(example.text, return_tensors="pt").input_ids
        assert int(ids[0, 0]) != tokenizer.bos_token_id
        if example.segments is None:  # each token its own, the first kept
            segments = torch.tensor([[-1] + list(range(1, ids.shape[1]))])
        else:  # each word in the segment holding it, the first kept
            bounds = torch.tensor([len(s.split()) for s in example.segments]).cumsum(0)
            segments = torch.searchsorted(bounds, torch.arange(ids.shape[1]), right=True)[None]
            segments[0, 0] = -1
        for method in methods:
            row = next(r for r in _rows(output) if r["index"] == example.index and r["method"] == method)
            answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
            mask = torch.ones_like(ids)
            if method == "grad_sam":
                scores = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]
            else:
                scores = _estimates(model, ids, mask, answer, segments)
            assert row["lds"] == pytest.approx(_lds(model, ids, mask, answer, scores, segments), abs=1e-6), method
    assert main(["fit-head-weights", str(data), "--model", str(folder), "--ablations", "2", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize("trim_offsets", [True, False])
def test_each_token_is_in_the_segment_that_holds_its_word(trim_offsets):
    """A byte-level tokenizer that does not trim its offsets (GPT-2's, Llama-3's, Qwen2's)
    starts the token of a segment's first word at the space that ends the segment before:
    it was counted in that segment. Each token belongs where its word is."""
    from lm_models import make_byte_level_tokenizer, make_decoder

    from captum_attention.presentation.dataset import AnswerExample
    from captum_attention.presentation.evaluate import answer_tensors

    segments = ("The meeting moved to Tuesday. ", "Lunch is at noon. ", "When is the meeting?")
    tokenizer = make_byte_level_tokenizer("".join(segments), trim_offsets)
    example = AnswerExample(0, 1, "".join(segments), " Tuesday", segments)
    ids, _, _, found = answer_tensors(make_decoder("llama"), tokenizer, example, 1)
    words = [tokenizer.convert_tokens_to_string([token]).strip() for token in tokenizer.convert_ids_to_tokens(ids[0])]
    expected = [k for k, segment in enumerate(segments) for word in segment.replace(".", " .").replace("?", " ?").split()]
    assert len(words) == len(expected), words
    assert found[0].tolist() == expected, list(zip(words, found[0].tolist()))


def test_answers_read_glued_to_their_prompt_are_named_in_one_line(tmp_path, capsys):
    """On a byte-level tokenizer, an answer given without its space is read glued to the
    prompt's last word ("the" and "mat": "themat"): evaluate and fit-head-weights say which."""
    import transformers as tf
    from lm_models import make_byte_level_tokenizer

    folder, data = tmp_path / "gpt2", tmp_path / "answers.jsonl"
    tokenizer = make_byte_level_tokenizer("the cat sat on the mat.")
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [{"prompt": "the cat sat on the", "answer": "mat"}, {"prompt": "the cat sat on the", "answer": " mat"},
            {"prompt": "the cat sat on the "}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for command in (["evaluate", "--methods", "raw", "--max-new-tokens", "2", "--output", str(tmp_path / "out")],
                    ["fit-head-weights", "--ablations", "2", "--max-new-tokens", "2"]):
        assert main([*command, str(data), "--model", str(folder)]) == 0
        error = capsys.readouterr().err
        assert "warning: " + str(data) + ": 1 answer (line 1) read glued to the prompt's last word" in error, error


def test_prompts_with_words_the_tokenizer_does_not_know_are_named_in_one_line(llm, tmp_path, capsys):
    """The word-level tokenizer reads unknown words as its pad token: evaluate and
    fit-head-weights say which rows hold them."""
    import shutil

    model, data = shutil.copytree(llm, tmp_path / "llama"), tmp_path / "answers.jsonl"  # the fit writes beside the model
    rows = [{"prompt": "the secret code is seven", "answer": "seven"}, {"prompt": "the zebra code is seven", "answer": "seven"},
            {"prompt": "quokka code is seven", "answer": "seven"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for command in (["evaluate", "--methods", "raw", "--metrics", "top_k_log_prob_drop", "--output", str(tmp_path / "out")],
                    ["fit-head-weights", "--ablations", "2"]):
        assert main([*command, str(data), "--model", str(model)]) == 0
        error = capsys.readouterr().err
        assert "warning: " + str(data) + ": 2 prompts (line 2 and 1 more) with words the tokenizer reads as its unknown" in error, error


def test_attention_flow_is_refused_for_answers_before_any_work(llm, tmp_path, capsys):
    data, output = _data(tmp_path, count=2), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(llm), "--methods", "raw,attention_flow", "--output", str(output)]) == 1
    assert "attention_flow explains one answer token at a time, not a whole answer" in capsys.readouterr().err
    assert not output.exists()


def test_a_sequence_to_sequence_models_answers_are_scored_over_its_source(seq2seq, tmp_path, capsys):
    """BART: each answer explained over the source (the span's source side), the metrics
    deleting source segments and reading the decoder's log-probabilities; rows equal the
    metrics computed directly, and those equal the decoder's own log-probabilities."""
    from captum_attention import TransformerAttribution
    from captum_attention.loading import load_causal_lm
    from captum_attention.metrics.context import answer_log_probs

    data, output = _data(tmp_path, 3), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(seq2seq), "--methods", "transformer_attribution,raw",
                 "--max-new-tokens", "3", "--output", str(output)]) == 0
    assert "| transformer_attribution |" in capsys.readouterr().out
    rows = _rows(output)
    assert len(rows) == 3 * 2
    model, tokenizer = load_causal_lm(seq2seq, seq2seq=True)
    examples, _ = read_answers(data)
    example, row = examples[0], next(r for r in rows if r["method"] == "transformer_attribution" and r["index"] == 0)
    ids = tokenizer(example.text, return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
    decoder = torch.cat([torch.full_like(answer[:, :1], model.config.decoder_start_token_id), answer[:, :-1]], dim=1)
    with torch.no_grad():
        log_probs = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder).logits.log_softmax(-1)
    expected = float(log_probs.gather(2, answer[..., None]).sum())
    assert row["answer_log_prob"] == pytest.approx(expected, abs=1e-5)
    assert float(answer_log_probs(model, ids, mask, answer)[0]) == pytest.approx(expected, abs=1e-5)
    scores = TransformerAttribution(model).attribute_span(ids, answer, additional_forward_args=(mask,))[0]
    segments = torch.tensor([[-1] + list(range(1, ids.shape[1]))])  # BOS kept, each token its own, numbered by position
    assert row["lds"] == pytest.approx(_lds(model, ids, mask, answer, scores, segments), abs=1e-6)
    top = int(scores[0, 1:].argmax()) + 1  # the top segment deleted by hand, the source closing up
    kept = torch.cat([ids[:, :top], ids[:, top + 1 :]], dim=1)
    with torch.no_grad():
        without = model(input_ids=kept, attention_mask=torch.ones_like(kept), decoder_input_ids=decoder).logits.log_softmax(-1)
    drop = top_k_log_prob_drop(model, ids, mask, answer, scores, (1,), segments)[0, 0]
    assert float(drop) == pytest.approx(expected - float(without.gather(2, answer[..., None]).sum()), abs=1e-5)
    with pytest.raises(ValueError, match="norm_attention explains one self-attention stack"):
        from captum_attention.presentation.evaluate import evaluate_answers

        evaluate_answers(model, tokenizer, examples, ["norm_attention"], ["lds"], tmp_path / "refused")


def test_a_killed_run_resumes_to_the_same_bytes_and_two_processes_give_them_too(llm, tmp_path):
    data = _data(tmp_path, 12)
    options = ["--model", str(llm), "--methods", "grad_sam,raw", "--metrics", "lds,top_k_log_prob_drop", "--max-new-tokens", "2"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "captum_attention", "evaluate", str(data), *options]
    subprocess.run([*command, "--output", str(tmp_path / "whole")], env=environment, check=True, capture_output=True)
    done = killed_part_way([*command, "--output", str(tmp_path / "killed")], tmp_path / "killed" / "shards", 2, environment)
    assert 2 <= done < 12, "the run must be killed part way"
    resumed = subprocess.run([*command, "--output", str(tmp_path / "killed")], env=environment, check=True,
                             capture_output=True, text=True)
    assert f"resuming: {done} of 12 answers already done" in resumed.stdout
    whole = (tmp_path / "whole" / "results.jsonl").read_bytes()
    assert (tmp_path / "killed" / "results.jsonl").read_bytes() == whole
    pytest.importorskip("accelerate")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29519"]
    two = [*launcher, "-m", "captum_attention", "evaluate", str(data), *options, "--output", str(tmp_path / "two")]
    result = subprocess.run(two, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "two" / "results.jsonl").read_bytes() == whole
    report = {name: (tmp_path / name / "report.html").read_text().replace(str(tmp_path / name), "") for name in ("two", "whole")}
    assert report["two"] == report["whole"]  # the same but for the folder it names


@pytest.mark.parametrize("row, message", [
    ({"answer": "seven"}, "'prompt' is missing or empty"),
    ({"prompt": "the cat", "segments": ["the ", "dog"]}, "'segments' do not join to 'prompt'"),
    ({"segments": "the cat"}, "'segments' must be a non-empty list of strings"),
    ({"prompt": "the cat", "answer": ""}, "'answer' must be a non-empty string"),
])
def test_bad_rows_get_one_clear_line(llm, tmp_path, capsys, row, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError, match=message):
        read_answers(data)
    assert main(["evaluate", str(data), "--model", str(llm), "--output", str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err
    assert message in error and "line 1" in error and error.count("\n") == 1


def test_a_row_longer_than_the_model_takes_is_one_line_or_skipped(llm, tmp_path, capsys):
    """A prompt and answer past the model's 64 positions stop ``evaluate`` and
    ``fit-head-weights`` before any work with the row's line (an index error deep in the
    embeddings before), or with ``--skip-malformed`` are skipped and reported."""
    data = tmp_path / "answers.jsonl"
    rows = [{"prompt": " ".join(WORDS[3:13]), "answer": "seven"}, {"prompt": " ".join([WORDS[5]] * 70), "answer": "seven"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = "line 2: the prompt's 71 tokens and the answer's 1 token are more than the 64 the model takes"
    output = tmp_path / "out"
    for command in (["evaluate", "--output", str(output)], ["fit-head-weights", "--ablations", "2"]):
        assert main([*command, str(data), "--model", str(llm)]) == 1
        error = capsys.readouterr().err
        assert message in error and "--skip-malformed" in error and error.count("\n") == 1, error
    assert not output.exists()
    assert main(["evaluate", str(data), "--model", str(llm), "--methods", "raw", "--skip-malformed", "--output", str(output)]) == 0
    assert f"skipped {data}, {message}" in capsys.readouterr().err
    assert [row["line"] for row in _rows(output)] == [1]


def _lds(model, ids, mask, answer, scores, segments) -> float:
    """The ``lds`` metric's value for one answer: its own ablations."""
    return float(linear_datamodeling_score(model, ids, mask, answer, scores, segments, per_example=True)[0])


def test_a_prompt_beginning_with_the_bos_text_is_read_with_one_bos(llm, tmp_path):
    """A prompt written with the BOS token's text first (a chat template's text pasted in),
    which the tokenizer adds itself, gives the rows of the prompt without it: one BOS, not
    two, its segments cut alike (a first segment of the BOS alone left out)."""
    plain = _data(tmp_path, count=3)
    pasted = tmp_path / "pasted.jsonl"
    rows = [json.loads(line) for line in plain.read_text().splitlines()]
    for row in rows:
        if "segments" in row:
            row["segments"] = ["<s>", *row["segments"]]
        else:
            row["prompt"] = "<s>" + row["prompt"]
    pasted.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for data in (plain, pasted):
        assert main(["evaluate", str(data), "--model", str(llm), "--methods", "grad_sam", "--max-new-tokens", "3",
                     "--output", str(tmp_path / data.stem)]) == 0
    assert _rows(tmp_path / "pasted") == _rows(tmp_path / "answers")


def test_chat_scores_each_rows_message_in_the_chat_template(llm, tmp_path, capsys):
    """``--chat`` (evaluate, fit-head-weights): each prompt is the user's message in the
    chat template; the template's tokens are never removed, the segments make up the
    message; a template that changes the message, or a classifier, is refused in one line."""
    import shutil

    from lm_models import CHAT_TEMPLATE, make_word_tokenizer

    from captum_attention.loading import load_causal_lm

    folder = tmp_path / "instruct"
    shutil.copytree(llm, folder)
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    data, output = _data(tmp_path, count=2), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "grad_sam", "--max-new-tokens", "3", "--chat",
                 "--output", str(output)]) == 0
    model, tokenizer = load_causal_lm(folder)
    for example in read_answers(data)[0]:
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": example.text}], add_generation_prompt=True)
        ids = torch.tensor([encoded["input_ids"]])
        words = example.text.split()
        assert tokenizer.convert_ids_to_tokens(ids[0].tolist()) == ["<s>", "question", *words, "answer"]
        if example.segments is None:
            in_message = list(range(2, 2 + len(words)))
        else:
            bounds = torch.tensor([len(s.split()) for s in example.segments]).cumsum(0)
            in_message = torch.searchsorted(bounds, torch.arange(len(words)), right=True).tolist()
        segments = torch.tensor([[-1, -1, *in_message, -1]])  # the template's tokens never removed
        row = next(r for r in _rows(output) if r["index"] == example.index)
        answer = tokenizer(row["answer"], add_special_tokens=False, return_tensors="pt").input_ids
        mask = torch.ones_like(ids)
        scores = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]
        assert row["lds"] == pytest.approx(_lds(model, ids, mask, answer, scores, segments), abs=1e-6)
        drop = top_k_log_prob_drop(model, ids, mask, answer, scores, (3,), segments)[0, 0]
        assert row["top_k_log_prob_drop"] == pytest.approx(float(drop), abs=1e-5)
    assert main(["fit-head-weights", str(data), "--model", str(folder), "--ablations", "2", "--max-new-tokens", "3", "--chat"]) == 0
    capsys.readouterr()
    trimming = make_word_tokenizer()
    trimming.chat_template = CHAT_TEMPLATE.replace("message['content']", "message['content'] | trim")
    trimming.save_pretrained(folder)
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text(json.dumps({"prompt": "the cat is here ", "answer": "seven"}) + "\n")
    assert main(["evaluate", str(spaced), "--model", str(folder), "--chat", "--output", str(tmp_path / "trim")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "line 1: the chat template changes the prompt's text" in error
    assert "pass --skip-malformed to skip them" in error
    assert main(["evaluate", str(spaced), "--chat", "--output", str(tmp_path / "classifier")]) == 1
    assert "--chat is for a language model's prompts" in capsys.readouterr().err


def test_rows_with_images_are_refused_for_a_language_model_in_one_line(llm, tmp_path, capsys):
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    data = tmp_path / "answers.jsonl"
    data.write_text(json.dumps({"prompt": "the cat", "image": "cat.png"}) + "\n")
    assert main(["evaluate", str(data), "--model", str(llm), "--output", str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err
    assert "rows name an 'image' (line 1)" in error and "holds no vision-language model" in error and error.count("\n") == 1


def test_a_translation_models_languages_are_set_and_a_run_with_others_is_not_resumed(translation, tmp_path, capsys):
    """NLLB under --source-language and --target-language: each answer after the forced
    code, its log-probability the decoder's of the tokens after it with the source after
    its own code; the same folder with other languages is another run."""
    from captum_attention.loading import load_causal_lm

    data, output = tmp_path / "answers.jsonl", tmp_path / "out"
    data.write_text(json.dumps({"prompt": "the cat sat on the mat", "answer": "the dog"}) + "\n"
                    + json.dumps({"prompt": "the bird flew over the tree"}) + "\n")
    command = ["evaluate", str(data), "--model", str(translation), "--methods", "raw", "--metrics", "top_k_log_prob_drop",
               "--max-new-tokens", "3", "--output", str(output)]
    assert main([*command, "--source-language", "fra_Latn", "--target-language", "deu_Latn"]) == 0
    rows = {row["index"]: row for row in _rows(output)}
    assert rows[0]["answer"].startswith("deu_Latn") and rows[1]["answer"].startswith("deu_Latn")
    model, tokenizer = load_causal_lm(translation, seq2seq=True)
    tokenizer.src_lang = "fra_Latn"
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids
    answer = torch.tensor([[tokenizer.convert_tokens_to_ids("deu_Latn"), *tokenizer("the dog", add_special_tokens=False).input_ids]])
    with torch.no_grad():
        log_probs = model(input_ids=ids, decoder_input_ids=torch.cat([torch.tensor([[2]]), answer[:, :-1]], 1)).logits.log_softmax(-1)
    assert rows[0]["answer_log_prob"] == pytest.approx(float(log_probs[0, 1:].gather(1, answer[0, 1:, None]).sum()), abs=1e-5)
    capsys.readouterr()
    assert main([*command, "--source-language", "fra_Latn", "--target-language", "spa_Latn"]) == 1
    assert "holds another run (languages:" in capsys.readouterr().err
    assert main([*command, "--source-language", "fra_Latn", "--target-language", "deu_Latn"]) == 0
    assert "resuming: 2 of 2 answers already done" in capsys.readouterr().out
