"""Streaming capture: the model keeps its own attention kernel; each call's inputs are recorded.

Models that dispatch attention through transformers' attention interface call
``attention_function(module, query, key, value, attention_mask, scaling=..., ...)``.
While a streaming capture is active, the ``sdpa`` entry of that interface is wrapped: the
wrapper records what the kernel receives (a :class:`~captum_attention.maps.kernel.KernelCall`)
and runs the kernel unchanged, so the model computes exactly what it computes without us,
at the kernel's speed and memory. Any reduction of the attention probabilities can then
recompute the rows it needs, block by block (:mod:`captum_attention.maps.kernel` defines
them exactly as ``torch.nn.functional.scaled_dot_product_attention`` does). No
``(heads, N, N)`` tensor is ever alive.

The wrapper is installed while at least one capture is active (a
:class:`~captum_attention.capture.guard.SharedPatch`) and dispatches on a context
variable, so other threads and other models run the kernel as if nothing were there, and
it is removed when the last capture ends, also on an exception or a
``KeyboardInterrupt``; a ``"sdpa"`` function a user registered in the meantime (from the
forward or another thread) is kept, not reverted.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

from torch import Tensor, nn

from .._compat import StreamingUnsupported, attention_function, register_attention_function, sdpa_call
from ..maps.kernel import KernelCall
from .guard import SharedPatch


KernelInputs = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""``inputs(query, key, value) -> (query, key, value)``: what the kernel runs with instead
of what the model gave it (the tensors in the autograd graph)."""

Recorder = Callable[[nn.Module, KernelCall, Callable[..., Tensor]], Tensor]
"""``recorder(module, call, run_kernel) -> output``: sees each call of the kernel;
``run_kernel(inputs=None)`` runs it, on the model's tensors or on ``inputs`` of them
(:data:`KernelInputs`)."""

_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("captum_attention_kernel", default=None)


class KernelInterception:
    """Context manager: while active, this context's calls of transformers' ``sdpa``
    attention function go through ``recorder``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._token: contextvars.Token | None = None

    def __enter__(self) -> "KernelInterception":
        _SDPA.acquire()
        self._token = _ACTIVE.set(self.recorder)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
        _SDPA.release()


def _dispatch(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The wrapped ``sdpa`` attention function: hands the call to the active recorder."""
    original = _SDPA.original
    recorder = _ACTIVE.get()
    if recorder is None:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    call = kernel_call(module, query, key, value, attention_mask, *args, **kwargs)

    def run_kernel(inputs: KernelInputs | None = None) -> Tensor:
        used = (query, key, value) if inputs is None else inputs(query, key, value)
        return original(module, *used, attention_mask, *args, **kwargs)[0]

    return recorder(module, call, run_kernel), None


_SDPA = SharedPatch(lambda: attention_function("sdpa"), lambda f: register_attention_function("sdpa", f), _dispatch)


def kernel_call(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> KernelCall:
    """What transformers' ``sdpa`` attention function computes for this call, as a
    :class:`~captum_attention.maps.kernel.KernelCall` (see
    :func:`~captum_attention._compat.sdpa_call`); raises :class:`StreamingUnsupported`
    for anything the recomputation cannot reproduce."""
    call = sdpa_call(module, query, key, value, attention_mask, *args, **kwargs)
    return KernelCall(
        call.query.detach(), call.key.detach(), call.value.detach(), call.scale, call.mask, call.causal,
        None if call.position_bias is None else call.position_bias.detach(), call.groups,
    )
