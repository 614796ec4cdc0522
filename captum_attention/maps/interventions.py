"""Interventions on attention probabilities, applied before they weight the values.

Pure functions of ``(B, H, T, T)`` probabilities; the capture layer applies them inside
the model's own attention (see ``AttentionCapture(intervention=...)``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def on_heads(attn: Tensor, changed: Tensor, heads: Sequence[int] | None, first_head: int = 0) -> Tensor:
    """``changed`` on the chosen heads, ``attn`` on the others (all heads when ``heads`` is None).

    Both hold heads ``first_head .. first_head + H - 1`` of their layer (a module that
    computes one softmax per head hands them over one at a time); chosen heads outside that
    range belong to other calls.
    """
    if heads is None:
        return changed
    local = [h - first_head for h in heads if first_head <= h < first_head + attn.shape[1]]
    if not local:
        return attn
    chosen = torch.zeros(attn.shape[1], dtype=torch.bool, device=attn.device)
    chosen[local] = True
    return torch.where(chosen[None, :, None, None], changed, attn)


def weigh_keys(attn: Tensor, log_presence: Tensor, scores: Tensor | None = None) -> Tensor:
    r"""Scale the attention every query pays to each key by the key's presence, then
    renormalise rows: the softmax of the scores plus :math:`\log p_j`.

    A key at presence :math:`p_j \in (0, 1]` counts as :math:`p_j` copies of itself in every
    row's normaliser: :math:`p_j = 1` leaves it as it is, :math:`p_j = 0` removes it
    (:func:`erase_keys`), and the same presence for every key changes nothing.

    Args:
        attn: ``(B, H, T, K)`` probabilities; columns after the ``K`` keys (gpt-oss's sink)
            stay at presence 1.
        log_presence: ``(B, K)`` the keys' :math:`\log p_j` (0 for a key left as it is,
            :math:`-\infty` for one removed).
        scores: ``(B, H, T, K)`` pre-softmax scores, optional: with them the result is the
            softmax of the weighted scores, exact where the probabilities underflowed.

    Returns:
        ``(B, H, T, K)`` probabilities; a row whose every key was removed stays zero.
    """
    bias = log_presence[:, None, None, :].to(attn.device)
    if attn.shape[-1] > bias.shape[-1]:
        bias = torch.nn.functional.pad(bias, (0, attn.shape[-1] - bias.shape[-1]))
    if scores is not None:
        # Keys the model masked itself (scores at the dtype's minimum, as transformers
        # masks) stay out, as they do when renormalising probabilities.
        masked_by_model = scores <= torch.finfo(scores.dtype).min / 2
        logits = (scores.float() + bias.float()).masked_fill(masked_by_model, float("-inf"))
        return torch.nan_to_num(logits.softmax(dim=-1), nan=0.0).to(attn.dtype)
    weighted = attn * bias.exp().to(attn.dtype)
    return weighted / weighted.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(weighted.dtype).tiny)


def erase_keys(attn: Tensor, erased: Tensor, scores: Tensor | None = None) -> Tensor:
    """Zero the attention every query pays to the ``erased`` keys, then renormalise rows.

    Serrano & Smith, "Is Attention Interpretable?", ACL 2019. With the softmax's input
    ``scores`` the result is the softmax over the remaining keys' scores, which equals the
    renormalised probabilities and stays exact where the kept keys' probabilities
    underflowed (a peaked attention that put ~all its mass on erased keys).

    Args:
        attn: ``(B, H, T, T)`` probabilities; columns after the ``T`` keys (gpt-oss's sink,
            which joins the softmax) are never erased.
        erased: ``(B, T)`` bool, True for the key positions to erase.
        scores: ``(B, H, T, T)`` pre-softmax scores, optional.

    Returns:
        ``(B, H, T, T)`` probabilities; a row whose every key was erased stays zero.
    """
    log_presence = torch.zeros(erased.shape, device=erased.device, dtype=torch.float32).masked_fill(erased, float("-inf"))
    return weigh_keys(attn, log_presence, scores)


def permute_rows(attn: Tensor, visible: Tensor, draws: Tensor) -> Tensor:
    """Shuffle each query row's weights among the keys it sees; the others stay zero.

    Jain & Wallace, "Attention is not Explanation", NAACL 2019. Every row (query) of every
    head gets its own random permutation of the positions of the keys it sees: its real
    keys, and under a causal mask only those up to it (a shuffle onto later keys would let
    a decoder's row read tokens it never sees).

    Args:
        attn: ``(B, H, Q, K)`` probabilities; columns after the ``K`` keys (gpt-oss's sink)
            keep their weight.
        visible: ``(B, K)`` bool, True for real (non-padding) keys, or ``(B, Q, K)``: the
            keys each row sees.
        draws: ``(B, H, Q, K)`` random numbers (or broadcast to it), one per entry: each
            row's seen keys take, in the order of their positions, the weights of the seen
            keys in the order of their draws (ties in the order of the positions), e.g.
            :func:`~captum_attention.maps.draws.hashed_draws`, the same in any batch.

    Returns:
        ``(B, H, Q, K)`` probabilities with each row's seen entries permuted.
    """
    num_keys = visible.shape[-1]
    if attn.shape[-1] > num_keys:
        return torch.cat([permute_rows(attn[..., :num_keys], visible, draws[..., :num_keys]), attn[..., num_keys:]], dim=-1)
    rows = (visible[:, None, None, :] if visible.dim() == 2 else visible[:, None]).expand_as(attn)
    unseen_last = float("inf") if draws.is_floating_point() else torch.iinfo(torch.long).max
    shuffled_keys = draws.to(attn.device).expand_as(attn).masked_fill(~rows, unseen_last).argsort(dim=-1, stable=True)
    seen_rank = (rows.long().cumsum(dim=-1) - 1).clamp(min=0)  # a seen key's place among the row's seen keys
    return attn.gather(-1, shuffled_keys.gather(-1, seen_rank)).masked_fill(~rows, 0.0)
