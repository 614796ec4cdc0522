"""The first-order effect of knocking a key out of every attention call (attribution
patching on the attention's keys: Syed, Rager & Conmy, 2023, https://arxiv.org/abs/2310.10348;
Kramár, Lieberum, Shah & Nanda, "AtP*", 2024, https://arxiv.org/abs/2403.00745).

Deleting key j from a call scales its softmax weight by a gate g_j → 0: with a logit bias
log g_j, the row's attention is A'_ij ∝ A_ij g_j. At g = 1, dS/d(log g_j) =
Σ_i A_ij (G_ij − Σ_j' A_ij' G_ij') per head, with G = dS/dA; summed over every call and
head it is the first-order estimate of S(all) − S(without token j), the token's
leave-one-out effect where its keys are masked out of every call. Where one token
decides the output, the slope is flat (its attention saturates): with_decisive_tokens
gives such tokens a score from elsewhere (AttnLRP's relevance, in KnockoutLRP).

How far the slope can miss, row by row: if the keys of a segment s hold the share a of
row i's attention, the row's output is o(g) = (g·a·v_s + (1 − a)·v_rest) / (g·a + 1 − a),
so the deletion moves it by o(1) − o(0) = a·(v_s − v_rest) while the slope says
do/dg = a·(1 − a)·(v_s − v_rest): 1 / (1 − a) times less. segment_shares gives each
segment's largest such a.
"""

from __future__ import annotations

import torch
from torch import Tensor


def knockout_terms(attn: Tensor, grad: Tensor) -> Tensor:
    """A ⊙ (G − Σ_j A_ij G_ij) ``(B, H, Q, K)`` in float32: per query row, the first-order
    change of S when each key's logit is lowered by one (the knockout's slope)."""
    attn, grad = attn.float(), grad.float()
    return attn * (grad - (attn * grad).sum(dim=-1, keepdim=True))


def knockout_head_sum(attn: Tensor, grad: Tensor) -> Tensor:
    """:func:`knockout_terms` summed over the heads: ``(B, Q, K)``."""
    return knockout_terms(attn, grad).sum(dim=1)


def with_decisive_tokens(first_order: Tensor, relevance: Tensor, count: int) -> Tensor:
    """``first_order`` with, in each row (the last dimension), the ``count`` tokens of
    largest ``|relevance|`` taking their ``relevance``: the tokens whose knockout slope
    flattens where deleting them decides the output."""
    decisive = relevance.abs().topk(min(count, relevance.shape[-1]), dim=-1).indices
    return first_order.scatter(-1, decisive, relevance.gather(-1, decisive))


def segment_shares(attn_probs: Tensor, key_segments: Tensor, row_segments: Tensor, real_rows: Tensor, count: int) -> Tensor:
    """``(B, count)`` float32: the largest share of one row's attention that each
    segment's keys hold, over the heads and the rows of ``attn_probs`` ``(B, H, r, k)`` (a
    block of query rows) that are ``real_rows`` ``(B, r)`` and not the segment's own
    (deleting a segment removes its rows instead of reweighting them).
    ``key_segments`` ``(B, ≥ k)`` and ``row_segments`` ``(B, r)`` hold each token's
    segment, -1 for a token in none."""
    batch, heads, rows, keys = attn_probs.shape
    buckets = key_segments[:, :keys].masked_fill(key_segments[:, :keys] < 0, count)
    sums = attn_probs.new_zeros(batch, heads, rows, count + 1, dtype=torch.float32)
    sums.scatter_add_(-1, buckets[:, None, None, :].expand(batch, heads, rows, keys), attn_probs.float())
    own = row_segments.masked_fill(row_segments < 0, count)
    sums.scatter_(-1, own[:, None, :, None].expand(batch, heads, rows, 1), 0.0)
    if not bool(real_rows.all()):
        sums.masked_fill_(~real_rows[:, None, :, None], 0.0)
    return sums[..., :count].amax(dim=(1, 2))
