"""A needle in a long context: a tiny causal LM that retrieves a value from contexts of any
length, and the task's examples with their known answer.

A context of filler words holds several key-value pairs (``k3=v7``, one token each), then
``?`` and a key; the answer is that key's value, so the decisive token of the answer, the
needle, is known. The model: a 2-layer Llama (hidden 64, 4 heads, 2 key-value heads)
without position encoding (its rotary frequencies set to 0, every rotation the identity),
so that the lookup is by content and holds beyond the lengths it is trained on: contexts
of 16 to 64 tokens first, then up to 512, then up to 2,048. It answers 97-100% of held-out
contexts from 512 to 16,384 tokens.

The model that ``NeedleTraining()`` trains ships with the package (:data:`CHECKPOINT`), so
that every machine loads the same weights: training on another kind of CPU can give
weights that differ in their last bits, and through 1,500 steps of training a different
model (on one such machine Feature Ablation's LDS on the needle benchmark at 2,048 tokens
came out 0.845, not 0.892). Any other training, or ``trained_here=True``, trains on this
machine (a few minutes on two CPU cores) and caches the model like the default one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .default_model import SHIPPED, cached_trained_model, optimiser_step, progress_bar

FILLER = [f"f{i}" for i in range(64)]
KEYS = [f"k{i}" for i in range(32)]
VALUES = [f"v{i}" for i in range(10)]
WORDS = ["<pad>", "<s>", "?", *FILLER, *KEYS, *VALUES, *(f"{k}={v}" for k in KEYS for v in VALUES)]
"""The vocabulary: padding, BOS, ``?``, filler words, keys, values, then every pair."""
PAD, BOS, ASK = 0, 1, 2
FIRST_KEY = 3 + len(FILLER)
FIRST_VALUE = FIRST_KEY + len(KEYS)
FIRST_PAIR = FIRST_VALUE + len(VALUES)
FILLER_RUN = 32
"""The most filler words one segment holds."""
MODEL_NAME = "needle-nope-v1"
CHECKPOINT = SHIPPED / MODEL_NAME
"""The folder of the shipped model, the one ``NeedleTraining()`` trains, with its
configuration, weights and tokenizer, and in ``metadata.json`` the training's settings,
its accuracy and each file's digest; a checkpoint that ``from_pretrained`` and the
command line take."""


@dataclass(frozen=True)
class NeedleTraining:
    """How the needle model is trained.

    Attributes:
        pairs: key-value pairs per context.
        phases: ``(steps, shortest, longest, batch size)`` per phase: the context lengths
            (tokens in all) drawn for each step grow from phase to phase, so that the
            lookup is learned on short contexts first.
        learning_rate: AdamW learning rate.
        seed: seed of the data and the initial weights.
    """

    pairs: int = 8
    phases: tuple[tuple[int, int, int, int], ...] = ((600, 16, 64, 64), (600, 32, 512, 32), (300, 512, 2048, 8))
    learning_rate: float = 1e-3
    seed: int = 0


@dataclass
class NeedleExample:
    """One context and its known answer.

    Attributes:
        input_ids: ``(length,)`` BOS, the context, ``?`` and the asked key.
        answer: the asked key's value token.
        segments: ``(length,)`` the segment of each token: each pair its own, each run of
            up to :data:`FILLER_RUN` filler words one; -1 for BOS, ``?`` and the key.
        needle: the asked key's pair's segment.
        needle_position: its position in ``input_ids``.
    """

    input_ids: Tensor
    answer: int
    segments: Tensor
    needle: int
    needle_position: int


def needle_example(length: int, generator: torch.Generator, pairs: int = 8) -> NeedleExample:
    """A context of ``length`` tokens in all (at least ``pairs + 3``)."""
    if length < pairs + 3:
        raise ValueError(f"a context of {pairs} pairs needs at least {pairs + 3} tokens, got {length}.")
    context = length - 3
    keys = torch.randperm(len(KEYS), generator=generator)[:pairs]
    values = torch.randint(len(VALUES), (pairs,), generator=generator)
    places = torch.randperm(context, generator=generator)[:pairs].sort().values
    tokens = 3 + torch.randint(len(FILLER), (context,), generator=generator)
    tokens[places] = FIRST_PAIR + keys * len(VALUES) + values
    asked = int(torch.randint(pairs, (1,), generator=generator))
    ids = torch.cat([torch.tensor([BOS]), tokens, torch.tensor([ASK, FIRST_KEY + int(keys[asked])])])
    is_pair = torch.zeros(context, dtype=torch.bool)
    is_pair[places] = True
    starts = is_pair.clone()
    run = 0
    for position in range(context):  # a filler run starts after a pair, or after FILLER_RUN words
        run = 0 if is_pair[position] else run + 1
        if run == 1 or (run > 1 and (run - 1) % FILLER_RUN == 0):
            starts[position] = True
    segments = torch.full((length,), -1)
    segments[1 : 1 + context] = starts.long().cumsum(0) - 1
    needle_position = 1 + int(places[asked])
    return NeedleExample(ids, FIRST_VALUE + int(values[asked]), segments, int(segments[needle_position]), needle_position)


def without_positions(model: Any) -> Any:
    """``model`` (a Llama) with its rotary frequencies set to 0: no position encoding."""
    rotary = model.model.rotary_emb
    with torch.no_grad():
        rotary.inv_freq.zero_()
    if hasattr(rotary, "original_inv_freq"):
        rotary.original_inv_freq = rotary.inv_freq.clone()
    return model


def _new_model(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32768, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None,
        tie_word_embeddings=False,
    )
    return without_positions(LlamaForCausalLM(config))


def needle_accuracy(model: Any, examples: list[NeedleExample]) -> float:
    """Fraction of ``examples`` whose answer is the model's greedy next token."""
    with torch.no_grad():
        right = [int(model(e.input_ids[None]).logits[0, -1].argmax()) == e.answer for e in examples]
    return sum(right) / len(right)


def _train(training: NeedleTraining, progress: bool) -> tuple[Any, dict[str, Any]]:
    model = _new_model(training.seed).train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=training.learning_rate)
    generator = torch.Generator().manual_seed(training.seed + 1)
    parameters = [p for p in model.parameters() if p.requires_grad]
    start = time.perf_counter()
    with progress_bar(sum(phase[0] for phase in training.phases), "training the needle model", progress) as bar:
        for steps, shortest, longest, batch_size in training.phases:
            for _ in range(steps):
                length = int(torch.randint(shortest, longest + 1, (1,), generator=generator))
                batch = [needle_example(length, generator, training.pairs) for _ in range(batch_size)]
                logits = model(torch.stack([e.input_ids for e in batch])).logits[:, -1]
                loss = torch.nn.functional.cross_entropy(logits, torch.tensor([e.answer for e in batch]))
                optimiser_step(optimiser, loss, parameters)
                bar.update()
    model.eval()
    heldout = torch.Generator().manual_seed(999_999)
    accuracy = needle_accuracy(model, [needle_example(2048, heldout, training.pairs) for _ in range(50)])
    if progress:
        print(f"needle: accuracy {accuracy:.1%} at 2048 tokens", flush=True)
    return model, {"accuracy": accuracy, "training_seconds": round(time.perf_counter() - start, 1)}


def load_needle_model(
    cache_dir: str | os.PathLike[str] | None = None,
    training: NeedleTraining = NeedleTraining(),
    progress: bool = True,
    trained_here: bool = False,
) -> Any:
    """The trained needle model (``LlamaForCausalLM`` without position encoding, eval mode):
    the shipped one (:data:`CHECKPOINT`) for ``NeedleTraining()``, else trained on first use
    and cached under :func:`~captum_attention.demo.cache_root`.

    Args:
        cache_dir (path, optional): cache root, for a model trained here. Default: None.
        training (NeedleTraining, optional): how to train it. Default: ``NeedleTraining()``.
        progress (bool, optional): show the training's progress and accuracy. Default: True.
        trained_here (bool, optional): train (and cache) the model on this machine even
            where the shipped one is the one asked for. Default: False.

    Raises:
        RuntimeError: the shipped checkpoint is damaged (one of its files differs from its
            recorded digest).
    """
    from transformers import LlamaForCausalLM

    model = cached_trained_model(
        MODEL_NAME, training, lambda: _train(training, progress), LlamaForCausalLM, cache_dir, progress,
        needle_tokenizer(), trained_here,
    )
    return without_positions(model)


def needle_tokenizer() -> Any:
    """A whitespace word-level fast tokenizer over :data:`WORDS` that prepends BOS (for
    Captum's text inputs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>")
