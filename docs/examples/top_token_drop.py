"""A new faithfulness metric, registered so that ``evaluate`` scores it.

"Top-token drop": how much the explained class's probability falls when the single
top-ranked token is masked out. Registered metrics are called the Captum way (see
:mod:`captum_attention.metrics.registry`) and return one value per example.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from captum_attention.metrics import MetricContext, register_metric


@register_metric(
    "top_token_drop",
    "drop of the explained class's probability when the top token is masked out",
)
def top_token_drop(
    forward_func: Callable[..., Tensor],
    inputs: Tensor,
    attributions: Tensor,
    additional_forward_args: tuple[Any, ...],
    target: Tensor,
    context: MetricContext,
) -> Tensor:
    mask = additional_forward_args[0]
    ranked = attributions.masked_fill(~context.included(mask), float("-inf"))
    masked = mask.clone()
    masked[torch.arange(len(mask)), ranked.argmax(dim=1)] = 0
    with torch.no_grad():
        before = forward_func(inputs, mask).float().softmax(dim=-1)
        after = forward_func(inputs, masked).float().softmax(dim=-1)
    return (before - after).gather(1, target[:, None])[:, 0]
