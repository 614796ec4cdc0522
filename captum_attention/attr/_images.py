"""Images in the attributions: patch-grid scores upsampled to the image, and a
vision-language model's token scores (and pixels' relevance) placed on its images' grids."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

from captum.attr import LayerAttribution
from torch import Tensor, nn

from .._compat import check_one_tensor
from ..capture.adapters.images import image_token_layout, pixel_patch_grids


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
        Tensor ``(batch, height, width, 1)``. Scores or images of other shapes (flat
        scores, channel-last images) are refused in one line.
    """
    _check_grid_and_images(grid_scores, images)
    upsampled = LayerAttribution.interpolate(grid_scores[:, None], tuple(images.shape[-2:]), mode)
    return upsampled.permute(0, 2, 3, 1)


IMAGE_CHANNELS = (1, 3, 4)
"""The channel counts of images: grey, RGB, RGBA."""


def _check_grid_and_images(grid_scores: Tensor, images: Tensor) -> None:
    """A one-line error where ``grid_scores`` are not ``(batch, rows, columns)`` or
    ``images`` not ``(batch, channels, height, width)``: channel-last images would be
    upsampled to their width and channels."""
    check_one_tensor(grid_scores, "grid_scores")
    check_one_tensor(images, "images")
    if grid_scores.dim() != 3:
        raise ValueError(
            f"grid_scores have shape {tuple(grid_scores.shape)}, not (batch, rows, columns): give the patch grid's scores "
            "(a model's flattened patches' scores reshaped to its grid)."
        )
    if images.dim() != 4:
        raise ValueError(f"images have shape {tuple(images.shape)}, not (batch, channels, height, width).")
    if images.shape[-1] in IMAGE_CHANNELS and images.shape[1] not in IMAGE_CHANNELS:
        raise ValueError(
            f"images have shape {tuple(images.shape)}, channel-last: give them as (batch, channels, height, width), "
            "images.permute(0, 3, 1, 2)."
        )


def image_scores(
    model: nn.Module, input_ids: Tensor, scores: Tensor | tuple[Tensor, Tensor], image_inputs: Mapping[str, Any] | None = None
) -> list[list[Tensor]]:
    r"""A vision-language model's token scores placed on each image's patch grid.

    The scores of ``attribute``, ``attribute_span`` or ``attribute_continuation`` on a
    vision-language model (LLaVA, PaliGemma, Gemma 3, Qwen2-VL, Idefics3, ...) are over
    every token its language model read, each image's tokens among them. This reads, from
    the family's config and image inputs, which positions hold each image and in what grid
    they were laid out (:mod:`captum_attention.capture.adapters.images`: LLaVA's one token
    per patch, Qwen2-VL's 2×2 merge, Idefics3's pixel shuffle per tile, ...) and returns
    them on that grid. A family whose layout is not known gets its image tokens' scores in
    sequence order, with a warning, never a guessed grid.

    Mllama reads its images by cross-attention, not as tokens: its methods return
    ``(image-state scores, text scores)`` like an encoder-decoder's ``(source, target)``,
    and the image-state scores are placed here, each image's tiles put back in place
    (their class tokens left out).

    Args:
        model (nn.Module): the vision-language model explained.
        input_ids (Tensor): ``(batch, seq_len)`` token ids as the processor expanded them
            (one image token per token the image gives the language model).
        scores (Tensor or tuple): ``(batch, seq_len)`` token scores, or ``(batch, rows,
            seq_len)`` token rows from ``attribute_continuation`` (``seq_len`` may extend
            past the prompt's: the continuation holds no image tokens); Mllama's pair of
            ``(image states, text)`` scores or rows.
        image_inputs (Mapping, optional): the image inputs passed to the model
            (``image_grid_thw`` for Qwen2-VL; ``aspect_ratio_ids`` and
            ``aspect_ratio_mask`` for Mllama). Default: None.

    Returns:
        Per example, per image (per tile for Idefics3 and SmolVLM: the split image's tiles
        row by row, then the whole image; for LLaVA-NeXT the whole image resized, then its
        tiles as one grid), its scores ``(grid rows, grid columns)``, with a leading axis
        of token rows for ``(batch, rows, seq_len)`` scores.

    Example::

        >>> inputs = (mask, {"pixel_values": pixels})
        >>> span = GradSAM(llava).attribute_span(input_ids, answer, additional_forward_args=inputs)
        >>> first_image = image_scores(llava, input_ids, span)[0][0]  # (24, 24) for LLaVA-1.5
    """
    if isinstance(scores, tuple):  # Mllama's (image states, text): the states are placed
        scores = scores[0]
    placed: list[list[Tensor]] = []
    unplaced = False
    for example, images in enumerate(image_token_layout(model, input_ids, image_inputs or {})):
        placed.append([])
        for image in images:
            tokens = scores[example, ..., image.grid_positions.to(scores.device)]
            unplaced |= image.grid is None
            placed[-1].append(tokens if image.grid is None else tokens.reshape(*tokens.shape[:-1], *image.grid))
    if unplaced:
        warnings.warn(
            f"The layout of {getattr(model.config, 'model_type', type(model).__name__)}'s image tokens is not known: "
            "their scores are returned in sequence order, not on a grid.",
            stacklevel=2,
        )
    return placed


def pixel_scores(model: nn.Module, pixel_relevance: Tensor, image_inputs: Mapping[str, Any] | None = None) -> list[Tensor]:
    r"""AttnLRP's relevance of a vision-language model's pixels (``through_vision_tower=True``)
    summed per patch of its vision tower: one ``(rows, columns)`` grid per image (per tile
    for tiled images), in the order of ``pixel_values``. Any per-pixel scores of an image
    captioner's or an image classifier's pixels (Captum's Integrated Gradients') are summed
    per patch of its own image encoder so too.

    Images given as ``(..., channels, height, width)`` pixels are pooled by the tower's
    ``patch_size`` (Pixtral's cut to their ``image_sizes``); Qwen2-VL's flattened patches
    are unfolded with ``image_grid_thw`` (each ``spatial_merge_size`` × ``spatial_merge_size``
    block of neighbours consecutive, as its processor flattens them). Other layouts raise
    one clear error.

    Args:
        model (nn.Module): the vision-language model explained.
        pixel_relevance (Tensor): the pixels' relevance, shaped as ``pixel_values``.
        image_inputs (Mapping, optional): the image inputs passed to the model
            (``image_grid_thw``, ``image_sizes``). Default: None.

    Returns:
        list of Tensor ``(rows, columns)``, one per image or tile.

    Example::

        >>> tokens, pixels = AttnLRP(llava).attribute_span(
        ...     input_ids, answer, additional_forward_args=(mask, images), through_vision_tower=True)
        >>> first = pixel_scores(llava, pixels, images)[0]  # (24, 24) for LLaVA-1.5
    """
    return pixel_patch_grids(model.config, pixel_relevance, image_inputs or {})


def grid_follows_image(grid: tuple[int, int], size: tuple[int, int]) -> bool:
    """Whether a ``(rows, columns)`` grid of image tokens follows an image of ``(width,
    height)`` pixels (PIL's order), within a cell along one side: the grid can then be
    laid over the whole image, as a processor that resizes it whole makes it (one that
    crops or pads it makes a grid of another shape, for any image but a square)."""
    rows, columns = grid
    width, height = size
    return round(height * columns / width) == rows or round(width * rows / height) == columns
