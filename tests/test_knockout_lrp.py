"""KnockoutLRP: the first-order knockout effects of an eager twin's attention and
gradients (``output_attentions``, ``autograd.grad``), with AttnLRP's relevance at the
tokens of largest relevance, in both capture modes and on every path."""

from __future__ import annotations

import pytest
import torch
from captum.attr import NoiseTunnel
from conftest import assert_same_state, counted_calls, make_batch, make_model, model_state
from lm_models import Prompts, lm_span_reference, make_decoder, make_prompts, make_vision, make_word_tokenizer
from methods import knockout_reference, reference_decisive
from test_knockout_gradient import CONTINUATION
from test_llm import _sequence

from captum_attention import AttnLRP, KnockoutGradient, KnockoutLRP, LLMAttentionAttribution


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder", ["llama", "gpt2"])
@pytest.mark.parametrize("decisive", [1, 2])
def test_span_is_the_knockout_reference_with_the_relevance_at_the_decisive_tokens(decoder, decisive):
    model, prompts = make_decoder(decoder), make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    sequence = _sequence(prompts, CONTINUATION)
    ref = lm_span_reference(model, Prompts(sequence.input_ids, sequence.attention_mask), CONTINUATION)
    first_order = knockout_reference(ref.attentions, ref.grads, sequence.real, sequence.input_ids.shape[1] - 2)
    relevance = AttnLRP(model).attribute_span(prompts.input_ids, CONTINUATION, **args)
    before = model_state(model)
    scores = KnockoutLRP(model, decisive=decisive).attribute_span(prompts.input_ids, CONTINUATION, **args)
    assert_same_state(before, model_state(model))
    expected = reference_decisive(first_order, relevance, decisive)
    changed = (expected - first_order).abs() > 1e-3 * first_order.abs().max()
    assert changed.sum(dim=1).tolist() == [decisive] * 3, "the relevance must replace a slope it differs from"
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
def test_each_continuation_row_and_each_example_alone_are_combined_as_the_span():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    rows = KnockoutLRP(model).attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    first_order = KnockoutGradient(model).attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    relevance = AttnLRP(model).attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    for step in range(CONTINUATION.shape[1]):
        torch.testing.assert_close(rows[:, step], reference_decisive(first_order[:, step], relevance[:, step], 1))
    batched = KnockoutLRP(model).attribute(prompts.input_ids, target=4, **args)
    for b in range(len(prompts.input_ids)):
        real = prompts.attention_mask[b].bool()
        alone = KnockoutLRP(model).attribute(prompts.input_ids[b : b + 1, real], target=4)
        torch.testing.assert_close(batched[b : b + 1, real], alone, rtol=1e-4, atol=1e-5 * alone.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
def test_one_forward_serves_the_relevance_and_the_slope_on_every_path():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    explainer = KnockoutLRP(model)
    explainer.attribute(prompts.input_ids, target=4, **args)  # the left padding confirmed once (two forwards)
    with counted_calls(model) as forwards:
        explainer.attribute(prompts.input_ids, target=4, **args)
        explainer.attribute_span(prompts.input_ids, CONTINUATION, **args)
        explainer.attribute_continuation(prompts.input_ids, CONTINUATION, **args)
    assert len(forwards) == 3


def test_a_classifier_and_the_llm_interface():
    model = make_model("bert")
    batch = make_batch(model)
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    scores = KnockoutLRP(model).attribute((batch.input_ids,), **args)
    assert isinstance(scores, tuple)
    expected = reference_decisive(KnockoutGradient(model).attribute(batch.input_ids, **args), AttnLRP(model).attribute(batch.input_ids, **args), 1)
    torch.testing.assert_close(scores[0], expected)
    assert (scores[0][batch.attention_mask == 0] == 0).all()
    embeds = model.get_input_embeddings()(batch.input_ids).detach()
    on_embeds = KnockoutLRP(lambda e, mask: model(inputs_embeds=e, attention_mask=mask).logits, model=model)
    tunnel = NoiseTunnel(on_embeds).attribute(embeds, nt_samples=2, stdevs=0.0, **args)  # no noise: the call itself, twice
    torch.testing.assert_close(tunnel, on_embeds.attribute(embeds, **args))
    torch.testing.assert_close(tunnel, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())

    from captum.attr import TextTokenInput

    decoder, tokenizer = make_decoder("llama"), make_word_tokenizer()
    prompt = TextTokenInput("the secret code is", tokenizer)
    combined, first_order = (
        LLMAttentionAttribution(cls(decoder), tokenizer).attribute(prompt, target="seven").seq_attr for cls in (KnockoutLRP, KnockoutGradient)
    )
    assert combined.shape == (5,) and int(_changed(combined, first_order).sum()) == 1


def test_an_image_takes_its_decisive_patch_from_the_whole_grid():
    model = make_vision("vit")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    scores = KnockoutLRP(model, decisive=2).attribute(pixels, target=1)
    first_order, relevance = (cls(model).attribute(pixels, target=1) for cls in (KnockoutGradient, AttnLRP))
    assert scores.shape == (2, 4, 4)
    expected = reference_decisive(first_order.flatten(1), relevance.flatten(1), 2).view(2, 4, 4)
    torch.testing.assert_close(scores, expected)
    assert int(_changed(scores, first_order).sum()) == 4  # two patches an image, not two a grid row


def test_an_encoder_decoder_is_refused_as_by_knockout_gradient_before_any_pass():
    from lm_models import make_encoder_decoder

    model = make_encoder_decoder("bart")
    source, answer = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]])
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        for call in (lambda e: e.attribute_span(source, answer), lambda e: e.attribute_continuation(source, answer),
                     lambda e: e.attribute((source, answer), target=3)):
            with pytest.raises(ValueError, match="^KnockoutLRP is defined for one self-attention stack") as refused:
                call(KnockoutLRP(model))
            assert "\n" not in str(refused.value)
    finally:
        hook.remove()
    assert not forwards


@pytest.mark.parametrize("decisive", [0, -1, 1.5, True])
def test_decisive_is_a_positive_count(decisive):
    with pytest.raises(ValueError, match="decisive must be a number of tokens") as refused:
        KnockoutLRP(make_decoder("llama"), decisive=decisive)
    assert "\n" not in str(refused.value)


def _changed(scores, first_order):
    """Where the scores are not the first-order effects (beyond rounding: the slope comes
    from a backward on the graph of a forward under AttnLRP's rules)."""
    return (scores - first_order).abs() > 1e-5 * first_order.abs().max()
