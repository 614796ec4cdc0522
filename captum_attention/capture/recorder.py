"""Recording attention probabilities for one model call, with hooks that never outlive it."""

from __future__ import annotations

import contextvars
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import SOFTMAXES, StreamingUnsupported, attention_softmax, mha_forward_with_softmax
from .adapters import AttentionAdapter, AttentionSite
from .adapters.protocol import UnsupportedModelError
from .guard import ModelChanges, ScopedFunctionMode, current_thread, every_forward
from ..maps.kernel import KernelCall
from .kernel import KernelInterception, SdpaArguments, plain_sdpa
from .probes import CallInfo, Probe, RunKernel
from .runner import resolve_adapter


class AttentionCapture(ModelChanges):
    """Context manager that records the post-softmax attention of the calls made inside it.

    On entry it asks the adapter for the attention modules (raising before anything is
    touched if there are none), lets the adapter prepare the model (e.g. switch ``sdpa``
    to eager attention), enters its probes and registers forward hooks. On exit, also
    when the body raised, every hook is removed, the probes are left and the adapter
    restores the model.

    After the body, ``attn_probs`` holds one ``(batch, heads, queries, keys)`` tensor per
    attention call in forward order, still attached to the autograd graph, and ``roles``
    the role of each call (``"self"``, or ``"encoder"``/``"decoder"``/``"cross"`` in an
    encoder-decoder). ``gradients(score)`` gives dS/dA for every call, exactly: it
    differentiates with respect to the very tensors that weighted the values.
    ``attention_mask`` (and ``decoder_attention_mask``) hold the padding masks the model
    received, or None; ``cross_attended_mask`` the real states a decoder without an encoder
    cross-attends to (Mllama's image features), or None.

    Args:
        model (nn.Module): the module holding the attention layers.
        adapter (AttentionAdapter, optional): how to find and read them. Default: the
            built-in adapter for the model's family.
        probes (sequence of Probe, optional): what else the call records or changes
            (:mod:`captum_attention.capture.probes`): interventions on the
            probabilities, keys or rows, recorded values, relevance rules, torch's
            gradient mode. Each receives the events it declares. Default: none.
        streaming (bool): keep the model's own attention kernel and record each call's
            inputs (:class:`~captum_attention.maps.kernel.KernelCall`, in
            ``kernel_calls``) instead of its probabilities; raises
            :class:`~captum_attention.capture.StreamingUnsupported` where that is
            not possible (a probe that cannot stream included). Default: False.
        track_grad (bool): make the attention part of the autograd graph even when the
            model's parameters are frozen (the hidden states entering each attention
            module are marked as requiring grad; the parameters are never touched).
            Default: False.

    Example::

        >>> with AttentionCapture(model, track_grad=True) as capture:
        ...     logits = model(input_ids, attention_mask=mask).logits
        >>> attn_grads = capture.gradients(logits[:, 1].sum())
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: AttentionAdapter | None = None,
        *,
        probes: Sequence[Probe] = (),
        streaming: bool = False,
        track_grad: bool = False,
    ) -> None:
        self.model = model
        self.adapter = resolve_adapter(model, adapter)
        self.probes = list(probes)
        self.streaming = streaming
        self.track_grad = track_grad
        self.attention_mask: Tensor | None = None
        self.decoder_attention_mask: Tensor | None = None
        self.cross_attended_mask: Tensor | None = None
        self._calls: list[_Call] = []
        self._open: list[_Call] = []
        self._mask_seen = False
        self._sites: dict[nn.Module, AttentionSite] = {}
        self._forward_context: contextvars.Context | None = None  # where the forward ran, once it has
        super().__init__(model, self._change_model)
        self._thread = current_thread()
        self.model_calls = 0  # calls of the model itself, to refuse a forward_func that runs it twice
        self.autocast_in_forward: list[str] = []  # the devices whose autocast forward_func turned on around the model

    def _listening(self, event: str) -> list[Probe]:
        return [probe for probe in self.probes if event in probe.events]

    @property
    def attn_probs(self) -> list[Tensor]:
        """Per attention call, ``(batch, heads, queries, keys)``, in the autograd graph."""
        if self.streaming:
            raise RuntimeError("A streaming capture records no probabilities: read kernel_calls.")
        return [self._as_heads(call) for call in self._calls]

    @property
    def kernel_calls(self) -> list[KernelCall]:
        """Streaming mode: per attention call, what the kernel received (and its output)."""
        return [call.kernel for call in self._calls if call.kernel is not None]

    @property
    def modules(self) -> list[nn.Module]:
        """Per attention call, the module that made it."""
        return [call.module for call in self._calls]

    @property
    def roles(self) -> list[str]:
        roles: list[str] = [call.site.role for call in self._calls]
        if "decoder" in roles and "cross" not in roles and not self.adapter.is_encoder_decoder(self.model):
            return ["self" if role == "decoder" else role for role in roles]  # Mllama given text only
        return roles

    @property
    def causal(self) -> list[bool | None]:
        """Per attention call, whether the adapter says it is causal (None: it cannot tell)."""
        return [call.site.causal for call in self._calls]

    def gradients(self, score: Tensor, retain_graph: bool = False) -> list[Tensor]:
        """dS/dA per attention call, ``(batch, heads, queries, keys)``, or a clear error.

        Args:
            score (Tensor): the scalar S to differentiate.
            retain_graph (bool): keep the graph for a further backward pass. Default: False.
        """
        pieces = [piece for call in self._calls for piece in call.pieces]
        if self.track_grad and not all(piece.requires_grad for piece in pieces):
            raise _no_gradient(self.model)
        grads = list(torch.autograd.grad(score, pieces, allow_unused=True, retain_graph=retain_graph))
        per_call: list[list[Tensor]] = []
        for call in self._calls:
            per_call.append(grads[: len(call.pieces)])
            del grads[: len(call.pieces)]
        self._check_used([all(g is not None for g in call_grads) for call_grads in per_call])
        return [self._as_heads(call, call_grads, gradient=True) for call, call_grads in zip(self._calls, per_call)]

    def rows_read(self, score: Tensor) -> Tensor | None:
        """``(batch, queries)`` bool: the query rows of the last attention call that
        ``score`` depends on, by a finite gradient other than 0 (after it, the tokens no
        longer mix, so these are the rows the output reads); None where that call is not in
        the autograd graph. The backward runs from the score to that call only (the head
        and the last layer's feed-forward)."""
        call = self._calls[-1]
        tensors = [call.kernel.output] if call.kernel is not None else call.pieces
        if not all(isinstance(t, Tensor) and t.requires_grad for t in tensors):
            return None
        grads = torch.autograd.grad(score, cast(list[Tensor], tensors), allow_unused=True, retain_graph=True)
        if any(g is None for g in grads):
            return None
        if call.kernel is not None:
            return _nonzero(grads[0]).flatten(2).any(dim=2)  # (B, Q, H, D)
        return _nonzero(self._as_heads(call, list(grads), gradient=True)).any(dim=-1).any(dim=1)

    def output_gradients(
        self, score: Tensor, retain_graph: bool = False, also: Sequence[Tensor | None] = ()
    ) -> tuple[list[Tensor], list[Tensor | None]]:
        """Streaming mode: dS/dO per attention call, the gradient of the kernel's output
        ``(batch, queries, heads, head_dim)``, and the gradients of the tensors ``also``
        (None for a None, or one the score does not reach), from one backward pass."""
        outputs = [call.output for call in self.kernel_calls]
        if not all(isinstance(o, Tensor) for o in outputs):
            raise RuntimeError("Output gradients need AttentionCapture(track_grad=True, streaming=True).")
        if not all(o.requires_grad for o in outputs):  # type: ignore[union-attr]
            raise _no_gradient(self.model)
        inputs = cast(list[Tensor], [*outputs, *(t for t in also if t is not None)])
        grads = list(torch.autograd.grad(score, inputs, allow_unused=True, retain_graph=retain_graph))
        self._check_used([g is not None for g in grads[: len(outputs)]])
        extra_grads = iter(grads[len(outputs) :])
        return grads[: len(outputs)], [None if t is None else next(extra_grads) for t in also]  # type: ignore[return-value]

    def run_backward(
        self, score: Tensor, listeners: Sequence[Probe], retain_graph: bool = False, attn_maps: Sequence[Tensor] = ()
    ) -> None:
        """One backward pass of ``score`` in which each listener's ``on_backward`` receives
        every call's ``(attn_maps, attn_grads)``, ``(batch, heads, queries, keys)``, as soon
        as the pass reaches it (the full gradients are then never all alive at once). The
        backward itself only asks for the small gradients of the hidden states entering each
        call. ``attn_maps``: per call, the maps the listeners receive instead of the recorded
        probabilities (e.g. effective attention). Needs ``track_grad=True``.
        """
        anchors = [call.hidden for call in self._calls]
        if any(anchor is None for anchor in anchors):
            if self.track_grad:
                raise _no_gradient(self.model)
            raise RuntimeError("A backward pass through the capture needs AttentionCapture(track_grad=True).")
        reached = [False] * len(self._calls)
        arrived: list[list[Tensor | None]] = [[None] * len(call.pieces) for call in self._calls]

        def on_gradient(index: int, piece: int, grad: Tensor) -> None:
            arrived[index][piece] = grad
            if all(g is not None for g in arrived[index]):
                call = self._calls[index]
                grads = self._as_heads(call, arrived[index], gradient=True)  # type: ignore[arg-type]
                maps = attn_maps[index] if attn_maps else self._as_heads(call).detach()
                for listener in listeners:
                    listener.on_backward(self._call_info(call), maps, grads)
                reached[index], arrived[index] = True, [None] * len(call.pieces)

        handles = [
            p.register_hook(lambda grad, index=index, piece=piece: on_gradient(index, piece, grad))
            for index, call in enumerate(self._calls)
            for piece, p in enumerate(call.pieces)
        ]
        try:
            torch.autograd.grad(score, anchors, allow_unused=True, retain_graph=retain_graph)  # type: ignore[arg-type]
        finally:
            for handle in handles:
                handle.remove()
        self._check_used(reached)

    @staticmethod
    def _check_used(used: list[bool]) -> None:
        unused = [index for index, ok in enumerate(used) if not ok]
        if unused:
            raise UnsupportedModelError(
                f"The attention captured at calls {unused} did not influence the explained "
                "output: the model computes it from other attention than it records, or an "
                "adapter returns a copy of the tensor that weights the values."
            )

    def _as_heads(self, call: "_Call", tensors: list[Tensor] | None = None, gradient: bool = False) -> Tensor:
        """``call``'s pieces (or tensors shaped like them) as heads, read by the adapter in
        the context the forward ran in (where an adapter keeps what it noted of the call,
        e.g. a window's grid), from any thread (autograd's), also after the capture ended."""
        if self._forward_context is None:
            return call.stacked(self.adapter, tensors, gradient)
        return self._forward_context.copy().run(call.stacked, self.adapter, tensors, gradient)

    def _change_model(self, stack: ExitStack) -> None:
        """Let the adapter prepare the model and hook its attention modules; ``stack``
        undoes it all, after keeping the context the forward ran in."""
        sites = self.adapter.attention_sites(self.model)
        self._sites = {site.module: site for site in sites}
        mask_modules = self.adapter.mask_modules(self.model)
        self._calls, self._open, self._mask_seen = [], [], False
        self._forward_context = None
        self.model_calls = 0
        self._thread = current_thread()
        self.attention_mask = self.decoder_attention_mask = self.cross_attended_mask = None
        from_softmax = self.adapter.probs_source == "softmax"
        mode = "streaming" if self.streaming else "eager"
        refused = next((probe for probe in self.probes if mode not in probe.modes), None)
        if refused is not None and self.streaming:
            raise StreamingUnsupported(refused.eager_reason)
        if refused is not None:
            raise ValueError(f"{type(refused).__name__} works only under a streaming capture.")
        stack.enter_context(self.adapter.prepared(self.model, self.streaming))
        if self.streaming:
            stack.enter_context(KernelInterception(self._on_kernel))
            if from_softmax:  # a named module's F.scaled_dot_product_attention
                stack.enter_context(_PlainKernelInterception(self))
        else:
            # The eager probabilities enter the graph through the hooks' returned tensors,
            # which a compiled graph (torch.compile) does not use: its Python code runs instead.
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        for probe in self.probes:
            probe.enter(self.model, self.adapter, stack)
        for module in self._sites:
            # prepend: read the output before any hook of the adapter's rewrites it
            stack.callback(module.register_forward_hook(self._close_call, prepend=True).remove)
            stack.callback(module.register_forward_pre_hook(self._open_call, with_kwargs=True).remove)
        for module in mask_modules:
            stack.enter_context(every_forward(module, self._record_masks))
        stack.enter_context(every_forward(self.model, self._count_model_call))
        if not self.streaming and (
            from_softmax or self._listening("softmax") or self._listening("product") or _in_float64(self.model)
        ):  # a float64 model's softmax in float32 overflows (see attention_softmax)
            stack.enter_context(_SoftmaxInterception(self))
        stack.callback(self._keep_forward_context)  # last in, first out: before the hooks go

    def _keep_forward_context(self) -> None:
        self._forward_context = contextvars.copy_context()

    def _count_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._ours():
            self.model_calls += 1
            self.autocast_in_forward = autocast_on()

    def _ours(self) -> bool:
        """Whether a hooked call runs in the capture's thread (another thread's forward of
        the same modules is not recorded)."""
        return current_thread() == self._thread

    def _open_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if not self._ours():
            return None
        call = _Call(self._sites[module], len(self._calls) + len(self._open))
        self._open.append(call)
        named = [*enumerate(args), *kwargs.items()]
        key, hidden = next(((k, v) for k, v in named if _is_float_tensor(v)), (None, None))
        if hidden is None or not self.track_grad or not torch.is_grad_enabled():
            return None
        if not hidden.requires_grad:
            # Frozen model: mark the hidden states entering the module (never the parameters).
            hidden = hidden.detach().requires_grad_()
        call.hidden = hidden
        if isinstance(key, int):
            return args[:key] + (hidden,) + args[key + 1 :], kwargs
        return args, {**kwargs, key: hidden}

    def _call_info(self, call: "_Call") -> CallInfo:
        return CallInfo(call.index, call.module, call.site.role, self.adapter)

    def _on_softmax(self, softmax_output: Tensor, softmax_input: Any = None) -> Tensor:
        """Called by the softmax interception for every softmax computed in the forward."""
        if not self._open:
            return softmax_output
        call = self._open[-1]
        if self.adapter.probs_source == "output" and call.softmaxes_seen:
            return softmax_output  # only the attention softmax, the first of the call
        call.softmaxes_seen += 1
        used = softmax_output
        probes = self._listening("softmax")
        if probes:
            info = self._call_info(call)
            heads = info.as_heads(softmax_output)
            scores = None
            if isinstance(softmax_input, Tensor) and softmax_input.shape == softmax_output.shape:
                scores = info.as_heads(softmax_input)
            first_head = sum(info.as_heads(p).shape[1] for p in call.pieces)
            for probe in probes:
                changed = probe.on_softmax(info, heads, first_head, scores)
                heads = heads if changed is None else changed
            used = heads.to(softmax_output.dtype).reshape(softmax_output.shape)
        if self.adapter.probs_source == "softmax":
            call.pieces.append(used)
        return used

    def _on_product(self, left: Any, right: Any) -> None:
        """Called for every matrix product in the forward (eager capture, where a probe
        listens): products inside an attention call go to the listening probes."""
        if self._open and isinstance(left, Tensor) and isinstance(right, Tensor):
            info = self._call_info(self._open[-1])
            for probe in self._listening("product"):
                probe.on_product(info, left, right)

    def _on_kernel(self, module: nn.Module, kernel: KernelCall, run_kernel: RunKernel) -> Tensor:
        """Streaming mode: one call of the attention kernel; the first probe that computes
        its output does, else the kernel runs as the model asked."""
        call = self._open[-1] if self._open else None
        ours = call is not None and call.kernel is None and any(m is module for m in call.module.modules())
        info = self._call_info(call) if ours and call is not None else None  # None: not ours to record
        key_bias = None if info is None else next(
            (bias for probe in self._listening("key_bias") if (bias := probe.key_bias(info, kernel)) is not None), None
        )
        run = run_kernel if key_bias is None else partial(run_kernel, key_bias=key_bias)
        output = next(
            (out for probe in self._listening("kernel") if (out := probe.on_kernel(info, kernel, run)) is not None),
            None,
        )
        output = run(rows_backward=self.track_grad) if output is None else output
        if call is None or info is None:
            return output
        kernel.output = output
        if not self.track_grad:  # only gradients need the values (dS/dA = dO·Vᵀ) and the output
            kernel.value = None
            kernel.output = output if output.requires_grad else None  # a graph from this call on (LastCallGraph)
        call.kernel = kernel
        return output

    def _close_call(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._ours():
            return
        call = self._open.pop()
        if self.streaming:
            if call.kernel is None:
                raise StreamingUnsupported(
                    f"{type(module).__name__} did not call transformers' sdpa attention function nor "
                    "F.scaled_dot_product_attention"
                )
            self._calls.append(call)
            return
        if self._listening("softmax") and not call.softmaxes_seen:
            raise RuntimeError(
                f"Cannot intervene on the attention of {type(module).__name__}: it computed no "
                "softmax (is the model running a fused attention kernel?)."
            )
        if self.adapter.probs_source == "output":
            probs = self.adapter.read_probs(call.site, output)
            if probs is None:
                raise RuntimeError(
                    f"{type(module).__name__} returned no attention probabilities. The model must "
                    "compute attention explicitly (eager attention); if it uses a fused kernel "
                    "that the adapter cannot switch off, load it with "
                    "attn_implementation='eager'."
                )
            call.pieces.append(probs)
        elif not call.pieces:
            raise RuntimeError(
                f"{type(module).__name__} computed no softmax, so there are no attention "
                "probabilities to record: name the module that calls the softmax (or F.scaled_dot_product_attention)."
            )
        info = self._call_info(call)
        for probe in self._listening("call_end"):
            probe.on_call_end(info, call.pieces)
        self._calls.append(call)

    def _record_masks(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._mask_seen or not self._ours():
            return
        self._mask_seen = True
        masks = {
            "attention_mask": self.adapter.padding_mask(module, args, kwargs),
            "decoder_attention_mask": self.adapter.decoder_padding_mask(module, args, kwargs),
        }
        for name, mask in masks.items():
            if mask is not None and not isinstance(mask, Tensor):
                raise TypeError(
                    f"{name} is a {type(mask).__name__}, not a tensor (batch, seq_len): give a tensor (tokenizer(..., "
                    "return_tensors='pt')), and additional_forward_args as a tuple, as Captum takes them (a list is "
                    "passed whole, as one argument), e.g. (attention_mask,)."
                )
            if mask is not None and mask.dim() != 2:
                raise ValueError(
                    f"{name} must be (batch, seq_len) with 1 for real tokens, got shape {tuple(mask.shape)}."
                )
        for probe in self._listening("masks"):
            probe.on_masks(*masks.values())
        for name, mask in masks.items():
            empty_rows = [] if mask is None else (mask == 0).all(dim=1).nonzero().flatten().tolist()
            if empty_rows:
                raise ValueError(
                    f"Examples {empty_rows} are all padding ({name} has no 1): there is "
                    "nothing to attribute; drop them from the batch."
                )
        self.attention_mask, self.decoder_attention_mask = masks.values()
        self.cross_attended_mask = self.adapter.cross_attended_mask(module, args, kwargs)


def _nonzero(gradient: Tensor) -> Tensor:
    """Where ``gradient`` is finite and not 0: a non-finite value (a NaN spread through
    the attention) says nothing of which rows are read."""
    return gradient.ne(0) & gradient.isfinite()


@dataclass(eq=False)
class _Call:
    """One call of an attention module: the tensors that weighted its values."""

    site: AttentionSite
    index: int
    pieces: list[Tensor] = field(default_factory=list)
    softmaxes_seen: int = 0
    hidden: Tensor | None = None  # the hidden states that entered the call, when tracked
    kernel: KernelCall | None = None  # streaming mode: what the attention kernel received

    @property
    def module(self) -> nn.Module:
        return self.site.module

    def stacked(self, adapter: AttentionAdapter, tensors: list[Tensor] | None = None, gradient: bool = False) -> Tensor:
        """``(batch, heads, queries, keys)``: the pieces (or tensors shaped like them, such
        as their gradients) as heads."""
        view = adapter.gradient_as_heads if gradient else adapter.as_heads
        parts = [view(self.module, t) for t in (self.pieces if tensors is None else tensors)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
"""The device types whose autocast the capture reads and turns off."""


def autocast_on() -> list[str]:
    """The device types whose ``torch.autocast`` is on here."""
    return [device for device in AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]


def _in_float64(model: nn.Module) -> bool:
    return any(p.dtype == torch.float64 for p in model.parameters())


def _is_float_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


_PRODUCTS = (torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm)


class _SoftmaxInterception(ScopedFunctionMode):
    """Hands every softmax output to the capture, which records or replaces it.

    Intercepting the softmax itself (rather than re-implementing attention) keeps the
    model's own masking, scaling and value weighting exact for any eager implementation.
    ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) dispatches as a whole,
    which would hide its softmax, so it runs as a private copy of the same function whose
    softmax is visible (nothing global is patched). A fused
    ``F.scaled_dot_product_attention`` inside an attention module's call hides it too: it
    runs as the computation PyTorch documents for it (:func:`_explicit_sdpa`).
    """

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self.capture = capture
        self.products = bool(capture._listening("product"))

        def softmax(*args: Any, **kwargs: Any) -> Tensor:
            return capture._on_softmax(F.softmax(*args, **kwargs), args[0] if args else kwargs.get("input"))

        def product(matmul: Any) -> Any:
            def reported(left: Tensor, right: Tensor) -> Tensor:
                if self.products:
                    capture._on_product(left, right)
                return matmul(left, right)

            return reported

        self._mha_forward = mha_forward_with_softmax(softmax, product(torch.bmm))
        self._sdpa = partial(_explicit_sdpa, capture._on_softmax, product(torch.matmul))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.multi_head_attention_forward:
            return self._mha_forward(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention and self.capture._open:
            return self._sdpa(SdpaArguments(*args, **(kwargs or {})))
        if func in SOFTMAXES and self.capture._open:
            probs = attention_softmax(func, args, kwargs or {})
            return self.capture._on_softmax(probs, args[0] if args else (kwargs or {}).get("input"))
        result = func(*args, **(kwargs or {}))
        if func in _PRODUCTS and self.products and len(args) == 2:
            self.capture._on_product(*args)
        return result


class _PlainKernelInterception(ScopedFunctionMode):
    """Streaming capture: hands each ``F.scaled_dot_product_attention`` call inside a named
    attention module's call to the capture (:func:`~captum_attention.capture.kernel.plain_sdpa`);
    a second in one call (two attentions in one module) cannot be one call's record."""

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not F.scaled_dot_product_attention or not self.capture._open:
            return func(*args, **(kwargs or {}))
        call = self.capture._open[-1]
        if call.kernel is not None:
            raise StreamingUnsupported(f"{type(call.module).__name__} calls F.scaled_dot_product_attention more than once")
        return plain_sdpa(self.capture._on_kernel, call.module, SdpaArguments(*args, **(kwargs or {})))


def _explicit_sdpa(record: Any, product: Any, arguments: SdpaArguments) -> Tensor:
    """``F.scaled_dot_product_attention`` as PyTorch documents it, its probabilities
    handed to ``record(probs, scores)`` (which returns the tensor that weights the values)
    and its two matrix products computed by ``product``; a row whose keys are all masked
    weights no value, as the fused kernel's (PyTorch's reference gives NaN there)."""
    query, attn_mask = arguments.query, arguments.attn_mask
    if arguments.dropout_p:
        raise UnsupportedModelError(
            f"an attention module calls F.scaled_dot_product_attention with dropout_p={arguments.dropout_p}: its output is "
            "random; call model.eval() (and pass dropout_p only in training)."
        )
    if arguments.is_causal and attn_mask is not None:
        raise ValueError("F.scaled_dot_product_attention takes attn_mask or is_causal=True, not both.")
    key, value = arguments.key, arguments.value
    if arguments.groups > 1:
        key, value = key.repeat_interleave(arguments.groups, dim=-3), value.repeat_interleave(arguments.groups, dim=-3)
    scores = product(query, key.transpose(-2, -1)) * arguments.kernel_scale
    if arguments.is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    live = scores.amax(dim=-1, keepdim=True) > float("-inf")
    probs = torch.where(live, F.softmax(scores.masked_fill(~live, 0.0), dim=-1), 0.0)  # no NaN, nor its gradient
    return product(record(probs, scores), value)


def _no_gradient(model: nn.Module) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{type(model).__name__} runs its attention without gradient (under torch.no_grad): the "
        "gradient methods cannot explain it; rollout and raw attention can."
    )
