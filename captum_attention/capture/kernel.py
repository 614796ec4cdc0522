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
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import StreamingUnsupported, attention_function, register_attention_function, sdpa_call
from ..maps import streaming
from ..maps.kernel import KernelCall, block_shape, live_rows
from .guard import SharedPatch


KernelInputs = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""``inputs(query, key, value) -> (query, key, value)``: what the kernel runs with instead
of what the model gave it (the tensors in the autograd graph)."""

Recorder = Callable[[nn.Module, KernelCall, Callable[..., Tensor]], Tensor]
"""``recorder(module, call, run_kernel) -> output``: sees each call of the kernel;
``run_kernel(inputs=None, rows_backward=False, key_bias=None)`` runs it, on the model's
tensors or on ``inputs`` of them (:data:`KernelInputs`); ``rows_backward``: with a backward
that skips the query rows without gradient (:class:`_RowsBackward`); ``key_bias``: a
``(B, H / groups, K)`` tensor added to every query's logit of each key
(:func:`key_bias_applies`)."""

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

    def run(*used: Tensor) -> Tensor:
        if call.explicit:  # keys and values as the call holds them
            seen = call.on(*used)
            return _ExplicitAttention.apply(seen.query, seen.key, seen.value, call)
        if used[0].shape[-1] != query.shape[-1]:  # widened by a key bias: the scale stays the model's
            positional, named = _with_scaling(args, kwargs, call.scale)
            return original(module, *used, attention_mask, *positional, **named)[0]
        return original(module, *used, attention_mask, *args, **kwargs)[0]

    return _recorded(recorder, module, call, run, (query, key, value), attention_mask), None


@dataclass(frozen=True)
class SdpaArguments:
    """One call's arguments of ``F.scaled_dot_product_attention``, as it takes them
    (``SdpaArguments(*args, **kwargs)``)."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_mask: Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @property
    def kernel_scale(self) -> float:
        """The factor on ``query @ key^T``: ``scale``, else one over the root of the head width."""
        return float(self.query.shape[-1] ** -0.5 if self.scale is None else self.scale)

    @property
    def groups(self) -> int:
        """How many consecutive query heads each key head serves."""
        return self.query.shape[1] // self.key.shape[1] if self.enable_gqa else 1


def plain_sdpa(recorder: Recorder, module: nn.Module, arguments: SdpaArguments) -> Tensor:
    """A call of ``F.scaled_dot_product_attention`` inside the attention ``module`` (one a
    :class:`~captum_attention.capture.ModuleAdapter` names) through ``recorder``, as
    transformers' calls are handed on: the kernel runs as the module asked, and its output
    ``(B, H, Q, D)`` is what the function returns."""
    query, key, value, mask = arguments.query, arguments.key, arguments.value, arguments.attn_mask
    if arguments.dropout_p:
        raise StreamingUnsupported(
            f"{type(module).__name__} calls F.scaled_dot_product_attention with dropout_p={arguments.dropout_p}"
        )
    if arguments.groups * key.shape[1] != query.shape[1] or value.shape[1] != key.shape[1]:
        raise StreamingUnsupported(f"{query.shape[1]} query heads over {key.shape[1]} key heads")
    call = KernelCall(
        query.detach(), key.detach(), value.detach(), arguments.kernel_scale, mask, bool(arguments.is_causal), None,
        arguments.groups,
    )

    def run(used_query: Tensor, used_key: Tensor, used_value: Tensor) -> Tensor:  # (B, Q, H, D), as transformers' return it
        output = F.scaled_dot_product_attention(
            used_query, used_key, used_value, attn_mask=mask, is_causal=arguments.is_causal, scale=arguments.kernel_scale,
            enable_gqa=arguments.enable_gqa,
        )
        return output.transpose(1, 2)

    return _recorded(recorder, module, call, run, (query, key, value), mask).transpose(1, 2)


def _recorded(
    recorder: Recorder, module: nn.Module, call: KernelCall, run: Callable[..., Tensor], tensors: tuple[Tensor, Tensor, Tensor],
    attention_mask: Tensor | None,
) -> Tensor:
    """The output of one kernel ``call`` (``run`` on the model's query, key and value
    ``tensors``) as ``recorder`` has it computed (see :data:`Recorder`)."""

    def run_kernel(inputs: KernelInputs | None = None, rows_backward: bool = False, key_bias: Tensor | None = None) -> Tensor:
        used = tensors if inputs is None else inputs(*tensors)
        if key_bias is not None:
            used = _with_key_bias(used, key_bias, call.scale)
            _read_from(call, used)
        if rows_backward and _rows_backward_applies(call, used, attention_mask):
            output = _RowsBackward.apply(*used, call, run)
        else:
            output = run(*used)
        return output if key_bias is None else output[..., :-1].contiguous()  # contiguous: what the model keeps

    return recorder(module, call, run_kernel)


def key_bias_applies(call: KernelCall) -> bool:
    """Whether ``run_kernel`` can add a key bias to this call: a float32 or float64 call
    on a CPU without a softcap (which would cap the bias too), whether
    ``scaled_dot_product_attention`` computes it or, with sinks, the explicit computation
    does. The bias rides on one more query and key dimension (query 1, key ``bias /
    scale``; the values padded with a zero), so the kernel computes the biased logits and
    its own backward gives the bias's gradient, Σ over the query rows of dS/dlogits, with
    no pass over the attention of its own (measured on a CPU with heads 32 wide: the
    kernel's forward and backward about 15% slower). On a GPU the wider heads may leave
    the flash kernels: not used there until measured (``bash benchmarks/gpu_run.sh
    keybias``)."""
    return (
        call.query.device.type == "cpu" and call.query.dtype in (torch.float32, torch.float64)
        and call.softcap is None and torch.is_grad_enabled()
    )


def _with_key_bias(used: tuple[Tensor, ...], key_bias: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(query, key, value)`` one dimension wider, so that ``s·q'·k'ᵀ = s·q·kᵀ + bias``
    (the bias zero-padded to the keys the kernel received) and the values' new dimension
    is zero."""
    query, key, value = used
    bias = F.pad(key_bias, (0, key.shape[2] - key_bias.shape[2]))
    ones = query.new_ones(*query.shape[:-1], 1)
    return (
        torch.cat([query, ones], dim=-1), torch.cat([key, (bias / scale)[..., None]], dim=-1),
        F.pad(value, (0, 1)),
    )


def _read_from(call: KernelCall, widened: tuple[Tensor, ...]) -> None:
    """The call's query, key and value as the kernel runs them: views of the widened ones,
    which it keeps for its backward, so that a record of the call holds no copy of its own
    (the model's values, unless a probe's ``inputs`` changed them)."""
    seen = call.on(*(tensor.detach()[..., :-1] for tensor in widened))
    call.query, call.key, call.value = seen.query, seen.key, seen.value


def _with_scaling(args: tuple, kwargs: dict, scale: float) -> tuple[tuple, dict]:
    """The attention function's arguments after the mask with ``scaling`` (the second,
    after ``dropout``) set to ``scale``."""
    if len(args) >= 2:
        return (args[0], scale, *args[2:]), kwargs
    return args, {**kwargs, "scaling": scale}


ROWS_BACKWARD_SHARE = 1 / 16
"""The largest share of a call's query rows whose output gradient may be nonzero for
:class:`_RowsBackward` to compute the backward from those rows alone; above it the
kernel's own backward runs."""


def _rows_backward_applies(call: KernelCall, inputs: tuple[Tensor, ...], attention_mask: Tensor | None) -> bool:
    """Whether the call is differentiated and the gradients of its query, key and value
    are all it has (no position bias, no mask that is itself differentiated)."""
    differentiated = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return (
        differentiated and not call.explicit and call.position_bias is None
        and not (isinstance(attention_mask, Tensor) and attention_mask.requires_grad)
    )


class _RowsBackward(torch.autograd.Function):
    """The kernel unchanged in the forward; in the backward, where the output's gradient
    is nonzero on at most :data:`ROWS_BACKWARD_SHARE` of the query rows (a language
    model's top layer, explaining the last tokens), the backward of those rows alone
    (:meth:`~captum_attention.maps.kernel.KernelCall.rows_backward`), else the kernel's own
    backward. Both compute the same gradients; the first at ``rows × keys`` instead of
    ``queries × keys``."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, call: KernelCall, run: Callable[..., Tensor]) -> Tensor:
        leaves = tuple(t.detach().requires_grad_(t.requires_grad) for t in (query, key, value))
        with torch.enable_grad():
            output = run(*leaves)
        # a copy of the tensors used (one dimension wider under a key bias): the recorder sets call.output to ours
        ctx.call, ctx.leaves, ctx.output = call.on(*(leaf.detach() for leaf in leaves)), leaves, output
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        live = live_rows(grad_output).any(dim=0).nonzero().flatten()
        if live.numel() == 0:  # zeros, not None: the backward still reaches the calls below
            return (*(torch.zeros_like(leaf) if leaf.requires_grad else None for leaf in ctx.leaves), None, None)
        rows = slice(int(live[0]), int(live[-1]) + 1)
        if rows.stop - rows.start > ROWS_BACKWARD_SHARE * grad_output.shape[1]:
            needed = [leaf for leaf in ctx.leaves if leaf.requires_grad]
            grads = iter(torch.autograd.grad(ctx.output, needed, grad_output, retain_graph=True))
            return (*(next(grads) if leaf.requires_grad else None for leaf in ctx.leaves), None, None)
        computed = ctx.call.rows_backward(grad_output, rows)
        padded = [F.pad(grad, (0, 0, 0, leaf.shape[2] - grad.shape[2])) for grad, leaf in zip(computed, ctx.leaves)]
        return (*(grad if leaf.requires_grad else None for grad, leaf in zip(padded, ctx.leaves)), None, None)


class _ExplicitAttention(torch.autograd.Function):
    """An attention call that ``scaled_dot_product_attention`` cannot compute (a softcap,
    sinks: :attr:`~captum_attention.maps.kernel.KernelCall.explicit`), computed from its
    probabilities one block of rows at a time in the forward (or by the Triton kernel of
    :func:`~captum_attention.maps.streaming.erased_output`, where it runs) and again in
    the backward (:meth:`~captum_attention.maps.kernel.KernelCall.input_grads`, the blocks
    whose output gradient is zero skipped): the model's eager attention, exactly, without
    its ``(heads, N, N)`` tensors."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, call: KernelCall) -> Tensor:
        ctx.call = replace(call, query=query.detach(), key=key.detach(), value=value.detach(), output=None)
        return streaming.erased_output(ctx.call, None, None, block_shape(ctx.call))

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        call = ctx.call
        heads, rows = block_shape(call)
        blocks = call.blocks((call.num_heads, max(1, heads * rows // call.num_heads)), reached=live_rows(grad_output))
        grads = call.input_grads(grad_output, (rows for _, rows in blocks))  # one block of every head per rows
        return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)), None)


_SDPA = SharedPatch(lambda: attention_function("sdpa"), lambda f: register_attention_function("sdpa", f), _dispatch)


def kernel_call(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, *args: Any, **kwargs: Any) -> KernelCall:
    """What transformers' ``sdpa`` attention function computes for this call, as a
    :class:`~captum_attention.maps.kernel.KernelCall` (see
    :func:`~captum_attention._compat.sdpa_call`); raises :class:`~captum_attention.capture.StreamingUnsupported`
    for anything the recomputation cannot reproduce."""
    call = sdpa_call(module, query, key, value, attention_mask, *args, **kwargs)
    return KernelCall(
        call.query.detach(), call.key.detach(), call.value.detach(), call.scale, call.mask, call.causal,
        None if call.position_bias is None else call.position_bias.detach(), call.groups,
        softcap=call.softcap, sinks=None if call.sinks is None else call.sinks.detach(),
    )
