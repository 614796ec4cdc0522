"""Checks shared by the metrics: scores that can be ranked, in rows that have tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def check_rankable(scores: Tensor, include: Tensor, name: str = "attributions") -> None:
    """A clear error for NaN among the ``include``\\ d scores (a NaN has no rank) and for
    rows with nothing included (nothing to rank)."""
    nan_rows = (scores.isnan() & include).any(dim=1).nonzero().flatten().tolist()
    if nan_rows:
        raise ValueError(
            f"{name} hold NaN in examples {nan_rows}: a NaN has no rank. Replace it (e.g. "
            "torch.nan_to_num) or leave those examples out."
        )
    empty_rows = (~include.any(dim=1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(
            f"Examples {empty_rows} have no token to rank (all padding, or all excluded): "
            "leave them out of the batch."
        )
