"""The token-removal metrics over an image classifier's patches (``metrics.image_patches``):
each removal greys the patches a direct re-computation greys by hand."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

from captum_attention import AttnLRP
from captum_attention.metrics import ImagePatches, image_patches, leave_one_out, perturbation_curve, sufficiency
from captum_attention.metrics.image_patches import REMOVED

PATCH, SIDE = 8, 32
GRID = (SIDE // PATCH, SIDE // PATCH)


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    config = tf.ViTConfig(image_size=SIDE, patch_size=PATCH, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, initializer_range=0.3, num_labels=3)
    return tf.ViTForImageClassification(config).eval()


PIXELS = torch.randn(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
GREY = torch.full((1, 3, SIDE, SIDE), 0.25)


def _greyed(image: torch.Tensor, patches: list[int]) -> torch.Tensor:
    """``image`` with the ``patches`` (row-major on the grid) taken from the grey image."""
    out = image.clone()
    for patch in patches:
        row, column = divmod(patch, GRID[1])
        out[:, row * PATCH:(row + 1) * PATCH, column * PATCH:(column + 1) * PATCH] = GREY[0, :, :PATCH, :PATCH]
    return out


def _probability(vit, image: torch.Tensor, label: int) -> float:
    with torch.no_grad():
        return float(vit(image[None]).logits.softmax(-1)[0, label])


def test_leave_one_out_greys_each_patch_of_each_image_alone(vit):
    patches = image_patches(vit, PIXELS, GREY, GRID)
    labels = torch.tensor([0, 2])
    drops = leave_one_out(patches.forward_func, patches.input_ids, patches.attention_mask, target=labels, **patches.removal)
    expected = torch.tensor([
        [_probability(vit, PIXELS[b], int(labels[b])) - _probability(vit, _greyed(PIXELS[b], [p]), int(labels[b]))
         for p in range(GRID[0] * GRID[1])]
        for b in range(2)
    ])
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(drops, expected, rtol=1e-4, atol=1e-6)


def test_chefers_perturbation_test_greys_the_most_relevant_patches_first(vit):
    """AttnLRP's grid, flattened: at each step the top ⌈fraction · 16⌉ patches are greyed."""
    labels = torch.tensor([1, 1])
    grid = AttnLRP(vit).attribute(PIXELS, target=labels).detach()
    patches = image_patches(vit, PIXELS, GREY, grid.shape[1:])
    scores = grid.flatten(1)
    curve = perturbation_curve(patches.forward_func, patches.input_ids, patches.attention_mask, scores, target=labels,
                               steps=(25, 50), **patches.removal)
    for b in range(2):
        order = scores[b].argsort(descending=True).tolist()
        for step, fraction in enumerate((0.25, 0.5), start=1):  # the steps are percentages
            greyed = _greyed(PIXELS[b], order[: math.ceil(fraction * 16)])
            assert float(curve.target_prob[b, step]) == pytest.approx(_probability(vit, greyed, 1), abs=1e-5)
    kept = sufficiency(patches.forward_func, patches.input_ids, patches.attention_mask, scores, target=labels, bins=(25,),
                       **patches.removal)
    for b in range(2):
        order = scores[b].argsort(descending=True).tolist()
        only_top = _greyed(PIXELS[b], order[4:])
        assert float(kept[b, 0]) == pytest.approx(_probability(vit, PIXELS[b], 1) - _probability(vit, only_top, 1), abs=1e-5)


def test_a_row_of_every_patch_removed_is_the_grey_image(vit):
    patches = image_patches(vit, PIXELS, GREY[0], GRID)
    ids = torch.tensor([[REMOVED] * 16, list(range(16, 32))])
    images = patches.forward_func.pixels(ids)
    torch.testing.assert_close(images[0], GREY[0])
    torch.testing.assert_close(images[1], PIXELS[1])


def test_what_the_patches_cannot_be_is_refused_in_one_line(vit):
    patches = image_patches(vit, PIXELS, GREY, GRID)
    assert isinstance(patches, ImagePatches)
    in_place = r"the metrics must replace removed patches in place by -1 \(pass \*\*patches.removal"
    with pytest.raises(ValueError, match=in_place):  # deleted
        leave_one_out(patches.forward_func, patches.input_ids, patches.attention_mask, target=0)
    with pytest.raises(ValueError, match=in_place):  # replaced by id 0, perturbation_curve's default: patch 0 of image 0
        perturbation_curve(patches.forward_func, patches.input_ids, patches.attention_mask, torch.rand(2, 16), target=0)
    with pytest.raises(ValueError, match=r"grid must be \(rows, columns\) of patches that tile the 32x32 images, got \(5, 4\)"):
        image_patches(vit, PIXELS, GREY, (5, 4))
    with pytest.raises(ValueError, match=r"baseline_pixels must be one image of the images' size \(1, 3, 32, 32\), got \(2, 3, 32, 32\)"):
        image_patches(vit, PIXELS, PIXELS, GRID)
    with pytest.raises(ValueError, match=r"pixel_values must be float images \(batch, channels, height, width\), got \(3, 32, 32\)"):
        image_patches(vit, PIXELS[0], GREY, GRID)
    vit.config.problem_type = "multi_label_classification"
    try:
        with pytest.raises(ValueError, match="configured with problem_type 'multi_label_classification'"):
            image_patches(vit, PIXELS, GREY, GRID)
    finally:
        vit.config.problem_type = None
