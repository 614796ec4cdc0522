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
"""

from __future__ import annotations

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
