"""Running a model once, optionally with an attention intervention, for the metrics."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from .._compat import format_additional_forward_args
from ..capture import AttentionAdapter, ForwardRecord, Probe, record_forward
from ..capture.inputs import QueryIndex, format_inputs, take_rows
from ..capture.runner import CaptureMode, CaptureRunner, check_inputs, resolve_adapter, stream_refusal
from ..maps import real_ranks
from ._checks import check_class_probabilities
from .token_removal import example_seeds


def run_model(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    additional_forward_args: Any = None,
    probes: Sequence[Probe] = (),
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
    *,
    track_grad: bool = False,
    query_index: QueryIndex = None,
    compares_probabilities: bool = True,
) -> ForwardRecord:
    """One forward through the capture layer with ``probes``, explaining ``query_index``
    (default: the default position; ``explained_probs()`` are the output distribution the
    metrics compare), in the autograd graph with ``track_grad``. ``capture`` is decided
    by :class:`~captum_attention.capture.runner.CaptureRunner` (``auto`` streams where
    the adapter and the probes allow it, else runs eager). A metric that
    ``compares_probabilities`` refuses a classifier whose outputs are none
    (:func:`~captum_attention.metrics._checks.check_class_probabilities`)."""
    _, tensors = format_inputs(inputs)
    if compares_probabilities:
        check_class_probabilities(forward_func)
    runner = CaptureRunner(capture, "metric")
    check_inputs(resolve_adapter(model, adapter), model, tensors)
    reason = stream_refusal(resolve_adapter(model, adapter), probes)
    return runner.run(
        lambda streaming: record_forward(
            forward_func, model, tensors, additional_forward_args, adapter, probes=probes, track_grad=track_grad,
            query_index=query_index, streaming=streaming,
        ),
        reason,
    )


def select_rows(
    inputs: Tensor | tuple[Tensor, ...], additional_forward_args: Any, rows: Tensor
) -> tuple[Tensor | tuple[Tensor, ...], Any]:
    """The examples ``rows`` (with repeats) of the inputs and of every batch-shaped extra argument."""
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    batch = tensors[0].shape[0]
    extra = format_additional_forward_args(additional_forward_args)
    picked = take_rows(tensors, rows, batch)
    return (picked if isinstance(inputs, tuple) else picked[0]), (None if extra is None else take_rows(extra, rows, batch))


def layer_set(layers: int | list[int] | None, num_calls: int) -> set[int]:
    """``layers`` (attention calls) as a set of indices in ``0..num_calls-1``; None = all; a clear error if absent."""
    if layers is None:
        return set(range(num_calls))
    chosen = [layers] if isinstance(layers, (int, float)) else list(layers)
    wrong = [layer for layer in chosen if isinstance(layer, bool) or not isinstance(layer, int)]
    if wrong:
        raise TypeError(f"layers must be an int or a list of ints (layer indices), got {layers!r}.")
    if not chosen:
        raise ValueError("layers is empty: give at least one layer, or None for all layers.")
    missing = [layer for layer in chosen if not -num_calls <= layer < num_calls]
    if missing:
        raise ValueError(
            f"layers {missing} do not exist: the model has {num_calls} attention layers "
            f"(valid: {-num_calls}..{num_calls - 1})."
        )
    return {layer % num_calls for layer in chosen}


def js_divergence(p: Tensor, q: Tensor) -> Tensor:
    """Jensen-Shannon divergence in bits (0..1) between rows of two distributions."""
    p, q = p.double(), q.double()
    middle = 0.5 * (p + q)

    def kl(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(a > 0, a * (a.clamp(min=1e-30).log2() - b.clamp(min=1e-30).log2()), 0.0).sum(-1)

    return (0.5 * kl(p, middle) + 0.5 * kl(q, middle)).clamp(min=0.0).float()


def example_seeds_of(inputs: Tensor | tuple[Tensor, ...], run: ForwardRecord, seed: int) -> Tensor:
    """``(B,)`` each example's seed: :func:`~captum_attention.metrics.token_removal.example_seeds`
    of each input in turn, over its real positions where it is laid out along the tokens
    (the first input along the source's, a sequence-to-sequence model's others along the
    target's)."""
    seeds: int | Tensor = seed
    for position, tensor in enumerate(inputs if isinstance(inputs, tuple) else (inputs,)):
        real = run.input_real if position == 0 else run.target_real
        seeds = example_seeds(tensor, real if tensor.dim() >= 2 and tensor.shape[1] == real.shape[1] else None, seeds)
    assert isinstance(seeds, Tensor)
    return seeds


def ranks_of(run: ForwardRecord, call: int) -> tuple[Tensor, Tensor]:
    """``(B, Q or 1)`` and ``(B, K)`` long: each query row's and key's place among the real
    tokens of the call's queries and keys (:func:`~captum_attention.maps.real_ranks`), the
    coordinates of per-example draws that padding does not move."""
    queries, keys = run.real_of(run.roles[call])
    return real_ranks(queries), real_ranks(keys)
