"""Attention Rollout (Abnar & Zuidema, ACL 2020, https://arxiv.org/abs/2005.00928).

Per layer: Â^l = 0.5·fuse_m(Aˡᵐ) + 0.5·I, rows renormalised to sum 1; then
R = Â^L ··· Â^2 Â^1 and the scores are the query row of R (for a model read out by
attention pooling, its head-fused attention row times R). ``fuse`` is mean (the paper),
max or min; optionally the lowest fraction of each fused map is discarded first (as in
jacobgil/vit-explain), never the query's own entry.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import fuse_heads, mask_padding, propagate_query_row, query_weights
from .raw import raw_attention_maps


def discard_lowest(fused: Tensor, fraction: float, real: Tensor, query_index: Tensor) -> Tensor:
    """Zero the lowest ``⌊fraction·N²⌋`` entries of each sample's real ``N×N`` fused map.

    Only real query/key pairs compete; the query's own entry ``(q, q)`` (each position
    of a span's) is never discarded. Ties are broken by position (stable sort), so a sample is treated the
    same alone or inside a padded batch.
    """
    if fraction <= 0:
        return fused
    batch, seq_len, _ = fused.shape
    candidates = real[:, :, None] & real[:, None, :]
    candidates &= ~torch.diag_embed(query_weights(query_index.to(fused.device), seq_len) != 0)
    ranked = fused.masked_fill(~candidates, float("inf")).flatten(1)
    order = ranked.argsort(dim=1, stable=True)
    positions = torch.arange(seq_len * seq_len, device=fused.device).expand(batch, -1)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    n_discard = (fraction * real.sum(dim=1).double() ** 2).floor().long()
    discard = (rank < n_discard[:, None]) & candidates.flatten(1)
    return fused.masked_fill(discard.view_as(fused), 0.0)


def add_residual(fused: Tensor) -> Tensor:
    """Â = 0.5·A + 0.5·I with rows renormalised to sum 1 (the residual connection)."""
    with_residual = fused * 0.5
    with_residual.diagonal(dim1=-2, dim2=-1).add_(0.5)
    return with_residual.div_(with_residual.sum(dim=-1, keepdim=True))


def rollout_layer_maps(
    attn_probs: list[Tensor],
    real: Tensor,
    query_index: Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
) -> list[Tensor]:
    """The per-layer rollout matrices Â^l, padding rows/columns of the attention zeroed.

    Padding rows of Â^l are identity rows, so every row sums to 1.
    """
    maps = []
    for attn in attn_probs:
        fused = mask_padding(fuse_heads(attn, head_fusion), real)
        maps.append(add_residual(discard_lowest(fused, discard_ratio, real, query_index)))
    return maps


def rollout_scores(layer_maps: list[Tensor], query_index: Tensor, readout: Tensor | None = None) -> Tensor:
    """Query row of R = Â^L ··· Â^1; with a pooling ``readout`` (its fused attention over
    the tokens, which has no residual path of its own) ``readout · R``."""
    return propagate_query_row(layer_maps, query_index, readout)


def rollout_stack_maps(
    attn_maps: list[Tensor],
    pooling: list[bool],
    real: Tensor,
    query_index: Tensor,
    head_fusion: str = "mean",
    discard_ratio: float = 0.0,
) -> list[Tensor]:
    """Per call of one self-attention stack, ``(B, H, Q, T)`` maps in: Â^l for token calls
    (:func:`rollout_layer_maps`), the fused attention without residual for pooling calls
    (whose queries are no tokens: all real); shared by rollout and flow."""
    maps = []
    for attn, is_pooling in zip(attn_maps, pooling):
        if is_pooling:
            maps += raw_attention_maps([attn], torch.ones_like(real[:, :1]), real, head_fusion)
        else:
            maps += rollout_layer_maps([attn], real, query_index, head_fusion, discard_ratio)
    return maps
