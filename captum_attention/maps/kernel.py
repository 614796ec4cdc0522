"""One attention call as plain data, and the exact recomputation of its rows.

A :class:`KernelCall` holds what an attention kernel received (query, key, value, mask,
scale, causal flag, position bias, grouped-query heads; and a logit softcap or sinks,
which only the families' eager attention computes). Its methods define the rows of
``A = softmax(Q·Kᵀ·s + mask)`` and of ``dS/dA = dO·Vᵀ`` exactly as
``torch.nn.functional.scaled_dot_product_attention`` (or that eager attention) computes
them, one block of query rows at a time, so that no ``(heads, N, N)`` tensor is ever alive; :func:`block_shape` sizes the
blocks. Pure tensor functions: the streaming capture
(:mod:`captum_attention.capture.kernel`) fills a :class:`KernelCall`, the reductions of
:mod:`captum_attention.maps.streaming` read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import query_weights

RowsTransform = Callable[[Tensor, slice, slice, slice], Tensor]
"""``transform(attn_rows (b, h, r, K), examples, heads, rows) -> (b, h, r, K)``: new
probabilities for a block of the query rows ``rows`` of the examples ``examples`` and the
query heads ``heads`` (every example and head, or one example's every head, or one head's
rows)."""


def half_bmm_to_float(left: Tensor, right: Tensor) -> Tensor | None:
    """``torch.bmm`` of half-precision matrices with a float32 result (``out_dtype``, CUDA
    only in torch 2.13), or None where this torch has no such kernel."""
    try:
        return torch.bmm(left, right, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return None


@dataclass(eq=False)
class KernelCall:
    """One attention call as the kernel received it.

    Attributes:
        query: ``(B, H, Q, D)``.
        key: ``(B, H / groups, K, D)``: with grouped-query attention each key head serves
            ``groups`` consecutive query heads (as transformers' ``repeat_kv``).
        value: ``(B, H / groups, K, Dv)``; None when no gradient is taken.
        scale: the factor on ``query @ key^T``.
        mask: a boolean keep-mask or an additive float mask broadcastable to
            ``(B, H, Q, K)``, or None.
        causal: whether the kernel applies its own causal mask (upper-left aligned).
        position_bias: an additive ``(B or 1, H, Q, K)`` bias (T5), or None.
        groups: how many consecutive query heads each key head serves.
        output: the call's output ``(B, Q, H, Dv)``, in the autograd graph, kept when
            gradients are tracked (else None).
        softcap: ``c`` of Gemma-2's logit cap ``c·tanh(S / c)``, applied to the scaled
            products before any mask or bias; None for none.
        sinks: ``(1, H, 1, 1)`` one logit per head (gpt-oss) that joins every row's
            softmax and weights no value, so that a row's probabilities sum below 1; None
            for none.
    """

    query: Tensor
    key: Tensor
    value: Tensor | None
    scale: float
    mask: Tensor | None
    causal: bool
    position_bias: Tensor | None = None
    groups: int = 1
    output: Tensor | None = None
    softcap: float | None = None
    sinks: Tensor | None = None

    @property
    def explicit(self) -> bool:
        """Whether only the explicit computation gives this call's output: a softcap or
        sinks, which ``scaled_dot_product_attention`` does not model."""
        return self.softcap is not None or self.sinks is not None

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_queries(self) -> int:
        return self.query.shape[2]

    @property
    def num_keys(self) -> int:
        return self.key.shape[2]

    def on(self, query: Tensor, key: Tensor, value: Tensor) -> KernelCall:
        """This call on other tensors, their keys and values cropped to the ones the call
        sees (transformers crops a causal call's keys beyond its queries)."""
        return replace(self, query=query, key=key[:, :, : self.num_keys], value=value[:, :, : self.num_keys])

    def key_span(self, rows: slice) -> int:
        """How many leading keys the query rows ``rows`` can see: all of them, or under the
        kernel's causal mask those up to the block's last row (the rest have probability 0
        and are not computed)."""
        return min(rows.stop, self.num_keys) if self.causal else self.num_keys

    def logit_bias(self, rows: slice, keys: int | None = None, heads: slice = slice(None)) -> Tensor | None:
        """The additive bias of the query rows ``rows`` of the query heads ``heads`` over the
        first ``keys`` keys (default all), ``(B or 1, heads or 1, r, keys)`` float32, -inf
        where a key is masked; None when nothing is added."""
        keys = self.num_keys if keys is None else keys
        bias = None
        if self.mask is not None:
            mask = self.mask[..., rows, :keys] if self.mask.shape[-2] > 1 else self.mask[..., :keys]
            mask = mask[:, heads] if mask.shape[1] > 1 else mask
            if mask.dtype == torch.bool:
                bias = torch.zeros(mask.shape, device=mask.device, dtype=torch.float32).masked_fill_(~mask, -math.inf)
            else:
                bias = mask.float()
        if self.position_bias is not None:
            position_bias = self.position_bias[..., rows, :keys]
            position_bias = (position_bias[:, heads] if position_bias.shape[1] > 1 else position_bias).float()
            bias = position_bias if bias is None else bias + position_bias
        if self.causal:
            later = torch.arange(keys, device=self.query.device) > torch.arange(rows.start, rows.stop, device=self.query.device)[:, None]
            causal = torch.zeros(later.shape, device=later.device, dtype=torch.float32).masked_fill_(later, -math.inf)
            bias = causal if bias is None else bias + causal
        return bias

    def _per_key_head(self, rows: Tensor, keys: Tensor, heads: slice) -> Tensor:
        """``rows (B, h, r, D) @ keys^T`` as ``(B, h, r, K)`` float32, for the query heads
        ``heads`` (one head, or whole groups) and all key heads ``keys (B, H / groups, K, D)``,
        without repeating the key heads. Half-precision inputs on a GPU multiply on its
        tensor cores with float32 accumulation and output, as the attention kernel does."""
        batch, num_heads, num_rows, dim = rows.shape
        first, last, _ = heads.indices(self.num_heads)
        keys = keys[:, first // self.groups : -(-last // self.groups)]
        kv_heads, num_keys = keys.shape[1], keys.shape[2]
        assert num_heads % kv_heads == 0, "a block holds one query head or whole groups of them"
        grouped = rows.reshape(batch, kv_heads, num_heads // kv_heads * num_rows, dim)
        products = None
        if rows.dtype in (torch.float16, torch.bfloat16) and rows.is_cuda:
            products = half_bmm_to_float(
                grouped.reshape(batch * kv_heads, -1, dim), keys.transpose(-1, -2).reshape(batch * kv_heads, dim, num_keys)
            )
        if products is None:
            products = torch.matmul(grouped.float(), keys.float().transpose(-1, -2))
        return products.reshape(batch, num_heads, num_rows, num_keys)

    def _scores(self, rows: slice, heads: slice) -> Tensor:
        """``s·Q·Kᵀ`` ``(B, h, r, key_span)`` float32 of the query rows ``rows`` of the
        query heads ``heads``, before any cap, mask or bias."""
        return self._per_key_head(self.query[:, heads, rows] * self.scale, self.key[:, :, : self.key_span(rows)], heads)

    def _capped(self, scores: Tensor, with_slope: bool = False) -> tuple[Tensor, Tensor | None]:
        """``c·tanh(scores / c)`` (in place) under a softcap, else ``scores``; and with
        ``with_slope`` its derivative ``1 - tanh²(scores / c)`` (None without a cap)."""
        if self.softcap is None:
            return scores, None
        tanh = scores.div_(self.softcap).tanh_()
        slope = 1 - tanh.square() if with_slope else None
        return tanh.mul_(self.softcap), slope

    def _biased(self, scores: Tensor, rows: slice, heads: slice) -> Tensor:
        """The block's (capped) scores with its mask, causal mask and position bias added (in place)."""
        keys = scores.shape[-1]
        if self.causal and self.mask is None and self.position_bias is None:
            # only the block's own square holds later keys
            square = scores[..., rows.start : keys]
            later = torch.ones(square.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
            square.masked_fill_(later, -math.inf)
            return scores
        bias = self.logit_bias(rows, keys, heads)
        return scores if bias is None else scores.add_(bias)

    def logits(self, rows: slice, heads: slice = slice(None)) -> Tensor:
        """``(B, h, r, key_span)`` float32 pre-softmax scores of the query rows ``rows`` of
        the query heads ``heads`` (default all)."""
        return self._biased(self._capped(self._scores(rows, heads))[0], rows, heads)

    def sink_logits(self, heads: slice = slice(None)) -> Tensor | None:
        """``(1, h, 1, 1)`` float32 sink logits of the query heads ``heads``, or None."""
        return None if self.sinks is None else self.sinks[:, heads].float()

    def probs(self, rows: slice, heads: slice = slice(None), bias: Tensor | None = None) -> Tensor:
        """``(B, h, r, key_span)`` float32 attention probabilities of the query rows ``rows``
        of the query heads ``heads`` (0 in a row whose every key is masked), with ``bias``
        (broadcast over the block) added to the logits."""
        logits = self.logits(rows, heads)
        return self._normalised(logits if bias is None else logits.add_(bias), heads, self.mask is not None or bias is not None)

    def _normalised(self, logits: Tensor, heads: slice, masked: bool) -> Tensor:
        """The softmax of ``logits`` (in place), with the heads' sinks in each row's
        normaliser; 0 in a row without a key (``masked``: whether one can be)."""
        sinks = self.sink_logits(heads)
        if sinks is None:
            probs = logits.softmax(dim=-1)
            return _without_empty_rows(probs) if masked else probs
        top = torch.maximum(logits.amax(dim=-1, keepdim=True), sinks)
        exp = logits.sub_(top).exp_()
        return exp.div_(exp.sum(dim=-1, keepdim=True) + (sinks - top).exp())

    def rows_at(self, query_index: Tensor) -> Tensor:
        """``(B, H, K)`` float32 probabilities of each example's row ``query_index[b]`` (a
        span's ``(B, Q)`` weights: the weighted sum of its rows)."""
        return self._each_row(query_index, self.probs)

    def grad_rows_at(self, grad_output: Tensor, query_index: Tensor) -> Tensor:
        """``(B, H, K)`` float32 gradient dS/dA of each example's row ``query_index[b]``
        (a span's weighted sum of rows)."""
        return self._each_row(query_index, lambda rows: self.grad_probs(grad_output, rows))

    def _each_row(self, query_index: Tensor, block: Callable[[slice], Tensor]) -> Tensor:
        weights = query_weights(query_index, self.num_queries)
        rows = []
        for b, example in enumerate(weights.cpu()):
            used = example.nonzero().flatten()
            first, last = int(used[0]), int(used[-1]) + 1
            block_rows = block(slice(first, last))[b if self.query.shape[0] > 1 else 0]
            row = torch.einsum("q,hqk->hk", example[first:last].to(block_rows), block_rows)
            rows.append(F.pad(row, (0, self.num_keys - row.shape[-1])))
        return torch.stack(rows)

    def grad_probs(self, grad_output: Tensor, rows: slice, heads: slice = slice(None)) -> Tensor:
        """``(B, h, r, key_span)`` float32 gradient dS/dA of the rows ``rows`` of the query
        heads ``heads`` from the gradient of the call's output ``(B, Q, H, Dv)``: dA = dO · Vᵀ."""
        assert self.value is not None, "the values were not recorded (no gradient tracked)"
        grad_rows = grad_output[:, rows, heads].transpose(1, 2)
        return self._per_key_head(grad_rows, self.value[:, :, : self.key_span(rows)], heads)

    def rows_backward(self, grad_output: Tensor, rows: slice) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients ``(dQ, dK, dV)`` of the call's query, key and value (their shapes
        and dtypes) from a gradient of its output ``(B, Q, H, Dv)`` that is zero outside the
        query rows ``rows``: the kernel's backward restricted to those rows, at ``rows ×
        keys`` instead of ``queries × keys`` (:meth:`input_grads`)."""
        return self.input_grads(grad_output, [rows])

    def input_grads(self, grad_output: Tensor, row_blocks: Iterable[slice]) -> tuple[Tensor, Tensor, Tensor]:
        """The gradients ``(dQ, dK, dV)`` of the call's query, key and value (their shapes
        and dtypes) from a gradient of its output ``(B, Q, H, Dv)`` that is zero outside the
        ``row_blocks``, one block of rows of every head at a time, accumulated in float32:
        with A the rows' probabilities and dA = dO·Vᵀ, dS = A ⊙ (dA - Σ_j A ⊙ dA) (a sink,
        which weights no value, adds nothing to the sum), times ``1 - tanh²(S₀ / c)`` under
        a softcap (S₀ the scaled products), dQ = s·dS·K, dK = s·dSᵀ·Q, dV = Aᵀ·dO. The
        position bias, an additive mask and the sinks get no gradient."""
        assert self.value is not None, "the values were not recorded (no gradient tracked)"
        grads = tuple(torch.zeros(t.shape, device=t.device, dtype=torch.float32) for t in (self.query, self.key, self.value))
        for rows in row_blocks:
            self._add_row_grads(grad_output, rows, *grads)
        return tuple(grad.to(t.dtype) for grad, t in zip(grads, (self.query, self.key, self.value)))  # type: ignore[return-value]

    def _add_row_grads(self, grad_output: Tensor, rows: slice, grad_query: Tensor, grad_key: Tensor, grad_value: Tensor) -> None:
        assert self.value is not None
        batch, num_rows, kv_heads = self.query.shape[0], rows.stop - rows.start, self.key.shape[1]
        every_head = slice(None)
        capped, slope = self._capped(self._scores(rows, every_head), with_slope=True)
        probs = self._normalised(self._biased(capped, rows, every_head), every_head, self.mask is not None)
        grad_probs = self.grad_probs(grad_output, rows)
        grad_logits = probs * (grad_probs - (probs * grad_probs).sum(dim=-1, keepdim=True))
        grad_logits = grad_logits if slope is None else grad_logits.mul_(slope)
        span = probs.shape[-1]

        def grouped(tensor: Tensor) -> Tensor:  # (B, H, r, x) -> (B, H / groups, groups · r, x)
            return tensor.reshape(batch, kv_heads, -1, tensor.shape[-1])

        grad_query[:, :, rows] += (torch.matmul(grouped(grad_logits), self.key[:, :, :span].float()) * self.scale).reshape(
            batch, self.num_heads, num_rows, -1
        )
        query_rows = grouped(self.query[:, :, rows].float())
        grad_key[:, :, :span] += torch.matmul(grouped(grad_logits).transpose(-1, -2), query_rows) * self.scale
        grad_rows = grouped(grad_output[:, rows].transpose(1, 2).float())
        grad_value[:, :, :span] += torch.matmul(grouped(probs).transpose(-1, -2), grad_rows)

    def blocks(self, shape: tuple[int, int], reached: Tensor | None = None) -> Iterator[tuple[slice, slice]]:
        """``(heads, rows)`` slices of the blocks of ``shape = (heads, rows)``, the query rows
        outer; with ``reached`` ``(B, Q)``, only the blocks of rows where it is nonzero."""
        heads_per_block, rows_per_block = shape
        for start in range(0, self.num_queries, rows_per_block):
            rows = slice(start, min(start + rows_per_block, self.num_queries))
            if reached is not None and not bool(reached[:, rows].any()):
                continue
            for first in range(0, self.num_heads, heads_per_block):
                yield slice(first, min(first + heads_per_block, self.num_heads)), rows

    def erase_bias(self, erased: Tensor, heads: Sequence[int] | None) -> Tensor:
        """``(B, H, 1, K)`` float32 -inf on the ``erased`` keys ``(B, K)`` of the heads
        ``heads`` (default all), 0 elsewhere; ``(B, 1, 1, K)`` where every head erases."""
        erase = torch.zeros(erased.shape, device=erased.device, dtype=torch.float32)
        erase = erase.masked_fill_(erased, -math.inf)[:, None, None, :]
        if heads is None:
            return erase
        chosen = torch.zeros(self.num_heads, dtype=torch.bool, device=erased.device)
        chosen[[h for h in heads if 0 <= h < self.num_heads]] = True
        return erase if bool(chosen.all()) else torch.where(chosen[None, :, None, None], erase, 0.0)

    def erased_output(self, erase: Tensor | None, shape: tuple[int, int]) -> Tensor:
        """The call's output ``(B, Q, H, Dv)`` with ``erase`` (:meth:`erase_bias`; None for
        none) added to its logits: exactly zeroing the attention to the erased keys and
        renormalising each row. Computed by the kernel one block of ``shape`` at a time (a
        causal block over the keys up to its last row, as the causal kernel skips the rest),
        or for an :attr:`explicit` call from its probabilities; a row whose every key is
        erased gives 0."""
        assert self.value is not None
        output = self.query.new_empty(*self.query.shape[:3], self.value.shape[-1])
        for block_heads, rows in self.blocks(shape):
            keys = self.key_span(rows)
            block_erase = None if erase is None else erase[:, block_heads if erase.shape[1] > 1 else slice(None), :, :keys]
            if self.explicit:
                probs = self.probs(rows, block_heads, block_erase)
                output[:, block_heads, rows] = self._per_key_head(probs, self.value[:, :, :keys].transpose(-1, -2), block_heads)
                continue
            bias = self.logit_bias(rows, keys, block_heads)
            bias = block_erase if bias is None else bias if block_erase is None else bias + block_erase
            first, last, _ = block_heads.indices(self.num_heads)
            key_heads = slice(first // self.groups, -(-last // self.groups))
            out = F.scaled_dot_product_attention(
                self.query[:, block_heads, rows], self.key[:, key_heads, :keys], self.value[:, key_heads, :keys],
                attn_mask=None if bias is None else bias.to(self.query.dtype), scale=self.scale,
                enable_gqa=last - first > 1 and self.groups > 1,
            )
            output[:, block_heads, rows] = torch.nan_to_num(out, nan=0.0)
        return output.transpose(1, 2).contiguous()


def live_rows(grad_output: Tensor) -> Tensor:
    """``(B, Q)`` bool: the query rows where a call's output gradient ``(B, Q, H, Dv)`` is
    nonzero (elsewhere dS/dA = dO·Vᵀ is zero, and so is every term it multiplies)."""
    return grad_output.ne(0).any(dim=-1).any(dim=-1)


def _part(call: KernelCall, examples: slice, heads: slice) -> KernelCall:
    """The call restricted to the examples ``examples`` and the query heads ``heads``
    (every head, or one)."""

    def pick(tensor: Tensor | None, head_axis_size: int) -> Tensor | None:
        if tensor is None:
            return None
        tensor = tensor[examples] if tensor.shape[0] > 1 else tensor
        if tensor.shape[1] == 1 or heads == slice(None):
            return tensor
        head = heads.start // (call.num_heads // head_axis_size)
        return tensor[:, head : head + 1]

    kv_heads = call.key.shape[1]
    return KernelCall(
        pick(call.query, call.num_heads), pick(call.key, kv_heads), pick(call.value, kv_heads),  # type: ignore[arg-type]
        call.scale, pick(call.mask, call.num_heads), call.causal, pick(call.position_bias, call.num_heads),
        groups=call.groups if heads == slice(None) else 1, softcap=call.softcap, sinks=pick(call.sinks, call.num_heads),
    )


def _parts(call: KernelCall, budget_bytes: int) -> Iterator[tuple[slice, slice]]:
    """``(examples, heads)`` of the parts :func:`transformed_output` computes, in the order
    ``(example, head)``: every example and head at once where four float32 copies of the
    call's probabilities fit ``budget_bytes``, else one example's every head where its
    copies do, else one example's one head at a time."""
    batch = call.query.shape[0]
    per_example = 16 * call.num_heads * call.num_queries * call.num_keys
    if batch * per_example <= budget_bytes:
        yield slice(None), slice(None)
        return
    for example in range(batch):
        if per_example <= budget_bytes:
            yield slice(example, example + 1), slice(None)
            continue
        for head in range(call.num_heads):
            yield slice(example, example + 1), slice(head, head + 1)


def transformed_output(call: KernelCall, transform: RowsTransform, budget_bytes: int | None = None) -> Tensor:
    """The call's output ``(B, Q, H, Dv)`` with each block of rows of the probabilities
    replaced by ``transform`` before they weight the values: explicit attention, in blocks
    within ``budget_bytes`` (default :data:`ONE_HEAD_BLOCK_MEMORY`; every example and head
    at once where that fits, else :func:`_parts`, in blocks of rows as
    :func:`block_shape`), in the order ``(example, head, row)`` in which eager capture's
    ``(B, H, Q, K)`` tensor holds them."""
    assert call.value is not None
    budget_bytes = ONE_HEAD_BLOCK_MEMORY if budget_bytes is None else budget_bytes
    batch = call.query.shape[0]
    output = torch.empty(batch, call.num_heads, call.num_queries, call.value.shape[-1], dtype=call.query.dtype, device=call.query.device)
    for examples, heads in _parts(call, budget_bytes):
        part = _part(call, examples, heads)
        assert part.value is not None
        for _, rows in part.blocks((part.num_heads, block_shape(part, budget_bytes)[1])):
            probs = F.pad(part.probs(rows), (0, call.num_keys - part.key_span(rows)))
            changed = transform(probs, examples, heads, rows)
            values = part._per_key_head(changed, part.value.transpose(-1, -2), slice(None))
            output[examples, heads, rows] = values.to(output.dtype)
    return output.transpose(1, 2).contiguous()


BLOCK_MEMORY = {"cpu": (16 * 2**20, 64 * 2**20), "cuda": (256 * 2**20, None)}
"""Default bytes per block of every head's recomputed rows, ``(least, most)`` per device:
eight times a call's queries in float32 within those bounds, so that blocks grow with the
input (larger blocks multiply faster) but stay a small part of what the model itself
holds, and on a CPU within its caches. Measured in ``benchmarks/scaling.py``."""

ONE_HEAD_BLOCK_MEMORY = 64 * 2**20
"""Default bytes per block of one head's rows (:data:`ONE_HEAD_PER_BLOCK`): each
``(rows, keys)`` float32 temporary about 16 MiB, large enough that the compiled block
reductions (:data:`~captum_attention.maps.streaming.FUSED_MIN_PAIRS`) spend their time in
the block and not between blocks (measured on a BERT layer at 8k tokens: 0.80 s with
blocks of 512 rows, 1.0 s with 128; at 16k 3.2 s with 256 rows, 4.5 s with 64)."""

ONE_HEAD_PER_BLOCK = {"cpu": True, "cuda": False}
"""Whether a block of a bidirectional call holds one head's rows (else every head's), per
device. On a CPU every row of a bidirectional call sees every key, and blocks of one head
keep the elementwise passes within the caches (measured 15-20% faster on a 6-layer BERT at
8k tokens); causal calls, whose rows see half the keys on average, keep blocks of every
head (measured 15% faster on a 4-layer grouped-query Llama at 8k)."""


def block_shape(call: KernelCall, budget_bytes: int | None = None) -> tuple[int, int]:
    """``(heads, rows)`` per block: one head (a bidirectional call, where
    :data:`ONE_HEAD_PER_BLOCK` says so) or every head, and as many query rows as let four
    float32 ``(B, heads, rows, K)`` temporaries fit ``budget_bytes`` (at least one row).
    Default budget: :data:`ONE_HEAD_BLOCK_MEMORY` or :data:`BLOCK_MEMORY`."""
    device = "cpu" if call.query.device.type == "cpu" else "cuda"
    one_head = ONE_HEAD_PER_BLOCK[device] and not call.causal
    if budget_bytes is None and one_head:
        budget_bytes = ONE_HEAD_BLOCK_MEMORY
    elif budget_bytes is None:
        least, most = BLOCK_MEMORY[device]
        budget_bytes = max(least, 32 * call.query.numel())
        budget_bytes = budget_bytes if most is None else min(budget_bytes, most)
    heads = 1 if one_head else call.num_heads
    per_row = 4 * 4 * call.query.shape[0] * heads * call.num_keys
    return heads, max(1, budget_bytes // max(per_row, 1))


def _without_empty_rows(probs: Tensor) -> Tensor:
    """``probs``, a softmax over the last dimension, with its rows of NaN (every key masked)
    set to 0, in place. A softmax row is all NaN or all finite, so its first entry tells
    which; on the CPU the block is written only where there is such a row (writing every
    block took longer than the softmax itself)."""
    empty = probs[..., :1].isnan()
    if probs.device.type != "cpu" or bool(empty.any()):
        probs.masked_fill_(empty, 0.0)
    return probs
