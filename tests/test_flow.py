"""Attention Flow: a hand-solved graph, an independent max-flow solver on a tiny BERT,
padding and batch invariance, the pooling readout, and the model left as found."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_same_state, make_batch, make_model, model_state, reference_attention
from plain_models import make_plain
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from captum_attention import AttentionFlow, AttentionRollout
from captum_attention.capture import ModuleAdapter
from captum_attention.maps import attention_flow_scores

SCALE = 10**9  # scipy's solver takes integer capacities


def test_a_hand_solved_two_layer_graph():
    # Â^1 (rows: tokens after layer 1, columns: input tokens) and Â^2, query 0.
    first = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    second = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    # token 0: 0 -> (1,0) -> q carries min(0.7, 0.9) = 0.7, 0 -> (1,1) -> q min(0.2, 0.1) = 0.1
    # token 1: min(0.3, 0.9) = 0.3 and min(0.8, 0.1) = 0.1; rollout would give 0.65 and 0.35
    scores = attention_flow_scores([first[None], second[None]], torch.ones(1, 2, dtype=torch.bool), torch.tensor([0]))
    torch.testing.assert_close(scores, torch.tensor([[0.8, 0.4]]))


def _scipy_flow(maps: list[np.ndarray], source: int, sink: int | np.ndarray) -> float:
    """Max flow with scipy's solver on the same layered graph (nodes layer·n + token), to
    the top layer's token ``sink`` or, given weights, to a node they feed from the top."""
    n, layers = maps[0].shape[0], len(maps)
    capacity = np.zeros(((layers + 1) * n + 1, (layers + 1) * n + 1), dtype=np.int64)
    for layer, a_hat in enumerate(maps, start=1):
        capacity[(layer - 1) * n : layer * n, layer * n : (layer + 1) * n] = np.rint(a_hat.T * SCALE)
    if isinstance(sink, np.ndarray):
        capacity[layers * n : (layers + 1) * n, -1] = np.rint(sink * SCALE)
        return maximum_flow(csr_matrix(capacity), source, capacity.shape[0] - 1).flow_value / SCALE
    return maximum_flow(csr_matrix(capacity), source, layers * n + sink).flow_value / SCALE


def test_flow_equals_an_independent_max_flow_on_the_models_attention():
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    scores = AttentionFlow(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    assert_same_state(before, model_state(model))
    ref = reference_attention(model, batch, target=0)
    for b, n in enumerate(batch.lengths):
        maps = []
        for attn in ref.attentions:
            fused = attn[b, :, :n, :n].mean(0).double().numpy()
            a_hat = 0.5 * fused + 0.5 * np.eye(n)
            maps.append(a_hat / a_hat.sum(axis=1, keepdims=True))
        expected = [_scipy_flow(maps, j, 0) for j in range(n)]
        torch.testing.assert_close(scores[b, :n].double(), torch.tensor(expected), atol=1e-6, rtol=0)
        assert not scores[b, n:].any()
    rollout = AttentionRollout(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    assert not torch.allclose(scores, rollout), "flow is not rollout"


def test_an_output_read_from_weighted_rows_feeds_the_sink_from_them():
    """``query_index`` as row weights (a mean-pooled output's rows): the flow goes into a
    sink fed by the top layer's tokens with those weights, as a pooling readout's."""
    model = make_model("bert")
    batch = make_batch(model)
    weights = batch.attention_mask / batch.attention_mask.sum(dim=1, keepdim=True)
    weights[0, 1] *= 3  # and not only a mean
    scores = AttentionFlow(model).attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), query_index=weights
    )
    ref = reference_attention(model, batch, target=0)
    for b, n in enumerate(batch.lengths):
        maps = []
        for attn in ref.attentions:
            a_hat = 0.5 * attn[b, :, :n, :n].mean(0).double().numpy() + 0.5 * np.eye(n)
            maps.append(a_hat / a_hat.sum(axis=1, keepdims=True))
        expected = [_scipy_flow(maps, j, weights[b, :n].double().numpy()) for j in range(n)]
        torch.testing.assert_close(scores[b, :n].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0)


def test_a_padded_batch_gives_each_example_its_own_flow():
    model = make_model("bert")
    batch = make_batch(model)
    explainer = AttentionFlow(model)
    together = explainer.attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    for b, n in enumerate(batch.lengths):
        alone = explainer.attribute(batch.input_ids[b : b + 1, :n], additional_forward_args=(batch.attention_mask[b : b + 1, :n],))
        torch.testing.assert_close(together[b : b + 1, :n], alone, atol=1e-6, rtol=1e-5)


def test_a_pooling_readout_feeds_the_sink():
    model = make_plain("rnn")
    batch = make_batch(model)
    adapter = ModuleAdapter([model.attention], probs=lambda out: out[1], mask_module=model, pooling=[model.attention])
    scores = AttentionFlow(model, adapter=adapter).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    _, pieces = model.reference(batch.input_ids, batch.attention_mask)
    weights = pieces[0][0][:, 0].detach()  # with no layer below, each token's flow is its weight
    torch.testing.assert_close(scores, weights.masked_fill(batch.attention_mask == 0, 0.0))


def test_encoder_decoders_are_refused():
    from lm_models import make_encoder_decoder

    model = make_encoder_decoder("t5")
    ids = torch.randint(3, 20, (2, 5))
    with pytest.raises(ValueError, match="one self-attention stack"):
        AttentionFlow(model).attribute((ids, ids))


def _expected_flows(attentions: tuple[torch.Tensor, ...], row: int, kept: torch.Tensor, sink: int) -> torch.Tensor:
    """scipy's max flow from each kept token to ``sink`` (an index among the kept tokens)
    through rollout's graph of the head-mean attention, the kept tokens' block cut out."""
    n = int(kept.sum())
    maps = []
    for attn in attentions:
        fused = attn[row][:, kept][:, :, kept].mean(0).double().numpy()
        a_hat = 0.5 * fused + 0.5 * np.eye(n)
        maps.append(a_hat / a_hat.sum(axis=1, keepdims=True))
    return torch.tensor([_scipy_flow(maps, j, sink) for j in range(n)])


def test_decoders_and_vision_transformers_get_the_max_flow_of_their_own_attention():
    """A left-padded Llama (sink: the last real token) and a ViT (sink: the class token, the
    patches' flows on the grid), each against scipy on the model's eager ``output_attentions``."""
    import copy

    from lm_models import make_decoder, make_prompts, make_vision

    prompts, model = make_prompts(side="left"), make_decoder("llama")
    scores = AttentionFlow(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(prompts.input_ids, attention_mask=prompts.attention_mask, output_attentions=True).attentions
    for row, kept in enumerate(prompts.real):
        expected = _expected_flows(attentions, row, kept, int(kept.sum()) - 1)
        torch.testing.assert_close(scores[row, kept].double(), expected, atol=1e-6, rtol=0)
        assert not scores[row, ~kept].any()
    vit = make_vision("vit")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    grid = AttentionFlow(vit).attribute(pixels)
    eager = copy.deepcopy(vit)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(pixels, output_attentions=True).attentions
    for row in range(2):
        expected = _expected_flows(attentions, row, torch.ones(17, dtype=torch.bool), 0)
        torch.testing.assert_close(grid[row].flatten().double(), expected[1:], atol=1e-6, rtol=0)
