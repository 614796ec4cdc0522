"""The metric registry: every metric that scores an attribution over a data set, declared once.

A registered metric is called the Captum way, whatever it measures::

    metric(forward_func, inputs, attributions, additional_forward_args, target, context) -> Tensor

with ``inputs`` the ``(batch, seq_len)`` token ids, ``attributions`` one score per token
(any method's: ours, Captum's, a user's tensor), ``additional_forward_args`` the
forward's further arguments (the padding mask first), ``target`` the explained class per
example (a classifier's metric) or the answer's ``(batch, answer_len)`` token ids (a
language model's: ``task="generation"``, the prompts padded on the left), and ``context`` (:class:`MetricContext`) what some metrics need besides: the model
whose attention they intervene on, the tokens never removed, the rationale tokens. It
returns one value per example, ``(batch,)`` (NaN where the metric has none).

:func:`register_metric` adds a metric under a name; :data:`METRICS` lists them in
registration order, and ``evaluate`` (the command line's too) reads it: a metric
registered before the run is scored like the built-in ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

import torch
from torch import Tensor, nn

from .context import leave_one_out_agreement, linear_datamodeling_score, top_k_log_prob_drop
from .erasure import attention_erasure, decision_flip_fraction
from .patches import PatchRemoval, patch_datamodeling_score, patch_leave_one_out_agreement, top_k_patch_log_prob_drop
from .plausibility import auprc, pointing_game, token_f1
from .token_removal import aopc, comprehensiveness, configured_pad_id, datamodeling_score, sufficiency


@dataclass(frozen=True)
class MetricContext:
    """What a registered metric may need besides the Captum-style arguments.

    Attributes:
        model: the module holding the attention (for metrics that intervene on it).
        keep: ``(batch, seq_len)`` bool, tokens never removed or ranked (special tokens).
        rationale: ``(batch, seq_len)`` bool, the tokens of the known rationale, or None
            where the data has none.
        segments: ``(batch, seq_len)`` long, the segment of each prompt token for the
            context metrics (-1: never removed), or None: each token its own segment.
        patches: for an image captioner, whose ``inputs`` are its pixels, how the context
            metrics remove its patches (:class:`~captum_attention.metrics.patches.PatchRemoval`);
            None: they remove a prompt's segments.
        removal: how the token-removal metrics (comprehensiveness, sufficiency, the LDS)
            remove a token: their ``removal`` and ``baseline_token_id``; empty: deleted. An
            image classifier's patches are replaced
            (:attr:`~captum_attention.metrics.ImagePatches.removal`).
    """

    model: nn.Module
    keep: Tensor
    rationale: Tensor | None = None
    segments: Tensor | None = None
    patches: PatchRemoval | None = None
    removal: Mapping[str, Any] = field(default_factory=dict)

    def included(self, mask: Tensor) -> Tensor:
        """``(batch, seq_len)`` bool: the real tokens a metric ranks (not padding, not kept)."""
        return (mask == 1) & ~self.keep

    def prompt_segments(self) -> Tensor | None:
        """The segments, with the kept tokens never removed (-1); None where neither is
        given beyond the default (each token its own segment, the first one kept)."""
        if self.segments is None and not bool(self.keep.any()):
            return None
        segments = self.segments
        if segments is None:
            segments = torch.arange(self.keep.shape[1], device=self.keep.device).expand_as(self.keep)
        return segments.masked_fill(self.keep, -1)

    def rationale_tokens(self) -> Tensor:
        """The rationale, or a clear error where the data gave none."""
        if self.rationale is None:
            raise ValueError("This metric compares with rationales: give a 'rationale' on every row.")
        return self.rationale


MetricFunction = Callable[[Callable[..., Tensor], Tensor, Tensor, tuple[Any, ...], Tensor, MetricContext], Tensor]
"""``metric(forward_func, inputs, attributions, additional_forward_args, target, context) -> (batch,)``."""


@dataclass(frozen=True)
class MetricSpec:
    """A registered metric as data.

    Attributes:
        name: the registry key (``--metrics`` on the command line).
        function: see :data:`MetricFunction`.
        description: one line for the documentation and ``--help``.
        needs_rationale: the data set must give a rationale on every row.
        needs_model: the metric runs the model through the capture (attention
            interventions), not only ``forward_func``.
        task: ``"classification"`` (``evaluate``'s data sets) or ``"generation"`` (a
            language model's answer to a prompt).
        better: ``"higher"`` or ``"lower"``: which values mean a more faithful (or more
            plausible) attribution; the summaries say it beside the metric's name.
        patches: a ``"generation"`` metric that also scores an image captioner's
            caption: its ``inputs`` are then the pixels, ``attributions`` the patch grid's
            scores and ``context.patches`` says how to remove patches.
    """

    name: str
    function: MetricFunction
    description: str
    needs_rationale: bool = False
    needs_model: bool = False
    task: str = "classification"
    better: str = "higher"
    patches: bool = False


METRICS: dict[str, MetricSpec] = {}
"""Registry name -> :class:`MetricSpec`, in registration order."""

Function = TypeVar("Function", bound=MetricFunction)


def register_metric(
    name: str,
    description: str,
    needs_rationale: bool = False,
    needs_model: bool = False,
    task: str = "classification",
    better: str = "higher",
    patches: bool = False,
) -> Callable[[Function], Function]:
    """Decorator: register ``function`` as the metric ``name`` (a second function under the
    same name is an error); the arguments are :class:`MetricSpec`'s.

    Example::

        >>> @register_metric("top_token_drop", "probability drop when the top token is removed")
        ... def top_token_drop(forward_func, inputs, attributions, additional_forward_args, target, context):
        ...     ...
    """

    def add(function: Function) -> Function:
        known = METRICS.get(name)
        if known is not None and known.function is not function:
            raise ValueError(f"Two metrics are registered as {name!r}: {known.function.__name__} and {function.__name__}.")
        if task not in ("classification", "generation"):
            raise ValueError(f"task must be 'classification' or 'generation', got {task!r}.")
        if better not in ("higher", "lower"):
            raise ValueError(f"better must be 'higher' or 'lower', got {better!r}.")
        if patches and task != "generation":
            raise ValueError("patches=True is for a metric of task='generation': a caption is an answer.")
        METRICS[name] = MetricSpec(name, function, description, needs_rationale, needs_model, task, better, patches)
        return function

    return add


ERASED_SHARE = 0.2
"""The share of each example's ranked tokens whose attention ``erasure_js`` erases."""


@register_metric("comprehensiveness", "ERASER comprehensiveness: AOPC over removing the top 1/5/10/20/50% tokens")
def _comprehensiveness(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    mask = additional_forward_args[0]
    pad_token_id = configured_pad_id(context.model)
    return aopc(comprehensiveness(forward_func, inputs, mask, attributions, target, keep=context.keep, pad_token_id=pad_token_id,
                                  **context.removal))


@register_metric("sufficiency", "ERASER sufficiency: AOPC over keeping only the top 1/5/10/20/50% tokens", better="lower")
def _sufficiency(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    mask = additional_forward_args[0]
    pad_token_id = configured_pad_id(context.model)
    return aopc(sufficiency(forward_func, inputs, mask, attributions, target, keep=context.keep, pad_token_id=pad_token_id,
                            **context.removal))


@register_metric(
    "datamodeling", "LDS: Spearman's rho between the kept tokens' summed scores and the class's probability over 32 "
    "seeded random half removals, each example's its own",
)
def _datamodeling(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    mask = additional_forward_args[0]
    return datamodeling_score(
        forward_func, inputs, mask, attributions, target, keep=context.keep, per_example=True,
        pad_token_id=configured_pad_id(context.model), **context.removal,
    )


@register_metric(
    "decision_flip", "fraction of tokens whose attention is erased (every layer, in ranking order) before the decision flips",
    needs_model=True, better="lower",
)
def _decision_flip(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    ranking = attributions.masked_fill(~context.included(additional_forward_args[0]), float("-inf"))
    flip = decision_flip_fraction(forward_func, inputs, ranking, additional_forward_args, model=context.model, keep=context.keep)
    return flip.fraction


@register_metric(
    "erasure_js", "JS divergence of the output when the attention paid to the top 20% tokens is erased at every layer",
    needs_model=True,
)
def _erasure_js(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    erased = top_share(attributions, context.included(additional_forward_args[0]))
    return attention_erasure(forward_func, inputs, erased, additional_forward_args, model=context.model).js_divergence


@register_metric("token_f1", "token F1 against the rationale, k = the rationale's size", needs_rationale=True)
def _token_f1(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    return token_f1(attributions, context.rationale_tokens(), context.included(additional_forward_args[0]))


@register_metric("auprc", "area under the precision-recall curve against the rationale", needs_rationale=True)
def _auprc(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    return auprc(attributions, context.rationale_tokens(), context.included(additional_forward_args[0]))


@register_metric("pointing_game", "whether the top token (an image's patch) lies in the rationale (the box)", needs_rationale=True)
def _pointing_game(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    return pointing_game(attributions, context.rationale_tokens(), context.included(additional_forward_args[0]))


@register_metric(
    "top_k_log_prob_drop", "drop of the answer's log-probability when the top 3 prompt segments (a caption's: image patches) are removed",
    task="generation", patches=True,
)
def _top_k_log_prob_drop(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    if context.patches is not None:
        removal = context.patches
        return top_k_patch_log_prob_drop(forward_func, inputs, target, attributions, removal.baseline_pixels, (3,),
                                         **_patch_reading(removal))[:, 0]
    mask, images = _mask_and_images(additional_forward_args)
    return top_k_log_prob_drop(forward_func, inputs, mask, target, attributions, (3,), context.prompt_segments(), image_inputs=images)[:, 0]


@register_metric(
    "lds", "ContextCite's linear datamodeling score over 32 seeded random half ablations (of a caption's image patches), each "
    "example's its own", task="generation", patches=True,
)
def _lds(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    if context.patches is not None:
        removal = context.patches
        return patch_datamodeling_score(forward_func, inputs, target, attributions, removal.baseline_pixels, per_example=True,
                                        **_patch_reading(removal))
    mask, images = _mask_and_images(additional_forward_args)
    segments = context.prompt_segments()
    return linear_datamodeling_score(forward_func, inputs, mask, target, attributions, segments, per_example=True, image_inputs=images)


@register_metric(
    "loo_agreement", "Spearman's rho with the segments' (a caption's: image patches') leave-one-out log-probability drops",
    task="generation", patches=True,
)
def _loo_agreement(
    forward_func: Callable[..., Tensor], inputs: Tensor, attributions: Tensor, additional_forward_args: tuple[Any, ...],
    target: Tensor, context: MetricContext,
) -> Tensor:
    if context.patches is not None:
        removal = context.patches
        return patch_leave_one_out_agreement(forward_func, inputs, target, attributions, removal.baseline_pixels,
                                             **_patch_reading(removal))
    mask, images = _mask_and_images(additional_forward_args)
    return leave_one_out_agreement(forward_func, inputs, mask, target, attributions, context.prompt_segments(), image_inputs=images)


def _patch_reading(removal: PatchRemoval) -> dict[str, Any]:
    """The patch metrics' arguments for how ``removal``'s model reads a caption: the
    regions, the prompt and its per-token inputs."""
    return {"regions": removal.regions, "prompt_ids": removal.prompt_ids, "prompt_inputs": removal.prompt_inputs}


def _mask_and_images(additional_forward_args: tuple[Any, ...]) -> tuple[Tensor, dict[str, Tensor] | None]:
    """An answer metric's attention mask, and a vision-language model's image inputs where
    a dict follows it (``(mask, image_inputs)``, as the attributions take them)."""
    images = additional_forward_args[1] if len(additional_forward_args) > 1 else None
    return additional_forward_args[0], images if isinstance(images, dict) else None


def top_share(scores: Tensor, include: Tensor, share: float = ERASED_SHARE) -> Tensor:
    """``(batch, seq_len)`` bool: the top ``share`` of each row's included tokens (at
    least one), ties broken by position."""
    ranked = scores.masked_fill(~include, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    counts = (include.sum(dim=-1).float() * share).ceil().clamp(min=1).long()
    chosen = torch.arange(scores.shape[-1], device=scores.device)[None, :] < counts[:, None]
    return torch.zeros_like(include).scatter_(-1, ranked, chosen) & include
