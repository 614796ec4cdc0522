"""Explain sentences with every method, batched, timing each method."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from captum.attr import LayerIntegratedGradients

from ..attr import METHODS
from .display import special_tokens

INTEGRATED_GRADIENTS = "integrated_gradients"
"""The Captum baseline the report adds to the registered methods."""


@dataclass
class SentenceExplanation:
    """What one sentence's report shows."""

    text: str
    tokens: list[str]
    label: str
    probability: float
    target: int
    target_label: str
    special: list[bool] = field(default_factory=list)
    scores: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Explanations:
    """Explanations of a batch of sentences and each method's wall time for the batch."""

    sentences: list[SentenceExplanation]
    seconds: dict[str, float]


def resolve_target(target: str | None, id2label: dict[int, str]) -> int | None:
    """``--target`` as a class index: an index or a label name; None keeps the prediction."""
    if target is None:
        return None
    by_name = {name.lower(): index for index, name in id2label.items()}
    index = int(target) if target.lstrip("-").isdigit() else by_name.get(target.lower(), -1)
    if index not in id2label:
        labels = ", ".join(f"{i}={name}" for i, name in sorted(id2label.items()))
        raise ValueError(f"target {target!r} is not a label of this model (labels: {labels})")
    return index


Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _attention_method(explainer: Any) -> Method:
    def run(ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
        return explainer.attribute(ids, target=targets, additional_forward_args=(mask,))

    return run


def method_names() -> list[str]:
    """What ``--methods`` accepts: the registered methods, then Integrated Gradients."""
    return [*METHODS, INTEGRATED_GRADIENTS]


def _methods(model: Any, ig_steps: int, names: list[str]) -> dict[str, Method]:
    """Display name -> ``run(ids, targets, mask, ig_baseline) -> (batch, seq_len) scores``,
    for the methods ``names`` (registry names, in the registry's order)."""

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask).logits

    methods = {
        cls.get_name(): _attention_method(cls(forward, model=model)) for name, cls in METHODS.items() if name in names
    }
    if INTEGRATED_GRADIENTS in names:
        lig = LayerIntegratedGradients(forward, model.get_input_embeddings())

        def integrated_gradients(
            ids: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor
        ) -> torch.Tensor:
            return lig.attribute(
                ids, baselines=baseline, target=targets, additional_forward_args=(mask,), n_steps=ig_steps
            ).sum(dim=-1)

        methods["Integrated Gradients"] = integrated_gradients
    return methods


def _baseline(ids: torch.Tensor, tokenizer: Any) -> torch.Tensor:
    """IG baseline: special tokens kept, every other token replaced by padding."""
    return torch.where(special_tokens(ids, tokenizer), ids, torch.full_like(ids, tokenizer.pad_token_id))


def explain(
    model: Any,
    tokenizer: Any,
    sentences: list[str],
    target: int | None = None,
    ig_steps: int = 50,
    max_length: int = 128,
    methods: list[str] | None = None,
) -> Explanations:
    """Run each method (by registry name, see :func:`method_names`; default: all) on
    ``sentences`` in one batch each."""
    encoded = tokenizer(sentences, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    with torch.no_grad():
        probabilities = model(input_ids=ids, attention_mask=mask).logits.softmax(dim=-1)
    predicted = probabilities.argmax(dim=-1)
    targets = predicted if target is None else torch.full_like(predicted, target)
    id2label = model.config.id2label
    results = [
        SentenceExplanation(
            text=text,
            tokens=tokenizer.convert_ids_to_tokens(ids[row, : int(mask[row].sum())].tolist()),
            label=id2label[int(predicted[row])],
            probability=float(probabilities[row, predicted[row]]),
            target=int(targets[row]),
            target_label=id2label[int(targets[row])],
            special=[i in tokenizer.all_special_ids for i in ids[row, : int(mask[row].sum())].tolist()],
        )
        for row, text in enumerate(sentences)
    ]
    baseline = _baseline(ids, tokenizer)
    seconds = {}
    for name, method in _methods(model, ig_steps, methods or method_names()).items():
        start = time.perf_counter()
        scores = method(ids, targets, mask, baseline).detach()
        seconds[name] = time.perf_counter() - start
        for row, result in enumerate(results):
            result.scores[name] = scores[row, : len(result.tokens)].tolist()
    return Explanations(results, seconds)
