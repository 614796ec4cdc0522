"""A model run on its input tokens' shares (DecompX), read from the model's own modules.

:class:`LinearisationPoints` records, during the explained forward and from its first
layer on, what every norm and activation computed. :func:`share_outputs` then runs the
model once more on a batch of ``1 + N`` rows per example: a zero input (which carries the
value bias) and each token's share, the first layer's input being each token's own state
alone. Hooks make each module the linear map it was at the recorded point
(:mod:`captum_attention.maps.decompx`): the attention at the forward's probabilities
(inside transformers' sdpa function, or where an eager attention's softmax computes
them; the value bias taken out of each share's output before the projection), a
norm at its statistics, an activation (a module of transformers' or torch's, or one of
torch's activation functions called outside them, as a head's ``torch.tanh``) at its
zero-origin slope (in a gated feed-forward, where the activation multiplies another
projection, the activation is held at its value), a linear map's bias shared by
``absdot``. The projections inside the attention run as they are: the attention reads
only the values. Whatever else bends the states (an activation written out of other
functions, a mixture of experts' routing) is not linearised, and the shares no longer add
up to the logits: the method checks that they do and refuses otherwise.

A model without any bias (:func:`without_biases`: Llama, Mistral, Gemma) makes that
forward one linear map of the first layer's input, with nothing to share by ``absdot``:
the explained forward itself then runs under :class:`ShareGradients`, its values the
model's own and its backward that map's, and every token's share is read from one
backward.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
import torch.nn.functional as F
import transformers.activations
from torch import Tensor, nn

from .._compat import SOFTMAXES, UnsupportedModelError, attention_softmax, error_line, format_additional_forward_args, run_forward
from ..maps import LinearNorm
from ..maps.decompx import distribute_bias, held_attention, linearised, unbiased_outputs, zero_origin_slope
from ..maps.kernel import KernelCall
from .adapters import AttentionAdapter
from .adapters.images import ENCODED_IMAGES, encoded_copies, with_encoded_images
from .inputs import output_logits, take_rows
from .guard import ModelChanges, ScopedFunctionMode, current_thread
from .kernel import KernelInterception
from .probes import CallInfo, Probe, RunKernel, layer_blocks
from .residual import linear_norm

_NOT_ACTIVATIONS = (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d, nn.MultiheadAttention, nn.GLU)


def _activation_classes() -> tuple[type, ...]:
    """transformers' activation modules and torch's element-wise ones."""
    named = [value[0] if isinstance(value, tuple) else value for value in transformers.activations.ACT2CLS.values()]
    elementwise = [cls for cls in vars(nn.modules.activation).values()
                   if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == nn.modules.activation.__name__
                   and not issubclass(cls, _NOT_ACTIVATIONS)]
    return tuple({cls for cls in [*named, *elementwise] if isinstance(cls, type)})


FUNCTIONS = 0
"""The key under which :class:`Points` keeps the activation functions called outside
activation modules (a classifier head's ``torch.tanh``, an inline ``nn.ReLU()``)."""

_ACTIVATION_FUNCTIONS = frozenset({
    torch.tanh, Tensor.tanh, F.tanh, torch.relu, Tensor.relu, F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu,
    F.leaky_relu, F.hardswish, torch.sigmoid, Tensor.sigmoid, F.sigmoid,
})


@dataclass
class ModelModules:
    """What the share forward hooks: the layers, in order, the attention modules, and
    each leaf module's kind (``"norm"``, ``"activation"``, ``"linear"``, or
    ``"projection"``: an attention's output projection) by ``id`` (modules inside the
    attention have none), with the modules of a kind in ``hooked``."""

    blocks: list[nn.Module]
    sites: list[nn.Module]
    kinds: dict[int, str]
    hooked: list[nn.Module]


def model_modules(model: nn.Module, adapter: AttentionAdapter) -> ModelModules:
    """The layers and the module kinds of ``model``; a refusal in one line where the
    adapter does not pair each attention with its layer."""
    attention_sites = adapter.attention_sites(model)
    sites = [site.module for site in attention_sites]
    blocks = layer_blocks(model, adapter, attention_sites)
    if not blocks or any(block is None for block in blocks):
        raise UnsupportedModelError(
            f"DecompX runs {type(model).__name__} layer by layer, but its adapter does not name each attention's layer (layer_block)."
        )
    inside = {id(module) for site in sites for module in site.modules()}
    projections = {weight.data_ptr() for site in sites if (weight := adapter.output_projection(model, site)) is not None}
    activations = _activation_classes()
    kinds: dict[int, str] = {}
    hooked: list[nn.Module] = []
    for module in model.modules():
        if next(module.children(), None) is not None or isinstance(module, nn.Embedding):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, Tensor) and weight.data_ptr() in projections:
            kinds[id(module)] = "projection"
        elif "norm" in type(module).__name__.lower():  # inside the attention too: a norm after its output (ALBERT)
            kinds[id(module)] = "norm"
        elif id(module) in inside:
            continue
        elif isinstance(module, activations):
            kinds[id(module)] = "activation"
        elif isinstance(weight, Tensor) and weight.dim() == 2:
            kinds[id(module)] = "linear"
        if id(module) in kinds:
            hooked.append(module)
    return ModelModules([block for block in blocks if block is not None], sites, kinds, hooked)


@dataclass
class Seen:
    """One call of a module: its input, its output (norms and activations) and the layer
    it ran in (None outside the layers)."""

    inputs: Tensor
    output: Tensor | None
    layer: int | None


@dataclass
class Points:
    """What each module computed in the explained forward, from its first layer on: per
    module ``id`` (activation functions under :data:`FUNCTIONS`), per call, its input and
    output (norms and activations) or its input (linear maps, to tell a gated
    feed-forward)."""

    modules: ModelModules
    seen: dict[int, list[Seen]] = field(default_factory=dict)

    def gated(self, activation: int, call: int) -> bool:
        """Whether an activation's call in a layer gates a feed-forward: no linear map of
        the layer takes its output, which is multiplied with another projection first
        (Llama's ``down_proj(act(gate_proj(x)) * up_proj(x))``, a fused ``gate_up_proj``).
        Outside the layers (a head's ``tanh``, a logit cap) an activation is never a gate."""
        seen = self.seen[activation][call]
        if seen.layer is None or seen.output is None:
            return False
        output = seen.output
        return not any(
            takes_output(inputs, output) for inputs in self._linear_inputs.get(seen.layer, [])
        )

    @cached_property
    def _linear_inputs(self) -> dict[int, list[Tensor]]:
        """The inputs of the linear maps and output projections, per layer."""
        by_layer: dict[int, list[Tensor]] = {}
        for module, kind in self.modules.kinds.items():
            if kind in ("linear", "projection"):
                for entry in self.seen.get(module, []):
                    if entry.layer is not None:
                        by_layer.setdefault(entry.layer, []).append(entry.inputs)
        return by_layer


def takes_output(linear_input: Tensor, activation_output: Tensor) -> bool:
    """Whether a linear map's input is an activation's output: the activation then gates
    nothing (:meth:`Points.gated`)."""
    return linear_input.shape == activation_output.shape and torch.equal(linear_input, activation_output)


def _hidden_argument(args: tuple, kwargs: dict) -> tuple[Tensor, Callable[[Tensor], tuple[tuple, dict]]]:
    """A layer's hidden states (its first positional argument, else ``hidden_states``)
    and how to call it with others instead."""
    if args and isinstance(args[0], Tensor):
        return args[0], lambda states: ((states, *args[1:]), kwargs)
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return kwargs["hidden_states"], lambda states: (args, {**kwargs, "hidden_states": states})
    raise UnsupportedModelError("DecompX could not find a layer's hidden states among its arguments.")


ModuleHook = Callable[[int, nn.Module | None, Tensor, Tensor, int | None], Any]
"""``(key, module, input, output, layer)``, the module None for an activation function,
the layer None outside the layers; returns the output to use instead, or None."""


class _Functions(ScopedFunctionMode):
    """Hands the element-wise activation functions called outside the hooked activation
    modules and the attention to ``on_call``, and a softmax inside the attention to
    ``on_softmax`` (this thread only)."""

    def __init__(self, state: dict[str, int], on_call: ModuleHook, on_softmax: Callable[[int, Tensor], Tensor | None] | None) -> None:
        super().__init__()
        self.state, self.on_call, self.on_softmax = state, on_call, on_softmax

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        in_attention = func in SOFTMAXES and self.state["in_site"] > 0
        output = attention_softmax(func, args, kwargs or {}) if in_attention else func(*args, **(kwargs or {}))
        if in_attention and self.on_softmax is not None and isinstance(output, Tensor):
            held = self.on_softmax(self.state["site"], output)
            return output if held is None else held
        if func not in _ACTIVATION_FUNCTIONS or self.state["layer"] < 0 or self.state["inside"] > 0:
            return output
        if not (args and isinstance(args[0], Tensor) and isinstance(output, Tensor)):
            return output
        replaced = self.on_call(FUNCTIONS, None, args[0], output, _layer(self.state))
        return output if replaced is None else replaced


def _layer(state: dict[str, int]) -> int | None:
    """The index of the layer running, or None between layers (the head)."""
    return state["layer"] if state["in_layer"] > 0 else None


def _from_first_layer(
    modules: ModelModules,
    stack: ExitStack,
    on_call: ModuleHook,
    on_block: Callable[[int, tuple, dict], Any] | None = None,
    on_softmax: Callable[[int, Tensor], Tensor | None] | None = None,
    before_projection: Callable[[int, tuple], Any] | None = None,
) -> None:
    """From the first layer's call on, in this thread: ``on_call`` after every module of a
    kind and every activation function outside them; ``on_block`` (the layer's index, its
    arguments) before every layer's call; ``on_softmax`` (the attention call's index, the
    probabilities) on a softmax inside an attention call; ``before_projection`` (the
    attention call's index, the arguments) before an output projection."""
    state = {"layer": -1, "inside": 0, "in_layer": 0, "site": -1, "in_site": 0}
    first, thread = modules.blocks[0], current_thread()

    def before_block(block: nn.Module, args: tuple, kwargs: dict) -> Any:
        if current_thread() != thread:
            return None
        if state["layer"] >= 0 or block is first:
            state["layer"] += 1
            state["in_layer"] += 1
            return on_block(state["layer"], args, kwargs) if on_block is not None else None
        return None

    def after_block(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if current_thread() == thread:
            state["in_layer"] = max(0, state["in_layer"] - 1)

    def enter(module: nn.Module, args: tuple) -> None:
        if current_thread() == thread:
            state["inside"] += 1

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if current_thread() == thread:
            state["inside"] -= 1

    def enter_site(module: nn.Module, args: tuple) -> None:
        if current_thread() == thread and state["layer"] >= 0:
            state["site"] += 1
            state["in_site"] += 1

    def leave_site(module: nn.Module, args: tuple, output: Any) -> None:
        if current_thread() == thread and state["layer"] >= 0:
            state["in_site"] = max(0, state["in_site"] - 1)

    def projecting(module: nn.Module, args: tuple) -> Any:
        if current_thread() != thread or state["layer"] < 0 or before_projection is None:
            return None
        return before_projection(state["site"], args)

    def after(module: nn.Module, args: tuple, output: Any) -> Any:
        if current_thread() != thread or state["layer"] < 0 or not (args and isinstance(args[0], Tensor)):
            return None
        if not isinstance(output, Tensor):
            raise UnsupportedModelError(
                f"DecompX cannot write {type(module).__name__} as a linear map of the tokens' shares: it returns "
                f"{type(output).__name__}, not states (a mixture of experts' router, a quantised layer)."
            )
        return on_call(id(module), module, args[0], output, _layer(state))

    for block in {id(block): block for block in modules.blocks}.values():  # a layer shared by every depth (ALBERT) once
        stack.callback(block.register_forward_pre_hook(before_block, with_kwargs=True).remove)
        stack.callback(block.register_forward_hook(after_block, with_kwargs=True, always_call=True).remove)
    for module in modules.hooked:
        stack.callback(module.register_forward_hook(after).remove)
    for module in [*modules.sites, *(m for m in modules.hooked if modules.kinds[id(m)] == "activation")]:
        stack.callback(module.register_forward_pre_hook(enter).remove)
        stack.callback(module.register_forward_hook(leave, always_call=True).remove)
    for module in modules.sites:
        stack.callback(module.register_forward_pre_hook(enter_site).remove)
        stack.callback(module.register_forward_hook(leave_site, always_call=True).remove)
    for module in modules.hooked:
        if modules.kinds[id(module)] == "projection":
            stack.callback(module.register_forward_pre_hook(projecting).remove)
    stack.enter_context(_Functions(state, on_call, on_softmax))


class LinearisationPoints(Probe):
    """Records :class:`Points` in the explained forward (both capture modes).

    Args:
        modules (ModelModules, optional): :func:`model_modules` of the model it will run
            in, where the caller has them; found when it enters otherwise. Default: None.
    """

    def __init__(self, modules: ModelModules | None = None) -> None:
        self._modules = modules
        self._points: Points | None = None

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        modules = self._modules or model_modules(model, adapter)
        points = self._points = Points(modules)

        def keep(key: int, module: nn.Module | None, inputs: Tensor, output: Tensor, layer: int | None) -> None:
            kept = module is None or modules.kinds[key] in ("norm", "activation")
            points.seen.setdefault(key, []).append(Seen(inputs.detach(), output.detach() if kept else None, layer))

        _from_first_layer(modules, stack, keep)

    def result(self) -> Points:
        assert self._points is not None
        return self._points


class _Cursor:
    """Each module's recorded calls, handed out in the order the share forward calls it."""

    def __init__(self, points: Points) -> None:
        self.points = points
        self.calls: dict[int, int] = {}

    def next(self, key: int, module: nn.Module | None) -> tuple[int, Tensor, Tensor | None]:
        call = self.calls.get(key, 0)
        seen = self.points.seen.get(key, [])
        if call >= len(seen):
            name = "an activation function" if module is None else type(module).__name__
            raise UnsupportedModelError(f"The forward on the tokens' shares called {name} more often than the explained forward did.")
        self.calls[key] = call + 1
        return call, seen[call].inputs, seen[call].output

    def check_done(self) -> None:
        if any(self.calls.get(module, 0) != len(seen) for module, seen in self.points.seen.items()):
            raise UnsupportedModelError("The forward on the tokens' shares did not call the model's modules as the explained forward did.")


def _check_rows(value: Any, batch: int, model: nn.Module) -> None:
    """Refuse in one line where an argument of the forward of several examples is not one
    row per example (flattened image patches), which the forward on the shares could not
    repeat per example."""
    if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] != batch:
        raise UnsupportedModelError(
            f"DecompX runs N + 1 copies of each example, but an argument of {type(model).__name__} of shape "
            f"{tuple(value.shape)} holds no row per example (flattened image patches): give one example at a time."
        )
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_rows(item, batch, model)
    elif isinstance(value, dict):
        for item in value.values():
            _check_rows(item, batch, model)


def _one_example_copies(value: Any, copies: int, keyword: bool = False) -> Any:
    """One example's forward arguments for ``copies`` copies of it: each tensor of two or
    more dimensions tiled along its first (its rows, or a vision-language model's flattened
    patches and image grids, whose first axis counts images, one example's all), and a 1-D
    one too among the keyword arguments (per image: VideoLLaMA 3's merge sizes); its images
    given encoded (:data:`~captum_attention.capture.adapters.images.ENCODED_IMAGES`) as
    they are, already for every copy."""
    if isinstance(value, Tensor):
        return value.repeat(copies, *[1] * (value.dim() - 1)) if value.dim() >= 2 or (keyword and value.dim() == 1) else value
    if isinstance(value, (tuple, list)):
        return type(value)(_one_example_copies(item, copies, keyword) for item in value)
    if isinstance(value, dict):
        return {name: item if name == ENCODED_IMAGES else _one_example_copies(item, copies, True) for name, item in value.items()}
    return value


def _with_encoded(value: Any, encoded: Any) -> Any:
    """Forward arguments whose image inputs (a mapping among them) take the ``encoded``
    images in place of the vision tower's inputs."""
    if isinstance(value, (tuple, list)):
        return type(value)(_with_encoded(item, encoded) for item in value)
    if isinstance(value, dict):
        return with_encoded_images(value, encoded)
    return value


def one_example_images(run: ExplainedRun) -> dict[str, Any] | None:
    """The image inputs of an explained forward of one example (a mapping among its
    arguments), or None."""
    if len(run.inputs[0]) != 1:
        return None
    found = [value for value in format_additional_forward_args(run.additional_forward_args) or () if isinstance(value, dict)]
    return found[-1] if found else None


def _shaped_norm(norm: LinearNorm, shares: Tensor) -> Tensor:
    """``norm``'s linear map at its statistics ``(B, ...)`` on ``shares`` ``(B, S, ..., D)``,
    its bias shared by ``absdot``."""
    if norm.centred:
        shares = shares - shares.mean(dim=-1, keepdim=True)
    shares = shares * norm.weight * norm.scale[:, None, ..., None]
    return shares if norm.bias is None else distribute_bias(shares, norm.bias)


@dataclass
class ExplainedRun:
    """The explained forward, to be run again with the share forward's hooks: the model
    (in eval mode), its adapter, Captum's forward function (returning the logits), the
    inputs (token ids, embeddings or pixels) and further arguments, the :class:`Points`
    it recorded, and whether it streamed (the attention then held inside transformers'
    sdpa function, else where the eager attention's softmax computes it)."""

    model: nn.Module
    adapter: AttentionAdapter
    forward_func: Callable[..., Any]
    inputs: tuple[Tensor, ...]
    additional_forward_args: Any
    points: Points
    streaming: bool

    def rerun(self, inputs: Any, additional_forward_args: Any, on_kernel: Callable[..., Tensor], *hooks: Any) -> Any:
        """The model's output on ``inputs``, run without gradients as the explained forward
        ran (streaming: each sdpa call through ``on_kernel``) with
        :func:`_from_first_layer`'s ``hooks`` (``on_call``, then optionally ``on_block``,
        ``on_softmax``, ``before_projection``); the model as it was afterwards."""

        def install(stack: ExitStack) -> None:
            stack.enter_context(torch.no_grad())
            stack.enter_context(self.adapter.prepared(self.model, streaming=self.streaming))
            if self.streaming:
                stack.enter_context(KernelInterception(on_kernel))
            _from_first_layer(self.points.modules, stack, *hooks)

        with ModelChanges(self.model, install):
            return run_forward(self.adapter.keyword_forward(self.forward_func), inputs, None, additional_forward_args)


def bias_modules(modules: ModelModules) -> list[nn.Module]:
    """The modules of the layers (the attention's projections included) and after them
    that hold a bias."""
    inner = (module for block in modules.blocks for module in block.modules())
    found = {id(module): module for module in (*inner, *modules.hooked) if isinstance(getattr(module, "bias", None), Tensor)}
    return list(found.values())


def without_biases(modules: ModelModules) -> bool:
    """Whether no module of the layers (the attention's projections included) and none
    after them holds a bias: then the forward on the shares is one linear map of the
    first layer's input, with no bias to share by ``absdot``, and
    :class:`ShareGradients` gives its shares from one backward."""
    return not bias_modules(modules)


@dataclass
class LinearisedGradient:
    r"""The read logits' gradient through the linear map the forward on the shares
    applies: :math:`J_k = \partial y / \partial x_k` at each token's first-layer state
    :math:`x_k` (``grad``, ``states``: ``(B, N, D)`` float32) and the part of the logits
    the biases add, :math:`\sum_b (\partial y / \partial b)^\top b` (``biases``,
    ``(B,)``). Where the map is the model's linearisation, they add up to the logits,
    :math:`y = \sum_k J_k x_k + \text{biases}`."""

    grad: Tensor
    states: Tensor
    biases: Tensor

    def shares(self) -> Tensor:
        r"""``(B, N)``: :math:`J_k^\top x_k`, each token's share without the biases'."""
        return (self.grad * self.states).sum(dim=-1)

    def sensitivity(self) -> Tensor:
        r"""``(B, N)``: :math:`\lVert J_k \rVert_1`, how much the logit moves per unit of
        each token's state (Captum's local attribution, as ``Saliency`` sums it)."""
        return self.grad.abs().sum(dim=-1)

    def parts(self) -> Tensor:
        """``(B, N + 1)``: the parts of the logits the map gives back, each token's share
        and the biases' part last."""
        return torch.cat([self.shares(), self.biases[:, None]], dim=1)


@dataclass
class FirstLayerInput:
    """The first layer's input of a forward under :class:`ShareGradients`, a leaf
    requiring grad (None where no layer ran), the attention calls it held, and each
    biased module call's zero offset (per example, requiring grad) with its bias."""

    leaf: Tensor | None
    held: int
    offsets: list[tuple[Tensor, Tensor]]

    def gradient(self, model: nn.Module, read_logits: Tensor, calls: int, tokens: int, retain_graph: bool) -> LinearisedGradient | None:
        """``read_logits`` ``(B,)``'s :class:`LinearisedGradient`; None where the logits
        do not reach the first layer's input in the backward (a model that runs part of its
        forward without gradients). A refusal in one line where fewer than the ``calls``
        attention calls were held, or the layers' states are not ``(B, tokens, width)``."""
        _check_held(model, self.held, calls)
        if self.leaf is None or not read_logits.requires_grad:
            return None
        _check_states(model, self.leaf, len(read_logits), tokens)
        offsets = [offset for offset, _ in self.offsets]
        with torch.enable_grad():
            grads = torch.autograd.grad(read_logits.sum(), [self.leaf, *offsets], retain_graph=retain_graph, allow_unused=True)
        if grads[0] is None:
            return None
        batch = len(read_logits)
        biases = torch.zeros(batch, device=read_logits.device, dtype=torch.float32)
        for grad, (_, bias) in zip(grads[1:], self.offsets):
            if grad is not None:
                biases = biases + (grad.float().reshape(batch, -1, grad.shape[-1]) * bias.float()).sum(dim=(1, 2))
        return LinearisedGradient(grads[0].float(), self.leaf.detach().float(), biases)


class ShareGradients(Probe):
    r"""Probe: the explained forward as the linear map the forward on the shares applies
    to every share (result: :class:`FirstLayerInput`).

    Its values are the model's own; its backward is that map's. The attention's queries
    and keys are detached (inside transformers' sdpa function, or the softmax's output
    under eager capture), so its probabilities are held; each norm passes back the
    gradient of the linear map it is at its statistics; each gate of a feed-forward
    passes back none; any other activation passes back its zero-origin slope. That map is
    linear in the first layer's input and the biases together, :math:`y = \sum_k J_k x_k +
    \sum_b (\partial y / \partial b)^\top b`, and one backward gives every
    :math:`J_k` (without biases, token k's share of a read logit is :math:`J_k^\top x_k`,
    what :func:`share_outputs` carries for its row). Each biased module's output gets a
    zero offset per example, so that the same backward gives the biases' part and the
    sum can be checked against the logit.

    Whether an activation gates (:meth:`Points.gated`: no linear map of its layer takes
    its output) is known only once the layer has run; its backward asks then.

    Args:
        modules (ModelModules, optional): :func:`model_modules` of the model it will run
            in, where the caller has them; found when it enters otherwise. Default: None.
    """

    events = frozenset({"kernel", "softmax"})
    needs_grad = True

    def __init__(self, modules: ModelModules | None = None) -> None:
        self._modules = modules
        self._leaf: Tensor | None = None
        self._held: set[int] = set()
        self._offsets: list[tuple[Tensor, Tensor]] = []
        self._open_gates: list[tuple[_Gate, Tensor]] = []  # the current layer's activations still taken as gates
        self._thread = current_thread()

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        modules = self._modules or model_modules(model, adapter)
        self._kinds, self._leaf, self._held, self._offsets, self._open_gates = modules.kinds, None, set(), [], []
        self._thread = current_thread()
        stack.callback(self._open_gates.clear)
        _from_first_layer(modules, stack, self._on_call, self._on_block)
        for module in bias_modules(modules):  # after the hooks above, so that a norm's offset follows its linear map
            stack.callback(module.register_forward_hook(self._with_offset).remove)

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor | None:
        if call is None:  # a vision tower's attention, before the layers
            return None
        self._held.add(call.index)
        return run_kernel(lambda query, key, value: (query.detach(), key.detach(), value))

    def on_softmax(self, call: CallInfo, attn_probs: Tensor, first_head: int, attn_scores: Tensor | None) -> Tensor | None:
        self._held.add(call.index)
        return attn_probs.detach()

    def result(self) -> FirstLayerInput:
        return FirstLayerInput(self._leaf, len(self._held), self._offsets)

    def _with_offset(self, module: nn.Module, args: tuple, output: Any) -> Tensor | None:
        """A biased module's output from the first layer on, plus a zero offset per
        example requiring grad (kept with the bias, whose part of the logit its gradient
        gives)."""
        bias = getattr(module, "bias")
        assert isinstance(bias, Tensor)  # bias_modules chose it for one
        if current_thread() != self._thread or self._leaf is None or not isinstance(output, Tensor):
            return None
        if output.dim() < 2 or not output.is_floating_point() or output.shape[-1] != bias.numel() or output.shape[0] % len(self._leaf):
            return None  # no bias added to the output, or no rows per example: the check of the sum refuses
        shape = (output.shape[0], *[1] * (output.dim() - 2), output.shape[-1])
        offset = torch.zeros(shape, device=output.device, dtype=output.dtype, requires_grad=True)
        self._offsets.append((offset, bias.detach()))
        return output + offset

    def _on_block(self, index: int, args: tuple, kwargs: dict) -> Any:
        self._open_gates.clear()
        if index > 0:
            return None
        states, called_with = _hidden_argument(args, kwargs)
        self._leaf = states.detach().requires_grad_()
        return called_with(self._leaf)

    def _on_call(self, key: int, module: nn.Module | None, computed_from: Tensor, output: Tensor, layer: int | None) -> Tensor | None:
        kind = "activation" if module is None else self._kinds[key]
        if kind in ("linear", "projection"):
            self._ungate(computed_from)
            return None
        if kind == "norm":  # over (B, M, F) as the share forward reads it (a norm inside the attention: M = N·H)
            assert module is not None
            if output.shape != computed_from.shape:
                raise UnsupportedModelError(
                    f"DecompX reads {type(module).__name__} as a norm, but it returns {tuple(output.shape)} from "
                    f"{tuple(computed_from.shape)}: no linear map of its input at its statistics."
                )
            batch, width = computed_from.shape[0], computed_from.shape[-1]
            norm = linear_norm(module, computed_from.reshape(batch, -1, width), output.reshape(batch, -1, width))
            return linearised(computed_from, output, lambda x, y: lambda z: norm.linear(z.reshape(batch, -1, width)).reshape(z.shape))
        gate = _Gate(layer is not None)  # outside the layers (a head's tanh, a logit cap) never a gate
        if gate.gated:
            self._open_gates.append((gate, output))
        return linearised(computed_from, output, lambda x, y: None if gate.gated else _times(zero_origin_slope(x.float(), y.float())))

    def _ungate(self, linear_input: Tensor) -> None:
        """A linear map of the layer took ``linear_input``: an activation whose output it
        is does not gate."""
        for gate, output in self._open_gates:
            if takes_output(linear_input, output):
                gate.gated = False
        self._open_gates[:] = [(gate, output) for gate, output in self._open_gates if gate.gated]


@dataclass
class _Gate:
    """Whether an activation's call is taken as a gate (:meth:`Points.gated`)."""

    gated: bool


def _times(slope: Tensor) -> Callable[[Tensor], Tensor]:
    """The element-wise linear map ``z -> z * slope``."""
    return lambda z: z * slope


def share_outputs(run: ExplainedRun, probs: list[Tensor], encoded: dict[str, Any] | None = None) -> Tensor:
    """``(B, 1 + N, ...)``: the model's output on a zero input (index 0) and on each of the
    ``N`` input tokens' shares, from one forward of ``B·(1 + N)`` rows.

    Args:
        run: the explained forward.
        probs: per attention call, ``(B, H, N, N)`` float32 probabilities (``N`` tokens:
            a Vision Transformer's patches and class token), held where it computed them.
        encoded: one example's images encoded once
            (:func:`~captum_attention.capture.adapters.images.encoded_images`), given to
            its copies in place of the vision tower's inputs; None: the copies carry them.
    """
    model, inputs, points = run.model, run.inputs, run.points
    batch, tokens = probs[0].shape[0], probs[0].shape[-1]
    shares = 1 + tokens
    rows = torch.arange(batch, device=inputs[0].device).repeat_interleave(shares)
    cursor, kinds = _Cursor(points), points.modules.kinds
    layer_input: list[Tensor] = []

    def by_share(tensor: Tensor) -> Tensor:
        """``(B, 1 + N, M, F)``: a tensor of the share rows, whatever dimensions (or
        flattening, OPT's) lie between its rows and its features."""
        return tensor.reshape(batch, shares, -1, tensor.shape[-1])

    def by_example(tensor: Tensor) -> Tensor:
        """``(B, M, F)``: the explained forward's tensor, as :func:`by_share` lays out one row."""
        return tensor.reshape(batch, -1, tensor.shape[-1])

    def on_block(index: int, args: tuple, kwargs: dict) -> Any:
        states, called_with = _hidden_argument(args, kwargs)
        _check_states(model, states, batch * shares, tokens)
        if index > 0:
            layer_input[:] = [by_share(states)]
            return None
        own = torch.eye(tokens, device=states.device, dtype=states.dtype)
        own = torch.cat([torch.zeros_like(own[:1]), own])[None, :, :, None]  # share k holds token k's state alone
        first = by_share(states) * own
        layer_input[:] = [first]
        return called_with(first.reshape(states.shape))

    def on_call(key: int, module: nn.Module | None, computed_from: Tensor, output: Tensor, layer: int | None) -> Tensor | None:
        kind = "activation" if module is None else kinds[key]
        call, seen_input, seen_output = cursor.next(key, module)
        assert seen_output is not None or kind in ("linear", "projection")
        if kind == "norm":
            assert module is not None and seen_output is not None
            norm = linear_norm(module, by_example(seen_input), by_example(seen_output))
            shaped = _shaped_norm(norm, by_share(computed_from).float())
        elif kind == "activation" and points.gated(key, call):
            assert seen_output is not None
            shaped = by_example(seen_output).float()[:, None].expand(batch, shares, -1, -1)
        elif kind == "activation":
            assert seen_output is not None
            slope = zero_origin_slope(by_example(seen_input).float(), by_example(seen_output).float())
            shaped = by_share(computed_from).float() * slope[:, None]
        else:
            bias = getattr(module, "bias", None)
            bias = bias.detach().float() if isinstance(bias, Tensor) else None
            computed = by_share(output).float()
            if kind == "linear":
                if bias is None:
                    return None
                shaped = distribute_bias(computed - bias, bias)
            else:  # the output projection: the zero input's row is the values' and the projection's bias
                joined = computed[:, :1]
                attended = computed[:, 1:] - (bias if bias is not None else 0.0)
                shared = distribute_bias(attended, joined, by=attended + layer_input[0][:, 1:].float())
                shaped = torch.cat([torch.zeros_like(joined), shared], dim=1)
        return shaped.reshape(output.shape).to(output.dtype)

    sites = {id(site) for site in points.modules.sites}
    held: set[int] = set()

    def held_probs(index: int, shape: torch.Size) -> Tensor:
        if index >= len(probs) or tuple(shape) != (batch * shares, *probs[index].shape[1:]):
            raise UnsupportedModelError("DecompX expects one self-attention call over the tokens per layer.")
        held.add(index)
        return probs[index]

    def on_kernel(module: nn.Module, call: Any, run_kernel: Any) -> Tensor:
        if id(module) not in sites:  # a vision tower's attention, before the layers
            return run_kernel()
        mixing = held_probs(len(held), torch.Size((call.query.shape[0], call.query.shape[1], call.query.shape[2], call.value.shape[2])))
        values = call.value.float().reshape(batch, shares, *call.value.shape[1:])
        mixed = held_attention(mixing.to(values.device), values, call.groups)
        return mixed.reshape(batch * shares, *mixed.shape[2:]).to(call.value.dtype)

    def on_softmax(index: int, computed: Tensor) -> Tensor:
        mixing = held_probs(index, computed.shape)
        return mixing.to(computed)[:, None].expand(batch, shares, *mixing.shape[1:]).reshape(computed.shape)

    def before_projection(index: int, args: tuple) -> Any:
        if index not in held or not args or not isinstance(args[0], Tensor):
            return None
        mixing = probs[index]
        heads = mixing.shape[1]
        outputs = by_share(args[0]).float()
        outputs = outputs.reshape(*outputs.shape[:3], heads, -1)
        fixed = unbiased_outputs(outputs, mixing.to(outputs.device), first_layer=index == 0)
        return (fixed.reshape(args[0].shape).to(args[0].dtype), *args[1:])

    repeated = take_rows(inputs, rows, batch, min_dim=2)
    if batch == 1:  # its copies: every row, flattened patch and image grid of the one example repeated
        args = run.additional_forward_args
        if encoded is not None:
            args = _with_encoded(args, encoded_copies(model, inputs[0], encoded, shares))
        extra = _one_example_copies(args, shares)
    else:
        _check_rows((inputs, run.additional_forward_args), batch, model)
        extra = take_rows(run.additional_forward_args, rows, batch, min_dim=2)
    try:
        output = run.rerun(repeated, extra, on_kernel, on_call, on_block, on_softmax, before_projection)
    except RuntimeError as error:
        if not any(isinstance(arg, dict) for arg in format_additional_forward_args(run.additional_forward_args) or ()):
            raise
        reason = error_line(error)
        raise UnsupportedModelError(
            f"DecompX runs N + 1 copies of each example, but {type(model).__name__} fails on copies of its image inputs "
            f"(it lays a batch's images out otherwise): {reason}"
        ) from None
    cursor.check_done()
    _check_held(model, len(held), len(probs))
    logits = output_logits(output, batch * shares).detach().float()
    return logits.reshape(batch, shares, *logits.shape[1:])


def _check_states(model: nn.Module, states: Tensor, rows: int, tokens: int) -> None:
    """Refuse in one line where a layer's hidden states are not ``(rows, tokens, width)``."""
    if states.dim() != 3 or states.shape[:2] != (rows, tokens):
        raise UnsupportedModelError(
            f"DecompX reads a layer's hidden states as (batch, tokens, width); {type(model).__name__}'s layers take "
            f"{tuple(states.shape[1:])} per example (several residual streams?)."
        )


def _check_held(model: nn.Module, held: int, calls: int) -> None:
    """Refuse in one line where fewer than all ``calls`` attention calls were held."""
    if held != calls:
        raise UnsupportedModelError(
            f"DecompX holds the attention at its probabilities where transformers' sdpa function or the attention's "
            f"softmax computes them; {type(model).__name__}'s attention did neither in {calls - held} of its {calls} calls."
        )
