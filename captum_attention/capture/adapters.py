"""Adapters: everything the library knows about one model family.

An adapter answers the family questions for the capture layer, and nothing else does:

1. which modules compute post-softmax attention, with each one's role and causality
   (``attention_sites``, from ``attention_modules``, ``role`` and ``is_causal``);
2. how to read the probability tensor ``(batch, heads, queries, keys)`` from one call of
   such a module (``attention_probs``, or the softmaxes inside it);
3. which modules receive the padding mask, and how to read it from their call
   (``mask_modules``, ``padding_mask`` and ``decoder_padding_mask``);
4. what must be switched for one call so that the probabilities exist at all, e.g. a
   Hugging Face model loaded with ``sdpa`` attention is switched to ``eager``
   (``prepared``, a context manager that restores the model afterwards);
5. how to call the model's forward with Captum's positional arguments
   (``keyword_forward``), whether it is an encoder-decoder (``is_encoder_decoder``) and,
   for image models, the patch grid of an input (``patch_grid``);
6. which weight maps an attention module's concatenated head outputs back to the
   hidden size (``output_projection``, for effective attention).

Supporting a new model family means writing one adapter; the attribution methods and
metrics never change. Adapters keep no state between calls.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn

from .._compat import attn_implementation, declared_outputs, output_recorder_class


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


@runtime_checkable
class AttentionAdapter(Protocol):
    """The protocol the capture layer uses to find and read attention in a model.

    Implement it (most simply by subclassing :class:`AdapterBase`, which supplies the
    defaults) to support a model family whose attention the built-in adapters do not
    find. :class:`ModuleAdapter` covers the common case of a user naming their attention
    modules.

    Attributes:
        probs_source: ``"output"`` when ``attention_probs`` reads the probabilities from
            each call's output; ``"softmax"`` when they are the outputs of the softmaxes
            computed inside each call (several softmaxes in one call are stacked as heads).
    """

    probs_source: ProbsSource

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose calls compute attention probabilities, in forward order."""
        ...

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        """The attention modules with their role and causality, in forward order."""
        ...

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        """The probabilities from one call's output (``attention_probs`` of the site's
        module, unless the site says more)."""
        ...

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        """The probabilities from one call's output: the very tensor that weighted the
        values (any shape ``as_heads`` understands). Not used when ``probs_source`` is
        ``"softmax"``."""
        ...

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        """A ``(batch, heads, queries, keys)`` view of one captured probability tensor."""
        ...

    def role(self, module: nn.Module) -> Role:
        """``"self"`` for encoder-only or decoder-only models; for encoder-decoders
        ``"encoder"`` / ``"decoder"`` (self-attention) or ``"cross"``; ``"pooling"`` for
        a readout attention whose queries are not tokens (it comes after every
        self-attention call)."""
        ...

    def is_causal(self, module: nn.Module) -> bool | None:
        """Whether the module's attention is causal; None if the adapter cannot tell."""
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

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose first call receives the ``(batch, seq_len)`` padding mask."""
        ...

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The padding mask (1 = real token) passed to one of ``mask_modules``, if any."""
        ...

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """Encoder-decoders: the target-side padding mask passed to ``module``, if any."""
        ...

    def prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        """Context in which ``model`` exposes attention probabilities; restores it on exit."""
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

    streams: bool
    """Whether the family's attention runs through transformers' ``sdpa`` attention
    function, so that a streaming capture can record it (see ``kernel_prepared``)."""

    def kernel_prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        """Context in which ``model`` runs its attention through the ``sdpa`` attention
        function; restores it on exit."""
        ...


class AdapterBase:
    """Defaults for :class:`AttentionAdapter`: subclass and override what differs.

    Probabilities are read from the output (``output[1]`` for tuples, else the output
    itself), single-head ``(batch, queries, keys)`` maps get a heads axis, every call is
    self-attention whose causality the probabilities tell, there is no padding mask and
    nothing to prepare, the forward is called positionally, and there is no patch grid.
    """

    probs_source: ProbsSource = "output"
    streams: bool = False

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        return [AttentionSite(m, self.role(m), self.is_causal(m)) for m in self.attention_modules(model)]

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        return self.attention_probs(site.module, output)

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        return output[1] if isinstance(output, (tuple, list)) else output

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        return probs.unsqueeze(1) if probs.dim() == 3 else probs

    def role(self, module: nn.Module) -> Role:
        return "self"

    def is_causal(self, module: nn.Module) -> bool | None:
        return None

    def is_encoder_decoder(self, model: nn.Module) -> bool:
        return False

    def keyword_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        return forward_func

    def patch_grid(self, model: nn.Module, images: Tensor) -> tuple[int, int] | None:
        return None

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return []

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return None

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return None

    def prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def kernel_prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        return None

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        return []


class AttentionNotFoundError(ValueError):
    """Raised when an adapter finds no attention modules in a model."""


def _bound_argument(forward: Callable[..., Any], name: str, args: tuple, kwargs: dict) -> Any:
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return kwargs.get(name)
    return bound.arguments.get(name, bound.arguments.get("kwargs", {}).get(name))


@dataclass(frozen=True)
class _RecorderSpec:
    """One entry of a transformers ``_can_record_outputs`` declaration, normalised."""

    target_class: type | None
    index: int
    layer_name: str | None
    class_name: str | None

    def matches(self, name: str, module: nn.Module) -> bool:
        by_class = self.target_class is not None and isinstance(module, self.target_class)
        by_name = self.class_name is not None and name.endswith(self.class_name)
        if not (by_class or by_name):
            return False
        if self.layer_name is None:
            return True
        return "." + self.layer_name.strip(".") + "." in "." + name + "."


class HuggingFaceAdapter(AdapterBase):
    """Adapter for Hugging Face ``transformers`` models: encoders (BERT, RoBERTa, ...),
    decoders (GPT-2, Llama, Qwen2, ...), encoder-decoders (T5, BART) and ViT/DeiT.

    Attention modules are the ones each model class declares itself in its
    ``_can_record_outputs`` (the declaration transformers uses for
    ``output_attentions=True``), matched inside that class's own sub-tree, so any
    architecture that supports ``output_attentions`` is found without a list of class
    names here. Under eager attention those modules return the probabilities at the
    declared output index; they are the tensor that weighted the values. Models loaded
    with ``sdpa``/flash attention are switched to ``eager`` for the call and switched
    back afterwards.

    The padding mask is the ``attention_mask`` argument of the outermost
    ``PreTrainedModel`` call (and ``decoder_attention_mask`` for encoder-decoders).
    In an encoder-decoder, self-attention inside ``model.get_encoder()`` has the role
    ``"encoder"``, other self-attention ``"decoder"``, and ``cross_attentions`` modules
    ``"cross"``.

    Args:
        kinds (sequence of str, optional): which ``_can_record_outputs`` entries to
            capture. Default: ``("attentions", "cross_attentions")``.
    """

    def __init__(self, kinds: Sequence[str] = ("attentions", "cross_attentions")) -> None:
        self.kinds = tuple(kinds)

    @staticmethod
    def _pretrained_models(model: nn.Module) -> list[nn.Module]:
        from transformers import PreTrainedModel

        return [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    def _specs(self, submodel: nn.Module) -> list[tuple[str, _RecorderSpec]]:
        recorder = output_recorder_class()
        declared = declared_outputs(type(submodel))
        specs: list[tuple[str, _RecorderSpec]] = []
        for kind in self.kinds:
            entries = declared.get(kind, [])
            for entry in entries if isinstance(entries, list) else [entries]:
                if recorder is not None and isinstance(entry, recorder):
                    spec = _RecorderSpec(entry.target_class, entry.index, entry.layer_name, entry.class_name)
                elif isinstance(entry, str):
                    spec = _RecorderSpec(None, 1, None, entry)
                else:
                    spec = _RecorderSpec(entry, 1, None, None)
                specs.append((kind, spec))
        return specs

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [site.module for site in self.attention_sites(model)]

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        encoder = _encoder_of(model)
        encoder_modules = set(encoder.modules()) if encoder is not None else set()
        found: dict[nn.Module, AttentionSite] = {}
        declared: list[str] = []
        # Innermost declarations first: each model class describes its own sub-tree.
        for submodel in reversed(self._pretrained_models(model)):
            specs = self._specs(submodel)
            declared += [s.target_class.__name__ if s.target_class else str(s.class_name) for _, s in specs]
            for name, module in submodel.named_modules():
                match = next((kind_spec for kind_spec in specs if kind_spec[1].matches(name, module)), None)
                if match is None or module in found:
                    continue
                kind, spec = match
                role: Role = "cross" if kind == "cross_attentions" else "self"
                if role == "self" and encoder is not None:
                    role = "encoder" if module in encoder_modules else "decoder"
                found[module] = AttentionSite(module, role, self.is_causal(module), spec.index)
        if not found:
            raise AttentionNotFoundError(
                f"No attention modules found in {type(model).__name__}: looked for the modules "
                f"that transformers models declare in `_can_record_outputs` under {self.kinds} "
                f"(declared here: {sorted(set(declared)) or 'none'}). If this is not a Hugging "
                "Face model, or its attention lives elsewhere, name the modules yourself: "
                "`adapter=ModuleAdapter([...attention modules...])` (see "
                "captum_attention.capture.ModuleAdapter and the AttentionAdapter protocol)."
            )
        order = {module: index for index, module in enumerate(model.modules())}
        return sorted(found.values(), key=lambda site: order[site.module])

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        if not isinstance(output, (tuple, list)) or len(output) <= site.output_index:
            return None
        return output[site.output_index]

    def is_causal(self, module: nn.Module) -> bool | None:
        # transformers' attention modules carry it (T5's declared layer on its T5Attention)
        for inner in module.modules():
            causal = getattr(inner, "is_causal", None)
            if isinstance(causal, bool):
                return causal
        return None

    def is_encoder_decoder(self, model: nn.Module) -> bool:
        return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))

    def keyword_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        """A generating Hugging Face model (a causal LM or an encoder-decoder) called with
        Captum's positional arguments, by name.

        ``(inputs..., *additional_forward_args)`` map to ``(input_ids, attention_mask)`` for
        causal language models and to ``(input_ids, decoder_input_ids, attention_mask,
        decoder_attention_mask)`` for encoder-decoders (``inputs_embeds`` /
        ``decoder_inputs_embeds`` for float inputs). A causal language model given a
        left-padded mask gets ``position_ids`` counted over the real tokens, as ``generate``
        does. Other Hugging Face models (classifiers, whose positional order already is
        ``input_ids, attention_mask, ...``) are called positionally, float embeddings in
        the place of ``input_ids`` as ``inputs_embeds``; other forward functions are
        returned as they are.
        """
        from transformers import PreTrainedModel

        if not isinstance(forward_func, PreTrainedModel):
            return forward_func
        if not forward_func.can_generate():
            return _EmbeddingsByKeyword(forward_func)
        return _KeywordForward(forward_func, self.is_encoder_decoder(forward_func))

    def patch_grid(self, model: nn.Module, images: Tensor) -> tuple[int, int] | None:
        patch = getattr(getattr(model, "config", None), "patch_size", None)
        if patch is None:
            return None
        rows, columns = (patch, patch) if isinstance(patch, int) else tuple(patch)
        return images.shape[-2] // rows, images.shape[-1] // columns

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return self._pretrained_models(model)

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return _bound_argument(module.forward, "attention_mask", args, kwargs)

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return _bound_argument(module.forward, "decoder_attention_mask", args, kwargs)

    streams = True

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        """The attention module's own projection (``o_proj``, ``out_proj``, ``o``,
        ``c_proj``, ``out_lin``), or, where the declared module is the inner
        self-attention (BERT family), its parent's ``output.dense``."""
        names = {m: name for name, m in model.named_modules()}
        parent = model.get_submodule(names[module].rpartition(".")[0]) if module in names else None
        candidates = [getattr(module, name, None) for name in _PROJECTIONS]
        if parent is not None:
            candidates.append(getattr(getattr(parent, "output", None), "dense", None))
        projection = next((c for c in candidates if isinstance(c, nn.Module)), None)
        if isinstance(projection, nn.Linear):
            return projection.weight
        if type(projection).__name__ == "Conv1D":  # GPT-2's (in, out) weight
            return projection.weight.t()  # type: ignore[union-attr, operator]
        return None

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        """``get_input_embeddings()`` of the encoder and the decoder (one module where they
        share it, as T5's ``shared``), else of the model."""
        owners = [getattr(model, "get_encoder")(), getattr(model, "get_decoder")()] if self.is_encoder_decoder(model) else [model]
        modules: list[nn.Module] = []
        for owner in owners:
            embedding = getattr(owner, "get_input_embeddings", lambda: None)()
            if isinstance(embedding, nn.Module) and not any(embedding is m for m in modules):
                modules.append(embedding)
        return modules

    def prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        return _implementation(model, "eager")

    def kernel_prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        return _implementation(model, "sdpa")


_PROJECTIONS = ("o_proj", "out_proj", "o", "c_proj", "out_lin")
"""Names transformers' attention modules give their output projection."""


@contextmanager
def _implementation(model: nn.Module, wanted: str) -> Iterator[None]:
    """``model`` switched to the attention implementation ``wanted`` and back."""
    original = attn_implementation(model)
    switch = getattr(model, "set_attn_implementation", None)
    if original in (None, wanted) or switch is None:
        yield
        return
    try:
        switch(wanted)
        yield
    finally:
        switch(original)


@dataclass(frozen=True)
class _KeywordForward:
    """A generating Hugging Face model called with positional arguments (see
    :meth:`HuggingFaceAdapter.keyword_forward`)."""

    model: nn.Module
    encoder_decoder: bool

    @property
    def names(self) -> list[str]:
        if self.encoder_decoder:
            return ["input_ids", "decoder_input_ids", "attention_mask", "decoder_attention_mask"]
        return ["input_ids", "attention_mask"]

    def __call__(self, *args: Any) -> Any:
        names = self.names
        if len(args) > len(names):
            raise TypeError(
                f"{type(self.model).__name__} was given {len(args)} positional inputs; as "
                f"forward_func it takes at most {len(names)}: {names}. Wrap it in a function "
                "to pass more."
            )
        kwargs: dict[str, Any] = {}
        for name, value in zip(names, args):
            if isinstance(value, Tensor) and value.is_floating_point() and name.endswith("input_ids"):
                name = name.replace("input_ids", "inputs_embeds")
            kwargs[name] = value
        mask = kwargs.get("attention_mask")
        if not self.encoder_decoder and isinstance(mask, Tensor) and bool((mask[:, 0] == 0).any()):
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return self.model(**kwargs)


@dataclass(frozen=True)
class _EmbeddingsByKeyword:
    """A Hugging Face model called positionally, float embeddings given where its forward
    takes ``input_ids`` passed as ``inputs_embeds`` (see :meth:`HuggingFaceAdapter.keyword_forward`)."""

    model: nn.Module

    def __call__(self, *args: Any) -> Any:
        first = next(iter(inspect.signature(self.model.forward).parameters), None)
        if first == "input_ids" and args and isinstance(args[0], Tensor) and args[0].is_floating_point():
            return self.model(None, *args[1:], inputs_embeds=args[0])
        return self.model(*args)


def _encoder_of(model: nn.Module) -> nn.Module | None:
    """The encoder of a Hugging Face encoder-decoder model, else None."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    get_encoder = getattr(model, "get_encoder", None)
    return get_encoder() if callable(get_encoder) else None


class ModuleAdapter(AdapterBase):
    """Adapter for attention modules the user names.

    For a hand-written model (or any module the built-in adapters do not find): list the
    modules whose calls compute the attention, in forward order, and say where the
    post-softmax probabilities are: a function of each call's output, or
    ``probs="softmax"`` for modules that compute them inline with ``F.softmax`` /
    ``torch.softmax`` / ``Tensor.softmax`` and do not return them. With ``"softmax"``,
    each softmax inside one call of a named module is recorded (the very tensor the
    module goes on to use) and several softmaxes in one call are stacked as heads, so a
    textbook ``MultiHeadAttention`` made of one ``Head`` module per head is named once.

    Args:
        modules (sequence of nn.Module): the attention modules, in forward order. A module
            called several times (shared weights) is recorded at each call.
        probs (callable or "softmax", optional): maps one call's output to the
            probability tensor, ``(batch, heads, queries, keys)`` or
            ``(batch, queries, keys)`` for one head; it must be the tensor that weighted
            the values, so that gradients with respect to it are exact. ``"softmax"``:
            the softmax outputs computed inside the call. Default: ``output[1]`` for
            tuple outputs, else the output itself.
        mask_module (nn.Module, optional): module whose first call receives the padding
            mask. Default: None (all tokens real).
        mask_argument (str): name of that module's mask argument (1 = real token).
            Default: ``"attention_mask"``.
        pooling (sequence of nn.Module, optional): the modules among ``modules`` whose
            queries are not tokens: attention pooling with a learned query, or the
            additive (Bahdanau) attention of an RNN classifier, ``(batch, queries, keys)``
            or ``(batch, heads, queries, keys)`` with the tokens as keys. They are the
            model's readout: every method reads their rows (the mean over their queries)
            where it would read the query token's row. Default: none.

    Example::

        >>> adapter = ModuleAdapter([block.attention for block in net.blocks], probs="softmax")
        >>> scores = GradSAM(net, adapter=adapter).attribute(ids, target=0)
        >>> rnn_adapter = ModuleAdapter([rnn.attention], probs=lambda out: out[1],
        ...                             pooling=[rnn.attention])
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        probs: Callable[[Any], Tensor] | Literal["softmax"] | None = None,
        mask_module: nn.Module | None = None,
        mask_argument: str = "attention_mask",
        pooling: Sequence[nn.Module] = (),
    ) -> None:
        if not modules:
            raise ValueError("ModuleAdapter needs at least one attention module.")
        if any(all(module is not named for named in modules) for module in pooling):
            raise ValueError("Every module in pooling=[...] must also be one of the attention modules named first.")
        if isinstance(probs, str) and probs != "softmax":
            raise ValueError(f'probs must be a callable, "softmax" or None, got {probs!r}.')
        self.modules = list(modules)
        self.probs = probs
        self.probs_source = "softmax" if probs == "softmax" else "output"
        self.mask_module = mask_module
        self.mask_argument = mask_argument
        self.pooling = list(pooling)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(dict.fromkeys(self.modules))

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        if callable(self.probs):
            return self.probs(output)
        return super().attention_probs(module, output)

    def role(self, module: nn.Module) -> Role:
        return "pooling" if any(module is pooled for pooled in self.pooling) else "self"

    def is_causal(self, module: nn.Module) -> bool | None:
        return False if self.role(module) == "pooling" else None

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return [] if self.mask_module is None else [self.mask_module]

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return _bound_argument(module.forward, self.mask_argument, args, kwargs)


class MultiheadAttentionAdapter(AdapterBase):
    """Adapter for ``torch.nn.MultiheadAttention`` (per-head probabilities, exact gradients).

    For the call, every ``nn.MultiheadAttention`` of the model is asked for
    ``need_weights=True`` (so that it computes an explicit softmax, off the fused fast
    path), the per-head probabilities are the softmax output inside
    ``F.multi_head_attention_forward`` (the very tensor that multiplies the values, so
    gradients and interventions are exact), and the output is handed back to the caller
    exactly as it asked for it (no weights, or head-averaged weights). The padding mask
    is the ``key_padding_mask`` of the first attention call (True or -inf = padding),
    turned into 1 = real token.
    """

    probs_source: ProbsSource = "softmax"

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        modules: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        if not modules:
            raise AttentionNotFoundError(
                f"{type(model).__name__} has no nn.MultiheadAttention module. Name the "
                "attention modules yourself with ModuleAdapter (see the AttentionAdapter "
                "protocol)."
            )
        return modules

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        assert isinstance(module, nn.MultiheadAttention)
        return probs.view(-1, module.num_heads, *probs.shape[-2:])

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return self.attention_modules(model)[:1]

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        assert isinstance(module, nn.MultiheadAttention)
        return module.out_proj.weight

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        key_padding_mask = _bound_argument(module.forward, "key_padding_mask", args, kwargs)
        return None if key_padding_mask is None else (key_padding_mask == 0).long()

    @contextmanager
    def prepared(self, model: nn.Module) -> Iterator[None]:
        asked: dict[nn.Module, list[bool]] = {}

        def ask_for_weights(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            asked.setdefault(module, []).append(bound.arguments["need_weights"])
            bound.arguments["need_weights"] = True
            return bound.args, bound.kwargs

        def hand_back(module: nn.Module, args: tuple, output: Any) -> Any:
            return output if asked[module].pop() else (output[0], None)

        with ExitStack() as stack:
            for module in self.attention_modules(model):
                stack.callback(module.register_forward_pre_hook(ask_for_weights, with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(hand_back, prepend=True).remove)
            yield


def default_adapter(model: nn.Module) -> AttentionAdapter:
    """The built-in adapter for ``model``: Hugging Face models, else ``nn.MultiheadAttention``."""
    from transformers import PreTrainedModel

    if any(isinstance(m, PreTrainedModel) for m in model.modules()):
        return HuggingFaceAdapter()
    if any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        return MultiheadAttentionAdapter()
    raise AttentionNotFoundError(
        f"{type(model).__name__} is neither a Hugging Face model nor has nn.MultiheadAttention "
        "modules, so its attention cannot be found automatically. Pass "
        "adapter=ModuleAdapter([...your attention modules...], probs=...) (probs='softmax' "
        "for modules that call F.softmax inline), or implement the AttentionAdapter protocol."
    )
