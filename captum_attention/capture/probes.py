"""Probes: what one capture records or changes besides the attention it finds.

An :class:`~captum_attention.capture.AttentionCapture` finds the attention calls of one
forward pass. Everything else a method or a metric needs from that pass is a probe: an
object the capture enters for the call (its hooks and modes go on the capture's stack, so
they are removed with the capture's own, also on an exception or an interrupt) and that
receives only the events it declares in :attr:`Probe.events`:

- ``"softmax"`` (eager capture): each attention softmax, as ``(batch, heads, queries,
  keys)`` probabilities; the probe may return others to use instead;
- ``"product"`` (eager capture): each matrix product computed inside an attention call;
- ``"kernel"`` (streaming capture): each call of the attention kernel; the probe may
  compute the call's output itself;
- ``"key_bias"`` (streaming capture): each call of the attention kernel, before the
  ``"kernel"`` event; the probe may give a bias on each key's logits that the kernel adds,
  whoever runs it;
- ``"call_end"``: the end of each attention call, with the tensors that weighted its values;
- ``"masks"``: the padding masks the model received;
- ``"backward"``: a backward pass through the capture
  (:meth:`~captum_attention.capture.AttentionCapture.run_backward`) reaching each call, with
  its maps and their gradient.

A probe's :meth:`Probe.result` is a typed value that the record of the pass keeps
(:meth:`~captum_attention.capture.ForwardRecord.result`); a probe without one returns None.
A new method or metric adds a probe, never a parameter of the capture.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache

from .._compat import StreamingUnsupported, UnsupportedModelError, in_place_count
from ..maps.interventions import weigh_keys
from ..maps.kernel import KernelCall
from .adapters import AttentionAdapter, AttentionSite
from .adapters.images import leading_image_features
from .adapters.protocol import parent_module
from .guard import current_thread
from .inputs import take_rows
from .kernel import key_bias_applies

Event = str
"""One of ``"softmax"``, ``"product"``, ``"kernel"``, ``"key_bias"``, ``"call_end"``,
``"masks"``, ``"backward"``."""

RunKernel = Callable[..., Tensor]
"""``run_kernel(inputs=None, rows_backward=False)``: runs the model's attention kernel, on
its own query, key and value or on ``inputs(query, key, value)`` of them, with the call's
key bias where a probe gave one (see :data:`~captum_attention.capture.kernel.Recorder`)."""


@dataclass(frozen=True, eq=False)
class CallInfo:
    """One attention call, as probes see it.

    Attributes:
        index: the call's number, from 0 in forward order.
        module: the attention module that made it.
        role: ``"self"``, ``"encoder"``, ``"decoder"``, ``"cross"`` or ``"pooling"``.
        adapter: the capture's adapter (``as_heads`` reads the module's tensors as heads).
    """

    index: int
    module: nn.Module
    role: str
    adapter: AttentionAdapter

    def as_heads(self, tensor: Tensor) -> Tensor:
        """A ``(batch, heads, queries, keys)`` view of one of the call's probability tensors."""
        return self.adapter.as_heads(self.module, tensor)


class Probe:
    """Base of the probes: every callback does nothing; subclasses override those they
    declare in :attr:`events`.

    Attributes:
        events: the events the probe receives (see the module docstring).
        modes: the capture modes it works in; a streaming capture with a probe that
            cannot stream raises
            :class:`~captum_attention.maps.kernel.StreamingUnsupported` with
            :attr:`eager_reason`, so that ``capture="auto"`` falls back to eager.
        eager_reason: why the probe needs the explicit probabilities.
        needs_grad: the forward must build the autograd graph (gradient methods, rules).
    """

    events: ClassVar[frozenset[Event]] = frozenset()
    modes: ClassVar[frozenset[str]] = frozenset({"eager", "streaming"})
    eager_reason: ClassVar[str] = "this probe works on explicit probabilities"
    needs_grad: ClassVar[bool] = False

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        """Install what the probe needs for the call; ``stack`` undoes it."""

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor | None:
        """The probabilities ``(batch, heads, queries, keys)`` to use instead, or None.
        ``first_head``: the layer's index of the first head in ``attn_probs`` (0 unless
        the module computes one softmax per head); ``attn_scores``: the softmax's input
        (masked, scaled logits), or None where the softmax was called unusually. A model
        with attention sinks (gpt-oss) softmaxes one more column after the keys, the
        sink's, which weights no value."""
        return None

    def on_product(self, call: CallInfo, left: Tensor, right: Tensor) -> None:
        """A matrix product ``left @ right`` computed inside the call."""

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        """The call's output ``(B, Q, H, Dv)`` computed by the probe, or None for the
        kernel's own. ``call`` is None for kernel calls outside the adapter's modules."""
        return None

    def key_bias(self, call: CallInfo, kernel: KernelCall) -> Tensor | None:
        """A ``(B, H / groups, K)`` tensor the kernel adds to every query's logit of each
        key, or None (:func:`~captum_attention.capture.kernel.key_bias_applies`)."""
        return None

    def on_call_end(self, call: CallInfo, pieces: Sequence[Tensor]) -> None:
        """The call ended; ``pieces`` are the tensors that weighted its values."""

    def on_masks(self, attention_mask: Tensor | None, decoder_attention_mask: Tensor | None) -> None:
        """The padding masks the model received (1 = real token), or None."""

    def on_backward(self, call: CallInfo, attn_maps: Tensor, attn_grads: Tensor) -> None:
        """A backward pass reached the call: its ``(batch, heads, queries, keys)`` maps and
        dS/dA."""

    def result(self) -> Any:
        """The probe's typed result for the record, or None."""
        return None


class PerCall:
    """A result with one entry per attention call in each of its list fields; records
    select its calls with the record's (e.g. one role's)."""

    def select(self: "PerCallT", calls: Sequence[int]) -> "PerCallT":
        picked = {f.name: [getattr(self, f.name)[i] for i in calls] for f in fields(self)}  # type: ignore[arg-type]
        return replace(self, **picked)  # type: ignore[type-var]


PerCallT = TypeVar("PerCallT", bound=PerCall)


@dataclass
class GradMaps(PerCall):
    """Per attention call, a gradient method's reduction of (A, dS/dA) over heads,
    ``(B, Q, K)`` float32."""

    maps: list[Tensor]


class GradientReduction(Probe):
    """Reduces each call's (A, dS/dA) as a backward pass reaches it:
    ``reduce(attn_maps, attn_grads) -> (B, Q, K)`` (result: :class:`GradMaps`, in call
    order).

    Args:
        reduce (callable): the method's reduction over heads.
    """

    events = frozenset({"backward"})

    def __init__(self, reduce: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.reduce = reduce
        self._reduced: dict[int, Tensor] = {}

    def on_backward(self, call: CallInfo, attn_maps: Tensor, attn_grads: Tensor) -> None:
        self._reduced[call.index] = self.reduce(attn_maps, attn_grads).float()

    def result(self) -> GradMaps:
        return GradMaps([self._reduced[index] for index in sorted(self._reduced)])


class GradMode(Probe):
    """torch's gradient mode for the forward, restored with the model on exit (so an
    interrupt cannot leave it changed)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        stack.enter_context(torch.set_grad_enabled(self.enabled))


class LastCallGraph(Probe):
    """The autograd graph from the last attention call on only, in a forward without
    gradients (in the capturing thread; :class:`GradMode` restores the mode on exit), so
    that the output's dependence on that call's rows can be read at the cost of what
    follows it: under streaming capture from the kernel's output (a fresh leaf: the output
    projection, one feed-forward, the head), under eager capture from the last attention
    module's input (its probabilities in the graph)."""

    events = frozenset({"kernel"})

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self._last: nn.Module | None = None
        self._thread = 0

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        sites = adapter.attention_sites(model)
        self._last, self._thread = (sites[-1].module if sites else None), current_thread()
        if self._last is not None and not self.streaming:
            stack.callback(self._last.register_forward_pre_hook(self._from_input, with_kwargs=True).remove)

    def _from_input(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if current_thread() != self._thread:
            return None
        torch.set_grad_enabled(True)
        if args and isinstance(args[0], Tensor) and args[0].is_floating_point():
            return (args[0].detach().requires_grad_(), *args[1:]), kwargs
        return None

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        if call is None or call.module is not self._last or current_thread() != self._thread:
            return None
        output = run_kernel()
        torch.set_grad_enabled(True)
        return output.detach().requires_grad_()


class MaskShape(Probe):
    """A clear error when the padding mask does not belong to inputs of ``input_shape``."""

    events = frozenset({"masks"})

    def __init__(self, input_shape: tuple[int, int]) -> None:
        self.input_shape = input_shape

    def on_masks(self, attention_mask: Tensor | None, decoder_attention_mask: Tensor | None) -> None:
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(self.input_shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the inputs are "
                f"{tuple(self.input_shape)} (batch, seq_len): pass the mask that belongs "
                "to these inputs, one row per example and one entry per token."
            )


class TowerInputs(Probe):
    """The image tower apart (:meth:`AttentionAdapter.image_tower_apart`), named in
    :attr:`fed` once the given float ``inputs`` went into it: pixels (a dual encoder's
    flattened patches, SigLIP2's) explained through a model whose explained attention is
    its tokens'."""

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = inputs
        self.fed: list[str] = []

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        tower = adapter.image_tower_apart(model) if any(t.is_floating_point() for t in self.inputs) else None
        if tower is None:
            return

        def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if any(value is given for value in (*args, *kwargs.values()) for given in self.inputs):
                self.fed.append(tower)

        stack.callback(model.get_submodule(tower).register_forward_pre_hook(seen, with_kwargs=True).remove)


class EmbeddedIds(Probe):
    """The token ids, in :attr:`embedded` in order, that an encoder-decoder given token ids
    as its second input embeds (the decoder's last: it runs after the encoder); none for
    other models and inputs, nor for a class that names no input embeddings."""

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = inputs
        self.embedded: list[Tensor] = []

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        if len(self.inputs) != 2 or self.inputs[1].is_floating_point() or not adapter.is_encoder_decoder(model):
            return
        try:
            modules = adapter.input_embeddings(model)
        except UnsupportedModelError:
            return
        for module in modules:
            stack.callback(module.register_forward_pre_hook(self._seen).remove)

    def _seen(self, module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], Tensor) and not args[0].is_floating_point():
            self.embedded.append(args[0])


Intervention = Callable[[int, Tensor, int, Tensor | None], Tensor]
"""``intervention(call_index, attn_probs, first_head, attn_scores) -> attn_probs``: the
probabilities of one call to use instead (see :meth:`Probe.on_softmax`)."""


class ProbsIntervention(Probe):
    """Replaces each call's probabilities by ``intervention(call_index, attn_probs,
    first_head, attn_scores)`` before they weight the values (eager capture).

    Args:
        intervention (callable): see :data:`Intervention`.
    """

    events = frozenset({"softmax"})
    modes = frozenset({"eager"})
    eager_reason = "this intervention replaces whole probability maps; it cannot stream"

    def __init__(self, intervention: Intervention) -> None:
        self.intervention = intervention

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor:
        return self.intervention(call.index, attn_probs, first_head, attn_scores)


class KeysTransform(Probe):
    """Runs each chosen kernel call on other keys (streaming capture): ``transform(call_index)``
    returns a function from the keys the kernel received ``(B, H / groups, K, D)`` to the
    keys to use, or None for calls it leaves alone.

    Args:
        transform (callable): see above.
    """

    events = frozenset({"kernel"})
    modes = frozenset({"streaming"})

    def __init__(self, transform: Callable[[int], Callable[[Tensor], Tensor] | None]) -> None:
        self.transform = transform

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        new_keys = None if call is None else self.transform(call.index)
        if new_keys is None:
            return None
        return run_kernel(lambda query, key, value: (query, new_keys(kernel.key), value))


@dataclass
class KeyBiases(PerCall):
    """Per attention call, the zero ``(B, H / groups, K)`` bias its kernel added to each
    key's logits, in the autograd graph, or None where the call could not carry one."""

    biases: list[Tensor | None]


class ZeroKeyBiases(Probe):
    """Adds a zero bias to the logits of each key of every kernel call that can carry one
    (:func:`~captum_attention.capture.kernel.key_bias_applies`), in the autograd graph: a
    backward's gradient in it is, per key head, the sum over its query heads and the query
    rows of dS/dlogits (result: :class:`KeyBiases`, in call order). Nothing under an eager
    capture."""

    events = frozenset({"key_bias"})

    def __init__(self) -> None:
        self._biases: dict[int, Tensor | None] = {}

    def key_bias(self, call: CallInfo, kernel: KernelCall) -> Tensor | None:
        bias = None
        if key_bias_applies(kernel):
            bias = kernel.query.new_zeros(kernel.key.shape[:3]).requires_grad_()
        self._biases[call.index] = bias
        return bias

    def result(self) -> KeyBiases:
        return KeyBiases([self._biases[index] for index in sorted(self._biases)])


class KeyPresence(Probe):
    r"""Weighs each token's keys by its presence in every self-attention call: the
    attention a query pays to token j is scaled by :math:`p_j` and its row renormalised
    (:func:`~captum_attention.maps.weigh_keys`), in the autograd graph. Under an eager
    capture it replaces the probabilities; under a streaming one the kernel adds
    :math:`\log p_j` to the keys' logits (as :class:`ZeroKeyBiases` adds its zero), on a
    call with a logit softcap it cannot (the cap would cap the bias too): the capture falls
    back to eager there.

    Args:
        presence: ``(B, T)`` each token's presence in (0, 1], T the tokens the model reads
            (the image features a model puts before them, GIT's, fully present).
    """

    events = frozenset({"softmax", "key_bias"})

    def __init__(self, presence: Tensor) -> None:
        if presence.dim() != 2 or not presence.is_floating_point():
            raise ValueError(f"presence must be a (batch, tokens) float tensor, got shape {tuple(presence.shape)} of {presence.dtype}.")
        if not bool(((presence > 0) & (presence <= 1)).all()):
            raise ValueError("presence must lie in (0, 1] for every token (1: as it is; a removed token would be 0, which is no presence).")
        self.log_presence = presence.detach().double().log()
        self.features_first = False

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        self.features_first = leading_image_features(model) is not None

    def _log_presence(self, call: CallInfo, batch: int, keys: int, device: torch.device) -> Tensor:
        if call.role not in ("self", "pooling"):
            raise ValueError(
                "presence weighs the tokens' keys in one self-attention stack; an encoder-decoder's or a "
                "cross-attending model's calls are not defined for it: leave presence=None."
            )
        tokens = self.log_presence.shape[1]
        if self.features_first and batch == self.log_presence.shape[0] and keys > tokens:
            return F.pad(self.log_presence, (keys - tokens, 0)).to(device)
        if (batch, keys) != tuple(self.log_presence.shape):
            raise ValueError(
                f"presence has shape {tuple(self.log_presence.shape)} but an attention call of the model reads {keys} "
                f"keys for {batch} examples: give one value per example and token the model reads (with "
                "attribute_span, the prompt's and the answer's)."
            )
        return self.log_presence.to(device)

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor:
        sink = not self.features_first and attn_probs.shape[-1] == self.log_presence.shape[1] + 1
        keys = attn_probs.shape[-1] - (1 if sink else 0)
        return weigh_keys(attn_probs, self._log_presence(call, attn_probs.shape[0], keys, attn_probs.device), attn_scores)

    def key_bias(self, call: CallInfo, kernel: KernelCall) -> Tensor:
        if kernel.softcap is not None:
            raise StreamingUnsupported("presence rides on the keys' logits, which the model's softcap would cap too")
        batch, key_heads, keys = kernel.key.shape[:3]
        log_presence = self._log_presence(call, batch, keys, kernel.key.device)
        return log_presence.to(kernel.query.dtype)[:, None, :].expand(batch, key_heads, keys)


@dataclass
class RecordedValues(PerCall):
    """Per attention call, the ``(B, H / groups, K, Dv)`` values its probabilities weighted
    (detached; each key-value head serving ``groups`` consecutive query heads, 1 where the
    values were recorded per head), the adapter's output projection weight
    ``(hidden, H * Dv)``, or None where it does not know it, and, where the recorder was
    given ``projected_rows``, what that projection received on those rows
    ``(B, rows, features)`` (None where it saw no such input)."""

    values: list[Tensor]
    projections: list[Tensor | None]
    groups: list[int]
    projected: list[Tensor | None] = field(default_factory=list)

    def per_head(self, call: int) -> Tensor:
        """``(B, H, K, Dv)``: the call's values, one per query head."""
        values, groups = self.values[call], self.groups[call]
        return values if groups == 1 else values.repeat_interleave(groups, dim=1)


class ValueRecorder(Probe):
    """Records the values each call's probabilities weight: the right factor of the
    matrix product whose left factor is the probabilities (eager capture).

    Args:
        projected_rows: also record what each call's output projection receives, on the
            query rows ``projected_rows(tokens)`` gives (slices), to check that it
            receives the heads' attention-weighted values and nothing else (a gate on
            them). Default: None, not recorded.
    """

    events = frozenset({"product", "call_end"})
    modes = frozenset({"eager"})
    eager_reason = "effective attention needs the values and the full maps"

    def __init__(self, projected_rows: Callable[[int], list[slice]] | None = None) -> None:
        self._products: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._values: list[Tensor] = []
        self._projections: list[Tensor | None] = []
        self._groups: list[int] = []
        self._model: nn.Module | None = None
        self.projected_rows = projected_rows
        self._owners: dict[nn.Module, nn.Module | None] = {}
        self._received: dict[nn.Module, list[Tensor | None]] = {}
        self._starts: dict[nn.Module, list[int | None]] = {}
        self._slots: list[tuple[nn.Module | None, int | None]] = []

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        self._model = model
        self._products, self._values, self._projections, self._groups = {}, [], [], []
        self._owners, self._received, self._starts, self._slots = {}, {}, {}, []
        if self.projected_rows is not None:
            self._watch_projections(model, adapter, stack)

    def _watch_projections(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        rows_of = self.projected_rows
        assert rows_of is not None

        def keep(projection: nn.Module, args: tuple) -> None:
            received = args[0] if args and isinstance(args[0], Tensor) and args[0].dim() == 3 else None
            if received is not None:
                rows = torch.cat([torch.arange(r.start, r.stop) for r in rows_of(received.shape[1])])
                received = received.detach()[:, rows.to(received.device)]
            self._received.setdefault(projection, []).append(received)

        def started(module: nn.Module, args: tuple) -> None:
            owner = self._owners[module]
            self._starts.setdefault(module, []).append(len(self._received[owner]) if owner is not None else 0)

        for site in adapter.attention_sites(model):
            owner = _weight_owner(model, site.module, adapter.output_projection(model, site.module))
            self._owners[site.module] = owner
            stack.callback(site.module.register_forward_pre_hook(started).remove)
            if owner is not None and owner not in self._received:
                self._received[owner] = []
                stack.callback(owner.register_forward_pre_hook(keep).remove)

    def _record(self, call: CallInfo, values: Tensor, groups: int) -> None:
        assert self._model is not None
        self._values.append(values)
        self._groups.append(groups)
        self._projections.append(call.adapter.output_projection(self._model, call.module))
        if self.projected_rows is not None:  # the call's start said which of its projection's inputs is its own
            starts = self._starts.get(call.module) or [None]
            self._slots.append((self._owners.get(call.module), starts.pop(0)))

    def on_product(self, call: CallInfo, left: Tensor, right: Tensor) -> None:
        self._products.setdefault(call.index, []).append((left, right))

    def on_call_end(self, call: CallInfo, pieces: Sequence[Tensor]) -> None:
        products = self._products.pop(call.index, [])
        parts = []
        for piece in pieces:
            value = next((right for left, right in products if _same_tensor(left, piece)), None)
            if value is None:
                raise UnsupportedModelError(
                    f"Cannot find the values that {type(call.module).__name__}'s attention "
                    "weights: no torch.matmul/bmm (or @) took its probabilities as the left "
                    "factor."
                )
            batch, heads = call.as_heads(piece).shape[:2]
            shape = value.shape[-2:]
            if value.numel() == batch * shape.numel():  # one value head for every query head, broadcast by the product (Falcon)
                parts.append(value.detach().reshape(batch, 1, *shape).expand(batch, heads, *shape))
            else:
                parts.append(value.detach().reshape(batch, heads, *shape))
        self._record(call, parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), 1)

    def result(self) -> RecordedValues:
        projected = [
            self._received[owner][seen] if owner is not None and seen is not None and seen < len(self._received[owner]) else None
            for owner, seen in self._slots
        ]
        return RecordedValues(self._values, self._projections, self._groups, projected)


def _weight_owner(model: nn.Module, module: nn.Module, weight: Tensor | None) -> nn.Module | None:
    """The module, inside ``module`` or its parent, whose weight ``weight`` is (or a view
    of: GPT-2's transposed ``Conv1D``; or dequantized from:
    :func:`~captum_attention.maps.common.dense_weight`); None where there
    is none."""
    if weight is None:
        return None
    parent = parent_module(model, module)
    sources = (weight, getattr(weight, "_base", None), getattr(weight, "dequantized_from", None))
    for candidate in (*module.modules(), *(parent.modules() if parent is not None else ())):
        own = getattr(candidate, "weight", None)
        if isinstance(own, Tensor) and any(own is source for source in sources):
            return candidate
    return None


class AttendedValues(ValueRecorder):
    """:class:`ValueRecorder` in both capture modes: under streaming capture, the values
    each kernel call received (per key-value head, with its grouping), for the methods
    that weigh attention by what it moves."""

    events = frozenset({"product", "call_end", "kernel"})
    modes = frozenset({"eager", "streaming"})

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        if call is not None and kernel.value is not None:
            self._record(call, kernel.value.detach(), kernel.groups)
        return None


def _same_tensor(left: Tensor, right: Tensor) -> bool:
    """The same tensor, or a view of the same memory with the same shape (what an
    identity dropout or a dtype no-op hands on)."""
    return left is right or (
        left.shape == right.shape and left.stride() == right.stride() and left.data_ptr() == right.data_ptr()
    )


@dataclass
class ModuleStates:
    """One module inside a layer that returned hidden states of the layer's shape
    ``(B, N, D)``, as the forward ran it: its first input as such states (None where it
    took none) and its output (both detached)."""

    module: nn.Module
    inputs: Tensor | None
    output: Tensor


@dataclass
class BlockCall:
    """One call of a layer: the module, its arguments, its output hidden states
    ``(B, N, D)`` (detached) and, where :class:`LayerBlocks` recorded them, the
    :class:`ModuleStates` of its modules in the order they returned (None otherwise)."""

    block: nn.Module
    args: tuple
    kwargs: dict
    output: Tensor
    states: list[ModuleStates] | None = None

    def rerun_inputs(self, examples: Tensor | None = None) -> tuple[tuple, dict]:
        """The call's arguments for a re-run of the layer (of ``examples`` only, repeats
        allowed): without the key-value cache the forward filled, and not filling one."""
        def uncached(value: Any) -> Any:
            return None if isinstance(value, Cache) else value

        args = tuple(uncached(value) for value in self.args)
        kwargs = {name: uncached(value) for name, value in self.kwargs.items()}
        if examples is not None:
            batch = self.output.shape[0]
            args, kwargs = take_rows(args, examples, batch, min_dim=2), take_rows(kwargs, examples, batch, min_dim=2)
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return args, kwargs

    @property
    def hidden_input(self) -> Tensor:
        """``(B, N, D)``: the hidden states the layer took (its first argument of the
        output's shape)."""
        found = next((value for value in (*self.args, *self.kwargs.values())
                      if isinstance(value, Tensor) and value.shape == self.output.shape), None)
        if found is None:
            raise UnsupportedModelError(
                f"{type(self.block).__name__} took no hidden states of its output's shape {tuple(self.output.shape)}."
            )
        return found.detach()


@dataclass
class RecordedBlocks:
    """The layers' calls (:class:`BlockCall`) in the order they ran; ``cache`` keeps what a
    method derives from them once per forward (Value Zeroing's mixing matrices)."""

    calls: list[BlockCall]
    cache: dict = field(default_factory=dict)


def layer_blocks(model: nn.Module, adapter: AttentionAdapter, sites: Sequence[AttentionSite] | None = None) -> list[nn.Module | None]:
    """Each attention site's layer (the adapter's ``layer_block``), in the sites' order
    (``sites``: the adapter's ``attention_sites``, where the caller has them already);
    None where the adapter does not know it."""
    find = getattr(adapter, "layer_block", None)
    return [find(model, site.module) if find else None for site in (adapter.attention_sites(model) if sites is None else sites)]


class LayerBlocks(Probe):
    """Records the call (inputs and output) of each layer that holds an attention module
    (the adapter's ``layer_block``), in both capture modes: what re-running a layer
    needs. Calls from other threads are not recorded.

    Args:
        states: also record the :class:`ModuleStates` of the modules inside the layer
            calls (all: True; one call: its index in the forward's calls, negative from
            the end, a layer called twice counted twice; none: False),
            where the residual stream meets the attention output
            (:func:`~captum_attention.capture.residual.attention_residual`): copies of a
            few more ``(B, N, D)`` tensors per layer kept (a layer may add into a
            module's output in place once it has used it), where re-running the layer
            would compute it all again. The modules inside the attention module are
            left out but its norms: the residual joins the attention's output outside
            it, or at a norm inside it (ALBERT's). Default: False.
    """

    def __init__(self, states: bool | int = False) -> None:
        self._calls: list[BlockCall] = []
        self.states = states

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        sites = adapter.attention_sites(model)
        blocks = {id(block): block for block in layer_blocks(model, adapter, sites) if block is not None}
        calls: list[BlockCall] = []
        self._calls, thread = calls, current_thread()
        pending: dict[int, tuple[tuple, dict, list | None]] = {}
        kept: list[tuple[Tensor, list, list]] = []  # the running layer call's hidden input, states, and its last copy

        def before(block: nn.Module, args: tuple, kwargs: dict) -> None:
            if current_thread() == thread:
                hidden = next((v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.dim() == 3), None)
                seen: list | None = None
                if self._wanted(len(calls) + len(pending)) and hidden is not None:
                    seen = []
                    kept.append((hidden, seen, []))
                pending[id(block)] = (args, dict(kwargs), seen)

        def after(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if current_thread() == thread and id(block) in pending:
                hidden = output[0] if isinstance(output, (tuple, list)) else output
                call_args, call_kwargs, seen = pending.pop(id(block))
                if seen is not None:
                    kept.pop()
                    seen = _as_module_states(seen, hidden)
                calls.append(BlockCall(block, call_args, call_kwargs, hidden.detach(), seen))
                if not isinstance(self.states, bool) and self.states < 0 and len(calls) > -self.states:
                    calls[len(calls) - 1 + self.states].states = None  # out of the last -states calls: not the one asked for

        def inside(module: nn.Module, args: tuple, output: Any) -> None:
            if current_thread() == thread and kept:
                layer_input, seen, last = kept[-1]
                hidden = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(hidden, Tensor) and hidden.numel() == layer_input.numel():  # never an MLP's wider states
                    first = args[0] if args and isinstance(args[0], Tensor) else None
                    kept_input = first.detach() if first is not None and first.numel() == hidden.numel() else None
                    seen.append((module, kept_input, _copy_once(hidden, last)))

        inside_attention = set() if self.states is False else {
            id(m) for site in sites for m in site.module.modules() if m is not site.module and not is_norm_module(m)
        }
        for block in blocks.values():
            stack.callback(block.register_forward_pre_hook(before, with_kwargs=True).remove)
            stack.callback(block.register_forward_hook(after, with_kwargs=True).remove)
            if self.states is not False:
                for module in block.modules():
                    if module is not block and id(module) not in inside_attention:
                        stack.callback(module.register_forward_hook(inside).remove)

    def _wanted(self, index: int) -> bool:
        """Whether the layer call ``index`` (in the forward's order) records its module
        states: a negative index records every call's, keeping the last ones only."""
        if isinstance(self.states, bool):
            return self.states
        return self.states < 0 or index == self.states

    def result(self) -> RecordedBlocks:
        return RecordedBlocks(list(self._calls))


def is_norm_module(module: nn.Module) -> bool:
    """Whether ``module`` is a norm by its class's name (a LayerNorm, an RMSNorm); inside
    an attention module, the residual may join its output (ALBERT's)."""
    return "norm" in type(module).__name__.lower()


def _copy_once(states: Tensor, last: list) -> Tensor:
    """A detached copy of ``states`` (a layer may add into a module's output in place once
    it has used it, as Falcon's does), the ``last`` one ``[tensor, version, copy]`` again
    where a module returned the tensor the one before returned, unchanged (a dropout in
    eval returns its input, a feed-forward its last projection's output); copied each
    time where no count says it is unchanged (an inference tensor)."""
    version = in_place_count(states)
    if version is None or not last or last[0] is not states or last[1] != version:
        last[:] = [states, version, states.detach().clone()]
    return last[2]


def _as_module_states(seen: list[tuple[nn.Module, Tensor | None, Tensor]], layer_output: Tensor) -> list[ModuleStates]:
    """The modules of ``seen`` (module, first input, output) whose output has the shape
    of the layer's output ``(B, N, D)``, as it is or flattened over the tokens (OPT), their
    inputs where those do too."""
    shape = layer_output.shape

    def as_states(value: Tensor | None) -> Tensor | None:
        if value is None or value.shape[-1:] != shape[-1:] or value.numel() != layer_output.numel() or value.dim() not in (2, 3):
            return None
        return value.detach().reshape(shape)

    return [ModuleStates(module, as_states(inputs), states)
            for module, inputs, output in seen if (states := as_states(output)) is not None]
