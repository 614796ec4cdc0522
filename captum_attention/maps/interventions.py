"""Interventions on attention probabilities, applied before they weight the values.

Pure functions of ``(B, H, T, T)`` probabilities; the capture layer applies them inside
the model's own attention (see ``AttentionCapture(intervention=...)``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def on_heads(
    attn: Tensor, heads: Sequence[int] | None, change: Callable[[Tensor], Tensor], first_head: int = 0
) -> Tensor:
    """Apply ``change`` to the chosen heads only (all heads when ``heads`` is None).

    ``attn`` holds heads ``first_head .. first_head + H - 1`` of its layer (a module that
    computes one softmax per head hands them over one at a time); chosen heads outside that
    range are left to the other calls.
    """
    if heads is None:
        return change(attn)
    local = [h - first_head for h in heads if first_head <= h < first_head + attn.shape[1]]
    if not local:
        return attn
    chosen = torch.as_tensor(local, device=attn.device)
    changed = attn.clone()
    changed[:, chosen] = change(attn[:, chosen])
    return changed


def erase_keys(attn: Tensor, erased: Tensor) -> Tensor:
    """Zero the attention every query pays to the ``erased`` keys, then renormalise rows.

    Serrano & Smith, "Is Attention Interpretable?", ACL 2019.

    Args:
        attn: ``(B, H, T, T)`` probabilities.
        erased: ``(B, T)`` bool, True for the key positions to erase.

    Returns:
        ``(B, H, T, T)`` probabilities; a row whose every key was erased stays zero.
    """
    kept = attn.masked_fill(erased[:, None, None, :], 0.0)
    total = kept.sum(dim=-1, keepdim=True)
    return kept / total.clamp(min=torch.finfo(kept.dtype).tiny)


def permute_rows(attn: Tensor, real: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Shuffle each query row's weights among the real keys; padding keys stay zero.

    Jain & Wallace, "Attention is not Explanation", NAACL 2019. Every row (query) of every
    head gets its own random permutation of the real key positions.

    Args:
        attn: ``(B, H, T, T)`` probabilities.
        real: ``(B, T)`` bool, True for real (non-padding) tokens.
        generator: random generator (on the CPU) for reproducible permutations.

    Returns:
        ``(B, H, T, T)`` probabilities with each row's real entries permuted.
    """
    batch, heads, seq_len, _ = attn.shape
    draws = torch.rand(attn.shape, generator=generator).to(attn.device)
    padded_last = (~real)[:, None, None, :].expand_as(attn)
    shuffled_keys = draws.masked_fill(padded_last, 2.0).argsort(dim=-1)
    positions = torch.arange(seq_len, device=attn.device).expand(batch, seq_len)
    real_keys = positions.masked_fill(~real, seq_len).argsort(dim=-1)[:, None, None, :].expand_as(attn)
    return torch.zeros_like(attn).scatter_(-1, real_keys, attn.gather(-1, shuffled_keys))
