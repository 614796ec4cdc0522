"""Plausibility against known rationales (DeYoung et al., ERASER, ACL 2020).

Token-level F1 of the top-k tokens, IOU-F1 over contiguous spans, AUPRC (average
precision) of the scores against the rationale tokens, and the pointing game (Zhang et al.,
ECCV 2016) of the top token, per example.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_rankable, takes_captum_scores


def _checked(
    attributions: Tensor, rationale: Tensor, include: Tensor | None, k: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be a positive number of tokens (or None: the rationale's size), got {k!r}.")
    if attributions.shape != rationale.shape or attributions.dim() != 2:
        raise ValueError(
            f"attributions {tuple(attributions.shape)} and rationale {tuple(rationale.shape)} "
            "must both be (batch, seq_len)."
        )
    if include is not None and include.shape != rationale.shape:
        raise ValueError(f"include has shape {tuple(include.shape)}; it must be {tuple(rationale.shape)} (batch, seq_len).")
    include = torch.ones_like(rationale, dtype=torch.bool) if include is None else include.bool()
    check_rankable(attributions, include)
    return attributions.float(), rationale.bool() & include, include


def top_k_weights(attributions: Tensor, k: Tensor, include: Tensor) -> Tensor:
    """``(batch, seq_len)`` float: each example's ``k[b]`` highest-scoring included tokens
    with weight 1; tokens tied at the cut share the remaining places (the chance that a
    random order among them selects each), so ties are never broken by position."""
    masked = attributions.masked_fill(~include, float("-inf"))
    k = torch.minimum(k, include.sum(dim=1))
    cut = masked.sort(dim=1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
    above = (masked > cut) & include
    tied = (masked == cut) & include
    places = (k - above.sum(dim=1)).float() / tied.sum(dim=1).clamp(min=1)
    weights = above.float() + tied.float() * places[:, None]
    return weights.masked_fill(k[:, None] == 0, 0.0)


def _f1(predicted: Tensor, gold: Tensor) -> Tensor:
    """F1 of (weighted) predicted tokens against the gold ones: with weights from
    :func:`top_k_weights` it is the expected F1 over the orders of tied tokens (F1 is
    linear in the overlap when the number of predicted tokens is fixed)."""
    overlap = (predicted.float() * gold).sum(dim=1)
    precision = overlap / predicted.float().sum(dim=1).clamp(min=1)
    recall = overlap / gold.sum(dim=1).clamp(min=1)
    return torch.where(overlap > 0, 2 * precision * recall / (precision + recall).clamp(min=1e-30), 0.0)


@takes_captum_scores("attributions")
def token_f1(attributions: Tensor, rationale: Tensor, include: Tensor | None = None, k: int | None = None) -> Tensor:
    """F1 between the top-k tokens and the rationale tokens.

    Tokens tied at the k-th place count fractionally: the result is the expected F1 over
    the orders of the tied tokens, never a choice by position.

    Args:
        attributions (Tensor): ``(batch, seq_len)`` scores.
        rationale (Tensor): ``(batch, seq_len)`` bool, the known decisive tokens.
        include (Tensor, optional): tokens that may be selected (e.g. real, non-special).
        k (int, optional): tokens selected per example. Default: each example's number of
            rationale tokens.

    Returns:
        ``(batch,)`` tensor.

    Raises:
        ValueError: NaN among the included scores, an example with no included token, or
            ``k`` below 1.
    """
    scores, gold, include = _checked(attributions, rationale, include, k)
    counts = gold.sum(dim=1) if k is None else torch.full((len(gold),), k, device=gold.device)
    return _f1(top_k_weights(scores, counts, include), gold)


def _spans(selected: Tensor) -> list[tuple[int, int]]:
    spans, start = [], None
    for position, on in enumerate(selected.tolist() + [False]):
        if on and start is None:
            start = position
        elif not on and start is not None:
            spans.append((start, position))
            start = None
    return spans


@takes_captum_scores("attributions")
def iou_f1(attributions: Tensor, rationale: Tensor, include: Tensor | None = None, k: int | None = None, threshold: float = 0.5) -> Tensor:
    """ERASER's IOU F1: predicted spans (contiguous runs of the top-k tokens) match a
    rationale span when their intersection over union exceeds ``threshold``; F1 of the
    matches. Tokens tied at the k-th place are all selected (spans have no fractional
    membership; position never decides). Arguments as for :func:`token_f1`. Returns
    ``(batch,)``."""
    scores, gold, include = _checked(attributions, rationale, include, k)
    counts = gold.sum(dim=1) if k is None else torch.full((len(gold),), k, device=gold.device)
    predicted = top_k_weights(scores, counts, include) > 0
    values = []
    for pred_row, gold_row in zip(predicted.cpu(), gold.cpu()):
        pred_spans, gold_spans = _spans(pred_row), _spans(gold_row)

        def iou(a: tuple[int, int], b: tuple[int, int]) -> float:
            inter = max(0, min(a[1], b[1]) - max(a[0], b[0]))
            return inter / (max(a[1], b[1]) - min(a[0], b[0]))

        matched_pred = sum(any(iou(p, g) > threshold for g in gold_spans) for p in pred_spans)
        matched_gold = sum(any(iou(p, g) > threshold for p in pred_spans) for g in gold_spans)
        precision = matched_pred / len(pred_spans) if pred_spans else 0.0
        recall = matched_gold / len(gold_spans) if gold_spans else 0.0
        values.append(0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
    return torch.tensor(values, dtype=torch.float32)


@takes_captum_scores("attributions")
def auprc(attributions: Tensor, rationale: Tensor, include: Tensor | None = None) -> Tensor:
    """Average precision of the scores ranking the rationale tokens first, ``(batch,)``:
    Σ_t (R_t − R_(t−1))·P_t over the distinct score thresholds t, highest first (as
    ``sklearn.metrics.average_precision_score``), so tied scores form one step and their
    positions never matter. NaN without any rationale token."""
    scores, gold, include = _checked(attributions, rationale, include)
    values = []
    for row_scores, row_gold, row_include in zip(scores, gold, include):
        kept, hits = row_scores[row_include], row_gold[row_include].float()
        if not bool(hits.any()):
            values.append(torch.tensor(float("nan"), dtype=torch.float32))
            continue
        thresholds, group = kept.unique(sorted=True, return_inverse=True)
        selected = torch.zeros_like(thresholds).index_add_(0, group, torch.ones_like(hits)).flip(0).cumsum(0)
        found = torch.zeros_like(thresholds).index_add_(0, group, hits).flip(0).cumsum(0)
        recall_steps = torch.diff(found, prepend=found.new_zeros(1)) / hits.sum()
        values.append((recall_steps * found / selected).sum())
    return torch.stack(values)


@takes_captum_scores("attributions")
def pointing_game(attributions: Tensor, rationale: Tensor, include: Tensor | None = None) -> Tensor:
    """The pointing game (Zhang et al., "Top-down Neural Attention by Excitation
    Backprop", ECCV 2016): 1 where the highest-scored included token (an image's patch)
    lies in the rationale (the object's box), else 0, ``(batch,)``. Tokens tied at the top
    count fractionally: the chance that a random order among them puts one of the
    rationale first, never a choice by position. NaN without any rationale token.
    Arguments as for :func:`token_f1`."""
    scores, gold, include = _checked(attributions, rationale, include)
    first = top_k_weights(scores, torch.ones(len(scores), dtype=torch.long, device=scores.device), include)
    hits = (first * gold).sum(dim=1)
    return torch.where(gold.any(dim=1), hits, torch.full_like(hits, float("nan")))
