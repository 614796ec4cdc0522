r"""An image classifier's patches as the token-removal metrics' features: with
:func:`image_patches`, :func:`~captum_attention.metrics.comprehensiveness`,
:func:`~captum_attention.metrics.sufficiency`, Chefer et al.'s
:func:`~captum_attention.metrics.perturbation_curve`,
:func:`~captum_attention.metrics.leave_one_out`,
:func:`~captum_attention.metrics.datamodeling_score` and the others score an attribution
over a ViT's (DeiT's, Swin's, ...) patch grid, a removed patch taking its pixels from a
baseline image (a grey one, through the same processor) instead of a token being deleted.

Each patch is a token id: patch :math:`p` of image :math:`b` is :math:`b P + p` (:math:`P`
patches an image), and a removed patch the id :data:`REMOVED`, which the metrics put in
its place (``removal="replace"``); the forward function they call turns the ids back into
images, greys the removed patches and runs the classifier on them, so the metrics batch
removals of several images' patches as they batch sentences'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..capture.inputs import output_logits
from ._checks import check_class_probabilities

REMOVED = -1
"""The id of a removed patch (the metrics' ``baseline_token_id``)."""


class GreyedPatches:
    """``forward(patch_ids, mask)``: the classifier's logits for the images ``patch_ids``
    ``(n, P)`` stand for, each removed patch (:data:`REMOVED`) taken from the baseline image."""

    def __init__(self, forward_func: Callable[..., Any], pixel_values: Tensor, baseline_pixels: Tensor, grid: tuple[int, int]) -> None:
        self.forward_func, self.pixel_values, self.grid = forward_func, pixel_values, grid
        self.baseline = baseline_pixels.to(pixel_values.device, pixel_values.dtype)

    def pixels(self, patch_ids: Tensor) -> Tensor:
        """``(n, channels, height, width)``: the images ``patch_ids`` stand for."""
        rows, columns = self.grid
        count = rows * columns
        kept = patch_ids != REMOVED
        in_place = patch_ids.dim() == 2 and patch_ids.shape[1] == count
        image = patch_ids.max(dim=1).values.clamp(min=0) // count if in_place else None  # every patch removed: the baseline
        if image is None or bool((kept & (patch_ids != image[:, None] * count + torch.arange(count, device=patch_ids.device))).any()):
            raise ValueError(
                f"patch ids of shape {tuple(patch_ids.shape)} are not rows of an image's {count} patches with the removed ones "
                f"{REMOVED}: the metrics must replace removed patches in place by {REMOVED} (pass **patches.removal: "
                f"{{'removal': 'replace', 'baseline_token_id': {REMOVED}}})."
            )
        channels, height, width = self.pixel_values.shape[1:]
        shape = (-1, channels, rows, height // rows, columns, width // columns)
        keep = kept.view(-1, 1, rows, 1, columns, 1).to(self.pixel_values.dtype)
        images = self.pixel_values[image.to(self.pixel_values.device)].view(shape)
        return (images * keep + self.baseline.view(shape) * (1 - keep)).view(-1, channels, height, width)

    def __call__(self, patch_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return output_logits(self.forward_func(self.pixels(patch_ids)))


@dataclass(frozen=True)
class ImagePatches:
    """What the token-removal metrics take, for an image classifier's patches.

    Attributes:
        forward_func: :class:`GreyedPatches`, the classifier on the images the ids stand
            for; its ``pixels(ids)`` gives those images.
        input_ids: ``(B, rows * columns)`` the patches' ids.
        attention_mask: ``(B, rows * columns)`` ones: every patch can be removed.
        removal: the metrics' ``removal`` and ``baseline_token_id``: pass ``**removal``.
    """

    forward_func: GreyedPatches
    input_ids: Tensor
    attention_mask: Tensor
    removal: dict[str, Any] = field(default_factory=lambda: {"removal": "replace", "baseline_token_id": REMOVED})


def image_patches(
    forward_func: Callable[..., Any], pixel_values: Tensor, baseline_pixels: Tensor, grid: Sequence[int]
) -> ImagePatches:
    """An image classifier's patches as the token-removal metrics' features.

    Args:
        forward_func (Callable): the classifier: ``forward_func(pixel_values)`` returns its
            logits ``(batch, classes)`` (a transformers image classifier itself).
        pixel_values (Tensor): ``(B, channels, height, width)`` the images explained.
        baseline_pixels (Tensor): ``(1, channels, height, width)`` (or without the batch
            dimension) the image a removed patch takes its pixels from: a uniform grey
            image through the same processor.
        grid (sequence of int): ``(rows, columns)`` the patch grid of the attributions (a
            method's ``attribute(pixel_values)``: a ViT's patches, a Swin's first stage's),
            whose cells tile the images.

    Returns:
        :class:`ImagePatches`; flatten the ``(B, rows, columns)`` attributions to ``(B,
        rows * columns)`` for the metrics.

    Example::

        >>> grid = AttnLRP(vit).attribute(pixel_values, target=label)            # (B, 14, 14)
        >>> patches = image_patches(vit, pixel_values, grey_pixels, grid.shape[1:])
        >>> curve = perturbation_curve(patches.forward_func, patches.input_ids, patches.attention_mask,
        ...                            grid.flatten(1), target=label, **patches.removal)
        >>> curve.auc_target_prob  # Chefer et al.'s positive perturbation test: lower is more faithful
    """
    if not isinstance(pixel_values, Tensor) or not pixel_values.is_floating_point() or pixel_values.dim() != 4:
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, Tensor) else type(pixel_values).__name__
        raise ValueError(f"pixel_values must be float images (batch, channels, height, width), got {shape}.")
    baseline = baseline_pixels[None] if isinstance(baseline_pixels, Tensor) and baseline_pixels.dim() == 3 else baseline_pixels
    if not isinstance(baseline, Tensor) or tuple(baseline.shape) != (1, *pixel_values.shape[1:]):
        shape = tuple(baseline_pixels.shape) if isinstance(baseline_pixels, Tensor) else type(baseline_pixels).__name__
        raise ValueError(f"baseline_pixels must be one image of the images' size {(1, *pixel_values.shape[1:])}, got {shape}.")
    rows, columns = _grid(grid, pixel_values)
    check_class_probabilities(forward_func)
    count = rows * columns
    ids = torch.arange(len(pixel_values), device=pixel_values.device)[:, None] * count + torch.arange(count, device=pixel_values.device)
    return ImagePatches(GreyedPatches(forward_func, pixel_values, baseline, (rows, columns)), ids, torch.ones_like(ids))


def box_patches(box: Sequence[float], image_size: Sequence[int], grid: Sequence[int]) -> Tensor:
    """The patches of a grid laid over the whole image that lie in an object's box, as the
    rationale of the plausibility metrics
    (:func:`~captum_attention.metrics.pointing_game`, :func:`~captum_attention.metrics.token_f1`,
    :func:`~captum_attention.metrics.auprc` over :func:`image_patches`' features).

    A patch lies in the box where its centre does; a box smaller than a patch, which holds
    no patch's centre, marks the patch that holds its own centre.

    Args:
        box (sequence of float): ``(x0, y0, x1, y1)``, the box's left, top, right and
            bottom edges in the image's pixels.
        image_size (sequence of int): ``(width, height)`` of the image (PIL's ``size``),
            whose whole the grid covers (a processor that resizes it without cropping:
            :func:`~captum_attention.presentation.answer.keeps_whole_image`).
        grid (sequence of int): ``(rows, columns)``.

    Returns:
        ``(rows * columns,)`` bool, in the row-major order of a flattened grid.
    """
    x0, y0, x1, y1 = (float(v) for v in box)
    width, height = image_size
    rows, columns = grid
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise ValueError(f"box {tuple(box)} is not within the {width} × {height} image: give (x0, y0, x1, y1), x0 < x1 and y0 < y1.")
    centres_x = (torch.arange(columns, dtype=torch.float64) + 0.5) * width / columns
    centres_y = (torch.arange(rows, dtype=torch.float64) + 0.5) * height / rows
    inside = ((centres_y >= y0) & (centres_y < y1))[:, None] & ((centres_x >= x0) & (centres_x < x1))[None, :]
    if not bool(inside.any()):
        row = min(int((y0 + y1) / 2 * rows / height), rows - 1)
        column = min(int((x0 + x1) / 2 * columns / width), columns - 1)
        inside[row, column] = True
    return inside.flatten()


def _grid(grid: Sequence[int], pixel_values: Tensor) -> tuple[int, int]:
    """``(rows, columns)``, checked to tile the images."""
    height, width = pixel_values.shape[-2:]
    if len(grid) != 2 or not all(isinstance(n, int) and n >= 1 for n in grid) or height % grid[0] or width % grid[1]:
        raise ValueError(
            f"grid must be (rows, columns) of patches that tile the {height}x{width} images, got {tuple(grid)}: give the "
            "attributions' grid (attribution.shape[1:])."
        )
    return int(grid[0]), int(grid[1])
