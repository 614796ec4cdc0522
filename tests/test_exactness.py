"""Each method against a direct re-computation from output_attentions and autograd.grad
(the references are in ``methods.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_scores_close, make_batch, make_model, reference_attention
from methods import MAP_METHODS, METHODS, reference_chefer, reference_grad_sam, reference_grad_sam_key_axis, reference_raw, reference_rollout

from captum_attention import METHODS as REGISTERED
from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

TARGET = 2


def test_every_registered_method_has_a_reference():
    assert set(METHODS) == set(REGISTERED)


@pytest.mark.parametrize("name", list(MAP_METHODS))
def test_registered_method_matches_reference_with_default_options(family, name, capture_mode):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch, TARGET)
    explainer = METHODS[name].cls(model)
    scores = explainer.attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
    assert explainer.last_capture.startswith(capture_mode)
    expected = METHODS[name].reference(ref, batch.lengths)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


def test_grad_sam_matches_reference(family):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch, TARGET)
    scores = GradSAM(model).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    assert scores.abs().max() > 0
    assert_scores_close(scores, reference_grad_sam(ref, batch.lengths))


@pytest.mark.parametrize("start_layer", [0, 1])
def test_transformer_attribution_matches_reference(family, start_layer):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch, TARGET)
    scores = TransformerAttribution(model).attribute(
        batch.input_ids,
        target=TARGET,
        additional_forward_args=(batch.attention_mask,),
        start_layer=start_layer,
    )
    expected = reference_chefer(ref, batch.lengths, start_layer=start_layer)
    assert (expected[:, 1:] > 0).any(), "the tiny model should give non-trivial relevance"
    assert_scores_close(scores, expected)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_matches_reference(family, fusion):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch)
    scores = AttentionRollout(model).attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), head_fusion=fusion
    )
    assert_scores_close(scores, reference_rollout(ref, batch.lengths, fusion=fusion))


@pytest.mark.parametrize("layer", [-1, 0, 1])
def test_raw_attention_matches_reference(family, layer):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch)
    scores = RawAttention(model).attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), layer=layer
    )
    assert_scores_close(scores, reference_raw(ref, batch.lengths, layer=layer))


def test_query_index_selects_the_row():
    model = make_model("bert")
    batch = make_batch(model)
    ref = reference_attention(model, batch, TARGET)
    queries = [2, 5, 3]
    chefer = TransformerAttribution(model).attribute(
        batch.input_ids,
        target=TARGET,
        additional_forward_args=(batch.attention_mask,),
        query_index=torch.tensor(queries),
    )
    rollout = AttentionRollout(model).attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), query_index=queries, start_layer=1
    )
    for b, query in enumerate(queries):
        one = [batch.lengths[b]]
        sub = type(ref)(
            [a[b : b + 1] for a in ref.attentions], [g[b : b + 1] for g in ref.grads], ref.logits, ref.targets
        )
        assert_scores_close(chefer[b : b + 1, : one[0]], reference_chefer(sub, one, query=query))
        assert_scores_close(
            rollout[b : b + 1, : one[0]], reference_rollout(sub, one, query=query, start_layer=1)
        )


def test_target_none_explains_the_predicted_class():
    model = make_model("bert")
    batch = make_batch(model)
    ref = reference_attention(model, batch, None)
    explainer = GradSAM(model)
    by_default = explainer.attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    by_list = explainer.attribute(
        batch.input_ids,
        target=ref.targets.tolist(),
        additional_forward_args=(batch.attention_mask,),
    )
    torch.testing.assert_close(by_default, by_list)
    assert_scores_close(by_default, reference_grad_sam(ref, batch.lengths))


def test_per_example_targets():
    model = make_model("bert")
    batch = make_batch(model)
    targets = torch.tensor([0, 2, 1])
    explainer = TransformerAttribution(model)
    together = explainer.attribute(
        batch.input_ids, target=targets, additional_forward_args=(batch.attention_mask,)
    )
    for b in range(3):
        alone = explainer.attribute(
            batch.input_ids[b : b + 1],
            target=int(targets[b]),
            additional_forward_args=(batch.attention_mask[b : b + 1],),
        )
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-6, rtol=1e-5)


def test_return_maps_shapes_and_consistency():
    model = make_model("bert")
    batch = make_batch(model)
    args = dict(additional_forward_args=(batch.attention_mask,))
    scores, maps = RawAttention(model).attribute(batch.input_ids, return_maps=True, **args)
    assert maps.shape == (3, 3, 9, 9)
    torch.testing.assert_close(scores, maps[:, -1, 0, :])
    scores, maps = GradSAM(model).attribute(batch.input_ids, target=0, return_maps=True, **args)
    lengths = torch.tensor(batch.lengths, dtype=torch.float32)
    torch.testing.assert_close(scores, maps.sum(dim=(1, 3)) / (3 * lengths[:, None]))
    scores, maps = AttentionRollout(model).attribute(batch.input_ids, return_maps=True, **args)
    torch.testing.assert_close(maps.sum(-1), torch.ones(3, 3, 9))


def test_grad_sam_key_axis_matches_reference(family):
    model = make_model(family)
    batch = make_batch(model)
    ref = reference_attention(model, batch, TARGET)
    scores = GradSAM(model).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,), axis="key"
    )
    expected = reference_grad_sam_key_axis(ref, batch.lengths)
    assert not torch.allclose(expected, reference_grad_sam(ref, batch.lengths)), "the axes differ"
    assert_scores_close(scores, expected)
    with pytest.raises(ValueError, match="axis must be one of"):
        GradSAM(model).attribute(batch.input_ids, target=TARGET, axis="column")
