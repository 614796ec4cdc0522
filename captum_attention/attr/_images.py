"""Vision Transformers in the attributions: the patch grid of an image and upsampling to it."""

from __future__ import annotations

from captum.attr import LayerAttribution
from torch import Tensor, nn


def grid_shape(model: nn.Module, images: Tensor) -> tuple[int, int]:
    """``(rows, columns)`` of patches for ``images`` ``(B, C, H, W)``, from the config's patch size."""
    patch = getattr(getattr(model, "config", None), "patch_size", None)
    if patch is None:
        raise ValueError(
            f"Cannot place the tokens of {type(model).__name__} on a patch grid: its config "
            "has no patch_size. Pass token inputs, or a vision transformer (ViT, DeiT)."
        )
    rows, columns = (patch, patch) if isinstance(patch, int) else tuple(patch)
    return images.shape[-2] // rows, images.shape[-1] // columns


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
