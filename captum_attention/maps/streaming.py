"""The methods' reductions computed from recorded kernel calls, one block of query rows at a time.

Each function recomputes exactly the rows of ``A = softmax(Q·Kᵀ·s + mask)`` (and of
``dS/dA = dO·Vᵀ``) that it needs from a :class:`~captum_attention.capture.kernel.KernelCall`,
reduces them, and lets them go: no ``(heads, N, N)`` tensor is ever alive. Each equals the
method's formula on the full maps (``grad_sam``, ``transformer_attribution``, ``rollout``,
``raw``): the reductions are sums over heads and keys of the same entries, and the query-row
products of ``propagate_query_row`` are taken one block of rows at a time.

``real_queries`` / ``real_keys`` are ``(B, Q)`` / ``(B, K)`` bool; the pairs outside them
are zeroed as ``mask_padding`` zeroes them.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import Tensor

from ..capture.kernel import KernelCall
from .common import fuse_heads


Shape = tuple[int, int]
"""``(heads, rows)`` per block (:func:`~captum_attention.capture.kernel.block_shape`)."""


def _over_real_keys(block: Tensor, real_keys: Tensor) -> Tensor:
    """``block`` ``(B, h, r, k)`` with the columns of non-real keys zeroed."""
    keys = real_keys[:, : block.shape[-1]]
    return block if bool(keys.all()) else block.masked_fill_(~keys[:, None, None, :], 0.0)


def grad_sam_row_sums(
    call: KernelCall, grad_output: Tensor, real_queries: Tensor, real_keys: Tensor, shape: Shape, axis: str = "query"
) -> Tensor:
    """Σ_m Σ_j A^m_ij·ReLU(G^m_ij) per query row i, ``(B, Q)``: one layer's Grad-SAM sums;
    with ``axis="key"`` Σ_m Σ_i per key column j, ``(B, K)``, over the real queries."""
    by_key = axis == "key"
    sums = torch.zeros(real_keys.shape if by_key else real_queries.shape, device=real_queries.device)
    for heads, rows in call.blocks(shape):
        weighted = _over_real_keys(call.grad_probs(grad_output, rows, heads).clamp_(min=0).mul_(call.probs(rows, heads)), real_keys)
        if by_key:
            weighted.masked_fill_(~real_queries[:, None, rows, None], 0.0)
            sums[:, : weighted.shape[-1]] += weighted.sum(dim=(1, 2))
        else:
            sums[:, rows] += weighted.sum(dim=(1, 3))
    return sums if by_key else sums.masked_fill_(~real_queries, 0.0)


def _relevance(call: KernelCall, grad_output: Tensor, rows: slice, heads: slice, real_keys: Tensor) -> Tensor:
    """``(G^m ⊙ A^m)^+`` of the rows ``rows`` and heads ``heads``, ``(B, h, r, key_span)``,
    non-real keys 0: the terms of Ā = mean_m((G^m ⊙ A^m)^+)."""
    relevance = call.grad_probs(grad_output, rows, heads).mul_(call.probs(rows, heads)).clamp_(min=0)
    return _over_real_keys(relevance, real_keys)


def relevance_rows_into(
    call: KernelCall, grad_output: Tensor, row: Tensor, real_queries: Tensor, real_keys: Tensor, shape: Shape
) -> Tensor:
    """``row·Ā`` ``(B, K)`` for a row vector ``row`` over the call's queries."""
    total = torch.zeros(row.shape[0], call.num_keys, device=row.device)
    row = row.masked_fill(~real_queries, 0.0) / call.heads  # the head mean and the non-real queries, folded in
    for heads, rows in call.blocks(shape, reached=row):
        relevance = _relevance(call, grad_output, rows, heads, real_keys)
        total[:, : relevance.shape[-1]] += torch.matmul(row[:, None, None, rows], relevance).sum(dim=(1, 2))
    return total


def relevance_row_step(call: KernelCall, grad_output: Tensor, row: Tensor, real: Tensor, shape: Shape) -> Tensor:
    """``row + row·Ā`` with Ā = mean_m((G^m ⊙ A^m)^+) of one layer: one step of the
    Transformer Attribution query row (later layers first)."""
    return row + relevance_rows_into(call, grad_output, row, real, real, shape)


def relevance_column_step(call: KernelCall, grad_output: Tensor, columns: Tensor, real: Tensor, shape: Shape) -> Tensor:
    """``columns + Ā·columns`` for ``(B, T, m)`` column vectors: one step of R·x
    (earlier layers first)."""
    step = columns.clone()
    for heads, rows in call.blocks(shape):
        relevance = _relevance(call, grad_output, rows, heads, real)
        products = torch.matmul(relevance, columns[:, None, : relevance.shape[-1]]).sum(dim=1)
        step[:, rows] += (products / call.heads).masked_fill_(~real[:, rows, None], 0.0)  # head mean, real queries
    return step


def without_self_times(vector: Tensor, relevance_times_vector: Tensor, relevance_times_ones: Tensor) -> Tensor:
    """``R̄·x`` from ``R·x`` and ``R·1``, with R̄ = (R - I) rows normalised to sum 1, plus I
    (Chefer et al., eqs. 8-9; a row without relevance stays an identity row)."""
    row_sums = relevance_times_ones - 1
    normalised = (relevance_times_vector - vector) / row_sums.clamp(min=torch.finfo(row_sums.dtype).tiny)
    return vector + torch.where(row_sums > 0, normalised, 0.0)


_HEAD_FUSIONS: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {
    "mean": (torch.sum, torch.add), "max": (torch.amax, torch.maximum), "min": (torch.amin, torch.minimum),
}
"""Per fusion: how one block of heads is reduced, and how two reductions combine."""


def _fused_blocks(
    call: KernelCall, shape: Shape, fusion: str, real_queries: Tensor, real_keys: Tensor, reached: Tensor | None = None
) -> Iterator[tuple[slice, Tensor]]:
    """``(rows, fuse_m(A^m) of those rows (B, r, key_span))`` per block of rows, the heads
    fused one block of heads at a time; pairs of a non-real query or key 0."""
    reduce, combine = _HEAD_FUSIONS[fusion]
    fused = None
    for heads, rows in call.blocks(shape, reached):
        probs = call.probs(rows, heads)
        part = probs[:, 0] if probs.shape[1] == 1 else reduce(probs, dim=1)
        fused = part if fused is None else combine(fused, part, out=fused)
        if heads.stop == call.heads:
            if fusion == "mean":
                fused.div_(call.heads)
            fused = _over_real_keys(fused[:, None], real_keys)[:, 0]
            queries = real_queries[:, rows]
            yield rows, fused if bool(queries.all()) else fused.masked_fill_(~queries[:, :, None], 0.0)
            fused = None


def rollout_row_step(call: KernelCall, row: Tensor, real: Tensor, fusion: str, shape: Shape) -> Tensor:
    """``row·Â`` with Â = 0.5·fuse_m(A^m) + 0.5·I, rows renormalised: one step of the
    rollout query row (later layers first)."""
    step = torch.zeros_like(row)
    for rows, fused in _fused_blocks(call, shape, fusion, real, real, reached=row):
        fused.mul_(0.5)
        diagonal = torch.arange(rows.start, rows.stop, device=fused.device)
        fused[:, diagonal - rows.start, diagonal] += 0.5
        fused.div_(fused.sum(dim=-1, keepdim=True))
        step[:, : fused.shape[-1]] += torch.bmm(row[:, None, rows], fused)[:, 0]
    return step


def cross_rollout_row_step(
    call: KernelCall, source_row: Tensor, target_row: Tensor, real_targets: Tensor, real_sources: Tensor,
    fusion: str, shape: Shape,
) -> tuple[Tensor, Tensor]:
    """One cross-attention step of the joint-graph rollout query row (later layers first):
    target token i maps to (0.5·e_i + 0.5·fuse_m(A^m)_i) / z_i over [target | source], with
    z_i = 0.5 + 0.5·Σ_k fuse_m(A^m)_{ik} (see ``encoder_decoder_rollout``)."""
    source_step, target_step = source_row.clone(), target_row.clone()
    for rows, fused in _fused_blocks(call, shape, fusion, real_targets, real_sources):
        weight = target_row[:, rows] * 0.5 / (0.5 + 0.5 * fused.sum(dim=-1))
        target_step[:, rows] = weight
        source_step[:, : fused.shape[-1]] += torch.bmm(weight[:, None], fused)[:, 0]
    return source_step, target_step


def query_row(row_index: Tensor, num_tokens: int) -> Tensor:
    """``(B, T)`` float32 one-hot rows ``e_q``: the start of a query-row propagation."""
    row = torch.zeros(len(row_index), num_tokens, device=row_index.device)
    row[torch.arange(len(row_index), device=row_index.device), row_index] = 1.0
    return row


def raw_attention_row(call: KernelCall, query_index: Tensor, real: Tensor, fusion: str = "mean") -> Tensor:
    """fuse_m(A^m) at each example's query row, ``(B, K)``, non-real keys zeroed."""
    return fuse_heads(call.rows_at(query_index)[:, :, None], fusion)[:, 0].masked_fill(~real, 0.0)
