"""Triton kernels for the streaming block reductions: flash-style, one program per block of
query rows of one head, the logits recomputed in on-chip memory and never stored.

Each program recomputes the probabilities ``P = exp(S - m) / l`` and ``G = dO·Vᵀ`` one
block of keys at a time and reduces ``P ⊙ ReLU(G)``, or ``P`` alone (times the real keys'
weights): row sums in one pass over the keys with an online softmax (the sum so far
rescaled whenever a row's maximum logit m grows, and divided by its normaliser l at the
end), column sums in two (m and l first, as a flash attention backward takes them, since
every term of a column needs them):

- :func:`positive_row_sums`: ``Σ_j (P ⊙ G⁺)_ij`` per query row and head, Grad-SAM's sums;
- :func:`weighted_column_sums`: ``Σ_h Σ_i w_i (P ⊙ G⁺)_ij`` per key, the row-vector step of
  Transformer Attribution and Grad-SAM's key axis;
- :func:`row_sums` and :func:`column_sums`: the same of ``P``, the rollout row's step;
- :func:`erased_attention`: erasure's output ``softmax(S + e)·V`` (``e`` -inf on the erased
  keys) in one pass with an online softmax, as a flash attention forward.

Under the kernel's causal flag a block of query rows stops at the key of its last row.

They compute what :func:`~captum_attention.maps.streaming.exp_terms` computes from a
:class:`~captum_attention.maps.kernel.KernelCall`: grouped-query heads, the kernel's
causal flag, a boolean or additive mask broadcast over ``(B, H, Q, K)``, and the scale.
A logit softcap (Gemma-2) is applied to each tile's logits, a sink logit per head
(gpt-oss) starts each row's online softmax. Calls with a position bias (T5) are not
handled (:func:`supports`). ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors, exactly and
slowly: how the tests check them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernel import KernelCall

try:
    import triton
    import triton.language as tl
    from triton.errors import TritonError
    from triton.runtime.errors import InterpreterError
except ImportError:  # pragma: no cover - triton is optional
    triton = None


@dataclass(frozen=True)
class Tiles:
    """How a kernel is launched: ``rows`` query rows per program, ``keys`` keys per step
    over them, and Triton's ``warps`` and pipeline ``stages``."""

    rows: int
    keys: int
    warps: int = 4
    stages: int = 2


TILES = {"cuda": Tiles(64, 64, 4, 2), "cpu": Tiles(32, 32)}
"""The launch per device. On CUDA 64 rows × 64 keys, 4 warps, 2 stages: of the five
shapes ``benchmarks/gpu_check.py``'s ``kernel_tiles`` timed on an H200 (one bf16 layer of
Llama-3.2-1B's shape at 16k tokens) the fastest or within 8% of it for the row sums,
column sums and erasure, 17% behind 128 × 32 for rollout's column sums; on the CPU
(Triton's interpreter, the tests) small tiles, which several key steps cross."""


def available() -> bool:
    """Whether triton is installed."""
    return triton is not None


def failed_to_launch(error: BaseException) -> bool:
    """Whether ``error`` is Triton refusing to compile or launch a kernel on a device (a
    card without the instructions, too little shared memory), after which the block
    reductions take over; not an error of the interpreter, which the tests must see."""
    return triton is not None and isinstance(error, TritonError) and not isinstance(error, InterpreterError)


def supports(call: KernelCall, gradient: bool = True) -> bool:
    """Whether the kernels compute this call exactly: no position bias, a mask (if any) of
    four dimensions broadcastable to ``(B, H, Q, K)``, and for the gradient kernels the
    values (a capture without gradients keeps none)."""
    return (
        call.position_bias is None and (call.value is not None or not gradient)
        and (call.mask is None or call.mask.dim() == 4) and not math.isnan(call.scale)
    )


def _mask_operand(call: KernelCall) -> tuple[Tensor, tuple[int, int, int, int], int]:
    """The mask as the kernels read it: the tensor, its strides over ``(B, H, Q, K)``
    (0 where broadcast) and its kind (0 none, 1 boolean keep-mask, 2 additive)."""
    if call.mask is None:
        return call.query, (0, 0, 0, 0), 0
    mask = call.mask
    strides = tuple(0 if size == 1 else stride for size, stride in zip(mask.shape, mask.stride()))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), strides, 1  # type: ignore[return-value]
    return mask, strides, 2  # type: ignore[return-value]


if triton is not None:

    @triton.jit
    def _logits(q, k_ptr, key_ok, mask_ptr, mask_row, rows, keys, scale, softcap, mask_stride_q, mask_stride_k, head_dim,
                MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, D: tl.constexpr,
                PRECISION: tl.constexpr, stride_kk, stride_kd):
        """One (rows × keys) tile of logits in float32 (capped to ``softcap·tanh(S / softcap)``
        with ``SOFTCAP``), -inf where a key is masked."""
        dims = tl.arange(0, D)
        k = tl.load(k_ptr + keys[None, :] * stride_kk + dims[:, None] * stride_kd,
                    mask=key_ok[None, :] & (dims[:, None] < head_dim), other=0.0)
        s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION).to(tl.float32) * scale
        if SOFTCAP:  # tanh from exp(-2|x|), exact to rounding near 0 and at large |x|
            small = tl.exp(-2.0 * tl.abs(s / softcap))
            tanh = (1.0 - small) / (1.0 + small)
            s = softcap * tl.where(s < 0, -tanh, tanh)
        valid = key_ok[None, :]
        if CAUSAL:
            valid = valid & (keys[None, :] <= rows[:, None])
        if MASK_KIND == 1:
            keep = tl.load(mask_ptr + mask_row[:, None] * mask_stride_q + keys[None, :] * mask_stride_k, mask=valid, other=0)
            valid = valid & (keep != 0)
        if MASK_KIND == 2:
            bias = tl.load(mask_ptr + mask_row[:, None] * mask_stride_q + keys[None, :] * mask_stride_k, mask=valid, other=0.0)
            s = s + bias.to(tl.float32)
        return tl.where(valid, s, float("-inf"))

    @triton.jit
    def _program_rows(num_queries, num_heads, groups, BLOCK_M: tl.constexpr):
        """This program's block of rows, example, query head and key head, and which of
        its rows exist."""
        program_bh, program_m = tl.program_id(0), tl.program_id(1)
        b, h = program_bh // num_heads, program_bh % num_heads
        rows = program_m * BLOCK_M + tl.arange(0, BLOCK_M)
        return program_m, b, h, h // groups, rows, rows < num_queries

    @triton.jit
    def _query_tile(q_ptr, b, h, rows, row_ok, head_dim, stride_qb, stride_qh, stride_qq, stride_qd, D: tl.constexpr):
        """The block's queries ``(rows, D)``, zero beyond the head dimension."""
        dims = tl.arange(0, D)
        return tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qq + dims[None, :] * stride_qd,
                       mask=row_ok[:, None] & (dims[None, :] < head_dim), other=0.0)

    @triton.jit
    def _key_end(program_m, num_keys, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
        """How many keys the block of rows ``program_m`` reads: under the causal flag, those
        up to its last row (the later ones are masked for all its rows)."""
        end = num_keys
        if CAUSAL:
            end = tl.minimum(num_keys, (program_m + 1) * BLOCK_M)
        return end

    @triton.jit
    def _softmax_start(sinks_ptr, h, BLOCK_M: tl.constexpr, SINKS: tl.constexpr):
        """An online softmax before any key: no logit yet, or with ``SINKS`` the head's sink
        logit as the largest so far and its ``exp(0) = 1`` in the normaliser."""
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        norm = tl.zeros([BLOCK_M], tl.float32)
        if SINKS:
            top = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32)
            norm = norm + 1.0
        return top, norm

    @triton.jit
    def _online_step(top, s):
        """One tile of an online softmax: the rows' new largest logit, the factor on what
        was summed under the old one, and the tile's ``exp(s - largest)`` (0 in a row
        without a key yet)."""
        new_top = tl.maximum(top, tl.max(s, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        rescale = tl.exp(tl.where(top == float("-inf"), float("-inf"), top - shift))
        return new_top, rescale, tl.exp(s - shift[:, None])

    @triton.jit
    def _key_factor(grad, v_base, key_weights_ptr, keys, key_ok, value_dim, stride_vk, stride_vd,
                    DV: tl.constexpr, GRADIENT: tl.constexpr, PRECISION: tl.constexpr):
        """What multiplies a key tile's probabilities: the keys' weights, times ReLU(dO·Vᵀ)
        for the gradient sums."""
        factor = tl.load(key_weights_ptr + keys, mask=key_ok, other=0.0)[None, :]
        if GRADIENT:
            value_dims = tl.arange(0, DV)
            v = tl.load(v_base + keys[None, :] * stride_vk + value_dims[:, None] * stride_vd,
                        mask=key_ok[None, :] & (value_dims[:, None] < value_dim), other=0.0)
            factor = factor * tl.maximum(tl.dot(grad, v.to(grad.dtype), input_precision=PRECISION).to(tl.float32), 0.0)
        return factor

    @triton.jit
    def _reduce_block(
        q_ptr, k_ptr, v_ptr, do_ptr, mask_ptr, sinks_ptr, weights_ptr, key_weights_ptr, out_ptr,
        num_queries, num_keys, num_heads, groups, scale, softcap, head_dim, value_dim,
        stride_qb, stride_qh, stride_qq, stride_qd,
        stride_kb, stride_kh, stride_kk, stride_kd,
        stride_vb, stride_vh, stride_vk, stride_vd,
        stride_ob, stride_oq, stride_oh, stride_od,
        stride_mb, stride_mh, stride_mq, stride_mk,
        stride_wb, stride_kwb,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
        COLUMNS: tl.constexpr, GRADIENT: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Row sums of ``P ⊙ F`` (``F`` the keys' weights, times ReLU(dO·Vᵀ) with
        ``GRADIENT``) in one pass with an online softmax; or with ``COLUMNS`` their column
        sums weighted by the rows' weights, in two passes (the rows' softmax statistics,
        then the terms)."""
        program_m, b, h, kv, rows, row_ok = _program_rows(num_queries, num_heads, groups, BLOCK_M)
        value_dims = tl.arange(0, DV)
        q = _query_tile(q_ptr, b, h, rows, row_ok, head_dim, stride_qb, stride_qh, stride_qq, stride_qd, D)
        grad = q  # not read without GRADIENT
        if GRADIENT:
            grad = tl.load(do_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_oq + value_dims[None, :] * stride_od,
                           mask=row_ok[:, None] & (value_dims[None, :] < value_dim), other=0.0)
        k_base = k_ptr + b * stride_kb + kv * stride_kh
        v_base = v_ptr + b * stride_vb + kv * stride_vh
        key_weights_base = key_weights_ptr + b * stride_kwb
        mask_base = mask_ptr + b * stride_mb + h * stride_mh
        mask_row = tl.where(row_ok, rows, 0)
        key_end = _key_end(program_m, num_keys, BLOCK_M, CAUSAL)
        top, norm = _softmax_start(sinks_ptr, h, BLOCK_M, SINKS)
        sums = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, key_end, BLOCK_N):  # rows: the sums; columns: the statistics
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < num_keys
            s = _logits(q, k_base, key_ok, mask_base, mask_row, rows, keys, scale, softcap, stride_mq, stride_mk, head_dim,
                        MASK_KIND, CAUSAL, SOFTCAP, D, PRECISION, stride_kk, stride_kd)
            top, rescale, p = _online_step(top, s)
            norm = norm * rescale + tl.sum(p, axis=1)
            if not COLUMNS:
                factor = _key_factor(grad, v_base, key_weights_base, keys, key_ok, value_dim, stride_vk, stride_vd,
                                     DV, GRADIENT, PRECISION)
                sums = sums * rescale + tl.sum(p * factor, axis=1)
        inverse = tl.where(norm > 0, 1.0 / norm, 0.0)
        if not COLUMNS:
            tl.store(out_ptr + (b * num_heads + h) * num_queries + rows, sums * inverse, mask=row_ok)
        else:
            shift = tl.where(top == float("-inf"), 0.0, top)
            inverse = inverse * tl.load(weights_ptr + b * stride_wb + rows, mask=row_ok, other=0.0)
            for start in range(0, key_end, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                key_ok = keys < num_keys
                s = _logits(q, k_base, key_ok, mask_base, mask_row, rows, keys, scale, softcap, stride_mq, stride_mk,
                            head_dim, MASK_KIND, CAUSAL, SOFTCAP, D, PRECISION, stride_kk, stride_kd)
                factor = _key_factor(grad, v_base, key_weights_base, keys, key_ok, value_dim, stride_vk, stride_vd,
                                     DV, GRADIENT, PRECISION)
                terms = tl.exp(s - shift[:, None]) * inverse[:, None] * factor
                tl.atomic_add(out_ptr + b * num_keys + keys, tl.sum(terms, axis=0), mask=key_ok)

    @triton.jit
    def _erased_forward(
        q_ptr, k_ptr, v_ptr, mask_ptr, sinks_ptr, erase_ptr, out_ptr,
        num_queries, num_keys, num_heads, groups, scale, softcap, head_dim, value_dim,
        stride_qb, stride_qh, stride_qq, stride_qd,
        stride_kb, stride_kh, stride_kk, stride_kd,
        stride_vb, stride_vh, stride_vk, stride_vd,
        stride_ob, stride_oq, stride_oh, stride_od,
        stride_mb, stride_mh, stride_mq, stride_mk,
        stride_eb, stride_eh,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_KIND: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
        ERASE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """The call's output with ``erase`` (0 or -inf per key; with ``ERASE``) added to
        every logit: one pass over the keys with an online softmax, as a flash attention
        forward."""
        program_m, b, h, kv, rows, row_ok = _program_rows(num_queries, num_heads, groups, BLOCK_M)
        value_dims = tl.arange(0, DV)
        q = _query_tile(q_ptr, b, h, rows, row_ok, head_dim, stride_qb, stride_qh, stride_qq, stride_qd, D)
        k_base = k_ptr + b * stride_kb + kv * stride_kh
        v_base = v_ptr + b * stride_vb + kv * stride_vh
        mask_base = mask_ptr + b * stride_mb + h * stride_mh
        mask_row = tl.where(row_ok, rows, 0)
        top, norm = _softmax_start(sinks_ptr, h, BLOCK_M, SINKS)
        acc = tl.zeros([BLOCK_M, DV], tl.float32)
        key_end = _key_end(program_m, num_keys, BLOCK_M, CAUSAL)
        for start in range(0, key_end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < num_keys
            s = _logits(q, k_base, key_ok, mask_base, mask_row, rows, keys, scale, softcap, stride_mq, stride_mk, head_dim,
                        MASK_KIND, CAUSAL, SOFTCAP, D, PRECISION, stride_kk, stride_kd)
            if ERASE:
                s = s + tl.load(erase_ptr + b * stride_eb + h * stride_eh + keys, mask=key_ok, other=0.0)[None, :]
            top, rescale, p = _online_step(top, s)
            v = tl.load(v_base + keys[:, None] * stride_vk + value_dims[None, :] * stride_vd,
                        mask=key_ok[:, None] & (value_dims[None, :] < value_dim), other=0.0)
            norm = norm * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        out = acc / tl.where(norm > 0, norm, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_oq + h * stride_oh + value_dims[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (value_dims[None, :] < value_dim))

def _launch(call: KernelCall, grad_output: Tensor | None, key_weights: Tensor, row_weights: Tensor | None) -> Tensor:
    gradient = grad_output is not None
    assert triton is not None and supports(call, gradient)
    batch, heads, queries, dim = call.query.shape
    value = call.value if call.value is not None else call.key  # not read without a gradient
    keys, value_dim = call.num_keys, value.shape[-1]
    columns = row_weights is not None
    out = torch.zeros((batch, keys) if columns else (batch, heads, queries), dtype=torch.float32, device=call.query.device)
    mask, mask_strides, mask_kind = _mask_operand(call)
    output_grad = grad_output if grad_output is not None else call.query.transpose(1, 2)  # not read: any (B, Q, H, D) tensor
    query, key, value, output_grad = _operands(call.query, call.key, value, output_grad)
    key_weights = key_weights.float().expand(batch, keys).contiguous()
    weights = row_weights.float().contiguous() if columns else key_weights  # type: ignore[union-attr]
    tiles = _tiles(call)
    sinks, softcap, flags = _cap_and_sinks(call)
    _reduce_block[(batch * heads, triton.cdiv(queries, tiles.rows))](
        query, key, value, output_grad, mask, sinks, weights, key_weights, out,
        queries, keys, heads, heads // key.shape[1], call.scale, softcap, dim, value_dim,
        *query.stride(), *key.stride(), *value.stride(), *output_grad.stride(), *mask_strides,
        weights.stride(0), key_weights.stride(0),
        D=_dim_tile(dim), DV=_dim_tile(value_dim), BLOCK_M=tiles.rows, BLOCK_N=tiles.keys,
        MASK_KIND=mask_kind, CAUSAL=call.causal, COLUMNS=columns, GRADIENT=gradient,
        PRECISION=_precision(query.dtype), num_warps=tiles.warps, num_stages=tiles.stages, **flags,
    )
    return out


def _cap_and_sinks(call: KernelCall) -> tuple[Tensor, float, dict[str, bool]]:
    """The sinks as the kernels read them (a float32 per head; any tensor, unread, without
    them), the softcap (1, unread, without one) and the kernels' flags for both."""
    sinks = call.query if call.sinks is None else call.sinks.float().reshape(-1).contiguous()
    return sinks, call.softcap or 1.0, {"SOFTCAP": call.softcap is not None, "SINKS": call.sinks is not None}


def _tiles(call: KernelCall) -> Tiles:
    return TILES["cpu" if call.query.device.type == "cpu" else "cuda"]


def _operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as the kernels multiply them: float64 in float32 (no float64 dot), and
    half types too under the interpreter, whose products of half types are wrong (triton 3.9)."""
    dtype = tensors[0].dtype
    if dtype == torch.float64 or (dtype != torch.float32 and _interpreted()):
        return tuple(t.float() for t in tensors)
    return tensors


def _precision(dtype: torch.dtype) -> str | None:
    """float32 products exactly; half types on tensor cores."""
    return "ieee" if dtype == torch.float32 else None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dim_tile(size: int) -> int:
    """A head dimension's tile: the next power of two, at least 16 (the products' least
    size); the dimensions beyond ``size`` load as zeros."""
    return max(16, triton.next_power_of_2(size))


def positive_row_sums(call: KernelCall, grad_output: Tensor, key_weights: Tensor) -> Tensor:
    """``Σ_j (P ⊙ ReLU(G))_ij · key_weights_j`` ``(B, H, Q)`` float32 for every head and query
    row of ``call``; ``grad_output`` is dS/dO ``(B, Q, H, Dv)``, ``key_weights`` ``(B, K)``."""
    return _launch(call, grad_output, key_weights, None)


def weighted_column_sums(call: KernelCall, grad_output: Tensor, row_weights: Tensor, key_weights: Tensor) -> Tensor:
    """``Σ_h Σ_i row_weights_i (P ⊙ ReLU(G))_ij · key_weights_j`` ``(B, K)`` float32;
    ``row_weights`` ``(B, Q)`` (the same for every head)."""
    return _launch(call, grad_output, key_weights, row_weights)


def row_sums(call: KernelCall, key_weights: Tensor) -> Tensor:
    """``Σ_j P_ij · key_weights_j`` ``(B, H, Q)`` float32 for every head and query row."""
    return _launch(call, None, key_weights, None)


def column_sums(call: KernelCall, row_weights: Tensor, key_weights: Tensor) -> Tensor:
    """``Σ_h Σ_i row_weights_i P_ij · key_weights_j`` ``(B, K)`` float32."""
    return _launch(call, None, key_weights, row_weights)


def erased_attention(call: KernelCall, erase: Tensor | None) -> Tensor:
    """The call's output ``(B, Q, H, Dv)`` (in its dtype) with ``erase`` ``(B, H or 1, 1,
    K)`` added to every logit: -inf on an erased key, 0 elsewhere (None: nothing erased,
    the call's own output); 0 in a row left without keys. What
    :meth:`~captum_attention.maps.kernel.KernelCall.erased_output` computes, in one pass
    over the keys (no mask of ``rows × keys`` is built)."""
    assert triton is not None and supports(call)
    batch, heads, queries, dim = call.query.shape
    value_dim = call.value.shape[-1]  # type: ignore[union-attr]
    out = torch.empty(batch, queries, heads, value_dim, dtype=call.query.dtype, device=call.query.device)
    query, key, value = _operands(call.query, call.key, call.value)  # type: ignore[arg-type]
    mask, mask_strides, mask_kind = _mask_operand(call)
    erase = call.query if erase is None else erase[:, :, 0].float().contiguous()  # unread without an erasure
    erase_strides = tuple(0 if size == 1 else stride for size, stride in zip(erase.shape[:2], erase.stride()[:2]))
    tiles = _tiles(call)
    sinks, softcap, flags = _cap_and_sinks(call)
    _erased_forward[(batch * heads, triton.cdiv(queries, tiles.rows))](
        query, key, value, mask, sinks, erase, out,
        queries, call.num_keys, heads, heads // key.shape[1], call.scale, softcap, dim, value_dim,
        *query.stride(), *key.stride(), *value.stride(), *out.stride(), *mask_strides, *erase_strides,
        D=_dim_tile(dim), DV=_dim_tile(value_dim), BLOCK_M=tiles.rows, BLOCK_N=tiles.keys,
        MASK_KIND=mask_kind, CAUSAL=call.causal, ERASE=erase is not call.query, PRECISION=_precision(query.dtype),
        num_warps=tiles.warps, num_stages=tiles.stages, **flags,
    )
    return out
