"""Attention erasure (Serrano & Smith, "Is Attention Interpretable?", ACL 2019).

Zero the attention that queries pay to chosen key positions at chosen layers and heads,
renormalise each row, re-run the model and compare the output distributions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..capture import AttentionAdapter, CallInfo, ForwardRecord, Probe
from ..capture.probes import RunKernel
from ..capture.runner import resolve_model
from ..capture.record import without_autocast
from ..maps import erase_keys, on_heads, streaming
from ..maps.kernel import KernelCall, block_shape
from ._checks import check_rankable, takes_captum_scores
from ._forward import CaptureMode, js_divergence, layer_set, run_model, select_rows


@dataclass
class ErasureResult:
    """Per example: the JS divergence (bits) between the output distributions before and
    after erasing, whether the argmax changed, and both distributions ``(B, C)``."""

    js_divergence: Tensor
    flipped: Tensor
    original: Tensor
    erased: Tensor


@dataclass
class FlipResult:
    """Per example, for erasing keys in ranking order until the decision flips.

    Attributes:
        removed: keys erased when the argmax first changed; -1 where it never changed.
        fraction: ``removed`` over the example's real tokens; NaN where it never changed.
        attention_mass_removed: the query's original attention (head mean, averaged over
            the erased layers) on the erased keys at the flip; NaN where it never changed.
        flipped: whether the decision changed before the erasable keys ran out.
    """

    removed: Tensor
    fraction: Tensor
    attention_mass_removed: Tensor
    flipped: Tensor


class _KeyErasure(Probe):
    """Probe: erase the keys ``erased`` at the chosen calls whose keys are the tokens (for
    an encoder-decoder: the source tokens, in encoder self-attention and cross-attention).

    Under eager capture it zeroes their probabilities and renormalises each row; under
    streaming capture it gives those keys a score of -inf in the kernel, which is the
    same.
    """

    events = frozenset({"softmax", "kernel"})

    def __init__(self, erased: Tensor, layers: set[int], heads: Sequence[int] | None, run: ForwardRecord) -> None:
        self.erased, self.layers, self.heads, self.run = erased, layers, heads, run

    def _erases(self, call: CallInfo | None) -> bool:
        return call is not None and call.index in self.layers and self.run.keys_are_inputs(call.index)

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor | None:
        if not self._erases(call):
            return None
        changed = erase_keys(attn_probs, self.erased.to(attn_probs.device), attn_scores)
        return on_heads(attn_probs, changed, self.run.heads_of(call.index, self.heads), first_head)

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        if call is None or not self._erases(call):
            return None
        heads = self.run.heads_of(call.index, self.heads)
        return streaming.erased_output(kernel, self.erased.to(kernel.query.device), heads, block_shape(kernel))


def _check_keys(keys: Tensor, real: Tensor, name: str) -> None:
    if tuple(keys.shape) != tuple(real.shape):
        raise ValueError(
            f"{name} has shape {tuple(keys.shape)} but the model attends over "
            f"{tuple(real.shape)} (batch, tokens): give one value per token (for a ViT, per "
            "class/distillation/patch token)."
        )


@without_autocast("attention_erasure")
def attention_erasure(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    erased_keys: Tensor,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layers: int | list[int] | None = None,
    heads: Sequence[int] | None = None,
    query_index: int | None = None,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> ErasureResult:
    """Erase the attention paid to ``erased_keys`` and measure the change of the output.

    At each chosen layer (and head), every query's attention to the erased key positions
    is set to 0 and the row renormalised; the model then runs on. Returns the
    Jensen-Shannon divergence (in bits, 0..1) between the original and new output
    distributions and whether the predicted class changed.

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``, or a language
            model's ``(batch, seq_len, vocab)`` (read at the last real token).
        inputs (Tensor): token ids ``(batch, seq_len)``, embeddings or images.
        erased_keys (Tensor): ``(batch, seq_len)`` bool, True for the keys to erase.
        additional_forward_args (Any, optional): e.g. ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (int or list of int, optional): attention layers to erase at (negative
            counts from the end). Default: None, all layers.
        heads (sequence of int, optional): heads to erase at. Default: None, all heads.
        query_index (int, optional): the position whose output is compared (a masked
            LM's or a token classifier's token; a decoder's prefix). Default: None, the
            first real token (a decoder's last).
        adapter (AttentionAdapter, optional): how to find the attention.
        capture (str, optional): ``"streaming"`` erases through the model's own kernel
            (the erased keys get a score of -inf, block by block: no ``(heads, N, N)``
            tensor); ``"eager"`` edits explicit probabilities; ``"auto"`` streams where the
            model allows it. Default: ``"auto"``.

    Returns:
        ErasureResult.

    Example::

        >>> top = RawAttention(model).attribute(ids, additional_forward_args=(mask,))
        >>> erased = top == top.max(dim=1, keepdim=True).values
        >>> attention_erasure(model, ids, erased, (mask,)).flipped.float().mean()
    """
    model = resolve_model(forward_func, model)
    original = run_model(
        forward_func, model, inputs, additional_forward_args, adapter=adapter, capture=capture, query_index=query_index
    )
    original_probs = original.explained_probs()
    _check_keys(erased_keys, original.input_real[:, original.leading :], "erased_keys")
    erased_keys = original.over_positions(erased_keys.to(original.input_real.device), False)
    chosen = layer_set(layers, original.num_calls)
    original.check_heads(heads, chosen)
    erasure = _KeyErasure(erased_keys.bool(), chosen, heads, original)
    erased = run_model(
        forward_func, model, inputs, additional_forward_args, [erasure], adapter, capture, query_index=query_index
    ).explained_probs()
    return ErasureResult(
        js_divergence=js_divergence(original_probs, erased),
        flipped=original_probs.argmax(dim=-1) != erased.argmax(dim=-1),
        original=original_probs,
        erased=erased,
    )


@without_autocast("decision_flip_fraction")
@takes_captum_scores("ranking")
def decision_flip_fraction(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    ranking: Tensor,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layers: int | list[int] | None = None,
    heads: Sequence[int] | None = None,
    keep: Tensor | None = None,
    query_index: int | None = None,
    max_batch_size: int = 64,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> FlipResult:
    """Erase keys in the order of ``ranking`` until the decision flips.

    Serrano & Smith's "fraction of items removed before the first decision flip". All
    prefixes of every example's order (1, 2, ... keys erased) are evaluated batched, in
    forwards of at most ``max_batch_size`` rows, not one forward per step. At least one
    real key always stays.

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``, or a language
            model's ``(batch, seq_len, vocab)`` (read at the last real token).
        inputs (Tensor): token ids ``(batch, seq_len)``, embeddings or images.
        ranking (Tensor): ``(batch, seq_len)`` importance, higher first: any attribution
            (ours, Integrated Gradients, SHAP values aligned to tokens), or
            :func:`attention_ranking`, :func:`gradient_ranking`,
            :func:`gradient_attention_ranking`, :func:`random_ranking`. Tied keys are
            erased together, never one before another by position (an all-zero ranking
            ranks nothing); NaN is refused.
        additional_forward_args (Any, optional): e.g. ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (int or list of int, optional): layers to erase at. Default: all.
        heads (sequence of int, optional): heads to erase at. Default: all.
        keep (Tensor, optional): ``(batch, seq_len)`` bool, positions never erased (e.g.
            special tokens). Default: None.
        query_index (int, optional): the explained position: the decision read there (a
            masked LM's or a token classifier's token; a decoder's prefix) and its query
            row for ``attention_mass_removed``. Default: None, the first real token (a
            decoder's last).
        max_batch_size (int, optional): rows per forward. Default: 64.
        adapter (AttentionAdapter, optional): how to find the attention.
        capture (str, optional): as for :func:`attention_erasure`. Default: ``"auto"``.

    Returns:
        FlipResult; examples that never flip have ``removed = -1`` and NaN fractions.
    """
    model = resolve_model(forward_func, model)
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}.")
    original = run_model(
        forward_func, model, inputs, additional_forward_args, adapter=adapter, capture=capture, query_index=query_index
    )
    tokens_real = original.input_real[:, original.leading :]
    _check_keys(ranking, tokens_real, "ranking")
    check_rankable(ranking, tokens_real, "ranking")
    if keep is not None:
        _check_keys(keep, tokens_real, "keep")
    if original.leading:  # GIT's image features: never erased
        ranking = original.over_positions(ranking.to(tokens_real.device), float("-inf"))
        keep = original.over_positions(torch.zeros_like(tokens_real) if keep is None else keep.to(tokens_real.device).bool(), True)
    chosen = layer_set(layers, original.num_calls)
    original.check_heads(heads, chosen)
    plan = _plan_prefixes(ranking, original.input_real, keep)

    def erased_output(rows: Tensor, erased: Tensor) -> Tensor:
        chunk_inputs, chunk_args = select_rows(inputs, additional_forward_args, rows)
        erasure = _KeyErasure(erased, chosen, heads, original)
        return run_model(
            forward_func, model, chunk_inputs, chunk_args, [erasure], adapter, capture, query_index=query_index
        ).explained_probs()

    decision = original.explained_probs().argmax(dim=-1).cpu()
    flips = _evaluate_prefixes(plan, decision, erased_output, max_batch_size)
    never = int(plan.steps.max()) + 1 if len(plan.steps) else 1
    first_flip = torch.full((len(plan.steps),), never).scatter_reduce(
        0, plan.rows, torch.where(flips, plan.prefix, never), reduce="amin"
    )
    flipped = first_flip < never
    removed = torch.where(flipped, first_flip, -1)
    fraction = torch.where(flipped, removed.float() / tokens_real.sum(1).cpu(), torch.nan)
    mass = _attention_mass(original, chosen, plan.ranks < removed[:, None])
    return FlipResult(removed, fraction, torch.where(flipped, mass, torch.nan), flipped)


@dataclass
class _PrefixPlan:
    """Every erasure to evaluate: the first ``prefix[i]`` keys of example ``rows[i]``'s order.

    ``ranks[b, t]`` is token t's place in example b's erasure order (0 = erased first);
    ``steps[b]`` the most keys example b may lose (at least one real key always stays).
    A prefix never ends inside a run of tied scores.
    """

    rows: Tensor
    prefix: Tensor
    ranks: Tensor
    steps: Tensor


def _plan_prefixes(ranking: Tensor, real: Tensor, keep: Tensor | None) -> _PrefixPlan:
    """The prefixes of each example's erasure order that end between two different scores
    (tied keys are erased together) and leave at least one real key."""
    kept = keep.bool().to(real.device) if keep is not None else torch.zeros_like(real)
    erasable = real & ~kept
    scores = ranking.float().masked_fill(~erasable, float("-inf"))
    order = scores.argsort(dim=1, descending=True, stable=True)
    ordered = scores.gather(1, order).cpu()
    steps = torch.minimum(erasable.sum(1), real.sum(1) - 1).clamp(min=0).cpu()
    sizes = torch.arange(1, ranking.shape[1] + 1).expand_as(ordered)
    group_end = torch.ones_like(ordered, dtype=torch.bool)
    group_end[:, :-1] = ordered[:, :-1] != ordered[:, 1:]
    allowed = group_end & (sizes <= steps[:, None])
    rows, columns = allowed.nonzero(as_tuple=True)
    positions = torch.arange(ranking.shape[1], device=order.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(1, order, positions).cpu()
    return _PrefixPlan(rows, sizes[rows, columns], ranks, steps)


def _evaluate_prefixes(
    plan: _PrefixPlan, decision: Tensor, erased_output: Callable[[Tensor, Tensor], Tensor], max_batch_size: int
) -> Tensor:
    """Whether each planned erasure changes the decision, in forwards of at most
    ``max_batch_size`` rows."""
    flips = torch.zeros(len(plan.rows), dtype=torch.bool)
    for start in range(0, len(plan.rows), max_batch_size):
        chunk = slice(start, start + max_batch_size)
        rows = plan.rows[chunk]
        erased = plan.ranks[rows] < plan.prefix[chunk, None]
        flips[chunk] = erased_output(rows, erased).argmax(dim=-1).cpu() != decision[rows]
    return flips


def _attention_mass(explained: ForwardRecord, layers: set[int], erased: Tensor) -> Tensor:
    """The query's original attention (head mean, averaged over the erased layers whose
    queries are the explained sequence's) on the ``erased`` keys, per example."""
    queried = [layer for layer in sorted(layers) if explained.queries_are_explained(layer)]
    query_attention = torch.stack([_query_attention(explained, layer) for layer in queried])
    query_attention = query_attention.mean(dim=0).cpu()
    return (query_attention * erased).sum(dim=1)


def _query_attention(record: ForwardRecord, layer: int) -> Tensor:
    """``(B, K)`` head-mean attention of each example's query row at ``layer`` (a pooling
    layer's mean row)."""
    if record.streaming:
        return record.kernel_calls[layer].rows_at(record.query_index).mean(dim=1)
    return record.explained_row(layer, record.attn_maps[layer].float().mean(dim=1))
