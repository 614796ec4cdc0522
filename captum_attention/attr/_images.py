"""Vision Transformers in the attributions: patch-grid scores upsampled to the image."""

from __future__ import annotations

from captum.attr import LayerAttribution
from torch import Tensor


def upsample_to_image(grid_scores: Tensor, images: Tensor, mode: str = "bilinear") -> Tensor:
    """Patch-grid scores ``(B, rows, columns)`` upsampled to the image size.

    Uses Captum's ``LayerAttribution.interpolate``. The result is channel-last,
    ``(B, H, W, 1)``, so that ``visualize_image_attr(upsampled[i].numpy(), image_hwc)``
    takes one example directly.

    Args:
        grid_scores (Tensor): ``(batch, rows, columns)`` scores, e.g. from ``attribute``
            on images.
        images (Tensor): the ``(batch, channels, height, width)`` images explained.
        mode (str, optional): interpolation mode. Default: ``"bilinear"``.

    Returns:
        Tensor ``(batch, height, width, 1)``.
    """
    upsampled = LayerAttribution.interpolate(grid_scores[:, None], tuple(images.shape[-2:]), mode)
    return upsampled.permute(0, 2, 3, 1)
