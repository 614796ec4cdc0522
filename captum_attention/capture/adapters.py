"""Adapters: where a model family computes attention probabilities, and how to read them.

An adapter answers four questions for the capture layer, and nothing else:

1. which modules compute post-softmax attention (``attention_modules``);
2. how to read the probability tensor ``(batch, heads, queries, keys)`` from one call of
   such a module (``attention_probs``);
3. which modules receive the padding mask, and how to read it from their call
   (``mask_modules`` and ``padding_mask``);
4. what must be switched for one call so that the probabilities exist at all, e.g. a
   Hugging Face model loaded with ``sdpa`` attention is switched to ``eager``
   (``prepared``, a context manager that restores the model afterwards).

Supporting a new model family means writing one adapter; the attribution methods never
change.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class AttentionAdapter(Protocol):
    """The protocol the capture layer uses to find and read attention in a model.

    Implement it to support a model family (or a single hand-written model) whose
    attention the built-in adapters do not find. :class:`ModuleAdapter` covers the common
    case of a user naming their attention modules.
    """

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose calls compute attention probabilities, in forward order."""
        ...

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        """The probabilities from one call's output: ``(batch, heads, queries, keys)``, or
        ``(batch, queries, keys)`` for one head; the very tensor that weighted the values."""
        ...

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules whose first call receives the ``(batch, seq_len)`` padding mask."""
        ...

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The padding mask (1 = real token) passed to one of ``mask_modules``, if any."""
        ...

    def prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        """Context in which ``model`` exposes attention probabilities; restores it on exit."""
        ...


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


class HuggingFaceAdapter:
    """Adapter for Hugging Face ``transformers`` models (BERT, RoBERTa, DistilBERT, ...).

    Attention modules are the ones each model class declares itself in its
    ``_can_record_outputs["attentions"]`` (the declaration transformers uses for
    ``output_attentions=True``), so any architecture that supports ``output_attentions``
    is found without a list of class names here. Under eager attention those modules
    return ``(attn_output, attn_probs)``, and ``attn_probs`` is the tensor that weighted
    the values. Models loaded with ``sdpa``/flash attention are switched to ``eager`` for
    the call and switched back afterwards.

    The padding mask is the ``attention_mask`` argument of the outermost
    ``PreTrainedModel`` call.

    Args:
        kinds (sequence of str, optional): which ``_can_record_outputs`` entries to
            capture. Default: ``("attentions",)`` (self-attention).
    """

    def __init__(self, kinds: Sequence[str] = ("attentions",)) -> None:
        self.kinds = tuple(kinds)
        self._output_index: dict[nn.Module, int] = {}

    @staticmethod
    def _pretrained_models(model: nn.Module) -> list[nn.Module]:
        from transformers import PreTrainedModel

        return [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    def _specs(self, model: nn.Module) -> list[_RecorderSpec]:
        from transformers.utils.output_capturing import OutputRecorder

        specs: list[_RecorderSpec] = []
        for submodel in self._pretrained_models(model):
            declared = getattr(type(submodel), "_can_record_outputs", None) or {}
            for kind in self.kinds:
                entries = declared.get(kind, [])
                for entry in entries if isinstance(entries, list) else [entries]:
                    if isinstance(entry, OutputRecorder):
                        specs.append(
                            _RecorderSpec(
                                entry.target_class, entry.index, entry.layer_name, entry.class_name
                            )
                        )
                    elif isinstance(entry, str):
                        specs.append(_RecorderSpec(None, 1, None, entry))
                    else:
                        specs.append(_RecorderSpec(entry, 1, None, None))
        return list(dict.fromkeys(specs))

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        specs = self._specs(model)
        self._output_index = {}
        for name, module in model.named_modules():
            spec = next((spec for spec in specs if spec.matches(name, module)), None)
            if spec is not None:
                self._output_index[module] = spec.index
        if not self._output_index:
            declared = [s.target_class.__name__ if s.target_class else s.class_name for s in specs]
            raise AttentionNotFoundError(
                f"No attention modules found in {type(model).__name__}: looked for the modules "
                f"that transformers models declare in `_can_record_outputs` under {self.kinds} "
                f"(declared here: {declared or 'none'}). If this is not a Hugging Face model, "
                "or its attention lives elsewhere, name the modules yourself: "
                "`adapter=ModuleAdapter([...attention modules...], probs=...)` "
                "(see captum_attention.capture.ModuleAdapter)."
            )
        return list(self._output_index)

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        if not isinstance(output, (tuple, list)):
            return None
        return output[self._output_index.get(module, 1)]

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return self._pretrained_models(model)

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return _bound_argument(module.forward, "attention_mask", args, kwargs)

    @contextmanager
    def prepared(self, model: nn.Module) -> Iterator[None]:
        original = getattr(getattr(model, "config", None), "_attn_implementation", None)
        switch = getattr(model, "set_attn_implementation", None)
        if original in (None, "eager") or switch is None:
            yield
            return
        switch("eager")
        try:
            yield
        finally:
            switch(original)


class ModuleAdapter:
    """Adapter for attention modules the user names.

    For a hand-written model (or any module the built-in adapters do not find): list the
    modules whose output holds the post-softmax probabilities, in forward order, and say
    how to read the probabilities from that output.

    Args:
        modules (sequence of nn.Module): the attention modules, in forward order. A module
            called several times (shared weights) is recorded at each call.
        probs (callable, optional): maps one call's output to the probability tensor,
            shaped ``(batch, heads, queries, keys)`` or ``(batch, queries, keys)`` for one
            head. The tensor must be the one that weighted the values, so that gradients
            with respect to it are exact. Default: ``output[1]`` for tuple outputs, else
            the output itself.
        mask_module (nn.Module, optional): module whose first call receives the padding
            mask. Default: None (all tokens real).
        mask_argument (str): name of that module's mask argument (1 = real token).
            Default: ``"attention_mask"``.

    Example::

        >>> adapter = ModuleAdapter([blk.attn.softmax for blk in net.blocks])
        >>> scores = GradSAM(net, adapter=adapter).attribute(ids, target=0)
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        probs: Callable[[Any], Tensor] | None = None,
        mask_module: nn.Module | None = None,
        mask_argument: str = "attention_mask",
    ) -> None:
        if not modules:
            raise ValueError("ModuleAdapter needs at least one attention module.")
        self.modules = list(modules)
        self.probs = probs
        self.mask_module = mask_module
        self.mask_argument = mask_argument

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(dict.fromkeys(self.modules))

    def attention_probs(self, module: nn.Module, output: Any) -> Tensor | None:
        if self.probs is not None:
            return self.probs(output)
        return output[1] if isinstance(output, (tuple, list)) else output

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return [] if self.mask_module is None else [self.mask_module]

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return _bound_argument(module.forward, self.mask_argument, args, kwargs)

    def prepared(self, model: nn.Module) -> AbstractContextManager[None]:
        return nullcontext()


def default_adapter(model: nn.Module) -> AttentionAdapter:
    """The built-in adapter for ``model``: Hugging Face models so far."""
    return HuggingFaceAdapter()
