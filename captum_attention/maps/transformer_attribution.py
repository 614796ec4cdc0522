"""Transformer Attribution (Chefer, Gur & Wolf, ICCV 2021, https://arxiv.org/abs/2103.15679).

The gradient rule for self-attention: R = I; for l = 1..L:
Ā^l = mean_m((Gˡᵐ ⊙ Aˡᵐ)^+) (ReLU before the head mean), R = R + Ā^l·R.
The scores are the query row of R = (I + Ā^L) ··· (I + Ā^1) (for a model read out by
attention pooling, the pooling call's Ā row times R).
"""

from __future__ import annotations

from torch import Tensor

from .common import identity_like, mask_padding, propagate_query_row


def relevance_head_mean(attn: Tensor, grad: Tensor) -> Tensor:
    """Ā^l = mean_m((Gˡᵐ ⊙ Aˡᵐ)^+) of one layer: ``(B, H, Q, K)`` → ``(B, Q, K)``, in
    float32 (a half-precision product of small weights and gradients underflows)."""
    return (grad.float() * attn.float()).clamp_(min=0).mean(dim=1)


def relevance_layer_maps(head_means: list[Tensor], real: Tensor, real_keys: Tensor | None = None) -> list[Tensor]:
    """Per-layer Ā^l (:func:`relevance_head_mean`) with padding rows/columns zeroed."""
    return [mask_padding(head_mean, real, real_keys) for head_mean in head_means]


def transformer_attribution_scores(layer_maps: list[Tensor], query_index: Tensor, readout: Tensor | None = None) -> Tensor:
    """Query row of R = (I + Ā^L) ··· (I + Ā^1), i.e. of R ← R + Ā^l·R from R = I; with a
    pooling ``readout`` (the pooling call's Ā row, which has no residual path) ``readout · R``."""
    return propagate_query_row([identity_like(m) + m for m in layer_maps], query_index, readout)
