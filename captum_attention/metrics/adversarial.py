"""Adversarial attention and adversarial keys: how different can the attention be for the same output?

- :func:`adversarial_attention` (Jain & Wallace, "Attention is not Explanation", NAACL
  2019, §4): per example, search for attention as far as possible from the model's
  (Jensen-Shannon divergence) while the output distribution stays within ε in total
  variation distance. Large divergences within ε mean the attention is one of many that
  explain the decision equally well.
- :func:`adversarial_keys` (the transformer variant of Vafaie et al.'s poster "Is
  Attention Explanation in Transformers?", University of Ottawa): per example, move the
  key vectors as far as possible while the decision stays, minimising
  ``α·CE(output, original decision) − (1 − α)·‖k − k_adv‖₂``.

Both optimise per-example tensors with Adam for a fixed number of steps, batched (each
example's loss depends on its own tensors only and Adam is element-wise, so the examples
of a batch do not influence each other), each from a random start drawn from ``seed``
and the example's own inputs: an example's search is the same alone as in any batch.
The model's parameters and their ``.grad`` are never touched: gradients are taken with
``torch.autograd.grad`` with respect to the searched tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import UnsupportedModelError
from ..capture import AttentionAdapter, ForwardRecord, KeysTransform, ProbsIntervention
from ..capture.inputs import QueryIndex, take_rows
from ..capture.runner import resolve_model
from ..capture.record import without_autocast
from ..maps import hashed_normal, on_heads
from ._forward import example_seeds_of, js_divergence, layer_set, ranks_of, run_model, select_rows

Rows = Literal["all", "query"]

MARGIN = 0.8
"""The penalty starts at ``MARGIN · ε``: a hinge at ε itself balances the divergence's pull
just outside ε, where no point counts."""

NEAR_SCALE = 0.01
"""Standard deviation of the start next to the model's attention (δ ≈ 0): it begins within
ε and moves out, which finds allowed points on models too sensitive for the other starts."""

PENALTY_GROWTH = 1.25
"""Each step an example's output is beyond ``MARGIN · ε``, its penalty weight grows by this
factor (from ``penalty``), so that the search comes back within ε on sensitive models."""


@dataclass
class AdversarialAttentionResult:
    """Per example: ``js_divergence`` (bits), the largest mean JS divergence from the
    model's attention reached with the output within ε; ``tvd``, the output's total
    variation distance there; ``within_epsilon``, whether any searched point kept the
    output within ε (else the two are 0); ``js_bound``, the largest mean divergence any
    attention could reach on those rows (each row moved to its least-attended key: JS is
    convex, so the maximum over distributions is at a vertex); ``attention``, per chosen
    call, the ``(B, H, Q, K)`` adversarial attention found (the model's where nothing was
    found)."""

    js_divergence: Tensor
    tvd: Tensor
    within_epsilon: Tensor
    js_bound: Tensor
    attention: list[Tensor]


@dataclass
class AdversarialKeysResult:
    """Per example: ``distance``, the largest ``‖k − k_adv‖₂`` (over the chosen calls,
    heads and real keys) reached with the decision unchanged; ``relative_distance``, that
    over ``‖k‖₂`` of the same entries; ``decision_kept``, whether any searched point kept
    the decision (else both are 0); ``key_shifts``, per chosen call, the ``(B, KV heads, K,
    D)`` shift ``k_adv − k`` found."""

    distance: Tensor
    relative_distance: Tensor
    decision_kept: Tensor
    key_shifts: list[Tensor]


@without_autocast("adversarial_attention")
def adversarial_attention(
    forward_func: Callable[..., Any],
    inputs: Tensor | tuple[Tensor, ...],
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layers: int | list[int] | None = None,
    heads: Sequence[int] | None = None,
    epsilon: float = 0.01,
    rows: Rows = "all",
    steps: int = 100,
    lr: float = 0.3,
    penalty: float = 10.0,
    init_scale: float = 1.0,
    seed: int = 0,
    query_index: QueryIndex = None,
    adapter: AttentionAdapter | None = None,
) -> AdversarialAttentionResult:
    r"""The most different attention that keeps the output within ε (Jain & Wallace, §4).

    The attention logits (the softmax's input) of the chosen layers and heads get a
    per-example additive shift δ; masked keys stay masked. Adam maximises, per example,

    .. math::

        \mathrm{JS}(A, \mathrm{softmax}(S + \delta)) - \lambda \cdot
        \max\big(0, \mathrm{TVD}(\hat y(\delta), \hat y) - 0.8\,\epsilon\big)

    with JS averaged over the chosen heads and rows (in bits) and TVD between the output
    distributions; the hinge starts at 0.8·ε, and λ (from ``penalty``) grows by a quarter
    every step an example stays beyond it. It runs from three starts: δ ~ N(0, σ²) with
    σ = ``init_scale`` (Jain & Wallace's random start); the same noise scaled to σ = 0.01,
    next to the model's attention, which begins within ε and finds allowed points on
    sensitive models; and the inverted attention softmax(−S) (δ = −2·log A plus the
    noise), next to the largest divergence, which wins where the output ignores the
    attention (from there the softmax is saturated and the penalty's gradient small where ε
    binds). The result is, per example, the best point any run saw that keeps TVD ≤ ε.
    The three starts run side by side, the batch repeated three times: ``steps`` forward
    and backward passes of three times the batch (and three times its attention maps in
    memory). Eager capture (the softmax's input is needed).

    Args:
        forward_func (Callable): the model's forward; logits ``(batch, classes)`` or a
            language model's ``(batch, seq_len, vocab)`` (read at the explained position).
        inputs (Tensor or tuple): token ids (embeddings, pixels); a pair for
            encoder-decoders.
        additional_forward_args (Any, optional): e.g. ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (int or list of int, optional): attention calls to search at (negative
            counts from the end). Default: None, all.
        heads (sequence of int, optional): heads to search at. Default: None, all.
        epsilon (float, optional): largest output TVD allowed. Default: 0.01.
        rows (str, optional): ``"all"`` real query rows, or ``"query"``: only the
            explained position's row (a pooling call's rows). Default: ``"all"``.
        steps (int, optional): optimisation steps per start (one forward and backward
            each). Default: 100.
        lr (float, optional): Adam's learning rate. Default: 0.3.
        penalty (float, optional): λ, the weight of the TVD excess. Default: 10.0.
        init_scale (float, optional): standard deviation of δ's random start. Default: 1.0.
        seed (int, optional): seed of the random start, with each example's own inputs
            (its start, and so its result, do not depend on the batch). Default: 0.
        query_index (int or Tensor, optional): the explained position (decoders).
            Default: None, the default position.
        adapter (AttentionAdapter, optional): how to find the attention.

    Returns:
        :class:`AdversarialAttentionResult`.

    Example::

        >>> found = adversarial_attention(model, input_ids, (mask,), layers=[-1], epsilon=0.01)
        >>> found.js_divergence, found.js_bound
    """
    model = resolve_model(forward_func, model)
    _check_budget(steps, lr, epsilon)
    if rows not in ("all", "query"):
        raise ValueError(f'rows must be "all" or "query", got {rows!r}.')
    with torch.no_grad():
        base = run_model(forward_func, model, inputs, additional_forward_args, adapter=adapter, capture="eager", query_index=query_index)
    chosen = sorted(layer_set(layers, base.num_calls))
    base.check_heads(heads, chosen)
    seeds = example_seeds_of(inputs, base, seed)
    noise = [_attention_noise(base, c, seeds, base.attn_maps[c]) for c in chosen]
    starts = [
        [n * init_scale for n in noise],
        [n * NEAR_SCALE for n in noise],
        [n * init_scale - 2 * _log_attention(base.attn_maps[c]) for n, c in zip(noise, chosen)],
    ]
    weights = {c: _row_weights(base, c, heads, rows) for c in chosen}
    original = base.explained_probs()
    # The starts run side by side: the batch once per start, each copy with its own shifts.
    batch, count = len(original), len(starts)
    copies = torch.arange(batch).repeat(count)
    search_inputs, search_args = select_rows(inputs, additional_forward_args, copies)
    search_query = take_rows(query_index, copies, batch)
    search_weights = {c: w.repeat(count, 1, 1) for c, w in weights.items()}
    search_attn = {c: base.attn_maps[c].repeat(count, 1, 1, 1) for c in chosen}
    reference = original.repeat(count, 1)
    shifts = [torch.cat([start[i] for start in starts]).requires_grad_() for i in range(len(chosen))]
    weight = torch.full_like(reference[:, 0], penalty)  # λ per example and start
    found: dict[int, list[Tensor]] = {}

    def shifted(call: int, attn: Tensor, first_head: int, scores: Tensor | None) -> Tensor:
        if call not in search_weights:
            return attn
        if scores is None:
            raise RuntimeError("adversarial_attention needs the softmax's input (the attention logits) of every chosen call.")
        shift = shifts[chosen.index(call)][:, first_head : first_head + attn.shape[1]]
        if scores.shape[-1] != shift.shape[-1]:
            raise UnsupportedModelError(
                "adversarial_attention shifts the logits of the tokens' keys, but this model's attention softmax "
                f"holds {scores.shape[-1] - shift.shape[-1]} more column(s) (attention sinks), which it does not model."
            )
        masked = scores <= torch.finfo(scores.dtype).min / 2
        new = (scores.float() + shift).masked_fill(masked, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        rows_kept = search_weights[call][:, first_head : first_head + attn.shape[1], :, None] > 0
        new = on_heads(attn.float(), torch.where(rows_kept, new, attn.float()), base.heads_of(call, heads), first_head)
        found.setdefault(call, []).append(new)
        return new.to(attn.dtype)

    def evaluate() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        found.clear()
        run = run_model(
            forward_func, model, search_inputs, search_args, [ProbsIntervention(shifted)], adapter, "eager",
            track_grad=True, query_index=search_query,
        )
        tvd = 0.5 * (run.explained_probs() - reference).abs().sum(dim=-1)
        divergence = torch.stack([_mean_js(search_attn[c], torch.cat(found[c], dim=1), search_weights[c]) for c in chosen]).mean(0)
        excess = (tvd - MARGIN * epsilon).clamp(min=0.0)
        loss = -divergence + weight.clone() * excess
        weight.mul_(torch.where(excess.detach() > 0, PENALTY_GROWTH, 1.0))  # until the example is back within ε
        return loss, divergence.detach(), tvd.detach() <= epsilon, tvd.detach()

    value, companion, allowed, at = _search(shifts, evaluate, steps, lr)
    searches = [
        (value[start], companion[start], allowed[start], [shift[start] for shift in at])
        for start in (slice(i * batch, (i + 1) * batch) for i in range(count))
    ]
    best, aux, ok, best_shifts = functools.reduce(_better, searches)
    attention = []
    for c, shift in zip(chosen, best_shifts):
        attention.append(_adversarial_maps(base, c, shift, weights[c], heads, ok))
    bound = torch.stack([_mean_js_bound(base.attn_maps[c], weights[c]) for c in chosen]).mean(0)
    return AdversarialAttentionResult(best, aux, ok, bound, attention)


@without_autocast("adversarial_keys")
def adversarial_keys(
    forward_func: Callable[..., Any],
    inputs: Tensor | tuple[Tensor, ...],
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    layers: int | list[int] | None = None,
    heads: Sequence[int] | None = None,
    alpha: float = 0.5,
    steps: int = 100,
    lr: float = 0.1,
    init_scale: float = 0.01,
    seed: int = 0,
    query_index: QueryIndex = None,
    adapter: AttentionAdapter | None = None,
) -> AdversarialKeysResult:
    r"""The farthest keys that keep the decision (the poster's transformer variant).

    The keys the attention kernel receives at the chosen calls (after rotary embeddings;
    with grouped-query attention, the key heads) get a per-example shift δ on the real
    keys. Adam minimises, per example,

    .. math::

        \alpha \cdot \mathrm{CE}(\hat y(k + \delta), y) - (1 - \alpha) \cdot \lVert \delta \rVert_2

    with y the model's original decision, starting from δ ~ N(0, σ²) with σ = ``init_scale``. The
    result is the largest ``‖δ‖₂`` seen with the decision unchanged. Runs through the
    streaming capture (models whose attention goes through transformers' attention
    interface).

    Args:
        forward_func (Callable): the model's forward.
        inputs (Tensor or tuple): token ids (embeddings, pixels).
        additional_forward_args (Any, optional): e.g. ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): module holding the attention. Default: forward_func.
        layers (int or list of int, optional): attention calls whose keys move. Default:
            None, all.
        heads (sequence of int, optional): key heads that move. Default: None, all.
        alpha (float, optional): α in (0, 1), the weight of keeping the decision.
            Default: 0.5.
        steps (int, optional): optimisation steps. Default: 100.
        lr (float, optional): Adam's learning rate. Default: 0.1.
        init_scale (float, optional): standard deviation of δ's random start. Default: 0.01.
        seed (int, optional): seed of the random start, with each example's own inputs
            (its start, and so its result, do not depend on the batch). Default: 0.
        query_index (int or Tensor, optional): the explained position (decoders).
        adapter (AttentionAdapter, optional): how to find the attention.

    Returns:
        :class:`AdversarialKeysResult`.

    Example::

        >>> moved = adversarial_keys(model, input_ids, (mask,), layers=[0])
        >>> moved.relative_distance
    """
    model = resolve_model(forward_func, model)
    _check_budget(steps, lr, 1.0)
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}.")
    with torch.no_grad():
        base = run_model(
            forward_func, model, inputs, additional_forward_args, adapter=adapter, capture="streaming", query_index=query_index,
        )
    chosen = sorted(layer_set(layers, base.num_calls))
    keys = {c: base.kernel_calls[c].key for c in chosen}
    key_heads = {c: keys[c].shape[1] for c in chosen}
    for c in chosen:
        _check_key_heads(heads, key_heads[c], c)
    masks = {c: _key_mask(base, c, heads, keys[c]) for c in chosen}
    seeds = example_seeds_of(inputs, base, seed)
    shifts = [(_key_noise(base, c, seeds, keys[c]) * init_scale).requires_grad_() for c in chosen]
    decision = base.explained_logits().argmax(dim=-1)
    key_norm = _distance([keys[c] * masks[c] for c in chosen])

    def shifted_keys(call: int) -> Callable[[Tensor], Tensor] | None:
        if call not in masks:
            return None
        return lambda key: key + (shifts[chosen.index(call)] * masks[call]).to(key.dtype)

    def evaluate() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        run = run_model(
            forward_func, model, inputs, additional_forward_args, [KeysTransform(shifted_keys)], adapter, "streaming",
            track_grad=True, query_index=query_index,
        )
        logits = run.explained_logits().float()
        distance = _distance([s * masks[c] for s, c in zip(shifts, chosen)])
        loss = alpha * F.cross_entropy(logits, decision, reduction="none") - (1 - alpha) * distance
        return loss, distance.detach(), logits.argmax(dim=-1) == decision, distance.detach() / key_norm.clamp(min=1e-30)

    best, relative, kept, best_shifts = _search(shifts, evaluate, steps, lr)
    return AdversarialKeysResult(best, relative, kept, [s * masks[c] for s, c in zip(best_shifts, chosen)])


def _search(
    shifts: list[Tensor], evaluate: Callable[[], tuple[Tensor, Tensor, Tensor, Tensor]], steps: int, lr: float
) -> Search:
    """Adam on ``shifts`` for ``steps`` evaluations; ``evaluate()`` gives per example the
    loss, the value to maximise, whether the point is allowed, and a companion figure.
    Returns per example the best allowed value, its companion, whether one was found, and
    the shifts that gave it (zero where none)."""
    optimiser = torch.optim.Adam(shifts, lr=lr)
    loss, value, allowed, companion = evaluate()
    best, aux, found = torch.zeros_like(value), torch.zeros_like(companion), torch.zeros_like(allowed)
    best_shifts = [torch.zeros_like(s) for s in shifts]
    for step in range(steps):
        if step:
            loss, value, allowed, companion = evaluate()
        better = allowed & (~found | (value > best))
        best, aux, found = torch.where(better, value, best), torch.where(better, companion, aux), found | allowed
        for kept, shift in zip(best_shifts, shifts):
            kept[better] = shift.detach()[better]
        if step < steps - 1:
            grads = torch.autograd.grad(loss.sum(), shifts)
            for shift, grad in zip(shifts, grads):
                shift.grad = grad
            optimiser.step()
    return best, aux, found, best_shifts


def _log_attention(attn: Tensor) -> Tensor:
    """log A on the keys a row attends to, 0 elsewhere: δ = −2·log A turns softmax(S) into
    softmax(−S) (S = log A + a per-row constant)."""
    return attn.float().clamp(min=1e-30).log().masked_fill(attn <= 0, 0.0)


Search = tuple[Tensor, Tensor, Tensor, list[Tensor]]


def _better(first: Search, second: Search) -> Search:
    """Per example, the search that found an allowed point with the larger value."""
    value, aux, found, shifts = first
    other_value, other_aux, other_found, other_shifts = second
    take = other_found & (~found | (other_value > value))
    chosen = [torch.where(take.view(-1, *[1] * (a.dim() - 1)), b, a) for a, b in zip(shifts, other_shifts)]
    return (
        torch.where(take, other_value, value), torch.where(take, other_aux, aux), found | other_found, chosen,
    )


def _check_budget(steps: int, lr: float, epsilon: float) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}.")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr}.")
    if not 0 < epsilon <= 1:
        raise ValueError(f"epsilon must be in (0, 1] (a total variation distance), got {epsilon}.")


def _row_weights(base: ForwardRecord, call: int, heads: Sequence[int] | None, rows: Rows) -> Tensor:
    """``(B, H, Q)`` float: 1 on the chosen heads' searched rows, else 0."""
    attn = base.attn_maps[call]
    role = base.roles[call]
    real_queries = base.real_of(role)[0].to(attn.device)
    if rows == "query" and role != "pooling":
        if not base.queries_are_explained(call):
            raise ValueError(f"rows='query': attention call {call} ({role}) has no explained query row; use rows='all'.")
        real_queries = torch.zeros_like(attn[:, 0, :, 0], dtype=torch.bool)
        real_queries[torch.arange(len(real_queries)), base.query_index.to(attn.device)] = True
    chosen_heads = base.heads_of(call, heads)
    on = torch.zeros(attn.shape[1], dtype=torch.bool, device=attn.device)
    on[chosen_heads if chosen_heads is not None else slice(None)] = True
    return (real_queries.expand(attn.shape[0], attn.shape[2])[:, None, :] & on[None, :, None]).float()


def _mean_js(attn: Tensor, new: Tensor, weights: Tensor) -> Tensor:
    """``(B,)`` weighted mean over heads and rows of JS(attn row, new row), bits."""
    divergence = js_divergence(attn.float(), new)
    return (divergence * weights).flatten(1).sum(1) / weights.flatten(1).sum(1).clamp(min=1)


def _mean_js_bound(attn: Tensor, weights: Tensor) -> Tensor:
    """``(B,)`` weighted mean over rows of max_j JS(a, e_j) over the keys the row can
    attend to (probability > 0), in closed form:
    JS(a, e_j) = ½[(1 − a_j) + a_j·log2(2a_j / (1 + a_j)) + log2(2 / (1 + a_j))]."""
    a = attn.double()
    vertex = 0.5 * ((1 - a) + a * torch.log2(2 * a / (1 + a)).nan_to_num(0.0) + torch.log2(2 / (1 + a)))
    best = vertex.masked_fill(a <= 0, 0.0).amax(dim=-1).float()
    return (best * weights).flatten(1).sum(1) / weights.flatten(1).sum(1).clamp(min=1)


def _adversarial_maps(
    base: ForwardRecord, call: int, shift: Tensor, weights: Tensor, heads: Sequence[int] | None, found: Tensor
) -> Tensor:
    """The adversarial ``(B, H, Q, K)`` attention of a call from its best shift (the
    model's own where nothing was found), recomputed from the model's probabilities:
    softmax(S + δ) = normalise(A · exp(δ)) over the keys A attends to."""
    attn = base.attn_maps[call].double()
    weighted = attn * torch.exp(shift.double() - shift.double().amax(dim=-1, keepdim=True))
    new = (weighted / weighted.sum(dim=-1, keepdim=True).clamp(min=1e-300)).float()
    searched = (weights[..., None] > 0) & found[:, None, None, None].to(attn.device)
    return torch.where(searched, new, attn.float())


def _check_key_heads(heads: Sequence[int] | None, num_heads: int, call: int) -> None:
    wrong = [h for h in heads or [] if not isinstance(h, int) or not -num_heads <= h < num_heads]
    if wrong or (heads is not None and not list(heads)):
        raise ValueError(
            f"heads {wrong or list(heads or [])} do not exist: attention call {call} has {num_heads} key "
            f"heads (valid: {-num_heads}..{num_heads - 1}, or None for all)."
        )


def _key_mask(base: ForwardRecord, call: int, heads: Sequence[int] | None, key: Tensor) -> Tensor:
    """``(B, KV heads, K, 1)`` float: 1 on the real keys of the chosen key heads."""
    real_keys = base.real_of(base.roles[call])[1].to(key.device)  # causal: up to the query, all it sees
    on = torch.zeros(key.shape[1], dtype=torch.bool, device=key.device)
    on[[h % key.shape[1] for h in heads] if heads is not None else slice(None)] = True
    return (real_keys[:, None, :, None] & on[None, :, None, None]).float()


def _attention_noise(base: ForwardRecord, call: int, seeds: Tensor, attn: Tensor) -> Tensor:
    """``(B, H, Q, K)`` standard normal draws for the call's attention logits, hashed from
    each example's seed, the head and the row's and key's places among its real tokens:
    the same start in any batch, under any padding."""
    query_ranks, key_ranks = (ranks.to(attn.device) for ranks in ranks_of(base, call))
    key_ranks = F.pad(key_ranks, (0, attn.shape[-1] - key_ranks.shape[-1]), value=key_ranks.shape[-1])  # a sink's column
    heads = torch.arange(attn.shape[1], device=attn.device)
    return hashed_normal(
        seeds.to(attn.device)[:, None, None, None], call, heads[None, :, None, None],
        query_ranks[:, None, :, None], key_ranks[:, None, None, :],
    )


def _key_noise(base: ForwardRecord, call: int, seeds: Tensor, key: Tensor) -> Tensor:
    """``(B, KV heads, K, D)`` standard normal draws for the call's keys, hashed as
    :func:`_attention_noise` draws, from the key head, the key's place and the feature."""
    key_ranks = ranks_of(base, call)[1].to(key.device)
    heads, features = torch.arange(key.shape[1], device=key.device), torch.arange(key.shape[-1], device=key.device)
    return hashed_normal(
        seeds.to(key.device)[:, None, None, None], call, heads[None, :, None, None], key_ranks[:, None, :, None], features,
    ).to(key.dtype)


def _distance(shifts: list[Tensor]) -> Tensor:
    """``(B,)`` Euclidean norm of all the shifts of each example together."""
    squared = torch.stack([s.float().pow(2).flatten(1).sum(1) for s in shifts]).sum(0)
    return squared.clamp(min=1e-30).sqrt()
