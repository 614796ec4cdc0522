"""Recording attention probabilities for one model call, with hooks that never outlive it."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .adapters import AttentionAdapter, default_adapter


class AttentionCapture:
    """Context manager that records the post-softmax attention of the calls made inside it.

    On entry it asks the adapter for the attention modules (raising before anything is
    touched if there are none), lets the adapter prepare the model (e.g. switch ``sdpa``
    to eager attention) and registers forward hooks. On exit, also when the body raised,
    every hook is removed and the adapter restores the model.

    After the body, ``attn_probs`` holds one ``(batch, heads, queries, keys)`` tensor
    (``(batch, queries, keys)`` for single-head modules) per attention call in forward order, still attached to the autograd graph, so
    ``torch.autograd.grad(score, capture.attn_probs)`` gives dS/dA exactly.
    ``attention_mask`` holds the padding mask the model received (or None).

    Args:
        model (nn.Module): the module holding the attention layers.
        adapter (AttentionAdapter, optional): how to find and read them. Default: the
            built-in adapter for the model's family.
        track_grad (bool): make the attention probabilities part of the autograd graph
            even when the model's parameters are frozen (the hidden states entering each
            attention module are marked as requiring grad; the parameters are never
            touched). Default: False.
        input_shape (tuple of int, optional): ``(batch, seq_len)`` of the inputs; the
            captured mask must have this shape. Default: None (not checked).
        intervention (callable, optional): ``intervention(call_index, attn_probs)`` returns
            the probabilities to use instead, before they weight the values; it replaces
            the output of the softmax inside each attention call (call_index counts
            attention calls from 0 in forward order). The recorded ``attn_probs`` are the
            replaced ones. Default: None.

    Example::

        >>> with AttentionCapture(model, track_grad=True) as capture:
        ...     logits = model(input_ids, attention_mask=mask).logits
        >>> attn_grads = torch.autograd.grad(logits[:, 1].sum(), capture.attn_probs)
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: AttentionAdapter | None = None,
        *,
        track_grad: bool = False,
        input_shape: tuple[int, int] | None = None,
        intervention: Callable[[int, Tensor], Tensor] | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter if adapter is not None else default_adapter(model)
        self.track_grad = track_grad
        self.input_shape = input_shape
        self.attn_probs: list[Tensor] = []
        self.attention_mask: Tensor | None = None
        self.intervention = intervention
        self._mask_seen = False
        self._pending_call: int | None = None
        self._stack = ExitStack()

    def __enter__(self) -> "AttentionCapture":
        modules = self.adapter.attention_modules(self.model)
        mask_modules = self.adapter.mask_modules(self.model)
        self.attn_probs, self.attention_mask, self._mask_seen = [], None, False
        with ExitStack() as stack:
            stack.enter_context(self.adapter.prepared(self.model))
            for module in modules:
                stack.callback(module.register_forward_hook(self._record_probs).remove)
                if self.track_grad:
                    hook = module.register_forward_pre_hook(self._require_grad, with_kwargs=True)
                    stack.callback(hook.remove)
                if self.intervention is not None:
                    stack.callback(module.register_forward_pre_hook(self._open_call).remove)
            for module in mask_modules:
                hook = module.register_forward_pre_hook(self._record_mask, with_kwargs=True)
                stack.callback(hook.remove)
            if self.intervention is not None:
                stack.enter_context(_SoftmaxIntervention(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    def _open_call(self, module: nn.Module, args: tuple) -> None:
        self._pending_call = len(self.attn_probs)

    def _intervene(self, attn_probs: Tensor) -> Tensor:
        """Called by the softmax interception: the first softmax of an open attention call."""
        if self._pending_call is None or self.intervention is None:
            return attn_probs
        call_index, self._pending_call = self._pending_call, None
        return self.intervention(call_index, attn_probs)

    def _record_probs(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._pending_call is not None:
            raise RuntimeError(
                f"Cannot intervene on the attention of {type(module).__name__}: it computed no "
                "softmax (is the model running a fused attention kernel?)."
            )
        probs = self.adapter.attention_probs(module, output)
        if probs is None:
            raise RuntimeError(
                f"{type(module).__name__} returned no attention probabilities. The model must "
                "compute attention explicitly (eager attention); if it uses a fused kernel "
                "that the adapter cannot switch off, load it with "
                "attn_implementation='eager'."
            )
        self.attn_probs.append(probs)

    def _record_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._mask_seen:
            return
        self._mask_seen = True
        mask = self.adapter.padding_mask(module, args, kwargs)
        if mask is not None:
            self._check_mask(mask)
        self.attention_mask = mask

    def _check_mask(self, mask: Tensor) -> None:
        if mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be (batch, seq_len) with 1 for real tokens, got shape "
                f"{tuple(mask.shape)}."
            )
        if self.input_shape is not None and tuple(mask.shape) != tuple(self.input_shape):
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but the inputs are "
                f"{tuple(self.input_shape)} (batch, seq_len): pass the mask that belongs "
                "to these inputs, one row per example and one entry per token."
            )
        empty_rows = (mask == 0).all(dim=1).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(
                f"Examples {empty_rows} are all padding (attention_mask has no 1): there is "
                "nothing to attribute; drop them from the batch."
            )

    @staticmethod
    def _require_grad(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """Mark the hidden states entering ``module`` as requiring grad if nothing did."""
        if not torch.is_grad_enabled():
            return None
        named = [*enumerate(args), *kwargs.items()]
        key, hidden = next(((k, v) for k, v in named if _is_float_tensor(v)), (None, None))
        if hidden is None or hidden.requires_grad:
            return None
        tracked = hidden.detach().requires_grad_()
        if isinstance(key, int):
            return args[:key] + (tracked,) + args[key + 1 :], kwargs
        return args, {**kwargs, key: tracked}


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


_SOFTMAXES = (F.softmax, torch.softmax, Tensor.softmax)


class _SoftmaxIntervention(TorchFunctionMode):
    """Replaces the first softmax of each attention call by the capture's intervention.

    Intercepting the softmax itself (rather than re-implementing attention) keeps the
    model's own masking, scaling and value weighting exact for any eager implementation.
    """

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        return self.capture._intervene(result) if func in _SOFTMAXES else result
