"""Transformer Attribution (Chefer, Gur & Wolf, ICCV 2021, https://arxiv.org/abs/2103.15679).

The gradient rule for self-attention: R = I; for l = 1..L:
Ā^l = mean_m((G^{lm} ⊙ A^{lm})^+) (ReLU before the head mean), R = R + Ā^l·R.
The scores are the query row of R = (I + Ā^L) ··· (I + Ā^1).
"""

from __future__ import annotations

from torch import Tensor

from .common import identity_like, mask_padding, propagate_query_row


def relevance_layer_maps(
    attn_probs: list[Tensor], attn_grads: list[Tensor], real: Tensor, real_keys: Tensor | None = None
) -> list[Tensor]:
    """Per-layer Ā^l = mean_m((G^{lm} ⊙ A^{lm})^+), padding rows/columns zeroed."""
    return [
        mask_padding((grad * attn).clamp(min=0).mean(dim=1), real, real_keys)
        for attn, grad in zip(attn_probs, attn_grads)
    ]


def transformer_attribution_scores(layer_maps: list[Tensor], query_index: Tensor) -> Tensor:
    """Query row of R = (I + Ā^L) ··· (I + Ā^1), i.e. of R ← R + Ā^l·R from R = I."""
    return propagate_query_row([identity_like(m) + m for m in layer_maps], query_index)
