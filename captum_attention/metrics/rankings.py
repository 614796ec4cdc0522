"""Rankings of key positions for erasure: attention, gradient, gradient × attention, random.

Serrano & Smith (ACL 2019) compare erasure orders by attention weight α, by the gradient
of the decision with respect to α, and by their product; each ranking here is the
head-mean of that quantity at one layer's query row, ``(batch, seq_len)``, higher first.
Any attribution tensor of that shape (ours, Integrated Gradients, SHAP values aligned to
tokens) is a ranking too.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn

from .._compat import TargetType
from ..capture import AttentionAdapter, GradMaps, OutputGrads
from ..capture.record import HeadReduction, without_autocast
from ..capture.runner import resolve_model
from ..maps import mask_padding
from ._forward import CaptureMode, run_model


Kind = Literal["attention", "gradient", "gradient_attention"]


def _ranking(
    kind: Kind,
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType,
    additional_forward_args: Any,
    model: nn.Module | None,
    layer: int,
    query_index: int | None,
    adapter: AttentionAdapter | None,
    capture: CaptureMode,
) -> Tensor:
    """The head mean of ``kind`` (α, ∂S/∂α or their product) at ``layer``'s query row,
    ``(batch, seq_len)``, non-real keys 0."""
    model = resolve_model(forward_func, model)
    record = run_model(
        forward_func, model, inputs, additional_forward_args, (), adapter, capture,
        track_grad=kind != "attention", query_index=query_index, compares_probabilities=False,
    )
    index = record.call_index(layer)
    if record.streaming:
        call = record.kernel_calls[index]
        if kind == "attention":
            rows = call.rows_at(record.query_index)
        else:
            grads = record.with_output_gradients(target).result(OutputGrads).grads
            rows = call.grad_rows_at(grads[index], record.query_index)
            rows = rows if kind == "gradient" else rows * call.rows_at(record.query_index)
        return rows.mean(dim=1).masked_fill(~record.target_real, 0.0)
    if kind != "attention":
        head_mean = record.with_gradients(target, _HEAD_MEANS[kind]).result(GradMaps).maps[index]
    else:
        head_mean = record.attn_maps[index].float().mean(dim=1)
    return record.explained_row(index, mask_padding(head_mean, *record.real_of(record.roles[index])))


@without_autocast("attention_ranking")
def attention_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> Tensor:
    """Head-mean attention α of ``layer`` at the query row, ``(batch, seq_len)``
    (``capture``: as for :func:`attention_erasure`)."""
    return _ranking("attention", forward_func, inputs, None, additional_forward_args, model, layer, query_index, adapter, capture)


@without_autocast("gradient_ranking")
def gradient_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType = None,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> Tensor:
    """Head-mean gradient ∂S/∂α of ``layer`` at the query row (S: the target's logit)."""
    return _ranking("gradient", forward_func, inputs, target, additional_forward_args, model, layer, query_index, adapter, capture)


@without_autocast("gradient_attention_ranking")
def gradient_attention_ranking(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    target: TargetType = None,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layer: int = -1,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> Tensor:
    """Head-mean ∂S/∂α ⊙ α of ``layer`` at the query row."""
    return _ranking(
        "gradient_attention", forward_func, inputs, target, additional_forward_args, model, layer, query_index, adapter, capture
    )


_HEAD_MEANS: dict[str, HeadReduction] = {
    "gradient": lambda attn, grad: grad.float().mean(dim=1),
    "gradient_attention": lambda attn, grad: (grad.float() * attn.float()).mean(dim=1),
}


def random_ranking(shape: tuple[int, int] | torch.Size, seed: int = 0) -> Tensor:
    """A uniformly random ranking of ``shape`` (``(batch, seq_len)``, or ``(batch, rows,
    columns)`` for patches), reproducible by ``seed``."""
    dims = tuple(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape must be sizes such as (batch, seq_len), non-negative ints; got {shape!r}.")
    return torch.rand(dims, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
