"""The methods of the reports that explain a logit read at one token of each example: an
extractive answer's start or end, a token classifier's label of one word, a masked language
model's token at one mask."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from captum.attr import LayerIntegratedGradients

from .explain import (
    CLASSIFIERS_ONLY, INTEGRATED_GRADIENTS, PRESENCE, SIGNED, MethodInfo, check_methods, ig_baseline, presence_display,
    presence_weights, registered_method,
)

Target = Union[list[int], list[tuple[int, int]]]
"""Captum's ``target`` per example: a position of ``(batch, tokens)`` logits, or a
``(position, class)`` of ``(batch, tokens, classes)`` ones."""

Run = Callable[[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...], Target, list[int]], torch.Tensor]
"""How a method explains ``forward``'s logits at each example's position:
``run(forward, ids, arguments, target, positions)``, a score per token, ``(batch, tokens)``;
``arguments``: the attention mask first, then the other inputs ``forward`` takes."""


@dataclass
class PositionPlan:
    """The logits a report explains at tokens of one text, each read at one token.

    Attributes:
        ids: ``(1, tokens)``, the tokens the model reads.
        arguments: ``(1, tokens)`` each, what ``forward`` takes beside the ids: the
            attention mask first, then the token types where the model takes them.
        forward: ``forward(ids, *arguments)``, the logits ``(batch, tokens, classes)``.
        targets: each explained logit's ``(position, class)``.
        candidates: ``(tokens,)`` bool, where a logit's probability is its softmax over
            these tokens (an answer's start or end over the context's tokens: the class is
            which end); None: over the classes at its position (a word's label, a mask's
            token).
    """

    ids: torch.Tensor
    arguments: tuple[torch.Tensor, ...]
    forward: Callable[..., torch.Tensor]
    targets: list[tuple[int, int]]
    candidates: torch.Tensor | None = None

    @property
    def positions(self) -> list[int]:
        """The token each logit is read at."""
        return [position for position, _ in self.targets]

    def target_logits(self, target: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``forward(ids, attention_mask)`` of the ``target``-th logit's classes,
        ``(batch, classes)`` (the tokens, those outside :attr:`candidates` at -inf), the
        other inputs as the text's own: what the token-removal metrics read with the tokens
        replaced in place; its class is :meth:`target_class`."""
        position, index = self.targets[target]
        candidates = self.candidates

        def forward(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            others = tuple(argument.expand(len(ids), -1) for argument in self.arguments[1:])
            logits = self.forward(ids, attention_mask, *others)
            if candidates is None:
                return logits[:, position]
            return logits[:, :, index].masked_fill(~candidates.to(logits.device), float("-inf"))

        return forward

    def target_class(self, target: int) -> int:
        """The class :meth:`target_logits` reads of the ``target``-th logit."""
        position, index = self.targets[target]
        return index if self.candidates is None else position


def score_positions(
    plan: PositionPlan, names: Sequence[str], model: Any, tokenizer: Any, ig_steps: int, ig_batch_size: int | None,
    presence: float,
) -> Iterator[tuple[str, MethodInfo, float, torch.Tensor]]:
    """Each method's shown name, how to read it, its wall time and its scores of every
    logit of ``plan``, ``(targets, tokens)``, all the logits in one batch
    (:func:`position_method`)."""
    count = len(plan.targets)
    for name in names:
        display, info, run = position_method(name, model, tokenizer, ig_steps, ig_batch_size, presence)
        begin = time.perf_counter()
        scores = run(plan.forward, plan.ids.expand(count, -1), tuple(a.expand(count, -1) for a in plan.arguments),
                     plan.targets, plan.positions)
        yield display, info, time.perf_counter() - begin, scores.detach().float()


def check_position_methods(names: Sequence[str], explained: str) -> None:
    """A one-line ``ValueError`` where a method of ``names`` cannot explain a logit read at
    a token (``explained``: what it is, for the message): those
    :func:`~captum_attention.presentation.explain.check_methods` refuses for a classifier,
    and the presence's refinements, whose removals of words move the token explained."""
    refined = [name for name in names if name in CLASSIFIERS_ONLY]
    if refined:
        raise ValueError(
            f"{', '.join(refined)} explain a classifier's prediction: their removals of words move {explained}; leave "
            f"{'it' if len(refined) == 1 else 'them'} out"
        )
    check_methods(names, answers=False)


def position_method(
    name: str, model: Any, tokenizer: Any, ig_steps: int, ig_batch_size: int | None, presence: float
) -> tuple[str, MethodInfo, Run]:
    """The method ``name``'s shown name, how to read it, and how to run it at a position
    (:data:`Run`): each registered method's ``attribute(ids, target=target,
    query_index=positions)``; Integrated Gradients, Captum's ``LayerIntegratedGradients``
    on the word embeddings against padding, special tokens kept, ``ig_steps`` steps;
    :data:`~captum_attention.presentation.explain.PRESENCE`, AttnLRP with the words at
    ``presence``."""
    if name == INTEGRATED_GRADIENTS:
        def integrated_gradients(
            forward: Callable[..., torch.Tensor], ids: torch.Tensor, arguments: tuple[torch.Tensor, ...], target: Target,
            positions: list[int],
        ) -> torch.Tensor:
            return LayerIntegratedGradients(forward, model.get_input_embeddings()).attribute(
                ids, baselines=ig_baseline(ids, tokenizer), target=target, additional_forward_args=arguments,
                n_steps=ig_steps, internal_batch_size=ig_batch_size,
            ).sum(dim=-1)

        return "Integrated Gradients", SIGNED, integrated_gradients
    registered = "attn_lrp" if name == PRESENCE else name

    def attention(
        forward: Callable[..., torch.Tensor], ids: torch.Tensor, arguments: tuple[torch.Tensor, ...], target: Target,
        positions: list[int],
    ) -> torch.Tensor:
        options = {"presence": presence_weights(ids, arguments[0], tokenizer, presence)} if name == PRESENCE else {}
        return registered_method(registered, model, forward).attribute(
            ids, target=target, query_index=positions, additional_forward_args=arguments, **options
        )

    shown = registered_method(registered, model)
    return presence_display(presence) if name == PRESENCE else shown.get_name(), MethodInfo.of(shown), attention


def output_forward(model: Any, output: str, inputs: Sequence[str]) -> Callable[..., torch.Tensor]:
    """``forward(ids, *arguments)``: the model's ``output`` (``"logits"``,
    ``"start_logits"``, ...), the ``arguments`` passed as the model's ``inputs`` by name."""

    def forward(ids: torch.Tensor, *arguments: torch.Tensor) -> torch.Tensor:
        return getattr(model(input_ids=ids, **dict(zip(inputs, arguments))), output)

    return forward


def forward_inputs(encoded: Any, model: Any, row: int | None = None) -> tuple[list[str], torch.Tensor, tuple[torch.Tensor, ...]]:
    """The names of what a tokenizer gave beside the ids that the model reads (the
    attention mask first, then the token types where it gives them and the model takes
    them), the ids and those tensors, on the model's device; given ``row``, that row of an
    unpadded batch of lists (one window of several), ``(1, tokens)``."""
    takes = inspect.signature(model.forward).parameters
    names = [name for name in ("attention_mask", "token_type_ids") if name in encoded and name in takes]
    device = next((parameter.device for parameter in model.parameters()), torch.device("cpu"))

    def placed(given: Any) -> torch.Tensor:
        return (given if row is None else torch.tensor(given[row])[None]).to(device)

    return names, placed(encoded["input_ids"]), tuple(placed(encoded[name]) for name in names)


def check_fast(tokenizer: Any, needs: str) -> None:
    """A one-line ``ValueError`` where ``tokenizer`` is a slow one, without the offsets and
    word ids that ``needs`` (what they are needed for, for the message)."""
    if not tokenizer.is_fast:
        raise ValueError(f"{needs} a fast tokenizer's offsets and word ids: save the tokenizer with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)")
