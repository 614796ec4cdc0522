"""The adapter protocol: everything the capture layer asks about one model family.

An adapter answers the family questions for the capture layer, and nothing else does:

1. which modules compute post-softmax attention, with each one's role and causality
   (``attention_sites``);
2. how to read the probability tensor ``(batch, heads, queries, keys)`` from one call of
   such a module (``read_probs``, or the softmaxes inside it: ``probs_source``), and how
   to view it as heads (``as_heads``);
3. which modules receive the padding mask, and how to read it from their call
   (``mask_modules``, ``padding_mask`` and ``decoder_padding_mask``);
4. what must be switched for one call so that the probabilities exist at all (eager
   capture) or so that the attention runs through the kernel the streaming capture
   records (``prepared(model, streaming)``, a context manager that restores the model);
5. how to call the model's forward with Captum's positional arguments
   (``keyword_forward``), whether it is an encoder-decoder (``is_encoder_decoder``) and,
   for image models, the patch grid of an input (``patch_grid``), and which rows the
   output reads where it reads several (``readout_rows``);
6. which weight maps an attention module's concatenated head outputs back to the
   hidden size (``output_projection``, for effective attention), and where the input
   embeddings are (``input_embeddings``, for relevance propagation).

Supporting a new model family means writing one adapter; the attribution methods and
metrics never change. Adapters keep no state between calls.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..._compat import UnsupportedModelError

Role = Literal["self", "encoder", "decoder", "cross", "pooling"]
ProbsSource = Literal["output", "softmax"]


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module of a model, as its adapter describes it for one capture.

    Attributes:
        module: the module whose calls compute the attention.
        role: ``"self"``, or ``"encoder"``/``"decoder"``/``"cross"`` in an encoder-decoder;
            ``"pooling"`` for attention whose queries are not tokens (a learned query, an
            RNN's additive attention) and whose keys are the tokens: the model's readout.
        causal: whether its queries never see later keys (a decoder's self-attention);
            None when the adapter cannot tell (then the captured probabilities decide:
            exact zeros on every later key).
        output_index: where the probabilities are in a tuple output (adapters that read
            the output use it).
    """

    module: nn.Module
    role: Role = "self"
    causal: bool | None = None
    output_index: int = 1


@dataclass(frozen=True, eq=False)
class RelevanceSites:
    """The modules AttnLRP's rules act on besides attention (one model family's knowledge).

    Attributes:
        activations: element-wise non-linearities (the identity rule).
        norms: normalisation layers (their scale, ``rsqrt`` inside, held constant).
    """

    activations: list[nn.Module]
    norms: list[nn.Module]


@runtime_checkable
class AttentionAdapter(Protocol):
    """The protocol the capture layer uses to find and read attention in a model.

    Implement it (most simply by subclassing :class:`AdapterBase`, which supplies the
    defaults) to support a model family whose attention the built-in adapters do not
    find. :class:`~captum_attention.capture.ModuleAdapter` covers the common case of a
    user naming their attention modules.

    Attributes:
        probs_source: ``"output"`` when ``read_probs`` reads the probabilities from each
            call's output; ``"softmax"`` when they are the outputs of the softmaxes
            computed inside each call (several softmaxes in one call are stacked as heads).
        streams: whether the family's attention runs through transformers' ``sdpa``
            attention function (or, with ``probs_source`` ``"softmax"``, through
            ``F.scaled_dot_product_attention`` inside each call), so that a streaming
            capture can record it.
        propagates_relevance: whether AttnLRP's propagation rules are checked on the
            family's attention (its kernel's inputs and output, or its explicit products)
            and ``input_embeddings`` names where relevance is read.
    """

    probs_source: ProbsSource
    streams: bool
    propagates_relevance: bool

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        """The attention modules with their role and causality, in forward order."""
        ...

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        """The probabilities from one call's output: the very tensor that weighted the
        values (any shape ``as_heads`` understands), or None where the output holds none.
        Not used when ``probs_source`` is ``"softmax"``."""
        ...

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        """A ``(batch, heads, queries, keys)`` view of one captured probability tensor."""
        ...

    def gradient_as_heads(self, module: nn.Module, grads: Tensor) -> Tensor:
        """The same of a gradient of one (where the probabilities are placed on other
        tokens, the gradient can take another share of them)."""
        ...

    def is_encoder_decoder(self, model: nn.Module) -> bool:
        """Whether ``model`` takes a source and a target sequence (inputs are a pair)."""
        ...

    def keyword_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        """``forward_func`` callable with Captum's positional ``(inputs..., *extra)``."""
        ...

    def patch_grid(self, model: nn.Module, images: Tensor) -> tuple[int, int] | None:
        """``(rows, columns)`` of patch tokens for ``(B, C, H, W)`` images; None if the
        model has no patch grid."""
        ...

    def image_tower_apart(self, model: nn.Module) -> str | None:
        """Where ``model`` reads token ids and its images through a tower whose attention
        is not among its sites (a dual encoder's image tower beside its text tower, CLIP's;
        a vision-language model's vision tower), that tower's name in ``model``; None
        where images, if it reads any, are explained through its sites."""
        ...

    def readout_rows(self, model: nn.Module, real: Tensor) -> Tensor | None:
        """Where the model's output reads several of its tokens' states rather than one
        (the mean of its tokens, two heads' average), the ``(batch, seq_len)`` weights of
        those rows, each example's summing to 1: the default explained row is then their
        weighted sum. ``real`` holds the real tokens (``(batch, seq_len)`` bool). None
        where the output reads one token."""
        ...

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose first call receives the ``(batch, seq_len)`` padding mask."""
        ...

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The padding mask (1 = real token) passed to one of ``mask_modules``, if any."""
        ...

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """Encoder-decoders: the target-side padding mask passed to ``module``, if any."""
        ...

    def cross_attended_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """A decoder that cross-attends to states of no encoder of its own (Mllama's image
        features): ``(batch, states)``, 1 for the real ones, read from the arguments of
        one of ``mask_modules``; None for other models."""
        ...

    def prepared(self, model: nn.Module, streaming: bool) -> AbstractContextManager[None]:
        """Context in which ``model`` exposes attention probabilities (``streaming=False``)
        or runs its attention through the ``sdpa`` attention function the streaming
        capture records (``streaming=True``); restores the model on exit."""
        ...

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        """The ``(hidden, heads * head_dim)`` weight that maps the module's concatenated
        head outputs to the hidden size (each head's slice of it is the H of Brunner et
        al.), or None where the adapter does not know it."""
        ...

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        """The modules whose outputs are the input embeddings of the explained tokens (an
        encoder-decoder's source embedding first, then its target embedding; a vision
        transformer's patch embedding), where relevance is read; empty where unknown."""
        ...

    def merged_embeddings(self, model: nn.Module) -> nn.Module | None:
        """A module whose ``inputs_embeds`` argument holds the embeddings of every
        explained token, where relevance is read instead of at ``input_embeddings``'
        outputs: a vision-language model's language model, which reads the text's
        embeddings and the image's features merged; None for other models."""
        ...

    def generated_inputs(self, model: nn.Module, inputs: Mapping[str, Any], prompt_length: int, new_tokens: int) -> dict[str, Any]:
        """``inputs``, keyword arguments of a call over prompts of ``prompt_length`` tokens
        (a vision-language model's image inputs and token types), with each per-token entry
        extended over ``new_tokens`` generated tokens as ``generate`` extends it."""
        ...

    def relevance_sites(self, model: nn.Module) -> RelevanceSites:
        """The activation and normalisation modules AttnLRP's rules act on."""
        ...

    def layer_block(self, model: nn.Module, module: nn.Module) -> nn.Module | None:
        """The layer (block) that holds the attention ``module``: called with the
        previous layer's output, it returns this layer's (Value Zeroing re-runs it), or
        None where the adapter does not know it."""
        ...


class AdapterBase:
    """Defaults for :class:`AttentionAdapter`: subclass and override what differs.

    ``attention_sites`` comes from ``attention_modules`` (which a subclass names), with
    ``role`` ("self") and ``is_causal`` (None: the probabilities tell) per module.
    Probabilities are read from the output (``output[site.output_index]`` for tuples,
    else the output itself), single-head ``(batch, queries, keys)`` maps get a heads
    axis, there is no padding mask and nothing to prepare, the forward is called
    positionally, and there is no patch grid.
    """

    probs_source: ProbsSource = "output"
    streams: bool = False
    propagates_relevance: bool = False

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The attention modules, in forward order (what ``attention_sites`` describes)."""
        raise NotImplementedError

    def role(self, module: nn.Module) -> Role:
        return "self"

    def is_causal(self, module: nn.Module) -> bool | None:
        return None

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        return [AttentionSite(m, self.role(m), self.is_causal(m)) for m in self.attention_modules(model)]

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        return output[site.output_index] if isinstance(output, (tuple, list)) else output

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        if not isinstance(probs, Tensor):
            raise UnsupportedModelError(
                f"{type(module).__name__} returned its attention as a {type(probs).__name__}, not one tensor of "
                "probabilities (separate local and global weights, as PEGASUS-X's): it cannot be read as maps "
                "over the tokens."
            )
        return probs.unsqueeze(1) if probs.dim() == 3 else probs

    def gradient_as_heads(self, module: nn.Module, grads: Tensor) -> Tensor:
        return self.as_heads(module, grads)

    def is_encoder_decoder(self, model: nn.Module) -> bool:
        return False

    def keyword_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        return forward_func

    def patch_grid(self, model: nn.Module, images: Tensor) -> tuple[int, int] | None:
        return None

    def image_tower_apart(self, model: nn.Module) -> str | None:
        return None

    def readout_rows(self, model: nn.Module, real: Tensor) -> Tensor | None:
        return None

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return []

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return None

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return None

    def cross_attended_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return None

    def prepared(self, model: nn.Module, streaming: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        return None

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        return []

    def merged_embeddings(self, model: nn.Module) -> nn.Module | None:
        return None

    def generated_inputs(self, model: nn.Module, inputs: Mapping[str, Any], prompt_length: int, new_tokens: int) -> dict[str, Any]:
        return extended_per_token(inputs, prompt_length, new_tokens, {})

    def relevance_sites(self, model: nn.Module) -> RelevanceSites:
        return RelevanceSites([], [])

    def layer_block(self, model: nn.Module, module: nn.Module) -> nn.Module | None:
        return enclosing_block(model, module)


TOWER_INPUTS = ("pixel_values", "pixel_values_images", "pixel_values_videos", "image_patches")
"""The image inputs a family's vision tower reads (Fuyu's patches among them), which a
model given its images already encoded (transformers' ``mm_encoder_outputs``, as
``generate`` encodes them once before its first step) takes no more."""


def per_token(value: Any, width: int, name: str = "") -> bool:
    """Whether ``value`` (the input ``name``) is a per-token input of a ``width``-token
    prompt: a tensor ``(batch, width, ...)`` (token types, masks, Mllama's cross-attention
    mask), not one of the :data:`TOWER_INPUTS` (pixels of 3 channels for a prompt of 3
    tokens)."""
    return isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == width and name not in TOWER_INPUTS


TEXT_MARKED_ZERO = ("mm_token_type_ids", "image_embeds_position_mask")
"""Per-token inputs in which a text token is 0: the multimodal token types, Kosmos-2's
image positions (its ``generate`` appends zeros)."""


def extended_per_token(
    inputs: Mapping[str, Any], prompt_length: int, new_tokens: int, generated: Mapping[str, Any]
) -> dict[str, Any]:
    """``inputs`` with each ``(batch, prompt_length, ...)`` tensor extended by
    ``new_tokens`` along its second axis: ``generated``'s entry where it holds the extended
    tensor, else, for a ``(batch, prompt_length)`` one, ones (masks), or zeros for
    :data:`TEXT_MARKED_ZERO` (generated tokens are text)."""
    extended = dict(inputs)
    for key, value in inputs.items():
        if not per_token(value, prompt_length, key):
            continue
        grown = generated.get(key)
        shape = (value.shape[0], prompt_length + new_tokens, *value.shape[2:])
        if isinstance(grown, Tensor) and tuple(grown.shape) == shape:
            extended[key] = grown
        elif value.dim() == 2:
            tail = value.new_zeros if key.endswith(TEXT_MARKED_ZERO) else value.new_ones
            extended[key] = torch.cat([value, tail(value.shape[0], new_tokens)], dim=1)
    return extended


def enclosing_block(model: nn.Module, module: nn.Module, outermost: bool = False) -> nn.Module | None:
    """The ancestor of ``module`` that is an entry of an ``nn.ModuleList`` (transformers'
    ``layers``/``layer``/``h``: one layer each), the innermost such, or the outermost (T5's
    block rather than its sub-layers); None where no list holds it."""
    block, current = None, module
    while (parent := parent_module(model, current)) is not None:
        if isinstance(parent, nn.ModuleList):
            if not outermost:
                return current
            block = current
        current = parent
    return block


_PARENTS: "weakref.WeakKeyDictionary[nn.Module, dict[int, weakref.ref[nn.Module]]]" = weakref.WeakKeyDictionary()
"""Per model (held weakly), each module's parent (held weakly), by the module's id."""


def parent_module(model: nn.Module, module: nn.Module) -> nn.Module | None:
    """The module of ``model`` that holds ``module`` as a child; None for the model itself
    or a module outside it. Asked once per attention module, the model's tree is walked
    once, not once each: the map is kept per model, and each answer is checked against the
    parent's children as they are now (a changed tree is walked again)."""
    if module is model:
        return None
    kept = _PARENTS.get(model)
    for parents in (kept, None) if kept is not None else (None,):
        if parents is None:
            parents = _PARENTS[model] = {id(child): weakref.ref(parent) for parent in model.modules() for child in parent.children()}
        known = parents.get(id(module))
        parent = known() if known is not None else None
        if parent is not None and any(child is module for child in parent.children()):
            return parent
    return None


class AttentionNotFoundError(UnsupportedModelError):
    """Raised when an adapter finds no attention modules in a model."""


def bound_argument(forward: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> Any:
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get(name)
    return bound.arguments.get(name, bound.arguments.get("kwargs", {}).get(name))
