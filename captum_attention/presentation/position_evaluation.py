"""``evaluate`` for the models whose outputs are read at tokens: an extractive question
answerer's answers (the start and end logits), a token classifier's labels (each
labelled word's, at its first token) and a masked language model's tokens (at each
mask). Each row is explained as ``explain`` explains it and scored by the token-removal
metrics, with the removed tokens replaced in place, so that the token read stays where it
is."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..metrics.registry import METRICS as METRIC_REGISTRY
from ..metrics.registry import MetricContext
from ..metrics.token_removal import shared_removals
from .dataset import PositionExample
from .display import special_tokens
from .evaluate import Options, sharded, run_manifest
from .explain import check_names, method_names
from .positions import PositionPlan, check_position_methods, score_positions
from .question_answering import ENDS, plan_question
from .token_class import plan_masks, plan_token_labels

POSITION_METRICS = ("comprehensiveness", "sufficiency", "datamodeling")
"""The metrics of a logit read at a token: ERASER's comprehensiveness and sufficiency and
the LDS, each removed token replaced by the mask token (:func:`replacement_id`)."""

EXPLAINED = {
    "question-answering": "an answer's start and end",
    "token-classification": "the word whose label is read",
    "fill-mask": "the mask whose prediction is read",
}
"""What each task explains, as the methods' refusals name it."""


def check_position_request(task: str, methods: Sequence[str], metrics: Sequence[str]) -> None:
    """Before any work, a one-line ``ValueError`` for a method or metric that cannot score
    the outputs of a model of ``task`` (the methods that remove words, the estimates of
    answers, ALTI-Logit: :func:`~captum_attention.presentation.positions.check_position_methods`)."""
    check_names("method", methods, method_names())
    check_position_methods(methods, EXPLAINED[task])
    check_names("metric", metrics, list(POSITION_METRICS))


def replacement_id(tokenizer: Any) -> int:
    """The token that replaces a removed one: the mask token (what a masked language
    model's pretraining put in place of hidden words), else the padding token; a one-line
    ``ValueError`` where the tokenizer names neither."""
    for token_id in (tokenizer.mask_token_id, tokenizer.pad_token_id):
        if token_id is not None:
            return int(token_id)
    raise ValueError("the tokenizer names neither a mask nor a padding token, which replace the tokens the metrics remove: "
                     "save the model's own tokenizer")


def plan_example(model: Any, tokenizer: Any, task: str, example: PositionExample) -> tuple[Any, list[PositionPlan]]:
    """What ``explain`` would explain of the row: the explanation without scores and its
    logits (:class:`~captum_attention.presentation.positions.PositionPlan`, one per window
    of the text that holds some); a one-line ``ValueError`` where the row cannot be
    explained."""
    named = {"question-answering": "'answer'", "token-classification": "'word'", "fill-mask": "'target'"}[task]
    if task == "question-answering":
        explanation, plan = plan_question(model, tokenizer, example.question or "", example.text, example.target, named)
        return explanation, [plan]
    if task == "token-classification":
        return plan_token_labels(model, tokenizer, example.text, example.target, named)
    return plan_masks(model, tokenizer, example.text, example.target, named)


def position_row_problem(model: Any, tokenizer: Any, task: str, example: PositionExample) -> str | None:
    """What is wrong with the row (why :func:`plan_example` refuses it), or None."""
    try:
        plan_example(model, tokenizer, task, example)
    except ValueError as error:
        return str(error)
    return None


def evaluate_positions(
    model: Any,
    tokenizer: Any,
    task: str,
    examples: Sequence[PositionExample],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: Options | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> int:
    """:func:`~captum_attention.presentation.evaluate.evaluate` for a model of ``task``
    (``"question-answering"``, ``"token-classification"``, ``"fill-mask"``): each row's
    logits explained by every method as ``explain`` explains them (the predicted answer,
    labelled words or masks' tokens, or the row's own), each logit scored by every metric
    of :data:`POSITION_METRICS` (its probability: an answer end's softmax over the context,
    a label's or token's over the classes at its token; special tokens never removed;
    removed tokens replaced by :func:`replacement_id`), a row's value of a metric the mean
    over its logits (none where it explains none: a text whose every word is labelled
    outside the entities). One example a shard, resumable, split over processes, merged by
    :func:`~captum_attention.presentation.evaluate.merge` as the classifier's are."""
    options = options or Options()
    check_position_request(task, methods, metrics)
    baseline = replacement_id(tokenizer)
    return sharded(
        Path(output), run_manifest(model, examples, methods, metrics, options), examples,
        lambda example: _example_rows(model, tokenizer, task, example, methods, metrics, options, baseline),
        process_index, num_processes, progress, on_resume,
    )


def _example_rows(
    model: Any, tokenizer: Any, task: str, example: PositionExample, methods: Sequence[str], metrics: Sequence[str],
    options: Options, baseline: int,
) -> list[dict[str, Any]]:
    """The row of each method for one example: each logit's metrics, and their means."""
    explanation, plans = plan_example(model, tokenizer, task, example)
    read = _explained_logits(task, explanation)
    logits: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    with shared_removals():
        for plan in plans:
            for method, values in _window_logits(model, tokenizer, plan, methods, metrics, options, baseline):
                logits[method] += values
    rows = []
    for method in methods:
        listed = [{**where, **values} for where, values in zip(read, logits[method])]
        means = {metric: sum(logit[metric] for logit in listed) / len(listed) if listed else None for metric in metrics}
        rows.append({"index": example.index, "line": example.line, "method": method,
                     "explained": _shown_explained(task, read), **means, "logits": listed})
    return rows


def _window_logits(
    model: Any, tokenizer: Any, plan: PositionPlan, methods: Sequence[str], metrics: Sequence[str], options: Options,
    baseline: int,
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Each method's values of each logit of one window's ``plan``: where it is read, its
    probability and each metric."""
    context = MetricContext(model, special_tokens(plan.ids, tokenizer), removal={"removal": "replace", "baseline_token_id": baseline})
    mask = plan.arguments[0]
    count = len(plan.targets)
    probabilities = [_probability(plan, k) for k in range(count)]
    forwards = [plan.target_logits(k) for k in range(count)]  # one object each: the metrics share their removals
    targets = [torch.tensor([plan.target_class(k)], device=plan.ids.device) for k in range(count)]
    for method, (_, _, _, scores) in zip(methods, score_positions(plan, methods, model, tokenizer, options.ig_steps, None, options.presence)):
        yield method, [
            {"position": plan.targets[k][0], "probability": probabilities[k],
             **{metric: float(METRIC_REGISTRY[metric].function(forwards[k], plan.ids, scores[k : k + 1], (mask,), targets[k], context)[0])
                for metric in metrics}}
            for k in range(count)
        ]


def _explained_logits(task: str, explanation: Any) -> list[dict[str, Any]]:
    """Where each logit is read (an answer's end; a word or a mask, and the window it is
    read in) and what it explains there (the answer, a label, a token), as
    ``results.jsonl`` lists them."""
    if task == "question-answering":
        return [{"at": end, "explained": explanation.answer} for end in ENDS]
    return [{"at": word.word, "window": word.window, "explained": word.label} for word in explanation.words]


def _shown_explained(task: str, read: list[dict[str, Any]]) -> str:
    """A row's explained outputs in one line: the answer, or each word's label."""
    if task == "question-answering":
        return str(read[0]["explained"])
    return "; ".join(f"{logit['at']}: {logit['explained']}" for logit in read)


def _probability(plan: PositionPlan, target: int) -> float:
    """The probability the metrics read of the ``target``-th logit, on all of its window."""
    with torch.no_grad():
        logits = plan.target_logits(target)(plan.ids, plan.arguments[0])
    return float(logits.float().softmax(-1)[0, plan.target_class(target)])
