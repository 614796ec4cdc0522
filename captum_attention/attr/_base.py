"""What the four attention attributions share: one forward (and backward) through Capture."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from captum._utils.common import _format_output, _format_tensor_into_tuples, _run_forward
from captum._utils.typing import TargetType
from torch import Tensor, nn

from ..capture import AttentionAdapter, AttentionCapture
from ..maps import real_tokens

Scores = Tensor | tuple[Tensor, ...]


@dataclass
class CapturedAttention:
    """One call's attention, ready for the maps layer.

    Attributes:
        attn_probs: per attention call, ``(B, H, T, T)`` float32 probabilities.
        attn_grads: per attention call, ``(B, H, T, T)`` float32 dS/dA, or None.
        real: ``(B, T)`` bool, True for real (non-padding) tokens.
        query_index: ``(B,)`` long, the explained query position per example.
    """

    attn_probs: list[Tensor]
    attn_grads: list[Tensor] | None
    real: Tensor
    query_index: Tensor

    @property
    def num_layers(self) -> int:
        return len(self.attn_probs)

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

    needs_gradients = False
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
        inputs: Tensor,
        target: TargetType,
        additional_forward_args: Any,
        query_index: int | Sequence[int] | Tensor = 0,
    ) -> CapturedAttention:
        """Run the model once (and, for gradient methods, one ``autograd.grad``)."""
        return capture_attention(
            self.forward_func, self.model, inputs, target, additional_forward_args,
            query_index, self.adapter, self.needs_gradients,
        )


@dataclass
class ForwardPass:
    """One forward through the capture layer: logits, attention as captured, padding."""

    logits: Tensor
    attn_probs: list[Tensor]  # per attention call, still in the autograd graph if tracked
    real: Tensor  # (B, T) bool


def forward_through_capture(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: Tensor,
    additional_forward_args: Any,
    adapter: AttentionAdapter | None = None,
    track_grad: bool = False,
    intervention: Callable[[int, Tensor], Tensor] | None = None,
) -> ForwardPass:
    """Run ``forward_func`` once with ``model``'s attention captured (and intervened on)."""
    batch, seq_len = inputs.shape[:2]
    if model.training:
        warnings.warn(
            f"{type(model).__name__} is in training mode: dropout makes the attention "
            "random. Call model.eval() before explaining it.",
            stacklevel=4,
        )
    capture = AttentionCapture(
        model, adapter, track_grad=track_grad, input_shape=(batch, seq_len), intervention=intervention
    )
    with capture, torch.set_grad_enabled(track_grad):
        logits = output_logits(_run_forward(forward_func, inputs, None, additional_forward_args))
    _check_attention(capture.attn_probs, batch, seq_len)
    real = real_tokens(capture.attention_mask, batch, seq_len, inputs.device)
    return ForwardPass(logits, capture.attn_probs, real)


def capture_attention(
    forward_func: Callable[..., Any],
    model: nn.Module,
    inputs: Tensor,
    target: TargetType,
    additional_forward_args: Any,
    query_index: int | Sequence[int] | Tensor = 0,
    adapter: AttentionAdapter | None = None,
    gradients: bool = False,
) -> CapturedAttention:
    """The attention of one forward, and dS/dA of the target's logit when ``gradients``."""
    run = forward_through_capture(forward_func, model, inputs, additional_forward_args, adapter, gradients)
    queries = _query_positions(query_index, run.real)
    attn_grads = None
    if gradients:
        targets = resolve_targets(run.logits, target)
        with torch.enable_grad():  # callers such as NoiseTunnel run under no_grad
            attn_grads = _gradients(run.logits.gather(1, targets[:, None]).sum(), run.attn_probs)
    return CapturedAttention(
        attn_probs=[_with_heads(p.detach()) for p in run.attn_probs],
        attn_grads=None if attn_grads is None else [_with_heads(g) for g in attn_grads],
        real=run.real,
        query_index=queries,
    )


def format_inputs(inputs: Tensor | tuple[Tensor, ...]) -> tuple[bool, Tensor]:
    """Validate Captum-style ``inputs``: one tensor of token ids or embeddings (or a 1-tuple)."""
    is_tuple = isinstance(inputs, tuple)
    formatted = _format_tensor_into_tuples(inputs) if is_tuple or isinstance(inputs, Tensor) else None
    if formatted is None or len(formatted) != 1 or not isinstance(formatted[0], Tensor):
        raise TypeError(
            "inputs must be one tensor (or a 1-tuple): token ids (batch, seq_len) or "
            f"embeddings (batch, seq_len, hidden); got {type(inputs).__name__}"
            + (f" of length {len(inputs)}" if isinstance(inputs, tuple) else "")
            + ". Pass further model inputs through additional_forward_args."
        )
    tensor = formatted[0]
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
    if tensor.is_floating_point() and tensor.dim() != 3:
        raise TypeError(
            f"embeddings must be (batch, seq_len, hidden), got shape {tuple(tensor.shape)}."
        )
    if tensor.shape[1] == 0:
        raise ValueError("inputs have no tokens (seq_len is 0).")
    return is_tuple, tensor


def format_scores(is_tuple: bool, scores: Tensor, maps: list[Tensor], return_maps: bool) -> Any:
    """Captum's output convention, plus the ``(B, L, T, T)`` per-layer maps on request."""
    formatted = _format_output(is_tuple, (scores,))
    return (formatted, torch.stack(maps, dim=1)) if return_maps else formatted


def output_logits(output: Any) -> Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(
            f"forward_func must return logits of shape (batch, num_classes), got {shape}. "
            "Wrap the model so that it returns the logits to explain."
        )
    return logits


def _with_heads(maps: Tensor) -> Tensor:
    """float32 ``(B, H, T, T)``: single-head ``(B, T, T)`` maps get a heads axis."""
    return (maps.unsqueeze(1) if maps.dim() == 3 else maps).float()


def _gradients(score: Tensor, attn_probs: list[Tensor]) -> list[Tensor]:
    """dS/dA for each captured map, or a clear error if a map did not feed the score."""
    attn_grads = torch.autograd.grad(score, attn_probs, allow_unused=True)
    unused = [index for index, grad in enumerate(attn_grads) if grad is None]
    if unused:
        raise RuntimeError(
            f"The attention captured at calls {unused} did not influence the explained "
            "output: the adapter must return the very tensor that weights the values (not "
            "a copy or a reshaped view of it)."
        )
    return list(attn_grads)


def _check_attention(attn_probs: list[Tensor], batch: int, seq_len: int) -> None:
    if not attn_probs:
        raise RuntimeError(
            "The forward pass ran no attention module of `model`: check that forward_func "
            "calls the model passed as model=..."
        )
    for probs in attn_probs:
        if probs.dim() not in (3, 4) or probs.shape[0] != batch or probs.shape[-1] != seq_len:
            raise RuntimeError(
                f"Captured attention of shape {tuple(probs.shape)}, expected (batch={batch}, "
                f"[heads,] queries, keys={seq_len}): the adapter reads the wrong output."
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


def _query_positions(query_index: int | Sequence[int] | Tensor, real: Tensor) -> Tensor:
    """``query_index`` as a ``(B,)`` long tensor of real positions, or a clear error."""
    batch, seq_len = real.shape
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
            "(the first token, [CLS], by default)."
        )
    return queries.long()
