"""What the attention attributions share: one recorded forward (and backward), shaped like Captum's output."""

from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from typing import Any, Callable, ClassVar, Literal, Protocol, cast, overload

import torch
from captum.log import log_usage
from torch import Tensor, nn

from .._compat import TargetType, format_additional_forward_args, format_output
from ..capture import AttentionAdapter
from ..capture.inputs import QueryIndex, format_inputs
from ..capture.kernel import StreamingUnsupported
from ..capture.record import ForwardRecord, GradientReduction, record_forward, resolve_adapter
from ..maps import effective_attention, patch_grid, query_rows
from ._docs import shared_attribute_docs
from ._registry import register

logger = logging.getLogger("captum_attention")

CaptureMode = Literal["auto", "streaming", "eager"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "streaming", "eager")

Scores = Tensor | tuple[Tensor, ...]
"""What ``attribute`` returns: Captum's output shape for the inputs."""

Maps = Tensor | dict[str, Tensor]
"""What ``return_maps=True`` adds: ``(B, L, T, T)`` per-layer maps, or a dict per role
(encoder-decoders; models with a pooling readout: ``"self"`` and ``"pooling"``)."""


class AttributeCall(Protocol):
    """The type of every ``attribute``: the scores, or ``(scores, maps)`` with
    ``return_maps=True`` (as Captum types ``return_convergence_delta``)."""

    @overload
    def __call__(self, inputs: Tensor | tuple[Tensor, ...], *args: Any, return_maps: Literal[True], **options: Any) -> tuple[Scores, Maps]: ...

    @overload
    def __call__(
        self, inputs: Tensor | tuple[Tensor, ...], *args: Any, return_maps: Literal[False] = ..., **options: Any
    ) -> Scores: ...


def attribute_method(attribute: Callable[..., Scores | tuple[Scores, Maps]]) -> AttributeCall:
    """Make ``attribute`` a Captum attribute method: its shared docstring lines filled,
    ``captum.log.log_usage`` around it (``NoiseTunnel`` calls ``attribute.__wrapped__``)
    and typed by :class:`AttributeCall`."""
    return cast(AttributeCall, log_usage(part_of_slo=True)(shared_attribute_docs(attribute)))


class AttentionAttributionBase:
    """Mixin for the attention attributions; combine with a Captum ``Attribution`` class.

    A subclass that sets ``method_name`` is registered in :data:`captum_attention.METHODS`
    under that name (read by the command line, the benchmarks and the tests).

    Args:
        forward_func (Callable): the forward function of the model, returning logits
            ``(batch, num_classes)``; a Hugging Face model (its ``.logits`` is used) or
            any function of ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module that holds the attention layers.
            Default: ``forward_func`` when it is an ``nn.Module``.
        adapter (AttentionAdapter, optional): how to find the attention in ``model``.
            Default: the built-in adapter (Hugging Face models).
        capture (str, optional): ``"streaming"``: the model keeps its own attention kernel
            and the method recomputes the rows it needs block by block (no
            ``(heads, N, N)`` tensor is alive); ``"eager"``: the model computes explicit
            probabilities, which are recorded; ``"auto"``: streaming wherever it is
            exact, else eager (``last_capture`` then says why). Default: ``"auto"``.
        block_memory (int, optional): bytes one block of recomputed attention rows may
            take in streaming mode. Default: None, eight times a call's queries in float32,
            16-64 MiB on CPU, at least 256 MiB on GPU.
    """

    method_name: ClassVar[str] = ""  # the registry key, e.g. "grad_sam"
    streams_encoder_decoder: ClassVar[bool] = False  # whether _streamed_scores takes them
    readable_name: ClassVar[str] = ""  # what get_name() and reports show
    signed: ClassVar[bool] = False  # whether scores take both signs (reports colour them so)
    gradient_reduction: GradientReduction | None = None  # set by the gradient methods
    forward_func: Callable[..., Any]  # set by Captum's Attribution.__init__

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("method_name"):
            register(cls.method_name, cls)

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
        capture: CaptureMode = "auto",
        block_memory: int | None = None,
    ) -> None:
        if model is None:
            if not isinstance(forward_func, nn.Module):
                raise TypeError(
                    f"{type(self).__name__} needs the nn.Module that holds the attention "
                    "layers: pass model=... (forward_func is not a module)."
                )
            model = forward_func
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}.")
        if block_memory is not None and block_memory < 1:
            raise ValueError(f"block_memory must be a positive number of bytes, got {block_memory}.")
        super().__init__(forward_func)  # type: ignore[call-arg]
        self.model = model
        self.adapter = adapter
        self.capture = capture
        self.block_memory = block_memory
        self.last_capture = ""  # "streaming", or "eager: <why>" after each call

    @classmethod
    def get_name(cls) -> str:
        return cls.readable_name or cls.__name__

    @classmethod
    def uses_backward(cls) -> bool:
        """Whether the method takes a backward pass (its cost is measured against the
        model's forward+backward; else against its forward)."""
        return cls.gradient_reduction is not None

    def _scores(self, record: ForwardRecord, *args: Any, **options: Any) -> tuple[Tensor, list[Tensor]]:
        """The method's ``(B, T)`` scores and per-layer maps for one self-attention stack
        (``options``: the method's own ``attribute`` options)."""
        raise NotImplementedError

    def _encoder_decoder_scores(
        self, record: ForwardRecord, *args: Any, **options: Any
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """``(source, target)`` scores and the maps per role for an encoder-decoder."""
        raise NotImplementedError

    def _streamed_scores(self, record: ForwardRecord, *args: Any, **options: Any) -> Scores:
        """The method's scores from a streaming record: ``(B, T)``, or ``(source, target)``
        for an encoder-decoder where ``streams_encoder_decoder``."""
        raise NotImplementedError

    def _streaming_refusal(self, *args: Any, **options: Any) -> str | None:
        """Why these options need the full maps (eager capture), or None."""
        return None

    def _eager_reason(
        self, adapter: AttentionAdapter, return_maps: bool, effective: bool = False, **options: Any
    ) -> str | None:
        """Why this call cannot stream exactly, or None when it can."""
        if effective:
            return "effective attention needs the values and the full maps"
        if not getattr(adapter, "streams", False):
            return f"{type(adapter).__name__} does not run attention through transformers' sdpa function"
        if return_maps:
            return "return_maps=True needs the full maps"
        if adapter.is_encoder_decoder(self.model) and not self.streams_encoder_decoder:
            return "the encoder-decoder relevance rules need the full maps"
        if type(self)._streamed_scores is AttentionAttributionBase._streamed_scores:
            return f"{type(self).__name__} has no streaming reduction"
        return self._streaming_refusal(**options)

    def _streams(self, adapter: AttentionAdapter, return_maps: bool, effective: bool = False, **options: Any) -> bool:
        """Whether to try streaming for this call (a clear error if it was asked for and cannot)."""
        reason = None if self.capture == "eager" else self._eager_reason(adapter, return_maps, effective, **options)
        if self.capture == "streaming" and reason is not None:
            raise ValueError(f"capture='streaming' is not possible here: {reason}. Use capture='auto' or 'eager'.")
        self._note_capture("eager: capture='eager'" if self.capture == "eager" else reason and f"eager: {reason}")
        return self.capture != "eager" and reason is None

    def _note_capture(self, how: str | None) -> None:
        if how is not None:
            self.last_capture = how
            logger.debug("%s: %s", type(self).__name__, how)

    def _forward(
        self,
        inputs: tuple[Tensor, ...],
        additional_forward_args: Any,
        query_index: QueryIndex,
        streaming: bool,
        effective: bool = False,
    ) -> ForwardRecord:
        """One forward through the capture (in the autograd graph for gradient methods);
        with ``effective=True`` its maps are effective attention."""
        record = record_forward(
            self.forward_func, self.model, inputs, additional_forward_args, self.adapter,
            track_grad=self.gradient_reduction is not None, query_index=query_index, streaming=streaming,
            block_memory=self.block_memory, record_values=effective,
        )
        return with_effective_attention(record) if effective else record

    def _explained(self, record: ForwardRecord, target: TargetType, retain_graph: bool = False) -> ForwardRecord:
        """The record ready for the method's reduction: for gradient methods with one
        backward pass for ``target``."""
        reduction = self.gradient_reduction
        if record.streaming:
            return record.with_output_gradients(target, retain_graph) if reduction is not None else record
        if reduction is not None:
            return record.with_gradients(target, reduction, retain_graph)
        return replace(record, attn_probs=[p.float() for p in record.attn_probs])

    def _token_scores(self, record: ForwardRecord, **options: Any) -> Tensor:
        """The method's ``(B, T)`` scores of an explained record (one self-attention
        stack), streaming or eager."""
        if record.streaming:
            return cast(Tensor, self._streamed_scores(record, **options))
        return self._scores(record, **options)[0]

    def _recorded(self, forward: Callable[[bool], ForwardRecord], streaming: bool) -> ForwardRecord:
        """``forward(streaming)``; where streaming turns out impossible, ``auto`` runs it
        eager and says why, ``streaming`` raises."""
        if streaming:
            try:
                record = forward(True)
            except StreamingUnsupported as error:
                if self.capture == "streaming":
                    raise ValueError(
                        f"capture='streaming' is not possible here: {error}. Use capture='auto' or 'eager'."
                    ) from error
                self._note_capture(f"eager: {error}")
            else:
                self._note_capture("streaming")
                return record
        return forward(False)

    def _explain(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType,
        additional_forward_args: Any,
        query_index: QueryIndex,
        return_maps: bool,
        effective: bool = False,
        **options: Any,
    ) -> Any:
        """What every ``attribute`` does: record, reduce, shape the output like Captum
        (``effective``: over effective attention, for the methods that offer it)."""
        is_tuple, tensors = format_inputs(inputs)
        adapter = resolve_adapter(self.model, self.adapter)
        if adapter.is_encoder_decoder(self.model) and len(tensors) != 2:
            raise TypeError(
                f"{type(self.model).__name__} is an encoder-decoder: pass inputs=(input_ids, "
                "decoder_input_ids) and get (source scores, target scores) back."
            )
        streaming = self._streams(adapter, return_maps, effective, **options)
        record = self._recorded(
            lambda stream: self._explained(
                self._forward(tensors, additional_forward_args, query_index, stream, effective), target
            ),
            streaming,
        )
        if record.is_encoder_decoder:
            if record.streaming:
                return format_scores(True, _zero_padding(record, self._streamed_scores(record, **options)), None, False)
            scores, role_maps = self._encoder_decoder_scores(record, **options)
            return format_scores(True, _zero_padding(record, scores), role_maps, return_maps)
        if len(tensors) != 1:
            raise TypeError("A pair of inputs is for encoder-decoder models; pass one tensor.")
        token_scores, maps = (self._token_scores(record, **options), None) if record.streaming else self._scores(record, **options)
        token_scores = _zero_padding(record, token_scores)
        if tensors[0].dim() == 4:
            token_scores = patch_grid(token_scores, _grid_shape(adapter, self.model, tensors[0]))
        return format_scores(is_tuple, token_scores, maps and record.by_role(maps), return_maps)

    def attribute_continuation(
        self,
        inputs: Tensor,
        continuation: Tensor,
        additional_forward_args: Any = None,
        **options: Any,
    ) -> Tensor:
        r"""Explain a continuation of a decoder's prompt, token by token, in one forward.

        Row k explains ``continuation[:, k]`` as the next token after the prompt and the
        first k continuation tokens: exactly what ``attribute`` gives for that prefix
        (with ``target`` = that token and the default query, the prefix's last token),
        because a causal model's computation at a position never sees later tokens. The
        prompt and continuation run through the model once; gradient methods take one
        ``autograd.grad`` per continuation token on that one graph.

        Args:
            inputs (Tensor): prompt token ids ``(batch, prompt_len)``, padded on the
                left (as for ``generate``).
            continuation (Tensor): ``(batch, new_tokens)`` token ids, e.g.
                ``model.generate(...)[:, prompt_len:]``.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``; every tensor shaped ``(batch, prompt_len)`` is taken as a
                padding mask and extended with ones over the continuation. Default: None.
            **options: the method's options of ``attribute`` (e.g. ``head_fusion``,
                ``effective``).

        Returns:
            Tensor ``(batch, new_tokens, prompt_len + new_tokens)``: one row of scores per
            continuation token, 0 at padding and at the token itself and after.
        """
        _, (prompt,) = format_inputs(inputs)
        _check_continuation(prompt, continuation)
        sequence = torch.cat([prompt, continuation.to(prompt.device)], dim=1)
        extra = _extend_masks(additional_forward_args, prompt.shape, continuation.shape[1])
        offers_effective = "effective" in inspect.signature(getattr(self, "attribute")).parameters
        effective = bool(options.pop("effective", False)) if offers_effective else False
        streaming = self._streams(resolve_adapter(self.model, self.adapter), False, effective, **options)
        record = self._recorded(lambda stream: self._forward((sequence,), extra, None, stream, effective), streaming)
        _check_continuation_record(record, prompt.shape[1])
        prompt_len, new_tokens = prompt.shape[1], continuation.shape[1]
        rows = []
        for step in range(new_tokens):
            position = torch.full((len(prompt),), prompt_len - 1 + step, device=record.target_real.device)
            token = continuation[:, step].to(record.logits.device)
            explained = self._explained(record.at_query(position), token, retain_graph=step < new_tokens - 1)
            rows.append(_zero_padding(explained, self._token_scores(explained, **options)))
        return torch.stack(rows, dim=1)


def with_effective_attention(record: ForwardRecord) -> ForwardRecord:
    """``record`` with each call's probabilities replaced by its effective attention
    (Brunner et al., ICLR 2020; see :func:`~captum_attention.maps.effective_attention`),
    each real query's row projected over the keys it sees."""
    assert record.values is not None and record.projections is not None
    maps = [
        effective_attention(attn, values, *record.visible_keys(call), projection)
        for call, (attn, values, projection) in enumerate(zip(record.attn_probs, record.values, record.projections))
    ]
    return replace(record, attn_probs=maps)


def _zero_padding(record: ForwardRecord, scores: Any) -> Any:
    """``scores`` (or ``(source, target)`` scores) exactly 0 outside the real tokens, also
    where non-finite values elsewhere would spread into them through a product."""
    if isinstance(scores, tuple):
        source, target = scores
        return source.masked_fill(~record.input_real, 0.0), target.masked_fill(~record.target_real, 0.0)
    return scores.masked_fill(~record.target_real, 0.0)


def _check_continuation_record(record: ForwardRecord, prompt_len: int) -> None:
    """A decoder-only model, prompts padded on the left."""
    if record.is_encoder_decoder or not record.causal:
        raise ValueError(
            "attribute_continuation needs a decoder-only model (causal self-attention); for "
            "an encoder-decoder, call attribute with query_index at each target position."
        )
    if not bool(record.target_real[:, prompt_len - 1].all()):
        raise ValueError("Pad the prompts on the left (as for generate): the last prompt token must be real.")


def _check_continuation(prompt: Tensor, continuation: Tensor) -> None:
    if continuation.dim() != 2 or continuation.shape[0] != prompt.shape[0] or continuation.is_floating_point():
        raise ValueError(
            f"continuation must be token ids (batch={prompt.shape[0]}, new_tokens), got "
            f"shape {tuple(continuation.shape)} and dtype {continuation.dtype}."
        )
    if continuation.shape[1] == 0:
        raise ValueError("continuation has no tokens: give at least one new token to explain.")


def _extend_masks(additional_forward_args: Any, prompt_shape: torch.Size, new_tokens: int) -> Any:
    """Every ``(batch, prompt_len)`` tensor argument extended with ``new_tokens`` ones."""
    extra = format_additional_forward_args(additional_forward_args)
    if extra is None:
        return None
    return tuple(
        torch.cat([arg, arg.new_ones(arg.shape[0], new_tokens)], dim=1)
        if isinstance(arg, Tensor) and tuple(arg.shape) == tuple(prompt_shape)
        else arg
        for arg in extra
    )


def _grid_shape(adapter: AttentionAdapter, model: nn.Module, images: Tensor) -> tuple[int, int]:
    grid = adapter.patch_grid(model, images)
    if grid is None:
        raise ValueError(
            f"Cannot place the tokens of {type(model).__name__} on a patch grid: its adapter "
            "knows no patch size. Pass token inputs, or a vision transformer (ViT, DeiT), or "
            "an adapter whose patch_grid answers."
        )
    return grid


def format_scores(is_tuple: bool, scores: Tensor | tuple[Tensor, ...], maps: Any, return_maps: bool) -> Any:
    """Captum's output convention, plus the per-layer maps on request."""
    formatted = format_output(is_tuple, scores if isinstance(scores, tuple) else (scores,))
    if not return_maps:
        return formatted
    return formatted, (torch.stack(maps, dim=1) if isinstance(maps, list) else maps)


def encoder_decoder_rows(
    record: ForwardRecord,
    maps: list[Tensor],
    relevance: Callable[[list[Tensor], list[Tensor], list[str]], tuple[Tensor, Tensor]],
) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
    """Source and target scores: the query rows of ``relevance``'s R^{qs} and R^{qq}."""
    encoder_maps = [m for m, role in zip(maps, record.roles) if role == "encoder"]
    decoder_side = [(m, role) for m, role in zip(maps, record.roles) if role != "encoder"]
    target_self, target_source = relevance(encoder_maps, [m for m, _ in decoder_side], [r for _, r in decoder_side])
    scores = (query_rows(target_source, record.query_index), query_rows(target_self, record.query_index))
    role_maps = {
        role: torch.stack([m for m, r in zip(maps, record.roles) if r == role], dim=1)
        for role in ("encoder", "decoder", "cross")
    }
    return scores, role_maps
