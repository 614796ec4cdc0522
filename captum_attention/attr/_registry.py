"""What each attribution method is and needs, declared as data, and the registry of methods.

Each attribution class declares one :class:`MethodSpec` (``spec = MethodSpec(...)``). The
base class reads it to run the method (which capture, which backward, which reduction),
and the registry reads it to list the method: :data:`REGISTRY` holds every named method,
:data:`METHODS` those reports show by default (the command line, ``evaluate``, the
benchmarks and the shared test tables read them instead of listing the methods
themselves; ``--methods`` takes any of :data:`REGISTRY`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from torch import Tensor

Needs = Literal["forward", "backward", "relevance"]


@dataclass(frozen=True)
class Option:
    """One ``attribute`` option of a method: which values it takes.

    Attributes:
        accepts: whether a value is valid.
        expects: what a valid value is, as the error names it (``"one of ('mean',
            'max', 'min')"``, ``"an int"``).
        error: what a value it does not accept raises: ``TypeError`` where the option
            takes one type (a flag, an index), ``ValueError`` where it takes some values.
    """

    accepts: Callable[[Any], bool]
    expects: str
    error: type[Exception] = ValueError


def one_of(*choices: Any) -> Option:
    """An option that takes one of ``choices``."""
    return Option(lambda value: isinstance(value, type(choices[0])) and value in choices, f"one of {choices}")


FLAG = Option(lambda value: isinstance(value, bool), "True or False", TypeError)
LAYER = Option(
    lambda value: isinstance(value, int) and not isinstance(value, bool), "an int (negative counts from the end)", TypeError
)
FRACTION = Option(
    lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0, "a number in [0, 1)"
)


@dataclass(frozen=True)
class MethodSpec:
    """An attribution method as data.

    Attributes:
        name: the registry key (e.g. ``"grad_sam"``); ``""`` leaves the class unregistered.
        readable_name: what ``get_name()`` and the reports show.
        needs: ``"forward"``: the attention of one forward pass; ``"backward"``: with the
            gradient of the explained logit from one backward pass (dS/dA under eager
            capture, dS/dO under streaming); ``"relevance"``: one backward under AttnLRP's
            propagation rules, the scores being input × modified gradient on the input
            embeddings (the base class computes them: such a method writes no reduction).
        gradient_reduction: ``"backward"`` methods under eager capture:
            ``reduce(attn_maps, attn_grads) -> (B, Q, K)``, applied to each call as the
            backward pass reaches it.
        streams: whether the method has a streaming reduction (``_streamed_scores``); else
            ``capture="auto"`` runs it eager.
        encoder_decoder: whether it explains encoder-decoders (source and target scores).
        classifiers: whether it explains a classifier's logit (ALTI-Logit explains a
            language model's next-token logit alone).
        spans: whether ``attribute_span`` explains a whole answer (Attention Flow, a
            maximum flow into one query token, explains one answer token at a time).
        signed: whether its scores take both signs (reports colour them so).
        reads_target: whether a method without a backward still explains the target's
            score (DecompX and ALTI-Logit decompose the explained logit).
        reads_weights: whether a method without a backward reads the layers' weights as
            linear maps of their inputs (the norms and ALTI: the output projection);
            refused, as the methods with a backward or a target are, where a layer
            quantizes its inputs.
        reads_query_row: whether its scores read the explained query's row (rollout,
            raw attention, Transformer Attribution); the default row is then confirmed
            against the rows the logits read.
        rolls_out: whether its scores carry the explained row down through every attention
            layer (rollout, Transformer Attribution, Attention Flow, ALTI, ALTI-Logit, Value
            Zeroing): refused in one line where the tokens also mix outside the attention
            (layers without attention in the attention layers' stack, a convolution over the
            tokens inside the attention layers), which a rollout would skip.
        in_reports: listed in :data:`METHODS` (the reports' defaults, benchmarks);
            False keeps a method registered (:data:`REGISTRY`: the command line and
            ``evaluate`` take it by name) but out of the defaults.
        options: the options of ``attribute`` beyond Captum's arguments, name ->
            :class:`Option`; :meth:`check_options` checks every call's options against
            them (``attribute``, ``attribute_span``, ``attribute_continuation``,
            :class:`~captum_attention.LLMAttentionAttribution`).
        eager_options: option name -> why a truthy value of it needs the full maps.
    """

    name: str
    readable_name: str
    needs: Needs = "forward"
    gradient_reduction: Callable[[Tensor, Tensor], Tensor] | None = None
    streams: bool = True
    encoder_decoder: bool = True
    classifiers: bool = True
    spans: bool = True
    signed: bool = False
    reads_target: bool = False
    reads_weights: bool = False
    reads_query_row: bool = True
    rolls_out: bool = False
    in_reports: bool = True
    options: Mapping[str, Option] = field(default_factory=dict)
    eager_options: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.needs == "backward") != (self.gradient_reduction is not None):
            raise ValueError(f"{self.name or self.readable_name}: a gradient_reduction goes with needs='backward'.")

    def check_options(self, options: Mapping[str, Any], where: str) -> None:
        """A ``TypeError`` naming an option ``where`` (``"GradSAM.attribute_span"``) does
        not take, or the option's error naming a value it does not accept."""
        for name, value in options.items():
            option = self.options.get(name)
            if option is None:
                known = ", ".join(self.options) or "none"
                raise TypeError(f"{where} got an unexpected option {name!r}; its options are: {known}.")
            if not option.accepts(value):
                raise option.error(f"{name} must be {option.expects}, got {value!r}.")

    @property
    def effective(self) -> bool:
        """Whether ``attribute`` offers ``effective=True`` (effective attention)."""
        return "effective" in self.options

    @property
    def uses_backward(self) -> bool:
        """Whether the method takes a backward pass (its cost is measured against the
        model's forward+backward; else against its forward)."""
        return self.needs != "forward"

    @property
    def uses_target(self) -> bool:
        """Whether the scores depend on ``target``."""
        return self.uses_backward or self.reads_target


REGISTRY: dict[str, Any] = {}
"""Registry name -> attribution class, every named method, in registration order."""

METHODS: dict[str, Any] = {}
"""Registry name (e.g. ``"grad_sam"``) -> attribution class, the methods reports show by
default (``spec.in_reports``), in registration order."""


def register(cls: Any) -> None:
    """Add ``cls`` under its ``spec.name``; a second class with the same name is an error."""
    name = cls.spec.name
    if REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"Two attribution methods are registered as {name!r}: {REGISTRY[name].__name__} and {cls.__name__}.")
    REGISTRY[name] = cls
    if cls.spec.in_reports:
        METHODS[name] = cls
