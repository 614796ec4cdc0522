"""Language models' answers explained as a whole (spans) and token by token, and Captum's
LLM interface over the attention methods."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lm_models import lm_span_reference, make_decoder, make_prompts
from lrp_reference import llama_relevance
from methods import MAP_METHODS, METHODS

from captum_attention import AttentionFlow, AttnLRP, RawAttention

CONTINUATION = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 14, 15]])


def _sequence(prompts, continuation):
    """The prompts (left padded) followed by the continuation, as one batch."""
    ids = torch.cat([prompts.input_ids, continuation], dim=1)
    mask = torch.cat([prompts.attention_mask, torch.ones_like(continuation)], dim=1)
    return SimpleNamespace(input_ids=ids, attention_mask=mask, real=mask.bool())


def span_reference(method, ref, real: torch.Tensor, positions: range) -> torch.Tensor:
    """The reference on each example's real tokens up to the span's last query, the rows of
    the span's positions summed (Grad-SAM has no query row: it credits every row)."""
    reference = METHODS[method].reference
    scores = torch.zeros(real.shape)
    last = positions[-1]
    for b in range(real.shape[0]):
        idx = (real[b] & (torch.arange(real.shape[1]) <= last)).nonzero().flatten()
        block = lambda t: t[b : b + 1][:, :, idx][:, :, :, idx]  # noqa: E731
        sub = SimpleNamespace(attentions=[block(a) for a in ref.attentions], grads=[block(g) for g in ref.grads])
        rows = [int((idx == p).nonzero()) for p in positions] if method != "grad_sam" else [0]
        scores[b, idx] = sum(reference(sub, [len(idx)], row)[0] for row in rows)
    return scores


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder", ["llama", "gpt2"])
@pytest.mark.parametrize("method", MAP_METHODS)
def test_span_equals_the_reference_of_the_summed_log_probability(decoder, method):
    model = make_decoder(decoder)
    prompts = make_prompts(side="left")
    sequence = _sequence(prompts, CONTINUATION)
    prompt_len, new_tokens = prompts.input_ids.shape[1], CONTINUATION.shape[1]
    ref = lm_span_reference(model, sequence, CONTINUATION)
    scores = METHODS[method].cls(model).attribute_span(
        prompts.input_ids, CONTINUATION, additional_forward_args=(prompts.attention_mask,)
    )
    positions = range(prompt_len - 1, prompt_len - 1 + new_tokens)
    expected = span_reference(method, ref, sequence.real, positions)
    assert expected.abs().max() > 0
    scale = expected.abs().max().item()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * scale)
    assert (scores[:, -1] == 0).all(), "no explained position sees the last token"


@pytest.mark.usefixtures("capture_mode")
def test_attn_lrp_span_equals_the_reference_of_the_summed_log_probability():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    sequence = _sequence(prompts, CONTINUATION)
    expected = llama_relevance(model, sequence.input_ids, sequence.attention_mask, None, span=CONTINUATION).relevance
    expected = expected * sequence.attention_mask
    expected[:, -1] = 0.0
    scores = AttnLRP(model).attribute_span(prompts.input_ids, CONTINUATION, additional_forward_args=(prompts.attention_mask,))
    scale = expected.abs().max().item()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("method", ["rollout", "raw", "attn_lrp"])
def test_linear_methods_spans_are_the_sum_of_the_log_prob_token_rows(method):
    """Rollout and raw attention are linear in the explained rows, AttnLRP in the output's
    gradient: the span's scores are exactly the sum of attribute_continuation's
    log-probability rows (Grad-SAM's ReLU and Transformer Attribution's are not)."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    explainer = METHODS[method].cls(model)
    args = dict(additional_forward_args=(prompts.attention_mask,))
    span = explainer.attribute_span(prompts.input_ids, CONTINUATION, **args)
    rows = explainer.attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    scale = span.abs().max().item()
    torch.testing.assert_close(span, rows.sum(dim=1), rtol=1e-5, atol=1e-6 * scale)


def test_token_rows_with_log_prob_equal_one_token_spans():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    explainer = METHODS["grad_sam"].cls(model)
    args = dict(additional_forward_args=(prompts.attention_mask,))
    rows = explainer.attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    for step in range(CONTINUATION.shape[1]):
        prefix = torch.cat([prompts.input_ids, CONTINUATION[:, :step]], dim=1)
        mask = torch.cat([prompts.attention_mask, torch.ones(3, step, dtype=torch.long)], dim=1)
        alone = explainer.attribute_span(prefix, CONTINUATION[:, step : step + 1], additional_forward_args=(mask,))
        torch.testing.assert_close(rows[:, step, : prefix.shape[1] + 1], alone, rtol=1e-5, atol=1e-7)
    logit_rows = explainer.attribute_continuation(prompts.input_ids, CONTINUATION, **args)
    assert not torch.allclose(rows, logit_rows), "the log-probability and the logit have other gradients"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_span_and_all_token_rows_each_run_the_model_once(method):
    """Once the model's left padding is confirmed (its first left-padded call runs one
    prompt alone and padded: :meth:`_KeywordForward.left_padding_read`)."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    explainer = METHODS[method].cls(model)
    args = dict(additional_forward_args=(prompts.attention_mask,))
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        explainer.attribute_span(prompts.input_ids, CONTINUATION[:, :1], **args)
        assert len(calls) == 3, "the confirmation's two forwards, then the explanation's"
        calls.clear()
        explainer.attribute_span(prompts.input_ids, CONTINUATION, **args)
        assert len(calls) == 1
        explainer.attribute_continuation(prompts.input_ids, CONTINUATION, **args)
        assert len(calls) == 2
    finally:
        handle.remove()


def test_attention_flow_has_no_span():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    with pytest.raises(ValueError, match="Attention Flow .* has no span"):
        AttentionFlow(model).attribute_span(prompts.input_ids, CONTINUATION, additional_forward_args=(prompts.attention_mask,))
    span = RawAttention(model).attribute_span(prompts.input_ids, CONTINUATION[:, :1], additional_forward_args=(prompts.attention_mask,))
    assert span.shape == (3, 8)


# Captum's LLM interface ---------------------------------------------------------------

from captum.attr import FeatureAblation, LLMAttribution, TextTemplateInput, TextTokenInput  # noqa: E402
from lm_models import WORDS, make_word_tokenizer  # noqa: E402

from captum_attention import GradSAM, LLMAttentionAttribution  # noqa: E402

PROMPT = "the secret code is seven . what is the code ?"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_llm_result_equals_the_span_and_the_log_prob_rows(method):
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    explainer = METHODS[method].cls(model)
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target="seven .")
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(["seven", "."])])
    mask = (torch.ones_like(prompt),)
    span = explainer.attribute_span(prompt, answer, additional_forward_args=mask)[0, : prompt.shape[1]]
    rows = explainer.attribute_continuation(prompt, answer, additional_forward_args=mask, log_prob=True)[0, :, : prompt.shape[1]]
    torch.testing.assert_close(result.seq_attr, span)
    torch.testing.assert_close(result.token_attr, rows)
    assert result.input_tokens == tokenizer.convert_ids_to_tokens(prompt[0].tolist())
    assert result.output_tokens == ["seven", "."]


def test_llm_result_plots_and_generates_and_skips_tokens():
    import matplotlib

    matplotlib.use("Agg")
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    llm_attr = LLMAttentionAttribution(GradSAM(model), tokenizer)
    inp = TextTokenInput(PROMPT, tokenizer, skip_tokens=["<s>"])
    result = llm_attr.attribute(inp, gen_args={"max_new_tokens": 4, "do_sample": False})
    assert result.seq_attr.shape == (len(PROMPT.split()),)
    assert result.token_attr.shape == (4, len(PROMPT.split()))
    assert "<s>" not in result.input_tokens
    import matplotlib.pyplot as plt

    try:
        result.plot_token_attr()
        result.plot_seq_attr()
    finally:
        plt.close("all")  # a figure left open would reach whatever draws next in this process
    assert llm_attr.attribute(inp, target="seven", per_token=False).token_attr is None


def test_template_values_score_the_sum_of_their_tokens():
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    explainer = GradSAM(model)
    inp = TextTemplateInput("{} is {} . {}", values=["the secret code", "seven", "what is the code ?"])
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, target="seven")
    prompt = tokenizer(inp.to_model_input(), return_tensors="pt").input_ids
    tokens = explainer.attribute_span(prompt, torch.tensor([[51]]), additional_forward_args=(torch.ones_like(prompt),))[0]
    # <s> the secret code is seven . what is the code ?
    expected = torch.stack([tokens[1:4].sum(), tokens[5], tokens[7:12].sum()])
    torch.testing.assert_close(result.seq_attr, expected)
    assert result.input_tokens == ["the secret code", "seven", "what is the code ?"]
    grouped = TextTemplateInput("{} is {} . {}", values=["the secret code", "seven", "what is the code ?"], mask=[0, 1, 0])
    together = LLMAttentionAttribution(explainer, tokenizer).attribute(grouped, target="seven").seq_attr
    torch.testing.assert_close(together, torch.stack([expected[0] + expected[2], expected[1], expected[0] + expected[2]]))


def test_the_model_receives_the_attention_mask():
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append("attention_mask" in kwargs), with_kwargs=True)
    try:
        LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target="seven")
    finally:
        handle.remove()
    assert seen and all(seen)


def test_side_by_side_with_captums_feature_ablation():
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    inp = TextTokenInput(PROMPT, tokenizer)
    ours = LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(inp, target="seven .")
    theirs = LLMAttribution(FeatureAblation(model), tokenizer).attribute(inp, target="seven .", use_cached_outputs=False)
    assert ours.input_tokens == theirs.input_tokens and ours.output_tokens == theirs.output_tokens
    assert ours.seq_attr.shape == theirs.seq_attr.shape and ours.token_attr.shape == theirs.token_attr.shape
    # Captum's ablation, as the comparisons run it: each token replaced by id 0, the answer's
    # log-likelihood dropping by exactly that much
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    answer = torch.tensor([tokenizer.convert_tokens_to_ids(["seven", "."])])

    def log_likelihood(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            log_probs = model(torch.cat([ids, answer], dim=1)).logits.log_softmax(-1)[0]
        n = ids.shape[1]
        return log_probs[n - 1, answer[0, 0]] + log_probs[n, answer[0, 1]]

    full = log_likelihood(prompt)
    drops = torch.stack([full - log_likelihood(prompt.index_fill(1, torch.tensor([i]), 0)) for i in range(prompt.shape[1])])
    torch.testing.assert_close(theirs.seq_attr.float(), drops, rtol=1e-4, atol=1e-5)


def test_captums_cached_outputs_read_later_answer_tokens_wrong_which_is_why_the_comparisons_turn_them_off():
    """Captum 0.9's LLMAttribution with its default use_cached_outputs=True gets the second
    and later answer tokens' probabilities wrong on transformers 5.24; without the cache they
    are the model's own. If this starts failing, Captum or transformers fixed it."""
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    inp = TextTokenInput(PROMPT, tokenizer)
    ids = tokenizer(PROMPT + " seven . the", return_tensors="pt").input_ids
    with torch.no_grad():
        log_probs = model(ids).logits.log_softmax(-1)[0]
    n = ids.shape[1]
    direct = torch.stack([log_probs[n - 4 + k, ids[0, n - 3 + k]] for k in range(3)]).exp()
    read = {}
    for cached in (True, False):
        seen = []
        LLMAttribution(FeatureAblation(model), tokenizer).attribute(
            inp, target="seven . the", use_cached_outputs=cached, _inspect_forward=lambda text, answer, probs: seen.append(probs)
        )
        read[cached] = torch.tensor(seen[0][1:])
    torch.testing.assert_close(read[False], direct, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(read[True][1:], direct[1:], rtol=1e-2)


def test_llm_interface_errors_name_the_fix():
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    with pytest.raises(TypeError, match="wraps an attention attribution"):
        LLMAttentionAttribution(FeatureAblation(model), tokenizer)
    reversing = TextTemplateInput(lambda a, b: f"{a[::-1]} is {b}", values=["code", "seven"])
    with pytest.raises(ValueError, match="changes value 0"):
        LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(reversing, target="seven")
    with pytest.raises(ValueError, match="no tokens"):
        LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target=torch.tensor([], dtype=torch.long))


def test_a_prompt_whose_text_begins_with_the_bos_it_gets_again_is_warned_about():
    """A chat template's text pasted into a TextTokenInput begins with the BOS token's text,
    and the tokenizer adds another: the model would read two; the warning names the fix,
    which gives the template's tokens, and no warning."""
    import warnings

    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    explainer = LLMAttentionAttribution(GradSAM(model), tokenizer)
    with pytest.warns(UserWarning, match="begins with two BOS tokens") as caught:
        explainer.attribute(TextTokenInput("<s>" + PROMPT, tokenizer), target="seven", per_token=False)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = TextTokenInput(("<s>" + PROMPT).removeprefix(tokenizer.bos_token), tokenizer)
        assert fixed.inp_tensor[0, :2].tolist() == [tokenizer.bos_token_id, WORDS.index(PROMPT.split()[0])]
        explainer.attribute(fixed, target="seven", per_token=False)
