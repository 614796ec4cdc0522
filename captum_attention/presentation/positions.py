"""The methods of the reports that explain a logit read at one token of each example: an
extractive answer's start or end, a token classifier's label of one word, a masked language
model's token at one mask."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence, Union

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


def forward_inputs(encoded: Any, model: Any) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """The names and tensors of what a tokenizer gave beside the ids that the model reads
    (the attention mask first, then the token types where it gives them and the model
    takes them)."""
    takes = inspect.signature(model.forward).parameters
    names = [name for name in ("attention_mask", "token_type_ids") if name in encoded and name in takes]
    return names, tuple(encoded[name] for name in names)


def check_fast(tokenizer: Any, needs: str) -> None:
    """A one-line ``ValueError`` where ``tokenizer`` is a slow one, without the offsets and
    word ids that ``needs`` (what they are needed for, for the message)."""
    if not tokenizer.is_fast:
        raise ValueError(f"{needs} a fast tokenizer's offsets and word ids: save the tokenizer with "
                         "AutoTokenizer.from_pretrained(..., use_fast=True)")
