"""The command line on a token classifier (``*ForTokenClassification``: a named-entity
tagger): the words explained are those labelled other than "O" (every word where the
model has no such label, or the one given), each label read at the word's first token,
and each method's scores equal to the library's own call on that word alone (Captum's
``LayerIntegratedGradients`` for Integrated Gradients), with the token types the model
was trained with."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from captum.attr import LayerIntegratedGradients
from test_cli import marked_rows, run_cli

from captum_attention import AttentionRollout, AttnLRP, GradSAM
from captum_attention.loading import checkpoint_task, load_token_classifier
from captum_attention.presentation.token_class import explain_token_labels

WORDS = "ada love ##lace lived in london with zoe paris a cat sat on the mat".split()
TEXT = "ada lovelace lived in london with zoe ."
LABELS = ["O", "B-PER", "I-PER", "B-LOC"]


def _vocab(folder: Path) -> Path:
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]) + "\n")
    return vocab


def _bert(labels: list[str], seed: int = 0, o_bias: float = 0.0) -> tf.BertForTokenClassification:
    torch.manual_seed(seed)
    model = tf.BertForTokenClassification(tf.BertConfig(
        vocab_size=len(WORDS) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, initializer_range=0.3, id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    ))
    with torch.no_grad():
        model.classifier.bias[0] += o_bias
    return model


@pytest.fixture(scope="module")
def taggers(tmp_path_factory):
    """A BERT tagger (token types), a DistilBERT one (none), a BERT one whose labels hold
    no "O" (a part-of-speech tagger) and one that labels every word "O", saved with their
    tokenizers; 32 positions."""
    root = tmp_path_factory.mktemp("taggers")
    vocab = str(_vocab(root))
    folders = {name: root / name for name in ("bert", "distilbert", "pos", "outside")}
    _bert(LABELS).save_pretrained(folders["bert"])
    _bert(["NOUN", "VERB", "ADP", "PUNCT"], seed=1).save_pretrained(folders["pos"])
    _bert(LABELS, o_bias=50.0).save_pretrained(folders["outside"])
    torch.manual_seed(0)
    tf.DistilBertForTokenClassification(tf.DistilBertConfig(
        vocab_size=len(WORDS) + 6, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=32,
        initializer_range=0.3, id2label=dict(enumerate(LABELS)), label2id={label: i for i, label in enumerate(LABELS)},
    )).save_pretrained(folders["distilbert"])
    for name, folder in folders.items():
        (tf.DistilBertTokenizerFast if name == "distilbert" else tf.BertTokenizerFast)(vocab=vocab).save_pretrained(folder)
    return folders


def _explained(folder: Path, tmp_path: Path, *options: str, text: str = TEXT) -> dict:
    path = tmp_path / "explanation.json"
    result = run_cli("explain", "--model", str(folder), text, "--json", str(path), *options)
    assert result.returncode == 0, result.stderr
    return json.loads(path.read_text())


def _firsts_and_labels(folder: Path, text: str = TEXT) -> tuple[list[int], list[str], dict]:
    """Each word's first token, and the predicted label of every token, by the model."""
    model, tokenizer = load_token_classifier(folder)
    encoded = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        predicted = model(**encoded).logits[0].argmax(-1).tolist()
    word_ids = encoded.word_ids(0)
    firsts = [i for i, w in enumerate(word_ids) if w is not None and (i == 0 or word_ids[i - 1] != w)]
    return firsts, [model.config.id2label[p] for p in predicted], encoded


@pytest.mark.parametrize("name", ["bert", "distilbert"])
def test_each_words_label_is_explained_as_the_library_explains_it_alone(taggers, tmp_path, name):
    explained = _explained(taggers[name], tmp_path, "--methods", "grad_sam,rollout,attn_lrp,integrated_gradients", "--ig-steps", "6")
    model, tokenizer = load_token_classifier(taggers[name])
    encoded = tokenizer(TEXT, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    types = "token_type_ids" in encoded
    assert types == (name == "bert")
    arguments = (mask, encoded["token_type_ids"]) if types else (mask,)

    def forward(ids, mask, *given):
        return model(input_ids=ids, attention_mask=mask, **({"token_type_ids": given[0]} if types else {})).logits

    baseline = torch.where(torch.isin(ids, torch.tensor(tokenizer.all_special_ids)), ids, tokenizer.pad_token_id)
    assert len(explained["words"]) >= 2
    for word in explained["words"]:
        target = (word["position"], LABELS.index(word["label"]))
        expected = {
            "Grad-SAM": GradSAM(forward, model=model).attribute(ids, target=target, additional_forward_args=arguments),
            "Attention Rollout": AttentionRollout(forward, model=model).attribute(ids, target=target, additional_forward_args=arguments),
            "AttnLRP": AttnLRP(forward, model=model).attribute(ids, target=target, additional_forward_args=arguments),
            "Integrated Gradients": LayerIntegratedGradients(forward, model.get_input_embeddings()).attribute(
                ids, baselines=baseline, target=target, additional_forward_args=arguments, n_steps=6).sum(-1),
        }
        for method, scores in expected.items():
            torch.testing.assert_close(torch.tensor(word["scores"][method]), scores[0].detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bert", "pos"])
def test_the_words_explained_are_those_labelled_other_than_o_at_their_first_token(taggers, tmp_path, name):
    """The tagger of "O" and entities explains its entities; the part-of-speech tagger
    every word. "lovelace" is two tokens: its label is read at "love"."""
    explained = _explained(taggers[name], tmp_path, "--methods", "raw")
    firsts, labels, _ = _firsts_and_labels(taggers[name])
    expected = [i for i in firsts if name == "pos" or labels[i] != "O"]
    assert [word["position"] for word in explained["words"]] == expected and expected
    assert [word["label"] for word in explained["words"]] == [labels[i] for i in expected]
    words = dict(zip(firsts, TEXT.split()))
    assert [word["word"] for word in explained["words"]] == [words[i] for i in expected]
    (window,) = explained["windows"]
    assert window["tokens"][firsts[1] : firsts[2]] == ["love", "##lace"] and window["characters"] == [0, len(TEXT)]
    assert all(word["window"] == 0 for word in explained["words"])


def test_a_given_word_is_explained_at_its_first_token(taggers, tmp_path):
    explained = _explained(taggers["bert"], tmp_path, "--methods", "attn_lrp", "--target", "lovelace")
    firsts, labels, _ = _firsts_and_labels(taggers["bert"])
    (word,) = explained["words"]
    assert explained["given"] and word["word"] == "lovelace" and word["position"] == firsts[1]
    assert word["label"] == labels[firsts[1]]
    phrase = _explained(taggers["bert"], tmp_path, "--methods", "attn_lrp", "--target", "lovelace lived")
    assert [w["position"] for w in phrase["words"]] == [firsts[1]]  # a phrase: its first word
    result = run_cli("explain", "--model", str(taggers["bert"]), TEXT, "--target", "paris")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "--target 'paris' is not in the text: give a word as the text spells it" in result.stderr


def test_no_word_labelled_other_than_o_says_so(taggers, tmp_path):
    explained = _explained(taggers["outside"], tmp_path, "--methods", "raw")
    assert explained["words"] == []
    result = run_cli("explain", "--model", str(taggers["outside"]), TEXT, "--methods", "raw", "--html", str(tmp_path / "r.html"))
    assert result.returncode == 0 and "no word is labelled other than 'O': --target WORD explains one word's label" in result.stdout


LONG = " ".join(["ada lived in london ."] * 8)
"""42 tokens with [CLS] and [SEP]: two windows of the taggers' 32 positions."""


def window_ids(tokenizer, text: str, limit: int) -> list[torch.Tensor]:
    """The windows of ``text`` the model reads, built here from the whole text's tokens:
    ``limit - 2`` of them between [CLS] and [SEP], each after the first starting half a
    window's text back from the previous one's end (consecutive ones sharing
    ``(limit - 2) // 2`` tokens), the last ending with the text."""
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    width = limit - 2
    step = width - width // 2
    starts = [0]
    while starts[-1] + width < len(tokens):
        starts.append(starts[-1] + step)
    return [torch.tensor([[tokenizer.cls_token_id, *tokens[start : start + width], tokenizer.sep_token_id]]) for start in starts]


def max_context(ids: list[torch.Tensor], token: int) -> tuple[int, int]:
    """The window and position of the whole text's ``token``-th token (no special ones)
    where the fewer tokens on either side are the most (then the longer, then the first
    window), by brute force over :func:`window_ids`."""
    width = ids[0].shape[1] - 2
    step = width - width // 2
    best = None
    for index, window in enumerate(ids):
        length = window.shape[1] - 2
        if index * step <= token < index * step + length:
            at = token - index * step
            context = (min(at, length - 1 - at), length)
            if best is None or context > best[0]:
                best = (context, index, at + 1)
    return best[1], best[2]


def test_a_text_longer_than_the_model_takes_is_read_in_windows_each_word_where_it_has_most_context(taggers, tmp_path):
    """Every word of the 42 tokens is labelled and explained (none is cut), each in the
    window where it has the most context, its label and AttnLRP's scores those of that
    window alone."""
    explained = _explained(taggers["pos"], tmp_path, "--methods", "attn_lrp", text=LONG)
    model, tokenizer = load_token_classifier(taggers["pos"])
    ids = window_ids(tokenizer, LONG, 32)
    assert len(ids) == len(explained["windows"]) == 2
    assert [window["tokens"] for window in explained["windows"]] == [tokenizer.convert_ids_to_tokens(i[0]) for i in ids]
    words = LONG.split()
    assert [word["word"] for word in explained["words"]] == words  # one token each, in the text's order
    for index, word in enumerate(explained["words"]):
        window, position = max_context(ids, index)
        assert (word["window"], word["position"]) == (window, position), word
        with torch.no_grad():
            probabilities = model(input_ids=ids[window]).logits[0, position].softmax(-1)
        assert word["label"] == model.config.id2label[int(probabilities.argmax())]
        assert word["probability"] == pytest.approx(float(probabilities.max()), rel=1e-5)
        forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
        expected = AttnLRP(forward, model=model).attribute(
            ids[window], target=(position, int(probabilities.argmax())), additional_forward_args=(torch.ones_like(ids[window]),))
        torch.testing.assert_close(torch.tensor(word["scores"]["AttnLRP"]), expected[0].detach(), rtol=1e-5, atol=1e-6)
    assert {word["window"] for word in explained["words"]} == {0, 1}
    first, end = explained["windows"][1]["characters"]
    assert LONG[first:end] == " ".join(words[15:]) and explained["windows"][0]["characters"] == [0, len(" ".join(words[:30]))]
    result = run_cli("explain", "--model", str(taggers["pos"]), LONG, "--methods", "raw")
    assert "note: the text is longer than the model takes: it was read in 2 overlapping windows" in result.stdout
    assert re.search(rf"^ +london \(\w+, window 2, characters {first}-{end}\) <- ", result.stdout, re.MULTILINE)
    given = _explained(taggers["pos"], tmp_path, "--methods", "raw", "--target", "ada lived in london . ada lived in london . ada", text=LONG)
    assert [(w["window"], w["position"]) for w in given["words"]] == [max_context(ids, 0)]  # a phrase: its first word


def test_the_report_underlines_each_words_first_token(taggers, tmp_path):
    html = tmp_path / "report.html"
    result = run_cli("explain", "--model", str(taggers["pos"]), TEXT, "--methods", "attn_lrp,rollout", "--html", str(html))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(" <- ") == 2 * len(TEXT.split())

    rows = marked_rows(html.read_text())
    firsts, _, _ = _firsts_and_labels(taggers["pos"])
    assert [row.index(True) for row in rows] == firsts * 2 and all(sum(row) == 1 for row in rows)


def test_a_token_classifier_is_recognised_and_misuse_is_refused_in_one_line(taggers, tmp_path):
    bert = str(taggers["bert"])
    assert checkpoint_task(bert) == checkpoint_task(taggers["distilbert"]) == "token-classification"
    refusals = [
        (("explain", "--model", bert, TEXT, "--methods", "alti_logit"), "alti_logit explains"),
        (("explain", "--model", bert, TEXT, "--methods", "attn_lrp_presence_calibrated"),
         "their removals of words move the word whose label is read"),
        (("explain", "--model", bert, TEXT, "--skip", "ada"), "--skip: for a language model's prompt"),
        (("explain", "--model", bert, TEXT, "another text"), "a token classifier explains one text at a time; got 2"),
        (("explain", "--model", bert, "--question", "who?", TEXT), "--question is for an extractive question answerer"),
        (("evaluate", str(tmp_path / "rows.jsonl"), "--model", bert, "--chat"), "--chat and --regions are for a language model's "
         "prompts and answers; a token classifier reads a text"),
    ]
    for arguments, said in refusals:
        result = run_cli(*arguments)
        assert result.returncode == 1 and said in result.stderr, (arguments, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1
    model, _ = load_token_classifier(taggers["bert"])
    with pytest.raises(ValueError, match="words are told apart by a fast tokenizer's offsets and word ids"):
        explain_token_labels(model, SimpleNamespace(is_fast=False), TEXT, methods=["raw"])  # a Python backend: no word ids


def test_a_token_classification_adapter_keeps_its_heads_labels(taggers, tmp_path):
    """A LoRA adapter saved alone (task TOKEN_CLS) of a tagger of 6 labels trained from the
    4-label one: its saved head decides the labels, as PEFT computes it unmerged."""
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(1)
    base = tf.BertForTokenClassification.from_pretrained(taggers["bert"], num_labels=6, ignore_mismatched_sizes=True)
    lora = LoraConfig(task_type="TOKEN_CLS", r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    get_peft_model(base, lora).save_pretrained(adapter)
    assert checkpoint_task(adapter) == "token-classification"
    model, tokenizer = load_token_classifier(adapter)
    encoded = tokenizer(TEXT, return_tensors="pt")
    torch.manual_seed(2)  # the head PEFT loads over is replaced by the adapter's
    fresh = tf.BertForTokenClassification.from_pretrained(taggers["bert"], num_labels=6, ignore_mismatched_sizes=True)
    unmerged = PeftModel.from_pretrained(fresh, adapter).eval()
    with torch.no_grad():
        expected = unmerged.get_base_model()(**encoded).logits
        assert expected.shape[-1] == model.config.num_labels == 6
        torch.testing.assert_close(model(**encoded).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory):
    """A tiny BERT masked language model with its tokenizer; 32 positions."""
    folder = tmp_path_factory.mktemp("masked_lm") / "bert"
    torch.manual_seed(3)
    tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=len(WORDS) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, initializer_range=0.3,
    )).save_pretrained(folder)
    tf.BertTokenizerFast(vocab=str(_vocab(folder.parent))).save_pretrained(folder)
    return folder


MASKED = "ada lived in [MASK] with zoe . a cat sat on the [MASK] ."


def test_each_masks_token_is_explained_as_the_library_explains_it_alone(masked_lm, tmp_path):
    """The most probable token at each mask (or the one given), each method's scores of
    its logit at the mask equal to the method's own call on that mask alone."""
    model = tf.BertForMaskedLM.from_pretrained(masked_lm).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(masked_lm)
    encoded = tokenizer(MASKED, return_tensors="pt")
    ids, mask, types = encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]
    masks = (ids[0] == tokenizer.mask_token_id).nonzero().flatten().tolist()
    with torch.no_grad():
        logits = model(**encoded).logits[0]
    forward = lambda i, m, t: model(input_ids=i, attention_mask=m, token_type_ids=t).logits  # noqa: E731
    for given in (None, "mat"):
        options = () if given is None else ("--target", given)
        explained = _explained(masked_lm, tmp_path, "--methods", "rollout,attn_lrp", *options, text=MASKED)
        assert [w["position"] for w in explained["words"]] == masks and explained["given"] == (given is not None)
        assert [w["word"] for w in explained["words"]] == ["[MASK] 1", "[MASK] 2"]
        for word, position in zip(explained["words"], masks):
            token = int(logits[position].argmax()) if given is None else tokenizer.convert_tokens_to_ids(given)
            assert word["label"] == tokenizer.convert_ids_to_tokens(token)
            assert word["probability"] == pytest.approx(float(logits[position].softmax(-1)[token]), rel=1e-5)
            for method, cls in (("Attention Rollout", AttentionRollout), ("AttnLRP", AttnLRP)):
                expected = cls(forward, model=model).attribute(ids, target=(position, token), additional_forward_args=(mask, types))
                torch.testing.assert_close(torch.tensor(word["scores"][method]), expected[0].detach(), rtol=1e-5, atol=1e-6)


def test_the_report_underlines_each_mask(masked_lm, tmp_path):
    """The mask, a special token left uncoloured, is still marked as the token read."""
    html = tmp_path / "masks.html"
    assert run_cli("explain", "--model", str(masked_lm), MASKED, "--methods", "raw", "--html", str(html)).returncode == 0
    page = html.read_text()
    assert page.count('class="tok special marked"') == 2 and page.count("marked\"") == 2
    assert "Masks and their predicted tokens: [MASK] 1 " in page


def test_a_prediction_in_an_embedding_row_past_the_vocabulary_is_shown_by_its_id(masked_lm):
    """A model's embedding table may be padded past its tokenizer's vocabulary (ModernBERT's
    50,368 rows for 50,280 tokens): a mask predicted there showed as None and the report
    failed on it. It is named by its id and explained."""
    from captum_attention.presentation.token_class import explain_masks

    tokenizer = tf.BertTokenizerFast.from_pretrained(masked_lm)
    rows = len(tokenizer) + 4
    torch.manual_seed(3)
    model = tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=rows, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, initializer_range=0.3,
    )).eval()
    with torch.no_grad():
        model.cls.predictions.bias[rows - 1] += 100.0
    explanation = explain_masks(model, tokenizer, MASKED, methods=["attn_lrp"])
    assert [word.label for word in explanation.words] == [f"<id {rows - 1}>"] * 2
    ids = tokenizer(MASKED, return_tensors="pt")["input_ids"]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    expected = AttnLRP(forward, model=model).attribute(ids, target=(explanation.words[0].position, rows - 1),
                                                       additional_forward_args=(torch.ones_like(ids),))
    torch.testing.assert_close(torch.tensor(explanation.words[0].scores["AttnLRP"]), expected[0].detach(), rtol=1e-5, atol=1e-6)


def test_a_masked_language_models_misuse_is_refused_in_one_line(masked_lm, tmp_path):
    folder = str(masked_lm)
    assert checkpoint_task(masked_lm) == "fill-mask"
    refusals = [
        (("explain", "--model", folder, "ada lived in london ."), "[MASK] is not in the text: put it where the word to predict goes"),
        (("explain", "--model", folder, MASKED, "--target", "lovelace"), "--target 'lovelace' is 2 tokens to the tokenizer (love ##lace)"),
        (("explain", "--model", folder, MASKED, "--target", "park"), "--target 'park' is not in the tokenizer's vocabulary"),
        (("explain", "--model", folder, MASKED, "--methods", "alti_logit"), "alti_logit explains"),
        (("evaluate", str(tmp_path / "rows.jsonl"), "--model", folder, "--metrics", "pointing_game"), "unknown metric 'pointing_game'; "
         "choose from comprehensiveness, sufficiency, datamodeling"),
    ]
    for arguments, said in refusals:
        result = run_cli(*arguments)
        assert result.returncode == 1 and said in result.stderr, (arguments, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_masks_past_one_window_are_each_read_where_they_have_most_context(masked_lm, tmp_path):
    """A mask at each end of 38 tokens (two windows of 32 positions): the first read in
    the first window, the last in the second, each token and AttnLRP's scores those of
    its window alone."""
    text = "[MASK] " + " ".join(["ada lived in london ."] * 7) + " [MASK]"
    explained = _explained(masked_lm, tmp_path, "--methods", "attn_lrp", text=text)
    model = tf.BertForMaskedLM.from_pretrained(masked_lm).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(masked_lm)
    ids = window_ids(tokenizer, text, 32)
    assert len(ids) == len(explained["windows"]) == 2
    last = len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 1
    assert [(w["window"], w["position"]) for w in explained["words"]] == [max_context(ids, 0), max_context(ids, last)] == \
        [(0, 1), (1, ids[1].shape[1] - 2)]
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    for word in explained["words"]:
        window = ids[word["window"]]
        with torch.no_grad():
            token = int(model(input_ids=window).logits[0, word["position"]].argmax())
        assert word["label"] == tokenizer.convert_ids_to_tokens(token)
        expected = AttnLRP(forward, model=model).attribute(window, target=(word["position"], token),
                                                           additional_forward_args=(torch.ones_like(window),))
        torch.testing.assert_close(torch.tensor(word["scores"]["AttnLRP"]), expected[0].detach(), rtol=1e-5, atol=1e-6)


def test_a_sentencepiece_taggers_windows_start_mid_word_and_show_words_without_their_space():
    """XLM-R's kind of tokenizer: a word's offsets hold its space ("▁lived"), and a window
    that starts mid-word decodes to ids that re-encode otherwise. The words are shown
    without the space, the tokens without a warning, and each word's AttnLRP scores are
    its window's alone."""
    import warnings

    from lm_models import make_sentencepiece_tokenizer

    tokenizer = make_sentencepiece_tokenizer("ada lived in london . the cat sat on the mat in paris .")
    config = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=34, pad_token_id=1, initializer_range=0.3)
    torch.manual_seed(0)
    model = tf.XLMRobertaForTokenClassification(tf.XLMRobertaConfig(**config, num_labels=3)).eval()
    text = " ".join(["ada lived in london ."] * 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explanation = explain_token_labels(model, tokenizer, text, methods=["attn_lrp"])
    ids = window_ids(tokenizer, text, 32)
    assert len(explanation.windows) == len(ids) > 2
    assert [word.word for word in explanation.words] == text.split()
    assert any(tokenizer.convert_ids_to_tokens(int(window[0, 1])).isalpha() for window in ids[1:])  # a window starts mid-word
    forward = lambda i, m: model(input_ids=i, attention_mask=m).logits  # noqa: E731
    from captum_attention.presentation.question_answering import explain_question

    answerer = tf.XLMRobertaForQuestionAnswering(tf.XLMRobertaConfig(**config)).eval()
    answer = explain_question(answerer, tokenizer, "where did ada live", "ada lived in london .", "in london", ["raw"])
    assert answer.answer == "in london" and answer.predicted == answer.predicted.strip()
    for word in explanation.words[::5]:
        window = ids[word.window]
        expected = AttnLRP(forward, model=model).attribute(window, target=(word.position, model.config.label2id[word.label]),
                                                           additional_forward_args=(torch.ones_like(window),))
        torch.testing.assert_close(torch.tensor(word.scores["AttnLRP"]), expected[0].detach(), rtol=1e-5, atol=1e-6)


def test_umt5s_tagger_is_an_encoder_and_t5gemmas_is_refused_in_one_line(taggers):
    """UMT5's token classifier keeps its family's ``is_encoder_decoder`` over an encoder
    alone: it was told to pass decoder ids it does not take, with a traceback. It is
    explained as the encoder it is; T5Gemma's, whose decoder reads the text again, is
    refused in one line."""
    from zoo import Architecture, build

    _, tokenizer = load_token_classifier(taggers["bert"])
    torch.manual_seed(0)
    umt5 = tf.UMT5ForTokenClassification(tf.UMT5Config(
        vocab_size=len(WORDS) + 6, d_model=32, d_kv=8, d_ff=36, num_layers=2, num_heads=4, num_labels=4,
        initializer_factor=3.0, pad_token_id=0, decoder_start_token_id=0,
    )).eval()
    assert umt5.config.is_encoder_decoder
    explanation = explain_token_labels(umt5, tokenizer, TEXT, "london", ["attn_lrp", "rollout"])
    (word,) = explanation.words
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    forward = lambda i, m: umt5(input_ids=i, attention_mask=m).logits  # noqa: E731
    target = (word.position, umt5.config.label2id[word.label])
    for method, cls in (("AttnLRP", AttnLRP), ("Attention Rollout", AttentionRollout)):
        expected = cls(forward, model=umt5).attribute(ids, target=target, additional_forward_args=(torch.ones_like(ids),))
        torch.testing.assert_close(torch.tensor(word.scores[method]), expected[0].detach(), rtol=1e-5, atol=1e-6)
    assert sum(score > 1e-3 for score in word.scores["Attention Rollout"]) > 1  # the tokens mix, as an encoder's do
    t5gemma = build(Architecture("t5gemma", "T5GemmaForTokenClassification", "token classification"))
    with pytest.raises(ValueError, match=r"^T5GemmaForTokenClassification reads the text twice, in its encoder and again in "
                       r"its decoder, whose states give the labels: explain an encoder's labels [^\n]*$"):
        explain_token_labels(t5gemma, tokenizer, TEXT, methods=["raw"])


def test_a_byte_level_tokenizer_without_token_types_places_words_masks_and_answers(tmp_path):
    """RoBERTa's kind of tokenizer: no token types, a pair read as <s> A </s></s> B </s>,
    words as "Ġword" tokens whose offsets leave the space out, a mask's target token taken as
    a sentence holds it, after a space ("Ġmat", not "mat"). Each of the three explanations
    equals AttnLRP's own call at its token."""
    from lm_models import make_roberta_tokenizer

    from captum_attention.presentation.question_answering import explain_question
    from captum_attention.presentation.token_class import explain_masks

    tokenizer = make_roberta_tokenizer(" ".join(WORDS).replace("##", "") + " where did sit . <mask>")
    config = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=64, pad_token_id=1, initializer_range=0.3)
    torch.manual_seed(4)
    heads = {
        "tags": tf.RobertaForTokenClassification(tf.RobertaConfig(**config, num_labels=4)).eval(),
        "masks": tf.RobertaForMaskedLM(tf.RobertaConfig(**config)).eval(),
        "answers": tf.RobertaForQuestionAnswering(tf.RobertaConfig(**config)).eval(),
    }
    tags = explain_token_labels(heads["tags"], tokenizer, TEXT, "lovelace", ["attn_lrp"])
    masks = explain_masks(heads["masks"], tokenizer, "ada lived in <mask> .", "mat", ["attn_lrp"])
    answer = explain_question(heads["answers"], tokenizer, "where did the cat sit", "the cat sat on the mat", "the mat", ["attn_lrp"])
    encoded = tokenizer(TEXT, return_offsets_mapping=True)
    assert "token_type_ids" not in encoded
    (word,) = tags.words
    assert word.word == "lovelace" and encoded["offset_mapping"][word.position][0] == TEXT.index("lovelace")
    (mask,) = masks.words
    spaced, bare = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" mat", "mat"))
    assert len(spaced) == len(bare) == 1 and spaced != bare and mask.label == "mat"  # the word as a sentence holds it
    assert answer.answer == "the mat" and answer.in_context[answer.start] and answer.in_context[answer.end]
    cases = [
        (heads["tags"], TEXT, (word.position, heads["tags"].config.label2id[word.label]), word.scores),
        (heads["masks"], "ada lived in <mask> .", (mask.position, spaced[0]), mask.scores),
    ]
    for model, text, target, scores in cases:
        ids = tokenizer(text, return_tensors="pt")
        forward = lambda i, m, model=model: model(input_ids=i, attention_mask=m).logits  # noqa: E731
        expected = AttnLRP(forward, model=model).attribute(ids["input_ids"], target=target, additional_forward_args=(ids["attention_mask"],))
        torch.testing.assert_close(torch.tensor(scores["AttnLRP"]), expected[0].detach(), rtol=1e-5, atol=1e-6)
    pair = tokenizer("where did the cat sit", "the cat sat on the mat", return_tensors="pt")
    start = lambda i, m: heads["answers"](input_ids=i, attention_mask=m).start_logits  # noqa: E731
    expected = AttnLRP(start, model=heads["answers"]).attribute(
        pair["input_ids"], target=answer.start, additional_forward_args=(pair["attention_mask"],))
    torch.testing.assert_close(torch.tensor(answer.scores["AttnLRP"]["start"]), expected[0].detach(), rtol=1e-5, atol=1e-6)
