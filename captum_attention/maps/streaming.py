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

from typing import Iterator

import torch
from torch import Tensor

from ..capture.kernel import KernelCall
from .common import fuse_heads


def _blocks(call: KernelCall, rows_per_block: int) -> Iterator[slice]:
    for start in range(0, call.num_queries, rows_per_block):
        yield slice(start, min(start + rows_per_block, call.num_queries))


def _only_real_pairs(block_map: Tensor, real_queries: Tensor, real_keys: Tensor, rows: slice) -> Tensor:
    """``block_map`` ``(B, r, k)`` with the pairs of a non-real query (of ``rows``) or key zeroed."""
    queries, keys = real_queries[:, rows], real_keys[:, : block_map.shape[-1]]
    if bool(queries.all()) and bool(keys.all()):
        return block_map
    return block_map.mul_((queries[:, :, None] & keys[:, None, :]).to(block_map.dtype))


def _add_row_times_block(total: Tensor, row: Tensor, rows: slice, block_map: Tensor) -> None:
    """``total[:, :k] += row[:, rows] @ block_map`` for ``block_map`` ``(B, r, k)``."""
    total[:, : block_map.shape[-1]] += torch.bmm(row[:, None, rows], block_map)[:, 0]


def grad_sam_row_sums(
    call: KernelCall, grad_output: Tensor, real_queries: Tensor, real_keys: Tensor, rows_per_block: int
) -> Tensor:
    """Σ_m Σ_j A^m_ij·ReLU(G^m_ij) per query row i, ``(B, Q)``: one layer's Grad-SAM sums."""
    sums = []
    for rows in _blocks(call, rows_per_block):
        weighted = call.grad_probs(grad_output, rows).clamp_(min=0).mul_(call.probs(rows)).sum(dim=1)
        sums.append(_only_real_pairs(weighted, real_queries, real_keys, rows).sum(dim=-1))
    return torch.cat(sums, dim=1)


def _relevance_block(call: KernelCall, grad_output: Tensor, rows: slice, real_queries: Tensor, real_keys: Tensor) -> Tensor:
    """Rows ``rows`` of Ā = mean_m((G^m ⊙ A^m)^+), ``(B, r, key_span)``, non-real pairs 0."""
    relevance = call.grad_probs(grad_output, rows).mul_(call.probs(rows)).clamp_(min=0).mean(dim=1)
    return _only_real_pairs(relevance, real_queries, real_keys, rows)


def relevance_rows_into(
    call: KernelCall, grad_output: Tensor, row: Tensor, real_queries: Tensor, real_keys: Tensor, rows_per_block: int
) -> Tensor:
    """``row·Ā`` ``(B, K)`` for a row vector ``row`` over the call's queries."""
    total = torch.zeros(row.shape[0], call.num_keys, device=row.device)
    for rows in _blocks(call, rows_per_block):
        if bool(row[:, rows].any()):  # rows the vector does not reach contribute nothing
            _add_row_times_block(total, row, rows, _relevance_block(call, grad_output, rows, real_queries, real_keys))
    return total


def relevance_row_step(
    call: KernelCall, grad_output: Tensor, row: Tensor, real: Tensor, rows_per_block: int
) -> Tensor:
    """``row + row·Ā`` with Ā = mean_m((G^m ⊙ A^m)^+) of one layer: one step of the
    Transformer Attribution query row (later layers first)."""
    return row + relevance_rows_into(call, grad_output, row, real, real, rows_per_block)


def relevance_column_step(
    call: KernelCall, grad_output: Tensor, columns: Tensor, real: Tensor, rows_per_block: int
) -> Tensor:
    """``columns + Ā·columns`` for ``(B, T, m)`` column vectors: one step of R·x
    (earlier layers first)."""
    step = columns.clone()
    for rows in _blocks(call, rows_per_block):
        block = _relevance_block(call, grad_output, rows, real, real)
        step[:, rows] += torch.bmm(block, columns[:, : block.shape[-1]])
    return step


def without_self_times(vector: Tensor, relevance_times_vector: Tensor, relevance_times_ones: Tensor) -> Tensor:
    """``R̄·x`` from ``R·x`` and ``R·1``, with R̄ = (R - I) rows normalised to sum 1, plus I
    (Chefer et al., eqs. 8-9; a row without relevance stays an identity row)."""
    row_sums = relevance_times_ones - 1
    normalised = (relevance_times_vector - vector) / row_sums.clamp(min=torch.finfo(row_sums.dtype).tiny)
    return vector + torch.where(row_sums > 0, normalised, 0.0)


def rollout_row_step(call: KernelCall, row: Tensor, real: Tensor, fusion: str, rows_per_block: int) -> Tensor:
    """``row·Â`` with Â = 0.5·fuse_m(A^m) + 0.5·I, rows renormalised: one step of the
    rollout query row (later layers first)."""
    step = torch.zeros_like(row)
    for rows in _blocks(call, rows_per_block):
        if not bool(row[:, rows].any()):
            continue
        fused = _only_real_pairs(fuse_heads(call.probs(rows), fusion), real, real, rows).mul_(0.5)
        diagonal = torch.arange(rows.start, rows.stop, device=fused.device)
        fused[:, diagonal - rows.start, diagonal] += 0.5
        _add_row_times_block(step, row, rows, fused.div_(fused.sum(dim=-1, keepdim=True)))
    return step


def cross_rollout_row_step(
    call: KernelCall, source_row: Tensor, target_row: Tensor, real_targets: Tensor, real_sources: Tensor,
    fusion: str, rows_per_block: int,
) -> tuple[Tensor, Tensor]:
    """One cross-attention step of the joint-graph rollout query row (later layers first):
    target token i maps to (0.5·e_i + 0.5·fuse_m(A^m)_i) / z_i over [target | source], with
    z_i = 0.5 + 0.5·Σ_k fuse_m(A^m)_{ik} (see ``encoder_decoder_rollout``)."""
    source_step, target_step = source_row.clone(), target_row.clone()
    for rows in _blocks(call, rows_per_block):
        fused = _only_real_pairs(fuse_heads(call.probs(rows), fusion), real_targets, real_sources, rows)
        weight = target_row[:, rows] * 0.5 / (0.5 + 0.5 * fused.sum(dim=-1))
        target_step[:, rows] = weight
        _add_row_times_block(source_step, weight, slice(0, weight.shape[1]), fused)
    return source_step, target_step


def query_row(row_index: Tensor, num_tokens: int) -> Tensor:
    """``(B, T)`` float32 one-hot rows ``e_q``: the start of a query-row propagation."""
    row = torch.zeros(len(row_index), num_tokens, device=row_index.device)
    row[torch.arange(len(row_index), device=row_index.device), row_index] = 1.0
    return row


def raw_attention_row(call: KernelCall, query_index: Tensor, real: Tensor, fusion: str = "mean") -> Tensor:
    """fuse_m(A^m) at each example's query row, ``(B, K)``, non-real keys zeroed."""
    return fuse_heads(call.rows_at(query_index)[:, :, None], fusion)[:, 0] * real.float()
