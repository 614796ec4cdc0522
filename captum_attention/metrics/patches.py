r"""Context metrics over an image's patches: does an attribution over the image an image
captioner reads (an image encoder before a text decoder, ``VisionEncoderDecoderModel``:
ViT-GPT-2, TrOCR, Donut; or a vision-language model that reads its image apart from its
prompt and captions it after its start token, BLIP's and GIT's; or a vision-language
model's answer about its image, given its prompt) say which parts of it the caption rests
on? Each metric is its
prompt counterpart in :mod:`~captum_attention.metrics.context`, the features being the
cells of the attribution's grid (the encoder's patches) instead of a prompt's segments,
and a cell removed by taking its pixels from a baseline image (a grey one, through the
same processor) instead of deleting tokens; a fine grid's patches may be pooled into
coarser regions (``regions``), each one feature:

- :func:`top_k_patch_log_prob_drop`: grey the k highest-scored patches; how far does
  :math:`\log p(a \mid x)` fall?
- :func:`patch_datamodeling_score`: LDS over random ablations that grey each patch with
  probability 1/2.
- :func:`patch_leave_one_out_agreement`: Spearman's ρ between the patches' scores and the
  drop when each patch alone is greyed.

The caption :math:`a` is read by the decoder after its start token (a vision-language
model's: after the ``prompt_ids`` its ``generate`` reads, GIT's [CLS]), teacher-forced; every
ablated image of a call is evaluated batched, and in a
:func:`~captum_attention.metrics.context.shared_ablations` scope each set of greyed patches runs
once for every method and metric.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from ..capture.adapters import HuggingFaceAdapter
from ..capture.inputs import decoder_start_token, forced_tokens, output_logits
from ._checks import check_rankable, takes_captum_scores
from .context import (
    DEFAULT_KS,
    AblationScorer,
    check_ablation_count,
    check_ks,
    datamodeling_scores,
    leave_one_out_agreements,
    summed_log_probs,
    top_k_drops,
)
from .token_removal import content_key, example_seeds


VALUES_PER_FORWARD = 2**24
"""The most pixel values (channels × height × width, summed over the images) one forward of
greyed images holds."""


@dataclass(frozen=True)
class PatchRemoval:
    """How the registered context metrics remove an image captioner's features
    (:class:`~captum_attention.metrics.MetricContext`'s ``patches``): a removed patch's
    pixels are ``baseline_pixels``'s (a grey image through the captioner's processor), the
    patches are pooled into ``regions`` (rows, columns; None: each patch its own), and a
    vision-language captioner reads ``prompt_ids`` ``(1, n)`` before the caption (None: an
    image encoder before a text decoder, which reads its start token), with the prompt's
    per-token ``prompt_inputs`` (PaliGemma's token types; None: none)."""

    baseline_pixels: Tensor
    regions: tuple[int, int] | None = None
    prompt_ids: Tensor | None = None
    prompt_inputs: Mapping[str, Tensor] | None = None


class _PatchScorer(AblationScorer):
    """The caption's log-probability after greying sets of the image's patches (or of
    regions of them), batched."""

    def __init__(
        self, model: Any, pixel_values: Tensor, caption: Tensor, grid: Sequence[int], baseline: Tensor, max_batch_size: int,
        regions: Sequence[int] | None = None, prompt_ids: Tensor | None = None, prompt_inputs: Mapping[str, Tensor] | None = None,
    ) -> None:
        if not pixel_values.is_floating_point() or pixel_values.dim() != 4:
            raise ValueError(f"pixel_values must be float pixels (batch, channels, height, width), got {pixel_values.dtype} "
                             f"of shape {tuple(pixel_values.shape)}.")
        if caption.dim() != 2 or caption.shape[0] != pixel_values.shape[0] or caption.shape[1] == 0 or caption.is_floating_point():
            raise ValueError(f"caption must be token ids (batch={pixel_values.shape[0]}, caption_len >= 1), got "
                             f"{caption.dtype} of shape {tuple(caption.shape)}.")
        if baseline.dim() != 4 or baseline.shape[0] not in (1, pixel_values.shape[0]) or baseline.shape[1:] != pixel_values.shape[1:]:
            raise ValueError(f"baseline_pixel_values must be shaped as pixel_values {tuple(pixel_values.shape)} (or one image "
                             f"of that size), got {tuple(baseline.shape)}.")
        if prompt_ids is not None and (prompt_ids.dim() != 2 or prompt_ids.shape[0] not in (1, len(pixel_values))
                                       or prompt_ids.shape[1] == 0 or prompt_ids.is_floating_point()):
            raise ValueError(f"prompt_ids must be token ids (1 or batch={len(pixel_values)}, prompt_len >= 1), got "
                             f"{prompt_ids.dtype} of shape {tuple(prompt_ids.shape)}.")
        _check_prompt_inputs(prompt_inputs, prompt_ids, len(pixel_values))
        if len(grid) != 2:
            raise ValueError(f"attributions must be patch scores (batch, rows, columns), got {len(grid) + 1} dimensions.")
        rows, columns = grid
        height, width = pixel_values.shape[-2:]
        if height % rows or width % columns:
            raise ValueError(
                f"a grid of {rows}x{columns} patches does not tile {height}x{width} pixels: give the scores on the "
                "encoder's patch grid (attribute_span's, pixel_scores')."
            )
        regions = (rows, columns) if regions is None else tuple(regions)
        if len(regions) != 2 or not all(isinstance(n, int) and 1 <= n <= most for n, most in zip(regions, grid)):
            raise ValueError(f"regions must be (rows, columns) of at least 1 and at most the {rows}x{columns} patches, got {regions}.")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}.")
        self.model, self.pixels, self.caption, self.grid = model, pixel_values, caption.to(pixel_values.device), (rows, columns)
        self.prompt = None if prompt_ids is None else prompt_ids.to(pixel_values.device).expand(len(pixel_values), -1)
        self.prompt_inputs = {
            name: value.to(pixel_values.device).expand(len(pixel_values), *value.shape[1:]) for name, value in (prompt_inputs or {}).items()
        }
        self.baseline = baseline.to(pixel_values.device, pixel_values.dtype).expand_as(pixel_values)
        self.max_batch_size, self.regions = max_batch_size, regions
        device = pixel_values.device
        row_region = torch.arange(rows, device=device) * regions[0] // rows  # as even as whole patches allow
        column_region = torch.arange(columns, device=device) * regions[1] // columns
        self.patch_region = (row_region[:, None] * regions[1] + column_region[None, :]).flatten()  # (rows * columns,)
        pixel_rows = row_region[torch.arange(height, device=device) // (height // rows)]
        pixel_columns = column_region[torch.arange(width, device=device) // (width // columns)]
        self.pixel_region = pixel_rows[:, None] * regions[1] + pixel_columns[None, :]  # (height, width)
        self.present = torch.ones(len(pixel_values), regions[0] * regions[1], dtype=torch.bool, device=device)
        self.rows = torch.arange(len(pixel_values), device=device)

    def segment_scores(self, attributions: Tensor) -> Tensor:
        """``(B, F)`` each region's summed patch scores (each patch's where every patch is
        its own region), row by row."""
        if tuple(attributions.shape) != (len(self.pixels), *self.grid):
            raise ValueError(f"attributions have shape {tuple(attributions.shape)}; give one score per patch, "
                             f"({len(self.pixels)}, {self.grid[0]}, {self.grid[1]}).")
        flat = attributions.flatten(1)
        check_rankable(flat.float(), torch.ones_like(flat, dtype=torch.bool), finite=True)
        summed = torch.zeros(self.present.shape, dtype=torch.float64, device=flat.device)
        return summed.scatter_add_(1, self.patch_region.to(flat.device).expand_as(flat), flat.double())

    def own_seeds(self, seed: int) -> Tensor:
        """``(B,)`` each example's seed from ``seed`` and its pixels."""
        return example_seeds(self.pixels.flatten(1), None, seed)

    def _identity(self) -> tuple:
        read = (self.pixels, self.caption, self.baseline) if self.prompt is None else (self.pixels, self.caption, self.baseline, self.prompt)
        prompt_inputs = tuple((name, content_key(value)) for name, value in sorted(self.prompt_inputs.items()))
        return ("patches", id(self.model), self.grid, self.regions, *(content_key(t) for t in read), *prompt_inputs)

    def _per_forward(self, rows: int) -> int:
        """At most ``max_batch_size`` images and :data:`VALUES_PER_FORWARD` pixel values
        (a document reader's 2560 × 1920 images go one at a time)."""
        return max(1, min(rows, self.max_batch_size, VALUES_PER_FORWARD // self.pixels[0].numel()))

    def _distinct_log_probs(self, rows: Tensor, removed: Tensor) -> Tensor:
        values = torch.empty(len(rows), device=rows.device, dtype=torch.float32)
        for first in range(0, len(rows), self._per_forward(len(rows))):
            chunk = slice(first, first + self._per_forward(len(rows)))
            prompt = None if self.prompt is None else self.prompt[rows[chunk]]
            prompt_inputs = {name: value[rows[chunk]] for name, value in self.prompt_inputs.items()}
            values[chunk] = caption_log_probs(
                self.model, self._greyed(rows[chunk], removed[chunk]), self.caption[rows[chunk]], prompt, prompt_inputs
            )
        return values

    def _greyed(self, rows: Tensor, removed: Tensor) -> Tensor:
        """The images of examples ``rows`` with the pixels of their ``removed`` regions
        taken from the baseline."""
        covered = removed[:, self.pixel_region]  # (R, height, width)
        return torch.where(covered[:, None], self.baseline[rows], self.pixels[rows])


def caption_log_probs(
    model: Any, pixel_values: Tensor, caption: Tensor, prompt_ids: Tensor | None = None, prompt_inputs: Mapping[str, Tensor] | None = None
) -> Tensor:
    """``(B,)`` an image captioner's :math:`\\log p(a \\mid x)` of each ``caption``
    ``(B, n)`` of its ``pixel_values``, without gradients (:func:`read_caption_log_probs`)."""
    with torch.no_grad():
        return read_caption_log_probs(model, pixel_values, caption, prompt_ids, prompt_inputs)


def read_caption_log_probs(
    model: Any, pixel_values: Tensor, caption: Tensor, prompt_ids: Tensor | None = None, prompt_inputs: Mapping[str, Tensor] | None = None
) -> Tensor:
    """``(B,)`` an image captioner's :math:`\\log p(a \\mid x)` of each ``caption``
    ``(B, n)`` of its ``pixel_values``: an image encoder before a text decoder's, its decoder
    reading its start token and the caption; a vision-language model's (``prompt_ids``
    ``(1 or B, m)``), its language model reading the prompt, then the caption, with the image
    and the prompt's per-token ``prompt_inputs`` ``(1 or B, m, ...)`` extended over the
    caption as the model's ``generate`` extends them."""
    if prompt_ids is None:  # the token its generate forces first read, not scored, as the spans read it
        logits = model(pixel_values=pixel_values, decoder_input_ids=caption_decoder_ids(model, caption)).logits
        return summed_log_probs(logits, caption, forced_tokens(model, caption))
    sequences = torch.cat([prompt_ids.expand(len(caption), -1), caption], dim=1)
    grown = HuggingFaceAdapter().generated_inputs(model, prompt_inputs, prompt_ids.shape[1], caption.shape[1]) if prompt_inputs else {}
    token_inputs = {name: value.expand(len(caption), *value.shape[1:]) for name, value in grown.items()}
    logits = output_logits(model(input_ids=sequences, attention_mask=torch.ones_like(sequences), pixel_values=pixel_values, **token_inputs))
    return summed_log_probs(logits[:, -caption.shape[1] - 1 : -1], caption)


def _check_prompt_inputs(prompt_inputs: Mapping[str, Tensor] | None, prompt_ids: Tensor | None, batch: int) -> None:
    if not prompt_inputs:
        return
    if prompt_ids is None:
        raise ValueError("prompt_inputs are the prompt's per-token inputs: give the prompt's prompt_ids too.")
    for name, value in prompt_inputs.items():
        if not isinstance(value, Tensor) or value.dim() < 2 or value.shape[0] not in (1, batch) or value.shape[1] != prompt_ids.shape[1]:
            raise ValueError(
                f"prompt_inputs[{name!r}] must be a per-token tensor (1 or batch={batch}, prompt_len={prompt_ids.shape[1]}, ...), got "
                f"{tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}."
            )


def caption_decoder_ids(model: Any, caption: Tensor) -> Tensor:
    """``(B, n)`` what the decoder reads to predict each token of ``caption`` ``(B, n)``:
    its start token, then the caption but its last token."""
    return torch.cat([torch.full_like(caption[:, :1], decoder_start_token(model)), caption[:, :-1]], dim=1)


@takes_captum_scores("attributions")
def top_k_patch_log_prob_drop(
    model: Any,
    pixel_values: Tensor,
    caption: Tensor,
    attributions: Tensor,
    baseline_pixel_values: Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    max_batch_size: int = 16,
    regions: tuple[int, int] | None = None,
    prompt_ids: Tensor | None = None,
    prompt_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Top-k log-probability drop over an image's patches: :math:`\log p(a \mid x) - \log
    p(a \mid x \text{ with its top}_k \text{ patches greyed})` (ties broken by position).

    Args:
        model: the image captioner: a ``VisionEncoderDecoderModel``, called as
            ``model(pixel_values=..., decoder_input_ids=...)``; or, with ``prompt_ids``, a
            vision-language model (BLIP's, GIT's), called as ``model(input_ids=...,
            attention_mask=..., pixel_values=...)``.
        pixel_values (Tensor): ``(batch, channels, height, width)``, as its processor gives them.
        caption (Tensor): ``(batch, caption_len)`` the caption's token ids, read after the
            decoder's start token.
        attributions (Tensor): ``(batch, rows, columns)`` patch scores on a grid that tiles
            the pixels (the encoder's patch grid, as ``attribute_span`` gives it), higher =
            more important; NaN and ±inf refused.
        baseline_pixel_values (Tensor): the pixels a removed patch takes, shaped as
            ``pixel_values`` (or one image): a uniform grey image through the same
            processor, say.
        ks (sequence of int, optional): numbers of patches (regions) greyed. Default: (1, 3, 5).
        max_batch_size (int, optional): images per forward. Default: 16.
        regions (tuple of int, optional): ``(rows, columns)``: the patches pooled into that
            many regions, as even as whole patches allow (a grid of 14 rows into 8: regions
            of one and two patch rows), each region one feature scoring the sum of its
            patches': for a grid whose patches are too small to tell much alone (Donut's 4-pixel
            patches), or for fewer leave-one-out forwards. Default: None, each patch its own.
        prompt_ids (Tensor, optional): ``(1 or batch, prompt_len)`` the tokens a
            vision-language captioner reads before the caption, as its ``generate`` reads
            them (GIT's [CLS], BLIP's start token), or the prompt of a vision-language
            model's answer about its image, as its processor expanded it. Default: None, an
            image encoder before a text decoder.
        prompt_inputs (mapping of str to Tensor, optional): the prompt's per-token inputs
            besides its ids, each ``(1 or batch, prompt_len, ...)`` (PaliGemma's
            ``token_type_ids``), extended over the caption as the model's ``generate``
            extends them. Default: None.

    Returns:
        ``(batch, len(ks))``: the drop per k.

    Example::

        >>> patches, _ = AttnLRP(captioner).attribute_span(pixels, caption)
        >>> grey = image_processor(images=Image.new("RGB", image.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
        >>> top_k_patch_log_prob_drop(captioner, pixels, caption, patches, grey)
    """
    check_ks(ks)
    scorer = _PatchScorer(model, pixel_values, caption, attributions.shape[1:], baseline_pixel_values, max_batch_size, regions,
                          prompt_ids, prompt_inputs)
    return top_k_drops(scorer, attributions, ks)


@takes_captum_scores("attributions")
def patch_datamodeling_score(
    model: Any,
    pixel_values: Tensor,
    caption: Tensor,
    attributions: Tensor,
    baseline_pixel_values: Tensor,
    num_ablations: int = 32,
    seed: int = 0,
    max_batch_size: int = 16,
    per_example: bool = False,
    regions: tuple[int, int] | None = None,
    prompt_ids: Tensor | None = None,
    prompt_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""LDS over an image's patches: Spearman's ρ, over ``num_ablations`` random ablations
    that grey each patch with probability 1/2 (seeded), between the kept patches' summed
    scores and the caption's actual :math:`\log p(a \mid x_{\text{kept}})`.

    The other arguments are :func:`top_k_patch_log_prob_drop`'s.

    Args:
        num_ablations (int, optional): random ablations per example. Default: 32.
        seed (int, optional): seed of the ablations. Default: 0.
        per_example (bool, optional): draw each example's ablations alone, from ``seed``
            and its pixels, so that its score is the same in any batch (as the registered
            ``lds`` metric draws them). Default: False.

    Returns:
        ``(batch,)``: ρ in [-1, 1]; NaN where either side is constant.
    """
    check_ablation_count(num_ablations)
    scorer = _PatchScorer(model, pixel_values, caption, attributions.shape[1:], baseline_pixel_values, max_batch_size, regions,
                          prompt_ids, prompt_inputs)
    return datamodeling_scores(scorer, attributions, num_ablations, seed, per_example)


@takes_captum_scores("attributions")
def patch_leave_one_out_agreement(
    model: Any,
    pixel_values: Tensor,
    caption: Tensor,
    attributions: Tensor,
    baseline_pixel_values: Tensor,
    max_batch_size: int = 16,
    regions: tuple[int, int] | None = None,
    prompt_ids: Tensor | None = None,
    prompt_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Spearman's ρ between the patches' scores and their leave-one-out effects
    :math:`\log p(a \mid x) - \log p(a \mid x \text{ with patch } s \text{ greyed})`: one
    forward per patch (region).

    The arguments are :func:`top_k_patch_log_prob_drop`'s, without ``ks``.

    Returns:
        ``(batch,)``: ρ in [-1, 1]; NaN where a side is constant.
    """
    scorer = _PatchScorer(model, pixel_values, caption, attributions.shape[1:], baseline_pixel_values, max_batch_size, regions,
                          prompt_ids, prompt_inputs)
    return leave_one_out_agreements(scorer, attributions)
