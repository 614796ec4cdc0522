"""Agreement between two attributions of the same inputs: Kendall's τ and Spearman's ρ."""

from __future__ import annotations

from typing import Callable

import torch
from scipy import stats
from torch import Tensor

from ._checks import takes_captum_scores


def _per_example(correlation: Callable[..., object], first: Tensor, second: Tensor, include: Tensor | None) -> Tensor:
    if first.shape != second.shape or first.dim() != 2:
        raise ValueError(
            f"attributions must both be (batch, seq_len); got {tuple(first.shape)} and {tuple(second.shape)}."
        )
    include = torch.ones_like(first, dtype=torch.bool) if include is None else include.bool()
    for name, scores in (("first", first), ("second", second)):
        nan_rows = (scores.isnan() & include).any(dim=1).nonzero().flatten().tolist()
        if nan_rows:
            raise ValueError(
                f"{name} holds NaN in examples {nan_rows}: a NaN has no rank. Replace it (e.g. "
                "torch.nan_to_num) or leave those tokens out of include."
            )
    values = []
    for a, b, chosen in zip(first.detach().cpu(), second.detach().cpu(), include.cpu()):
        if chosen.sum() < 2:
            values.append(float("nan"))
            continue
        statistic = correlation(a[chosen].double().numpy(), b[chosen].double().numpy()).statistic  # type: ignore[attr-defined]
        values.append(float(statistic))
    return torch.tensor(values, dtype=torch.float32)


@takes_captum_scores("first", "second")
def kendall_tau(first: Tensor, second: Tensor, include: Tensor | None = None) -> Tensor:
    """Kendall's τ-b (scipy.stats.kendalltau) between two ``(batch, seq_len)`` attributions.

    Args:
        first, second (Tensor): attributions of the same inputs.
        include (Tensor, optional): ``(batch, seq_len)`` bool, the tokens compared, e.g.
            ``attention_mask.bool() & ~special_tokens``. Default: all tokens.

    Returns:
        ``(batch,)`` tensor; NaN where fewer than two tokens are compared or one side is
        constant.
    """
    return _per_example(stats.kendalltau, first, second, include)


@takes_captum_scores("first", "second")
def spearman(first: Tensor, second: Tensor, include: Tensor | None = None) -> Tensor:
    """Spearman's ρ (scipy.stats.spearmanr); arguments as for :func:`kendall_tau`."""
    return _per_example(stats.spearmanr, first, second, include)
