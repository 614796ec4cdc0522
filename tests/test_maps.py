"""The pure map functions: hand-made tensors and property-based tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from captum_attention.maps import (
    erase_keys,
    add_residual,
    discard_lowest,
    fuse_heads,
    grad_sam_head_mean,
    grad_sam_layer_maps,
    grad_sam_scores,
    mask_padding,
    propagate_query_row,
    relevance_head_mean,
    relevance_layer_maps,
    rollout_layer_maps,
    rollout_scores,
    segment_shares,
    transformer_attribution_scores,
)
from methods import reference_chefer, reference_grad_sam


@st.composite
def attention_batches(draw):
    """Random row-stochastic attention with right padding: (probs per layer, real, queries)."""
    batch = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 7))
    heads = draw(st.integers(1, 3))
    layers = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    lengths = draw(st.lists(st.integers(1, seq_len), min_size=batch, max_size=batch))
    generator = torch.Generator().manual_seed(seed)
    real = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]
    key_mask = torch.where(real, 0.0, float("-inf"))[:, None, None, :]
    probs = [
        (torch.randn(batch, heads, seq_len, seq_len, generator=generator) * 3 + key_mask).softmax(-1)
        for _ in range(layers)
    ]
    queries = torch.tensor([draw(st.integers(0, n - 1)) for n in lengths])
    return probs, real, queries


@settings(max_examples=60, deadline=None)
@given(attention_batches(), st.sampled_from(["mean", "max", "min"]), st.sampled_from([0.0, 0.3, 0.9]))
def test_rollout_rows_sum_to_one_and_are_non_negative(data, fusion, discard):
    probs, real, queries = data
    maps = rollout_layer_maps(probs, real, queries, fusion, discard)
    for layer_map in maps:
        torch.testing.assert_close(layer_map.sum(-1), torch.ones(layer_map.shape[:-1]))
        assert (layer_map >= 0).all()
    scores = rollout_scores(maps, queries)
    torch.testing.assert_close(scores.sum(-1), torch.ones(len(queries)))
    assert (scores >= 0).all()
    assert (scores[~real] == 0).all()


@dataclass
class _Recorded:
    attentions: list[torch.Tensor]
    grads: list[torch.Tensor]


@settings(max_examples=60, deadline=None)
@given(attention_batches(), st.data())
def test_relevance_and_grad_sam_equal_the_full_matrix_formulas_and_are_non_negative(data, draw):
    """The batched, padding-masked reductions against ``tests/methods.py``'s per-example
    full-matrix formulas (each example's real block cut out), on random attention and
    gradients; then the signs and padding."""
    probs, real, queries = data
    generator = torch.Generator().manual_seed(draw.draw(st.integers(0, 2**16)))
    grads = [torch.randn(p.shape, generator=generator) for p in probs]
    relevance = transformer_attribution_scores(relevance_layer_maps([relevance_head_mean(p, g) for p, g in zip(probs, grads)], real), queries)
    maps = grad_sam_layer_maps([grad_sam_head_mean(p, g) for p, g in zip(probs, grads)], real)
    scores = grad_sam_scores(maps, [p.shape[1] for p in probs], real)
    lengths = real.sum(dim=1).tolist()
    for b, n in enumerate(lengths):
        one = _Recorded([p[b : b + 1] for p in probs], [g[b : b + 1] for g in grads])
        torch.testing.assert_close(relevance[b, :n], reference_chefer(one, [n], int(queries[b]))[0])
        torch.testing.assert_close(scores[b, :n], reference_grad_sam(one, [n])[0])
    assert (relevance >= 0).all() and (relevance[~real] == 0).all()
    assert (relevance[torch.arange(len(queries)), queries] >= 1).all()
    assert (scores >= 0).all() and (scores[~real] == 0).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.integers(0, 5))
def test_identity_attention_leaves_the_query_alone(batch, seq_len, layers, query_seed):
    identity = torch.eye(seq_len).expand(batch, 2, seq_len, seq_len)
    real = torch.ones(batch, seq_len, dtype=torch.bool)
    queries = torch.full((batch,), query_seed % seq_len)
    one_hot = torch.nn.functional.one_hot(queries, seq_len).float()
    maps = rollout_layer_maps([identity] * layers, real, queries)
    torch.testing.assert_close(rollout_scores(maps, queries), one_hot)
    # With identity attention and gradient 1, each layer adds the query's own entry once.
    ones = torch.ones_like(identity)
    relevance = transformer_attribution_scores(relevance_layer_maps([relevance_head_mean(identity, ones)] * layers, real), queries)
    torch.testing.assert_close(relevance, one_hot * 2.0**layers)


def test_propagation_multiplies_later_layers_on_the_left():
    first = torch.tensor([[[0.5, 0.5], [0.0, 1.0]]])
    second = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
    query = torch.tensor([0])
    # e_0^T · second · first = row 0 of second @ first = [0, 1]
    torch.testing.assert_close(propagate_query_row([first, second], query), torch.tensor([[0.0, 1.0]]))


def test_add_residual_by_hand():
    attention = torch.tensor([[[0.2, 0.8], [0.6, 0.4]]])
    expected = torch.tensor([[[0.6, 0.4], [0.3, 0.7]]])
    torch.testing.assert_close(add_residual(attention), expected)
    # A row that lost mass (discarding) is renormalised: [0.5·0.2 + 0.5, 0] / 0.6
    torch.testing.assert_close(add_residual(torch.tensor([[[0.2, 0.0], [0.0, 1.0]]]))[0, 0], torch.tensor([1.0, 0.0]))


def test_fusions_by_hand():
    attn = torch.tensor([[[[0.2, 0.8]], [[0.6, 0.4]]]])  # (1, 2 heads, 1, 2)
    torch.testing.assert_close(fuse_heads(attn, "mean"), torch.tensor([[[0.4, 0.6]]]))
    torch.testing.assert_close(fuse_heads(attn, "max"), torch.tensor([[[0.6, 0.8]]]))
    torch.testing.assert_close(fuse_heads(attn, "min"), torch.tensor([[[0.2, 0.4]]]))


def test_discard_lowest_by_hand():
    fused = torch.tensor([[[0.1, 0.5, 0.0], [0.2, 0.05, 0.9], [0.0, 0.0, 0.0]]])
    real = torch.tensor([[True, True, False]])
    # Real 2x2 block: 0.1 (the query's own entry, protected), 0.5, 0.2, 0.05.
    # floor(0.5 * 2²) = 2 lowest of the others: 0.05 and 0.2.
    out = discard_lowest(fused, 0.5, real, torch.tensor([0]))
    expected = torch.tensor([[[0.1, 0.5, 0.0], [0.0, 0.0, 0.9], [0.0, 0.0, 0.0]]])
    torch.testing.assert_close(out, expected)


def test_mask_padding_zeroes_rows_and_columns():
    maps = torch.ones(1, 2, 3, 3)
    real = torch.tensor([[True, False, True]])
    out = mask_padding(maps, real)
    assert out[0, :, 1].abs().sum() == 0 and out[0, :, :, 1].abs().sum() == 0
    assert out.sum() == 2 * 4


def test_grad_sam_by_hand():
    attn = torch.tensor([[[[0.25, 0.75], [0.5, 0.5]]]])  # 1 layer, 1 head
    grad = torch.tensor([[[[2.0, -1.0], [1.0, 4.0]]]])
    real = torch.ones(1, 2, dtype=torch.bool)
    maps = grad_sam_layer_maps([grad_sam_head_mean(attn, grad)], real)
    # rows of A ⊙ ReLU(G): [0.5, 0], [0.5, 2]; sums 0.5 and 2.5; / (L·M·N = 2)
    torch.testing.assert_close(grad_sam_scores(maps, [1], real), torch.tensor([[0.25, 1.25]]))


def test_erasing_keys_from_scores_equals_renormalising_and_survives_underflow():
    scores = torch.tensor([[[[0.0, 1.0, 2.0], [3.0, 0.5, -1.0], [0.0, 0.0, 0.0]]]])
    probs = scores.softmax(-1)
    erased = torch.tensor([[False, True, False]])
    torch.testing.assert_close(erase_keys(probs, erased, scores), erase_keys(probs, erased))
    # A peaked row: key 0 gets exp(-200) of the mass, which underflows in float32.
    peaked = torch.tensor([[[[-200.0, 0.0, -300.0]]]])
    survivors = erase_keys(peaked.softmax(-1), torch.tensor([[False, True, False]]), peaked)
    torch.testing.assert_close(survivors, torch.tensor([[[[1.0, 0.0, 0.0]]]]))
    everything = erase_keys(peaked.softmax(-1), torch.ones(1, 3, dtype=torch.bool), peaked)
    assert (everything == 0).all()


@given(st.integers(1, 2), st.integers(1, 3), st.integers(1, 5), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**16))
def test_segment_shares_are_each_segments_largest_row_sum_outside_its_own_rows(batch, heads, rows, keys, count, seed):
    """Against a loop over examples, segments, heads and rows, on random probabilities,
    segments (-1: in none; keys beyond the block's) and real rows."""
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(batch, heads, rows, keys, generator=generator).softmax(dim=-1)
    key_segments = torch.randint(-1, count, (batch, keys + 2), generator=generator)
    row_segments = torch.randint(-1, count, (batch, rows), generator=generator)
    real_rows = torch.rand(batch, rows, generator=generator) < 0.8
    shares = segment_shares(probs, key_segments, row_segments, real_rows, count)
    for b in range(batch):
        for segment in range(count):
            held = probs[b][..., key_segments[b, :keys] == segment].sum(dim=-1)  # (heads, rows)
            outside = real_rows[b] & (row_segments[b] != segment)
            expected = float(held[:, outside].max()) if bool(outside.any()) else 0.0
            assert float(shares[b, segment]) == pytest.approx(expected, abs=1e-6)
