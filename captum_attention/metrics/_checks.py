"""Checks shared by the metrics: arguments that are tensors, scores as Captum returns them,
scores that can be ranked, in rows that have tokens."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

Metric = TypeVar("Metric", bound=Callable[..., Any])

_NOT_PROBABILITIES = {
    "regression": "a regression model's scores are no probabilities",
    "multi_label_classification": (
        "a multi-label model's labels each have their own sigmoid, which a softmax over the labels would mix: score one "
        "label with a forward_func that returns its logit alone (read as its sigmoid)"
    ),
}


def check_class_probabilities(forward_func: Any, fix: str = "") -> None:
    """A one-line error where ``forward_func`` is a classifier whose outputs the metrics
    cannot read as the explained class's probability (its config's ``problem_type``): a
    regression model's scores, a multi-label model's labels; ``fix`` ends the line."""
    problem = getattr(getattr(forward_func, "config", None), "problem_type", None)
    if problem in _NOT_PROBABILITIES:
        raise ValueError(
            f"the metrics compare the explained class's probability, and {type(forward_func).__name__} is configured "
            f"with problem_type {problem!r}: {_NOT_PROBABILITIES[problem]}{fix}."
        )


def check_tensors(**named: Any) -> None:
    """A one-line ``TypeError`` naming the arguments of ``named`` that are not tensors (a
    tokenizer's lists, without ``return_tensors='pt'``)."""
    given = [f"{name} ({type(value).__name__})" for name, value in named.items() if not isinstance(value, Tensor)]
    if given:
        raise TypeError(
            f"{', '.join(given)} must be tensors (batch, seq_len): give torch tensors, e.g. tokenizer(..., "
            "return_tensors='pt')."
        )


def check_mask(attention_mask: Tensor, scores: str = "attributions") -> None:
    """A one-line error where ``attention_mask`` holds values other than 0 and 1: scores
    (called ``scores``) given in its place, which have its shape and which the model would
    read as a mask."""
    wrong = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
    if wrong.numel():
        raise ValueError(
            f"attention_mask holds values other than 0 and 1 (e.g. {wrong[0].item():.4g}): give the tokenizer's mask; "
            f"are attention_mask and {scores} swapped? The mask comes first, after input_ids."
        )


def check_per_token(scores: Tensor, ids: Tensor, name: str = "attributions", inputs: str = "inputs") -> None:
    """A clear error where ``scores`` (called ``name``) are not one score per token of
    ``ids`` (called ``inputs``); scores per embedding dimension, as Captum's layer
    attributions (``LayerIntegratedGradients``) give them, are told to be summed, and
    scores over more tokens (an answer's span, prompt and answer) to be cut to the prompt."""
    if tuple(scores.shape) == tuple(ids.shape):
        return
    hint = ""
    if scores.dim() == ids.dim() + 1 and tuple(scores.shape[:-1]) == tuple(ids.shape):
        hint = f" (these are per embedding dimension, as Captum's layer attributions give them: {name}.sum(-1))"
    elif scores.dim() == ids.dim() == 2 and scores.shape[0] == ids.shape[0] and scores.shape[1] > ids.shape[1]:
        hint = f" (an answer's span scores cover the prompt and the answer: give the prompt's, {name}[:, :{ids.shape[1]}])"
    raise ValueError(
        f"{name} of shape {tuple(scores.shape)}, but the {inputs} are {tuple(ids.shape)}: give one score per token{hint}."
    )


def check_rankable(scores: Tensor, include: Tensor, name: str = "attributions", finite: bool = False) -> None:
    """A clear error for NaN among the ``include``\\ d scores (a NaN has no rank), with
    ``finite`` for ±inf too (where the metric ranks tokens against excluded ones, which
    it places at -inf), and for rows with nothing included (nothing to rank)."""
    nan_rows = (scores.isnan() & include).any(dim=1).nonzero().flatten().tolist()
    if nan_rows:
        raise ValueError(
            f"{name} hold NaN in examples {nan_rows}: a NaN has no rank. Replace it (e.g. "
            "torch.nan_to_num) or leave those examples out."
        )
    infinite_rows = (scores.isinf() & include).any(dim=1).nonzero().flatten().tolist() if finite else []
    if infinite_rows:
        raise ValueError(
            f"{name} hold ±inf in examples {infinite_rows}: an infinite score ties with the "
            "tokens this metric never removes. Give finite scores (e.g. torch.nan_to_num with "
            "posinf/neginf set to the largest and smallest finite score)."
        )
    empty_rows = (~include.any(dim=1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(
            f"Examples {empty_rows} have no token to rank (all padding, or all excluded): "
            "leave them out of the batch."
        )


def with_ties(scores: Tensor, counts: Tensor) -> Tensor:
    """``counts`` ``(B, F)`` of top-scored tokens per example, each raised to include every
    token tied with the last one counted (``scores`` ``(B, T)``, excluded tokens at -inf),
    so that a cut never splits tied tokens by their position."""
    ordered = scores.sort(dim=1, descending=True).values
    cut = ordered.gather(1, (counts - 1).clamp(min=0))  # (B, F): the last counted score
    tied = (scores[:, None, :] >= cut[:, :, None]).sum(dim=-1)
    return torch.where(counts > 0, torch.maximum(counts, tied), counts)


def takes_captum_scores(*names: str) -> Callable[[Metric], Metric]:
    """Decorator: the metric's score arguments ``names`` may be what Captum's
    ``attribute`` returns for a tuple of inputs, a tuple of one tensor (taken as that
    tensor); a tuple of more is refused in one line, naming the one to pass."""

    def decorate(metric: Metric) -> Metric:
        signature = inspect.signature(metric)

        @functools.wraps(metric)
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            for name in names:
                if isinstance(bound.arguments.get(name), tuple):
                    bound.arguments[name] = _one_tensor(bound.arguments[name], name)
            return metric(*bound.args, **bound.kwargs)

        return run  # type: ignore[return-value]

    return decorate


def _one_tensor(scores: tuple, name: str) -> Any:
    if len(scores) == 1:
        return scores[0]
    raise ValueError(
        f"{name} is a tuple of {len(scores)}, as Captum returns scores for a tuple of inputs; this metric takes one "
        f"(batch, tokens) tensor: pass the scores of the input it removes from (an encoder-decoder's source scores: "
        f"{name}[0])."
    )
