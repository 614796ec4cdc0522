"""The methods' reductions computed from recorded kernel calls, one block of query rows at a time.

Each function recomputes exactly the rows of ``A = softmax(Q·Kᵀ·s + mask)`` (and of
``dS/dA = dO·Vᵀ``) that it needs from a :class:`~captum_attention.maps.kernel.KernelCall`,
reduces them, and lets them go: no ``(heads, N, N)`` tensor is ever alive. Each equals the
method's formula on the full maps (``grad_sam``, ``transformer_attribution``, ``rollout``,
``raw``): the reductions are sums over heads and keys of the same entries, and the query-row
products of ``propagate_query_row`` are taken one block of rows at a time.

``real_queries`` / ``real_keys`` are ``(B, Q)`` / ``(B, K)`` bool; the pairs outside them
are zeroed as ``mask_padding`` zeroes them.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import Tensor

from .kernel import KernelCall, live_rows
from .common import check_head_fusion, fuse_heads, query_weights
from .grad_sam import check_axis
from .knockout import knockout_terms, segment_shares


_LOG = logging.getLogger(__name__)

Shape = tuple[int, int]
"""``(heads, rows)`` per block (:func:`~captum_attention.maps.kernel.block_shape`)."""


def _over_real_keys(block: Tensor, real_keys: Tensor) -> Tensor:
    """``block`` ``(B, h, r, k)`` with the columns of non-real keys zeroed."""
    keys = real_keys[:, : block.shape[-1]]
    return block if bool(keys.all()) else block.masked_fill_(~keys[:, None, None, :], 0.0)


def _key_weights(real_keys: Tensor, span: int) -> Tensor | None:
    """``(B, 1, 1, span)`` float 1 on the real keys among the first ``span``, 0 elsewhere;
    None when every one is real."""
    keys = real_keys[:, :span]
    return None if bool(keys.all()) else keys[:, None, None, :].float()


def exp_terms(
    logits: Tensor, grad_probs: Tensor, key_weights: Tensor | None, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(z, E ⊙ G⁺ ⊙ key_weights)`` with ``E = exp(logits - m)``, m each row's max (0 in
    a row whose every key is masked, whose E is then 0) and z = Σ_j E_ij ``(B, h, r)``, so
    that ``A ⊙ G⁺ = (E ⊙ G⁺) / z`` with A = softmax(logits): both Grad-SAM's terms
    A·ReLU(G) and Chefer et al.'s (G ⊙ A)⁺, equal since A ≥ 0. Callers divide by z after
    reducing, where it costs a vector instead of a pass over the block. With ``sinks``
    (``(1, h, 1, 1)`` logits that join each row's softmax, :meth:`~captum_attention.maps.kernel.KernelCall.sink_logits`)
    m also covers the sink and z adds its ``exp(sink - m)``."""
    top = logits.amax(dim=-1, keepdim=True)
    top = top.masked_fill_(top == -math.inf, 0.0) if sinks is None else torch.maximum(top, sinks)
    exp = (logits - top).exp_()
    norm = exp.sum(dim=-1)
    norm = norm if sinks is None else norm.add_((sinks - top).exp_()[..., 0])
    norm = norm.clamp_(min=torch.finfo(exp.dtype).tiny)
    terms = exp.mul_(grad_probs.clamp(min=0))
    return norm, terms if key_weights is None else terms.mul_(key_weights)


def positive_row_sums(logits: Tensor, grad_probs: Tensor, key_weights: Tensor | None, sinks: Tensor | None = None) -> Tensor:
    """``Σ_j (A ⊙ G⁺ ⊙ key_weights)_ij`` ``(B, h, r)`` (:func:`exp_terms`)."""
    norm, terms = exp_terms(logits, grad_probs, key_weights, sinks)
    return terms.sum(dim=-1).div_(norm)


FUSED_MIN_PAIRS = 2048 * 2048
"""Calls with at least this many (query, key) pairs reduce their blocks with
:func:`exp_terms` and :func:`positive_row_sums` compiled by ``torch.compile`` (on a
CPU one C++ loop over the block, instead of an eager pass per operation; measured 2.3×
faster on a BERT layer at 8k tokens); smaller calls would spend longer compiling than
computing. Where compiling fails (no C++ compiler, an unsupported platform) the eager
functions are used, with the reason logged at debug level."""

FUSED_DEVICES = {"cpu": True, "cuda": False}
"""Whether the compiled reductions are used, per device (measured on CPU only)."""

COMPILE_AFTER_SECONDS = float(os.environ.get("CAPTUM_ATTENTION_COMPILE_AFTER", "2.5"))
"""Seconds of eager block reductions a process runs before it compiles them (``0``: at
once; ``inf``: never; environment variable ``CAPTUM_ATTENTION_COMPILE_AFTER``). Compiling
stalls the first compiled call by about as long, even with torch's compile cache warm
(importing dynamo and inductor, tracing, loading: a fresh process's first Grad-SAM at 4k
tokens on the 4-layer Llama took 3.7 s against 1.45 s warm), and the compiled reduction
saves a share of the eager one's time (10% of that call, 2.3× on a BERT layer's blocks at
8k). Compiling once as much time has gone into eager reductions as the stall costs keeps
any run within twice its best cost, whether it explains one short text or many long ones:
a first call at 4k tokens runs eagerly (1.76 s), a long one compiles part way through."""

Reduced = TypeVar("Reduced", Tensor, tuple[Tensor, Tensor])
_COMPILED: dict[tuple[Callable[..., Any], str], Callable[..., Any] | None] = {}
_EAGER_SECONDS: dict[str, float] = {}
"""Per device, the seconds this process has spent in eager block reductions that
:data:`COMPILE_AFTER_SECONDS` counts."""


def device_kind(device: torch.device) -> str:
    """``"cpu"``, else ``"cuda"``: the keys of :data:`FUSED_DEVICES` and the compile budget."""
    return "cpu" if device.type == "cpu" else "cuda"


def _device(call: KernelCall) -> str:
    return device_kind(call.query.device)


def _compiles(call: KernelCall) -> bool:
    """Whether :data:`FUSED_MIN_PAIRS` and :data:`FUSED_DEVICES` let ``call``'s blocks be
    compiled (once :data:`COMPILE_AFTER_SECONDS` is spent)."""
    return call.num_queries * call.num_keys >= FUSED_MIN_PAIRS and FUSED_DEVICES.get(_device(call), False)


def _block(reduction: Callable[..., Reduced], call: KernelCall, *args: Tensor | None) -> Reduced:
    """``reduction(*args)`` for one block of ``call``, compiled where
    :data:`FUSED_MIN_PAIRS`, :data:`FUSED_DEVICES` and :data:`COMPILE_AFTER_SECONDS` say so."""
    return compiled_block(reduction, _device(call), _compiles(call), *args)


def compiled_block(reduction: Callable[..., Reduced], device: str, large: bool, *args: Tensor | None) -> Reduced:
    """``reduction(*args)``, compiled by ``torch.compile`` where the computation is
    ``large`` (by the caller's threshold) and :data:`FUSED_DEVICES` allows it on ``device``
    (``"cpu"`` or ``"cuda"``), once this process has spent :data:`COMPILE_AFTER_SECONDS` in
    eager blocks there; eager where compiling fails."""
    if not (large and FUSED_DEVICES.get(device, False)):
        return reduction(*args)
    key = (reduction, device)
    if key not in _COMPILED and _EAGER_SECONDS.get(device, 0.0) < COMPILE_AFTER_SECONDS:
        start = time.perf_counter()
        reduced = reduction(*args)
        _EAGER_SECONDS[device] = _EAGER_SECONDS.get(device, 0.0) + time.perf_counter() - start
        return reduced
    if key not in _COMPILED:
        _LOG.debug("compiling %s on %s after %.1f s of eager block reductions", reduction.__name__, device, _EAGER_SECONDS.get(device, 0.0))
        _COMPILED[key] = torch.compile(reduction, dynamic=True)
    compiled = _COMPILED[key]
    if compiled is not None:
        try:
            return compiled(*args)
        except Exception as error:  # noqa: BLE001 - whatever stops compiling, eager computes the same
            _LOG.debug("compiled %s unavailable on %s, computing eagerly: %s", reduction.__name__, device, error)
            _COMPILED[key] = None
    return reduction(*args)


FUSED_KERNEL_DEVICES = {"cuda": os.environ.get("CAPTUM_ATTENTION_TRITON", "1") != "0", "cpu": False}
"""Whether the Triton kernels of :mod:`~captum_attention.maps.fused` reduce a call's rows,
per device (where triton is installed and the call is one they handle: no position bias).
On by default on CUDA, where they beat the eager and compiled block reductions
(``docs/benchmarks.rst``; ``CAPTUM_ATTENTION_TRITON=0`` turns them off); the tests run them
on the CPU under ``TRITON_INTERPRET=1``. Elsewhere the compiled or eager block reductions
run, and on a device where Triton cannot compile or launch them
(:func:`~captum_attention.maps.fused.failed_to_launch`) too, after one warning."""


def _fused_kernels(call: KernelCall, gradient: bool = True, compilable: bool = True) -> Any:
    """The :mod:`~captum_attention.maps.fused` module where its kernels (those with a
    gradient factor, or not) take ``call``, else None; which path reduces the call is
    logged at debug level (``compilable``: whether the caller's block path is one that
    :func:`_block` compiles)."""
    device = _device(call)
    kernels = None
    if FUSED_KERNEL_DEVICES.get(device, False):
        from . import fused

        kernels = fused if fused.available() and fused.supports(call, gradient) else None
    if kernels is not None:
        path = "Triton kernels"
    elif not compilable:
        path = "block computations"
    elif not _compiles(call):
        path = "eager block reductions"
    elif _EAGER_SECONDS.get(device, 0.0) < COMPILE_AFTER_SECONDS and not any(key[1] == device for key in _COMPILED):
        path = f"eager block reductions (compiled after {COMPILE_AFTER_SECONDS:g} s of them)"
    else:
        path = "compiled block reductions"
    _LOG.debug("%s reduce a call of %d queries and %d keys on %s", path, call.num_queries, call.num_keys, device)
    return kernels


def _through_kernels(
    call: KernelCall, reduce: Callable[[Any], Tensor], gradient: bool = True, compilable: bool = True
) -> Tensor | None:
    """``reduce(fused)`` where the Triton kernels take ``call`` (:func:`_fused_kernels`);
    None where they do not, or where Triton cannot compile or launch them on the call's
    device: then they stay off there (one warning) and the caller's block path runs."""
    kernels = _fused_kernels(call, gradient, compilable)
    if kernels is None:
        return None
    try:
        return reduce(kernels)
    except Exception as failure:
        if not kernels.failed_to_launch(failure):
            raise
        device = _device(call)
        FUSED_KERNEL_DEVICES[device] = False
        reason = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
        warnings.warn(
            f"captum_attention: Triton cannot run the streaming kernels on {device} ({reason}); the block reductions "
            "run instead, with the same results, more slowly (CAPTUM_ATTENTION_TRITON=0 skips the kernels).",
            RuntimeWarning, stacklevel=2,
        )
        return None


def _terms_of(
    call: KernelCall, grad_output: Tensor, rows: slice, heads: slice, real_keys: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """The recomputed logits and dS/dA of a block, its key weights (:func:`_key_weights`)
    and its heads' sink logits (or None)."""
    logits = call.logits(rows, heads)
    return logits, call.grad_probs(grad_output, rows, heads), _key_weights(real_keys, logits.shape[-1]), call.sink_logits(heads)


def grad_sam_row_sums(
    call: KernelCall, grad_output: Tensor, real_queries: Tensor, real_keys: Tensor, shape: Shape, axis: str = "query"
) -> Tensor:
    """Σ_m Σ_j A^m_ij·ReLU(G^m_ij) per query row i, ``(B, Q)``: one layer's Grad-SAM sums;
    with ``axis="key"`` Σ_m Σ_i per key column j, ``(B, K)``, over the real queries."""
    check_axis(axis)
    if axis == "key":
        return relevance_rows_into(call, grad_output, real_queries.float() * call.num_heads, real_queries, real_keys, shape)
    sums = _through_kernels(call, lambda fused: fused.positive_row_sums(call, grad_output, real_keys.float()).sum(dim=1))
    if sums is not None:
        return sums.masked_fill_(~real_queries, 0.0)
    sums = torch.zeros(real_queries.shape, device=real_queries.device, dtype=torch.float32)
    for heads, rows in call.blocks(shape, reached=live_rows(grad_output)):
        sums[:, rows] += _block(positive_row_sums, call, *_terms_of(call, grad_output, rows, heads, real_keys)).sum(dim=1)
    return sums.masked_fill_(~real_queries, 0.0)


def knockout_column_sums(
    call: KernelCall, grad_output: Tensor, real_queries: Tensor, real_keys: Tensor, shape: Shape
) -> Tensor:
    """``(B, K)`` Σ_m Σ_i of :func:`~captum_attention.maps.knockout.knockout_terms` per key
    column j over the real queries, the non-real keys' columns 0: one call's share of the
    first-order knockout effect of each key."""
    total = torch.zeros(real_keys.shape, device=real_keys.device, dtype=torch.float32)
    for heads, rows in call.blocks(shape, reached=live_rows(grad_output)):
        terms = knockout_terms(call.probs(rows, heads), call.grad_probs(grad_output, rows, heads))
        total[:, : terms.shape[-1]] += torch.einsum("bhrk,br->bk", terms, real_queries[:, rows].float())
    return total.masked_fill_(~real_keys, 0.0)


def segment_share_max(call: KernelCall, key_segments: Tensor, real_queries: Tensor, count: int, shape: Shape) -> Tensor:
    """:func:`~captum_attention.maps.knockout.segment_shares` ``(B, count)`` of the whole
    call, a self-attention's (its query rows are its keys, ``key_segments`` ``(B, K)``)."""
    largest = torch.zeros(len(key_segments), count, device=key_segments.device, dtype=torch.float32)
    for heads, rows in call.blocks(shape):
        block = segment_shares(call.probs(rows, heads), key_segments, key_segments[:, rows], real_queries[:, rows], count)
        torch.maximum(largest, block, out=largest)
    return largest


def key_bias_column_sums(bias_grad: Tensor, real_keys: Tensor) -> Tensor:
    """:func:`knockout_column_sums` ``(B, K)`` from the gradient ``(B, H / groups, K')`` of a
    zero bias on each key's logits (Σ over the query rows of dS/dlogits per key head, its
    query heads summed, which the kernel's own backward gives), the non-real keys' columns
    0: equal where the rows that are not real queries have no output gradient (the
    caller checks), so that the sum over every row is the sum over the real ones."""
    total = torch.zeros(real_keys.shape, device=real_keys.device, dtype=torch.float32)
    total[:, : bias_grad.shape[-1]] += bias_grad.float().sum(dim=1)
    return total.masked_fill_(~real_keys, 0.0)


def relevance_rows_into(
    call: KernelCall, grad_output: Tensor, row: Tensor, real_queries: Tensor, real_keys: Tensor, shape: Shape
) -> Tensor:
    """``row·Ā`` ``(B, K)`` for a row vector ``row`` over the call's queries, Ā =
    mean_m((G^m ⊙ A^m)^+) with the non-real keys' columns zeroed."""
    row = row.masked_fill(~real_queries, 0.0) / call.num_heads  # the head mean and the non-real queries, folded in
    through_kernels = _through_kernels(call, lambda fused: fused.weighted_column_sums(call, grad_output, row, real_keys.float()))
    if through_kernels is not None:
        return through_kernels
    total = torch.zeros(row.shape[0], call.num_keys, device=row.device, dtype=torch.float32)
    for heads, rows in call.blocks(shape, reached=row.ne(0) & live_rows(grad_output)):
        norm, terms = _block(exp_terms, call, *_terms_of(call, grad_output, rows, heads, real_keys))
        total[:, : terms.shape[-1]] += torch.matmul(row[:, None, None, rows] / norm[:, :, None], terms).sum(dim=(1, 2))
    return total


def relevance_row_step(call: KernelCall, grad_output: Tensor, row: Tensor, real: Tensor, shape: Shape) -> Tensor:
    """``row + row·Ā`` with Ā = mean_m((G^m ⊙ A^m)^+) of one layer: one step of the
    Transformer Attribution query row (later layers first)."""
    return row + relevance_rows_into(call, grad_output, row, real, real, shape)


def relevance_columns_into(call: KernelCall, grad_output: Tensor, columns: Tensor, real: Tensor, shape: Shape) -> Tensor:
    """``Ā·columns`` ``(B, T, m)`` for ``(B, T, m)`` column vectors, Ā = mean_m((G^m ⊙
    A^m)^+) with the non-real queries' rows and keys' columns zeroed."""
    products = torch.zeros_like(columns)
    for heads, rows in call.blocks(shape, reached=live_rows(grad_output)):
        norm, terms = _block(exp_terms, call, *_terms_of(call, grad_output, rows, heads, real))
        block = (torch.matmul(terms, columns[:, None, : terms.shape[-1]]) / norm[..., None]).sum(dim=1)
        products[:, rows] += (block / call.num_heads).masked_fill_(~real[:, rows, None], 0.0)  # head mean, real queries
    return products


def without_self_times(vector: Tensor, residual_times_vector: Tensor, residual_times_ones: Tensor) -> Tensor:
    """``R̄·x`` from ``(R - I)·x`` and ``(R - I)·1``, with R̄ = (R - I) rows normalised to
    sum 1, plus I (Chefer et al., eqs. 8-9; a row without relevance stays an identity
    row). The residuals are accumulated as such (never as R·x - x, whose float32
    difference loses relevances of order 1e-5)."""
    positive = residual_times_ones > 0
    normalised = residual_times_vector / residual_times_ones.clamp(min=torch.finfo(residual_times_ones.dtype).tiny)
    return vector + torch.where(positive, normalised, 0.0)


_HEAD_FUSIONS: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {
    "mean": (torch.sum, torch.add), "max": (torch.amax, torch.maximum), "min": (torch.amin, torch.minimum),
}
"""Per fusion: how one block of heads is reduced, and how two reductions combine."""


def _fused_blocks(
    call: KernelCall, shape: Shape, fusion: str, real_queries: Tensor, real_keys: Tensor, reached: Tensor | None = None
) -> Iterator[tuple[slice, Tensor]]:
    """``(rows, fuse_m(A^m) of those rows (B, r, key_span))`` per block of rows, the heads
    fused one block of heads at a time; pairs of a non-real query or key 0."""
    check_head_fusion(fusion)
    reduce, combine = _HEAD_FUSIONS[fusion]
    fused = None
    for heads, rows in call.blocks(shape, reached):
        probs = call.probs(rows, heads)
        part = probs[:, 0] if probs.shape[1] == 1 else reduce(probs, dim=1)
        fused = part if fused is None else combine(fused, part, out=fused)
        if heads.stop == call.num_heads:
            if fusion == "mean":
                fused.div_(call.num_heads)
            fused = _over_real_keys(fused[:, None], real_keys)[:, 0]
            queries = real_queries[:, rows]
            yield rows, fused if bool(queries.all()) else fused.masked_fill_(~queries[:, :, None], 0.0)
            fused = None


def rollout_row_step(call: KernelCall, row: Tensor, real: Tensor, fusion: str, shape: Shape) -> Tensor:
    """``row·Â`` with Â = 0.5·fuse_m(A^m) + 0.5·I, rows renormalised: one step of the
    rollout query row (later layers first), accumulated in float64 as
    :func:`~captum_attention.maps.common.propagate_query_row` does. ``row`` is ``(B, N)``,
    or ``(B, T, N)`` for T rows at once, which share one recomputation of each block."""
    if fusion == "mean" and row.dim() == 2:
        through_kernels = _through_kernels(
            call, lambda fused: _rollout_row_step_fused(fused, call, row, real), gradient=False, compilable=False
        )
        if through_kernels is not None:
            return through_kernels
    rows_at_once = row if row.dim() == 3 else row[:, None]
    step = torch.zeros_like(rows_at_once, dtype=torch.float64)
    for rows, fused in _fused_blocks(call, shape, fusion, real, real, reached=rows_at_once.abs().sum(dim=1)):
        fused.mul_(0.5)
        diagonal = torch.arange(rows.start, rows.stop, device=fused.device)
        fused[:, diagonal - rows.start, diagonal] += 0.5
        fused.div_(fused.sum(dim=-1, keepdim=True))
        step[..., : fused.shape[-1]] += torch.bmm(rows_at_once[..., rows].double(), fused.double())
    return step.to(row.dtype).reshape(row.shape)


def _rollout_row_step_fused(kernels: Any, call: KernelCall, row: Tensor, real: Tensor) -> Tensor:
    """:func:`rollout_row_step` of one row through the kernels: with s_i the head mean's
    weight on real keys (0 for a non-real query) and z_i = 0.5·s_i + 0.5 the
    renormaliser, ``row·Â = 0.5·Σ_i (row_i / z_i)·mean_m(A^m)_i + 0.5·row / z``."""
    key_weights = real.float()
    reached = kernels.row_sums(call, key_weights).mean(dim=1).masked_fill_(~real, 0.0)
    scaled = row.float() / (0.5 * reached + 0.5)
    columns = kernels.column_sums(call, scaled.masked_fill(~real, 0.0) / call.num_heads, key_weights)
    return (0.5 * columns + 0.5 * scaled).to(row.dtype)


def cross_rollout_row_step(
    call: KernelCall, source_row: Tensor, target_row: Tensor, real_targets: Tensor, real_sources: Tensor,
    fusion: str, shape: Shape,
) -> tuple[Tensor, Tensor]:
    """One cross-attention step of the joint-graph rollout query row (later layers first):
    target token i maps to (0.5·e_i + 0.5·fuse_m(A^m)_i) / z_i over [target | source], with
    z_i = 0.5 + 0.5·Σ_k fuse_m(A^m)_ik (see ``encoder_decoder_rollout``)."""
    source_step, target_step = source_row.clone(), target_row.clone()
    for rows, fused in _fused_blocks(call, shape, fusion, real_targets, real_sources):
        weight = target_row[:, rows] * 0.5 / (0.5 + 0.5 * fused.sum(dim=-1))
        target_step[:, rows] = weight
        source_step[:, : fused.shape[-1]] += torch.bmm(weight[:, None], fused)[:, 0]
    return source_step, target_step


def erased_output(call: KernelCall, erased: Tensor | None, heads: Sequence[int] | None, shape: Shape) -> Tensor:
    """The call's output ``(B, Q, H, Dv)`` with the ``erased`` keys ``(B, K)`` given a score
    of -inf on ``heads`` (default all; ``erased`` None: the call's own output, an explicit
    call's forward): through the Triton kernel in one pass where it takes the call, else
    by the model's kernel, or from the probabilities, one block of rows at a time
    (:meth:`~captum_attention.maps.kernel.KernelCall.erased_output`)."""
    erase = None if erased is None else call.erase_bias(erased, heads)
    output = _through_kernels(call, lambda fused: fused.erased_attention(call, erase), compilable=False)
    return call.erased_output(erase, shape) if output is None else output


def query_row(row_index: Tensor, num_tokens: int) -> Tensor:
    """``(B, T)`` float32 rows ``e_q`` (a span's weights): the start of a query-row
    propagation."""
    return query_weights(row_index, num_tokens)


def raw_attention_row(call: KernelCall, query_index: Tensor, real: Tensor, fusion: str = "mean") -> Tensor:
    """fuse_m(A^m) at each example's query row (a span's weighted sum of rows), ``(B, K)``,
    non-real keys zeroed."""
    return fuse_heads(call.rows_at(query_index)[:, :, None], fusion)[:, 0].masked_fill(~real, 0.0)
