"""The record of one forward pass through the capture, which attributions and metrics read.

:func:`record_forward` runs the user's forward function once with the model's attention
captured (and, optionally, intervened on) and returns a :class:`ForwardRecord`: the logits,
the attention of every call, which tokens are real on the source and target side, the
explained query position per example, and whether the self-attention is causal.
:meth:`ForwardRecord.with_gradients` adds each call's reduction of (A, dS/dA) from one
backward pass.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar, cast

import captum
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .._compat import StreamingUnsupported, TargetType, UnsupportedModelError, format_additional_forward_args, run_forward
from ..maps.common import (
    has_later_keys, is_tensor_subclass, last_query, mask_prefix_seen_both_ways, prefix_seen_both_ways, query_rows, query_weights,
    real_tokens,
)
from ..maps.kernel import KernelCall
from .adapters import AttentionAdapter
from .adapters.images import leading_image_features
from .inputs import (
    LogProbTarget, QueryIndex, class_probabilities, forced_first_token, forced_tokens, outside_inference_mode, output_logits,
    outside_vocabulary, query_positions, query_row_weights, resolve_targets, rows_beginning_with_bos,
)
from .probes import EmbeddedIds, GradientReduction, GradMode, KeyBiases, LastCallGraph, MaskShape, PerCall, Probe, TowerInputs
from .recorder import AttentionCapture, autocast_on
from .runner import image_tower_refusal, resolve_adapter

HeadReduction = Callable[[Tensor, Tensor], Tensor]
"""``reduce(attn_maps, attn_grads) -> (B, Q, K)``: one call's (A, dS/dA) reduced over heads."""

ResultT = TypeVar("ResultT")


@dataclass
class OutputGrads(PerCall):
    """Streaming records: per attention call, dS/dO ``(B, Q, H, Dv)``
    (:meth:`ForwardRecord.with_output_gradients`)."""

    grads: list[Tensor]


@dataclass
class KeyBiasGrads(PerCall):
    """Streaming records: per attention call, dS/d(its :class:`KeyBiases`), ``(B, H /
    groups, K)``: Σ over the query rows and each key head's query heads of dS/dlogits;
    None where the call carried no bias (:meth:`ForwardRecord.with_output_gradients`)."""

    grads: list[Tensor | None]


@dataclass
class ForwardRecord:
    """One forward pass through the capture layer: a small core, and typed results.

    Attributes:
        logits: ``(B, C)``, or a language model's ``(B, T, V)``.
        attn_maps: eager records: per attention call, ``(B, H, Q, K)`` float maps, the
            probabilities as they weighted the values (detached), or what a method
            reduces in their place (effective attention); empty for a streaming record.
        head_counts: per attention call, the number of heads.
        roles: per attention call, ``"self"``, or ``"encoder"``/``"decoder"``/``"cross"``.
        target_real: ``(B, T)`` bool, the real tokens of the explained sequence (the
            target sequence of an encoder-decoder); for causal attention only those up to
            the query, which is all a decoder's explanation of that position can see.
        source_real: ``(B, S)`` bool real source tokens of an encoder-decoder, else None.
        query_index: ``(B,)`` long, the explained query position per example; or, for a
            span, ``(B, T)`` float weights of the explained query rows (every row-reducing
            method reads their weighted sum: :func:`~captum_attention.maps.query_weights`).
        causal: whether the explained sequence's self-attention never looks ahead (but
            within ``prefix``).
        capture: the capture of the call (its probabilities still in the autograd graph
            when gradients are tracked).
        kernel_calls: streaming records: per attention call, what the kernel received
            (the probabilities are recomputed from it block by block); empty for an eager
            record.
        results: the probes' results and what was derived from the pass (gradients,
            relevance), by type; read them with :meth:`result`.
        prefix: for a causal record whose leading tokens see each other both ways (a
            prefix language model's: PaliGemma's image and prompt, Gemma 3's images),
            ``(B,)`` long, one past the last key an earlier query sees; else None.
        leading: how many positions the model put before the input tokens, which no input
            token stands for (GIT's image features); every position of the record counts
            them, the inputs' ``(B, N)`` tokens are its last N.
    """

    logits: Tensor
    attn_maps: list[Tensor]
    head_counts: list[int]
    roles: list[str]
    target_real: Tensor
    source_real: Tensor | None
    query_index: Tensor
    causal: bool
    capture: AttentionCapture
    kernel_calls: list[KernelCall] = field(default_factory=list)
    results: dict[type, Any] = field(default_factory=dict)
    prefix: Tensor | None = None
    leading: int = 0

    @property
    def streaming(self) -> bool:
        return bool(self.kernel_calls)

    def result(self, kind: type[ResultT]) -> ResultT:
        """The result of type ``kind`` (a probe's, or :class:`GradMaps`,
        :class:`OutputGrads`, ...), or a clear error where the pass has none."""
        found = self.results.get(kind)
        if found is None:
            raise RuntimeError(
                f"This forward record has no {kind.__name__}: run the forward with the probe "
                "that produces it (or derive it first, e.g. with_gradients)."
            )
        return cast(ResultT, found)

    def with_result(self, value: Any) -> "ForwardRecord":
        """This record with ``value`` kept as its result of that type."""
        return replace(self, results={**self.results, type(value): value})

    @property
    def num_calls(self) -> int:
        """How many attention calls the pass made (an encoder-decoder layer makes several)."""
        return len(self.roles)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.source_real is not None

    def over_positions(self, per_token: Tensor, fill: Any) -> Tensor:
        """``per_token`` ``(B, N)`` values of the input tokens over the record's positions:
        ``fill`` at the positions the model put before them (GIT's image features)."""
        return F.pad(per_token, (self.leading, 0), value=fill) if self.leading else per_token

    @property
    def input_real(self) -> Tensor:
        """``(B, T)`` bool real tokens of the inputs that per-token arguments (erased keys,
        rankings) refer to: the source tokens of an encoder-decoder, else the tokens."""
        return self.target_real if self.source_real is None else self.source_real

    def explained_logits(self) -> Tensor:
        """``(B, C)``: classifier logits as they are, language-model logits at the query
        (at a span's last position)."""
        if self.logits.dim() == 3:
            batch = torch.arange(len(self.query_index), device=self.logits.device)
            return self.logits[batch, last_query(self.query_index).to(self.logits.device)]
        return self.logits

    def explained_finite(self) -> Tensor:
        """``(B,)`` bool: whether every explained logit is finite (at each query row of a
        span)."""
        if self.logits.dim() == 3 and self.query_index.dim() == 2:
            read = self.query_index.to(self.logits.device) != 0
            return (torch.isfinite(self.logits).all(dim=-1) | ~read).all(dim=1)
        return torch.isfinite(self.explained_logits()).all(dim=-1)

    def explained_probs(self) -> Tensor:
        """``(B, C)`` float32 class probabilities of :meth:`explained_logits`
        (:func:`~captum_attention.capture.inputs.class_probabilities`: one logit's sigmoid
        beside its complement)."""
        return class_probabilities(self.explained_logits())

    def target_score(self, target: TargetType | LogProbTarget) -> Tensor:
        """S: the sum over examples of the ``target`` logit at the explained position
        (None: the predicted class), or a :class:`LogProbTarget`'s summed
        log-probabilities, in the autograd graph."""
        if isinstance(target, LogProbTarget):
            with torch.enable_grad():
                return target.score(self.logits)
        with torch.enable_grad():  # callers such as NoiseTunnel run under no_grad: the query's rows in the graph too
            logits = self.explained_logits()
            return logits.gather(1, resolve_targets(logits, target)[:, None]).sum()

    def with_gradients(
        self, target: TargetType | LogProbTarget, reduction: HeadReduction, retain_graph: bool = False
    ) -> "ForwardRecord":
        """This record with :class:`GradMaps`: ``reduction`` of each call's (A, dS/dA) for
        S = :meth:`target_score` (A: the record's maps)."""
        score = self.target_score(target)
        reduced = GradientReduction(reduction)
        with torch.enable_grad():
            self.capture.run_backward(score, [reduced], retain_graph, self.attn_maps)
        return self.with_result(reduced.result())

    def with_output_gradients(self, target: TargetType | LogProbTarget, retain_graph: bool = False) -> "ForwardRecord":
        """A streaming record with :class:`OutputGrads`: dS/dO of every call for S =
        :meth:`target_score`; and :class:`KeyBiasGrads` where the forward's calls carried
        :class:`KeyBiases`."""
        score = self.target_score(target)
        biases = self.results.get(KeyBiases)
        with torch.enable_grad():
            grads, bias_grads = self.capture.output_gradients(score, retain_graph, biases.biases if biases else ())
        record = self.with_result(OutputGrads(grads))
        return record.with_result(KeyBiasGrads(bias_grads)) if biases else record

    def head_rows(self) -> Tensor:
        """``(B, L, H, K)`` float32: every call's and head's attention at the explained
        query rows (a span's weighted sum of rows), from the maps (eager) or recomputed
        from each kernel call (streaming); an error where the calls differ in shape."""
        if self.streaming:
            per_call = [call.rows_at(self.query_index.to(call.query.device)) for call in self.kernel_calls]
        else:
            weights = query_weights(self.query_index, self.target_real.shape[1])
            per_call = [torch.einsum("bq,bhqk->bhk", weights.to(maps.device), maps.float()) for maps in self.attn_maps]
        shapes = sorted({tuple(rows.shape) for rows in per_call})
        if len(shapes) != 1:
            raise ValueError(f"Every attention call's heads are weighed together, but this model's calls differ in shape ({shapes}).")
        return torch.stack([rows.float().to(per_call[0].device) for rows in per_call], dim=1)

    @property
    def forward_real(self) -> Tensor:
        """``(B, N)`` bool, the real tokens of the forward: the record's, and under a
        causal record the ones after its last query too (cut from its real tokens when
        it explains one row of an answer, and real for the next row)."""
        real = self.target_real
        if not self.causal:
            return real
        positions = torch.arange(real.shape[1], device=real.device)
        return real | (positions[None, :] > self._last_seen(self.query_index))

    def at_query(self, query_index: Tensor) -> "ForwardRecord":
        """This record explaining ``query_index`` instead (a causal sequence's real tokens
        are cut after it, or after the prefix its tokens see both ways)."""
        if not self.causal:
            return replace(self, query_index=query_index)
        positions = torch.arange(self.target_real.shape[1], device=self.target_real.device)
        return replace(self, query_index=query_index, target_real=self.target_real & (positions[None, :] <= self._last_seen(query_index)))

    def _last_seen(self, query_index: Tensor) -> Tensor:
        """``(B, 1)``: the last token that the queries up to ``query_index`` (and the
        tokens they see) can see: the last query, or the prefix's last token."""
        last = last_query(query_index.to(self.target_real.device))
        if self.prefix is not None:
            last = last.maximum(self.prefix.to(last.device) - 1)
        return last[:, None]

    def of_role(self, role: str) -> "ForwardRecord":
        """Only the calls of one role (e.g. the decoder's self-attention)."""
        chosen = [i for i, r in enumerate(self.roles) if r == role]

        def pick(values: list[Any]) -> list[Any]:
            return [values[i] for i in chosen] if values else []

        results = {kind: r.select(chosen) if isinstance(r, PerCall) else r for kind, r in self.results.items()}
        return replace(
            self, attn_maps=pick(self.attn_maps), head_counts=pick(self.head_counts), roles=pick(self.roles),
            kernel_calls=pick(self.kernel_calls), results=results,
        )

    def real_of(self, role: str) -> tuple[Tensor, Tensor]:
        """``(real queries, real keys)`` of a call with this role: the source tokens for the
        encoder's self-attention and cross-attention keys, else the explained sequence. A
        pooling call's queries are no tokens: all real, ``(B, 1)`` (broadcast over them)."""
        if role == "pooling":
            return torch.ones_like(self.target_real[:, :1]), self.target_real
        source = self.input_real
        queries = source if role == "encoder" else self.target_real
        keys = self.target_real if role in ("self", "decoder") else source
        return queries, keys

    def visible_keys(self, call: int) -> tuple[Tensor, Tensor]:
        """``(B, Q or 1, K)`` bool, the keys each query row of the call sees (its real keys
        and, under a causal mask, only those up to the row), and ``(B, Q or 1)`` bool, which
        rows are real queries."""
        role = self.roles[call]
        queries, keys = self.real_of(role)
        if not (self.causal and role in ("self", "decoder")):
            return keys[:, None, :], queries
        if self.prefix is not None:
            raise UnsupportedModelError(
                "This forward's leading tokens see each other both ways (a prefix language model's image tokens), and "
                "which keys each of their rows sees is not tracked: effective attention and the permutation test "
                "need it; call the model without the token types that make its prefix bidirectional."
            )
        # the record's real tokens stop at the query; later rows see further
        mask = self.capture.decoder_attention_mask if role == "decoder" else self.capture.attention_mask
        keys = real_tokens(mask, keys.shape[0], keys.shape[1], keys.device)
        later = torch.ones(keys.shape[-1], keys.shape[-1], dtype=torch.bool, device=keys.device).triu(1)
        return keys[:, None, :] & ~later, keys

    @property
    def pooling(self) -> list[bool]:
        """Per call, whether its queries are no tokens (the model's readout)."""
        return [role == "pooling" for role in self.roles]

    @property
    def pooling_calls(self) -> list[int]:
        """The calls whose queries are not tokens (the model's readout), after all others."""
        return [i for i, role in enumerate(self.roles) if role == "pooling"]

    def explained_row(self, call: int, layer_map: Tensor) -> Tensor:
        """``(B, K)``: the row of the call's ``(B, Q, K)`` map that explains the output:
        the query token's row, or, for a pooling call, the mean of its rows."""
        if self.roles[call] == "pooling":
            return layer_map.mean(dim=1)
        return query_rows(layer_map, self.query_index.to(layer_map.device))

    def readout(self, layer_maps: list[Tensor], first: int = 0) -> tuple[list[Tensor], Tensor | None]:
        """Per-call maps split into the token calls' maps from ``first`` on (forward order)
        and the readout row: the mean of the pooling calls' rows, ``(B, K)``, or None
        where the model has no pooling call and the query token's row is read."""
        pooling = self.pooling_calls
        token_maps = [m for i, m in enumerate(layer_maps) if i >= first and i not in pooling]
        if not pooling:
            return token_maps, None
        return token_maps, torch.stack([self.explained_row(i, layer_maps[i]) for i in pooling]).mean(dim=0)

    def by_role(self, layer_maps: list[Tensor]) -> list[Tensor] | dict[str, Tensor]:
        """What ``return_maps`` gives: the per-call maps as they are, or, with pooling
        calls (whose maps have other shapes), ``{"self": (B, L, T, T), "pooling": (B, P, Q, T)}``."""
        if not self.pooling_calls:
            return layer_maps
        return {
            role: torch.stack([m for m, r in zip(layer_maps, self.roles) if r == role], dim=1)
            for role in dict.fromkeys(self.roles)
        }

    def keys_are_inputs(self, call: int) -> bool:
        """Whether the call's keys are the tokens ``input_real`` marks (not a decoder's own)."""
        return self.roles[call] != "decoder"

    def queries_are_explained(self, call: int) -> bool:
        """Whether the call's rows explain the output: the explained sequence's queries
        (self or cross) or a pooling readout."""
        return self.roles[call] in ("self", "cross", "pooling")

    def heads_of(self, call: int, heads: Sequence[int] | None) -> list[int] | None:
        """``heads`` of the call resolved to ``0..H-1`` (negative counts from the end), or
        a clear error; None (all heads) stays None."""
        if heads is None:
            return None
        chosen = list(heads)
        num_heads = self.head_counts[call]
        wrong = [h for h in chosen if not _is_int(h) or not -num_heads <= h < num_heads]
        if wrong or not chosen:
            raise ValueError(
                f"heads {wrong or chosen} do not exist: attention layer {call} has {num_heads} "
                f"heads (valid: {-num_heads}..{num_heads - 1}, or None for all)."
            )
        return sorted({h % num_heads for h in chosen})

    def check_heads(self, heads: Sequence[int] | None, calls: Iterable[int]) -> None:
        """A clear error unless ``heads`` exist in every one of ``calls``."""
        for call in calls:
            self.heads_of(call, heads)

    def call_index(self, index: int, name: str = "layer") -> int:
        """``index`` resolved to ``0..L-1`` (negative counts from the end), or a clear error."""
        if not _is_int(index):
            raise TypeError(f"{name} must be an int (a layer index), got {index!r}.")
        if not -self.num_calls <= index < self.num_calls:
            raise ValueError(
                f"{name}={index} is out of range: the model has {self.num_calls} attention "
                f"layers, so {name} must be in [{-self.num_calls}, {self.num_calls - 1}]."
            )
        return index % self.num_calls


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def record_forward(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    additional_forward_args: Any,
    adapter: AttentionAdapter | None = None,
    *,
    probes: Sequence[Probe] = (),
    track_grad: bool = False,
    query_index: QueryIndex = None,
    streaming: bool = False,
    confirm_rows: bool = False,
) -> ForwardRecord:
    """Run ``forward_func`` once with ``model``'s attention captured, with ``probes``.

    Args:
        forward_func: called as Captum calls it, ``forward_func(*inputs, *extra)`` (by
            keyword where the adapter says so).
        model: the module holding the attention layers.
        inputs: the formatted inputs (see :func:`format_inputs`).
        additional_forward_args: further arguments of ``forward_func``.
        adapter: how to find the attention. Default: the built-in one.
        probes: what else the pass records or changes
            (:mod:`captum_attention.capture.probes`); their results are the record's
            (:meth:`ForwardRecord.result`).
        track_grad: keep the attention in the autograd graph for
            :meth:`ForwardRecord.with_gradients`.
        query_index: the explained position; None = the default (see
            :func:`query_positions`).
        streaming: keep the model's attention kernel and record its inputs (see
            :class:`AttentionCapture`).
        confirm_rows: where ``query_index`` is None and the model returns one row of
            logits per example, confirm that the default query is a row the logits read
            (:func:`confirm_query_read`), or raise; a forward without gradients then keeps
            the autograd graph of its last attention call on only (:class:`LastCallGraph`;
            not under ``torch.inference_mode``, where it is not confirmed). An
            encoder-decoder's classifier is always confirmed: its default query row
            (:func:`classifier_rows`) bounds the decoder's rows every method reads.
    """
    _check_call(additional_forward_args, track_grad)
    inputs, additional_forward_args = tree_map(outside_inference_mode, (inputs, additional_forward_args))
    _check_float_inputs(model, inputs)
    batch = inputs[0].shape[0]
    text_shape = (batch, inputs[0].shape[1]) if inputs[0].dim() in (2, 3) else None
    _warn_if_training(model)
    adapter = resolve_adapter(model, adapter)
    encoder_decoder = adapter.is_encoder_decoder(model)
    readable_rows = query_index is None and not _generates(model) and not torch.is_inference_mode_enabled()
    confirm_rows = readable_rows and (confirm_rows or encoder_decoder)
    grad_mode = GradMode(track_grad or any(probe.needs_grad for probe in probes))
    if confirm_rows and not grad_mode.enabled:
        probes = [*probes, LastCallGraph(streaming)]
    shape_check = [] if text_shape is None else [MaskShape(text_shape)]
    keyword_forward = adapter.keyword_forward(forward_func)
    confirm_left_padding = getattr(keyword_forward, "confirm_left_padding", None)
    tower_inputs, embedded_ids = TowerInputs(inputs), EmbeddedIds(inputs)
    capture = AttentionCapture(
        model, adapter, probes=[grad_mode, *shape_check, tower_inputs, embedded_ids, *probes], streaming=streaming,
        track_grad=track_grad,
    )
    with without_autocast("The attention capture"), input_errors_named(model, inputs[0]):
        if confirm_left_padding is not None:  # it runs the model: before the capture
            confirm_left_padding(*inputs, *(format_additional_forward_args(additional_forward_args) or ()))
        with capture:
            output = run_forward(keyword_forward, inputs, None, additional_forward_args)
    if tower_inputs.fed:
        raise image_tower_refusal(model, tower_inputs.fed[0])
    if capture.autocast_in_forward:
        warn_user(
            f"forward_func runs {type(model).__name__} under torch.autocast ({', '.join(capture.autocast_in_forward)}): its "
            "layers round to half precision, and so do the scores (streaming and eager capture part by that rounding, "
            "about 1% of their scale). Leave autocast out of forward_func, or cast the model (model.to(torch.bfloat16)) "
            "to explain it in half precision."
        )
    _check_decoder_ids(model, inputs, embedded_ids.embedded)
    if capture.model_calls > 1:
        raise ValueError(
            f"forward_func ran {type(model).__name__} {capture.model_calls} times in one call. The "
            "attention methods explain one forward pass (Rollout and Transformer Attribution "
            "would chain the layers of different passes): explain each pass separately, or "
            "give a forward_func that runs the model once."
        )
    if capture.attention_mask is None:
        _warn_if_padded(model, inputs[0])
    logits = output_logits(output, batch)
    kernel_calls = capture.kernel_calls if streaming else []
    attn_maps = [] if streaming else [p.detach() for p in capture.attn_probs]
    shapes = [_shape(k) for k in kernel_calls] if streaming else [p.shape for p in attn_maps]
    roles = capture.roles
    leading = _leading_positions(model, shapes, roles, text_shape)
    seen_shape = text_shape if text_shape is None else (batch, leading + text_shape[1])
    _check_attention(shapes, roles, batch, seen_shape, [type(module).__name__ for module in capture.modules], encoder_decoder)
    if streaming and "pooling" in roles:
        raise StreamingUnsupported("pooling attention is read from its explicit probabilities")
    device = inputs[0].device
    source_real = None
    if "cross" in roles:
        cross = next(shape for shape, r in zip(shapes, roles) if r == "cross")
        source_mask, target_mask = (
            (capture.attention_mask, capture.decoder_attention_mask)
            if encoder_decoder
            else (capture.cross_attended_mask, capture.attention_mask)  # a decoder cross-attending to image features
        )
        source_real = real_tokens(source_mask, batch, cross[-1], device)
        target_real = real_tokens(target_mask, batch, cross[-2], device)
    else:
        target_real = F.pad(real_tokens(capture.attention_mask, batch, shapes[0][-1] - leading, device), (leading, 0), value=True)
    if logits.dim() == 3 and logits.shape[1] != target_real.shape[1]:
        raise ValueError(
            f"forward_func returned logits at {logits.shape[1]} of the {target_real.shape[1]} positions the attention "
            "runs over (as with logits_to_keep): return them at every position, or the explained position's alone as "
            "(batch, vocab)."
        )
    query_index = in_record_positions(query_index, leading)
    causal, prefix = _causality(capture, attn_maps, target_real, _generates(model))
    if source_real is not None and logits.dim() == 3 and not causal:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s decoder attended to later target tokens in this forward (a shortcut some "
            "models take while caching, as FSMT's with use_cache=True), so its logits are no next-token "
            "predictions: call it with use_cache=False (model.config.use_cache = False)."
        )
    readout = adapter.readout_rows(model, target_real) if query_index is None else None
    if logits.dim() == 3 and not causal and query_index is None and readout is None:
        raise ValueError(
            f"{type(model).__name__} returns logits at every position and its attention sees both ways (a masked "
            "language model or a token classifier), so no position is explained by default: pass query_index, the "
            "position whose logits to explain (the [MASK] token's, the tagged token's), or a forward_func that returns "
            "that position's logits."
        )
    if readout is not None:  # the rows the output reads, weighted as it reads them
        queries = readout
    elif isinstance(query_index, Tensor) and query_index.is_floating_point():  # the rows the caller weighs
        queries = query_row_weights(query_index, target_real)
    elif query_index is None and encoder_decoder and logits.dim() == 2:
        queries = classifier_rows(capture, logits, target_real, confirm_rows)
    else:
        queries = query_positions(query_index, target_real, causal)
        if confirm_rows and logits.dim() == 2 and roles[-1] in ("self", "decoder"):
            pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
            confirm_query_read(capture, logits, queries, target_real, pad_id, one_row=not causal)
    head_counts = [shape[1] for shape in shapes]
    results = {type(r): r for r in (probe.result() for probe in probes) if r is not None}
    record = ForwardRecord(
        logits, attn_maps, head_counts, roles, target_real, source_real, queries, causal, capture, kernel_calls, results, prefix,
        leading,
    )
    return record.at_query(queries)


def _leading_positions(model: nn.Module, shapes: list[torch.Size], roles: list[str], text_shape: tuple[int, int] | None) -> int:
    """How many positions ``model`` put before the input tokens in this forward: the keys
    of its first self-attention beyond the tokens, where it is known to put its image's
    features there (:func:`~captum_attention.capture.adapters.images.leading_image_features`:
    GIT's, given ``pixel_values``); else 0."""
    if text_shape is None or leading_image_features(model) is None:
        return 0
    keys = next((shape[-1] for shape, role in zip(shapes, roles) if role == "self" and len(shape) == 4), text_shape[1])
    return max(0, keys - text_shape[1])


def in_record_positions(query_index: QueryIndex, leading: int) -> QueryIndex:
    """``query_index`` given over the input tokens, as positions of a record that puts
    ``leading`` positions before them (row weights padded with zeros there)."""
    if not leading or query_index is None:
        return query_index
    if isinstance(query_index, Tensor) and query_index.is_floating_point():
        return F.pad(query_index, (leading, 0))
    if isinstance(query_index, Tensor | int):
        return query_index + leading
    return [position + leading for position in query_index]


def _check_call(additional_forward_args: Any, track_grad: bool) -> None:
    if isinstance(additional_forward_args, dict):
        raise TypeError(
            "additional_forward_args must hold positional arguments (Captum's convention), "
            "e.g. (attention_mask,); got a dict. For keyword arguments, wrap the model: "
            "forward_func=lambda ids, mask: model(ids, attention_mask=mask, ...)."
        )
    if track_grad:
        check_gradients_possible()


def check_gradients_possible() -> None:
    """A clear error under ``torch.inference_mode()``, where no backward can run."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "This explanation needs gradients, which torch.inference_mode() switches off: "
            "call it outside inference_mode (under torch.no_grad() it works: it enables "
            "gradients itself)."
        )


QUANTIZED_MODULES = ("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")
"""Where torch's quantized modules live (``torch.ao.quantization.quantize_dynamic``'s
``Linear`` among them): no gradient flows through them, and each call quantizes its input
apart, so that they are no linear map of it."""

ACTIVATION_QUANTIZATION = ("act_quant_kwargs", "activation_quantization")
"""The attributes by which torchao's quantized weights say that their layer quantizes its
input too (dynamic activation quantization), as torch's quantized modules do."""


def check_not_quantized(model: nn.Module, method: str) -> None:
    """A one-line error where ``model`` holds layers that quantize their inputs (torch's
    quantized modules; torchao's and optimum-quanto's layers with activation
    quantization), for a method that runs a backward through the model's layers or
    decomposes them into linear maps. Weight-only quantization keeps each layer a linear
    map of its input (see :func:`~captum_attention.maps.common.dense_weight`)."""
    quantized = [(name, module) for name, module in model.named_modules() if _quantizes_inputs(module)]
    if quantized:
        name, module = quantized[0]
        raise UnsupportedModelError(
            f"{method} runs a backward through {type(model).__name__}'s layers or splits them into linear maps, and "
            f"{len(quantized)} of them quantize their inputs ({name}: {type(module).__module__}.{type(module).__name__}"
            f"{_quantized_weight(module)}), which carries no gradient and makes them no linear maps: explain the float "
            "or weight-only quantized model, or use a method that reads only the attention and the model's outputs (raw, "
            "rollout, attention_flow, value_zeroing)."
        )


def _quantizes_inputs(module: nn.Module) -> bool:
    """Whether ``module`` quantizes its input: one of torch's quantized modules, a layer
    whose weight is torchao's with activation quantization, or optimum-quanto's with an
    activation type."""
    if type(module).__module__.startswith(QUANTIZED_MODULES):
        return True
    weight = module._parameters.get("weight")
    if any(getattr(weight, name, None) is not None for name in ACTIVATION_QUANTIZATION):
        return True
    return getattr(module, "activation_qtype", None) is not None


def _quantized_weight(module: nn.Module) -> str:
    """", its weight a <class>" where the module's weight is a tensor subclass, else ""."""
    weight = module._parameters.get("weight")
    return f", its weight a {type(weight).__name__}" if is_tensor_subclass(weight) else ""


Decorated = TypeVar("Decorated", bound=Callable[..., Any])

class without_autocast(ExitStack):
    """Autocast turned off, with a warning naming ``caller``, for a call that captures a
    model's attention (a context manager, or a decorator of such a function): the call
    runs the model, and computes from what it recorded, in the weights' own precision.

    Under autocast each layer rounds its products to half precision while the weights
    stay float32, so that a method's re-runs and sum checks (which read the weights'
    precision) fail, streaming and eager capture part by autocast's rounding (about 1% of
    the scores' scale), and a rank read from bfloat16 values is lower."""

    def __init__(self, caller: str) -> None:
        super().__init__()
        self.caller = caller

    def __call__(self, function: Decorated) -> Decorated:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            with without_autocast(self.caller):  # one stack per call
                return function(*args, **kwargs)

        return cast(Decorated, run)

    def __enter__(self) -> without_autocast:
        super().__enter__()
        autocast = autocast_on()
        if autocast:
            warn_user(
                f"torch.autocast is on for {', '.join(autocast)}: {self.caller} turns it off for the call and runs the "
                "model in its weights' precision. To explain a model in half precision, cast it (model.to(torch.bfloat16))."
            )
        try:
            for device in autocast:
                self.enter_context(torch.autocast(device, enabled=False))
        except BaseException:  # `with` calls no __exit__ when __enter__ raises
            self.close()
            raise
        return self


def warn_if_answer_begins_with_bos(model: Any, continuation: Tensor, name: str = "continuation") -> None:
    """A warning where rows of a decoder-only model's ``continuation`` (called ``name``)
    begin with its BOS token (:func:`~captum_attention.capture.inputs.rows_beginning_with_bos`):
    explained, or scored, as the answer's first token."""
    rows = rows_beginning_with_bos(model, continuation)
    if rows:
        warn_user(
            f"{name} rows {rows} begin with the model's BOS token ({model.config.bos_token_id}), which a tokenizer adds "
            f"to text unless add_special_tokens=False: it is read as the answer's first token; give {name}[:, 1:] if it "
            "is not the answer's."
        )


def chosen_answer_start(model: Any, continuation: Tensor, name: str = "continuation") -> int:
    """Where the tokens an encoder-decoder chose begin in ``continuation`` (called
    ``name``): after the token its ``generate`` forces first
    (:func:`~captum_attention.capture.inputs.forced_tokens`), which its answers' scores
    read but leave out; a one-line error where the continuation holds that token alone,
    and a warning where rows lack it (the decoder then reads them without it, unlike
    ``generate``)."""
    forced = forced_first_token(model)
    if forced is None:
        return 0
    skip = forced_tokens(model, continuation)
    if skip == continuation.shape[1]:
        raise ValueError(
            f"{name} holds only the token {forced} that {type(model).__name__}'s generate forces first "
            "(generation_config.forced_bos_token_id), which the model does not choose: give the answer's tokens after it."
        )
    if not skip:
        rows = (continuation[:, 0] != forced).nonzero().flatten().tolist()
        warn_user(
            f"{name} rows {rows} do not begin with the token {forced} that {type(model).__name__}'s generate forces "
            "first (generation_config.forced_bos_token_id: a translation's target language): its decoder reads them "
            f"without it, unlike its answers; put it first ({name} = torch.cat([torch.full_like({name}[:, :1], "
            f"{forced}), {name}], dim=1)), and it is read, not explained."
        )
    return skip


def _check_decoder_ids(model: nn.Module, inputs: tuple[Tensor, ...], embedded: list[Tensor]) -> None:
    """A one-line error where an encoder-decoder's decoder embedded other token ids than its
    second input, the ids its target scores stand for (as where ``forward_func`` passes them
    as ``labels``, which the model shifts right)."""
    if not embedded:
        return
    read, given = embedded[-1], inputs[1]
    if read.shape != given.shape or not torch.equal(read, given.to(read.device)):
        raise UnsupportedModelError(
            f"{type(model).__name__}'s decoder read other token ids than the second input {tuple(given.shape)}, for which "
            "the target scores stand (as where forward_func passes it as labels, which the model shifts right): pass "
            "the ids the decoder reads, decoder_input_ids, as the second input."
        )


def _check_float_inputs(model: nn.Module, inputs: tuple[Tensor, ...]) -> None:
    """Float inputs (embeddings, pixels) in the dtype of the model's parameters."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    wrong = [t.dtype for t in inputs if t.is_floating_point() and dtype is not None and t.dtype != dtype]
    if wrong:
        raise TypeError(
            f"The inputs are {wrong[0]} but the model computes in {dtype}: pass inputs.to({dtype})."
        )


POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_source_positions")
"""Configuration fields that bound a model's learned positions, in the order they are read."""

BIAS_LIMITS = {"mpt": "max_seq_len"}
"""Model types whose attention bias is built for a fixed number of positions, by
``config.model_type``, and the configuration field that sets it (MPT's ALiBi): they hold
no position table and take no more tokens."""


@contextmanager
def input_errors_named(model: Any, first_input: Tensor) -> Iterator[None]:
    """A forward that fails on token ids its vocabulary has no row for (ids of another
    model's tokenizer, or ``-100`` labels: torch's ``index out of range in self``), or on
    more tokens than the model's configuration has learned positions for (an embedding
    table of that many rows: BERT's ``expanded size``, GPT-2's ``index out of range``;
    rotary positions have no table and no such limit), fails with a one-line error that
    names them, the original error chained. ``model`` may be any ``forward_func``: one
    that is no model (no input embeddings, no configuration) has its errors as they are."""
    try:
        yield
    except (RuntimeError, IndexError) as error:
        problem = (
            "index out of range" in str(error) and ids_outside_vocabulary(model, first_input)
        ) or _more_tokens_than_positions(model, first_input)
        if not problem:
            raise
        raise ValueError(problem) from error


def ids_outside_vocabulary(model: Any, first_input: Tensor) -> str | None:
    """:func:`~captum_attention.capture.inputs.outside_vocabulary` for token ids
    ``(batch, tokens)`` of a ``model`` with input embeddings; None for anything else."""
    get_tokens = getattr(model, "get_input_embeddings", None)
    tokens = get_tokens() if callable(get_tokens) else None
    if first_input.is_floating_point() or first_input.dim() != 2 or not isinstance(tokens, nn.Embedding):
        return None
    return outside_vocabulary(model, first_input, tokens.num_embeddings)


def _more_tokens_than_positions(model: Any, first_input: Tensor) -> str | None:
    learned = learned_positions(model)
    if first_input.dim() not in (2, 3) or learned is None or first_input.shape[1] <= learned[1]:
        return None
    field, limit, reserved = learned
    source = f"config.{field}" + (f" less the {reserved} rows before its first position" if reserved else "")
    return (
        f"The inputs hold {first_input.shape[1]} tokens and {type(model).__name__} has positions for {limit} "
        f"({source}), and its forward failed on them: truncate the inputs "
        f"(tokenizer(..., truncation=True, max_length={limit})) or explain them in windows."
    )


def learned_positions(model: Any, config: Any = None) -> tuple[str, int, int] | None:
    """The configuration field (of ``config``, by default the model's) that bounds
    ``model``'s learned positions, how many tokens they take, and the rows their table
    reserves before its first position: its padding row and those before it, where it has
    one (RoBERTa's kind counts positions from its padding id + 1: 514 rows take 512
    tokens). None where the model holds no such table (rotary or relative positions set no
    limit)."""
    config = getattr(model, "config", None) if config is None else config
    bias_field = BIAS_LIMITS.get(str(getattr(config, "model_type", "")))
    if bias_field is not None and isinstance(getattr(config, bias_field, None), int):
        return bias_field, getattr(config, bias_field), 0
    field, limit = next(
        ((name, getattr(config, name)) for name in POSITION_LIMITS if isinstance(getattr(config, name, None), int)),
        (None, None),
    )
    table = None if field is None or limit is None else _position_table(model, limit)
    if field is None or limit is None or table is None:
        return None
    padding = getattr(table, "padding_idx", None)
    reserved = 0 if padding is None else padding + 1
    return field, limit - reserved, reserved


def _position_table(model: Any, rows: int) -> nn.Module | None:
    """The embedding table of ``rows`` rows that ``model`` holds besides its tokens' own
    (learned positions): an ``nn.Embedding``, or a module of its kind that holds the
    table as its ``weight`` beside a ``padding_idx`` (I-BERT's quantised embedding); or
    None."""
    if not isinstance(model, nn.Module):
        return None
    try:
        tokens = getattr(model, "get_input_embeddings", lambda: None)()
    except NotImplementedError:  # transformers cannot name them for this class (CANINE's)
        tokens = None

    def is_table(module: nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        table_like = isinstance(module, nn.Embedding) or hasattr(module, "padding_idx")
        return table_like and isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == rows

    return next((module for module in model.modules() if module is not tokens and is_table(module)), None)


_SAME_IN_TRAINING = (
    nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Conv1d, nn.Conv2d, nn.Identity,
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Tanh, nn.ReLU, nn.GELU, nn.SiLU,
    nn.DataParallel, nn.parallel.DistributedDataParallel,
)
"""Modules whose own training flag changes nothing: layers without dropout (their
subclasses too: a quantizer's linear layers, made in training mode when it swaps them
into a model in eval mode, or a head made after ``model.eval()``), containers, and the
parallel wrappers (the wrapped model's flags count)."""


_LIBRARIES = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(captum.__file__))


def warn_user(message: str) -> None:
    """A ``UserWarning`` attributed to the first caller outside this package and Captum
    (``NoiseTunnel`` and the metrics call in from different depths)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _generates(model: nn.Module) -> bool:
    """Whether ``model`` is a generative model (its logits are read at every position,
    and its explained row is the one the method reads the logits at)."""
    can_generate = getattr(model, "can_generate", None)
    return bool(callable(can_generate) and can_generate())


def classifier_rows(capture: AttentionCapture, logits: Tensor, target_real: Tensor, confirm: bool) -> Tensor:
    """``(B,)``: the default query row of an encoder-decoder returning one row of logits
    per example (a sequence classifier): with ``confirm``, the decoder row each example's
    logits read, else the decoder's last row. BART's and T5's classifiers read the
    decoder's state at the text's last end-of-sequence token, the last before padding on
    the right, not at the decoder's last row: the decoder (its ids the text's shifted
    right) takes no padding mask, so every one of its rows counts as real. A one-line error
    where an example's logits read several rows (:func:`confirm_query_read`)."""
    last_rows = query_positions(None, target_real, causal=True)
    if not confirm:
        return last_rows
    with torch.enable_grad():
        read = capture.rows_read(logits.sum())
    if read is not None and bool((read.sum(dim=1) == 1).all()):
        return read.long().argmax(dim=1).to(target_real.device)
    confirm_query_read(capture, logits, last_rows, target_real, None, one_row=True)
    return last_rows


def confirm_query_read(
    capture: AttentionCapture, logits: Tensor, queries: Tensor, real: Tensor, pad_id: Any, one_row: bool
) -> None:
    """A one-line error where the rows the logits read (found from the gradient of the
    logits with respect to the last attention call's output) are not the default query
    row: a decoder classifier that finds its last token by ``config.pad_token_id`` reads a
    padding position when the batch is padded with another id; an encoder read at its
    first position, when padded on the left; with ``one_row`` (bidirectional attention,
    whose heads read one token unless the adapter's ``readout_rows`` names several), an
    output that pools several rows (a sentence embedding's mean over the tokens, a
    pooling in ``forward_func``), of which the methods that read one row would explain
    only the first; the error says to pass the target's position where the output holds
    one score per token, each read from its own row (a question-answering model's)."""
    with torch.enable_grad():
        read = capture.rows_read(logits.sum())
    if read is None:
        return
    batch = torch.arange(len(queries), device=read.device)
    missed = ~read[batch, queries.to(read.device)] & read.any(dim=1)
    pooled = read.sum(dim=1) > 1 if one_row else torch.zeros_like(missed)
    wrong = (missed | pooled).nonzero().flatten().tolist()
    if not wrong:
        return
    example = wrong[0]
    rows = read[example].nonzero().flatten().tolist()
    where = f"position {rows[0]}" if len(rows) == 1 else f"positions {_listed(rows)}"
    if not bool(real[example, rows].all()):
        fix = f"{where} is padding by the attention mask: pad where and with what the model expects" + (
            f" (its config.pad_token_id is {pad_id})" if pad_id is not None else ""
        )
    elif len(rows) == 1:
        fix = f"pass query_index={rows[0]} to explain the row it reads"
    elif _scores_per_position(capture, logits, real, example, rows):
        fix = (
            "its outputs are one score per position, each read from its own row (a question-answering model's "
            "start or end logits): pass query_index=target, the position whose score is explained"
        )
    else:
        fix = (
            "pass query_index as (batch, seq_len) weights of the rows it reads, e.g. "
            "attention_mask / attention_mask.sum(dim=1, keepdim=True) for a mean over the tokens"
        )
    raise ValueError(
        f"The output of example {example} read {where}, not position {int(queries[example])} alone, which the "
        f"methods that read one row explain by default: {fix}."
    )


def _scores_per_position(capture: AttentionCapture, logits: Tensor, real: Tensor, example: int, rows: list[int]) -> bool:
    """Whether ``example``'s logits hold one score per token, the score at a read row
    reading that row alone (checked at the first read row)."""
    if logits.shape[-1] != real.shape[1]:
        return False
    with torch.enable_grad():
        read = capture.rows_read(logits[example, rows[0]])
    return read is not None and read[example].nonzero().flatten().tolist() == [rows[0]]


def _listed(positions: list[int]) -> str:
    """``[0, 1, 2, 3]`` as "0-3", other lists as written, cut after eight."""
    if positions == list(range(positions[0], positions[-1] + 1)):
        return f"{positions[0]}-{positions[-1]}"
    return str(positions[:8])[:-1] + (", ...]" if len(positions) > 8 else "]")


def _warn_if_training(model: nn.Module) -> None:
    training = [
        name or type(model).__name__ for name, m in model.named_modules() if m.training and not isinstance(m, _SAME_IN_TRAINING)
    ]
    if training:
        shown = ", ".join(training[:3]) + (f" and {len(training) - 3} more" if len(training) > 3 else "")
        warn_user(
            f"{type(model).__name__} has modules in training mode ({shown}): dropout makes the "
            "attention random. Call model.eval() before explaining it."
        )


def _warn_if_padded(model: nn.Module, input_ids: Tensor) -> None:
    """Warn when token ids look padded (the model's pad id first or last in a row) and no
    padding mask reached the model."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    if pad_id is None or input_ids.is_floating_point() or input_ids.dim() != 2:
        return
    if bool((input_ids[:, -1] == pad_id).any() or (input_ids[:, 0] == pad_id).any()):
        warn_user(
            f"The inputs hold the padding token id {pad_id} at the ends of rows, but no "
            "attention_mask reached the model: padding is explained as if it were text. Pass "
            "the mask, e.g. additional_forward_args=(attention_mask,)."
        )


def _shape(call: KernelCall) -> torch.Size:
    """The ``(B, H, Q, K)`` shape of the call's attention."""
    return torch.Size((call.query.shape[0], call.num_heads, call.num_queries, call.num_keys))


def _causality(capture: AttentionCapture, attn_maps: list[Tensor], real: Tensor, generates: bool) -> tuple[bool, Tensor | None]:
    """Whether the explained sequence's self-attention is causal, and the prefix its
    tokens see both ways (see :attr:`ForwardRecord.prefix`), read from the probabilities
    when they are recorded, else from the kernel's causal flag or mask.

    A decoder-only model whose tokens see later ones is causal after a prefix where it
    generates (its last position predicts the next token: PaliGemma's prompt, whose tokens
    all see each other given its token types) or where, in every example, no token sees the
    last real token but itself (a prefix language model's image tokens see each other both
    ways, the answer after them causally), else an encoder; one whose
    tokens never do is causal where the adapter says so, where there is a later key to hide (a
    decoder whose modules say ``is_causal=False`` but mask later keys themselves) or where it
    is an encoder-decoder's decoder (TrOCR's, whose modules say nothing, on one token)."""
    self_calls = [i for i, role in enumerate(capture.roles) if role in ("self", "decoder")]
    if not self_calls:
        return False, None
    said = capture.causal[self_calls[0]]
    if capture.streaming:
        call = capture.kernel_calls[self_calls[0]]
        if call.causal:
            return True, None
        if call.mask is None:
            if said is None:
                raise StreamingUnsupported("the adapter cannot tell whether the self-attention is causal")
            return said, None
        prefix = mask_prefix_seen_both_ways(call.mask, real)
    else:
        prefix = prefix_seen_both_ways(attn_maps[self_calls[0]], real)
    if not bool(prefix.any()):  # an encoder-decoder's decoder of one token saw no later one
        return said is True or has_later_keys(real) or capture.roles[self_calls[0]] == "decoder", None
    positions = torch.arange(real.shape[1], device=real.device)
    last_real = positions.masked_fill(~real, -1).amax(dim=1)
    # an encoder-decoder's decoder seeing later tokens took a caching shortcut (refused by the caller)
    prefix_model = (generates or bool((prefix <= last_real).all())) and capture.roles[self_calls[0]] == "self"
    return (True, prefix) if prefix_model else (False, None)


def _check_attention(
    shapes: list[torch.Size], roles: list[str], batch: int, text_shape: tuple[int, int] | None, names: list[str],
    encoder_decoder: bool,
) -> None:
    """``names``: the class of each call's module; ``encoder_decoder``: whether the model
    has an encoder (a decoder cross-attending to image features has none)."""
    if not shapes:
        raise RuntimeError(
            "The forward pass ran no attention module of `model`: check that forward_func "
            "calls the model passed as model=..., and not a TorchScript or exported copy of it."
        )
    over_tokens = [i for i, shape in enumerate(shapes) if text_shape is not None and len(shape) == 4 and shape[-1] == text_shape[1]]
    longer = [i for i, (shape, role) in enumerate(zip(shapes, roles)) if role == "self" and len(shape) == 4 and shape[0] == batch
              and text_shape is not None and shape[-1] > text_shape[1]]
    for call, (shape, role) in enumerate(zip(shapes, roles)):
        keys_ok = role not in ("self", "pooling") or text_shape is None or shape[-1] == text_shape[1]
        if not keys_ok and over_tokens and len(shape) == 4 and shape[0] == batch:
            assert text_shape is not None
            raise UnsupportedModelError(
                f"{names[call]} (attention call {call}) attends over {shape[-1]} positions, while "
                f"{names[over_tokens[0]]} (call {over_tokens[0]}) attends over the {text_shape[1]} input tokens: the "
                "model runs attention over other positions too (an image encoder beside a text model, or a sequence "
                "it shortens), and a capture explains one sequence: name the attention modules over the tokens, "
                "adapter=ModuleAdapter([...]), or pass a vision-language model whole (its language model is read)."
            )
        if not keys_ok and not over_tokens and longer:
            assert text_shape is not None
            raise UnsupportedModelError(
                f"{names[longer[0]]} (attention call {longer[0]}) attends over {shapes[longer[0]][-1]} positions for the "
                f"{text_shape[1]} input tokens: it also attends over positions no input token stands for, a generation "
                "cache passed to it (cache, past_key_values: pass the whole sequence instead, without the cache) or "
                "features of its own that its family is not known to put before the tokens (GIT's image features are; "
                "the tokens alone, without the image inputs, are explained)."
            )
        if len(shape) != 4 or shape[0] != batch or not keys_ok:
            expected = f"keys={text_shape[1]}" if text_shape is not None else "keys"
            raise UnsupportedModelError(
                f"Captured attention of shape {tuple(shape)}, expected (batch={batch}, "
                f"heads, queries, {expected}): the model's attention is not over its tokens "
                "(windowed or block-sparse attention, as Longformer's and BigBird's), or the "
                "adapter reads the wrong output."
            )
        if role == "self" and len(shape) == 4 and shape[-2] != shape[-1]:
            raise UnsupportedModelError(
                f"Captured self-attention of shape {tuple(shape)} has {shape[-2]} queries "
                f"for {shape[-1]} keys: its keys are not its tokens (spatially reduced, as "
                "PVT's), or its queries are not (attention pooling: name the "
                "module in ModuleAdapter(..., pooling=[module]))."
            )
    _check_pooling(roles)
    _check_encoder_decoder(roles, encoder_decoder)


def _check_encoder_decoder(roles: list[str], encoder_decoder: bool) -> None:
    """An encoder-decoder's capture holds each of its three kinds of attention (a decoder
    cross-attending to image features, the two of its own)."""
    kinds = {"encoder", "decoder", "cross"} if encoder_decoder else {"decoder", "cross"}
    if kinds & set(roles) and not kinds <= set(roles):
        missing = ", ".join(sorted(kinds - set(roles)))
        raise UnsupportedModelError(
            f"The encoder-decoder's capture found no {missing} attention, which the encoder-decoder rules need: "
            "its attention there is not softmax attention over its tokens (local or global windows, as LongT5's "
            "and LED's), or its adapter does not name those modules."
        )


def _check_pooling(roles: list[str]) -> None:
    """Pooling calls are the readout: after every other call, and not in an encoder-decoder."""
    if "pooling" not in roles:
        return
    if "cross" in roles:
        raise RuntimeError("Pooling attention is supported in models with one token sequence, not in encoder-decoders.")
    if roles.index("pooling") < len(roles) - roles.count("pooling"):
        raise RuntimeError(
            "A pooling attention ran before a self-attention call: pooling calls are the "
            "model's readout and must come after every self-attention, since their output "
            "is no longer one vector per token."
        )
