"""Attention pooling (queries that are not tokens): an RNN's additive attention and a
transformer read out by a learned query, named with ``ModuleAdapter(pooling=...)``.

References loop over examples, cut each example's real block out of the probabilities
the model computed and their ``autograd.grad`` gradients, and multiply full matrices.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, assert_scores_close, make_batch, model_state
from plain_models import LAYERS, make_plain

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution, UnsupportedModelError
from captum_attention.capture import ModuleAdapter
from captum_attention.metrics import (
    attention_erasure,
    attention_permutation,
    attention_ranking,
    decision_flip_fraction,
    gradient_attention_ranking,
)

TARGET = 1
KINDS = ("rnn", "pooled_textbook")


def adapter_for(model, pooling: bool = True) -> ModuleAdapter:
    if hasattr(model, "rnn"):
        named = [model.attention]
        return ModuleAdapter(named, probs=lambda out: out[1], mask_module=model, pooling=named if pooling else ())
    return ModuleAdapter(
        [*model.blocks, model.pooling], probs="softmax", mask_module=model, pooling=[model.pooling] if pooling else ()
    )


def reference(model, batch):
    """Per call ``(probabilities, gradients)``, each ``(B, H, Q, T)``; the pooling call last."""
    logits, pieces = model.reference(batch.input_ids, batch.attention_mask)
    as_heads = lambda t: t if t.dim() == 4 else t[:, None]  # noqa: E731
    flat = [p for block in pieces for p in block]
    grads = iter(torch.autograd.grad(logits[:, TARGET].sum(), flat))
    return [
        (torch.cat([as_heads(p) for p in block], dim=1).detach(), torch.cat([as_heads(next(grads)) for _ in block], dim=1))
        for block in pieces
    ]


def _real(tensor, b, n):
    """Example b's real block: queries up to n (a pooling call has one), keys up to n."""
    return tensor[b, :, :n, :n]


def reference_scores(method, calls, lengths):
    scores = torch.zeros(len(lengths), max(lengths))
    *token_calls, (pool_attn, pool_grad) = calls
    for b, n in enumerate(lengths):
        if method == "raw":
            scores[b, :n] = _real(pool_attn, b, n).mean(0)[0]
        elif method == "grad_sam":
            total = torch.zeros(n)
            for attn, grad in token_calls:  # a token's query row
                total += (_real(attn, b, n) * _real(grad, b, n).clamp(min=0)).sum(dim=(0, 2))
            total += (_real(pool_attn, b, n) * _real(pool_grad, b, n).clamp(min=0)).sum(dim=(0, 1))  # keys
            heads = sum(attn.shape[1] for attn, _ in calls)
            scores[b, :n] = total / (heads * n)
        elif method == "rollout":
            row = _real(pool_attn, b, n).mean(0)[0]
            for attn, _ in token_calls[::-1]:
                a_hat = 0.5 * _real(attn, b, n).mean(0) + 0.5 * torch.eye(n)
                row = row @ (a_hat / a_hat.sum(dim=-1, keepdim=True))
            scores[b, :n] = row
        else:
            row = (_real(pool_grad, b, n) * _real(pool_attn, b, n)).clamp(min=0).mean(0)[0]
            for attn, grad in token_calls[::-1]:
                row = row @ (torch.eye(n) + (_real(grad, b, n) * _real(attn, b, n)).clamp(min=0).mean(0))
            scores[b, :n] = row
    return scores


CLASSES = {"raw": RawAttention, "grad_sam": GradSAM, "rollout": AttentionRollout, "transformer_attribution": TransformerAttribution}


@pytest.mark.parametrize("kind", KINDS)
def test_reference_computes_the_model(kind):
    model = make_plain(kind)
    batch = make_batch(model)
    logits, _ = model.reference(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(logits, model(batch.input_ids, batch.attention_mask))


@pytest.mark.parametrize("method", list(CLASSES))
@pytest.mark.parametrize("kind", KINDS)
def test_methods_read_the_pooling_readout(kind, method):
    model = make_plain(kind)
    batch = make_batch(model)
    before = model_state(model)
    scores = CLASSES[method](model, adapter=adapter_for(model)).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    assert_same_state(before, model_state(model))
    expected = reference_scores(method, reference(model, batch), batch.lengths)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


@pytest.mark.parametrize("method", list(CLASSES))
def test_a_padded_batch_explains_each_example_as_alone(method):
    model = make_plain("pooled_textbook")
    batch = make_batch(model)
    explainer = CLASSES[method](model, adapter=adapter_for(model))
    together = explainer.attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
    for b, n in enumerate(batch.lengths):
        alone = explainer.attribute(batch.input_ids[b : b + 1, :n], target=TARGET, additional_forward_args=(batch.attention_mask[b : b + 1, :n],))
        assert_scores_close(together[b : b + 1, :n], alone, rel=1e-4)
        assert not together[b, n:].any()


def test_return_maps_gives_the_maps_of_each_role():
    model = make_plain("pooled_textbook")
    batch = make_batch(model)
    _, maps = GradSAM(model, adapter=adapter_for(model)).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,), return_maps=True
    )
    seq_len = batch.input_ids.shape[1]
    assert maps["self"].shape == (3, LAYERS, seq_len, seq_len)
    assert maps["pooling"].shape == (3, 1, 1, seq_len)


def test_raw_attention_reads_a_token_layer_at_the_query_row():
    model = make_plain("pooled_textbook")
    batch = make_batch(model)
    scores = RawAttention(model, adapter=adapter_for(model)).attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), layer=0, query_index=2
    )
    first_layer = reference(model, batch)[0][0]
    for b, n in enumerate(batch.lengths):
        torch.testing.assert_close(scores[b, :n], _real(first_layer, b, n).mean(0)[2])


def test_rankings_read_the_pooling_row():
    model = make_plain("rnn")
    batch = make_batch(model)
    args = dict(additional_forward_args=(batch.attention_mask,), model=model, adapter=adapter_for(model))
    ((attn, grad),) = reference(model, batch)
    torch.testing.assert_close(attention_ranking(model, batch.input_ids, **args), attn[:, 0, 0])
    torch.testing.assert_close(gradient_attention_ranking(model, batch.input_ids, target=TARGET, **args), (attn * grad)[:, 0, 0])


def test_erasure_at_the_pooling_attention_matches_renormalised_weights():
    model = make_plain("rnn")
    batch = make_batch(model)
    erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    erased[:, 1] = True
    result = attention_erasure(
        model, batch.input_ids, erased, (batch.attention_mask,), model=model, adapter=adapter_for(model)
    )
    expected, _ = model.reference(batch.input_ids, batch.attention_mask, erased=erased)
    torch.testing.assert_close(result.erased, expected.softmax(dim=-1))
    assert bool((result.js_divergence > 0).all())


def test_decision_flip_reports_the_pooling_attention_removed():
    model = make_plain("rnn")
    batch = make_batch(model, lengths=(9, 9, 9, 9), seed=3)
    adapter = adapter_for(model)
    ranking = attention_ranking(model, batch.input_ids, (batch.attention_mask,), adapter=adapter)
    result = decision_flip_fraction(model, batch.input_ids, ranking, (batch.attention_mask,), adapter=adapter)
    assert bool(result.flipped.any())
    ((attn, _),) = reference(model, batch)
    weights = attn[:, 0, 0]
    for b in torch.nonzero(result.flipped).flatten().tolist():
        removed = int(result.removed[b])
        top = weights[b].sort(descending=True).values[:removed].sum()
        torch.testing.assert_close(result.attention_mass_removed[b], top)


def test_permuting_the_pooling_attention_of_one_real_key_changes_nothing():
    model = make_plain("rnn")
    batch = make_batch(model, lengths=(1, 5))
    result = attention_permutation(
        model, batch.input_ids, (batch.attention_mask,), adapter=adapter_for(model), n_permutations=4
    )
    assert float(result.median_tvd[0]) == 0.0
    assert float(result.median_tvd[1]) > 0.0


def test_pooling_attention_not_named_as_pooling_gets_a_clear_error():
    model = make_plain("rnn")
    batch = make_batch(model)
    with pytest.raises(UnsupportedModelError, match=r"pooling=\[module\]"):
        GradSAM(model, adapter=adapter_for(model, pooling=False)).attribute(
            batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
        )


def test_pooling_modules_must_be_named_attention_modules():
    model = make_plain("pooled_textbook")
    with pytest.raises(ValueError, match="pooling"):
        ModuleAdapter(list(model.blocks), probs="softmax", pooling=[model.pooling])


def test_pooling_before_self_attention_is_refused():
    model = make_plain("pooled_textbook")
    batch = make_batch(model)
    adapter = ModuleAdapter(
        [*model.blocks, model.pooling], probs="softmax", mask_module=model, pooling=[model.blocks[0], model.pooling]
    )
    with pytest.raises(RuntimeError, match="readout"):
        RawAttention(model, adapter=adapter).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))

