"""What the attention attributions share: one recorded forward (and backward), shaped like Captum's output."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Mapping, TypeVar, cast

import torch
import torch.nn.functional as F
from captum.log import log_usage
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .._compat import NonFiniteScores, TargetType, UnsupportedModelError, format_additional_forward_args, format_output, hooked_modules
from ..capture import AttentionAdapter, ForwardRecord, Probe, RecordedValues, ValueRecorder, record_forward
from ..capture.inputs import (
    LogProbTarget, QueryIndex, answer_ids, check_no_padding_after_end, decoder_start_token,
    forced_tokens, format_inputs, index_target, outside_inference_mode, outside_vocabulary,
)
from ..capture.lrp import Embeddings, PixelInputs, PropagationRules, RelevanceRules, with_pixel_leaf
from ..capture.adapters.images import check_captioner_prompt, cross_attends_images
from ..capture.adapters.mixing import tokens_mixed_outside_attention
from ..capture.record import (
    check_gradients_possible, check_not_quantized, chosen_answer_start, warn_if_answer_begins_with_bos, without_autocast,
)
from ..capture.runner import (
    CaptureMode, CaptureRunner, check_capture_mode, check_inputs, resolve_adapter, resolve_model, stream_refusal,
)
from ..maps import effective_attention, patch_grid
from ..maps.lrp import token_relevance
from ._docs import shared_attribute_docs, shared_class_docs
from ._registry import MethodSpec, register

Scores = Tensor | tuple[Tensor, ...]
"""What ``attribute`` returns: Captum's output shape for the inputs."""

Inputs = TypeVar("Inputs", Tensor, tuple[Tensor, ...])
"""The inputs' type, which the scores keep (Captum's convention): a tensor, or a tuple."""

Maps = Tensor | dict[str, Tensor]
"""What ``return_maps=True`` adds: ``(B, L, T, T)`` per-layer maps, or a dict per role
(encoder-decoders; models with a pooling readout: ``"self"`` and ``"pooling"``)."""


AttributeFunction = TypeVar("AttributeFunction", bound=Callable[..., Any])


def attribute_method(attribute: AttributeFunction) -> AttributeFunction:
    """Make ``attribute`` a Captum attribute method: its shared docstring lines filled and
    ``captum.log.log_usage`` around it (``NoiseTunnel`` calls ``attribute.__wrapped__``),
    its signature kept for type checkers (each method declares ``@overload`` on
    ``return_maps``, as Captum does on ``return_convergence_delta``)."""
    return cast(AttributeFunction, log_usage(part_of_slo=True)(shared_attribute_docs(attribute)))


def _explanation(call: AttributeFunction) -> AttributeFunction:
    """``call`` with autocast off (:func:`~captum_attention.capture.record.without_autocast`),
    its arguments made under ``torch.inference_mode`` copied out of it
    (:func:`~captum_attention.capture.inputs.outside_inference_mode`), and through the
    runner's :meth:`~captum_attention.capture.runner.CaptureRunner.retried_eager`: under
    ``capture='auto'``, a streamed call whose scores are not finite at real tokens while
    the explained output is runs once more eager (the gradient of Gemma-3n's sdpa
    attention on a left-padded batch)."""

    @functools.wraps(call)
    def explained(self: AttentionAttributionBase, *args: Any, **kwargs: Any) -> Any:
        why = "the streamed scores were not finite at real tokens, where the explained output is"
        args, kwargs = tree_map(outside_inference_mode, (args, kwargs))
        with without_autocast(self.get_name()):
            return self._runner.retried_eager(lambda: call(self, *args, **kwargs), NonFiniteScores, why)

    return cast(AttributeFunction, explained)


class AttentionAttributionBase:
    """Mixin for the attention attributions; combine with a Captum ``Attribution`` class.

    A subclass declares what it is and needs in ``spec`` (a :class:`MethodSpec`); one
    with a ``spec.name`` is registered in :data:`captum_attention.METHODS` under it
    (read by the command line, the benchmarks and the tests). The base class reads the
    spec: which capture, which probes, which backward, and which of the score hooks
    (``_scores``, ``_encoder_decoder_scores``, ``_streamed_scores``) it calls; a method
    whose ``needs`` is ``"relevance"`` writes none of them.

    Args:
        $constructor_args
    """

    spec: ClassVar[MethodSpec]
    propagation_rules: PropagationRules | None = None  # set by methods whose needs are "relevance"
    forward_func: Callable[..., Any]  # set by Captum's Attribution.__init__

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__doc__ = shared_class_docs(cls.__doc__)
        spec = cls.__dict__.get("spec")
        if spec is not None and spec.name:
            register(cls)

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
        capture: CaptureMode = "auto",
        block_memory: int | None = None,
    ) -> None:
        model = resolve_model(forward_func, model, type(self).__name__)
        check_capture_mode(capture)
        if block_memory is not None and block_memory < 1:
            raise ValueError(f"block_memory must be a positive number of bytes, got {block_memory}.")
        super().__init__(forward_func)  # type: ignore[call-arg]
        self.model = model
        self.adapter = adapter
        self.capture = capture
        self.block_memory = block_memory
        self._runner = CaptureRunner(capture, type(self).__name__)

    @property
    def signed(self) -> bool:
        """Whether this explainer's scores take both signs (``spec.signed``; a method whose
        settings decide it says so itself)."""
        return self.spec.signed

    @property
    def last_capture(self) -> str:
        """``"streaming"``, or ``"eager: <why>"``, after each call; ``""`` before the first."""
        return self._runner.last

    @classmethod
    def get_name(cls) -> str:
        spec = getattr(cls, "spec", None)
        return spec.readable_name if spec is not None else cls.__name__

    def _refuse_maps(self, return_maps: bool, gives: str) -> None:
        """A one-line error for ``return_maps=True`` from a method without per-layer maps;
        ``gives`` says what it gives instead."""
        if return_maps:
            raise ValueError(f"{type(self).__name__} {gives} and has no maps: leave return_maps=False.")

    def _check_options(self, options: dict[str, Any], where: str) -> None:
        """A clear error for an option the method does not take or a value it does not
        accept (``where``: the call, as the error names it)."""
        self.spec.check_options(options, f"{type(self).__name__}.{where}")

    def _scores(self, record: ForwardRecord, *args: Any, **options: Any) -> tuple[Tensor, list[Tensor]]:
        """The method's ``(B, T)`` scores and per-layer maps for one self-attention stack
        (``options``: the method's own ``attribute`` options)."""
        raise NotImplementedError

    def _encoder_decoder_scores(
        self, record: ForwardRecord, *args: Any, **options: Any
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """``(source, target)`` scores and the maps per role for an encoder-decoder."""
        raise NotImplementedError

    def _streamed_rows(self, record: ForwardRecord, positions: Tensor, tokens: Tensor, *args: Any, **options: Any) -> Tensor | None:
        """A method that needs no backward may answer the rows of several query positions
        ``(B, T)`` of a decoder at once, each explaining the continuation token ``tokens``
        ``(B, T)`` there, ``(B, T, N)``; None: one row at a time."""
        return None

    def _streamed_scores(self, record: ForwardRecord, *args: Any, **options: Any) -> Scores:
        """The method's scores from a streaming record: ``(B, T)``, or ``(source, target)``
        for an encoder-decoder."""
        raise NotImplementedError

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        """Fresh probes for one forward: the values for effective attention, the
        propagation rules for relevance methods (``options``: the call's own
        ``attribute`` options, for a method whose options need more)."""
        probes: list[Probe] = [ValueRecorder()] if effective else []
        if self.spec.needs == "relevance":
            if self.propagation_rules is None:
                raise TypeError(f"{type(self).__name__} propagates relevance: set self.propagation_rules in __init__.")
            probes.append(RelevanceRules(self.propagation_rules, bool(options.get("through_vision_tower"))))
        return probes

    def _eager_reason(self, adapter: AttentionAdapter, effective: bool, return_maps: bool, options: dict[str, Any]) -> str | None:
        """Why this call cannot stream exactly, or None when it can."""
        reason = stream_refusal(adapter, self._probes(effective, **options))
        if reason is None and return_maps:
            reason = "return_maps=True needs the full maps"
        if reason is None and not self.spec.streams:
            reason = f"{type(self).__name__} has no streaming reduction"
        return reason or next((why for name, why in self.spec.eager_options.items() if options.get(name)), None)

    def _one_stack_adapter(self) -> AttentionAdapter:
        """The model's adapter; a one-line error where a method defined for one
        self-attention stack is given an encoder-decoder or a language model
        cross-attending to image features."""
        adapter = resolve_adapter(self.model, self.adapter)
        if (adapter.is_encoder_decoder(self.model) or cross_attends_images(self.model)) and not self.spec.encoder_decoder:
            raise ValueError(
                f"{type(self).__name__} is defined for one self-attention stack, not for encoder-decoders nor for a language "
                "model cross-attending to image features (Mllama)."
            )
        return adapter

    def _recorded(
        self,
        inputs: tuple[Tensor, ...],
        additional_forward_args: Any,
        query_index: QueryIndex,
        effective: bool,
        return_maps: bool,
        options: dict[str, Any],
    ) -> ForwardRecord:
        """One forward through the capture, in the mode the runner decides."""
        adapter = self._one_stack_adapter()
        if self.spec.rolls_out and (mixers := tokens_mixed_outside_attention(self.model, adapter)):
            raise UnsupportedModelError(
                f"{self.get_name()} rolls out the attention layers, but {type(self.model).__name__} also mixes "
                f"tokens outside them ({mixers}): use AttnLRP, Grad-SAM or raw attention."
            )
        if self.spec.needs != "forward" or self.spec.reads_target or self.spec.reads_weights:
            check_not_quantized(self.model, self.get_name())
        reason = self._eager_reason(adapter, effective, return_maps, options)
        return self._runner.run(lambda stream: self._forward(inputs, additional_forward_args, query_index, stream, effective, options), reason)

    def _forward(
        self,
        inputs: tuple[Tensor, ...],
        additional_forward_args: Any,
        query_index: QueryIndex,
        streaming: bool,
        effective: bool,
        options: dict[str, Any],
    ) -> ForwardRecord:
        """One forward with the method's probes (in the autograd graph for gradient
        methods); with ``effective=True`` its maps are effective attention; under
        propagation rules, given text embeddings are where relevance is read."""
        probes = self._probes(effective, **options)
        relevance = any(isinstance(probe, RelevanceRules) for probe in probes)
        pixels, given = None, inputs
        if relevance:
            check_gradients_possible()
            given = tuple(t.detach().requires_grad_() if _given_embeddings(self.model, t) else t for t in inputs)
            with torch.enable_grad():  # the model reads copies: computed from the inputs, activations to the rules (a leaf is a weight's kind)
                inputs = tuple(t.clone() if t.requires_grad else t for t in given)
            if options.get("through_vision_tower"):
                if cross_attends_images(self.model):
                    raise ValueError(
                        f"through_vision_tower follows image tokens back into the vision tower; {type(self.model).__name__} "
                        "cross-attends to its image features instead, and their relevance is the first of the pair it returns."
                    )
                additional_forward_args, pixels = with_pixel_leaf(
                    format_additional_forward_args(additional_forward_args), options.get("pixel_baselines", 0.0)
                )
        record = record_forward(
            self.forward_func, self.model, inputs, additional_forward_args, self.adapter, probes=probes,
            track_grad=self.spec.needs == "backward", query_index=query_index, streaming=streaming,
            confirm_rows=self.spec.reads_query_row,
        )
        if effective:
            record = with_effective_attention(record)
        if relevance:
            embeddings = record.result(Embeddings).after([t for t in given if t.requires_grad])
            if not embeddings.tensors:
                raise ValueError(
                    f"No input embeddings of {type(self.model).__name__} were seen: its adapter names none "
                    "(input_embeddings), or the forward did not call them. Pass embeddings as inputs instead."
                )
            record = record.with_result(embeddings)
        return record if pixels is None else record.with_result(pixels)

    def _explained(self, record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool = False) -> ForwardRecord:
        """The record ready for the method's reduction: with one backward pass for
        ``target`` where the method needs one."""
        needs, reduction = self.spec.needs, self.spec.gradient_reduction
        if needs == "relevance":
            return with_relevance(record, target, retain_graph)
        if reduction is not None and not record.streaming:
            return record.with_gradients(target, reduction, retain_graph)
        if needs == "backward":
            return record.with_output_gradients(target, retain_graph)
        return record if record.streaming else replace(record, attn_maps=[p.float() for p in record.attn_maps])

    def _method_scores(self, record: ForwardRecord, **options: Any) -> tuple[Scores, Any]:
        """The scores of an explained record, and the maps ``return_maps`` gives (None
        where the method has none); a refusal of the model's parts (a sum that does not
        add up) names the modules that carry a hook of the user's."""
        try:
            return self._reduced(record, **options)
        except UnsupportedModelError as error:
            hooked = hooked_modules(self.model)
            if not hooked:
                raise
            shown = ", ".join(hooked[:3]) + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
            raise UnsupportedModelError(
                f"{str(error).rstrip('.')} ({shown} carries a forward hook: where it changes what the module returns, the "
                "parts read from the weights no longer add up to what the model computes; remove it while explaining)."
            ) from error

    def _reduced(self, record: ForwardRecord, **options: Any) -> tuple[Scores, Any]:
        if self.spec.needs == "relevance":
            return relevance_scores(record), None
        if record.streaming:
            return self._streamed_scores(record, **options), None
        if record.is_encoder_decoder:
            return self._encoder_decoder_scores(record, **options)
        scores, maps = self._scores(record, **options)
        return scores, record.by_role(maps)

    @_explanation
    def _explain(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType,
        additional_forward_args: Any,
        query_index: QueryIndex,
        return_maps: bool,
        **options: Any,
    ) -> Any:
        """What every ``attribute`` does: check the method's ``options``, record, reduce,
        shape the output like Captum (``effective=True``: over effective attention, for
        the methods that offer it)."""
        self._check_options(options, "attribute")
        effective = bool(options.pop("effective", False))
        is_tuple, tensors = format_inputs(inputs)
        adapter = resolve_adapter(self.model, self.adapter)
        check_inputs(adapter, self.model, tensors, " and get (source scores, target scores) back")
        target, query_index, indexed = index_target(target, query_index, tensors[-1].shape[1])
        record = self._recorded(tensors, additional_forward_args, query_index, effective, return_maps, options)
        if indexed and record.logits.dim() != 3:
            raise ValueError(
                f"target (position, class) indexes logits per position, as Captum reads a tuple, but forward_func returns "
                f"{tuple(record.logits.shape)} logits: pass target as an int, or a list of one class per example."
            )
        record = self._explained(record, target)
        if not record.is_encoder_decoder and len(tensors) != 1:
            raise TypeError("A pair of inputs is for encoder-decoder models; pass one tensor.")
        scores, maps = self._method_scores(record, **options)
        scores = leading_apart(record, _zero_padding(record, scores))
        if tensors[0].dim() == 4:
            scores = _on_patch_grid(adapter, self.model, tensors[0], scores)
        return format_scores(is_tuple or isinstance(scores, tuple), scores, maps, return_maps)

    @_explanation
    def attribute_continuation(
        self,
        inputs: Tensor,
        continuation: Tensor,
        additional_forward_args: Any = None,
        log_prob: bool = False,
        **options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
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
            continuation (Tensor or list): ``(batch, new_tokens)`` token ids, e.g.
                ``model.generate(...)[:, prompt_len:]`` (a row padded after its
                end-of-sequence token, as ``generate`` pads a batch's shorter answers, is
                refused: give it alone, up to its end); one answer's ids (1-D, one row,
                or a tokenizer's list) are every prompt's.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``; every tensor shaped ``(batch, prompt_len)`` is taken as a
                padding mask and extended with ones over the continuation. Default: None.
            log_prob (bool, optional): explain each token's log-probability
                :math:`\log p(c_k \mid \text{prefix})` instead of its logit (Captum's
                LLM attributions explain log-probabilities). Default: False.
            **options: the method's options of ``attribute`` (e.g. ``head_fusion``,
                ``effective``).

        For an encoder-decoder (T5, BART, Marian, ...), ``inputs`` are the source token
        ids and ``continuation`` the generated target: the decoder reads the model's
        ``decoder_start_token_id`` and then the continuation, position k predicting
        ``continuation[:, k]``, and row k is exactly ``attribute((source, decoder_prefix),
        target=continuation[:, k])``; ``additional_forward_args`` is the source's
        attention mask only.

        Returns:
            Tensor ``(batch, new_tokens, prompt_len + new_tokens)``: one row of scores per
            continuation token, 0 at padding and at the token itself and after. For an
            encoder-decoder, ``(source rows (batch, new_tokens, source_len), target rows
            (batch, new_tokens, new_tokens))``, the target rows over the decoder's inputs
            (its start token, then the continuation but its last token).
        """
        record, first, continuation = self._continuation_record(inputs, continuation, additional_forward_args, options)
        new_tokens = continuation.shape[1]
        positions = first + torch.arange(new_tokens, device=record.target_real.device).expand(len(continuation), -1)
        streams_rows = record.streaming and self.spec.needs == "forward" and not record.is_encoder_decoder
        together = self._streamed_rows(record, positions, continuation.to(positions.device), **options) if streams_rows else None
        if together is not None:
            return torch.stack([_zero_padding(record.at_query(positions[:, k]), together[:, k]) for k in range(new_tokens)], dim=1)
        rows = []
        for step in range(new_tokens):
            position = positions[:, step]
            token = continuation[:, step].to(record.logits.device)
            target = LogProbTarget(position[:, None], token[:, None]) if log_prob else token
            explained = self._explained(record.at_query(position), target, retain_graph=step < new_tokens - 1)
            rows.append(leading_apart(explained, _zero_padding(explained, self._method_scores(explained, **options)[0])))
        if isinstance(rows[0], tuple):  # (source, target), (tokens, pixels), or (leading positions, tokens)
            stacked = torch.stack([row[0] for row in rows], dim=1), torch.stack([row[1] for row in rows], dim=1)
            return _on_patch_grid(resolve_adapter(self.model, self.adapter), self.model, inputs, stacked) if inputs.dim() == 4 else stacked
        return torch.stack(rows, dim=1)

    @_explanation
    def attribute_span(
        self,
        inputs: Tensor,
        continuation: Tensor,
        additional_forward_args: Any = None,
        **options: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        r"""Explain a whole continuation of a decoder's prompt in one forward (and, for
        gradient methods, one backward).

        The explained score is the continuation's log-likelihood,
        :math:`S = \sum_k \log p(c_k \mid \text{prompt}, c_{<k})`, which Captum's LLM
        attributions call the sequence attribution's target. Its query rows are the
        positions that predict the continuation (prompt_len - 1 to prompt_len +
        new_tokens - 2): the methods that read the explained query's row (rollout, raw
        attention, Transformer Attribution) read the sum of those rows, so that rollout's
        and raw attention's span scores are exactly the sum of
        :meth:`attribute_continuation`'s rows; the gradient methods take dS/dA of the
        summed objective (Grad-SAM credits every token's own row, as for one position;
        AttnLRP propagates S). Attention Flow (a max-flow to one sink) has no span
        (``spec.spans``).

        Args:
            inputs (Tensor): prompt token ids ``(batch, prompt_len)``, padded on the left.
            continuation (Tensor or list): ``(batch, new_tokens)`` token ids of the
                continuation (none padded after its end-of-sequence token; one answer's
                ids every prompt's, as for :meth:`attribute_continuation`).
            additional_forward_args (Any, optional): as for
                :meth:`attribute_continuation`. Default: None.
            **options: the method's options of ``attribute``.

        For an encoder-decoder, ``inputs`` are the source token ids and ``continuation``
        the target, read by the decoder after its start token (as in
        :meth:`attribute_continuation`); the explained score is the target's
        log-likelihood given the source, its query rows every decoder position.

        Returns:
            Tensor ``(batch, prompt_len + new_tokens)``: the scores of the prompt's and the
            continuation's tokens (0 at padding and at the last continuation token, which
            no explained position sees). For an encoder-decoder, ``(source scores (batch,
            source_len), target scores (batch, new_tokens))``, the target's over the
            decoder's inputs (its start token, then the continuation but its last token).
        """
        if not self.spec.spans:
            raise ValueError(
                f"{self.get_name()} explains one query token at a time and has no span: explain each "
                "token with attribute_continuation instead of attribute_span."
            )
        record, first, continuation = self._continuation_record(inputs, continuation, additional_forward_args, options)
        forced = forced_tokens(self.model, continuation)  # read, not explained, as the decoder's start token
        positions = torch.arange(first + forced, first + continuation.shape[1], device=record.target_real.device)
        target = LogProbTarget(positions.expand(len(continuation), -1), continuation[:, forced:].to(record.target_real.device))
        explained = self._explained(record.at_query(target.query_weights(record.target_real.shape[1])), target)
        scores = leading_apart(explained, _zero_padding(explained, self._method_scores(explained, **options)[0]))
        return _on_patch_grid(resolve_adapter(self.model, self.adapter), self.model, inputs, scores) if inputs.dim() == 4 else scores

    def _continuation_record(
        self, inputs: Tensor, continuation: Any, additional_forward_args: Any, options: dict[str, Any]
    ) -> tuple[ForwardRecord, int, Tensor]:
        """One forward of prompt + continuation (an encoder-decoder's source, and its
        decoder's start token + continuation), the first position that predicts the
        continuation, and the continuation as ``(batch, new_tokens)`` ids
        (:func:`~captum_attention.capture.inputs.answer_ids`; ``options`` loses
        ``effective``, which the record applies)."""
        self._check_options(options, "attribute_span or attribute_continuation")
        _, (prompt,) = format_inputs(inputs)
        continuation = answer_ids(continuation, prompt.shape[0], "continuation")
        _check_continuation(prompt, continuation)
        check_no_padding_after_end(self.model, continuation)
        warn_if_answer_begins_with_bos(self.model, continuation)
        chosen_answer_start(self.model, continuation)
        adapter = self._one_stack_adapter()
        effective = bool(options.pop("effective", False))
        continuation = continuation.to(prompt.device)
        _check_vocabulary(adapter, self.model, continuation if prompt.is_floating_point() else torch.cat([prompt, continuation], dim=1))
        if adapter.is_encoder_decoder(self.model):
            decoder, extra = _decoder_inputs(self.model, prompt, continuation, additional_forward_args)
            return self._recorded((prompt, decoder), extra, None, effective, False, options), 0, continuation
        check_captioner_prompt(self.model, prompt)
        sequence = torch.cat([prompt, continuation], dim=1)
        extra = _extend_masks(adapter, self.model, additional_forward_args, prompt.shape, continuation.shape[1])
        record = self._recorded((sequence,), extra, None, effective, False, options)
        _check_continuation_record(record, record.leading + prompt.shape[1])
        return record, record.leading + prompt.shape[1] - 1, continuation


AttentionAttributionBase.__doc__ = shared_class_docs(AttentionAttributionBase.__doc__)


@dataclass
class TokenRelevance:
    """Per embedded sequence (an encoder-decoder's source, then target), the ``(B, T)``
    relevance of its tokens: input × modified gradient, summed over the hidden size; and,
    carried through a vision tower, the relevance of each pixel value."""

    per_sequence: list[Tensor]
    pixels: Tensor | None = None


def _given_embeddings(model: nn.Module, tensor: Tensor) -> bool:
    """Whether ``tensor`` holds embeddings given in place of token ids, where relevance is
    read; not the flattened patches a vision model reads as its pixels (SigLIP2's native
    sizes), whose patch embeddings hold it, as an image's do."""
    return tensor.is_floating_point() and tensor.dim() == 3 and getattr(model, "main_input_name", None) != "pixel_values"


def with_relevance(record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool) -> ForwardRecord:
    """The record with the relevance of each embedded sequence (and of the pixels the
    record carried relevance to) for ``target``."""
    recorded = record.result(Embeddings)
    embeddings, injected = recorded.tensors, [i.features for i in recorded.injected]
    pixels = record.results.get(PixelInputs)
    score = record.target_score(target)
    with torch.enable_grad():
        grads = torch.autograd.grad(
            score, embeddings + injected + ([pixels.leaf] if pixels else []), retain_graph=retain_graph, allow_unused=True
        )
    relevance = [token_relevance(e, torch.zeros_like(e) if g is None else g) for e, g in zip(embeddings, grads)]
    for place, grad in zip(recorded.injected, grads[len(embeddings) :]):
        if grad is not None:  # the injected features' relevance, held by the tokens they were added to
            relevance[place.into] = relevance[place.into].masked_scatter(
                place.positions, relevance[place.into][place.positions] + token_relevance(place.features, grad)
            )
    if pixels is None:
        return record.with_result(TokenRelevance(relevance))
    if grads[-1] is None:
        raise UnsupportedModelError(
            f"{type(record.capture.model).__name__}'s explained output does not depend on pixel_values through the "
            "autograd graph (the image features are computed without gradients): through_vision_tower cannot reach them."
        )
    return record.with_result(TokenRelevance(relevance, pixels.relevance(grads[-1])))


def relevance_scores(record: ForwardRecord) -> Scores:
    """The relevance per token, aligned right with the tokens the attention sees (a
    vision transformer's class and distillation tokens, which have no input embedding,
    get 0), after the image features a model puts before its tokens (GIT's); an
    encoder-decoder's ``(source, target)``; with pixels, ``(tokens, pixels)``."""
    relevance = record.result(TokenRelevance)
    if record.is_encoder_decoder:
        if len(relevance.per_sequence) < 2:
            raise UnsupportedModelError(
                f"{type(record.capture.model).__name__}'s decoder embedded its tokens through no module AttnLRP found "
                "(the input embeddings of its get_encoder() and get_decoder()): its target's relevance cannot be read."
            )
        return _aligned(relevance.per_sequence[0], record.input_real), _aligned(relevance.per_sequence[-1], record.target_real)
    if record.leading and len(relevance.per_sequence) > 1:  # GIT's image features, then its tokens
        features, text = relevance.per_sequence[0], relevance.per_sequence[-1]
        tokens = torch.cat([features, _aligned(text, record.target_real[:, record.leading :])], dim=1)
    else:
        tokens = _aligned(relevance.per_sequence[0], record.target_real)
    return tokens if relevance.pixels is None else (tokens, relevance.pixels)


def _aligned(relevance: Tensor, real: Tensor) -> Tensor:
    """``(B, T')`` relevance padded on the left to the ``T`` tokens of ``real``."""
    return F.pad(relevance, (real.shape[1] - relevance.shape[1], 0))


def with_effective_attention(record: ForwardRecord) -> ForwardRecord:
    """``record`` with each call's probabilities replaced by its effective attention
    (Brunner et al., ICLR 2020; see :func:`~captum_attention.maps.effective_attention`),
    each real query's row projected over the keys it sees."""
    recorded = record.result(RecordedValues)
    maps = [
        effective_attention(attn, values, *record.visible_keys(call), projection)
        for call, (attn, values, projection) in enumerate(zip(record.attn_maps, recorded.values, recorded.projections))
    ]
    return replace(record, attn_maps=maps)


def leading_apart(record: ForwardRecord, scores: Any) -> Any:
    """``scores`` over a record's positions as ``(leading positions' scores, the input
    tokens' scores)`` where the model put positions before the tokens (GIT's image
    features: their scores first, as a model that cross-attends to its image's states gives
    them); with pixels, ``(the input tokens' scores, pixels)`` (the features passed their
    relevance on to the pixels); else as they are."""
    if not record.leading:
        return scores
    if isinstance(scores, tuple):  # (tokens, pixels): a model with leading positions is no encoder-decoder
        return scores[0][..., record.leading :], scores[1]
    return scores[..., : record.leading], scores[..., record.leading :]


def _zero_padding(record: ForwardRecord, scores: Any) -> Any:
    """``scores`` (or ``(source, target)`` scores) exactly 0 outside the real tokens, also
    where non-finite values elsewhere would spread into them through a product; NaN at the
    real tokens of an example whose explained logits are not finite (a streaming
    recomputation of NaN attention could otherwise give finite numbers); a refusal in one
    line where an example whose explained logits are finite has a non-finite score at a
    real token (:func:`_check_finite_where_explained`)."""
    broken = ~record.explained_finite()

    def finished(side: Tensor, real: Tensor) -> Tensor:
        broken_here = broken.to(side.device)
        _check_finite_where_explained(side, real, broken_here, record.streaming)
        nan_rows = broken_here[:, None] & real
        return side.masked_fill(nan_rows, float("nan")).masked_fill(~real, 0.0)

    if isinstance(scores, tuple) and record.is_encoder_decoder:
        source, target = scores
        return finished(source, record.input_real), finished(target, record.target_real)
    if isinstance(scores, tuple):  # (tokens, pixels)
        return finished(scores[0], record.target_real), scores[1]
    return finished(scores, record.target_real)


def _check_finite_where_explained(scores: Tensor, real: Tensor, broken: Tensor, streamed: bool) -> None:
    """A one-line refusal (:class:`NonFiniteScores`) where ``scores`` hold a non-finite value
    at a ``real`` token of an example whose explained logits are finite (not ``broken``):
    the model's own backward is not finite there, as Gemma-3n's under sdpa attention on a
    left-padded batch (its fully masked padded rows), which the example alone or eager
    attention does not meet (``capture='auto'`` retries eager by itself)."""
    examples = ((~scores.isfinite() & real).any(dim=tuple(range(1, scores.dim()))) & ~broken).nonzero().flatten().tolist()
    if examples:
        raise NonFiniteScores(
            f"The scores of examples {examples} are not finite at their real tokens, while the explained logits are: the "
            "model's gradient is not finite there (a padded row's under its attention kernel can spread): explain each "
            + ("example alone, or pass capture='auto' or 'eager'." if streamed else "example alone.")
        )


def _check_continuation_record(record: ForwardRecord, prompt_len: int) -> None:
    """A decoder-only model (its prompt's leading tokens may see each other both ways, but
    not the continuation), prompts padded on the left."""
    if not record.causal or (record.prefix is not None and bool((record.prefix > prompt_len).any())):
        raise ValueError(
            "attribute_continuation and attribute_span explain a generated continuation, which the prompt never sees: "
            "in this forward it does (an encoder, a decoder made bidirectional, or token types that put the continuation "
            "in a bidirectional prefix): explain a decoder or an encoder-decoder, with per-token inputs (token_type_ids) "
            "for the prompt only."
        )
    if not bool(record.target_real[:, prompt_len - 1].all()):
        raise ValueError("Pad the prompts on the left (as for generate): the last prompt token must be real.")


def _decoder_inputs(model: nn.Module, source: Tensor, continuation: Tensor, additional_forward_args: Any) -> tuple[Tensor, tuple]:
    """An encoder-decoder's decoder ids, its start token then the continuation but its last
    token (each position predicts the next), and the forward's arguments: the source's mask
    (given, or ones; none for an encoder that reads pixels), the decoder's (ones), and a
    vision-language model's image inputs where given last (Florence-2's, which its encoder
    reads)."""
    start = decoder_start_token(model)
    extra = format_additional_forward_args(additional_forward_args) or ()
    images = extra[-1:] if extra and isinstance(extra[-1], Mapping) else ()
    extra = extra[: len(extra) - len(images)]
    if len(extra) > 1:
        raise ValueError(
            "An encoder-decoder's answer takes the source's attention mask only as additional_forward_args, and a "
            "vision-language model's image inputs last (the decoder reads its start token and the continuation, all real)."
        )
    decoder = torch.cat([torch.full_like(continuation[:, :1], start), continuation[:, :-1]], dim=1)
    if source.dim() == 4:  # an image encoder's pixels, all real
        if extra:
            raise ValueError(
                "An encoder-decoder whose encoder reads the image (pixel_values) takes no source mask: leave "
                "additional_forward_args out (its decoder reads its start token and the continuation, all real)."
            )
        return decoder, (torch.ones_like(decoder), *images)
    source_mask = extra[0] if extra and extra[0] is not None else torch.ones_like(source)
    return decoder, (source_mask, torch.ones_like(decoder), *images)


def _check_continuation(prompt: Tensor, continuation: Tensor) -> None:
    if continuation.dim() == 2 and continuation.shape[1] == 0:
        raise ValueError("continuation has no tokens: give at least one new token to explain.")
    wrong_type = continuation.is_floating_point() or continuation.dtype == torch.bool
    if continuation.dim() != 2 or continuation.shape[0] != prompt.shape[0] or wrong_type:
        raise ValueError(
            f"continuation must be token ids (batch={prompt.shape[0]}, new_tokens), got "
            f"shape {tuple(continuation.shape)} and dtype {continuation.dtype}."
        )


def _check_vocabulary(adapter: AttentionAdapter, model: nn.Module, ids: Tensor) -> None:
    """A clear error for a token id outside the vocabulary of the model's token embedding
    (the embedding lookup would fail with a bare IndexError)."""
    try:
        embeddings = [m for m in adapter.input_embeddings(model) if isinstance(m, nn.Embedding)]
    except UnsupportedModelError:
        return
    if not embeddings:
        return
    problem = outside_vocabulary(model, ids, embeddings[-1].num_embeddings)
    if problem:
        raise ValueError(problem)


def _extend_masks(adapter: AttentionAdapter, model: nn.Module, additional_forward_args: Any, prompt_shape: torch.Size, new_tokens: int) -> Any:
    """Every ``(batch, prompt_len)`` tensor argument extended with ``new_tokens`` ones; a
    mapping of keyword arguments (a vision-language model's inputs) as ``generate`` extends
    it (the adapter's ``generated_inputs``)."""
    extra = format_additional_forward_args(additional_forward_args)
    if extra is None:
        return None

    def extended(arg: Any) -> Any:
        if isinstance(arg, Mapping):
            return adapter.generated_inputs(model, arg, prompt_shape[1], new_tokens)
        if not (isinstance(arg, Tensor) and tuple(arg.shape) == tuple(prompt_shape)):
            return arg
        return torch.cat([arg, arg.new_ones(arg.shape[0], new_tokens)], dim=1)

    return tuple(extended(arg) for arg in extra)


def _on_patch_grid(adapter: AttentionAdapter, model: nn.Module, images: Tensor, scores: Any) -> Any:
    """Scores over the tokens of ``images`` ``(..., T)`` on their patch grid ``(..., rows,
    columns)``, the prefix tokens dropped: an image model's, or an encoder-decoder's source
    scores where its encoder reads the image (the target's as they are)."""
    grid = _grid_shape(adapter, model, images)
    return (patch_grid(scores[0], grid), scores[1]) if isinstance(scores, tuple) else patch_grid(scores, grid)


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
