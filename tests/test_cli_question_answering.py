"""The command line on an extractive question answerer (``*ForQuestionAnswering``): the
answer's span chosen as the largest product of the start and end softmaxes over the
context, and each method's scores of its start and end logits equal to the library's own
calls (Captum's ``LayerIntegratedGradients`` for Integrated Gradients), with the token
types the model was trained with."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from captum.attr import LayerIntegratedGradients
from test_cli import marked_rows, run_cli

from captum_attention import AttentionRollout, AttnLRP, GradSAM
from captum_attention.loading import checkpoint_task, load_question_answerer
from captum_attention.presentation.question_answering import (
    MAX_ANSWER_TOKENS, best_span, context_tokens, explain_question, question_inputs,
)

WORDS = "where did the cat sit on mat a dog ran to park who saw it bird tree in".split()
QUESTION = "where did the cat sit"
CONTEXT = "the cat did sit on the mat . a dog ran to the park"


def _tokenizer(folder: Path) -> tf.BertTokenizerFast:
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]) + "\n")
    return tf.BertTokenizerFast(vocab=str(vocab))


@pytest.fixture(scope="module")
def answerers(tmp_path_factory):
    """A BERT question answerer (token types) and a DistilBERT one (none), saved with their
    tokenizer; 64 positions."""
    root = tmp_path_factory.mktemp("question_answerers")
    bert, distilbert = root / "bert", root / "distilbert"
    torch.manual_seed(0)
    tf.BertForQuestionAnswering(tf.BertConfig(
        vocab_size=len(WORDS) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, initializer_range=0.3,
    )).save_pretrained(bert)
    tf.DistilBertForQuestionAnswering(tf.DistilBertConfig(
        vocab_size=len(WORDS) + 6, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=64,
        initializer_range=0.3,
    )).save_pretrained(distilbert)
    _tokenizer(root).save_pretrained(bert)
    tf.DistilBertTokenizerFast(vocab=str(root / "vocab.txt")).save_pretrained(distilbert)
    return bert, distilbert


def _explained(folder: Path, tmp_path: Path, *options: str) -> dict:
    path = tmp_path / "explanation.json"
    result = run_cli("explain", "--model", str(folder), "--question", QUESTION, CONTEXT, "--json", str(path), *options)
    assert result.returncode == 0, result.stderr
    return json.loads(path.read_text())


def _head(model, end: str, types: bool):
    def forward(ids, mask, *given):
        extra = {"token_type_ids": given[0]} if types else {}
        return getattr(model(input_ids=ids, attention_mask=mask, **extra), f"{end}_logits")

    return forward


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_each_method_explains_the_answers_start_and_end_as_the_library_does(answerers, tmp_path, name):
    folder = answerers[0] if name == "bert" else answerers[1]
    explained = _explained(folder, tmp_path, "--methods", "grad_sam,rollout,attn_lrp,integrated_gradients", "--ig-steps", "6")
    model, tokenizer = load_question_answerer(folder)
    encoded = tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    types = "token_type_ids" in encoded
    assert types == (name == "bert")
    arguments = (mask, encoded["token_type_ids"]) if types else (mask,)
    baseline = torch.where(torch.isin(ids, torch.tensor(tokenizer.all_special_ids)), ids, tokenizer.pad_token_id)
    for end in ("start", "end"):
        position, forward = explained[end], _head(model, end, types)
        expected = {
            "Grad-SAM": GradSAM(forward, model=model).attribute(ids, target=position, query_index=position, additional_forward_args=arguments),
            "Attention Rollout": AttentionRollout(forward, model=model).attribute(
                ids, target=position, query_index=position, additional_forward_args=arguments),
            "AttnLRP": AttnLRP(forward, model=model).attribute(ids, target=position, additional_forward_args=arguments),
            "Integrated Gradients": LayerIntegratedGradients(forward, model.get_input_embeddings()).attribute(
                ids, baselines=baseline, target=position, additional_forward_args=arguments, n_steps=6).sum(-1),
        }
        for method, scores in expected.items():
            torch.testing.assert_close(torch.tensor(explained["scores"][method][end]), scores[0].detach(), rtol=1e-5, atol=1e-6)
    if types:  # the token types change what the model computes: leaving them out would be wrong
        with torch.no_grad():
            assert not torch.allclose(model(input_ids=ids, attention_mask=mask).start_logits, model(**encoded).start_logits)


def test_the_answer_is_the_best_span_of_the_context_as_a_brute_force_search_finds(answerers, tmp_path):
    explained = _explained(answerers[0], tmp_path, "--methods", "raw")
    model, tokenizer = load_question_answerer(answerers[0])
    encoded = tokenizer(QUESTION, CONTEXT, return_tensors="pt", return_offsets_mapping=True)
    with torch.no_grad():
        outputs = model(**{k: v for k, v in encoded.items() if k != "offset_mapping"})
    context = [i for i, sequence in enumerate(encoded.sequence_ids(0)) if sequence == 1]
    starts = outputs.start_logits[0, context].softmax(-1)
    ends = outputs.end_logits[0, context].softmax(-1)
    pairs = [(float(starts[a] * ends[b]), a, b) for a in range(len(context)) for b in range(a, min(len(context), a + 15))]
    _, a, b = max(pairs)
    assert (explained["start"], explained["end"]) == (context[a], context[b])
    offsets = encoded["offset_mapping"][0]
    assert explained["answer"] == CONTEXT[int(offsets[context[a]][0]) : int(offsets[context[b]][1])]
    assert explained["start_probability"] == pytest.approx(float(starts[a]), rel=1e-5)
    assert explained["end_probability"] == pytest.approx(float(ends[b]), rel=1e-5)
    assert explained["answer"] == explained["predicted"] and not explained["given"]


def test_the_span_stays_in_the_context_and_within_its_length():
    """Logits whose best pair lies in the question, or ends too far from its start, are
    passed over for the best allowed span."""
    start, end = torch.zeros(40), torch.zeros(40)
    in_context = torch.arange(40) >= 5
    start[1], end[2] = 9.0, 9.0  # the question's tokens
    start[10], end[10 + MAX_ANSWER_TOKENS] = 5.0, 5.0  # one token too long
    end[10 + MAX_ANSWER_TOKENS - 1] = 4.0
    end[8] = 8.0  # before the start: no span
    assert best_span(start, end, in_context) == (10, 10 + MAX_ANSWER_TOKENS - 1)


def test_a_given_answer_is_found_in_the_context_and_explained(answerers, tmp_path):
    explained = _explained(answerers[0], tmp_path, "--methods", "attn_lrp", "--target", "the park")
    tokens = explained["tokens"]
    assert explained["given"] and explained["answer"] == "the park"
    assert tokens[explained["start"] : explained["end"] + 1] == ["the", "park"] and explained["start"] > tokens.index("[SEP]")
    for missing, said in (("a bird", "is not in the context"), ("cat sit", "is not in the context")):  # "cat sit": the question's
        result = run_cli("explain", "--model", str(answerers[0]), "--question", QUESTION, CONTEXT, "--target", missing)
        assert result.returncode == 1 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1


def _windows_by_hand(model, tokenizer, context: str, stride: int) -> list[dict]:
    """Each window of the context the tokenizer gives at 64 tokens sharing ``stride``, run
    alone: its ids, token types, context tokens, characters and each end's log-softmax
    over its context tokens."""
    encoded = tokenizer(QUESTION, context, truncation="only_second", max_length=64, stride=stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True)
    windows = []
    for row, ids in enumerate(encoded["input_ids"]):
        in_context = torch.tensor([index == 1 for index in encoded.sequence_ids(row)])
        types = torch.tensor([encoded["token_type_ids"][row]])
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), token_type_ids=types)
        log_p = {end: getattr(out, f"{end}_logits")[0].masked_fill(~in_context, float("-inf")).log_softmax(-1)
                 for end in ("start", "end")}
        windows.append({"ids": torch.tensor([ids]), "types": types, "in_context": in_context,
                        "offsets": encoded["offset_mapping"][row], "log_p": log_p})
    return windows


def test_a_context_longer_than_the_model_takes_is_read_in_overlapping_windows(answerers, tmp_path):
    """As transformers' former pipeline read it: the answer is the best span of every
    window (a brute-force search here), explained in its window; a given answer in the
    first window that holds it."""
    context = " ".join(["the dog ran to the park ."] * 12) + " a bird"
    model, tokenizer = load_question_answerer(answerers[0])
    room = 64 - len(tokenizer(QUESTION)["input_ids"]) - 1
    windows = _windows_by_hand(model, tokenizer, context, room // 2)
    assert len(windows) > 2
    best = max(
        ((float(w["log_p"]["start"][s] + w["log_p"]["end"][e]), k, s, e)
         for k, w in enumerate(windows) for s in range(64) for e in range(s, min(s + MAX_ANSWER_TOKENS, 64))
         if s < len(w["in_context"]) and e < len(w["in_context"]) and w["in_context"][s] and w["in_context"][e]),
        key=lambda found: found[0],
    )
    path = tmp_path / "windows.json"
    result = run_cli("explain", "--model", str(answerers[0]), "--question", QUESTION, context, "--methods", "raw", "--json", str(path))
    assert result.returncode == 0, result.stderr
    explained = json.loads(path.read_text())
    _, k, s, e = best
    offsets = windows[k]["offsets"]
    assert explained["windows"] == len(windows) and explained["answer"] == context[offsets[s][0] : offsets[e][1]]
    assert explained["start_probability"] == pytest.approx(float(windows[k]["log_p"]["start"][s].exp()), abs=1e-6)
    assert f"note: the context is longer than the model takes: it was read in {len(windows)} overlapping windows" in result.stdout

    result = run_cli("explain", "--model", str(answerers[0]), "--question", QUESTION, context, "--methods", "attn_lrp",
                     "--target", "a bird", "--json", str(path))
    assert result.returncode == 0, result.stderr
    given = json.loads(path.read_text())
    last = windows[-1]
    ends = [max(b for (_, b), inside in zip(w["offsets"], w["in_context"].tolist()) if inside) for w in windows]
    assert ends[-1] == len(context) and max(ends[:-1]) < len(context)  # only the last window holds "a bird"
    assert explained["windows"] == given["windows"] and given["window"][1] == len(context)
    tokens = tokenizer.convert_ids_to_tokens(last["ids"][0].tolist())
    assert given["tokens"] == tokens and tokens[given["start"] : given["end"] + 1] == ["a", "bird"]
    forward = _head(model, "start", types=True)
    expected = AttnLRP(forward, model=model).attribute(last["ids"], target=given["start"],
                                                       additional_forward_args=(torch.ones_like(last["ids"]), last["types"]))
    torch.testing.assert_close(torch.tensor(given["scores"]["AttnLRP"]["start"]), expected[0].float(), atol=1e-5, rtol=1e-4)
    long_question = " ".join([QUESTION] * 13)
    refused = run_cli("explain", "--model", str(answerers[0]), "--question", long_question, CONTEXT)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1
    assert "the question and the special tokens are 68 tokens, leaving no room for the context within the 64" in refused.stderr


def test_windows_are_read_with_a_tokenizer_that_has_no_padding_token():
    """GPT-2's kind of tokenizer names no padding token: the windows of a long context (and
    of a tagger's long text) are read each alone, unpadded, the answer's start explained
    as AttnLRP explains its window."""
    from lm_models import make_byte_level_tokenizer

    from captum_attention.presentation.token_class import explain_token_labels

    tokenizer = make_byte_level_tokenizer(" ".join(WORDS) + " .")
    assert tokenizer.pad_token is None
    config = dict(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(5)
    answerer = tf.GPT2ForQuestionAnswering(tf.GPT2Config(**config)).eval()
    tagger = tf.GPT2ForTokenClassification(tf.GPT2Config(**config, num_labels=3)).eval()
    context = " ".join(["the dog ran to the park ."] * 6) + " a bird"
    explanation = explain_question(answerer, tokenizer, QUESTION, context, "a bird", ["attn_lrp"])
    assert explanation.windows > 1 and explanation.window[1] == len(context)
    stride = (32 - len(tokenizer(QUESTION)["input_ids"])) // 2  # half the room the question leaves (no special tokens)
    windows = tokenizer(QUESTION, context, truncation="only_second", max_length=32, stride=stride,
                        return_overflowing_tokens=True)["input_ids"]
    ids = torch.tensor([windows[-1]])
    assert explanation.windows == len(windows) and len(explanation.tokens) == len(windows[-1]) < 32
    forward = lambda i, m: answerer(input_ids=i, attention_mask=m).start_logits  # noqa: E731
    expected = AttnLRP(forward, model=answerer).attribute(ids, target=explanation.start,
                                                          additional_forward_args=(torch.ones_like(ids),))
    torch.testing.assert_close(torch.tensor(explanation.scores["AttnLRP"]["start"]), expected[0].float(), atol=1e-5, rtol=1e-4)
    labels = explain_token_labels(tagger, tokenizer, context, methods=["raw"])
    assert len(labels.windows) > 1 and {word.window for word in labels.words} == set(range(len(labels.windows)))


def test_a_tokenizer_that_pads_on_the_left_reads_the_context_first(answerers):
    """XLNet's order: the context, then the question; the answer is sought in the context."""
    model, tokenizer = load_question_answerer(answerers[0])
    tokenizer.padding_side = "left"
    encoded = question_inputs(tokenizer, QUESTION, CONTEXT)
    in_context = context_tokens(encoded, tokenizer)
    first = int(in_context.nonzero()[0])
    assert tokenizer.convert_ids_to_tokens(encoded["input_ids"][0, first : first + 3].tolist()) == ["the", "cat", "did"]
    assert first == 1 and not in_context[-3]
    explanation = explain_question(model, tokenizer, QUESTION, CONTEXT, methods=["raw"])
    assert in_context[explanation.start] and in_context[explanation.end]


def test_the_report_underlines_the_answer_and_warns_of_unknown_words(answerers, tmp_path):
    html = tmp_path / "report.html"
    result = run_cli("explain", "--model", str(answerers[0]), "--question", QUESTION, CONTEXT.replace("did sit", "sat"),
                     "--methods", "attn_lrp,rollout", "--html", str(html))
    assert result.returncode == 0, result.stderr
    assert "warning: the tokenizer read 1 of the question and context's" in result.stderr
    assert "question: where did the cat sit" in result.stdout and "answer, predicted: '" in result.stdout
    assert result.stdout.count("  start (") == result.stdout.count("    end (") == 2

    rows = marked_rows(html.read_text())
    explained = _explained(answerers[0], tmp_path, "--methods", "raw")
    assert len(rows) == 4 and len(rows[0]) == len(explained["tokens"]) - 1  # the unknown word is one token less
    for row in rows:
        assert [i for i, marked in enumerate(row) if marked] == [*range(row.index(True), row.index(True) + sum(row))]


def test_a_question_answerer_is_recognised_and_misuse_is_refused_in_one_line(answerers, tmp_path):
    bert = str(answerers[0])
    assert checkpoint_task(bert) == checkpoint_task(answerers[1]) == "question-answering"
    refusals = [
        (("explain", "--model", bert, CONTEXT), "give the question as --question TEXT"),
        (("explain", "--model", bert, "--question", QUESTION, CONTEXT, "--methods", "alti_logit"), "alti_logit explains"),
        (("explain", "--model", bert, "--question", QUESTION, CONTEXT, "--methods", "attn_lrp_half_contexts"),
         "their removals of words move an answer's start and end"),
        (("explain", "--model", bert, "--question", QUESTION, CONTEXT, "--per-token"), "--per-token: for a language model's prompt"),
        (("explain", "--model", bert, "--question", QUESTION, CONTEXT, "another context"), "explains one context at a time; got 2"),
        (("explain", "--model", bert, "--question", QUESTION, f"{CONTEXT} ||| x", "--pair-separator", "|||"),
         "holds an extractive question answerer"),
        (("explain", "--question", QUESTION, CONTEXT), "--question is for an extractive question answerer"),
        (("evaluate", str(tmp_path / "rows.jsonl"), "--model", bert, "--methods", "attn_lrp_half_contexts"),
         "their removals of words move an answer's start and end"),
    ]
    for arguments, said in refusals:
        result = run_cli(*arguments)
        assert result.returncode == 1 and said in result.stderr, (arguments, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_token_types_a_model_does_not_take_are_left_out(answerers):
    """A BERT tokenizer gives token types; DistilBERT takes none: they are not passed."""
    model, own = load_question_answerer(answerers[1])
    bert_tokenizer = tf.BertTokenizerFast.from_pretrained(answerers[0])
    assert "token_type_ids" in bert_tokenizer(QUESTION, CONTEXT) and "token_type_ids" not in own(QUESTION, CONTEXT)
    given = explain_question(model, bert_tokenizer, QUESTION, CONTEXT, methods=["attn_lrp"])
    alone = explain_question(model, own, QUESTION, CONTEXT, methods=["attn_lrp"])
    assert (given.start, given.end) == (alone.start, alone.end) and given.scores == alone.scores
    slow = SimpleNamespace(is_fast=False)  # a Python or SentencePiece backend: no offsets
    with pytest.raises(ValueError, match="placed in its context by a fast tokenizer's offsets and word ids"):
        explain_question(model, slow, QUESTION, CONTEXT, methods=["raw"])


def test_an_encoder_decoders_answerer_is_refused_in_one_line(answerers, tmp_path):
    """BART's answerer reads the text again in its decoder, whose states give the logits:
    the methods would need the decoder's ids as a second input."""
    folder = tmp_path / "bart"
    torch.manual_seed(0)
    tf.BartForQuestionAnswering(tf.BartConfig(
        vocab_size=len(WORDS) + 6, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
    )).save_pretrained(folder)
    tf.BertTokenizerFast.from_pretrained(answerers[0]).save_pretrained(folder)
    result = run_cli("explain", "--model", str(folder), "--question", QUESTION, CONTEXT, "--methods", "raw")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "BartForQuestionAnswering reads the question and context twice" in result.stderr


def test_a_question_answering_adapter_is_merged_into_its_base(answerers, tmp_path):
    """A LoRA adapter saved alone (task QUESTION_ANS, the answer head saved with it) is
    read as a question answerer, as PEFT computes it unmerged: its LoRA layers in the base
    model (PeftModelForQuestionAnswering's own forward drops the token types)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(1)
    base = tf.BertForQuestionAnswering.from_pretrained(answerers[0])
    lora = LoraConfig(task_type="QUESTION_ANS", r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    get_peft_model(base, lora).save_pretrained(adapter)
    assert checkpoint_task(adapter) == "question-answering"
    model, tokenizer = load_question_answerer(adapter)
    encoded = tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    unmerged = PeftModel.from_pretrained(tf.BertForQuestionAnswering.from_pretrained(answerers[0]), adapter).eval()
    with torch.no_grad():
        expected = unmerged.get_base_model()(**encoded).start_logits
        torch.testing.assert_close(model(**encoded).start_logits, expected, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(tf.BertForQuestionAnswering.from_pretrained(answerers[0])(**encoded).start_logits, expected)
