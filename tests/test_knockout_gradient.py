"""KnockoutGradient: each token's first-order knockout effect, checked against the
attention and gradients of an eager twin (``output_attentions``, ``autograd.grad``), and
against what it estimates: the slope of the explained logit when the token's keys are
lowered in every call (a bias on its logits through the model's own mask)."""

from __future__ import annotations

import pytest
import torch
from lm_models import Prompts, lm_span_reference, make_decoder, make_prompts
from methods import knockout_reference
from test_llm import _sequence

from captum_attention import KnockoutGradient

CONTINUATION = torch.tensor([[5, 6], [7, 8], [9, 10]])


def _assert_span_equals_the_reference(decoder: str, capture: str = "auto") -> None:
    model, prompts = make_decoder(decoder), make_prompts(side="left")
    sequence = _sequence(prompts, CONTINUATION)
    ref = lm_span_reference(model, Prompts(sequence.input_ids, sequence.attention_mask), CONTINUATION)
    explainer = KnockoutGradient(model, capture=capture)
    scores = explainer.attribute_span(prompts.input_ids, CONTINUATION, additional_forward_args=(prompts.attention_mask,))
    expected = knockout_reference(ref.attentions, ref.grads, sequence.real, sequence.input_ids.shape[1] - 2)
    assert expected.abs().max() > 0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder", ["llama", "gpt2"])
def test_span_equals_the_reference_of_the_summed_log_probability(decoder):
    _assert_span_equals_the_reference(decoder)


@pytest.mark.parametrize("path", ["kernel backward", "recomputed rows"])
@pytest.mark.parametrize("decoder", ["llama", "gpt2", "gpt_oss"])
def test_streamed_slopes_from_the_kernels_backward_or_from_recomputed_rows_equal_the_reference(decoder, path, monkeypatch):
    """Streaming reads each call's slopes from the kernel's own backward (a zero bias on
    the keys' logits riding on it; for gpt-oss's sinks, on the explicit computation's)
    where the call can carry one, else from its rows recomputed block by block: each path
    alone equals the reference."""
    from captum_attention.attr import knockout_gradient
    from captum_attention.capture import kernel, probes

    def not_taken(*args, **kwargs):
        raise AssertionError(f"streaming left the {path} path")

    if path == "kernel backward":
        monkeypatch.setattr(knockout_gradient, "knockout_column_sums", not_taken)
    else:
        monkeypatch.setattr(probes, "key_bias_applies", lambda call: False)
        monkeypatch.setattr(kernel, "_with_key_bias", not_taken)
    _assert_span_equals_the_reference(decoder, capture="streaming")


def test_it_is_the_slope_of_the_log_probability_in_a_bias_on_the_tokens_keys():
    """A left-padded Llama, eager: a 4-D float mask (causal, padding) plus ε on key j's
    column in every call; d logit / dε at 0 is token j's score."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    scores = KnockoutGradient(model, capture="eager").attribute(prompts.input_ids, target=4, additional_forward_args=(prompts.attention_mask,))
    length = prompts.input_ids.shape[1]
    visible = torch.ones(length, length).tril().bool()[None, None] & prompts.real[:, None, None, :]
    epsilon = torch.zeros(3, length, requires_grad=True)
    mask = torch.where(visible, epsilon[:, None, None, :], torch.finfo(torch.float32).min)
    positions = (prompts.attention_mask.cumsum(-1) - 1).clamp(min=0)
    eager = make_decoder("llama")
    eager.set_attn_implementation("eager")
    logits = eager(input_ids=prompts.input_ids, attention_mask=mask, position_ids=positions).logits[:, -1]
    (slope,) = torch.autograd.grad(logits[:, 4].sum(), epsilon)
    torch.testing.assert_close(scores, slope.masked_fill(~prompts.real, 0.0), rtol=1e-4, atol=1e-6)


@pytest.mark.usefixtures("capture_mode")
def test_a_classifier_is_explained_over_all_its_rows_and_the_model_left_as_found():
    from conftest import assert_same_state, make_batch, make_model, model_state

    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    scores = KnockoutGradient(model).attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,))
    assert_same_state(before, model_state(model))
    eager = make_model("bert")
    eager.set_attn_implementation("eager")
    out = eager(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True)
    grads = torch.autograd.grad(out.logits[:, 1].sum(), out.attentions)
    expected = knockout_reference(out.attentions, grads, batch.attention_mask.bool(), batch.input_ids.shape[1])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_head_that_reads_the_padding_rows_is_explained_over_the_real_rows_in_both_modes():
    """A head that averages every position, padding included: the padding rows' output
    gradient is not zero, so the kernel's sum over every row is not the real rows' sum, and
    streaming recomputes those calls' rows instead: eager capture's scores."""
    from conftest import make_batch, make_model

    model = make_model("bert")
    batch = make_batch(model)
    assert not bool(batch.attention_mask.all())
    weight = torch.randn(model.config.hidden_size, 2, generator=torch.Generator().manual_seed(0))

    def pooled(input_ids, attention_mask):
        states = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1]
        return states.mean(dim=1) @ weight

    streamed, eager = (
        KnockoutGradient(pooled, model=model, capture=capture).attribute(
            batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,)
        )
        for capture in ("streaming", "eager")
    )
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_refusals_are_one_line():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    with pytest.raises(ValueError, match="no maps") as refused:
        KnockoutGradient(model).attribute(prompts.input_ids, target=4, additional_forward_args=(prompts.attention_mask,), return_maps=True)
    assert "\n" not in str(refused.value)
