"""Key-value recall: a tiny Llama trained on a task whose decisive earlier token is known.

A sequence lists key-value pairs, one token each, then asks for keys:
``c=7 a=3 f=1 b=9 ; a 3 f 1``. After each asked key the next token is that key's value,
which only the pair earlier in the sequence tells: the decisive token of each prediction
is known. The model (2 layers,
hidden 64, 4 heads, 2 key-value heads) learns the task in well under a minute on two CPU
cores; the one ``RecallTraining()`` gives ships with the package, any other is trained on
first use and cached like the default model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .default_model import cached_trained_model, optimiser_step

KEYS = "abcdefghijklmnop"
VALUES = "0123456789"
VOCAB = ["<pad>", ";"] + list(KEYS) + list(VALUES) + [f"{k}={v}" for k in KEYS for v in VALUES]
PAD, ASK = 0, 1
MODEL_NAME = "key-value-recall-v1"
HELDOUT_SEED = 999_999  # training batches use seeds from 1 on


@dataclass(frozen=True)
class RecallTraining:
    """How the recall model is trained.

    Attributes:
        pairs: key-value pairs per sequence.
        asked: keys asked per sequence.
        steps: optimiser steps.
        batch_size: sequences per step.
        learning_rate: AdamW learning rate.
        seed: seed of the data and the initial weights.
    """

    pairs: int = 4
    asked: int = 2
    steps: int = 600
    batch_size: int = 128
    learning_rate: float = 3e-3
    seed: int = 0


@dataclass
class RecallBatch:
    """Sequences of the task.

    Attributes:
        input_ids: ``(B, T)`` the pair tokens, ``;``, then each asked key and its value.
        answer_positions: ``(B, asked)`` positions of the asked keys: the next token after
            each is its value.
        answers: ``(B, asked)`` the values' token ids.
        decisive: ``(B, asked, T)`` bool, the pair token of each asked key.
    """

    input_ids: Tensor
    answer_positions: Tensor
    answers: Tensor
    decisive: Tensor


def recall_batch(count: int, training: RecallTraining = RecallTraining(), seed: int = 0) -> RecallBatch:
    """``count`` sequences of the task, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.stack([torch.randperm(len(KEYS), generator=generator)[: training.pairs] for _ in range(count)])
    values = torch.randint(len(VALUES), (count, training.pairs), generator=generator)
    asked = torch.stack([torch.randperm(training.pairs, generator=generator)[: training.asked] for _ in range(count)])
    pairs = 2 + len(KEYS) + len(VALUES) + keys * len(VALUES) + values
    answers = values.gather(1, asked) + 2 + len(KEYS)
    questions = torch.stack([keys.gather(1, asked) + 2, answers], dim=2).flatten(1)
    input_ids = torch.cat([pairs, torch.full((count, 1), ASK), questions], dim=1)
    answer_positions = training.pairs + 1 + 2 * torch.arange(training.asked).expand(count, -1)
    decisive = torch.zeros(count, training.asked, input_ids.shape[1], dtype=torch.bool)
    decisive.scatter_(2, asked[..., None], True)
    return RecallBatch(input_ids, answer_positions, answers, decisive)


def decode(input_ids: Tensor) -> list[str]:
    """The tokens of one sequence as text."""
    return [VOCAB[int(i)] for i in input_ids]


def _new_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def recall_accuracy(model: Any, batch: RecallBatch) -> float:
    """Fraction of the asked keys whose value the model predicts."""
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    predicted = logits.gather(1, batch.answer_positions[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
    return float((predicted == batch.answers).float().mean())


def _train(training: RecallTraining, progress: bool) -> tuple[Any, dict[str, Any]]:
    model = _new_model(training.seed)
    parameters = list(model.parameters())
    optimiser = torch.optim.AdamW(parameters, lr=training.learning_rate)
    start = time.perf_counter()
    model.train()
    for step in range(training.steps):
        batch = recall_batch(training.batch_size, training, seed=training.seed * 1_000_003 + step + 1)
        logits = model(batch.input_ids).logits
        at_answers = logits.gather(1, batch.answer_positions[..., None].expand(-1, -1, logits.shape[-1]))
        loss = torch.nn.functional.cross_entropy(at_answers.flatten(0, 1), batch.answers.flatten())
        optimiser_step(optimiser, loss, parameters)
    model.eval()
    accuracy = recall_accuracy(model, recall_batch(1000, training, seed=HELDOUT_SEED))
    if progress:
        print(f"key-value recall: accuracy {accuracy:.1%} after {training.steps} steps", flush=True)
    return model, {"accuracy": accuracy, "training_seconds": round(time.perf_counter() - start, 1)}


def load_recall_model(
    cache_dir: str | os.PathLike[str] | None = None,
    training: RecallTraining = RecallTraining(),
    progress: bool = True,
    trained_here: bool = False,
) -> Any:
    """The trained key-value recall model (``LlamaForCausalLM``, eval mode): the shipped one
    (:data:`~captum_attention.demo.default_model.SHIPPED`) for ``RecallTraining()``, else
    trained on first use and cached under :func:`~captum_attention.demo.cache_root`.

    Args:
        cache_dir (path, optional): cache root, for a model trained here. Default: None.
        training (RecallTraining, optional): how to train it. Default: ``RecallTraining()``.
        progress (bool, optional): print the accuracy when training. Default: True.
        trained_here (bool, optional): train (and cache) the model on this machine even
            where the shipped one is the one asked for. Default: False.

    Returns:
        ``LlamaForCausalLM``; its vocabulary is :data:`VOCAB`.
    """
    from transformers import LlamaForCausalLM

    return cached_trained_model(
        MODEL_NAME, training, lambda: _train(training, progress), LlamaForCausalLM, cache_dir, progress,
        trained_here=trained_here,
    )
