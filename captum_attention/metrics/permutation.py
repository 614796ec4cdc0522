"""Attention permutation (Jain & Wallace, "Attention is not Explanation", NAACL 2019).

Shuffle each real query row's attention weights among the keys it sees (its real keys;
under a causal mask those up to it) at chosen layers and heads and measure how much the
output moves; over a data set, per layer, how much the
accuracy moves (the per-layer study of Vafaie et al., "Is Attention Explanation in
Transformers?", University of Ottawa).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from ..capture import AttentionAdapter, CallInfo, ForwardRecord, Probe
from ..capture.probes import RunKernel
from ..capture.runner import resolve_model
from ..capture.record import without_autocast
from ..maps import hashed_draws, on_heads, permute_rows
from ..maps.kernel import KernelCall, transformed_output
from ._forward import CaptureMode, example_seeds_of, js_divergence, layer_set, ranks_of, run_model


@dataclass
class PermutationResult:
    """Per example, the median over permutations of the output's total-variation distance
    and Jensen-Shannon divergence (bits) from the unpermuted output, and the fraction of
    permutations that changed the decision."""

    median_tvd: Tensor
    median_js_divergence: Tensor
    flip_rate: Tensor


class _RowPermutation(Probe):
    """Probe: shuffle each real query row's weights among the keys it sees at the chosen
    calls (:func:`~captum_attention.maps.permute_rows`).

    Under eager capture it permutes each call's probabilities at once; under streaming
    capture one block of rows at a time (every example's, one example's or one head's).
    Each entry's draw is hashed from its example's seed, the permutation's number, the
    call, the head and the row's and key's places among the real tokens
    (:func:`~captum_attention.maps.draws.hashed_draws`), so the two modes give the same
    permutations, and an example gets the same alone as in any batch, under any padding.
    """

    events = frozenset({"softmax", "kernel"})

    def __init__(self, run: ForwardRecord, layers: set[int], heads: Sequence[int] | None, seeds: Tensor, number: int) -> None:
        self.run, self.layers, self.heads, self.seeds, self.number = run, layers, heads, seeds, number

    def _visible_keys(self, call_index: int) -> Tensor:
        """``(B, Q or 1, K)`` bool: the keys each row of the call sees."""
        return self.run.visible_keys(call_index)[0]

    def _draws(self, call_index: int, examples: slice, first_head: int, num_heads: int, rows: slice) -> Tensor:
        """``(b, h, q, K)`` int64: the draws of a block of the call's probabilities."""
        query_ranks, key_ranks = ranks_of(self.run, call_index)
        query_ranks, key_ranks = query_ranks[examples, rows], key_ranks[examples]
        heads = torch.arange(first_head, first_head + num_heads, device=key_ranks.device)
        seeds = self.seeds[examples].to(key_ranks.device)
        return hashed_draws(
            seeds[:, None, None, None], call_index, self.number, heads[None, :, None, None],
            query_ranks[:, None, :, None], key_ranks[:, None, None, :],
        )

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor | None:
        if call.index not in self.layers:
            return None
        visible = self._visible_keys(call.index).to(attn_probs.device).expand(-1, attn_probs.shape[-2], -1)
        draws = self._draws(call.index, slice(None), first_head, attn_probs.shape[1], slice(None))
        changed = permute_rows(attn_probs, visible, draws)
        return on_heads(attn_probs, changed, self.run.heads_of(call.index, self.heads), first_head)

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        if call is None or call.index not in self.layers:
            return None
        visible = self._visible_keys(call.index).expand(-1, kernel.num_queries, -1)
        heads = self.run.heads_of(call.index, self.heads)

        def permute(attn_rows: Tensor, examples: slice, block_heads: slice, rows: slice) -> Tensor:
            first_head = block_heads.start or 0
            draws = self._draws(call.index, examples, first_head, attn_rows.shape[1], rows)
            changed = permute_rows(attn_rows, visible[examples, rows].to(attn_rows.device), draws)
            return on_heads(attn_rows, changed, heads, first_head)

        return transformed_output(kernel, permute)


@without_autocast("attention_permutation")
def attention_permutation(
    forward_func: Callable[..., Any],
    inputs: Tensor,
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layers: int | list[int] | None = None,
    heads: Sequence[int] | None = None,
    n_permutations: int = 20,
    seed: int = 0,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> PermutationResult:
    """How far the output moves when attention rows are shuffled.

    Each permutation draws, for every example, head and real query row at the chosen
    layers, an independent shuffle of the weights among the keys the row sees (padding,
    and a causal row's later keys, stay out), drawn from ``seed`` and the example's own
    inputs: an example's permutations, and so its result, are the same alone as in any
    batch, under left or right padding, and in both capture modes.

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``.
        inputs (Tensor): token ids ``(batch, seq_len)`` or embeddings.
        additional_forward_args (Any, optional): e.g. ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (int or list of int, optional): layers to permute. Default: all.
        heads (sequence of int, optional): heads to permute. Default: all.
        n_permutations (int, optional): permutations per example. Default: 20.
        seed (int, optional): seed of the permutations, with each example's own
            inputs. Default: 0.
        adapter (AttentionAdapter, optional): how to find the attention.
        capture (str, optional): ``"streaming"`` permutes blocks of recomputed rows and
            weights the values with them (the same permutations as ``"eager"``, which
            permutes explicit probability maps); ``"auto"`` streams where the model
            allows it. Default: ``"auto"``.

    Returns:
        PermutationResult.
    """
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be at least 1, got {n_permutations}.")
    model = resolve_model(forward_func, model)
    original = run_model(forward_func, model, inputs, additional_forward_args, adapter=adapter, capture=capture)
    original_probs = original.explained_probs()
    chosen = layer_set(layers, original.num_calls)
    original.check_heads(heads, chosen)
    seeds = example_seeds_of(inputs, original, seed)
    permuted = torch.stack(
        [
            run_model(
                forward_func, model, inputs, additional_forward_args,
                [_RowPermutation(original, chosen, heads, seeds, number)], adapter, capture,
            ).explained_probs()
            for number in range(n_permutations)
        ]
    )  # (n_permutations, B, C)
    tvd = 0.5 * (permuted - original_probs).abs().sum(dim=-1)
    jsd = js_divergence(permuted, original_probs.expand_as(permuted))
    flips = (permuted.argmax(dim=-1) != original_probs.argmax(dim=-1)).float()
    return PermutationResult(tvd.median(dim=0).values, jsd.median(dim=0).values, flips.mean(dim=0))


@without_autocast("permutation_accuracy")
def permutation_accuracy(
    forward_func: Callable[..., Any],
    data: Iterable[tuple[Tensor, Tensor, Tensor]],
    model: nn.Module | None = None,
    layers: Sequence[int | list[int] | None] | None = None,
    seed: int = 0,
    progress: bool = True,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
) -> dict[str, float]:
    """Accuracy over a data set without and with permuted attention, per layer.

    Args:
        forward_func (Callable): ``forward_func(input_ids, attention_mask)`` returns logits.
        data (iterable): batches ``(input_ids, attention_mask, labels)``, e.g. a DataLoader.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (sequence, optional): the settings to compare, each a layer, a list of
            layers or None (all). Default: each layer alone, then all layers.
        seed (int, optional): seed of the permutations, with each example's own
            inputs (its result does not depend on the batch it comes in). Default: 0.
        progress (bool, optional): show a progress bar. Default: True.
        adapter (AttentionAdapter, optional): how to find the attention.
        capture (str, optional): ``"streaming"`` permutes blocks of recomputed rows and
            weights the values with them (the same permutations as ``"eager"``, which
            permutes explicit probability maps); ``"auto"`` streams where the model
            allows it. Default: ``"auto"``.

    Returns:
        ``{"original": accuracy, "layer 0": ..., "all layers": ...}``.
    """
    from tqdm.auto import tqdm

    model = resolve_model(forward_func, model)
    correct: dict[str, float] = {}
    total = 0
    for ids, mask, labels in tqdm(data, desc="permuting attention", disable=not progress):
        original = run_model(forward_func, model, ids, (mask,), adapter=adapter, capture=capture)
        settings = layers if layers is not None else [*range(original.num_calls), None]
        outcomes = {"original": original.explained_probs()}
        seeds = example_seeds_of(ids, original, seed)
        for number, setting in enumerate(settings):
            chosen = layer_set(setting, original.num_calls)
            name = "all layers" if setting is None else f"layer {setting}"
            permutation = _RowPermutation(original, chosen, None, seeds, number)
            outcomes[name] = run_model(forward_func, model, ids, (mask,), [permutation], adapter, capture).explained_probs()
        for name, probs in outcomes.items():
            hits = (probs.argmax(dim=-1).cpu() == labels.cpu()).sum().item()
            correct[name] = correct.get(name, 0) + hits
        total += len(labels)
    if total == 0:
        raise ValueError("data is empty: give at least one batch.")
    return {name: hits / total for name, hits in correct.items()}
