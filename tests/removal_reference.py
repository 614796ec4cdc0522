"""ERASER comprehensiveness computed one example at a time, unpadded: the reference the
token-removal metrics' batched, padded deletions are checked against."""

from __future__ import annotations

import math
from typing import Callable

import torch


def comprehensiveness_alone(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    scores: torch.Tensor, keep: torch.Tensor, share: float, target: int,
) -> torch.Tensor:
    """``(B,)`` p(target|x) − p(target|x without its top ⌈share·n⌉ removable tokens), each
    example's real tokens alone; ``forward(ids, mask)`` returns logits."""
    drops = []
    with torch.no_grad():
        for row in range(len(ids)):
            real = mask[row].bool()
            removable = real & ~keep[row]
            count = math.ceil(share * int(removable.sum()))
            kept = real.clone()
            kept[scores[row].masked_fill(~removable, float("-inf")).argsort(descending=True)[:count]] = False
            full = forward(ids[row : row + 1, real], mask[row : row + 1, real]).float().softmax(-1)[0, target]
            short = forward(ids[row : row + 1, kept], mask[row : row + 1, kept]).float().softmax(-1)[0, target]
            drops.append(full - short)
    return torch.stack(drops)
