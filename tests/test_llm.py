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


@pytest.mark.parametrize("method", ["rollout", "raw"])
def test_forward_only_spans_are_the_sum_of_the_token_rows(method):
    """Rollout and raw attention are linear in the explained rows: the span's scores are
    exactly the sum of attribute_continuation's rows."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    explainer = METHODS[method].cls(model)
    args = dict(additional_forward_args=(prompts.attention_mask,))
    span = explainer.attribute_span(prompts.input_ids, CONTINUATION, **args)
    rows = explainer.attribute_continuation(prompts.input_ids, CONTINUATION, **args)
    torch.testing.assert_close(span, rows.sum(dim=1), rtol=1e-6, atol=1e-7)


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
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        explainer = METHODS[method].cls(model)
        args = dict(additional_forward_args=(prompts.attention_mask,))
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
