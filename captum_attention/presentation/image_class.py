"""Explain an image classifier's prediction (ViT, DeiT, BEiT, Swin, ...) of one image with
every method, on the image's patch grid."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..attr import REGISTRY, pixel_scores
from ..capture.inputs import output_logits
from .answer import grey_image_warning, grey_pixels, grid_over_image, processed_pixels
from .explain import (
    CLASSIFIERS_ONLY, ESTIMATES_OF_ANSWERS, IG_TOKENS_PER_BATCH, INTEGRATED_GRADIENTS, PRESENCE, SIGNED, MethodInfo, check_methods,
    class_outputs, default_method_names, registered_method,
)


@dataclass
class ImageClassExplanation:
    """What the report of an image classifier's prediction shows.

    Attributes:
        image: the image file.
        label: the explained class's name.
        predicted: the predicted class's name.
        probability: the explained class's probability (a multi-label model's sigmoid, a
            regression model's score), as transformers' pipeline reads it.
        reads: what ``probability`` is: ``"p"``, or ``"score"`` for a regression model.
        given: whether the class was given (``--target``) rather than predicted.
        grids: method -> its scores of the image's patches on their grid (rows of columns).
        seconds: method -> wall time.
        methods: method -> how to read its scores.
        grid_covers_image: whether the grid's shape follows the image's (its cells can be
            laid over the image: a processor that resizes it whole).
        warnings: what the reader should know (the grey image Integrated Gradients starts
            from given as the image).
    """

    image: str
    label: str
    predicted: str
    probability: float
    reads: str
    given: bool
    grids: dict[str, list[list[float]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    grid_covers_image: bool = True
    warnings: list[str] = field(default_factory=list)


def image_class_method_names() -> list[str]:
    """The methods that explain an image classifier's class: the registered methods that
    explain a classifier's logit, and Integrated Gradients on the pixels."""
    return [*(name for name, cls in REGISTRY.items() if cls.spec.classifiers), INTEGRATED_GRADIENTS]


def check_image_class_methods(names: Sequence[str]) -> None:
    """A one-line ``ValueError`` where a method of ``names`` explains text alone: AttnLRP
    at a presence and its refinements (the presence of words), and the estimates of a
    language model's answers; the others as :func:`check_methods` checks a classifier's."""
    textual = [name for name in names if name in (PRESENCE, *CLASSIFIERS_ONLY, *ESTIMATES_OF_ANSWERS)]
    if textual:
        raise ValueError(
            f"{', '.join(textual)} explain text, not an image's patches; choose --methods among {', '.join(image_class_method_names())}"
        )
    check_methods(names, answers=False)


def explain_image_class(
    model: Any, image_processor: Any, image_path: str, target: int | None = None, methods: list[str] | None = None,
    ig_steps: int = 50,
) -> ImageClassExplanation:
    """An image classifier's prediction for the image at ``image_path`` (or the class
    ``target``), explained by each method on the image's patch grid: each registered
    method's ``attribute(pixel_values, target=...)``, and ``integrated_gradients``,
    Captum's ``IntegratedGradients`` of the class's logit on the pixels against a uniform
    grey image of the same size through the same processor (``ig_steps`` steps), summed
    per patch (:func:`~captum_attention.pixel_scores`)."""
    from PIL import Image

    chosen = methods or default_method_names()
    check_image_class_methods(chosen)
    with Image.open(image_path) as picture:
        image = picture.convert("RGB")
    pixels = processed_pixels(model, image_processor, image)
    with torch.no_grad():
        outputs = class_outputs(model.config, output_logits(model(pixel_values=pixels)))[0]
    predicted = int(outputs.argmax())
    label = predicted if target is None else target
    names = model.config.id2label
    grey = grey_pixels(model, image_processor, image.size) if INTEGRATED_GRADIENTS in chosen else None
    reads = "score" if getattr(model.config, "problem_type", None) == "regression" else "p"
    explanation = ImageClassExplanation(
        image=str(image_path), label=names[label], predicted=names[predicted], probability=float(outputs[label]), reads=reads,
        given=target is not None, warnings=grey_image_warning(pixels, grey),
    )
    for name in chosen:
        start = time.perf_counter()
        if name == INTEGRATED_GRADIENTS:
            assert grey is not None  # made where Integrated Gradients is chosen
            grid = image_integrated_gradients(model, pixels, grey, torch.tensor([label]), ig_steps)[0]
            info, display = SIGNED, "Integrated Gradients"
        else:
            explainer = registered_method(name, model)
            grid, info, display = explainer.attribute(pixels, target=label)[0], MethodInfo.of(explainer), explainer.get_name()
        explanation.seconds[display] = time.perf_counter() - start
        explanation.methods[display] = info
        explanation.grids[display] = grid.detach().float().tolist()
    explanation.grid_covers_image = grid_over_image(next(iter(explanation.grids.values())), image.size, image_processor)
    return explanation


def image_integrated_gradients(
    model: Any, pixels: torch.Tensor, grey: torch.Tensor, labels: torch.Tensor, steps: int
) -> torch.Tensor:
    """``(B, rows, columns)``: Captum's ``IntegratedGradients`` of each image's ``labels``
    logit on its ``pixels`` ``(B, channels, height, width)`` against the ``grey`` ones (one
    image, or one per image), ``steps`` steps, summed per patch
    (:func:`~captum_attention.pixel_scores`); at most :data:`IG_TOKENS_PER_BATCH` patch
    tokens a forward."""
    from captum.attr import IntegratedGradients

    def logits(images: torch.Tensor) -> torch.Tensor:
        return output_logits(model(pixel_values=images))

    patch = getattr(model.config, "patch_size", None)
    tokens = pixels.shape[-2] * pixels.shape[-1] // (patch if isinstance(patch, int) else 16) ** 2 + 1
    per_batch = max(1, min(steps * len(pixels), IG_TOKENS_PER_BATCH // tokens))
    gradients = IntegratedGradients(logits).attribute(
        pixels, baselines=grey.to(pixels.device, pixels.dtype).expand_as(pixels), target=labels.to(pixels.device), n_steps=steps,
        internal_batch_size=per_batch,
    )
    return torch.stack(pixel_scores(model, gradients.detach()))
