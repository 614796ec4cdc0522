"""Rankings of key positions for erasure: attention, gradient, gradient × attention, random.

Serrano & Smith (ACL 2019) compare erasure orders by attention weight α, by the gradient
of the decision with respect to α, and by their product; each ranking here is the
head-mean of that quantity at one layer's query row, ``(batch, seq_len)``, higher first.
Any attribution tensor of that shape (ours, Integrated Gradients, SHAP values aligned to
tokens) is a ranking too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from .._compat import TargetType
from ..capture import AttentionAdapter
from ..capture.inputs import format_inputs
from ..capture.record import ForwardRecord, GradientReduction, record_forward
from ..maps import mask_padding, query_rows
from ._forward import resolve_model


def _recorded(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType,
    additional_forward_args: Any,
    model: nn.Module | None,
    query_index: int | None,
    adapter: AttentionAdapter | None,
    reduction: GradientReduction | None,
) -> ForwardRecord:
    _, tensors = format_inputs(inputs)
    model = resolve_model(forward_func, model)
    record = record_forward(
        forward_func, model, tensors, additional_forward_args, adapter,
        track_grad=reduction is not None, query_index=query_index,
    )
    return record if reduction is None else record.with_gradients(target, reduction)


def _ranking(record: ForwardRecord, layer: int) -> Tensor:
    """The head-mean map of ``layer`` (attention, or the gradient reduction) at the query row."""
    index = record.layer(layer)
    head_mean = record.attn_probs[index].float().mean(dim=1) if record.grad_maps is None else record.grad_maps[index]
    return query_rows(mask_padding(head_mean, record.target_real), record.query_index)


def attention_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
) -> Tensor:
    """Head-mean attention α of ``layer`` at the query row, ``(batch, seq_len)``."""
    record = _recorded(forward_func, inputs, None, additional_forward_args, model, query_index, adapter, None)
    return _ranking(record, layer)


def gradient_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType = None,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
) -> Tensor:
    """Head-mean gradient ∂S/∂α of ``layer`` at the query row (S: the target's logit)."""
    record = _recorded(
        forward_func, inputs, target, additional_forward_args, model, query_index, adapter, _gradient_head_mean
    )
    return _ranking(record, layer)


def gradient_attention_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType = None,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
) -> Tensor:
    """Head-mean ∂S/∂α ⊙ α of ``layer`` at the query row."""
    record = _recorded(
        forward_func, inputs, target, additional_forward_args, model, query_index, adapter, _product_head_mean
    )
    return _ranking(record, layer)


def _gradient_head_mean(attn: Tensor, grad: Tensor) -> Tensor:
    return grad.mean(dim=1)


def _product_head_mean(attn: Tensor, grad: Tensor) -> Tensor:
    return (grad * attn).mean(dim=1)


def random_ranking(shape: tuple[int, int] | torch.Size, seed: int = 0) -> Tensor:
    """A uniformly random ranking of shape ``(batch, seq_len)``, reproducible by ``seed``."""
    return torch.rand(tuple(shape), generator=torch.Generator().manual_seed(seed))
