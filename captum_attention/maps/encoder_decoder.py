"""Encoder-decoder relevance: source (encoder) tokens, target (decoder) tokens, cross-attention.

Notation: S source tokens, T target tokens; encoder self-attention maps ``(B, S, S)``,
decoder self-attention ``(B, T, T)``, cross-attention ``(B, T, S)`` (target queries,
source keys), all already reduced over heads and padding-masked. Each function returns
the full relevance matrices ``R^qq`` ``(B, T, T)`` and ``R^qs`` ``(B, T, S)``; the
explained target token's row of each is its target and source scores.

- Transformer Attribution (Chefer, Gur & Wolf, ICCV 2021, Sec. 3, rules (6)-(11),
  https://arxiv.org/abs/2103.15679): R^ss = I, R^qq = I, R^qs = 0. Encoder layer:
  R^ss += Ā·R^ss. Decoder self-attention: R^qq += Ā·R^qq, R^qs += Ā·R^qs.
  Cross-attention: R^qs += (R̄^qq)ᵀ·Ā·R̄^ss, where R̄ = (R - I) with rows normalised
  to sum 1, plus I (eqs. 8-9; rows without relevance stay I). The source never attends
  the target, so rule (11) leaves R^qq unchanged.
- Attention Rollout over the joint token graph (Abnar & Zuidema's rollout with the
  cross-attention block's residual): encoder and decoder self-attention layers are the
  rollout matrices Â = norm(0.5·A + 0.5·I) of their own tokens; a cross-attention layer
  maps a target token to norm(0.5·e_q + 0.5·A^qs_q), half on itself and half on the
  source tokens as the encoder left them: R^qs ← (0.5·R^qs + 0.5·A^qs·R^ss) / z,
  R^qq ← 0.5·R^qq / z with z = 0.5 + 0.5·Σ_k A^qs_qk. A target row of
  [R^qq | R^qs] then sums to 1.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .common import identity_like, query_rows


def text_scores(source: Tensor, target: Tensor, attention_mask: Tensor) -> Tensor:
    """``(B, S)``: one score per token of the text that an encoder-decoder's sequence
    classifier reads twice, from the methods' ``source`` and ``target`` scores ``(B, S)``
    of ``(input_ids, classifier_decoder_ids(model, input_ids, attention_mask))``
    (:func:`~captum_attention.capture.inputs.classifier_decoder_ids`): token i's source
    score plus the target score of decoder position i + 1, where the decoder reads it. The
    decoder's first token, which the model puts there itself (BART's start token, the
    end-of-sequence token; mBART's, the text's last token moved to the front), counts with
    the text's last real token by ``attention_mask``, where the classifier reads, so that
    the scores keep their sum."""
    joined = source + torch.nn.functional.pad(target[:, 1:], (0, 1))
    positions = torch.arange(source.shape[1], device=source.device).expand_as(source)
    last = positions.masked_fill(attention_mask.to(source.device) == 0, -1).amax(dim=1, keepdim=True)
    return joined.scatter_add(1, last, target[:, :1])


def without_self(residual: Tensor) -> Tensor:
    """R̄ = (R - I) with rows normalised to sum 1, plus I (Chefer et al., eqs. 8-9), from
    the residual R - I itself: relevances of order 1e-5 next to the identity's 1 would lose
    most of their digits in float32 as R - I."""
    total = residual.sum(dim=-1, keepdim=True)
    normalised = torch.where(total > 0, residual / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)
    return normalised + identity_like(residual)


def encoder_decoder_relevance(
    encoder_maps: list[Tensor], decoder_maps: list[Tensor], roles: list[str]
) -> tuple[Tensor, Tensor]:
    """Chefer et al.'s R^qq, R^qs from per-layer Ā (``roles``: "decoder" or "cross",
    one per entry of ``decoder_maps``, in forward order). R^ss and R^qq are
    accumulated as residuals D = R - I (D += Ā·(D + I)), which :func:`without_self` reads."""
    source_residual = _source_relevance(encoder_maps, decoder_maps, roles, lambda d, a: d + a @ (d + identity_like(d)), start=0.0)
    target_self, target_source = _start(decoder_maps, roles, source_residual)
    target_residual = target_self - identity_like(target_self)
    source_bar = without_self(source_residual)
    for layer_map, role in zip(decoder_maps, roles):
        if role == "cross":
            target_source = target_source + without_self(target_residual).transpose(-1, -2) @ layer_map @ source_bar
        else:
            target_residual = target_residual + layer_map @ (target_residual + identity_like(target_residual))
            target_source = target_source + layer_map @ target_source
    return target_residual + identity_like(target_residual), target_source


def encoder_decoder_rollout(
    encoder_maps: list[Tensor], decoder_maps: list[Tensor], roles: list[str]
) -> tuple[Tensor, Tensor]:
    """Rollout's R^qq, R^qs over the joint graph. Self-attention entries of
    ``encoder_maps``/``decoder_maps`` are rollout matrices Â; "cross" entries are the
    fused cross-attention A^qs."""
    source = _source_relevance(encoder_maps, decoder_maps, roles, lambda r, a: a @ r)
    target_self, target_source = _start(decoder_maps, roles, source)
    for layer_map, role in zip(decoder_maps, roles):
        if role == "cross":
            z = 0.5 + 0.5 * layer_map.sum(dim=-1, keepdim=True)
            target_self, target_source = 0.5 * target_self / z, (0.5 * target_source + 0.5 * layer_map @ source) / z
        else:
            target_self, target_source = layer_map @ target_self, layer_map @ target_source
    return target_self, target_source


def _source_relevance(
    encoder_maps: list[Tensor], decoder_maps: list[Tensor], roles: list[str], step: Callable[[Tensor, Tensor], Tensor],
    start: float = 1.0,
) -> Tensor:
    """``step`` applied over the encoder layers from ``start`` times the identity."""
    cross = next(m for m, r in zip(decoder_maps, roles) if r == "cross")
    relevance = start * torch.eye(cross.shape[-1], dtype=cross.dtype, device=cross.device).expand(cross.shape[0], -1, -1)
    for layer_map in encoder_maps:
        relevance = step(relevance, layer_map)
    return relevance


def _start(decoder_maps: list[Tensor], roles: list[str], source: Tensor) -> tuple[Tensor, Tensor]:
    cross = next(m for m, r in zip(decoder_maps, roles) if r == "cross")
    batch, targets, sources = cross.shape
    target_self = torch.eye(targets, dtype=cross.dtype, device=cross.device).expand(batch, -1, -1)
    return target_self, cross.new_zeros(batch, targets, sources)


def encoder_decoder_rows(
    layer_maps: list[Tensor],
    roles: list[str],
    query_index: Tensor,
    relevance: Callable[[list[Tensor], list[Tensor], list[str]], tuple[Tensor, Tensor]],
) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
    """Source and target scores of an encoder-decoder: the query rows of ``relevance``'s
    R^qs and R^qq (:func:`encoder_decoder_relevance` or :func:`encoder_decoder_rollout`)
    over the per-call ``(B, Q, K)`` maps (roles ``"encoder"``, ``"decoder"``, ``"cross"``
    in forward order; no ``"encoder"`` calls for a decoder cross-attending to image
    features, whose R^ss stays I), and the maps stacked per role, ``(B, L, Q, K)``."""
    encoder_maps = [m for m, role in zip(layer_maps, roles) if role == "encoder"]
    decoder_side = [(m, role) for m, role in zip(layer_maps, roles) if role != "encoder"]
    target_self, target_source = relevance(encoder_maps, [m for m, _ in decoder_side], [r for _, r in decoder_side])
    scores = (query_rows(target_source, query_index), query_rows(target_self, query_index))
    role_maps: dict[str, Tensor] = {
        role: torch.stack([m for m, r in zip(layer_maps, roles) if r == role], dim=1)
        for role in ("encoder", "decoder", "cross")
        if role in roles
    }
    return scores, role_maps
