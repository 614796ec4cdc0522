"""Helpers shared by the attention maps: padding, head fusion, query rows, layer products.

Shapes: ``B`` batch, ``H`` heads, ``T`` tokens. Attention maps are ``(B, H, T, T)`` per
layer, rows = queries, columns = keys; fused maps are ``(B, T, T)``; ``real`` is a
``(B, T)`` bool tensor, True for real (non-padding) tokens.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from torch import Tensor, nn

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS: tuple[str, ...] = ("mean", "max", "min")


def is_tensor_subclass(value: Any) -> bool:
    """Whether ``value`` is a tensor of a subclass beside ``nn.Parameter`` (a quantized
    weight's, torchao's or optimum-quanto's)."""
    return isinstance(value, Tensor) and type(value) not in (Tensor, nn.Parameter)


def dense_weight(weight: Any) -> Any:
    """A weight quantized as a tensor subclass (torchao's, optimum-quanto's: the layer
    multiplies by its dequantized matrix) as that float matrix, which names the weight it
    came from (``dequantized_from``, as a view names its base); any other as it is."""
    dequantize = getattr(weight, "dequantize", None)
    if not is_tensor_subclass(weight) or not callable(dequantize):
        return weight
    dense = dequantize().detach()
    dense.dequantized_from = weight
    return dense


def half_precision(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a floating type of 16 bits or fewer (bfloat16, float16)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits <= 16


def fuse_heads(attn: Tensor, fusion: str = "mean") -> Tensor:
    """Reduce ``(B, H, T, T)`` maps over heads by ``fusion`` ("mean", "max" or "min")."""
    if fusion == "mean":
        return attn.mean(dim=1)
    if fusion == "max":
        return attn.amax(dim=1)
    check_head_fusion(fusion)
    return attn.amin(dim=1)


def check_head_fusion(fusion: str) -> None:
    """A clear error unless ``fusion`` is one of :data:`HEAD_FUSIONS`."""
    if fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {fusion!r}.")


def mask_padding(maps: Tensor, real: Tensor, real_keys: Tensor | None = None) -> Tensor:
    """Zero the rows and columns of padding tokens in ``(B, ..., Q, K)`` maps.

    ``real`` marks the real queries (and keys, unless ``real_keys`` marks them apart, as
    in cross-attention from target queries to source keys).
    """
    keys = real if real_keys is None else real_keys
    if bool(real.all()) and bool(keys.all()):
        return maps  # nothing to mask (saves a pass over every map for unpadded batches)
    pairs = real[:, :, None] & keys[:, None, :]
    pairs = pairs.view(real.shape[0], *([1] * (maps.dim() - 3)), *pairs.shape[1:])
    return maps.masked_fill(~pairs, 0.0)


def query_weights(query: Tensor, num_tokens: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """``(B, T)`` weights of the explained query rows: the one-hot ``e_q`` of a ``(B,)``
    position, or a span's ``(B, T)`` weights as given (every row-reducing method is
    linear in them: a span's row is the weighted sum of its positions' rows)."""
    if query.dim() == 2:
        return query.to(dtype)
    weights = torch.zeros(len(query), num_tokens, dtype=dtype, device=query.device)
    weights[torch.arange(len(query), device=query.device), query] = 1.0
    return weights


def last_query(query: Tensor) -> Tensor:
    """``(B,)`` the last explained position: the position itself, or a span's last
    position with a non-zero weight."""
    if query.dim() == 1:
        return query
    positions = torch.arange(query.shape[1], device=query.device).expand_as(query)
    return positions.masked_fill(query == 0, -1).amax(dim=1)


def query_rows(maps: Tensor, query: Tensor) -> Tensor:
    """The explained row of each ``(T, T)`` map in ``(B, T, T)`` maps, ``(B, T)``: row
    ``query[b]``, or a span's weighted sum of rows."""
    if query.dim() == 2:
        return torch.einsum("bq,bqk->bk", query.to(maps.dtype), maps)
    return maps[torch.arange(maps.shape[0], device=maps.device), query]


def propagate_query_row(layer_maps: Sequence[Tensor], query_index: Tensor, readout: Tensor | None = None) -> Tensor:
    """Query row of the product ``M^L ··· M^2 M^1`` (later layers on the left).

    Computed as ``e_q^T M^L ··· M^1``, one vector-matrix product per layer, which costs
    ``O(L·T²)`` instead of the ``O(L·T³)`` of multiplying the matrices; the products
    accumulate in float64 (a float32 sum over thousands of keys drifts by 1e-4 relative
    at 3k tokens), the result in the maps' dtype.

    Args:
        layer_maps: per-layer ``(B, T, T)`` matrices ``M^1 .. M^L`` in forward order.
        query_index: ``(B,)`` long tensor, the row to return per example, or a span's
            ``(B, T)`` weights (the weighted sum of rows; see :func:`query_weights`).
        readout: ``(B, T)`` row that replaces ``e_q`` (a pooling readout's attention over
            the tokens), optional.

    Returns:
        ``(B, T)`` tensor.
    """
    if readout is not None:
        row, dtype = readout[:, None, :].double(), readout.dtype
    else:
        first = layer_maps[0]
        row = query_weights(query_index.to(first.device), first.shape[-1], torch.float64)[:, None, :]
        dtype = first.dtype
    for layer_map in reversed(layer_maps):
        row = torch.bmm(row, layer_map.double())
    return row.squeeze(1).to(dtype)


def identity_like(maps: Tensor) -> Tensor:
    """Identity matrices broadcastable against ``(B, T, T)`` maps."""
    return torch.eye(maps.shape[-1], dtype=maps.dtype, device=maps.device).expand_as(maps)


def real_tokens(attention_mask: Tensor | None, batch: int, seq_len: int, device: torch.device) -> Tensor:
    """``(B, T)`` bool tensor of real tokens: ``attention_mask != 0``, or all True without a mask."""
    if attention_mask is None:
        return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    return attention_mask.to(device) != 0


def zero_on_later_keys(attn: Tensor, real: Tensor) -> bool:
    """Whether ``(B, H, T, T)`` attention puts exactly zero weight on every later real key
    (and there is a later real key to put it on).

    A softmax is never exactly 0 unless the key was masked (or, in low precision, its
    weight underflowed: the reason adapters that know say so instead). One head is enough
    (the mask is shared by all heads), which keeps the check a single pass over ``(B, T, T)``.
    """
    return has_later_keys(real) and not bool(prefix_seen_both_ways(attn, real).any())


def has_later_keys(real: Tensor) -> bool:
    """Whether some real query has a later real key: an example of two real tokens."""
    return bool((real.sum(dim=1) >= 2).any())


def prefix_seen_both_ways(attn: Tensor, real: Tensor) -> Tensor:
    """``(B,)`` long: per example, one past the last real key that ``(B, H, T, T)``
    attention lets an earlier real query see (its first head read), 0 where none does.
    Past it every query sees only earlier keys: where it ends before the last real token,
    the sequence is causal after a prefix (a prefix language model's, as PaliGemma's image
    and prompt); where it reaches the last, the sequence is an encoder's."""
    length = real.shape[1]
    later = real[:, :, None] & real[:, None, :] & torch.ones(length, length, dtype=torch.bool, device=real.device).triu(diagonal=1)
    return _one_past_last_key((attn[:, 0] != 0) & later)


def mask_prefix_seen_both_ways(mask: Tensor, real: Tensor, rows_per_block: int = 1024) -> Tensor:
    """:func:`prefix_seen_both_ways` of a kernel's mask (a boolean keep-mask, or an additive
    one, broadcastable to ``(B, H, T, T)``), read in blocks of query rows, so that nothing of
    ``(T, T)`` floats is made."""
    batch, length = real.shape
    full = mask.expand(batch, -1, length, length)
    keys = torch.arange(length, device=real.device)
    prefix = torch.zeros(batch, dtype=torch.long, device=real.device)
    for start in range(0, length, rows_per_block):
        rows = slice(start, min(start + rows_per_block, length))
        block = full[:, 0, rows]
        keep = (block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min / 2).to(real.device)
        later = (keys[None, :] > keys[rows, None]) & real[:, rows, None] & real[:, None, :]
        prefix = prefix.maximum(_one_past_last_key(keep & later))
    return prefix


def _one_past_last_key(seen: Tensor) -> Tensor:
    """``(B,)`` one past the last key column of ``(B, Q, K)`` bool ``seen`` that holds a True, or 0."""
    columns = seen.any(dim=1)
    positions = torch.arange(1, columns.shape[1] + 1, device=columns.device)
    return (columns * positions).amax(dim=1)
