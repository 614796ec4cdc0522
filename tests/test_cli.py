"""End-to-end: the command line on a tiny checkpoint saved to a folder, in this process
(``main(argv)``, its output captured) and, for the whole path from ``python -m``, in a
subprocess."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import unicodedata
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
import transformers as tf
from captum.attr import LayerIntegratedGradients

from captum_attention import METHODS as REGISTERED
from captum_attention.loading import CheckpointError, load_classifier
from captum_attention.presentation.cli import main
from captum_attention.presentation.explain import Explanations, MethodInfo, SentenceExplanation
from captum_attention.presentation.html import render_html
from captum_attention.presentation.text import render_text

WORDS = "the plot was dull but acting superb what a film < > script alert ( 1 ) /".split()
SENTENCES = ["the plot was dull but the acting was superb", "what a film"]
METHODS = {cls.get_name(): cls for cls in REGISTERED.values()}


def _tokenizer(folder: Path) -> tf.BertTokenizerFast:
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *dict.fromkeys(WORDS)]) + "\n")
    return tf.BertTokenizerFast(vocab=str(vocab))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    config = tf.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=64, initializer_range=0.3,
        id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1},
    )
    torch.manual_seed(0)
    classifier, encoder = root / "classifier", root / "encoder"
    tf.BertForSequenceClassification(config).save_pretrained(classifier)
    tf.BertModel(config).save_pretrained(encoder)
    for folder in (classifier, encoder):
        _tokenizer(root).save_pretrained(folder)
    return classifier, encoder


def run_cli_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m captum_attention *args`` in a subprocess (about 4 s of imports)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "captum_attention", *args], capture_output=True, text=True, env=env, timeout=300
    )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``main(args)`` in this process, with what it prints and its exit status as the
    subprocess would give them; the settings it changes for the process (the hub offline,
    transformers' verbosity and progress bars) put back after."""
    from transformers.utils import logging as hf_logging

    stdout, stderr = io.StringIO(), io.StringIO()
    environment, verbosity, bars = dict(os.environ), hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main(list(args))
            except SystemExit as stopped:  # argparse's usage errors, --help and --version
                status = stopped.code if isinstance(stopped.code, int) else int(stopped.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    return subprocess.CompletedProcess(["captum-attention", *args], status, stdout.getvalue(), stderr.getvalue())


def parse_tables(stdout: str) -> list[tuple[list[str], dict[str, list[float]]]]:
    """Each sentence's printed (tokens, {method: scores})."""
    tables, lines = [], stdout.splitlines()
    for index, line in enumerate(lines):
        if line.strip().startswith("token "):
            methods = [m for m in METHODS] + ["Integrated Gradients"]
            tokens, scores = [], {m: [] for m in methods}
            for row in lines[index + 1 :]:
                if not row.strip():
                    break
                cells = row.split()
                tokens.append(cells[0])
                for method, value in zip(methods, cells[1:]):
                    scores[method].append(float(value))
            tables.append((tokens, scores))
    return tables


def marked_rows(page: str) -> list[list[bool]]:
    """Each table row of a report page that holds tokens: whether each token is marked
    (underlined: an answer's, the token a label is read at)."""

    class Marked(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[bool]] = []

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            kind = dict(attrs).get("class") or ""
            if tag == "tr":
                self.rows.append([])
            elif tag == "span" and kind.startswith("tok") and self.rows:
                self.rows[-1].append("marked" in kind)

    parser = Marked()
    parser.feed(page)
    return [row for row in parser.rows if row]


def _saved_classifier(
    folder: Path, sentences: Sequence[str] = tuple(SENTENCES)
) -> tuple[Any, Any, Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The saved classifier, its forward, its tokenizer, the ``sentences``' ids and mask, and
    the predicted classes: what the command line explains."""
    model = tf.BertForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(folder)
    encoded = tokenizer(list(sentences), padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    return model, forward, tokenizer, ids, mask, forward(ids, mask).argmax(1)


def test_explain_prints_the_library_scores(checkpoints, tmp_path):
    classifier, _ = checkpoints
    result = run_cli_process("explain", *SENTENCES, "--model", str(classifier), "--ig-steps", "20", "--raw")
    assert result.returncode == 0, result.stderr
    assert "Transformer Attribution" in result.stdout and "wall time for 2 sentences" in result.stdout

    model, forward, tokenizer, ids, mask, targets = _saved_classifier(classifier)
    expected = {
        name: cls(forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask,))
        for name, cls in METHODS.items()
    }
    baseline = torch.where(torch.isin(ids, torch.tensor(tokenizer.all_special_ids)), ids, tokenizer.pad_token_id)
    expected["Integrated Gradients"] = LayerIntegratedGradients(forward, model.get_input_embeddings()).attribute(
        ids, baselines=baseline, target=targets, additional_forward_args=(mask,), n_steps=20
    ).sum(-1)

    tables = parse_tables(result.stdout)
    assert len(tables) == 2
    for row, (tokens, printed) in enumerate(tables):
        length = int(mask[row].sum())
        assert tokens == tokenizer.convert_ids_to_tokens(ids[row, :length].tolist())
        assert "[UNK]" not in tokens and tokens[1] == SENTENCES[row].split()[0]
        for method, scores in printed.items():
            torch.testing.assert_close(
                torch.tensor(scores), expected[method][row, :length].detach(), rtol=1e-3, atol=1e-9
            )


def test_attn_lrp_at_a_presence_on_request(checkpoints, tmp_path):
    """``--methods attn_lrp_presence``: AttnLRP with the words at ``--presence`` and the
    special tokens and padding at 1, under its own name; not among the defaults."""
    classifier, _ = checkpoints
    path = tmp_path / "presence.json"
    result = run_cli("explain", *SENTENCES, "--model", str(classifier), "--methods", "attn_lrp,attn_lrp_presence",
                     "--presence", "0.2", "--raw", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert "AttnLRP at presence 0.2" in result.stdout
    written = json.loads(path.read_text(encoding="utf-8"))
    model, forward, tokenizer, ids, mask, targets = _saved_classifier(classifier)
    words = ~torch.isin(ids, torch.tensor(tokenizer.all_special_ids)) & (mask == 1)
    presence = torch.where(words, 0.2, 1.0)
    expected = REGISTERED["attn_lrp"](forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask,),
                                                                     presence=presence).detach()
    plain = REGISTERED["attn_lrp"](forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask,))
    for row, sentence in enumerate(written["sentences"]):
        length = int(mask[row].sum())
        scores = torch.tensor(sentence["scores"]["AttnLRP at presence 0.2"])
        torch.testing.assert_close(scores, expected[row, :length], rtol=1e-4, atol=1e-7)
        assert not torch.allclose(scores, plain[row, :length].detach(), rtol=0.05), "the presence moves the scores"
    default = run_cli("explain", SENTENCES[1], "--model", str(classifier), "--ig-steps", "2")
    assert default.returncode == 0 and "presence" not in default.stdout
    for value in ("0", "1.5"):
        refused = run_cli("explain", SENTENCES[1], "--model", str(classifier), "--presence", value)
        assert refused.returncode == 1 and f"--presence must lie in (0, 1] (1: each token as it is), got {float(value)}" in refused.stderr


def test_the_presence_calibrated_on_request_is_calibrated_attribution(checkpoints, tmp_path):
    """``--methods attn_lrp_presence_calibrated``: the presence's scores calibrated on 8
    random removals of the words (special tokens kept), each sentence's the same alone as
    in the batch. Where the removals reverse the prior's direction ("a film" on this
    model) the scores are the prior's, and a note says so in the terminal and the JSON."""
    from captum_attention.metrics import calibrated_attribution

    classifier, _ = checkpoints
    name = "AttnLRP at presence 0.2, calibrated"
    kept_prior = "a film"
    paths = [tmp_path / "batch.json", tmp_path / "alone.json"]
    printed = []
    for path, sentences in zip(paths, ([*SENTENCES, kept_prior], SENTENCES[:1])):
        result = run_cli("explain", *sentences, "--model", str(classifier), "--methods", "attn_lrp_presence_calibrated",
                         "--presence", "0.2", "--raw", "--json", str(path))
        assert result.returncode == 0, result.stderr
        printed.append(result.stdout)
    written = json.loads(paths[0].read_text(encoding="utf-8"))
    model, forward, tokenizer, ids, mask, targets = _saved_classifier(classifier, [*SENTENCES, kept_prior])
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    presence = torch.where(~special & (mask == 1), 0.2, 1.0)
    prior = REGISTERED["attn_lrp"](forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask,),
                                                                  presence=presence).detach()
    expected = calibrated_attribution(forward, ids, mask, prior, targets, keep=special)
    for row, sentence in enumerate(written["sentences"]):
        length = int(mask[row].sum())
        torch.testing.assert_close(torch.tensor(sentence["scores"][name]), expected[row, :length], rtol=1e-4, atol=1e-6)
        words = ~special[row, :length]
        if sentence["text"] == kept_prior:
            assert torch.equal(expected[row, :length][words], prior[row, :length][words]), "this one keeps its prior"
            assert sentence["notes"] == {name: "its random removals reversed the prior's direction (fitted scale ≤ 0), "
                                         "so these are the uncalibrated presence's scores"}
        else:
            assert not torch.allclose(expected[row, :length], prior[row, :length], rtol=0.05), "the removals move the scores"
            assert sentence["notes"] == {}
    assert printed[0].count(f"note: {name}: its random removals reversed the prior's direction") == 1
    alone = json.loads(paths[1].read_text(encoding="utf-8"))["sentences"][0]["scores"][name]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(written["sentences"][0]["scores"][name]), rtol=1e-4, atol=1e-6)
    assert written["methods"][name] == {"uses_target": True, "signed": True}


def test_half_contexts_on_request_are_context_averaged_attribution(checkpoints, tmp_path):
    """``--methods attn_lrp_half_contexts``: the presence's scores beside AttnLRP in 8 random
    half contexts of the words (special tokens kept), each sentence's the same alone as in
    the batch."""
    from captum_attention.metrics import context_averaged_attribution

    classifier, _ = checkpoints
    name = "AttnLRP at presence 0.2, in half contexts"
    paths = [tmp_path / "batch.json", tmp_path / "alone.json"]
    for path, sentences in zip(paths, (SENTENCES, SENTENCES[:1])):
        result = run_cli("explain", *sentences, "--model", str(classifier), "--methods", "attn_lrp_half_contexts",
                         "--presence", "0.2", "--raw", "--json", str(path))
        assert result.returncode == 0, result.stderr
    written = json.loads(paths[0].read_text(encoding="utf-8"))
    model, forward, tokenizer, ids, mask, targets = _saved_classifier(classifier, SENTENCES)
    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    lrp = REGISTERED["attn_lrp"](forward, model=model)
    prior = lrp.attribute(ids, target=targets, additional_forward_args=(mask,), presence=torch.where(~special & (mask == 1), 0.2, 1.0))
    in_context = lambda i, m: lrp.attribute(i, target=targets, additional_forward_args=(m,))  # noqa: E731
    expected = context_averaged_attribution(in_context, ids, mask, prior.detach(), keep=special)
    for row, sentence in enumerate(written["sentences"]):
        length = int(mask[row].sum())
        torch.testing.assert_close(torch.tensor(sentence["scores"][name]), expected[row, :length], rtol=1e-4, atol=1e-6)
    alone = json.loads(paths[1].read_text(encoding="utf-8"))["sentences"][0]["scores"][name]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(written["sentences"][0]["scores"][name]), rtol=1e-4, atol=1e-6)
    assert written["methods"][name] == {"uses_target": True, "signed": True}


def test_every_registered_method_on_request(checkpoints, tmp_path):
    """``--methods`` takes every registered method, each under its own name with the
    library's scores; Learned Attention reads the head weights saved beside the model (a
    note says where there are none); ALTI-Logit, which explains a next-token logit, is
    refused before any work."""
    from captum_attention import HeadWeights
    from captum_attention.attr import REGISTRY

    folder = tmp_path / "classifier"
    shutil.copytree(checkpoints[0], folder)
    chosen = ["attention_flow", "norm_attention", "value_zeroing", "alti", "learned_attention", "knockout_gradient",
              "knockout_lrp", "decompx"]
    assert set(chosen) == set(REGISTRY) - set(REGISTERED) - {"alti_logit"}, "every other registered method"
    path = tmp_path / "registered.json"
    result = run_cli("explain", *SENTENCES, "--model", str(folder), "--methods", ",".join(chosen), "--raw", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert "no head weights beside the model" in result.stderr
    model, forward, _, ids, mask, targets = _saved_classifier(folder)
    weights = HeadWeights(torch.rand(2, 4, generator=torch.Generator().manual_seed(0)), {})
    weights.save(folder)
    fitted = run_cli("explain", *SENTENCES, "--model", str(folder), "--methods", "learned_attention", "--raw", "--json",
                     str(tmp_path / "fitted.json"))
    assert fitted.returncode == 0 and "head weights" not in fitted.stderr
    written = json.loads(path.read_text(encoding="utf-8"))
    written_fitted = json.loads((tmp_path / "fitted.json").read_text(encoding="utf-8"))
    learned = REGISTRY["learned_attention"](forward, model=model, weights=weights)
    for name in chosen:
        explainer = REGISTRY[name](forward, model=model)
        expected = explainer.attribute(ids, target=targets, additional_forward_args=(mask,)).detach()
        for row, sentence in enumerate(written["sentences"]):
            length = int(mask[row].sum())
            torch.testing.assert_close(torch.tensor(sentence["scores"][explainer.get_name()]), expected[row, :length], rtol=1e-4, atol=1e-7)
    expected = learned.attribute(ids, additional_forward_args=(mask,)).detach()
    for row, sentence in enumerate(written_fitted["sentences"]):
        length = int(mask[row].sum())
        scores = torch.tensor(sentence["scores"]["Learned Attention"])
        torch.testing.assert_close(scores, expected[row, :length], rtol=1e-4, atol=1e-7)
        assert not torch.allclose(scores, torch.tensor(written["sentences"][row]["scores"]["Learned Attention"]), rtol=0.05)
    assert written["methods"]["DecompX"] == {"uses_target": True, "signed": True}, "DecompX decomposes the class's logit"
    assert written["methods"]["ALTI"] == {"uses_target": False, "signed": False}
    refused = run_cli("explain", SENTENCES[1], "--model", str(folder), "--methods", "attn_lrp,alti_logit")
    assert refused.returncode == 1 and refused.stdout == ""
    assert "alti_logit explains a language model's next-token logit, not a classifier's: leave it out." in refused.stderr


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_html_report_is_self_contained_and_escaped(checkpoints, tmp_path):
    classifier, _ = checkpoints
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("what a <script>alert(1)</script> film\n\nthe plot was dull\n")
    report = tmp_path / "report.html"
    result = run_cli("explain", "--file", str(sentences), "--model", str(classifier), "--html", str(report), "--ig-steps", "5")
    assert result.returncode == 0, result.stderr
    page = report.read_text()
    collector = _Collector()
    collector.feed(page)
    assert "script" not in collector.tags, "a token became markup"
    assert not any(tag in collector.tags for tag in ("link", "img", "iframe"))
    assert "http" not in page.replace("http-equiv", "")
    text = "".join(collector.text)
    assert "what a <script>alert(1)</script> film" in text  # shown as text
    assert "&lt;script&gt;" in page
    assert '">&lt;</span>' in page and '">script</span>' in page  # the tokens themselves, escaped
    for method in [*METHODS, "Integrated Gradients"]:
        assert method in text
    assert text.count("Prediction:") == 2 and " ms" in text
    assert '<span class="tok special" title=' in page and "[CLS]</span>" in page
    assert not any("special" in span and "background" in span for span in page.split("<span")), "a special token coloured"
    assert "from the forward pass alone, the same for every class" in text and "green supports, red opposes" in text
    assert '<h2 class="sentence"><bdi>' in page and "unicode-bidi: isolate" in page


@pytest.mark.parametrize(
    "args, message",
    [
        (["explain", ""], "sentence 1 is empty"),
        (["explain", "fine", "--model", "/nonexistent/model"], "model folder not found"),
        (["explain", "fine", "--model", "org/model-name"], "model folder not found: org/model-name (--model takes a "
         "local folder and nothing is downloaded: for the Hub's org/model-name, run hf download org/model-name "
         "--local-dir model-name first)"),
        (["explain", "fine", "--file", "/nonexistent/file.txt"], "cannot read --file"),
        (["explain"], "no sentence to explain"),
        (["explain", os.fsdecode(b"caf\xff")], "sentence 1 is not valid UTF-8: caf\\udcff"),
        (["explain", "fine", "--model", "/nonexistent/\x1b[31mred"], "model folder not found: /nonexistent/\\x1b[31mred"),
    ],
)
def test_bad_input_one_line_and_non_zero_exit(args, message):
    result = run_cli(*args)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert message in result.stderr
    assert not any(unicodedata.category(char)[0] == "C" for char in result.stderr.strip()), "a raw control character"


def test_a_checkpoint_that_needs_custom_code_is_one_line(tmp_path):
    config = {"model_type": "mystery", "architectures": ["MysteryForSequenceClassification"],
              "auto_map": {"AutoConfig": "configuration_mystery.MysteryConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as raised:
        load_classifier(tmp_path)
    message = str(raised.value)
    assert "needs custom code (model_type 'mystery'" in message and "\n" not in message
    assert "trust_remote_code" not in message and "http" not in message


def _saved_bart_classifier(folder: Path) -> tuple[Any, Any]:
    """A tiny BART classifier (bart-large-mnli's kind: its decoder reads the text again,
    shifted right) and RoBERTa's kind of tokenizer (BART's ids for <s>, <pad>, </s>),
    saved to ``folder``."""
    from lm_models import make_encoder_decoder, make_roberta_tokenizer

    tokenizer = make_roberta_tokenizer(" ".join(SENTENCES))
    model = make_encoder_decoder("bart", classifier=True, vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def test_an_encoder_decoders_classifier_is_explained_per_token_of_its_text(tmp_path):
    """Each method's scores are its source and target scores of the text and the decoder
    ids the classifier makes of it, joined per token (token i's source score plus decoder
    position i + 1's); Integrated Gradients interpolates both stacks' embeddings; a
    sentence padded in a batch scores as alone."""
    from captum_attention.capture.inputs import classifier_decoder_ids
    from captum_attention.maps.encoder_decoder import text_scores

    folder = tmp_path / "bart"
    model, tokenizer = _saved_bart_classifier(folder)
    page = tmp_path / "report.html"
    result = run_cli("explain", *SENTENCES, "--model", str(folder), "--ig-steps", "20", "--raw", "--html", str(page))
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr
    assert 'special tokens (<span class="tok special">&lt;s&gt;</span>)' in page.read_text()  # the report's own
    encoded = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    decoder_ids = classifier_decoder_ids(model, ids, mask)
    targets = model(input_ids=ids, attention_mask=mask).logits.argmax(1)
    pair_forward = lambda i, d, m: model(input_ids=i, attention_mask=m, decoder_input_ids=d).logits  # noqa: E731
    expected = {
        name: text_scores(*cls(pair_forward, model=model).attribute((ids, decoder_ids), target=targets, additional_forward_args=(mask,)), mask)
        for name, cls in METHODS.items()
    }
    baseline = torch.where(torch.isin(ids, torch.tensor(tokenizer.all_special_ids)), ids, tokenizer.pad_token_id)
    stacks = [model.model.encoder.embed_tokens, model.model.decoder.embed_tokens]
    lig = LayerIntegratedGradients(lambda i, m: model(input_ids=i, attention_mask=m).logits, stacks)
    per_stack = lig.attribute(ids, baselines=baseline, target=targets, additional_forward_args=(mask,), n_steps=20)
    expected["Integrated Gradients"] = text_scores(*(stack.sum(-1) for stack in per_stack), mask)
    tables = parse_tables(result.stdout)
    assert len(tables) == 2
    for row, (tokens, printed) in enumerate(tables):
        length = int(mask[row].sum())
        assert len(tokens) == length and set(printed) == set(expected)
        for method, scores in printed.items():
            torch.testing.assert_close(torch.tensor(scores), expected[method][row, :length].detach(), rtol=1e-3, atol=1e-9)
    alone = run_cli("explain", SENTENCES[1], "--model", str(folder), "--ig-steps", "20", "--raw")
    assert alone.returncode == 0, alone.stderr
    for method, scores in parse_tables(alone.stdout)[0][1].items():
        torch.testing.assert_close(torch.tensor(scores), torch.tensor(tables[1][1][method]), rtol=1e-3, atol=1e-7)


def test_an_encoder_decoders_classifier_is_evaluated_with_what_reads_both_stacks(tmp_path):
    """``evaluate`` on BART's classifier runs the methods and the token-removal metrics by
    default, leaving out the metrics that erase one stack's attention; asked for them, for
    SmoothGrad (no input embeddings) or for AttnLRP at a presence, it refuses in one line
    before any work."""
    from captum_attention import RawAttention
    from captum_attention.capture.inputs import classifier_decoder_ids
    from captum_attention.maps.encoder_decoder import text_scores
    from captum_attention.metrics import aopc, comprehensiveness

    folder = tmp_path / "bart"
    model, tokenizer = _saved_bart_classifier(folder)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": sentence}) + "\n" for sentence in SENTENCES))
    result = run_cli("evaluate", str(rows), "--model", str(folder), "--output", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    written = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [(row["index"], row["method"]) for row in written] == [(i, name) for i in range(2) for name in REGISTERED]
    assert all(set(row) >= {"comprehensiveness", "sufficiency", "datamodeling"} for row in written)
    assert not any({"decision_flip", "erasure_js"} & set(row) for row in written)
    encoded = tokenizer([SENTENCES[0]], return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    predicted = forward(ids, mask).argmax(-1)
    pair = (ids, classifier_decoder_ids(model, ids, mask))
    scores = text_scores(*RawAttention(model).attribute(pair, additional_forward_args=(mask,)), mask)
    keep = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    expected = aopc(comprehensiveness(forward, ids, mask, scores, predicted, keep=keep)).item()
    assert next(row for row in written if row["method"] == "raw")["comprehensiveness"] == pytest.approx(expected, abs=1e-5)
    for asked, said in ((("--methods", "smoothgrad"), "smoothgrad takes one self-attention stack's"),
                        (("--metrics", "erasure_js"), "erasure_js takes one self-attention stack's"),
                        (("--methods", "attn_lrp_presence"), "attn_lrp_presence explains one self-attention stack")):
        refused = run_cli("evaluate", str(rows), "--model", str(folder), *asked, "--output", str(tmp_path / "refused"))
        assert refused.returncode == 1 and said in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("pad_token_id", [0, None])
def test_a_tokenizer_without_a_pad_token_pads_as_the_config_says(tmp_path, pad_token_id):
    """GPT-2's classifiers are often saved with a tokenizer that has no pad token: the
    model's config.pad_token_id (the id it finds its last token by) pads its batches, and
    they equal each sentence alone; with neither, one line names the fix."""
    config = tf.GPT2Config(vocab_size=len(WORDS) + 5, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                           num_labels=2, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    tf.GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer = _tokenizer(tmp_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    if pad_token_id is None:
        with pytest.raises(CheckpointError) as raised:
            load_classifier(tmp_path)
        assert 'set "pad_token_id" in config.json' in str(raised.value) and "\n" not in str(raised.value)
        return
    from captum_attention.presentation.explain import explain

    model, loaded = load_classifier(tmp_path)
    assert loaded.pad_token == "[PAD]" and loaded.pad_token_id == pad_token_id
    together = explain(model, loaded, SENTENCES, methods=["attn_lrp", "integrated_gradients"], batch_size=2).sentences
    for sentence in together:
        alone = explain(model, loaded, [sentence.text], methods=["attn_lrp", "integrated_gradients"]).sentences[0]
        for name, scores in sentence.scores.items():
            assert scores == pytest.approx(alone.scores[name], abs=1e-5), name


def test_a_classifiers_tokens_are_shown_as_words(tmp_path):
    """A byte-level tokenizer's tokens (RoBERTa's, GPT-2's "Ġfilm") are shown without
    their space mark, as the answers' tokens are; a WordPiece continuation keeps its "##"."""
    from lm_models import make_byte_level_tokenizer

    from captum_attention import readable_tokens
    from captum_attention.presentation.explain import explain

    sentence = "the film was good, the plot was dull"
    tokenizer = make_byte_level_tokenizer(sentence)
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=2,
                           pad_token_id=tokenizer.pad_token_id)
    model = tf.GPT2ForSequenceClassification(config).eval()
    raw = tokenizer.convert_ids_to_tokens(tokenizer(sentence).input_ids)
    assert "Ġfilm" in raw
    shown = explain(model, tokenizer, [sentence], methods=["raw"]).sentences[0].tokens
    assert shown == [token.replace("Ġ", "") for token in raw]
    assert readable_tokens(torch.tensor(tokenizer(sentence).input_ids), tokenizer) == shown
    batch = tokenizer([sentence], return_tensors="pt").input_ids
    listed = tokenizer(sentence).input_ids
    assert readable_tokens(listed, tokenizer) == readable_tokens(batch, tokenizer) == shown  # a list, a batch of one
    with pytest.raises(ValueError, match=r"^ids have shape \(2, \d+\), not \(seq_len,\): give one text's ids"):
        readable_tokens(batch.expand(2, -1), tokenizer)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "film", "act", "##ing"]) + "\n")
    wordpiece = tf.BertTokenizerFast(vocab=str(vocab))
    bert_config = tf.BertConfig(vocab_size=len(wordpiece), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                intermediate_size=48)
    bert = tf.BertForSequenceClassification(bert_config).eval()
    assert explain(bert, wordpiece, ["the film acting"], methods=["raw"]).sentences[0].tokens == [
        "[CLS]", "the", "film", "act", "##ing", "[SEP]"
    ]


def test_reports_show_control_characters_as_escapes():
    sentence = SentenceExplanation(
        text="bad \u202efilm\x1b[31m", tokens=["[CLS]", "bad", "\u202efilm\x1b[31m", "[SEP]"], label="neg\x07",
        probability=0.9, target=0, target_label="neg\x07", special=[True, False, False, True],
        scores={"Raw Attention": [0.1, 0.5, 0.4, 0.0]}, probabilities={"neg\x07": 0.9, "pos": 0.1},
    )
    explanations = Explanations([sentence], {"Raw Attention": 0.01}, {"Raw Attention": MethodInfo(False, False)})
    for shown in (render_html(explanations, "model\x1b]0;title\x07"), render_text(explanations)):
        assert not any(unicodedata.category(char) in ("Cc", "Cf") for char in shown.replace("\n", "")), shown
        assert "\\u202efilm\\x1b[31m" in shown


def test_not_a_sequence_classifier(checkpoints):
    _, encoder = checkpoints
    result = run_cli("explain", "the film", "--model", str(encoder))
    assert result.returncode != 0
    assert "BertModel checkpoint, neither a sequence, token or image classifier, a question answerer nor a language model" in result.stderr
    assert result.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("target", ["5", "neutral"])
def test_target_outside_the_labels(checkpoints, target):
    classifier, _ = checkpoints
    result = run_cli("explain", "the film", "--model", str(classifier), "--target", target)
    assert result.returncode != 0
    assert "is not a label of this model (labels: 0=negative, 1=positive)" in result.stderr


def test_target_by_name_or_index(checkpoints):
    classifier, _ = checkpoints
    by_name = run_cli("explain", "the film", "--model", str(classifier), "--target", "negative", "--ig-steps", "5")
    by_index = run_cli("explain", "the film", "--model", str(classifier), "--target", "0", "--ig-steps", "5")
    assert by_name.returncode == by_index.returncode == 0
    assert "explaining: negative" in by_name.stdout
    strip = lambda out: [l for l in out.splitlines() if "wall time" not in l]  # noqa: E731
    assert strip(by_name.stdout) == strip(by_index.stdout)


def test_the_default_table_shows_each_methods_share_of_the_words(checkpoints):
    classifier, _ = checkpoints
    result = run_cli(
        "explain", *SENTENCES, "--model", str(classifier), "--ig-steps", "5", "--batch-size", "1", "--ig-batch-size", "3"
    )
    assert result.returncode == 0, result.stderr
    assert "share of the words" in result.stdout and "the same for every class" in result.stdout
    assert "negative " in result.stdout and "positive " in result.stdout  # both class probabilities
    for line_block in result.stdout.split("\n\n")[1:-1]:
        rows = [line.split() for line in line_block.splitlines()[3:]]
        words = [row for row in rows if row[1] != "."]
        assert all(row[1:] == ["."] * (len(row) - 1) for row in rows if row[1] == ".")
        for column in range(1, len(words[0])):
            values = [float(row[column].rstrip("*")) for row in words]
            assert sum(abs(v) for v in values) == pytest.approx(1.0, abs=2e-3 * len(values))
            starred = [v for row, v in zip(words, values) if row[column].endswith("*")]
            positive = sorted((v for v in values if v > 0), reverse=True)
            assert sorted(starred, reverse=True) == positive[:3]  # the strongest support, never a negative share


def test_python_m_gives_the_version_and_one_line_errors():
    """The whole path from ``python -m``: the imports print nothing, the exit status is the
    process's."""
    result = run_cli_process("--version")
    assert result.returncode == 0 and result.stdout.strip() == "captum-attention 0.1.0" and not result.stderr
    result = run_cli_process("explain", "fine", "--model", "/nonexistent/\x1b[31mred")
    assert result.returncode == 1 and not result.stdout
    assert result.stderr == "captum-attention: error: model folder not found: /nonexistent/\\x1b[31mred\n"


def test_help_has_no_markup():
    result = run_cli("explain", "--help")
    assert result.returncode == 0 and "``" not in result.stdout
    assert "~/.cache/captum-attention" in result.stdout


def _one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert message in result.stderr
    assert "prediction" not in result.stdout, "the check must come before the work"


def test_unwritable_outputs_are_refused_before_any_work(checkpoints, tmp_path):
    classifier, _ = checkpoints
    args = ("explain", "the film", "--model", str(classifier))
    _one_line_error(run_cli(*args, "--html", str(tmp_path / "missing" / "r.html")), "does not exist")
    _one_line_error(run_cli(*args, "--html", str(tmp_path)), "is a folder")
    _one_line_error(run_cli(*args, "--methods", " , "), "--methods is empty")
    _one_line_error(run_cli(*args, "--methods", "raw,nonsense"), "unknown method 'nonsense'; choose from grad_sam")
    _one_line_error(run_cli(*args, "--methods", "lime,raw,shapley"), "unknown methods 'lime', 'shapley'; choose")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    _one_line_error(run_cli("explain", "the film", "--cache-dir", str(a_file)), "is a file, not a folder")
    _one_line_error(run_cli("train", "--cache-dir", str(a_file / "below")), "cannot create or write")
    _one_line_error(run_cli("explain", "the film", "--model", str(a_file)), "is a file: give the checkpoint's folder")


def _copy_checkpoint(source: Path, destination: Path) -> Path:
    import shutil

    shutil.copytree(source, destination)
    return destination


class _NotATensor:
    pass


def test_a_corrupt_or_unsafe_checkpoint_is_one_line(checkpoints, tmp_path):
    import pickle

    classifier, _ = checkpoints
    truncated = _copy_checkpoint(classifier, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _one_line_error(run_cli("explain", "the film", "--model", str(truncated)), "could not load the checkpoint")

    pickled = _copy_checkpoint(classifier, tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": _NotATensor()}))
    _one_line_error(run_cli("explain", "the film", "--model", str(pickled)), "could not load the checkpoint")


def test_a_model_saved_without_its_tokenizer_is_told_to_save_it(checkpoints, tmp_path):
    """transformers' own error cut to its first line said "Couldn't instantiate the backend
    tokenizer from one of:" and nothing more."""
    classifier, _ = checkpoints
    alone = _copy_checkpoint(classifier, tmp_path / "alone")
    for path in alone.iterdir():
        if path.name.startswith(("tokenizer", "vocab", "special_tokens")):
            path.unlink()
    result = run_cli("explain", "the film", "--model", str(alone))
    _one_line_error(result, f"{alone} holds no tokenizer")
    assert f"tokenizer.save_pretrained('{alone}')" in result.stderr
    with pytest.raises(CheckpointError, match="holds no tokenizer"):
        load_classifier(alone)
    (alone / "tokenizer.json").write_text("{not json")  # a tokenizer there, broken: transformers' own error
    with pytest.raises(CheckpointError, match="could not load the checkpoint"):
        load_classifier(alone)


def test_terminal_control_sequences_are_shown_escaped(checkpoints):
    classifier, _ = checkpoints
    result = run_cli("explain", "what a \x1b]0;title\x07 film \u202e", "--model", str(classifier), "--methods", "raw")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout
    assert "\\x1b]0;title\\x07" in result.stdout and "\\u202e" in result.stdout
    _one_line_error(run_cli("explain", "\u200b\u200d \x07", "--model", str(classifier)), "no visible character")


def test_a_file_with_a_byte_order_mark_reads_as_without(checkpoints, tmp_path):
    """A --file saved by an editor that writes a byte-order mark (and CRLF line ends): its
    first sentence is the sentence, not the mark and the sentence."""
    classifier, _ = checkpoints
    sentences = tmp_path / "sentences.txt"
    sentences.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(SENTENCES).encode("utf-8") + b"\r\n")
    path = tmp_path / "out.json"
    assert run_cli("explain", "--file", str(sentences), "--model", str(classifier), "--methods", "raw", "--json", str(path)).returncode == 0
    assert [sentence["text"] for sentence in json.loads(path.read_text())["sentences"]] == SENTENCES


def test_a_sentence_longer_than_the_model_takes_is_cut_and_says_so(checkpoints):
    classifier, _ = checkpoints
    long = " ".join(["the plot was dull"] * 30)  # 120 words, the model takes 64 tokens
    result = run_cli("explain", long, "--model", str(classifier), "--methods", "raw")
    assert result.returncode == 0, result.stderr
    assert "note: cut to the model's 64 tokens (of 122); nothing after 'plot' is seen or explained" in result.stdout
    pair = run_cli("explain", f"{long} ||| what a film", "--model", str(classifier), "--methods", "raw", "--pair-separator", "|||")
    assert pair.returncode == 0, pair.stderr
    assert "note: cut to the model's 64 tokens (of 126); the longer text's last tokens are neither seen nor explained" in pair.stdout
    assert pair.stdout.count("[SEP]") == 2 and "film" in pair.stdout, "the second text is read whole"


def test_text_pairs_are_explained_as_the_model_reads_them(checkpoints, tmp_path):
    """``--pair-separator``: each sentence's two texts tokenized as a pair, with the token
    type ids of the second text, as transformers' pipelines give them to the model."""
    classifier, _ = checkpoints
    pairs = [("the plot was dull", "the acting was superb"), ("what a film", "superb")]
    path = tmp_path / "pairs.json"
    result = run_cli("explain", *(f"{first} ||| {second}" for first, second in pairs), "--model", str(classifier),
                     "--pair-separator", "|||", "--methods", "grad_sam,attn_lrp,integrated_gradients", "--ig-steps", "8",
                     "--raw", "--json", str(path))
    assert result.returncode == 0, result.stderr
    assert "the plot was dull ‖ the acting was superb" in result.stdout

    model = tf.BertForSequenceClassification.from_pretrained(classifier).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(classifier)
    encoded = tokenizer(pairs, padding=True, return_tensors="pt")
    ids, mask, types = encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]
    forward = lambda i, m, t: model(input_ids=i, attention_mask=m, token_type_ids=t).logits  # noqa: E731
    probabilities = forward(ids, mask, types).softmax(-1)
    assert not torch.allclose(probabilities, forward(ids, mask, torch.zeros_like(types)).softmax(-1), atol=0.01)
    targets = probabilities.argmax(-1)
    expected = {
        name: REGISTERED[name](forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask, types))
        for name in ("grad_sam", "attn_lrp")
    }
    baseline = torch.where(torch.isin(ids, torch.tensor(tokenizer.all_special_ids)), ids, tokenizer.pad_token_id)
    integrated = LayerIntegratedGradients(forward, model.get_input_embeddings()).attribute(
        ids, baselines=baseline, target=targets, additional_forward_args=(mask, types), n_steps=8
    ).sum(-1)
    written = json.loads(path.read_text(encoding="utf-8"))
    for row, sentence in enumerate(written["sentences"]):
        length = int(mask[row].sum())
        assert (sentence["text"], sentence["text_pair"]) == pairs[row]
        assert sentence["tokens"] == tokenizer.convert_ids_to_tokens(ids[row, :length].tolist())
        assert list(sentence["probabilities"].values()) == pytest.approx(probabilities[row].tolist(), abs=1e-5)
        for name, scores in expected.items():
            shown = sentence["scores"][REGISTERED[name].get_name()]
            torch.testing.assert_close(torch.tensor(shown), scores[row, :length].detach(), rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(torch.tensor(sentence["scores"]["Integrated Gradients"]), integrated[row, :length].detach(),
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sentence, separator, message", [
    ("the plot was dull", "|||", "sentence 1 is not two texts parted by '|||'"),
    ("the plot ||| ", "|||", "sentence 1 is not two texts parted by '|||'"),
    ("the plot ||| dull", " ", "--pair-separator is empty or blank"),
])
def test_a_sentence_that_is_not_a_pair_is_one_line(checkpoints, sentence, separator, message):
    _one_line_error(run_cli("explain", sentence, "--model", str(checkpoints[0]), "--pair-separator", separator), message)


def test_pairs_whose_token_types_the_ids_do_not_give_are_refused(checkpoints):
    """A tokenizer that marks a pair's texts otherwise than 0 up to the first separator and
    1 after it (here its first separator already 1): token removals could not follow its
    types, so the pair is refused in one line."""
    from tokenizers.processors import TemplateProcessing

    from captum_attention.presentation.explain import classifier_inputs, types_separator

    classifier, _ = checkpoints
    model = tf.BertForSequenceClassification.from_pretrained(classifier).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(classifier)
    pairs = [("the plot was dull", "superb")]
    separator = types_separator(tokenizer, pairs)
    assert separator == tokenizer.sep_token_id and types_separator(tokenizer, ["the plot"]) is None
    classifier_inputs(model, tokenizer, pairs, separator)
    specials = [(token, tokenizer.convert_tokens_to_ids(token)) for token in ("[CLS]", "[SEP]")]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP]:1 $B:1 [SEP]:1", special_tokens=specials
    )
    with pytest.raises(ValueError, match="marks a pair's texts by token types other than") as refused:
        classifier_inputs(model, tokenizer, pairs, separator)
    assert "\n" not in str(refused.value)



def test_a_batch_padded_on_the_left_shows_each_sentences_tokens_and_scores(checkpoints, monkeypatch):
    """A classifier that reads its last position is padded on the left
    (``classifier_padding_side``): each row of the report holds that sentence's tokens and
    their scores, not the padding before them."""
    from captum_attention.presentation import explain as explain_module

    monkeypatch.setattr(explain_module, "classifier_padding_side", lambda *args, **kwargs: "left")
    model, _, tokenizer, _, _, _ = _saved_classifier(checkpoints[0])
    explanations = explain_module.explain(model, tokenizer, SENTENCES, methods=["grad_sam"])
    encoded = tokenizer(SENTENCES, padding=True, padding_side="left", return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    assert not bool(mask[:, 0].all()), "a row padded on the left"
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    targets = forward(ids, mask).argmax(-1)
    expected = REGISTERED["grad_sam"](forward, model=model).attribute(ids, target=targets, additional_forward_args=(mask,))
    for row, sentence in enumerate(explanations.sentences):
        real = mask[row] != 0
        assert sentence.tokens == tokenizer.convert_ids_to_tokens(ids[row, real].tolist())
        torch.testing.assert_close(torch.tensor(sentence.scores["Grad-SAM"]), expected[row, real].detach())


@pytest.mark.parametrize("config, output", [
    (dict(num_labels=1), "p"),
    (dict(num_labels=3, problem_type="multi_label_classification"), "p"),
    (dict(num_labels=1, problem_type="regression"), "score"),
])
def test_a_classifiers_outputs_are_shown_as_transformers_pipeline_gives_them(tmp_path, config, output):
    """One logit (a binary classifier or reward model) and a multi-label model's labels read
    as their sigmoids, a regression model's as its score, as the text-classification
    pipeline reads them: not a softmax over one logit (always 1) or over labels that are
    each their own."""
    folder = tmp_path / "classifier"
    torch.manual_seed(0)
    tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, initializer_range=0.3, **config,
    )).save_pretrained(folder)
    _tokenizer(tmp_path).save_pretrained(folder)
    path = tmp_path / "out.json"
    result = run_cli("explain", SENTENCES[0], "--model", str(folder), "--methods", "grad_sam", "--json", str(path))
    assert result.returncode == 0, result.stderr
    model, _, tokenizer, *_ = _saved_classifier(folder)
    pipeline = tf.pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)
    (scored,) = pipeline([SENTENCES[0]])
    expected = {entry["label"]: entry["score"] for entry in scored}
    written = json.loads(path.read_text(encoding="utf-8"))["sentences"][0]
    assert written["probabilities"] == pytest.approx(expected, abs=1e-5)
    assert written["output"] == output and f"({output}={written['probability']:.3f};" in result.stdout
