"""AttnLRP's rules applied to a model for one call, and nowhere else.

:class:`RelevanceRules` is a probe (:mod:`captum_attention.capture.probes`): a capture
enters it in its ``ExitStack``, so that it is removed with the capture's other hooks, also
on an exception or an interrupt. While active:

- under a streaming capture each attention kernel call (transformers' attention
  interface) runs on its queries and keys passing back half their gradient, and its
  output passes back half of its own: the uniform rule on ``Q·Kᵀ`` and on ``A·V``; the
  softmax between them keeps its ordinary gradient, which is Proposition 3.1 in gradient
  form (see :mod:`captum_attention.maps.lrp`). Under an eager capture the same rule
  reaches the explicit products (below);
- forward hooks on the model's element-wise activation modules (the adapter's
  ``relevance_sites``) give their outputs the identity rule;
- a ``TorchFunctionMode`` (this thread only) gives linear layers (``F.linear``, and
  GPT-2's ``Conv1D`` through ``torch.addmm``) their rule (ε or γ), ``F.layer_norm``/``F.rms_norm`` their
  normalisation rule, holds ``rsqrt`` constant inside the model's hand-written norm
  modules (``LlamaRMSNorm``, ``T5LayerNorm``, …), and gives a product of two activations
  (a gated MLP; an eager attention's ``Q·Kᵀ`` and ``A·V``) the uniform rule;
- forward hooks on the adapter's input-embedding modules record their outputs (detached
  and requiring grad, so that the relevance is read there whatever the parameters'
  ``requires_grad``; no gradient reaches a parameter). A vision-language model's language
  model's merged embeddings (and the image features Mllama's cross-attends to, or those
  a deepstack adds between its layers) are recorded so too, where its relevance stops; so
  are a model's embeddings with an image's features scattered in where no language model
  module reads them (Chameleon's), and features written over the embeddings (Kosmos-2's);
  or, carried through the vision tower, the image inputs' ``pixel_values``
  (:func:`with_pixel_leaf`).

Nothing global is patched; other threads run the model's functions unchanged (the mode
is thread-local, and the hooks act only in the capturing thread).
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import UnsupportedModelError
from ..maps.kernel import KernelCall
from .adapters import AttentionAdapter
from .adapters.images import leading_image_features
from .guard import ScopedFunctionMode, current_thread
from .probes import CallInfo, Probe, RunKernel


class PropagationRules(Protocol):
    """The rules as functions (:mod:`captum_attention.maps.lrp` is one): each returns its
    operation's forward value with the rule's backward."""

    def share_gradient(self, x: Tensor, share: float) -> Tensor: ...

    def identity_rule(self, x: Tensor, y: Tensor) -> Tensor: ...

    def held_constant(self, x: Tensor) -> Tensor: ...

    def layer_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
        bias: Tensor | None = None, eps: float = 1e-5,
    ) -> Tensor: ...

    def rms_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None
    ) -> Tensor: ...

    @property
    def gamma(self) -> float:
        """0: linear layers keep their ordinary gradient (the ε-rule, ε → 0); above: the
        γ-rule of :meth:`linear`."""
        ...

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...


_PRODUCTS = {
    torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__,
    torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, Tensor.bmm,
}
"""Products that take the uniform rule when both factors are activations: element-wise
(gated MLPs) and matrix products (an eager attention's ``Q·Kᵀ`` and ``A·V``). A factor of
one element is a gate computed from parameters (Mllama's ``tanh(gate)``), a constant."""


def _is_activation_tensor(value: Any) -> bool:
    """A tensor computed from the inputs: it requires grad and is not a leaf (parameters
    are leaves)."""
    return isinstance(value, Tensor) and value.requires_grad and value.grad_fn is not None and value.is_floating_point()


def _token_mask(index: Any, embeddings: Tensor) -> bool:
    """Whether ``index`` is a ``(B, T)`` bool mask of the ``(B, T, d)`` embeddings' tokens."""
    return isinstance(index, Tensor) and index.dtype == torch.bool and tuple(index.shape) == tuple(embeddings.shape[:2])


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in a function's arguments or result (nested in tuples, lists and dicts)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)


@dataclass
class Injected:
    """Image features a language model adds to its hidden states at the image's tokens
    between its layers (Qwen3-VL's deepstack), detached and requiring grad: ``features``
    ``(n, d)``, one row per ``True`` of ``positions`` ``(B, T)`` in row-major order, added
    to the tokens of the embeddings ``into`` (an index of :attr:`Embeddings.tensors`)."""

    features: Tensor
    positions: Tensor
    into: int


@dataclass
class Embeddings:
    """The input embeddings ``(B, T, d)`` a forward under the rules produced (an
    encoder-decoder's source, then target), detached and requiring grad: where relevance
    is read; and the image features injected deeper, whose relevance their tokens hold."""

    tensors: list[Tensor]
    injected: list[Injected] = field(default_factory=list)

    def after(self, leading: list[Tensor]) -> Embeddings:
        """These embeddings after ``leading`` others (the inputs given as embeddings)."""
        shifted = [Injected(i.features, i.positions, i.into + len(leading)) for i in self.injected]
        return Embeddings(leading + self.tensors, shifted)


INJECTED_FEATURES = (("deepstack_visual_embeds", "visual_pos_masks"), ("deepstack_features", "vision_mask"))
"""The keyword arguments of a language model that add image features to its hidden states
deeper than its embeddings, each with the mask of the tokens they are added to (Qwen3-VL's
and its kin's deepstack, a list per layer; Granite 4 Vision's, a dict by layer)."""

CROSS_ATTENDED_STATES = ("cross_attention_states", "encoder_hidden_states")
"""The keywords in which a vision-language model's language model is given the image
states it cross-attends to (Mllama's, BLIP's)."""


@dataclass
class PixelInputs:
    r"""The ``pixel_values`` a forward under the rules read, detached and requiring grad
    (``leaf``), and the reference image ``baseline`` their relevance is taken against:
    :math:`(x - \bar x) \odot \tilde g_x`."""

    leaf: Tensor
    baseline: float | Tensor

    def relevance(self, grad: Tensor) -> Tensor:
        """Float32 relevance per pixel value, shaped as ``pixel_values``."""
        return (self.leaf.detach().float() - torch.as_tensor(self.baseline, device=self.leaf.device).float()) * grad.float()


def with_pixel_leaf(additional_forward_args: tuple[Any, ...] | None, baseline: float | Tensor) -> tuple[tuple[Any, ...], PixelInputs]:
    """``additional_forward_args`` with the ``pixel_values`` of its mapping of image
    inputs replaced by a leaf requiring grad, and that leaf; a clear error where there is
    no such mapping."""
    args = tuple(additional_forward_args or ())
    found = [i for i, arg in enumerate(args) if isinstance(arg, Mapping) and isinstance(arg.get("pixel_values"), Tensor)]
    if not found or not args[found[0]]["pixel_values"].is_floating_point():
        raise ValueError(
            "through_vision_tower propagates relevance to the image's pixel_values: pass the image inputs as a mapping in "
            "additional_forward_args, e.g. (attention_mask, {\"pixel_values\": pixels}) or the processor's output."
        )
    images = args[found[0]]
    pixels = PixelInputs(images["pixel_values"].detach().requires_grad_(), baseline)
    replaced = {**images, "pixel_values": pixels.leaf}
    return args[: found[0]] + (replaced,) + args[found[0] + 1 :], pixels


class RelevanceRules(Probe):
    """Probe: AttnLRP's rules on the model for the calls made while it is active.

    The input embeddings are the outputs of the adapter's ``input_embeddings`` modules,
    recorded in call order (:class:`Embeddings`, the probe's result); or, where the
    adapter names a ``merged_embeddings`` module and it is called with ``inputs_embeds``
    (a vision-language model's language model), those: an encoder-decoder's (Florence-2's
    encoder) in place of its source's, its target's recorded after them.

    Args:
        rules (PropagationRules): the rules' functions (the attributions pass
            :mod:`captum_attention.maps.lrp`).
        through_vision_tower (bool, optional): leave the merged embeddings in the graph,
            so that relevance reaches the vision tower's inputs (the image tokens' own
            embeddings then receive none). Default: False.
    """

    events = frozenset({"kernel"})
    needs_grad = True

    def __init__(self, rules: PropagationRules, through_vision_tower: bool = False) -> None:
        self.rules = rules
        self.through_vision_tower = through_vision_tower
        self.embeddings: list[Tensor] = []
        self.merged: list[Tensor] = []
        self.sources: list[Tensor] = []
        self.leading: list[Tensor] = []  # the image features a model puts before its tokens (GIT's)
        self.injected: list[Injected] = []
        self.targets_from = 0  # an encoder-decoder's: the first embeddings recorded after the merged ones
        self.encoder_decoder = False
        self.names_merged = False  # whether the adapter names a module that reads the merged embeddings
        self._passed_on: list[tuple[weakref.ref[Tensor], int]] = []  # the embeddings the model received, by index
        self.depth = 0  # how many activation or norm modules the forward is inside
        self._activations: set[nn.Module] = set()
        self._held: dict[int, weakref.ref[Tensor]] = {}  # by id, each checked against its tensor
        self._thread = current_thread()

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        if not getattr(adapter, "propagates_relevance", False):
            raise UnsupportedModelError(
                f"AttnLRP's rules cover transformers' attention (the Hugging Face families, "
                f"HuggingFaceAdapter); {type(adapter).__name__} models are not supported."
            )
        self._thread = current_thread()
        self.embeddings, self.merged, self.sources, self.leading, self.depth, self.targets_from = [], [], [], [], 0, 0
        self.injected = []
        self.encoder_decoder = adapter.is_encoder_decoder(model)
        self._held = {}
        sites = adapter.relevance_sites(model)
        self._activations = set(sites.activations)
        for module in dict.fromkeys([*sites.activations, *sites.norms]):
            stack.callback(module.register_forward_pre_hook(self._enter_module).remove)
            stack.callback(module.register_forward_hook(self._leave_module).remove)
        merged = None if self.through_vision_tower else adapter.merged_embeddings(model)
        if merged is not None:
            stack.callback(merged.register_forward_pre_hook(self._record_merged_embeddings, with_kwargs=True).remove)
        self.names_merged, self._passed_on = merged is not None, []
        leading = None if self.through_vision_tower else leading_image_features(model)
        if leading is not None:
            stack.callback(leading.register_forward_hook(self._record_leading).remove)
        for module in adapter.input_embeddings(model):
            stack.callback(module.register_forward_hook(self._record_embeddings).remove)
        stack.enter_context(_RuleMode(self))

    def result(self) -> Embeddings:
        """The merged embeddings where the adapter names a module that read them (a
        vision-language model's language model; an encoder-decoder's encoder, its target's
        embeddings after them), else the input embeddings; after the image features a
        language model cross-attends to (Mllama's), as an encoder-decoder's source comes
        before its target."""
        injected = [Injected(i.features, i.positions, len(self.sources) + i.into) for i in self.injected]
        if not self.merged:
            return Embeddings(self.sources + self.leading + self.embeddings, injected)
        targets = self.embeddings[self.targets_from :] if self.encoder_decoder else []
        return Embeddings(self.sources + self.merged + targets, injected)

    def is_activation(self, value: Any) -> bool:
        """Whether a rule treats ``value`` as an activation (:func:`_is_activation_tensor`):
        not where it is a held constant, or computed from held constants only. Rules with a
        :class:`~captum_attention.maps.lrp.RuleSwitch` keep a held constant's graph (its
        ordinary gradient passes once the switch is off), so that it still requires grad;
        without one it is detached, and a norm module that returns its scale alone
        (HY-V4's) multiplies an activation by a constant: with a switch, by a constant all
        the same, not as a product of two activations sharing the relevance."""
        return _is_activation_tensor(value) and not self._is_held(value)

    def _is_held(self, tensor: Tensor) -> bool:
        held = self._held.get(id(tensor))
        return held is not None and held() is tensor

    def hold(self, constant: Tensor) -> Tensor:
        """A held constant (the rules' ``held_constant``), remembered where it keeps its graph."""
        if constant.requires_grad:
            self._held[id(constant)] = weakref.ref(constant)
        return constant

    def carry(self, result: Any, args: tuple, kwargs: dict) -> Any:
        """``result``, its tensors held where every argument requiring grad is held or a
        parameter: as detaching would have made them constants. A tensor computed from
        the weights alone (PEFT's IA3 scale, ``ia3_l.flatten()``) is no activation, and an
        activation times it is a linear map, not a product of two activations."""
        from_constants = False
        for tensor in _tensors((args, kwargs)):
            if tensor.requires_grad:
                if not (isinstance(tensor, nn.Parameter) or self._is_held(tensor)):
                    return result
                from_constants = True
        if from_constants:
            for tensor in _tensors(result):
                self.hold(tensor)
        return result

    def on_kernel(self, call: CallInfo | None, kernel: KernelCall, run_kernel: RunKernel) -> Tensor:
        return self.attention(run_kernel)

    def attention(self, run_kernel: Callable[..., Tensor]) -> Tensor:
        """One attention kernel call under the uniform rule on ``Q·Kᵀ`` and ``A·V``."""
        share = self.rules.share_gradient
        output = run_kernel(lambda query, key, value: (share(query, 0.5), share(key, 0.5), value), rows_backward=True)
        return share(output, 0.5)

    def _ours(self) -> bool:
        """Whether the forward running is the capturing thread's (the hooks are on the
        model; another thread's forward goes through them untouched)."""
        return current_thread() == self._thread

    def _enter_module(self, module: nn.Module, args: tuple) -> None:
        if self._ours():
            self.depth += 1

    def _leave_module(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._ours():
            return None
        self.depth -= 1
        if module in self._activations and args and self.is_activation(args[0]) and isinstance(output, Tensor):
            return self.rules.identity_rule(args[0], output)
        return None

    def _record_embeddings(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """The module's output, its embeddings (the first item of a tuple, as BEiT's patch
        embeddings return them with their grid) detached and recorded."""
        first = output[0] if isinstance(output, tuple) and output else output
        if not isinstance(first, Tensor) or not first.is_floating_point() or not self._ours():
            return None
        passed_on = self._recorded(first, self.embeddings)
        self._passed_on.append((weakref.ref(passed_on), len(self.embeddings) - 1))
        return passed_on if first is output else (passed_on, *output[1:])

    def _record_leading(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """The image features the model puts before its tokens (GIT's visual projection's
        output), detached and recorded."""
        if not isinstance(output, Tensor) or not self._ours():
            return None
        return self._recorded(output, self.leading)

    def merge(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """``(True, result)`` where ``func`` merges an image's features into the embeddings
        the model received and is run here so that the features' relevance is kept; else
        ``(False, None)``:

        - ``inputs_embeds.masked_scatter(image_mask, features)`` inside a model that names
          no language model reading the merged embeddings (Chameleon's, Emu3's, Fuyu's): they
          are recorded where relevance stops, as a language model's ``inputs_embeds`` are;
        - ``inputs_embeds[image_mask] = features`` (Kosmos-2's, in place; Kosmos-2.5's on a
          copy, whose copies are followed): the features are recorded as
          :class:`Injected` at the mask's tokens.
        """
        into = self._embeddings_index(args[0]) if not self.through_vision_tower and args and self._ours() else None
        if into is None:
            return False, None
        if func is Tensor.masked_scatter and not self.names_merged:
            return True, self._recorded(func(*args, **kwargs), self.merged)
        if func is Tensor.clone:
            copy = func(*args, **kwargs)
            self._passed_on.append((weakref.ref(copy), into))
            return True, copy
        if func is Tensor.__setitem__ and len(args) == 3 and _token_mask(args[1], args[0]) and isinstance(args[2], Tensor):
            leaf = args[2].detach().requires_grad_()
            self.injected.append(Injected(leaf, args[1].detach(), into))
            return True, func(args[0], args[1], leaf.clone())
        return False, None

    def _embeddings_index(self, tensor: Any) -> int | None:
        """Which recorded embeddings ``tensor`` is as the model received them, or None."""
        return next((index for passed, index in self._passed_on if passed() is tensor), None)

    def _record_merged_embeddings(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The ``inputs_embeds`` the module is called with, and the image features it
        cross-attends to (Mllama's ``cross_attention_states``, BLIP's
        ``encoder_hidden_states``), detached and recorded."""
        if not self._ours():
            return None
        recorded = {}
        if isinstance(embeddings := kwargs.get("inputs_embeds"), Tensor):
            recorded["inputs_embeds"] = self._recorded(embeddings, self.merged)
            self.targets_from = len(self.embeddings)
            for name, mask_name in INJECTED_FEATURES:
                features, mask = kwargs.get(name), kwargs.get(mask_name)
                if features and isinstance(mask, Tensor):
                    recorded[name] = self._recorded_injections(features, mask if mask.dim() == 2 else mask.any(dim=-1))
        tokens = next((value for value in (kwargs.get("input_ids"), embeddings) if isinstance(value, Tensor)), None)
        for name in CROSS_ATTENDED_STATES:
            if isinstance(features := kwargs.get(name), Tensor) and tokens is not None:
                # Mllama passes them per tile, (B·images·tiles, states, d); its attention reads (B, S, d)
                recorded[name] = self._recorded(features, self.sources, batch=tokens.shape[0])
        return (args, {**kwargs, **recorded}) if recorded else None

    def _recorded_injections(self, features: Any, positions: Tensor) -> Any:
        """Each of ``features`` (a list, or a dict by layer) detached, requiring grad and kept
        as :class:`Injected` at ``positions``; what the language model reads in their place."""
        def recorded(tensor: Tensor) -> Tensor:
            leaf = tensor.detach().requires_grad_()
            self.injected.append(Injected(leaf, positions.detach(), 0))
            return leaf.clone()

        if isinstance(features, Mapping):
            return {key: recorded(value) for key, value in features.items()}
        return [recorded(value) for value in features]

    @staticmethod
    def _recorded(embeddings: Tensor, into: list[Tensor], batch: int | None = None) -> Tensor:
        """``embeddings`` detached, requiring grad (``(batch, -1, d)`` where ``batch`` is
        given) and kept ``into``; what the model reads in their place."""
        leaf = embeddings.detach()
        leaf = (leaf if batch is None else leaf.reshape(batch, -1, leaf.shape[-1])).requires_grad_()
        into.append(leaf)
        return leaf.view(embeddings.shape).clone()  # not the leaf itself: some models scale it in place (CTRL, GIT)


class _RuleMode(ScopedFunctionMode):
    """The function-level rules of :class:`RelevanceRules` (see the module docstring)."""

    def __init__(self, relevance: RelevanceRules) -> None:
        super().__init__()
        self.relevance = relevance

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rules, activation = self.relevance.rules, self.relevance.is_activation
        merged, result = self.relevance.merge(func, args, kwargs)
        if merged:
            return result
        if func is F.layer_norm and activation(args[0]):
            return rules.layer_norm_rule(*args, **kwargs)
        if func is F.rms_norm and activation(args[0]):
            return rules.rms_norm_rule(*args, **kwargs)
        if self.relevance.depth > 0:
            result = func(*args, **kwargs)
            if func in (torch.rsqrt, Tensor.rsqrt):
                return self.relevance.hold(rules.held_constant(result))
            return self.relevance.carry(result, args, kwargs)
        if func in _PRODUCTS and len(args) == 2 and all(activation(a) and a.numel() > 1 for a in args):
            return func(rules.share_gradient(args[0], 0.5), rules.share_gradient(args[1], 0.5))
        if rules.gamma and func is F.linear and activation(args[0]):
            return rules.linear(*args, **kwargs)
        if rules.gamma and func is torch.addmm and not kwargs and len(args) == 3 and activation(args[1]):
            bias, x, weight = args  # GPT-2's Conv1D: x·W + b, a linear layer with W transposed
            return rules.linear(x, weight.t(), bias)
        return self.relevance.carry(func(*args, **kwargs), args, kwargs)
