"""Attention over coarser grids than the first patches: shifted windows (Swin, Swin-v2,
Donut-Swin) and reduced keys (SegFormer). Every map method equals its reference on the
first stage's patches (``grid_reference.py``: each window attention run as the linear map
it is, through the model's own window partition; SegFormer's ``output_attentions`` spread
over the patches by one-hot assignments), with shifted windows, padded windows, reduced
keys and three stages; AttnLRP equals Swin's forward written out with its rules
(``lrp_reference.swin_relevance``)."""

from __future__ import annotations

import copy
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from conftest import assert_same_state, model_state, with_random_biases
from lrp_reference import PVT_V2, SEGFORMER, reduced_key_relevance, swin_relevance
from methods import MAP_METHODS, reference_grad_sam
from grid_reference import reduced_maps_and_grads, window_maps_and_grads

from captum_attention import METHODS, UnsupportedModelError
from captum_attention.maps import windows_on_patch_grid

FAMILIES = {
    "swin": (tf.SwinConfig, tf.SwinForImageClassification),
    "swinv2": (tf.Swinv2Config, tf.Swinv2ForImageClassification),
    "donut-swin": (tf.DonutSwinConfig, tf.DonutSwinForImageClassification),
    "segformer": (tf.SegformerConfig, tf.SegformerForImageClassification),
    "pvt_v2": (tf.PvtV2Config, tf.PvtV2ForImageClassification),
}
REDUCED = ("segformer", "pvt_v2")
SHAPES = {
    "shifted": dict(image_size=32, window_size=2),  # 8×8 then 4×4 patches, every other block shifted
    "padded": dict(image_size=32, window_size=3),  # windows padded past the grid's edge
    "three stages": dict(image_size=48, window_size=2, depths=[2, 2, 2], num_heads=[2, 4, 4]),
}
REDUCED_SHAPES = {
    "shifted": dict(image_size=32, sr_ratios=[2, 1]),  # 8×8 patches, keys 4×4; then 4×4
    "padded": dict(image_size=32, sr_ratios=[4, 2]),  # keys 2×2 in both stages
    "three stages": dict(image_size=64, sr_ratios=[4, 2, 1], depths=[2, 1, 1], hidden_sizes=[16, 16, 32],
                         num_attention_heads=[1, 2, 2], patch_sizes=[7, 3, 3], strides=[4, 2, 2], mlp_ratios=[2, 2, 2]),
}
TARGET = 1


def _options(family: str, shape: str) -> dict:
    if family in REDUCED:
        return {**dict(num_encoder_blocks=len(REDUCED_SHAPES[shape].get("depths", [2, 2])), depths=[2, 2],
                       hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                       mlp_ratios=[2, 2], num_labels=3), **REDUCED_SHAPES[shape]}
    return {**dict(patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], num_labels=3), **SHAPES[shape]}


@lru_cache(maxsize=None)
def _case(family: str, shape: str) -> tuple[torch.nn.Module, torch.Tensor]:
    config_class, model_class = FAMILIES[family]
    options = _options(family, shape)
    torch.manual_seed(0)
    model = model_class(config_class(**options)).eval()
    images = torch.randn(2, 3, options["image_size"], options["image_size"], generator=torch.Generator().manual_seed(1))
    return model, images


@lru_cache(maxsize=None)
def _reference(family: str, shape: str) -> SimpleNamespace:
    model, images = _case(family, shape)
    on_grids = reduced_maps_and_grads if family in REDUCED else window_maps_and_grads
    maps, grads = on_grids(model, {"pixel_values": images}, lambda logits: logits[:, TARGET].sum())
    return SimpleNamespace(attentions=[a.float() for a in maps], grads=[g.float() for g in grads])


def _expected(name: str, ref: SimpleNamespace, query: int | torch.Tensor) -> torch.Tensor:
    lengths = [ref.attentions[0].shape[-1]] * ref.attentions[0].shape[0]
    return reference_grad_sam(ref, lengths) if name == "grad_sam" else MAP_METHODS[name].reference(ref, lengths, query)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", MAP_METHODS)
def test_scores_equal_the_dense_reference_for_the_mean_pooled_row(name, family, shape):
    model, images = _case(family, shape)
    ref = _reference(family, shape)
    patches = ref.attentions[0].shape[-1]
    options = {"target": TARGET} if METHODS[name].spec.uses_target else {}
    scores = METHODS[name](model).attribute(images, **options)
    expected = _expected(name, ref, torch.full((patches,), 1 / patches))
    assert scores.shape == (2, images.shape[-2] // 4, images.shape[-1] // 4)
    torch.testing.assert_close(scores.flatten(1), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("name", ["rollout", "transformer_attribution", "raw"])
def test_a_query_index_explains_that_patch_row(name):
    model, images = _case("swin", "shifted")
    options = {"target": TARGET} if METHODS[name].spec.uses_target else {}
    scores = METHODS[name](model).attribute(images, query_index=5, **options)
    expected = _expected(name, _reference("swin", "shifted"), 5)
    torch.testing.assert_close(scores.flatten(1), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("family", ["swin", "segformer"])
def test_auto_runs_eager_and_says_why_streaming_refuses_in_one_line(family):
    model, images = _case(family, "shifted")
    explainer = METHODS["rollout"](model)
    explainer.attribute(images)
    assert explainer.last_capture.startswith("eager") and "shifted window or over reduced keys" in explainer.last_capture
    with pytest.raises(ValueError, match="reduced keys") as error:
        METHODS["rollout"](model, capture="streaming").attribute(images)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("family, side, why", [
    ("swin", 20, "halve evenly"),  # 5×5 patches: the merge pads them to 6×6
    ("segformer", 20, "divide into the 2×2 cells"),  # 5×5 patches, keys reduced from 2×2 cells
])
def test_a_grid_that_does_not_divide_evenly_is_refused_in_one_line(family, side, why):
    model, _ = _case(family, "shifted")
    odd = torch.randn(1, 3, side, side)
    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match=why) as error:
        METHODS["rollout"](model).attribute(odd)
    assert "\n" not in str(error.value)
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("family", ["swin", *REDUCED])
@pytest.mark.parametrize("name", list(METHODS))
def test_each_image_alone_gets_its_batched_scores_and_the_model_is_left_as_found(name, family):
    model, images = _case(family, "shifted")
    before = model_state(model)
    options = {"target": TARGET} if METHODS[name].spec.uses_target else {}
    batched = METHODS[name](model).attribute(images, **options)
    assert_same_state(before, model_state(model))
    assert all(p.grad is None for p in model.parameters())
    for b in range(2):
        alone = METHODS[name](model).attribute(images[b : b + 1], **options)
        torch.testing.assert_close(alone[0], batched[b], rtol=1e-4, atol=1e-6 * batched.abs().max().item())


def test_window_maps_on_the_patch_grid_by_hand():
    """A 4×4 stage in 2×2 windows, each token 2×2 patches of an 8×8 grid (patch p = 8·row +
    column). Rows keep their sums; entries read off the windows by hand."""
    window_maps = torch.rand(3 * 4, 2, 4, 4).softmax(dim=-1)  # 3 images × 4 windows, 2 heads
    unshifted = windows_on_patch_grid(window_maps, (4, 4), window=2, shift=0, scale=2)
    assert unshifted.shape == (3, 2, 64, 64)
    torch.testing.assert_close(unshifted.sum(dim=-1), torch.ones(3, 2, 64))
    # token (0,0) → token (1,1): window 0, slots 0 → 3; patches 0 and 9 are token (0,0)'s, 18 and 27 token (1,1)'s
    for query, key in ((0, 18), (9, 27)):
        torch.testing.assert_close(unshifted[:, :, query, key], window_maps.view(3, 4, 2, 4, 4)[:, 0, :, 0, 3] / 4)
    assert (unshifted[:, :, 0, 4] == 0).all(), "token (0,2) is in another window"
    # rolled by 1: window 0 holds tokens (1,1), (1,2), (2,1), (2,2); token (1,1) → (1,2) is slots 0 → 1
    shifted = windows_on_patch_grid(window_maps, (4, 4), window=2, shift=1, scale=2)
    torch.testing.assert_close(shifted[:, :, 18, 20], window_maps.view(3, 4, 2, 4, 4)[:, 0, :, 0, 1] / 4)
    torch.testing.assert_close(shifted.sum(dim=-1), torch.ones(3, 2, 64))


def test_a_decoders_keys_on_the_last_stage_on_the_patch_grid_by_hand():
    """Three queries over a 2×2 last stage, each token 2×2 patches of a 4×4 grid (patch p =
    4·row + column): every patch of key t takes t's weight / 4; a stage of other keys is
    refused in one line."""
    from captum_attention.capture.adapters.grids import StageKeysCall

    maps = torch.rand(2, 5, 3, 4).softmax(dim=-1)
    on_patches = StageKeysCall((2, 2), 2).maps(maps)
    assert on_patches.shape == (2, 5, 3, 16)
    torch.testing.assert_close(on_patches.sum(dim=-1), torch.ones(2, 5, 3))
    for token, patches in ((0, (0, 1, 4, 5)), (1, (2, 3, 6, 7)), (2, (8, 9, 12, 13)), (3, (10, 11, 14, 15))):
        for patch in patches:
            torch.testing.assert_close(on_patches[..., patch], maps[..., token] / 4)
    torch.testing.assert_close(StageKeysCall((2, 2), 2).gradients(maps)[..., 5], maps[..., 0])
    with pytest.raises(UnsupportedModelError, match="reads 3 keys where the window encoder's last stage holds 2×2") as refused:
        StageKeysCall((2, 2), 2).maps(maps[..., :3])
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ["swin", "segformer", "pvt_v2"])
def test_attn_lrp_equals_an_explicit_forward_written_with_the_rules(family, shape):
    """``lrp_reference.swin_relevance`` and ``reduced_key_relevance``: the forward written
    out from the weights, each rule as a detach trick; it conserves the logit term by term,
    and AttnLRP equals its token relevances."""
    model, images = _case(family, shape)
    model = with_random_biases(copy.deepcopy(model))
    target = torch.tensor([1, 0])
    if family in REDUCED:
        expected = reduced_key_relevance(model, images, target, SEGFORMER if family == "segformer" else PVT_V2)
    else:
        expected = swin_relevance(model, images, target)
    total = expected.relevance.sum(dim=1) + expected.absorbed
    torch.testing.assert_close(total, expected.explained, rtol=0, atol=1e-6 * expected.magnitude.max().item())
    assert (expected.absorbed.abs() > 1e-3 * expected.magnitude).all(), "biases and the softmax absorb some"
    actual = METHODS["attn_lrp"](model).attribute(images, target=target)
    scale = expected.relevance.abs().max().item()
    torch.testing.assert_close(actual.flatten(1), expected.relevance, rtol=1e-5, atol=1e-5 * scale)


def test_interventions_inside_window_attention_are_refused_in_one_line():
    """Erasure and permutation change the probabilities while the layer runs, before its
    window geometry is noted: refused, the model left as found."""
    from captum_attention.metrics.erasure import attention_erasure
    from captum_attention.metrics.permutation import attention_permutation

    model, images = _case("swin", "shifted")
    before = model_state(model)
    for intervene in (lambda: attention_erasure(model, images, torch.zeros(2, 64, dtype=torch.bool)),
                      lambda: attention_permutation(model, images)):
        with pytest.raises(UnsupportedModelError, match="shifted windows") as error:
            intervene()
        assert "\n" not in str(error.value)
        assert_same_state(before, model_state(model))


@pytest.mark.parametrize("family", ["swin", "segformer"])
def test_nothing_of_a_call_is_kept_after_it_and_another_thread_reads_its_gradients(family):
    """The grids noted during a capture live in that capture's context only: after every
    method, none remain (in this thread or any); the gradient methods' backward reads them
    in the forward's context, so a gradient read in another thread (as autograd's device
    threads run hooks) gets the same scores."""
    import threading

    from captum_attention.capture.adapters import grids
    from captum_attention.capture.record import record_forward
    from captum_attention.maps.grad_sam import grad_sam_head_mean

    model, images = _case(family, "shifted")
    for name in METHODS:
        METHODS[name](model).attribute(images, target=TARGET)
        assert grids._NOTES.get() is None
    assert not [name for name in vars(grids) if name.isupper() and isinstance(vars(grids)[name], dict)]
    record = record_forward(model, model, (images,), None, track_grad=True)
    score = record.target_score(TARGET)
    here = record.capture.gradients(score, retain_graph=True)
    there: list = []
    thread = threading.Thread(target=lambda: there.extend(record.capture.gradients(score)))
    thread.start()
    thread.join()
    assert there and all(torch.equal(a, b) for a, b in zip(here, there))
    assert grad_sam_head_mean(record.attn_maps[0], here[0]).shape[-1] == record.attn_maps[0].shape[-1]
