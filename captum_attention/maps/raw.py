"""Raw attention: the head-mean attention of one layer, read at the query row.

S = mean_m Aˡᵐ, row q; the last layer l = L by default.
"""

from __future__ import annotations

from torch import Tensor

from .common import fuse_heads, mask_padding


def raw_attention_maps(
    attn_probs: list[Tensor], real: Tensor, real_keys: Tensor | None = None, fusion: str = "mean"
) -> list[Tensor]:
    """Per-layer head-fused attention (``mean_m Aˡᵐ`` by default), padding rows/columns zeroed."""
    return [mask_padding(fuse_heads(attn, fusion), real, real_keys) for attn in attn_probs]
