"""A deterministic binary-sentiment corpus with known rationales, generated from word lists.

Sentences are built from templates: a sentiment clause ("the plot was dull"), optionally
negated ("the plot was not dull") or intensified ("the plot was really dull"), behind a
neutral filler ("honestly , ..."), or two clauses joined by "and" (they agree) or "but"
(they disagree). The label rule:

- a clause is positive when its adjective is positive, flipped by "not";
- with "but", the second clause decides; with "and", both clauses agree.

The rationale of a sentence is the positions (in its whitespace-split words) of the words
that decide the label: the deciding adjectives and their "not". Training and held-out
sentences use disjoint sentiment adjectives, so held-out accuracy measures whether the
model learned sentiment rather than a word list.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import BatchEncoding

POSITIVE = {
    "train": [
        "good", "great", "excellent", "wonderful", "superb", "brilliant", "fantastic",
        "amazing", "delightful", "charming", "beautiful", "enjoyable", "impressive",
        "lovely", "outstanding", "moving", "gripping", "clever", "fun", "stunning",
    ],
    "heldout": [
        "marvelous", "terrific", "splendid", "fabulous", "magnificent", "pleasant",
        "engaging", "remarkable",
    ],
}
NEGATIVE = {
    "train": [
        "bad", "terrible", "awful", "boring", "dull", "poor", "horrible", "dreadful",
        "weak", "lousy", "mediocre", "tedious", "bland", "clumsy", "annoying",
        "disappointing", "painful", "messy", "forgettable", "silly",
    ],
    "heldout": [
        "atrocious", "abysmal", "dismal", "pathetic", "lame", "tiresome", "unbearable",
        "miserable",
    ],
}
NOUNS = [
    "movie", "film", "plot", "acting", "story", "script", "ending", "soundtrack",
    "dialogue", "cast", "pacing", "direction", "camera work", "performance", "show",
]
VERBS = ["was", "is", "felt", "seemed"]
INTENSIFIERS = ["very", "really", "truly", "extremely", "quite", "so"]
FILLERS = ["honestly ,", "overall ,", "in the end", "to be fair ,", "i think", "frankly ,"]
LABELS = ("negative", "positive")


@dataclass(frozen=True)
class Example:
    """One generated sentence, its label (1 = positive) and its rationale word positions."""

    text: str
    label: int
    rationale: tuple[int, ...]


@dataclass(frozen=True)
class _Clause:
    words: list[str]
    label: int
    decisive: list[int]  # positions within the clause


def _clause(rng: random.Random, split: str) -> _Clause:
    label = rng.randrange(2)
    adjective = rng.choice((POSITIVE if label else NEGATIVE)[split])
    style = rng.random()
    verb = rng.choice(VERBS[:2] if style < 0.3 else VERBS)
    words = ["the", *rng.choice(NOUNS).split(), verb]
    decisive = []
    if style < 0.3:
        decisive.append(len(words))
        words.append("not")
        label = 1 - label
    elif style < 0.5:
        words.append(rng.choice(INTENSIFIERS))
    decisive.append(len(words))
    words.append(adjective)
    return _Clause(words, label, decisive)


def _sentence(rng: random.Random, split: str) -> Example:
    first = _clause(rng, split)
    shape = rng.random()
    if shape < 0.45:
        words = rng.choice(FILLERS).split() if rng.random() < 0.4 else []
        offset = len(words)
        return Example(" ".join(words + first.words), first.label, tuple(offset + i for i in first.decisive))
    second = _clause(rng, split)
    if shape < 0.85:  # "but": the clauses disagree and the second decides
        while second.label == first.label:
            second = _clause(rng, split)
        offset = len(first.words) + 1
        words = first.words + ["but"] + second.words
        return Example(" ".join(words), second.label, tuple(offset + i for i in second.decisive))
    while second.label != first.label:  # "and": the clauses agree
        second = _clause(rng, split)
    offset = len(first.words) + 1
    rationale = tuple(first.decisive) + tuple(offset + i for i in second.decisive)
    return Example(" ".join(first.words + ["and"] + second.words), first.label, rationale)


def generate(split: str, size: int, seed: int = 0) -> list[Example]:
    """``size`` examples of ``split`` ("train" or "heldout"), the same for the same seed."""
    if split not in POSITIVE:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}.")
    rng = random.Random(f"{split}-{seed}")
    return [_sentence(rng, split) for _ in range(size)]


def token_rationales(encoded: "BatchEncoding", examples: list[Example]) -> "Tensor":
    """The examples' rationale words as a ``(batch, seq_len)`` bool mask over tokens.

    Args:
        encoded: a fast tokenizer's output for ``[e.text for e in examples]`` (its
            ``word_ids`` map tokens to the whitespace-separated words of the text).
        examples: the generated examples, in the same order.

    Returns:
        bool tensor, True for every word piece of a rationale word; for
        :func:`captum_attention.metrics.token_f1` and friends.
    """
    import torch

    rows = []
    for row, example in enumerate(examples):
        decisive = set(example.rationale)
        rows.append([word is not None and word in decisive for word in encoded.word_ids(row)])
    return torch.tensor(rows, dtype=torch.bool)


def write_jsonl(examples: list[Example], path: str | os.PathLike[str]) -> None:
    """``examples`` as a data set for ``captum-attention evaluate``: one JSON object per
    line with ``text``, ``label`` and ``rationale`` (the deciding words)."""
    with open(path, "w", encoding="utf-8") as file:
        for example in examples:
            words = example.text.split()
            rationale = [words[i] for i in example.rationale]
            file.write(json.dumps({"text": example.text, "label": example.label, "rationale": rationale}) + "\n")
