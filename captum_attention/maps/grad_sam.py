"""Grad-SAM (Barkan et al., CIKM 2021, https://arxiv.org/abs/2204.11073).

Hˡᵐ = Aˡᵐ ⊙ ReLU(Gˡᵐ); r_i = 1/(L·M·N) Σ_l Σ_m Σ_j Hˡᵐᵢⱼ: the sum over j runs
along the row of token i's query, N is the number of real tokens of the sample. The key
axis sums down token j's column instead (the attention it receives). A pooling layer's
queries are not tokens: its H credits the keys, Σ_q Hˡᵐ_qi.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .common import mask_padding


def grad_sam_head_mean(attn: Tensor, grad: Tensor) -> Tensor:
    """mean_m(Aˡᵐ ⊙ ReLU(Gˡᵐ)) of one layer: ``(B, H, Q, K)`` → ``(B, Q, K)``, in
    float32 (a half-precision product of small weights and gradients underflows)."""
    return grad.float().clamp(min=0).mul_(attn.float()).mean(dim=1)


def grad_sam_layer_maps(head_means: list[Tensor], real: Tensor, real_keys: Tensor | None = None) -> list[Tensor]:
    """Per-layer :func:`grad_sam_head_mean` maps with padding rows/columns zeroed."""
    return [mask_padding(head_mean, real, real_keys) for head_mean in head_means]


def grad_sam_scores(
    layer_maps: list[Tensor],
    heads_per_layer: list[int],
    real: Tensor,
    pooling: Sequence[bool] = (),
    axis: str = "query",
) -> Tensor:
    """r_i = Σ_l M_l·Σ_j mean_m(Hˡᵐ)ᵢⱼ / (Σ_l M_l · N), i.e. 1/(L·M·N) Σ_l Σ_m Σ_j H:
    each token credited along its query row (the paper). With ``axis="key"`` along its key
    column instead, r_j = 1/(L·M·N) Σ_l Σ_m Σ_i Hˡᵐᵢⱼ: the attention it receives.

    A layer flagged in ``pooling`` has queries that are not tokens (``(B, Q, T)`` maps):
    it credits its keys on either axis, Σ_q mean_m(Hˡᵐ)_qi.
    """
    check_axis(axis)
    pooled = list(pooling) + [False] * (len(layer_maps) - len(pooling))
    total = torch.stack(
        [
            heads * layer_map.sum(dim=-2 if is_pooling or axis == "key" else -1)
            for heads, layer_map, is_pooling in zip(heads_per_layer, layer_maps, pooled)
        ]
    ).sum(dim=0)
    return grad_sam_normalised(total, heads_per_layer, real)


AXES = ("query", "key")


def check_axis(axis: str) -> None:
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}.")


def grad_sam_normalised(total: Tensor, heads_per_layer: list[int], real: Tensor) -> Tensor:
    """Σ_l Σ_m Σ_j Hˡᵐᵢⱼ ``(B, T)`` divided by L·M·N (Σ_l M_l · N for layers of
    different head counts)."""
    n_real = real.sum(dim=1, keepdim=True).to(total.dtype)
    return total / (sum(heads_per_layer) * n_real)
