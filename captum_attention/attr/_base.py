"""What the four attention attributions share: one forward (and backward) through Capture."""

from __future__ import annotations

import string
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, TypeVar

import torch
from captum._utils.common import (
    _format_additional_forward_args,
    _format_output,
    _format_tensor_into_tuples,
    _run_forward,
)
from captum._utils.typing import TargetType
from torch import Tensor, nn

from ..capture import AttentionAdapter, AttentionCapture
from ..maps import is_causal, patch_grid, query_rows, real_tokens
from ._images import grid_shape

Scores = Tensor | tuple[Tensor, ...]


GradientReduction = Callable[[Tensor, Tensor], Tensor]


@dataclass
class CapturedAttention:
    """One call's attention, ready for the maps layer.

    Attributes:
        attn_probs: per attention call, ``(B, H, Q, K)`` float32 probabilities; None for
            gradient methods, which keep only ``grad_maps``.
        grad_maps: per attention call, the method's reduction of (A, dS/dA) over heads,
            ``(B, Q, K)`` float32 (computed as the backward pass reaches the call), or None.
        heads: per attention call, the number of heads.
        roles: per attention call, ``"self"``, or ``"encoder"``/``"decoder"``/``"cross"``.
        real: ``(B, T)`` bool, True for real tokens of the explained sequence (the
            target sequence of an encoder-decoder; for a decoder, up to the query).
        query_index: ``(B,)`` long, the explained query position per example.
        source_real: encoder-decoders: ``(B, S)`` bool real source tokens, else None.
    """

    attn_probs: list[Tensor] | None
    grad_maps: list[Tensor] | None
    heads: list[int]
    roles: list[str]
    real: Tensor
    query_index: Tensor
    source_real: Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.roles)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.source_real is not None

    def of_role(self, role: str) -> "CapturedAttention":
        """Only the calls of one role (e.g. the decoder's self-attention)."""
        chosen = [i for i, r in enumerate(self.roles) if r == role]

        def pick(values: list[Any] | None) -> Any:
            return None if values is None else [values[i] for i in chosen]

        return replace(
            self, attn_probs=pick(self.attn_probs), grad_maps=pick(self.grad_maps),
            heads=pick(self.heads), roles=pick(self.roles),
        )

    def real_of(self, role: str) -> tuple[Tensor, Tensor]:
        """``(real queries, real keys)`` of a call with this role: the source tokens for the
        encoder's self-attention and cross-attention keys, else the explained sequence."""
        source = self.source_real if self.source_real is not None else self.real
        queries = source if role == "encoder" else self.real
        keys = self.real if role in ("self", "decoder") else source
        return queries, keys

    def layer(self, index: int, name: str = "layer") -> int:
        """``index`` resolved to ``0..L-1`` (negative counts from the end), or a clear error."""
        if not -self.num_layers <= index < self.num_layers:
            raise ValueError(
                f"{name}={index} is out of range: the model has {self.num_layers} attention "
                f"layers, so {name} must be in [{-self.num_layers}, {self.num_layers - 1}]."
            )
        return index % self.num_layers


class AttentionAttributionBase:
    """Mixin for the attention attributions; combine with a Captum ``Attribution`` class.

    Args:
        forward_func (Callable): the forward function of the model, returning logits
            ``(batch, num_classes)``; a Hugging Face model (its ``.logits`` is used) or
            any function of ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module that holds the attention layers.
            Default: ``forward_func`` when it is an ``nn.Module``.
        adapter (AttentionAdapter, optional): how to find the attention in ``model``.
            Default: the built-in adapter (Hugging Face models).
    """

    gradient_reduction: GradientReduction | None = None  # set by the gradient methods
    readable_name = ""
    forward_func: Callable[..., Any]  # set by Captum's Attribution.__init__

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
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
        super().__init__(forward_func)  # type: ignore[call-arg]
        self.model = model
        self.adapter = adapter

    @classmethod
    def get_name(cls) -> str:
        return cls.readable_name or cls.__name__

    def _capture(
        self,
        inputs: tuple[Tensor, ...],
        target: TargetType,
        additional_forward_args: Any,
        query_index: QueryIndex = None,
    ) -> CapturedAttention:
        """Run the model once (and, for gradient methods, one ``autograd.grad``)."""
        return capture_attention(
            self.forward_func, self.model, inputs, target, additional_forward_args,
            query_index, self.adapter, self.gradient_reduction,
        )

    def _scores(self, captured: CapturedAttention, **options: Any) -> tuple[Tensor, list[Tensor]]:
        """The method's ``(B, T)`` scores and per-layer maps for one self-attention stack."""
        raise NotImplementedError

    def _encoder_decoder_scores(
        self, captured: CapturedAttention, **options: Any
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """``(source, target)`` scores and the maps per role for an encoder-decoder."""
        raise NotImplementedError

    def _explain(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType,
        additional_forward_args: Any,
        query_index: QueryIndex,
        return_maps: bool,
        **options: Any,
    ) -> Any:
        """What every ``attribute`` does: capture, reduce, shape the output like Captum."""
        is_tuple, tensors = format_inputs(inputs)
        if getattr(getattr(self.model, "config", None), "is_encoder_decoder", False) and len(tensors) != 2:
            raise TypeError(
                f"{type(self.model).__name__} is an encoder-decoder: pass inputs=(input_ids, "
                "decoder_input_ids) and get (source scores, target scores) back."
            )
        captured = self._capture(tensors, target, additional_forward_args, query_index)
        if captured.is_encoder_decoder:
            scores, role_maps = self._encoder_decoder_scores(captured, **options)
            return format_scores(True, scores, role_maps, return_maps)
        if len(tensors) != 1:
            raise TypeError("A pair of inputs is for encoder-decoder models; pass one tensor.")
        token_scores, maps = self._scores(captured, **options)
        if tensors[0].dim() == 4:
            token_scores = patch_grid(token_scores, grid_shape(self.model, tensors[0]))
        return format_scores(is_tuple, token_scores, maps, return_maps)

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
            **options: the method's options of ``attribute`` (e.g. ``head_fusion``).

        Returns:
            Tensor ``(batch, new_tokens, prompt_len + new_tokens)``: one row of scores per
            continuation token, 0 at padding and at the token itself and after.
        """
        _, (prompt,) = format_inputs(inputs)
        if continuation.dim() != 2 or continuation.shape[0] != prompt.shape[0] or continuation.is_floating_point():
            raise ValueError(
                f"continuation must be token ids (batch={prompt.shape[0]}, new_tokens), got "
                f"shape {tuple(continuation.shape)} and dtype {continuation.dtype}."
            )
        prompt_len, new_tokens = prompt.shape[1], continuation.shape[1]
        sequence = torch.cat([prompt, continuation.to(prompt.device)], dim=1)
        extra = _extend_masks(additional_forward_args, prompt.shape, new_tokens)
        reduction = self.gradient_reduction
        run = forward_through_capture(
            self.forward_func, self.model, (sequence,), extra, self.adapter, reduction is not None
        )
        if run.source_real is not None or not run.is_causal():
            raise ValueError(
                "attribute_continuation needs a decoder-only model (causal self-attention); for "
                "an encoder-decoder, call attribute with query_index at each target position."
            )
        if not bool(run.real[:, prompt_len - 1].all()):
            raise ValueError("Pad the prompts on the left (as for generate): the last prompt token must be real.")
        positions = torch.arange(prompt_len - 1, prompt_len - 1 + new_tokens, device=run.real.device)
        attn_probs = None if reduction is not None else [p.detach().float() for p in run.attn_probs]
        heads = [p.shape[1] for p in run.attn_probs]
        rows = []
        for step, position in enumerate(positions.tolist()):
            grad_maps = None
            if reduction is not None:
                logits = run.logits[:, position]
                score = logits.gather(1, continuation[:, step : step + 1].to(logits.device)).sum()
                with torch.enable_grad():
                    grads = run.capture.gradients(score, reduction, retain_graph=step < new_tokens - 1)
                grad_maps = [g.float() for g in grads]
            query = torch.full((len(prompt),), position, dtype=torch.long, device=run.real.device)
            captured = CapturedAttention(attn_probs, grad_maps, heads, run.roles, up_to(run.real, query), query)
            rows.append(self._scores(captured, **options)[0])
        return torch.stack(rows, dim=1)


def up_to(real: Tensor, queries: Tensor) -> Tensor:
    """``real`` without the tokens after each example's query position."""
    return real & (torch.arange(real.shape[1], device=real.device) <= queries[:, None])


def _extend_masks(additional_forward_args: Any, prompt_shape: torch.Size, new_tokens: int) -> Any:
    """Every ``(batch, prompt_len)`` tensor argument extended with ``new_tokens`` ones."""
    extra = _format_additional_forward_args(additional_forward_args)
    if extra is None:
        return None
    return tuple(
        torch.cat([arg, arg.new_ones(arg.shape[0], new_tokens)], dim=1)
        if isinstance(arg, Tensor) and tuple(arg.shape) == tuple(prompt_shape)
        else arg
        for arg in extra
    )


QueryIndex = int | Sequence[int] | Tensor | None


@dataclass
class ForwardPass:
    """One forward through the capture layer: logits, attention as captured, padding."""

    logits: Tensor  # (B, C) or, for language models, (B, T, V)
    capture: AttentionCapture  # attention per call, still in the autograd graph if tracked
    real: Tensor  # (B, T) bool, the explained (target) sequence
    source_real: Tensor | None  # (B, S) bool for encoder-decoders
    _causal: bool | None = None

    @property
    def attn_probs(self) -> list[Tensor]:
        return self.capture.attn_probs

    @property
    def roles(self) -> list[str]:
        return self.capture.roles

    def query_positions(self, query_index: QueryIndex) -> Tensor:
        """The explained position per example; None = the default (see ``_query_positions``)."""
        return _query_positions(query_index, self.real, self.is_causal())

    def is_causal(self) -> bool:
        """Whether the explained sequence's self-attention never looks ahead (a decoder)."""
        if self._causal is None:
            self_attention = [p for p, r in zip(self.attn_probs, self.roles) if r in ("self", "decoder")]
            self._causal = bool(self_attention) and is_causal(self_attention[0].detach(), self.real)
        return self._causal

    def explained_logits(self, queries: Tensor) -> Tensor:
        """``(B, C)``: classifier logits as they are, language-model logits at ``queries``."""
        if self.logits.dim() == 3:
            return self.logits[torch.arange(len(queries), device=self.logits.device), queries.to(self.logits.device)]
        return self.logits


def forward_through_capture(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    additional_forward_args: Any,
    adapter: AttentionAdapter | None = None,
    track_grad: bool = False,
    intervention: Callable[[int, Tensor, int, Tensor | None], Tensor] | None = None,
) -> ForwardPass:
    """Run ``forward_func`` once with ``model``'s attention captured (and intervened on)."""
    batch = inputs[0].shape[0]
    text_shape = (batch, inputs[0].shape[1]) if inputs[0].dim() in (2, 3) else None
    if model.training:
        warnings.warn(
            f"{type(model).__name__} is in training mode: dropout makes the attention "
            "random. Call model.eval() before explaining it.",
            stacklevel=4,
        )
    capture = AttentionCapture(
        model, adapter, track_grad=track_grad, input_shape=text_shape, intervention=intervention
    )
    with capture, torch.set_grad_enabled(track_grad):
        output = _run_forward(keyword_forward(forward_func), inputs, None, additional_forward_args)
    logits = output_logits(output)
    _check_attention(capture.attn_probs, capture.roles, batch, text_shape)
    device = inputs[0].device
    if "cross" in capture.roles:
        source_len = next(p.shape[-1] for p, r in zip(capture.attn_probs, capture.roles) if r == "cross")
        target_len = next(p.shape[-2] for p, r in zip(capture.attn_probs, capture.roles) if r == "cross")
        source_real = real_tokens(capture.attention_mask, batch, source_len, device)
        real = real_tokens(capture.decoder_attention_mask, batch, target_len, device)
        return ForwardPass(logits, capture, real, source_real)
    seq_len = capture.attn_probs[0].shape[-1]
    return ForwardPass(logits, capture, real_tokens(capture.attention_mask, batch, seq_len, device), None)


def capture_attention(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    target: TargetType,
    additional_forward_args: Any,
    query_index: QueryIndex = None,
    adapter: AttentionAdapter | None = None,
    gradient_reduction: GradientReduction | None = None,
) -> CapturedAttention:
    """The attention of one forward; with ``gradient_reduction``, instead of the
    probabilities, its reduction of (A, dS/dA) per call for the target's logit S."""
    gradients = gradient_reduction is not None
    run = forward_through_capture(forward_func, model, inputs, additional_forward_args, adapter, gradients)
    queries = run.query_positions(query_index)
    # A decoder's explanation of position q is that of its prefix: later tokens are not real to it.
    real = up_to(run.real, queries) if run.is_causal() else run.real
    heads = [p.shape[1] for p in run.attn_probs]
    grad_maps = None
    if gradient_reduction is not None:
        logits = run.explained_logits(queries)
        targets = resolve_targets(logits, target)
        with torch.enable_grad():  # callers such as NoiseTunnel run under no_grad
            grads = run.capture.gradients(logits.gather(1, targets[:, None]).sum(), gradient_reduction)
        grad_maps = [g.float() for g in grads]
    return CapturedAttention(
        attn_probs=None if gradients else [p.detach().float() for p in run.attn_probs],
        grad_maps=grad_maps,
        heads=heads,
        roles=run.roles,
        real=real,
        query_index=queries,
        source_real=run.source_real,
    )


def keyword_forward(forward_func: Callable[..., Any]) -> Callable[..., Any]:
    """A generating Hugging Face model (a causal LM or an encoder-decoder) called with
    Captum's positional arguments, by name.

    ``(inputs..., *additional_forward_args)`` map to ``(input_ids, attention_mask)`` for
    causal language models and to ``(input_ids, decoder_input_ids, attention_mask,
    decoder_attention_mask)`` for encoder-decoders (``inputs_embeds`` /
    ``decoder_inputs_embeds`` for float inputs). A causal language model given a
    left-padded mask gets ``position_ids`` counted over the real tokens, as ``generate``
    does. Other forward functions (and classifiers, whose positional order already is
    ``input_ids, attention_mask, ...``) are returned as they are.
    """
    from transformers import PreTrainedModel

    if not isinstance(forward_func, PreTrainedModel) or not forward_func.can_generate():
        return forward_func
    model = forward_func
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    names = (
        ["input_ids", "decoder_input_ids", "attention_mask", "decoder_attention_mask"]
        if encoder_decoder
        else ["input_ids", "attention_mask"]
    )

    def forward(*args: Any) -> Any:
        if len(args) > len(names):
            raise TypeError(
                f"{type(model).__name__} was given {len(args)} positional inputs; as "
                f"forward_func it takes at most {len(names)}: {names}. Wrap it in a function "
                "to pass more."
            )
        kwargs: dict[str, Any] = {}
        for name, value in zip(names, args):
            if isinstance(value, Tensor) and value.is_floating_point() and name.endswith("input_ids"):
                name = name.replace("input_ids", "inputs_embeds")
            kwargs[name] = value
        mask = kwargs.get("attention_mask")
        if not encoder_decoder and isinstance(mask, Tensor) and bool((mask[:, 0] == 0).any()):
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return model(**kwargs)

    return forward


def format_inputs(inputs: Tensor | tuple[Tensor, ...]) -> tuple[bool, tuple[Tensor, ...]]:
    """Validate Captum-style ``inputs``: one tensor of token ids, embeddings or images, or
    a pair ``(source, target)`` of them for encoder-decoders."""
    is_tuple = isinstance(inputs, tuple)
    formatted = _format_tensor_into_tuples(inputs) if is_tuple or isinstance(inputs, Tensor) else None
    if formatted is None or len(formatted) not in (1, 2) or not all(isinstance(t, Tensor) for t in formatted):
        raise TypeError(
            "inputs must be one tensor (or a 1-tuple): token ids (batch, seq_len), embeddings "
            "(batch, seq_len, hidden) or images (batch, channels, height, width); or, for "
            f"encoder-decoders, a pair (source, target); got {type(inputs).__name__}"
            + (f" of length {len(inputs)}" if isinstance(inputs, tuple) else "")
            + ". Pass further model inputs through additional_forward_args."
        )
    for tensor in formatted:
        _check_input(tensor, image_ok=len(formatted) == 1)
    return is_tuple, tuple(formatted)


def _check_input(tensor: Tensor, image_ok: bool) -> None:
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise ValueError("inputs is an empty batch: pass at least one example.")
    if tensor.is_floating_point() and tensor.dim() == 2:
        raise TypeError(
            f"inputs are floating-point with shape {tuple(tensor.shape)}: token ids must be "
            "integers (torch.long). To attribute embeddings (e.g. under NoiseTunnel), pass "
            "them as (batch, seq_len, hidden) and forward them through inputs_embeds."
        )
    if tensor.dtype == torch.bool or (not tensor.is_floating_point() and tensor.dim() != 2):
        raise TypeError(
            f"inputs with dtype {tensor.dtype} and shape {tuple(tensor.shape)} are neither "
            "token ids (integer, (batch, seq_len)) nor embeddings (float, (batch, seq_len, hidden))."
        )
    if tensor.is_floating_point() and tensor.dim() not in ((3, 4) if image_ok else (3,)):
        raise TypeError(
            f"float inputs must be embeddings (batch, seq_len, hidden) or images (batch, "
            f"channels, height, width), got shape {tuple(tensor.shape)}."
        )
    if tensor.dim() in (2, 3) and tensor.shape[1] == 0:
        raise ValueError("inputs have no tokens (seq_len is 0).")


def format_scores(is_tuple: bool, scores: Tensor | tuple[Tensor, ...], maps: Any, return_maps: bool) -> Any:
    """Captum's output convention, plus the per-layer maps on request."""
    formatted = _format_output(is_tuple, scores if isinstance(scores, tuple) else (scores,))
    if not return_maps:
        return formatted
    return formatted, (torch.stack(maps, dim=1) if isinstance(maps, list) else maps)


def output_logits(output: Any) -> Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, Tensor) or logits.dim() not in (2, 3):
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(
            f"forward_func must return logits of shape (batch, num_classes), or "
            f"(batch, seq_len, vocab) for language models, got {shape}. Wrap the model so "
            "that it returns the logits to explain."
        )
    return logits


def _check_attention(attn_probs: list[Tensor], roles: list[str], batch: int, text_shape: tuple[int, int] | None) -> None:
    if not attn_probs:
        raise RuntimeError(
            "The forward pass ran no attention module of `model`: check that forward_func "
            "calls the model passed as model=..."
        )
    for probs, role in zip(attn_probs, roles):
        keys_ok = role != "self" or text_shape is None or probs.shape[-1] == text_shape[1]
        if probs.dim() != 4 or probs.shape[0] != batch or not keys_ok:
            expected = f"keys={text_shape[1]}" if text_shape is not None else "keys"
            raise RuntimeError(
                f"Captured attention of shape {tuple(probs.shape)}, expected (batch={batch}, "
                f"heads, queries, {expected}): the adapter reads the wrong output."
            )


def resolve_targets(logits: Tensor, target: TargetType) -> Tensor:
    """Captum's ``target`` as a ``(B,)`` long tensor of class indices; None = predicted class."""
    batch, num_classes = logits.shape
    if target is None:
        return logits.argmax(dim=1)
    if isinstance(target, (list, tuple)) and any(not isinstance(t, int) for t in target):
        raise TypeError(f"target must hold ints (class indices), got {target!r}.")
    targets = torch.as_tensor(target, device=logits.device)
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"target must be class indices (integers), got dtype {targets.dtype}.")
    if targets.dim() == 0:
        targets = targets.expand(batch)
    if targets.shape != (batch,):
        raise ValueError(
            f"target has shape {tuple(targets.shape)}: give one int for all examples or one "
            f"per example ({batch})."
        )
    bad = ((targets < 0) | (targets >= num_classes)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"target {targets[bad[0]].item()} is out of range: the model has {num_classes} "
            f"classes, so target must be in [0, {num_classes - 1}]."
        )
    return targets.long()


def _query_positions(query_index: QueryIndex, real: Tensor, causal: bool = False) -> Tensor:
    """``query_index`` as a ``(B,)`` long tensor of real positions, or a clear error.

    None: the last real token when the attention is causal (decoders, where the
    explained logit is read), else the first real token ([CLS], a ViT's class token).
    """
    batch, seq_len = real.shape
    if query_index is None:
        positions = torch.arange(seq_len, device=real.device).expand(batch, -1)
        if causal:
            return positions.masked_fill(~real, -1).amax(dim=1)
        return positions.masked_fill(~real, seq_len).amin(dim=1)
    queries = torch.as_tensor(query_index, device=real.device)
    if queries.is_floating_point() or queries.dtype == torch.bool:
        raise TypeError(f"query_index must be an int or ints, got dtype {queries.dtype}.")
    if queries.dim() == 0:
        queries = queries.expand(batch)
    if queries.shape != (batch,):
        raise ValueError(
            f"query_index has shape {tuple(queries.shape)}: give one int or one per example ({batch})."
        )
    if ((queries < 0) | (queries >= seq_len)).any():
        raise ValueError(f"query_index {query_index} is outside the sequence [0, {seq_len - 1}].")
    padded = (~real[torch.arange(batch, device=real.device), queries]).nonzero().flatten().tolist()
    if padded:
        raise ValueError(
            f"query_index points at a padding token in examples {padded}: choose a real token "
            "(by default the first real token, or the last one for decoders)."
        )
    return queries.long()


def _encoder_decoder_rows(
    captured: CapturedAttention,
    maps: list[Tensor],
    relevance: Callable[[list[Tensor], list[Tensor], list[str]], tuple[Tensor, Tensor]],
) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
    """Source and target scores: the query rows of ``relevance``'s R^{qs} and R^{qq}."""
    encoder_maps = [m for m, role in zip(maps, captured.roles) if role == "encoder"]
    decoder_side = [(m, role) for m, role in zip(maps, captured.roles) if role != "encoder"]
    target_self, target_source = relevance(encoder_maps, [m for m, _ in decoder_side], [r for _, r in decoder_side])
    scores = (query_rows(target_source, captured.query_index), query_rows(target_self, captured.query_index))
    role_maps = {
        role: torch.stack([m for m, r in zip(maps, captured.roles) if r == role], dim=1)
        for role in ("encoder", "decoder", "cross")
    }
    return scores, role_maps


# The Args and Returns texts every attribute() shares (continuation lines keep the
# docstring indentation they are pasted into).
_SHARED_ATTRIBUTE_DOCS = {
    "inputs": (
        'inputs (Tensor or tuple of Tensor): token ids ``(batch, seq_len)``,\n'
        '                embeddings ``(batch, seq_len, hidden)`` or images ``(batch, channels,\n'
        '                height, width)``, passed to ``forward_func`` first; for an encoder-decoder,\n'
        '                the pair ``(input_ids, decoder_input_ids)``.'
    ),
    "target": (
        'target (int, list, Tensor or None, optional): the class (or, for a language\n'
        '                model, the token id) whose logit is explained. Default: None, the\n'
        '                predicted one.'
    ),
    "target_ignored": (
        'target (Any, optional): accepted for a drop-in Captum call and ignored.\n'
        '                Default: None.'
    ),
    "additional_forward_args": (
        'additional_forward_args (Any, optional): further arguments of\n'
        '                ``forward_func``, e.g. ``(attention_mask,)``. Default: None.'
    ),
    "query_index": (
        'query_index (int or sequence/Tensor of int, optional): the explained\n'
        '                position (the query row), one for all examples or one per example; for a\n'
        '                language model also where its logits are read. Default: None, the first\n'
        "                real token ([CLS], a ViT's class token) for bidirectional attention, the\n"
        '                last real token for decoders (causal attention) and encoder-decoders.'
    ),
    "returns": (
        'Returns:\n'
        "            float32 scores shaped like Captum's output for ``inputs``: ``(batch, seq_len)``\n"
        '            for tokens, 0 at padding (and, for decoders, after the query); ``(batch, rows,\n'
        '            columns)`` on the patch grid for images (class/distillation tokens dropped);\n'
        '            for an encoder-decoder the pair ``(source scores (batch, source_len), target\n'
        '            scores (batch, target_len))``. With ``return_maps``, a pair ``(scores, maps)``:\n'
        '            ``(batch, layers, seq_len, seq_len)``, or a dict of those per role\n'
        '            (``"encoder"``, ``"decoder"``, ``"cross"``) for an encoder-decoder.'
    ),
}

AttributeMethod = TypeVar("AttributeMethod", bound=Callable[..., Any])


def shared_attribute_docs(method: AttributeMethod) -> AttributeMethod:
    """Fill the ``$inputs``, ``$target``, ``$target_ignored``, ``$additional_forward_args``,
    ``$query_index`` and ``$returns`` lines of an ``attribute`` docstring with the texts the
    four methods share, so that each is written once."""
    method.__doc__ = string.Template(method.__doc__ or "").substitute(_SHARED_ATTRIBUTE_DOCS)
    return method
