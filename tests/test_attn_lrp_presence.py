"""AttnLRP at a presence (each token's keys weighted in every attention call): against the
independent reference with log p added to every call's scores of each key, in both
capture modes, on BERT, Llama (grouped-query heads, left padding) and GPT-2, an answer's
span, invariances, and clear errors."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, make_batch, make_model, model_state, with_random_biases
from lm_models import make_decoder, make_prompts
from lrp_reference import bert_relevance, gpt2_relevance, llama_relevance
from test_streaming import _case, _rel_close

from captum_attention import AttnLRP

CONTINUATION = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 14, 15]])


def _presence(mask: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """A presence in [0.05, 1] per token, seeded."""
    return 0.05 + 0.95 * torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed))


def _bert_case():
    model = with_random_biases(make_model("bert"))
    batch = make_batch(model)
    return model, batch.input_ids, batch.attention_mask, torch.tensor([1, 0, 1]), bert_relevance


def _decoder_case(family: str):
    def case():
        model, prompts = make_decoder(family), make_prompts(side="left")
        with torch.no_grad():
            target = model(prompts.input_ids, attention_mask=prompts.attention_mask).logits[:, -1].argmax(dim=-1)
        reference = llama_relevance if family == "llama" else gpt2_relevance
        return model, prompts.input_ids, prompts.attention_mask, target, reference

    return case


@pytest.mark.parametrize("case", [_bert_case, _decoder_case("llama"), _decoder_case("gpt2")], ids=["bert", "llama", "gpt2"])
def test_presence_equals_the_reference_with_its_log_on_every_key(case, capture_mode):
    model, ids, mask, target, reference = case()
    presence = _presence(mask)
    expected = reference(model, ids, mask, target, log_presence=presence.log()).relevance * mask
    as_it_is = reference(model, ids, mask, target).relevance * mask
    assert (expected - as_it_is).abs().max() > 0.05 * expected.abs().max(), "the presence changes the relevance"
    before = model_state(model)
    explainer = AttnLRP(model)
    actual = explainer.attribute(ids, target=target, additional_forward_args=(mask,), presence=presence)
    assert_same_state(before, model_state(model))
    assert explainer.last_capture.startswith(capture_mode)
    _rel_close(actual, expected)


def test_an_answer_span_at_a_presence_equals_the_reference(capture_mode):
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    ids = torch.cat([prompts.input_ids, CONTINUATION], dim=1)
    mask = torch.cat([prompts.attention_mask, torch.ones_like(CONTINUATION)], dim=1)
    presence = _presence(mask)
    expected = llama_relevance(model, ids, mask, None, span=CONTINUATION, log_presence=presence.log()).relevance * mask
    expected[:, -1] = 0.0
    explainer, args = AttnLRP(model), dict(additional_forward_args=(prompts.attention_mask,), presence=presence)
    scores = explainer.attribute_span(prompts.input_ids, CONTINUATION, **args)
    _rel_close(scores, expected)
    rows = explainer.attribute_continuation(prompts.input_ids, CONTINUATION, log_prob=True, **args)
    _rel_close(rows.sum(dim=1), expected)  # one row per answer token, their log-probabilities summing to the span's


def test_presence_one_or_the_same_for_every_token_changes_nothing(capture_mode):
    """Every key at the same presence shifts each row's scores by one constant: the softmax,
    and so the relevance, stay as they are."""
    model, ids, mask, target, _ = _bert_case()
    explainer = AttnLRP(model)
    as_it_is = explainer.attribute(ids, target=target, additional_forward_args=(mask,))
    for value in (1.0, 0.3):
        weighted = explainer.attribute(ids, target=target, additional_forward_args=(mask,), presence=torch.full(ids.shape, value))
        _rel_close(weighted, as_it_is)


def test_bad_presence_is_refused_clearly():
    model, ids, mask, target, _ = _bert_case()
    explainer = AttnLRP(model)

    def attribute(presence, inputs=ids):
        return explainer.attribute(inputs, target=target, additional_forward_args=(mask,), presence=presence)

    with pytest.raises(TypeError, match="presence"):
        attribute([[0.5] * ids.shape[1]] * len(ids))
    with pytest.raises(ValueError, match=r"presence has shape \(3, 8\) but .* reads 9 keys for 3 examples"):
        attribute(torch.full((3, 8), 0.5))
    for value in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"presence must lie in \(0, 1\]"):
            attribute(torch.full(ids.shape, value))
    with pytest.raises(ValueError, match="float tensor"):
        attribute(torch.ones(ids.shape, dtype=torch.long))
    seq2seq, inputs, args, _ = _case("t5")
    with pytest.raises(ValueError, match="encoder-decoder"):
        AttnLRP(seq2seq).attribute(inputs, target=1, additional_forward_args=args, presence=torch.ones(inputs[0].shape))


def test_a_softcap_sends_presence_to_eager_capture():
    """A logit softcap would cap the bias that carries log p in the kernel: the probe
    refuses to stream there (``capture="auto"`` then runs eager), and elsewhere adds log p
    to each key head's logits."""
    from types import SimpleNamespace

    from captum_attention._compat import StreamingUnsupported
    from captum_attention.capture.probes import KeyPresence

    probe = KeyPresence(torch.full((2, 5), 0.5))
    call = SimpleNamespace(role="self")
    kernel = SimpleNamespace(softcap=30.0, key=torch.zeros(2, 1, 5, 4), query=torch.zeros(2, 2, 5, 4))
    with pytest.raises(StreamingUnsupported, match="softcap"):
        probe.key_bias(call, kernel)
    kernel.softcap = None
    torch.testing.assert_close(probe.key_bias(call, kernel), torch.full((2, 1, 5), 0.5).log())


@pytest.mark.parametrize("family", ("bert", "distilbert", "gpt2", "llama", "qwen2", "vit", "deit"))
def test_streaming_equals_eager_at_a_presence_on_every_single_stack_family(family):
    """The kernel's log p on the keys (streaming) and the weighted probabilities (eager)
    give the same relevance on every family of one self-attention stack (the ViT and DeiT:
    the class, distillation and patch tokens)."""
    model, inputs, args, real = _case(family)
    presence = _presence(real)
    explain = {
        capture: AttnLRP(model, capture=capture).attribute(inputs, target=1, additional_forward_args=args, presence=presence)
        for capture in ("streaming", "eager")
    }
    as_it_is = AttnLRP(model).attribute(inputs, target=1, additional_forward_args=args)
    assert (explain["eager"] - as_it_is).abs().max() > 0.01 * as_it_is.abs().max()
    _rel_close(explain["streaming"], explain["eager"])
