"""Plausibility against known rationales (DeYoung et al., ERASER, ACL 2020).

Token-level F1 of the top-k tokens, IOU-F1 over contiguous spans, and AUPRC (average
precision) of the scores against the rationale tokens, per example.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _checked(attributions: Tensor, rationale: Tensor, include: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if attributions.shape != rationale.shape or attributions.dim() != 2:
        raise ValueError(
            f"attributions {tuple(attributions.shape)} and rationale {tuple(rationale.shape)} "
            "must both be (batch, seq_len)."
        )
    include = torch.ones_like(rationale, dtype=torch.bool) if include is None else include.bool()
    return attributions.float(), rationale.bool() & include, include


def top_k_tokens(attributions: Tensor, k: Tensor, include: Tensor) -> Tensor:
    """``(batch, seq_len)`` bool: each example's ``k[b]`` highest-scoring included tokens."""
    order = attributions.masked_fill(~include, float("-inf")).argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return (ranks < k[:, None]) & include


def _f1(predicted: Tensor, gold: Tensor) -> Tensor:
    overlap = (predicted & gold).sum(dim=1).float()
    precision = overlap / predicted.sum(dim=1).clamp(min=1)
    recall = overlap / gold.sum(dim=1).clamp(min=1)
    return torch.where(overlap > 0, 2 * precision * recall / (precision + recall), 0.0)


def token_f1(attributions: Tensor, rationale: Tensor, include: Tensor | None = None, k: int | None = None) -> Tensor:
    """F1 between the top-k tokens and the rationale tokens.

    Args:
        attributions (Tensor): ``(batch, seq_len)`` scores.
        rationale (Tensor): ``(batch, seq_len)`` bool, the known decisive tokens.
        include (Tensor, optional): tokens that may be selected (e.g. real, non-special).
        k (int, optional): tokens selected per example. Default: each example's number of
            rationale tokens.

    Returns:
        ``(batch,)`` tensor.
    """
    scores, gold, include = _checked(attributions, rationale, include)
    counts = gold.sum(dim=1) if k is None else torch.full((len(gold),), k, device=gold.device)
    return _f1(top_k_tokens(scores, counts, include), gold)


def _spans(selected: Tensor) -> list[tuple[int, int]]:
    spans, start = [], None
    for position, on in enumerate(selected.tolist() + [False]):
        if on and start is None:
            start = position
        elif not on and start is not None:
            spans.append((start, position))
            start = None
    return spans


def iou_f1(attributions: Tensor, rationale: Tensor, include: Tensor | None = None, k: int | None = None, threshold: float = 0.5) -> Tensor:
    """ERASER's IOU F1: predicted spans (contiguous runs of the top-k tokens) match a
    rationale span when their intersection over union exceeds ``threshold``; F1 of the
    matches. Arguments as for :func:`token_f1`. Returns ``(batch,)``."""
    scores, gold, include = _checked(attributions, rationale, include)
    counts = gold.sum(dim=1) if k is None else torch.full((len(gold),), k, device=gold.device)
    predicted = top_k_tokens(scores, counts, include)
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
    return torch.tensor(values)


def auprc(attributions: Tensor, rationale: Tensor, include: Tensor | None = None) -> Tensor:
    """Average precision of the scores ranking the rationale tokens first, ``(batch,)``:
    the mean, over rationale tokens, of the precision at their rank. NaN without any
    rationale token."""
    scores, gold, include = _checked(attributions, rationale, include)
    order = scores.masked_fill(~include, float("-inf")).argsort(dim=1, descending=True, stable=True)
    hits = gold.gather(1, order) & include.gather(1, order)
    precision_at = hits.cumsum(dim=1).float() / torch.arange(1, hits.shape[1] + 1, device=hits.device)
    total = hits.sum(dim=1).float()
    return torch.where(total > 0, (precision_at * hits).sum(dim=1) / total.clamp(min=1), torch.nan)
