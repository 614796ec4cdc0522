"""Coloured squares: a small ViT trained on images whose decisive patches are known.

Noisy grey 32×32 images hold one 8×8 square at a random place, red (class 0) or green
(class 1), or no square (class 2, in training only, so that the model must find the
square rather than the absence of the other colour). The ViT (4×4 patches, 3 layers,
hidden 64, 4 heads) learns it in seconds on two CPU cores; the one ``ShapeTraining()``
gives ships with the package, any other is trained on first use and cached like the
default model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .default_model import cached_trained_model, measured, optimiser_step

LABELS = ("red", "green", "none")
IMAGE, PATCH, SQUARE = 32, 4, 8
MODEL_NAME = "coloured-squares-vit-v1"
HELDOUT_SEED = 2


@dataclass(frozen=True)
class ShapeTraining:
    """How the ViT is trained: images, epochs, batch size, learning rate, seed."""

    train_size: int = 3000
    epochs: int = 3
    batch_size: int = 64
    learning_rate: float = 1e-3
    seed: int = 0


COLOURS = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))
"""Red, green, blue: the squares' colours, by label."""


def shape_images(count: int, seed: int, with_none: bool = False, colours: int = 2) -> tuple[Tensor, Tensor, Tensor]:
    """``(images (B, 3, 32, 32) in [0, 1], labels (B,), squares (B, 8, 8) bool)``: the
    patches each square covers; the same for the same seed. Labels ``0 .. colours - 1``
    index :data:`COLOURS` (red and green by default); with ``with_none``, label
    ``colours`` is an image without a square."""
    generator = torch.Generator().manual_seed(seed)
    images = (0.5 + 0.1 * torch.randn(count, 3, IMAGE, IMAGE, generator=generator)).clamp(0, 1)
    labels = torch.randint(0, colours + with_none, (count,), generator=generator)
    corners = torch.randint(0, IMAGE - SQUARE + 1, (count, 2), generator=generator)
    grid = IMAGE // PATCH
    squares = torch.zeros(count, grid, grid, dtype=torch.bool)
    for row, (top, left) in enumerate(corners.tolist()):
        if labels[row] == colours:
            continue
        colour = torch.tensor(COLOURS[int(labels[row])])
        images[row, :, top : top + SQUARE, left : left + SQUARE] = colour[:, None, None]
        squares[row, top // PATCH : (top + SQUARE - 1) // PATCH + 1, left // PATCH : (left + SQUARE - 1) // PATCH + 1] = True
    return images, labels, squares


def new_shape_vit(seed: int = 0) -> Any:
    """The untrained ``ViTForImageClassification``."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=64, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=128,
        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)},
    )
    return ViTForImageClassification(config)


def train_shape_vit(training: ShapeTraining = ShapeTraining()) -> tuple[Any, float]:
    """A ViT trained on :func:`shape_images` (squares and empty images), in eval mode, and
    the seconds it took."""
    images, labels, _ = shape_images(training.train_size, seed=training.seed + 1, with_none=True)

    def loss(model: Any, batch: Tensor, targets: Tensor) -> Tensor:
        return torch.nn.functional.cross_entropy(model(pixel_values=batch).logits, targets)

    return train_on_images(new_shape_vit(training.seed), images, labels, loss, training)


def train_on_images(
    model: Any, images: Tensor, labels: Tensor, loss: Callable[[Any, Tensor, Tensor], Tensor], training: ShapeTraining
) -> tuple[Any, float]:
    """``model`` trained with AdamW on ``loss(model, images, labels)`` over shuffled
    batches for ``training.epochs``, in eval mode, and the seconds it took."""
    parameters = list(model.parameters())
    optimiser = torch.optim.AdamW(parameters, lr=training.learning_rate)
    generator = torch.Generator().manual_seed(training.seed)
    start = time.perf_counter()
    model.train()
    for _ in range(training.epochs):
        for rows in torch.randperm(len(images), generator=generator).split(training.batch_size):
            optimiser_step(optimiser, loss(model, images[rows], labels[rows]), parameters)
    return model.eval(), time.perf_counter() - start


def shape_accuracy(model: Any, images: Tensor, labels: Tensor) -> float:
    """Fraction of ``images`` whose label the model predicts."""
    with torch.no_grad():
        return float((model(pixel_values=images).logits.argmax(-1) == labels).float().mean())


def load_shape_vit(
    cache_dir: str | os.PathLike[str] | None = None,
    training: ShapeTraining = ShapeTraining(),
    progress: bool = True,
    trained_here: bool = False,
) -> Any:
    """The trained coloured-squares ViT (eval mode): the shipped one
    (:data:`~captum_attention.demo.default_model.SHIPPED`) for ``ShapeTraining()``, else
    trained on first use and cached.

    Args:
        cache_dir (path, optional): cache root, for a model trained here. Default: None.
        training (ShapeTraining, optional): how to train it. Default: ``ShapeTraining()``.
        progress (bool, optional): print the accuracy when training. Default: True.
        trained_here (bool, optional): train (and cache) the model on this machine even
            where the shipped one is the one asked for. Default: False.

    Returns:
        ``ViTForImageClassification`` with labels :data:`LABELS`.
    """
    from transformers import ViTForImageClassification

    return cached_trained_model(
        MODEL_NAME,
        training,
        lambda: measured(
            "coloured squares ViT", lambda: train_shape_vit(training),
            lambda model: shape_accuracy(model, *shape_images(500, HELDOUT_SEED)[:2]), progress,
        ),
        ViTForImageClassification,
        cache_dir,
        progress,
        trained_here=trained_here,
    )
