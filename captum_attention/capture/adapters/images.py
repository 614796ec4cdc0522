"""Vision-language models: the language model a capture explains, and where each image's
tokens lie in its sequence and on the image's patch grid.

A vision-language model (LLaVA, PaliGemma, Qwen2-VL, Idefics3, ...) encodes its images with
a vision tower, projects the features and puts them in place of the image tokens of the
prompt; its language model then reads one sequence, the image's tokens among the text.
Explaining the answer is explaining that language model: the capture records the language
model's attention only (the vision tower's runs over other positions), and its scores are
over every token it read. :func:`image_token_layout` says, per example, which positions
hold each image's tokens and in what grid they were laid out, from the family's own
config and image inputs:

- ``llava``, ``paligemma``: one token per patch of the vision tower, row by row (LLaVA's
  ``"full"`` feature selection keeps CLIP's class token first, outside the grid);
- ``gemma3``: ``mm_tokens_per_image`` tokens, the patch grid average-pooled to a square;
- ``qwen2_vl``, ``qwen2_5_vl``: per image ``image_grid_thw`` patches merged
  ``spatial_merge_size`` × ``spatial_merge_size``, row by row;
- ``mistral3`` (and LLaVA with a Pixtral vision tower): each image at its own size,
  ``image_sizes`` in patches merged ``spatial_merge_size`` × ``spatial_merge_size`` (none
  for LLaVA), row by row, the row-break tokens between rows being text;
- ``idefics3``, ``smolvlm``: per tile (the split image's tiles row by row, then the whole
  image), the tile's patches pixel-shuffled by ``scale_factor``: one grid per tile;
- ``llava_next``: per image two grids, the whole image resized, then its tiles' patches
  as one grid unpadded to the image's shape, each row followed by a newline feature.

Mllama's language model does not read its images as tokens: its cross-attention layers
attend to the vision tower's states, ``images × tiles × (class token + patches)`` per
example (:func:`cross_attended_real` says which belong to an image's tiles). Its layout is
over those states: per image one grid, its tiles' patches put back in place
(``supported_aspect_ratios[aspect_ratio_ids - 1]`` tiles down and across, row by row, as
its processor cut them), the tiles' class tokens outside it.

A family missing here gets its image tokens' scores without a grid (and a one-line note),
never a wrong grid.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import Tensor, nn

from .protocol import TOWER_INPUTS, UnsupportedModelError


@dataclass(frozen=True)
class ImageTokens:
    """One image (or tile) of one example: the positions of its tokens in the sequence,
    and the ``(rows, columns)`` grid they fill row by row after ``leading`` tokens that
    lie outside it (LLaVA's class token), each row followed by ``row_breaks`` tokens of
    no cell (LLaVA-NeXT's newline feature); ``grid`` is None where the family's layout is
    unknown."""

    positions: Tensor
    grid: tuple[int, int] | None
    leading: int = 0
    row_breaks: int = 0

    @property
    def grid_positions(self) -> Tensor:
        """The positions of the grid's cells, row by row (all of them without a grid)."""
        if self.grid is None:
            return self.positions
        rows, columns = self.grid
        cells = self.positions[self.leading :].view(rows, columns + self.row_breaks)
        return cells[:, :columns].flatten()


def image_encoder_config(config: Any) -> Any:
    """The config of a model's image encoder: its ``vision_config`` (CLIP, SigLIP, the
    vision-language models) or a ``VisionEncoderDecoderModel``'s ``encoder``; None where
    it names neither."""
    return getattr(config, "vision_config", None) or getattr(config, "encoder", None)


def language_model_of(model: nn.Module) -> nn.Module | None:
    """The language model of a vision-language model (its ``get_decoder()``, a module
    inside it), else None."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None or getattr(config, "is_encoder_decoder", False):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    if not callable(get_decoder):
        return None
    try:
        decoder = get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def image_token_id(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


IMAGE_MARKERS = (
    "boi_token_id", "boi_token_index", "eoi_token_id", "eoi_token_index", "image_start_token_id", "image_end_token_id",
    "low_res_image_start_token_id", "vision_start_token_id", "vision_end_token_id", "im_start_id", "im_end_id", "im_newline_id",
)
"""The config fields that name the tokens a family's processor puts around or inside an
image's tokens (Gemma 3's begin and end of image, Qwen2-VL's vision start and end, GLM-4V's,
Ovis2.5's and Molmo2's image start and end, HunYuan-VL's image start, end and newlines)."""


def image_marker_ids(config: Any) -> list[int]:
    """The ids of the tokens that make up an image's span in a prompt: its image token
    (:func:`image_token_id`) and the markers the config names (:data:`IMAGE_MARKERS`)."""
    named = [image_token_id(config), *(getattr(config, name, None) for name in IMAGE_MARKERS)]
    return [value for value in named if isinstance(value, int) and not isinstance(value, bool)]


ENCODED_IMAGES = "mm_encoder_outputs"
"""The keyword under which a transformers model takes its images encoded by its tower."""


def takes_encoded_images(model: Any, image_inputs: Mapping[str, Any] | None) -> bool:
    """Whether ``model`` is a transformers model whose forward takes its images encoded
    (:data:`ENCODED_IMAGES`) and ``image_inputs`` hold what its tower reads."""
    takes = getattr(model, "_supports_mm_encoder_outputs", None)
    return (
        bool(set(TOWER_INPUTS) & set(image_inputs or {})) and takes is not None
        and hasattr(model, "_prepare_multimodal_encoder_kwargs_for_generation")
        and hasattr(model, "_expand_multimodal_outputs") and takes()
    )


def encoded_images(model: Any, image_inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """One example's images through ``model``'s vision tower once, as transformers'
    ``generate`` encodes them before its first step (:data:`ENCODED_IMAGES`), or None where
    the model takes none (:func:`takes_encoded_images`) or encoding them fails."""
    if not takes_encoded_images(model, image_inputs):
        return None
    try:
        with torch.no_grad():
            encoded = model._prepare_multimodal_encoder_kwargs_for_generation(dict(image_inputs))
    except Exception:  # noqa: BLE001 - its own forward encodes them as it does
        return None
    return encoded.get(ENCODED_IMAGES) or None


def with_encoded_images(image_inputs: Mapping[str, Any], encoded: Any) -> dict[str, Any]:
    """``image_inputs`` that take the images ``encoded`` (:data:`ENCODED_IMAGES`, from
    :func:`encoded_images` or :func:`encoded_copies`) in place of what the tower reads
    (:data:`TOWER_INPUTS`)."""
    return {**{name: value for name, value in image_inputs.items() if name not in TOWER_INPUTS}, ENCODED_IMAGES: encoded}


def encoded_copies(model: Any, input_ids: Tensor, encoded: Mapping[str, Any], copies: int) -> dict[str, Any]:
    """One example's ``encoded`` images (:func:`encoded_images`) for ``copies`` rows, repeated
    as ``generate`` repeats them for its beams (it changes the outputs it is given: copies
    of them), to be given as :data:`ENCODED_IMAGES` in place of the :data:`TOWER_INPUTS`.
    ``input_ids``: the example's ``(1, N)``, which place its images."""
    outputs = {modality: copy.copy(output) for modality, output in encoded.items()}
    return model._expand_multimodal_outputs(input_ids, outputs, expand_size=copies)


IMAGE_POSITION_MASKS = ("image_embeds_position_mask",)
"""The image inputs that mark, per token, where a family's image features replace the
tokens' embeddings (Kosmos-2's), whatever those tokens' ids."""


def marked_image_positions(image_inputs: Mapping[str, Any] | None, shape: torch.Size) -> Tensor | None:
    """``shape`` bool: the prompt's positions an image input of :data:`IMAGE_POSITION_MASKS`
    marks, or None where none is given."""
    for name in IMAGE_POSITION_MASKS:
        value = (image_inputs or {}).get(name)
        if isinstance(value, Tensor) and tuple(value.shape) == tuple(shape):
            return value != 0
    return None


def image_token_layout(model: nn.Module, input_ids: Tensor, image_inputs: Mapping[str, Any]) -> list[list[ImageTokens]]:
    """Per example, its images' tokens in order (see the module docstring); for a model
    that cross-attends to its images (Mllama), its images' positions among the vision
    states, ``input_ids`` unread.

    Raises:
        ValueError: the model names no image token, or the image tokens in ``input_ids``
            are not as many as its images' layout needs.
    """
    config = model.config
    if image_outside_prompt(model):
        return _class_token_then_patches(config, image_inputs)
    if cross_attends_images(model):
        return _mllama_images(config, image_inputs)
    token = image_token_id(config)
    if token is None:
        raise ValueError(f"{type(model).__name__}'s config names no image token id: its image tokens cannot be found.")
    held = input_ids == token
    layout = _LAYOUTS.get(str(getattr(config, "model_type", "")))
    shapes = _unplaced(held) if layout is None else layout(config, held, image_inputs)
    return [_split(row.nonzero().flatten(), per_example, example) for example, (row, per_example) in enumerate(zip(held, shapes))]


class _Shape(NamedTuple):
    """An image's token count, grid (None: unknown), leading tokens and tokens after
    each row (see :class:`ImageTokens`)."""

    tokens: int
    grid: tuple[int, int] | None
    leading: int = 0
    row_breaks: int = 0


def _split(positions: Tensor, shapes: list[_Shape], example: int) -> list[ImageTokens]:
    needed = sum(shape.tokens for shape in shapes)
    if needed != len(positions):
        raise ValueError(
            f"Example {example} holds {len(positions)} image tokens, but its {len(shapes)} image(s) need {needed}: "
            "pass the prompt as the model's processor expands it, with its image inputs."
        )
    images, start = [], 0
    for shape in shapes:
        images.append(ImageTokens(positions[start : start + shape.tokens], shape.grid, shape.leading, shape.row_breaks))
        start += shape.tokens
    return images


def _side(config: Any) -> int:
    vision = config.vision_config
    size, patch = vision.image_size, vision.patch_size
    size = size if isinstance(size, int) else size[0]
    patch = patch if isinstance(patch, int) else patch[0]
    return size // patch


def _fixed(shape: Callable[[Any], _Shape]) -> Callable[[Any, Tensor, Mapping[str, Any]], list[list[_Shape]]]:
    """A family whose every image has the same tokens: as many images per example as its
    image tokens hold."""

    def layout(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
        image = shape(config)
        return [[image] * -(-int(row.sum()) // image.tokens) for row in held]

    return layout


def _llava(config: Any) -> _Shape:
    side = _side(config)
    leading = int(getattr(config, "vision_feature_select_strategy", "default") == "full")
    return _Shape(side * side + leading, (side, side), leading)


def _paligemma(config: Any) -> _Shape:
    side = _side(config)
    return _Shape(side * side, (side, side))


def _gemma3(config: Any) -> _Shape:
    side = math.isqrt(int(config.mm_tokens_per_image))
    return _Shape(side * side, (side, side))


def _idefics3(config: Any) -> _Shape:
    side = _side(config) // int(config.scale_factor)
    return _Shape(side * side, (side, side))


def _chameleon(config: Any) -> _Shape:
    """Its VQ-VAE's codes of its square images, row by row."""
    side = int(config.vq_config.resolution) // _vq_codes(config)
    return _Shape(side * side, (side, side))


def _florence2(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
    """Florence-2's: per image, the mean of its features first, then its DaViT's last
    stage row by row, each stage's patch convolution shrinking the image."""
    pixels = image_inputs.get("pixel_values")
    if not isinstance(pixels, Tensor):
        raise ValueError("florence2 needs pixel_values to place its image tokens: pass the processor's image inputs.")
    vision = config.vision_config
    rows, columns = pixels.shape[-2:]
    for size, stride, padding in zip(vision.patch_size, vision.patch_stride, vision.patch_padding):
        rows, columns = (rows + 2 * padding - size) // stride + 1, (columns + 2 * padding - size) // stride + 1
    return _in_token_order(held, [_Shape(1 + rows * columns, (rows, columns), 1)] * len(pixels), "pixel_values")


def _qwen2_vl(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
    """Each image's ``(t, h, w)`` patches from ``image_grid_thw``, in the order of the
    batch's image tokens, merged ``m × m``: ``(h/m, w/m)`` (a video's frames refused)."""
    grids = image_inputs.get("image_grid_thw")
    if grids is None:
        raise ValueError(f"{config.model_type} needs image_grid_thw to place its image tokens: pass the processor's image inputs.")
    merge = int(config.vision_config.spatial_merge_size)
    images: list[_Shape] = []
    for frames, height, width in torch.as_tensor(grids).tolist():
        if frames != 1:
            raise UnsupportedModelError(f"{config.model_type}: an image of {frames} frames is a video; only images are placed on a grid.")
        images.append(_Shape(height * width // merge**2, (height // merge, width // merge)))
    return _in_token_order(held, images, "image_grid_thw")


def _image_sizes(pixels_per_token: Callable[[Any], int], row_breaks: int = 0) -> Callable[[Any, Tensor, Mapping[str, Any]], list[list[_Shape]]]:
    """Images at their own sizes: each ``image_sizes`` ``(height, width)`` in pixels,
    ``pixels_per_token(config)`` pixels a token's side, row by row, ``row_breaks`` tokens
    of the image's after each row (Emu3's end of line; Pixtral's row breaks are text)."""

    def layout(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
        sizes = image_inputs.get("image_sizes")
        if sizes is None:
            raise ValueError(f"{config.model_type} needs image_sizes to place its image tokens: pass the processor's image inputs.")
        side = pixels_per_token(config)
        grids = [(int(height) // side, int(width) // side) for height, width in torch.as_tensor(sizes).tolist()]
        images = [_Shape(rows * (columns + row_breaks), (rows, columns), 0, row_breaks) for rows, columns in grids]
        return _in_token_order(held, images, "image_sizes")

    return layout


def _pixtral_patches(merge_name: str | None) -> Callable[[Any], int]:
    """Pixtral's patches, merged ``m × m`` (``config.<merge_name>``, 1 for none)."""
    return lambda config: int(config.vision_config.patch_size) * (int(getattr(config, merge_name)) if merge_name else 1)


def _vq_codes(config: Any) -> int:
    """A VQ-VAE's code per pixels: the image halved once per stage after the first."""
    return 2 ** (len(config.vq_config.channel_multiplier) - 1)


def _in_token_order(held: Tensor, images: list[_Shape], given: str) -> list[list[_Shape]]:
    """The batch's images, in order, given to its examples by their image tokens."""
    remaining, shapes = list(images), []
    for row in held:
        tokens, mine = int(row.sum()), []
        while tokens > 0 and remaining:
            mine.append(remaining.pop(0))
            tokens -= mine[-1][0]
        shapes.append(mine)
    if remaining:
        raise ValueError(f"{given} holds {len(remaining)} image(s) more than the prompts' image tokens: pass the images of these prompts.")
    return shapes


def _llava_layout(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
    """LLaVA's: a square grid per image, or, with a Pixtral vision tower, each image at its
    own size."""
    if getattr(config.vision_config, "model_type", None) != "pixtral":
        return _fixed(_llava)(config, held, image_inputs)
    if config.vision_feature_select_strategy == "full":
        return _image_sizes(_pixtral_patches(None))(config, held, image_inputs)
    return _unplaced(held)  # the "default" strategy drops the batch's first feature only


def _llava_next(config: Any, held: Tensor, image_inputs: Mapping[str, Any]) -> list[list[_Shape]]:
    """LLaVA-NeXT's any resolution: per image, the whole image resized (a square grid),
    then its tiles' patches as one grid over the tiles (laid out by transformers' own
    ``get_anyres_image_grid_shape``), unpadded to the image's shape (``unpad_image``),
    each row followed by a newline feature."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    sizes = image_inputs.get("image_sizes")
    if sizes is None:
        raise ValueError(f"{config.model_type} needs image_sizes to place its image tokens: pass the processor's image inputs.")
    if config.vision_feature_select_strategy != "default":
        return _unplaced(held)
    side, size = _side(config), config.vision_config.image_size
    images: list[_Shape] = []
    for height, width in torch.as_tensor(sizes).tolist():
        tiles_down, tiles_across = get_anyres_image_grid_shape((height, width), config.image_grid_pinpoints, size)
        rows, columns = unpad_image(torch.empty(1, tiles_down * side, tiles_across * side), torch.tensor([height, width])).shape[1:]
        images += [_Shape(side * side, (side, side)), _Shape(rows * (columns + 1), (rows, columns), row_breaks=1)]
    return _in_token_order(held, images, "image_sizes")


def _unplaced(held: Tensor) -> list[list[_Shape]]:
    """Each example's image tokens as one run, without a grid."""
    return [[_Shape(int(row.sum()), None)] if bool(row.any()) else [] for row in held]


_LAYOUTS: dict[str, Callable[[Any, Tensor, Mapping[str, Any]], list[list[_Shape]]]] = {
    "llava": _llava_layout,
    "llava_next": _llava_next,
    "mistral3": _image_sizes(_pixtral_patches("spatial_merge_size")),
    "paligemma": _fixed(_paligemma),
    "gemma3": _fixed(_gemma3),
    "idefics3": _fixed(_idefics3),
    "smolvlm": _fixed(_idefics3),
    "chameleon": _fixed(_chameleon),
    "emu3": _image_sizes(_vq_codes, row_breaks=1),
    "florence2": _florence2,
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_vl,
}
"""Per ``config.model_type``: the token count, grid and leading tokens of each image of
each example."""


CROSS_ATTENDED = frozenset({"mllama", "blip"})
"""Families whose language model reads the images through cross-attention to the vision
tower's states (the keys of its ``"cross"`` calls), not as tokens of its sequence."""


def cross_attends_images(model: Any) -> bool:
    """Whether ``model``'s language model reads its images by cross-attention (Mllama, BLIP)."""
    return getattr(getattr(model, "config", None), "model_type", None) in CROSS_ATTENDED


IMAGE_FEATURES_FIRST = {"git": "GitProjection"}
"""Families whose text model reads the image's features as positions of its own before the
prompt's tokens, with no token of the prompt standing for them (GIT's), by the class of the
module whose output those features are."""


def leading_image_features(model: Any) -> nn.Module | None:
    """The module whose output ``model`` puts before its prompt's token embeddings (GIT's
    visual projection), or None for a model that reads its image otherwise or not at all."""
    found = IMAGE_FEATURES_FIRST.get(str(getattr(getattr(model, "config", None), "model_type", "")))
    if found is None or not isinstance(model, nn.Module):
        return None
    return next((module for module in model.modules() if type(module).__name__ == found), None)


def image_read_apart(model: Any) -> bool:
    """Whether ``model``'s scores of its image come apart from its prompt tokens', first of
    a pair: the states it cross-attends to (Mllama's, BLIP's), the features it puts before
    its tokens (GIT's)."""
    return cross_attends_images(model) or leading_image_features(model) is not None


IMAGE_APART_FROM_PROMPT = frozenset({"blip", "git"})
"""Families whose language model reads one image (each frame of a video) as its class token
and patches apart from the prompt, no token of the prompt standing for it: BLIP's states,
which it cross-attends to, and GIT's features, put before its tokens. They caption an image
after their start token alone."""


def image_outside_prompt(model: Any) -> bool:
    """Whether ``model`` reads its image with no token of its prompt standing for it
    (:data:`IMAGE_APART_FROM_PROMPT`)."""
    return getattr(getattr(model, "config", None), "model_type", None) in IMAGE_APART_FROM_PROMPT


def prompt_as_generated(model: nn.Module, ids: Tensor, *per_token: Tensor) -> tuple[Tensor, ...]:
    """The processor's prompt ``ids`` ``(B, N)`` as the model's ``generate`` reads it, and
    ``per_token`` values ``(..., N)`` cut as it is: BLIP's with ``bos_token_id`` in place of
    its first token and without its last ([SEP]); GIT's without the [SEP] its processor
    ends it with (its ``eos_token_id``: GIT answers a question after ``[CLS]`` and the
    question, and captions after ``[CLS]`` alone); any other model's as given."""
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type == "git" and ids.shape[1] > 1 and bool((ids[:, -1] == config.eos_token_id).all()):
        return (ids[:, :-1], *(value[..., :-1] for value in per_token))
    if model_type != "blip":
        return (ids, *per_token)
    read = ids[:, :-1].clone()
    read[:, 0] = config.text_config.bos_token_id
    return (read, *(value[..., :-1] for value in per_token))


def generate_inputs(model: nn.Module, ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The processor's prompt ``ids`` and ``mask`` as to give them to the model's
    ``generate``: BLIP's as the processor gives them (its ``generate`` cuts them itself),
    any other model's as its ``generate`` reads them (:func:`prompt_as_generated`: GIT's
    without its [SEP])."""
    if getattr(getattr(model, "config", None), "model_type", None) == "blip":
        return ids, mask
    read, read_mask = prompt_as_generated(model, ids, mask)
    return read, read_mask


def check_captioner_prompt(model: nn.Module, prompt: Tensor) -> None:
    """A one-line error for a BLIP prompt that its ``generate`` never reads: it puts
    ``bos_token_id`` in place of the processor's first token ([CLS]) and drops the last
    ([SEP]), so an answer follows that prompt, not the processor's."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "blip":
        return
    text = config.text_config
    if bool((prompt[:, -1] == text.sep_token_id).any()) or not bool((prompt == text.bos_token_id).any(dim=1).all()):
        raise ValueError(
            f"BLIP's generate reads a prompt that starts with bos_token_id ({text.bos_token_id}) and has no final "
            f"[SEP] ({text.sep_token_id}), and its answers follow that prompt: explain it as generate reads it, "
            "ids = input_ids[:, :-1].clone(); ids[:, 0] = bos_token_id (one prompt, or prompts padded on the left)."
        )


def _blip_patches(config: Any, image_inputs: Mapping[str, Any]) -> tuple[int, int, int]:
    """BLIP: the examples, and the rows and columns of patches of the one image each
    gives its vision tower (after its class token)."""
    pixels = image_inputs.get("pixel_values")
    if pixels is None:
        raise ValueError(f"{config.model_type.upper()} reads its image's features: pass the processor's pixel_values.")
    patch = config.vision_config.patch_size
    return pixels.shape[0], pixels.shape[-2] // patch, pixels.shape[-1] // patch


def _class_token_then_patches(config: Any, image_inputs: Mapping[str, Any]) -> list[list[ImageTokens]]:
    """Per example, the patches of each image (of each frame of a video's ``(B, frames,
    channels, height, width)`` pixels) among the image features the text model reads, each
    image's class token first and left out: BLIP's states, GIT's features before its
    tokens."""
    examples, rows, columns = _blip_patches(config, image_inputs)
    pixels = image_inputs["pixel_values"]
    frames, per_image = pixels.shape[1] if pixels.dim() == 5 else 1, 1 + rows * columns
    images = [ImageTokens(frame * per_image + 1 + torch.arange(rows * columns), (rows, columns)) for frame in range(frames)]
    return [list(images) for _ in range(examples)]


def _mllama_tiles(config: Any, image_inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, int]:
    """``aspect_ratio_ids`` ``(B, images)``, ``aspect_ratio_mask`` ``(B, images, tiles)``
    (real tiles) and the states per tile (class token + patches)."""
    ids, mask = image_inputs.get("aspect_ratio_ids"), image_inputs.get("aspect_ratio_mask")
    if ids is None or mask is None:
        raise ValueError("Mllama's images are placed by their aspect_ratio_ids and aspect_ratio_mask: pass the processor's image inputs.")
    side = _side(config)
    return torch.as_tensor(ids), torch.as_tensor(mask), side * side + 1


def cross_attended_real(config: Any, image_inputs: Mapping[str, Any]) -> Tensor:
    """``(B, S)`` bool, which of the image states a model reads apart from its tokens
    belong to an image: Mllama's real tiles (not a padding tile, not a missing image),
    every state of BLIP's one image, every feature GIT puts before its tokens."""
    if config.model_type in IMAGE_APART_FROM_PROMPT:
        images = _class_token_then_patches(config, image_inputs)
        return torch.ones(len(images), len(images[0]) * (1 + images[0][0].positions.numel()), dtype=torch.bool)
    ids, mask, per_tile = _mllama_tiles(config, image_inputs)
    real = (mask != 0) & (ids != 0)[..., None]
    return real.repeat_interleave(per_tile, dim=-1).flatten(1)


def _mllama_images(config: Any, image_inputs: Mapping[str, Any]) -> list[list[ImageTokens]]:
    ids, mask, per_tile = _mllama_tiles(config, image_inputs)
    side, tiles = _side(config), mask.shape[-1]
    ratios = config.vision_config.supported_aspect_ratios
    layouts: list[list[ImageTokens]] = []
    for example_ids in ids.tolist():
        layouts.append([])
        for image, ratio_id in enumerate(example_ids):
            if ratio_id == 0:
                continue
            down, across = ratios[ratio_id - 1]
            first = (image * tiles + torch.arange(down * across)) * per_tile + 1  # each tile's first patch
            patches = first.view(down, 1, across, 1) + (torch.arange(side)[:, None] * side + torch.arange(side))[None, :, None, :]
            layouts[-1].append(ImageTokens(patches.flatten(), (down * side, across * side)))
    return layouts


def pixel_patch_grids(config: Any, pixels: Tensor, image_inputs: Mapping[str, Any]) -> list[Tensor]:
    """Per-pixel values (AttnLRP's relevance through the vision tower) summed per patch of
    the vision tower (an image classifier's own patches), one ``(rows, columns)`` grid per
    image or tile, in ``pixel_values``' order:

    - ``(..., channels, height, width)`` pixels: each image (LLaVA, PaliGemma, ...) or tile
      (Idefics3's, LLaVA-NeXT's) pooled by ``patch_size``, an image given its own
      ``image_sizes`` (Pixtral) cut to them;
    - flattened patches with ``image_grid_thw`` (Qwen2-VL's kind): each row one patch,
      ``merge`` × ``merge`` neighbours consecutive, unfolded to the image's grid and summed
      over its frames.

    Raises:
        UnsupportedModelError: pixels in another layout, or no patch size in the config.
    """
    vision = image_encoder_config(config) or config  # an image classifier's config is its encoder's
    grid_thw = image_inputs.get("image_grid_thw")
    if grid_thw is not None and pixels.dim() == 2:
        return _flattened_patch_grids(vision, pixels.flatten(1).sum(dim=1), grid_thw, image_inputs.get("image_merge_sizes"))
    patch = getattr(vision, "patch_size", None)
    if pixels.dim() < 4 or not isinstance(patch, int) or pixels.shape[-1] % patch or pixels.shape[-2] % patch:
        raise UnsupportedModelError(
            f"pixel_values of shape {tuple(pixels.shape)} are not images of whole {patch}-pixel patches, nor flattened "
            "patches with an image_grid_thw: the pixels' relevance is returned as it is, without a grid."
        )
    images = pixels.sum(dim=-3).flatten(0, -3)
    grids = torch.nn.functional.avg_pool2d(images[:, None].float(), patch)[:, 0] * patch**2
    sizes = image_inputs.get("image_sizes")
    if sizes is not None and pixels.dim() == 4:  # Pixtral: each image padded to the batch's largest
        return [grid[: math.ceil(int(h) / patch), : math.ceil(int(w) / patch)] for grid, (h, w) in zip(grids, sizes.tolist())]
    return list(grids)


def _flattened_patch_grids(vision: Any, per_patch: Tensor, grid_thw: Tensor, merge_sizes: Tensor | None) -> list[Tensor]:
    grids, start = [], 0
    default_merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
    for index, (frames, rows, columns) in enumerate(grid_thw.tolist()):
        merge = default_merge if merge_sizes is None else int(merge_sizes[index])
        block = per_patch[start : start + frames * rows * columns].view(frames, rows // merge, columns // merge, merge, merge)
        grids.append(block.permute(0, 1, 3, 2, 4).reshape(frames, rows, columns).sum(dim=0))
        start += frames * rows * columns
    return grids
