"""Explain sentences with every method, batched, timing each method."""

from __future__ import annotations

import difflib
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar, Union, cast, overload

import torch
from captum.attr import LayerIntegratedGradients

from ..attr import METHODS, REGISTRY
from ..capture.adapters import HuggingFaceAdapter
from ..capture.adapters.huggingface import reads_decoder_ids
from ..capture.adapters.images import encoded_images, with_encoded_images
from ..capture.inputs import class_probabilities, classifier_decoder_ids, decoder_start_token, forced_tokens
from ..capture.record import BIAS_LIMITS, learned_positions
from ..maps.encoder_decoder import text_scores
from ..metrics import attention_shares, calibrated_attribution, context_averaged_attribution, leave_one_out_estimates
from ..metrics.context import kept_image_tokens, log_prob_moved, summed_log_probs
from ..metrics.head_weights import WEIGHTS_FILE, HeadWeights
from ..metrics.token_removal import padding_shift, pair_token_types
from .display import readable_tokens, special_tokens

INTEGRATED_GRADIENTS = "integrated_gradients"
"""The Captum baseline the report adds to the registered methods."""
PRESENCE = "attn_lrp_presence"
"""AttnLRP with each text's tokens (a prompt's) at a presence in every attention call, the
special tokens (and an answer) at 1: its ``presence`` option, on request."""
CALIBRATED = "attn_lrp_presence_calibrated"
"""A classifier's :data:`PRESENCE` calibrated on 8 random removals of the words
(:func:`~captum_attention.metrics.calibrated_attribution`), on request."""
HALF_CONTEXTS = "attn_lrp_half_contexts"
"""A classifier's :data:`PRESENCE` beside AttnLRP in 8 random half contexts of the words
(:func:`~captum_attention.metrics.context_averaged_attribution`), on request."""
CLASSIFIERS_ONLY = (CALIBRATED, HALF_CONTEXTS)
"""The methods that explain a classifier's prediction, not an answer."""
T = TypeVar("T")
Text = Union[str, tuple[str, str]]
"""A classifier's input: one text, or a pair it reads together (an NLI model's premise
and hypothesis), tokenized as the tokenizer pairs them."""
ESTIMATES = "leave_one_out_estimates"
"""A language model's answer explained by
:func:`~captum_attention.metrics.leave_one_out_estimates` (KnockoutGradient's first-order
effects, the two segments AttnLRP ranks highest deleted exactly): :func:`answer_estimates`,
on request."""
ESTIMATES_BY_SHARE = "leave_one_out_estimates_by_share"
"""The same estimates with the :data:`SHARE_DELETIONS` segments deleted exactly chosen by
the first-order effects over one minus the segment's attention share
(:func:`~captum_attention.metrics.attention_shares`): no AttnLRP pass, 8 forwards beyond
KnockoutGradient's forward and backward. On the needle task Feature Ablation's LDS within
a standard error from 512 to 4,096 tokens."""
SHARE_DELETIONS = 7
"""The exact deletions of :data:`ESTIMATES_BY_SHARE`."""
ESTIMATES_OF_ANSWERS = (ESTIMATES, ESTIMATES_BY_SHARE)
"""The leave-one-out estimates: a decoder-only language model's answers take them, a
classifier and an encoder-decoder refuse them."""


@dataclass
class SentenceExplanation:
    """What one sentence's report shows.

    Attributes:
        probabilities: the model's probability of each class label, as transformers'
            text-classification pipeline gives it (:func:`class_outputs`): a regression
            model's scores themselves.
        output: how ``probability`` and ``probabilities`` read: ``"p"``, or ``"score"`` for
            a regression model's.
        cut_from: the sentence's token count when it was cut to the model's length limit
            (``len(tokens)``), else None.
        all_unknown: whether every word became the tokenizer's unknown token (an
            all-emoji sentence for a BERT vocabulary): the scores then explain no text.
        notes: what a method says of its scores on this sentence, by the method's shown
            name (the calibrated presence where it kept its prior).
        text_pair: the second text of a pair the classifier read with ``text``, else None.
    """

    text: str
    tokens: list[str]
    label: str
    probability: float
    target: int
    target_label: str
    special: list[bool] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)
    probabilities: dict[str, float] = field(default_factory=dict)
    cut_from: int | None = None
    all_unknown: bool = False
    notes: dict[str, str] = field(default_factory=dict)
    text_pair: str | None = None
    output: str = "p"

    @property
    def shown_text(self) -> str:
        """The text as the reports show it: a pair's two texts joined by " ‖ "."""
        return self.text if self.text_pair is None else f"{self.text} ‖ {self.text_pair}"


@dataclass(frozen=True)
class MethodInfo:
    """How to read a method's scores: whether they depend on the explained class, and
    whether their sign means something (else they are non-negative)."""

    uses_target: bool
    signed: bool

    @classmethod
    def of(cls, explainer: Any) -> "MethodInfo":
        """How to read the scores of ``explainer``, an attribution of the library."""
        return cls(uses_target=explainer.spec.uses_target, signed=explainer.signed)

    @property
    def forward_only(self) -> bool:
        """Whether the scores are the forward pass's alone (the same for every class),
        non-negative: the reports colour them blue."""
        return not self.uses_target and not self.signed


SIGNED = MethodInfo(uses_target=True, signed=True)
"""How to read signed scores of the explained class or answer that no registered method
gives (Integrated Gradients', the estimates', AttnLRP's at a presence refined by removals,
AttnLRP's on the pixels)."""


@dataclass
class Explanations:
    """Explanations of a batch of sentences, each method's wall time over all of them, and
    how to read each method (display name -> :class:`MethodInfo`)."""

    sentences: list[SentenceExplanation]
    seconds: dict[str, float]
    methods: dict[str, MethodInfo] = field(default_factory=dict)


LISTED_LABELS = 20
"""An error lists a model's labels where it has at most this many, else the closest ones."""


def resolve_target(target: str | None, id2label: dict[int, str], name: str = "target") -> int | None:
    """``--target`` (a row's label, ``name``) as a class index: an index or a label name, in
    any case, or one of the comma-separated names of exactly one label (ImageNet's 281 is
    "tabby, tabby cat": "tabby cat" names it); None keeps the prediction."""
    if target is None:
        return None
    text = target.strip()
    if text.lstrip("-").isdigit():
        index = int(text)
    else:
        named = [i for i, label in id2label.items() if text.lower() == label.lower()] or [
            i for i, label in id2label.items() if text.lower() in (part.strip().lower() for part in label.split(","))
        ]
        index = named[0] if len(named) == 1 else -1
    if index not in id2label:
        raise ValueError(f"{name} {target!r} is not a label of this model ({_labels_near(text, id2label)})")
    return index


def _labels_near(text: str, id2label: dict[int, str]) -> str:
    """The model's labels, or where it has more than :data:`LISTED_LABELS`, how many and
    those closest to ``text``."""
    if len(id2label) <= LISTED_LABELS:
        return "labels: " + ", ".join(f"{i}={label}" for i, label in sorted(id2label.items()))
    by_name = {label.lower(): index for index, label in id2label.items()}
    close = difflib.get_close_matches(text.lower(), list(by_name), n=5, cutoff=0.4)
    closest = f"; the closest: {', '.join(f'{by_name[label]}={id2label[by_name[label]]}' for label in close)}" if close else ""
    return f"{len(id2label)} labels{closest}"


@dataclass
class NotedScores:
    """``(batch, seq_len)`` scores with a note per example (None where there is nothing
    to say), shown beside the method's scores."""

    scores: torch.Tensor
    notes: list[str | None]


Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Union[torch.Tensor, NotedScores]]
"""``run(ids, mask, targets, ig_baseline) -> (batch, seq_len)`` scores, or
:class:`NotedScores`."""


def noted(result: torch.Tensor | NotedScores) -> NotedScores:
    """A :data:`Method`'s result as :class:`NotedScores` (no notes where it gave scores alone)."""
    return result if isinstance(result, NotedScores) else NotedScores(result, [None] * len(result))


Refine = Callable[..., torch.Tensor]
Note = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[Union[str, None]]]
"""``note(prior, refined, removable) -> one note (or None) per example``."""


@dataclass(frozen=True)
class ReportMethod:
    """One method of a report: the name it is shown under, how to run it (:data:`Method`)
    and how to read its scores."""

    display: str
    run: Method
    info: MethodInfo


def _attention_method(explainer: Any, decoder_ids_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> Method:
    """``explainer``'s scores of a classifier's tokens; given ``decoder_ids_of(ids, mask)``
    (an encoder-decoder's classifier: the decoder ids it makes itself,
    :func:`~captum_attention.capture.inputs.classifier_decoder_ids`), its source and target
    scores joined per token (:func:`~captum_attention.maps.encoder_decoder.text_scores`)."""

    def run(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
        if decoder_ids_of is None:
            return explainer.attribute(ids, target=targets, additional_forward_args=(mask,))
        source, target = explainer.attribute((ids, decoder_ids_of(ids, mask)), target=targets, additional_forward_args=(mask,))
        return text_scores(source, target, mask)

    return run


def once_per_batch(compute: Callable[..., T]) -> Callable[..., T]:
    """``compute``, computed once for a batch however many methods ask for it (a batch
    comes to every method as the same tensors): the last result while the call's tensor
    arguments are the same objects."""
    last: list[Any] = []

    def cached(*args: Any) -> T:
        tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
        if not (last and len(last[0]) == len(tensors) and all(a is b for a, b in zip(last[0], tensors))):
            last[:] = [tensors, compute(*args)]
        return cast(T, last[1])

    return cached


def default_method_names() -> list[str]:
    """What a report runs by default: the methods of reports (:data:`~captum_attention.METHODS`),
    then Integrated Gradients."""
    return [*METHODS, INTEGRATED_GRADIENTS]


def method_names() -> list[str]:
    """What ``--methods`` accepts: every registered method (:data:`~captum_attention.attr.REGISTRY`),
    Integrated Gradients, AttnLRP at a presence (:data:`PRESENCE`), then, for classifiers, that
    presence calibrated (:data:`CALIBRATED`) and beside half contexts (:data:`HALF_CONTEXTS`),
    for answers the leave-one-out estimates (:data:`ESTIMATES`, :data:`ESTIMATES_BY_SHARE`)."""
    return [*REGISTRY, INTEGRATED_GRADIENTS, PRESENCE, *CLASSIFIERS_ONLY, *ESTIMATES_OF_ANSWERS]


def check_names(kind: str, given: Sequence[str], known: Sequence[str]) -> None:
    """A one-line ``ValueError`` naming what of ``given`` is not among ``known`` (``kind``:
    "method", "metric"), and the choices."""
    unknown = [name for name in given if name not in known]
    if given and not unknown:
        return
    named = f"unknown {kind}{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}" if unknown else f"no {kind} given"
    raise ValueError(f"{named}; choose from {', '.join(known)}")


def check_methods(names: Sequence[str], answers: bool, one_stack: bool = True) -> None:
    """Before any work, a one-line ``ValueError`` where a method of ``names`` cannot explain
    what is asked: a classifier's logit (``answers`` False; ALTI-Logit explains a next-token
    logit; the estimates an answer), a whole answer (``answers``; Attention Flow explains
    one answer token at a time; :data:`CLASSIFIERS_ONLY` a classifier), or a model with more
    than one attention stack (``one_stack`` False: an encoder-decoder, a language
    model cross-attending to image features; the registered methods whose
    ``spec.encoder_decoder`` is False, :data:`PRESENCE` and what is built on it, and the
    estimates)."""
    specs = {name: REGISTRY[name].spec for name in names if name in REGISTRY}
    refused = {
        "a language model's next-token logit, not a classifier's":
            [] if answers else [name for name, spec in specs.items() if not spec.classifiers],
        "a language model's answer, not a classifier's prediction": [] if answers else [n for n in names if n in ESTIMATES_OF_ANSWERS],
        "a classifier's prediction, not an answer": [n for n in names if n in CLASSIFIERS_ONLY] if answers else [],
        "one answer token at a time, not a whole answer":
            [name for name, spec in specs.items() if not spec.spans] if answers else [],
        "one self-attention stack, not an encoder-decoder nor a model cross-attending to image features":
            [] if one_stack else [
                n for n in names
                if n in (PRESENCE, *CLASSIFIERS_ONLY, *ESTIMATES_OF_ANSWERS) or (n in specs and not specs[n].encoder_decoder)
            ],
    }
    problems = [
        f"{', '.join(listed)} {'explains' if len(listed) == 1 else 'explain'} {what}: leave {'it' if len(listed) == 1 else 'them'} out"
        for what, listed in refused.items()
        if listed
    ]
    if problems:
        raise ValueError("; ".join(problems) + ".")


def saved_head_weights(model: Any) -> Path | None:
    """The head weights saved beside ``model``'s checkpoint (``HeadWeights.save`` into its
    folder, :data:`~captum_attention.metrics.head_weights.WEIGHTS_FILE`), or None."""
    folder = getattr(model, "name_or_path", "")
    path = Path(folder) / WEIGHTS_FILE if folder else None
    return path if path is not None and path.is_file() else None


def registered_method(name: str, model: Any, forward: Callable[..., Any] | None = None) -> Any:
    """The registered method ``name`` explaining ``forward`` (default: the model itself);
    :class:`~captum_attention.LearnedAttention` with the head weights saved beside the model
    (:func:`saved_head_weights`), uniform where there are none."""
    cls = REGISTRY[name]
    weights = saved_head_weights(model) if name == "learned_attention" else None
    extra = {} if weights is None else {"weights": HeadWeights.load(weights)}
    return cls(model, **extra) if forward is None else cls(forward, model=model, **extra)


def presence_display(presence: float) -> str:
    """The name :data:`PRESENCE` is shown under."""
    return f"AttnLRP at presence {presence:g}"


@overload
def refined_method(
    at_presence: Callable[..., torch.Tensor], refine: Refine, forward: Callable[..., Any], tokenizer: Any, note: None = None
) -> Callable[..., torch.Tensor]: ...


@overload
def refined_method(
    at_presence: Callable[..., torch.Tensor], refine: Refine, forward: Callable[..., Any], tokenizer: Any, note: Note
) -> Callable[..., NotedScores]: ...


def refined_method(
    at_presence: Callable[..., torch.Tensor], refine: Refine, forward: Callable[..., Any], tokenizer: Any, note: Note | None = None
) -> Callable[..., torch.Tensor | NotedScores]:
    """``run(ids, mask, targets, extra)``: ``at_presence(ids, mask, targets, extra)``'s scores
    refined by ``refine`` (:func:`~captum_attention.metrics.calibrated_attribution`,
    :func:`~captum_attention.metrics.greedy_deletion`) on its 8 removals of the words, the
    special tokens kept as the metrics keep them; with ``note``, as :class:`NotedScores`
    with its notes on the prior and the refined scores. Each example's removals depend on
    it alone: the same scores in any batch."""

    def run(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, extra: Any) -> torch.Tensor | NotedScores:
        prior = at_presence(ids, mask, targets, extra)
        keep = special_tokens(ids, tokenizer)
        refined = refine(forward, ids, mask, prior, targets, keep=keep, pad_token_id=tokenizer.pad_token_id)
        return refined if note is None else NotedScores(refined, note(prior, refined, (mask != 0) & ~keep))

    return run


def in_half_contexts(attn_lrp: Any) -> Refine:
    """A refinement as :func:`refined_method` takes it: the prior beside ``attn_lrp``
    (AttnLRP) in 8 random half contexts of the words
    (:func:`~captum_attention.metrics.context_averaged_attribution`), each context one call
    on the batch, explaining the same targets."""

    def refine(forward: Callable[..., Any], ids: torch.Tensor, mask: torch.Tensor, prior: torch.Tensor,
               targets: torch.Tensor, keep: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
        def in_context(context_ids: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
            return attn_lrp.attribute(context_ids, target=targets, additional_forward_args=(context_mask,))

        return context_averaged_attribution(in_context, ids, mask, prior, keep=keep, pad_token_id=pad_token_id)

    return refine


def calibration_notes(prior: torch.Tensor, calibrated: torch.Tensor, removable: torch.Tensor) -> list[str | None]:
    """Where :func:`~captum_attention.metrics.calibrated_attribution` kept the prior (its
    removals reversed the prior's direction, a fitted scale α ≤ 0, and it returns
    the prior itself): a note saying so; None elsewhere."""
    kept_prior = ((calibrated == prior.float()) | ~removable).all(dim=1) & removable.any(dim=1)
    return [
        "its random removals reversed the prior's direction (fitted scale ≤ 0), so these are the uncalibrated presence's scores"
        if kept else None
        for kept in kept_prior.tolist()
    ]


def presence_weights(ids: torch.Tensor, mask: torch.Tensor, tokenizer: Any, presence: float) -> torch.Tensor:
    """``ids``-shaped presences: ``presence`` for the text's tokens, 1 for the special
    tokens and the padding."""
    return torch.where(special_tokens(ids, tokenizer) | (mask == 0), 1.0, presence)


def span_presence(prompt_ids: torch.Tensor, answer_length: int, tokenizer: Any, presence: float) -> torch.Tensor:
    """``(batch, prompt + answer)`` presences for an answer's span: the prompt's tokens at
    ``presence``, its special tokens and the answer's tokens at 1."""
    weights = presence_weights(prompt_ids, torch.ones_like(prompt_ids), tokenizer, presence)
    return torch.cat([weights, weights.new_ones(len(prompt_ids), answer_length)], dim=1)


def prompt_span(
    explainer: Any, ids: torch.Tensor, answer: torch.Tensor, image_inputs: dict[str, Any] | None = None, **options: Any
) -> torch.Tensor:
    """``(1, N)`` float: ``explainer``'s scores of the prompt's ``N`` tokens ``ids`` for the
    whole ``answer`` (:func:`answer_span`, :func:`prompt_of`), detached."""
    return prompt_of(explainer.model, answer_span(explainer, ids, answer, image_inputs, **options), ids.shape[1])


def answer_span(
    explainer: Any, ids: torch.Tensor, answer: torch.Tensor, image_inputs: dict[str, Any] | None = None, **options: Any
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``explainer``'s ``attribute_span`` of the whole ``answer`` after the prompt ``ids``
    ``(1, N)``, all of it read (a vision-language model's with its ``image_inputs``)."""
    args = (torch.ones_like(ids),) if image_inputs is None else (torch.ones_like(ids), image_inputs)
    return explainer.attribute_span(ids, answer, additional_forward_args=args, **options)


def prompt_of(model: Any, span: torch.Tensor | tuple[torch.Tensor, torch.Tensor], length: int) -> torch.Tensor:
    """``(1, length)`` float, detached: the prompt tokens' scores of an :func:`answer_span`
    (an encoder-decoder's source side; the tokens' side of a vision-language model that
    reads its image apart: Mllama's, BLIP's, GIT's)."""
    if isinstance(span, tuple):  # (source, target), or (image states or features, tokens)
        span = span[0] if getattr(model.config, "is_encoder_decoder", False) else span[1]
    return span[:, :length].float().detach()


IG_TOKENS_PER_BATCH = 8192
"""The most tokens (steps × sequence length) one batch of an answer's Integrated Gradients
holds: its backward keeps every layer's activations of them."""


def answer_integrated_gradients(
    model: Any, ids: torch.Tensor, answer: torch.Tensor, steps: int, image_inputs: dict[str, Any] | None = None
) -> torch.Tensor:
    """``(1, N)`` float: Integrated Gradients of the whole ``answer``'s log-probability over
    the prompt ``ids`` ``(1, N)`` of a decoder-only language model (an encoder-decoder's
    source, its decoder reading its start token and the answer): Captum's
    ``LayerIntegratedGradients`` on the module that embeds the prompt
    (:func:`_prompt_embeddings`; a forward that calls it other than once is refused in one
    line), ``steps`` steps, every prompt token
    at id 0 in the baseline, summed over the embedding. That is the ``seq_attr`` of
    Captum's ``LLMGradientAttribution`` (which ``explain`` runs), in one run instead of one
    per answer token: the integral is linear in the explained score. A vision-language
    model's with its ``image_inputs`` (one example), the image held: the image's tokens
    (:func:`~captum_attention.metrics.context.kept_image_tokens`, as the context metrics
    keep them) keep their ids in the baseline, so they score 0, and each step runs alone
    with the image, encoded once by the vision tower where the model then gives the
    answer the log-probability it gives from the pixels (:func:`_held_images`). Detached."""
    start = decoder_start_token(model) if getattr(model.config, "is_encoder_decoder", False) else None
    forced = forced_tokens(model, answer.reshape(1, -1))  # read, not explained

    def answer_log_prob(prompts: torch.Tensor, images: dict[str, Any]) -> torch.Tensor:
        answers = answer.expand(len(prompts), -1)
        if start is None:
            logits = model(input_ids=torch.cat([prompts, answers], dim=1), **images).logits[:, prompts.shape[1] - 1 : -1]
        else:
            decoder = torch.cat([torch.full_like(answers[:, :1], start), answers[:, :-1]], dim=1)
            logits = model(input_ids=prompts, decoder_input_ids=decoder, **images).logits
        return summed_log_probs(logits, answers, forced)

    embeddings = _prompt_embeddings(model, start is not None, lambda: answer_log_prob(ids, image_inputs or {}))

    def log_prob(prompts: torch.Tensor, images: dict[str, Any]) -> torch.Tensor:
        calls: list[int] = []

        def copied_output(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return output.clone()  # a copy of the embeddings Captum moves: Kosmos-2 writes its image's features into them in place

        copied = embeddings.register_forward_hook(copied_output)
        try:
            value = answer_log_prob(prompts, images)
        finally:
            copied.remove()
        if len(calls) != 1:
            raise ValueError(
                f"{type(model).__name__}'s forward calls the module that embeds its prompt ({type(embeddings).__name__}) "
                f"{len(calls)} times, not once: Integrated Gradients cannot move the prompt's embeddings alone."
            )
        return value

    if image_inputs is None:
        images: dict[str, Any] = {}
        baselines, per_batch = torch.zeros_like(ids), max(1, min(steps, IG_TOKENS_PER_BATCH // (ids.shape[1] + answer.shape[1])))
    else:
        new_tokens = answer.shape[1] if start is None else 0  # an encoder-decoder's image inputs are its source's
        images = _held_images(model, ids, HuggingFaceAdapter().generated_inputs(model, image_inputs, ids.shape[1], new_tokens), log_prob)
        baselines, per_batch = ids.masked_fill(~kept_image_tokens(model, ids, None, image_inputs), 0), 1
    scores = LayerIntegratedGradients(lambda prompts: log_prob(prompts, images), embeddings).attribute(
        ids, baselines=baselines, n_steps=steps, internal_batch_size=per_batch
    )
    return scores[:, : ids.shape[1]].sum(dim=-1).float().detach()  # the answer's embeddings are the baseline's too


def _prompt_embeddings(model: Any, encoder_decoder: bool, run: Callable[[], torch.Tensor]) -> torch.nn.Module:
    """The module that embeds the prompt: the model's input embeddings; an
    encoder-decoder's, or its encoder's own where one forward (``run``) calls only that
    once (T5's and BART's encoders embed with modules of their own; Florence-2 embeds its
    source with the model's before merging the image in)."""
    embeddings = model.get_input_embeddings()
    encoder_embeddings = model.get_encoder().get_input_embeddings() if encoder_decoder else embeddings
    if encoder_embeddings is embeddings:
        return embeddings
    calls = {id(embeddings): 0, id(encoder_embeddings): 0}

    def counted(module: Any, args: Any, output: Any) -> None:
        calls[id(module)] += 1

    handles = [module.register_forward_hook(counted) for module in (embeddings, encoder_embeddings)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return encoder_embeddings if calls[id(encoder_embeddings)] == 1 and calls[id(embeddings)] == 0 else embeddings


def _held_images(
    model: Any, ids: torch.Tensor, images: dict[str, Any], log_prob: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
) -> dict[str, Any]:
    """One example's image inputs for the ``(1, N)`` prompt ``ids``, their tower inputs
    replaced by the images encoded once (:func:`~captum_attention.capture.adapters.images.encoded_images`,
    as ``generate`` encodes them) where ``log_prob`` of the whole prompt is then the same
    within the logits' precision (:func:`~captum_attention.metrics.context.log_prob_moved`,
    as the context metrics decide it); else as given, the tower rerun by every forward."""
    encoded = encoded_images(model, images)
    if encoded is None:
        return images
    held = with_encoded_images(images, encoded)
    try:
        with torch.no_grad():
            given, reused = log_prob(ids, images), log_prob(ids, held)
    except Exception:  # noqa: BLE001 - the forward refuses encoded images (BLIP-2's requires the pixels)
        return images
    return held if log_prob_moved(given, reused, model.get_input_embeddings().weight.dtype) is None else images


def removable_segments(keep: torch.Tensor, segments: torch.Tensor | None) -> torch.Tensor:
    """``segments``, or where the rows name none each prompt token its own segment; -1 for
    the tokens never removed (``keep``) and, in a row that keeps none (a tokenizer that
    adds no BOS: GPT-2's, Qwen's), its first token, as the context metrics keep it by
    default: an ablation of every segment would leave nothing to predict the answer from."""
    if segments is None:
        segments = torch.arange(keep.shape[1], device=keep.device)[None].expand_as(keep)
    removable = segments.masked_fill(keep, -1)
    removable[:, 0] = torch.where((removable < 0).any(dim=1), removable[:, 0], -1)
    return removable


def answer_estimates(
    model: Any, ids: torch.Tensor, answer: torch.Tensor, segments: torch.Tensor, by_share: bool = False,
    span_of: Callable[[str], torch.Tensor] | None = None, image_inputs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """:data:`ESTIMATES` (``by_share``: :data:`ESTIMATES_BY_SHARE`): ``(1, N)`` scores of the
    prompt ``ids`` for ``answer`` over the ``segments`` (:func:`removable_segments`), from
    KnockoutGradient's and AttnLRP's :func:`prompt_span` (``span_of(name)``; default:
    computed here); a vision-language model's with its ``image_inputs``."""

    def computed(name: str) -> torch.Tensor:
        return prompt_span(registered_method(name, model), ids, answer, image_inputs)

    spans = span_of or computed
    mask = torch.ones_like(ids)
    first_order = spans("knockout_gradient")
    if by_share:
        shares = attention_shares(model, ids, mask, answer, segments, image_inputs=image_inputs)
        return leave_one_out_estimates(
            model, ids, mask, answer, first_order, first_order, segments, SHARE_DELETIONS, shares=shares, image_inputs=image_inputs
        )
    return leave_one_out_estimates(model, ids, mask, answer, first_order, spans("attn_lrp"), segments, image_inputs=image_inputs)


def types_separator(tokenizer: Any, texts: Sequence[Text]) -> int | None:
    """The separator token after which
    :func:`~captum_attention.metrics.pair_token_types` gives a pair's second text token
    type 1: the tokenizer's, where ``texts`` hold a pair and the tokenizer gives token type
    ids (BERT's; RoBERTa's gives none); else None, no token types."""
    if not any(isinstance(text, tuple) for text in texts) or "token_type_ids" not in tokenizer.model_input_names:
        return None
    if tokenizer.sep_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} gives token type ids but has no separator token to tell a pair's texts apart by."
        )
    return int(tokenizer.sep_token_id)


def classifier_inputs(model: Any, tokenizer: Any, texts: Sequence[Text], separator: int | None = None, **options: Any) -> Any:
    """``tokenizer(texts)`` as tensors, padded on the side where the model reads each text
    as it reads it alone (:func:`classifier_padding_side`), whatever side the tokenizer pads
    by default; given the ``separator`` of the run's text pairs (:func:`types_separator`),
    a one-line error where the tokenizer's token types are not
    :func:`~captum_attention.metrics.pair_token_types` of the ids."""
    side = batch_padding_side(model, tokenizer, texts, separator, **options) if len(texts) > 1 else "right"
    encoded = tokenizer(list(texts), padding=True, padding_side=side, return_tensors="pt", **options)
    if separator is not None:
        given = encoded["token_type_ids"].masked_fill(encoded["attention_mask"] == 0, 0)
        if not torch.equal(pair_token_types(encoded["input_ids"], encoded["attention_mask"], separator), given):
            raise ValueError(
                f"{type(tokenizer).__name__} marks a pair's texts by token types other than 0 before its first separator "
                "token and 1 after it, which the token removals cannot follow: explain the pair with the Python API, "
                "passing its token_type_ids."
            )
    return encoded


def batch_padding_side(model: Any, tokenizer: Any, texts: Sequence[Text], separator: int | None = None, **options: Any) -> str:
    """The side to pad ``texts`` on (:func:`classifier_padding_side`), tested on the
    shortest padded to the longest's length (by one column at least)."""
    lengths = [len(ids) for ids in tokenizer(list(texts), **options)["input_ids"]]
    shortest = min(range(len(texts)), key=lengths.__getitem__)
    return classifier_padding_side(model, tokenizer, texts[shortest], separator, max(lengths) - lengths[shortest], **options)


def classifier_padding_side(
    model: Any, tokenizer: Any, text: Text, separator: int | None = None, columns: int = 1, **options: Any
) -> str:
    """``"right"`` where ``columns`` columns of padding there (at least one: a batch's
    shortest text is padded by as many as it is shorter than the longest) leave the
    classifier's probabilities for ``text`` alone where they were (GPT-2's absolute
    positions would shift under left padding; the metrics' deletions pad on the right),
    else ``"left"`` where they do there (XLNet reads its last position); a one-line error
    where padding moves them on either side. A tokenizer without a pad token keeps its own
    side (its padding refuses itself)."""
    if tokenizer.pad_token_id is None:
        return str(tokenizer.padding_side)
    encoded = tokenizer([text], return_tensors="pt", **options)
    device = next(model.parameters()).device
    ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    shifts = {}
    for side in ("right", "left"):
        moved, tolerance = padding_shift(
            classifier_forward(model, separator), ids, mask, tokenizer.pad_token_id, side, max(columns, 1)
        )
        if moved <= tolerance:
            return side
        shifts[side] = moved
    raise ValueError(
        f"{type(model).__name__}'s probabilities for one text move when it is padded, by {shifts['right']:.2g} on the right "
        f"and {shifts['left']:.2g} on the left: its batches would not read each text as it reads it alone; use --batch-size 1."
    )


def class_outputs(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` float32: the classifier's outputs as transformers' text-classification
    pipeline gives them: a regression model's logits themselves, a sigmoid per label for a
    multi-label model or one with one logit, else the softmax over the classes."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return logits.float()
    if problem == "multi_label_classification":
        return logits.float().sigmoid()
    return class_probabilities(logits)[:, : logits.shape[-1]]  # one logit: its sigmoid alone


def classifier_forward(model: Any, separator: int | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``forward(ids, mask)``: the classifier's logits, its inputs passed by name; given
    the ``separator`` of text pairs (:func:`types_separator`), their token types too
    (:func:`~captum_attention.metrics.pair_token_types`)."""

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        types = {} if separator is None else {"token_type_ids": pair_token_types(ids, mask, separator)}
        return model(input_ids=ids, attention_mask=mask, **types).logits

    return forward


def two_stack_forward(model: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``forward(ids, decoder_ids, mask)``: an encoder-decoder's classifier's logits, its
    decoder given ``decoder_ids`` (:func:`~captum_attention.capture.inputs.classifier_decoder_ids`),
    as the methods explain it."""

    def forward(ids: torch.Tensor, decoder_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits

    return forward


def classifier_embeddings(model: Any) -> list[torch.nn.Module]:
    """The modules that embed a classifier's text, as Integrated Gradients interpolates
    them: the input embeddings; an encoder-decoder's, its encoder's and its decoder's
    (the text shifted right), a one-line error where one module embeds both."""
    if not reads_decoder_ids(model):
        return [model.get_input_embeddings()]
    stacks = [model.get_encoder().get_input_embeddings(), model.get_decoder().get_input_embeddings()]
    if stacks[0] is stacks[1]:
        raise ValueError(
            f"{type(model).__name__} embeds its encoder's and its decoder's ids with one module, which Integrated "
            "Gradients cannot interpolate twice in one forward: leave integrated_gradients out"
        )
    return stacks


def report_methods(
    model: Any, ig_steps: int, names: list[str], ig_batch_size: int | None = None, tokenizer: Any = None,
    presence: float = 0.05, separator: int | None = None,
) -> dict[str, ReportMethod]:
    """Registry name -> :class:`ReportMethod`, for the methods ``names`` (registry names,
    in the registry's order, then Integrated Gradients, then :data:`PRESENCE` and
    :data:`CALIBRATED` and :data:`HALF_CONTEXTS`, whose ``presence`` needs the ``tokenizer``
    to keep the special tokens at 1), explaining :func:`classifier_forward` with the text
    pairs' ``separator``."""
    two_stacks = reads_decoder_ids(model)
    if two_stacks:
        check_methods(names, answers=False, one_stack=False)
    forward = classifier_forward(model, separator)
    explained = two_stack_forward(model) if two_stacks else forward
    explainers = {name: registered_method(name, model, explained) for name in REGISTRY if name in names}
    decoder_ids_of = once_per_batch(lambda ids, mask: classifier_decoder_ids(model, ids, mask)) if two_stacks else None
    methods = {
        name: ReportMethod(
            explainer.get_name(), _attention_method(explainer, decoder_ids_of), MethodInfo.of(explainer)
        )
        for name, explainer in explainers.items()
    }
    if INTEGRATED_GRADIENTS in names:
        with warnings.catch_warnings():  # Captum's caution where one layer feeds another: both stacks embed the ids
            warnings.filterwarnings("ignore", message="Multiple layers provided")
            lig = LayerIntegratedGradients(forward, classifier_embeddings(model))

        def integrated_gradients(
            ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, baseline: torch.Tensor
        ) -> torch.Tensor:
            per_stack = lig.attribute(
                ids, baselines=baseline, target=targets, additional_forward_args=(mask,), n_steps=ig_steps,
                internal_batch_size=ig_batch_size,
            )
            scores = [stack.sum(dim=-1) for stack in per_stack]
            return text_scores(scores[0], scores[1], mask) if two_stacks else scores[0]

        methods[INTEGRATED_GRADIENTS] = ReportMethod("Integrated Gradients", integrated_gradients, SIGNED)
    if PRESENCE not in names and not set(CLASSIFIERS_ONLY) & set(names):
        return methods
    attn_lrp = METHODS["attn_lrp"](forward, model=model)

    def at_presence(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
        weights = presence_weights(ids, mask, tokenizer, presence)
        return attn_lrp.attribute(ids, target=targets, additional_forward_args=(mask,), presence=weights)

    spec = METHODS["attn_lrp"].spec
    if PRESENCE in names:
        methods[PRESENCE] = ReportMethod(presence_display(presence), at_presence, MethodInfo(spec.uses_target, spec.signed))
    if CALIBRATED in names:
        methods[CALIBRATED] = ReportMethod(
            f"{presence_display(presence)}, calibrated",
            refined_method(at_presence, calibrated_attribution, forward, tokenizer, calibration_notes),
            SIGNED,
        )
    if HALF_CONTEXTS in names:
        methods[HALF_CONTEXTS] = ReportMethod(
            f"{presence_display(presence)}, in half contexts",
            refined_method(at_presence, in_half_contexts(attn_lrp), forward, tokenizer),
            SIGNED,
        )
    return methods


def ig_baseline(ids: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """IG baseline: special tokens kept, every other token replaced by padding."""
    return torch.where(special_tokens(ids, tokenizer), ids, torch.full_like(ids, tokenizer.pad_token_id))


def length_limit(model: Any, tokenizer: Any) -> int:
    """The most tokens the model takes: the smaller of the tokenizer's ``model_max_length``
    and the model's ``max_position_embeddings`` (a vision-language model's: its language
    model's; an image captioner's: its decoder's; less the rows its position table reserves
    before the first position, :func:`~captum_attention.capture.record.learned_positions`;
    MPT's ``max_seq_len``, its ALiBi bias's length) where set, else 512."""
    config = getattr(model.config, "text_config", None) or getattr(model.config, "decoder", None) or model.config
    positions = getattr(config, "max_position_embeddings", None)
    learned = learned_positions(model, config)
    if learned is not None and learned[0] in ("max_position_embeddings", *BIAS_LIMITS.values()):
        positions = learned[1]
    limits = [positions, getattr(tokenizer, "model_max_length", None)]
    known = [int(limit) for limit in limits if isinstance(limit, int) and 0 < limit < 1_000_000]
    return min(known) if known else 512


def answer_too_long(
    model: Any, tokenizer: Any, prompt_tokens: int, answer: str | None, max_new_tokens: int, named: str
) -> str | None:
    """What is wrong where a prompt of ``prompt_tokens`` tokens and the answer (given,
    ``named`` so in the message, else ``max_new_tokens`` of it) are more tokens than the
    model takes (:func:`length_limit`; an encoder-decoder: the source or the answer); else
    None."""
    from .text import count

    limit = length_limit(model, tokenizer)
    if answer is not None:
        answer_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        shown = f"{named}'s {count(answer_tokens, 'token')}"
    else:
        answer_tokens, shown = max_new_tokens, f"--max-new-tokens {max_new_tokens}"
    if getattr(model.config, "is_encoder_decoder", False):
        if max(prompt_tokens, answer_tokens) > limit:
            return f"the source's {count(prompt_tokens, 'token')} or {shown} are more than the {limit} the model takes"
    elif prompt_tokens + answer_tokens > limit:
        return f"the prompt's {count(prompt_tokens, 'token')} and {shown} are more than the {limit} the model takes"
    return None


def check_one_stack(model: Any, reads: str, gives: str, instead: str) -> None:
    """A one-line ``ValueError`` where ``model`` is an encoder-decoder whose decoder reads
    the text again (``reads``: the text, for the message), its states giving ``gives``
    (the logits read at tokens); ``instead``: the models to explain."""
    if reads_decoder_ids(model):
        raise ValueError(
            f"{type(model).__name__} reads {reads} twice, in its encoder and again in its decoder, whose states give {gives}: "
            f"explain {instead}, or pass (input_ids, decoder_input_ids) to the methods yourself"
        )


def explain(
    model: Any,
    tokenizer: Any,
    sentences: Sequence[Text],
    target: int | None = None,
    ig_steps: int = 50,
    methods: list[str] | None = None,
    batch_size: int = 16,
    ig_batch_size: int | None = None,
    presence: float = 0.05,
) -> Explanations:
    """Run each method (by registry name, see :func:`method_names`; default:
    :func:`default_method_names`) on ``sentences`` (texts, or pairs of texts the model reads
    together), ``batch_size`` sentences at a time; sentences longer than the model takes
    (:func:`length_limit`) are cut, and say so. ``presence``: the text's tokens' presence
    for :data:`PRESENCE`. An encoder-decoder's classifier (BART's) is explained with the
    decoder ids it makes itself (:func:`~captum_attention.capture.inputs.classifier_decoder_ids`),
    each method's source and target scores joined per token
    (:func:`~captum_attention.maps.encoder_decoder.text_scores`)."""
    limit = length_limit(model, tokenizer)
    separator = types_separator(tokenizer, sentences)
    chosen = report_methods(model, ig_steps, methods or default_method_names(), ig_batch_size, tokenizer, presence, separator)
    if sentences:  # one untimed call per method first: the times then exclude warm-up (lazy imports, compiling)
        _explain_batch(model, tokenizer, sentences[:1], target, limit, chosen, separator)
    results: list[SentenceExplanation] = []
    seconds = dict.fromkeys((method.display for method in chosen.values()), 0.0)
    for start in range(0, len(sentences), batch_size):
        batch_results, batch_seconds = _explain_batch(
            model, tokenizer, sentences[start : start + batch_size], target, limit, chosen, separator
        )
        results += batch_results
        for name, spent in batch_seconds.items():
            seconds[name] += spent
    return Explanations(results, seconds, {method.display: method.info for method in chosen.values()})


def _explain_batch(
    model: Any, tokenizer: Any, sentences: Sequence[Text], target: int | None, limit: int,
    methods: dict[str, ReportMethod], separator: int | None = None,
) -> tuple[list[SentenceExplanation], dict[str, float]]:
    encoded = classifier_inputs(model, tokenizer, sentences, separator, truncation=True, max_length=limit)
    full_lengths = [len(ids) for ids in tokenizer(list(sentences), truncation=False)["input_ids"]]
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        logits = classifier_forward(model, separator)(ids, mask)
    probabilities = class_outputs(model.config, logits)
    predicted = logits.argmax(dim=-1)
    targets = predicted if target is None else torch.full_like(predicted, target)
    id2label = model.config.id2label
    results = []
    real = mask != 0  # on either side of the padding (classifier_padding_side)
    for row, text in enumerate(sentences):
        length = int(real[row].sum())
        row_ids = ids[row, real[row]].tolist()
        results.append(
            SentenceExplanation(
                text=text[0] if isinstance(text, tuple) else text,
                text_pair=text[1] if isinstance(text, tuple) else None,
                tokens=readable_tokens(ids[row, real[row]], tokenizer),
                label=id2label[int(predicted[row])],
                probability=float(probabilities[row, predicted[row]]),
                target=int(targets[row]),
                target_label=id2label[int(targets[row])],
                special=[i in tokenizer.all_special_ids for i in row_ids],
                probabilities={id2label[c]: float(p) for c, p in enumerate(probabilities[row].tolist())},
                cut_from=full_lengths[row] if full_lengths[row] > length else None,
                all_unknown=_all_unknown(row_ids, tokenizer),
                output="score" if getattr(model.config, "problem_type", None) == "regression" else "p",
            )
        )
    baseline = ig_baseline(ids, tokenizer)
    seconds = {}
    for method in methods.values():
        begin = time.perf_counter()
        scored = noted(method.run(ids, mask, targets, baseline))
        seconds[method.display] = time.perf_counter() - begin
        scores = scored.scores.detach()
        for row, (result, note) in enumerate(zip(results, scored.notes)):
            result.scores[method.display] = scores[row, real[row]].tolist()
            if note is not None:
                result.notes[method.display] = note
    return results, seconds


def _all_unknown(ids: list[int], tokenizer: Any) -> bool:
    """Whether the words of ``ids`` (special tokens left out) are all the unknown token."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    words = [i for i in ids if i not in tokenizer.all_special_ids or i == unknown]
    return unknown is not None and bool(words) and all(i == unknown for i in words)
