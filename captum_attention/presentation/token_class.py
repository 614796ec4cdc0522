"""Explain a token classifier's labels (named entities, parts of speech: a
``*ForTokenClassification`` checkpoint), each labelled word's label read at the word's
first token, and a masked language model's predictions (BERT's ``[MASK]``), each read at
its mask: explained by every method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .answer import unknown_words
from .display import readable_tokens, special_tokens
from .explain import MethodInfo, default_method_names, length_limit
from .positions import PositionPlan, check_fast, check_position_methods, forward_inputs, output_forward, score_positions

OUTSIDE = "O"
"""The label of the words outside every entity (the IOB schemes'): a report explains the
others' labels."""


@dataclass
class WordLabel:
    """One explained word.

    Attributes:
        word: the word as the text spells it.
        position: its first token's position in the tokens: where its label is read.
        label: the label explained, the predicted one.
        probability: the softmax of the labels' logits at ``position``, at ``label``.
        scores: method -> a score per token of the label's logit.
    """

    word: str
    position: int
    label: str
    probability: float
    scores: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class TokenClassExplanation:
    """What the report of a token classifier's labels of one text shows.

    Attributes:
        text: the text as given.
        tokens: the tokens the model read, readable.
        special: whether each token is a special one.
        words: the explained words: each word labelled other than :data:`OUTSIDE` (every
            word where the model has no such label), or the one given.
        given: whether the word was given (``--target``).
        cut_from: the text's token count where it was cut to the model's length limit.
        seconds: method -> wall time over all the words.
        methods: method -> how to read its scores.
        warnings: what the reader should know (words the tokenizer does not know).
        masked: whether the words are a masked language model's masks, their labels the
            tokens it predicts there.
    """

    text: str
    tokens: list[str]
    special: list[bool]
    words: list[WordLabel]
    given: bool
    cut_from: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    masked: bool = False


def first_tokens(encoded: Any) -> dict[int, tuple[int, int]]:
    """Each word's first token -> the word's characters ``(begin, end)`` in the text, by
    the tokens' word ids and offsets (a fast tokenizer's)."""
    words: dict[int, tuple[int, int]] = {}
    firsts: dict[int, int] = {}
    offsets = encoded["offset_mapping"][0].tolist()
    for position, word in enumerate(encoded.word_ids(0)):
        if word is None:
            continue
        first = firsts.setdefault(word, position)
        begin = words[first][0] if first in words else offsets[position][0]
        words[first] = (begin, offsets[position][1])
    return words


def given_word(words: dict[int, tuple[int, int]], text: str, word: str, named: str = "--target") -> int:
    """The first token of the word where ``word`` first occurs in ``text``; a one-line
    ``ValueError`` where the text (as the model reads it) does not hold it (``named``:
    where the word was given, for the message)."""
    begin = text.find(word)
    if begin < 0 or not word.strip():
        raise ValueError(f"{named} {word!r} is not in the text: give a word as the text spells it")
    for first, (start, end) in words.items():
        if start <= begin < end:
            return first
    raise ValueError(f"{named} {word!r} lies in the part of the text cut to the model's length limit")


def explain_token_labels(
    model: Any, tokenizer: Any, text: str, word: str | None = None, methods: list[str] | None = None, ig_steps: int = 50,
    ig_batch_size: int | None = None, presence: float = 0.05,
) -> TokenClassExplanation:
    """A token classifier's predicted labels of ``text``'s words, each labelled word's
    label (or, given ``word``, that word's) explained by every method at the word's first
    token, all the words in one batch: each registered method's ``attribute(ids,
    target=[(position, label), ...], query_index=positions)`` of the logits, Integrated
    Gradients and AttnLRP at a presence as
    :func:`~captum_attention.presentation.positions.position_method` runs them. A text
    longer than the model takes is cut."""
    chosen = methods or default_method_names()
    check_position_methods(chosen, "the word whose label is read")
    return _scored(*plan_token_labels(model, tokenizer, text, word), chosen, model, tokenizer, ig_steps, ig_batch_size, presence)


def plan_token_labels(
    model: Any, tokenizer: Any, text: str, word: str | None = None, named: str = "--target"
) -> tuple[TokenClassExplanation, PositionPlan]:
    """The words :func:`explain_token_labels` explains, without scores, and their labels'
    logits as a :class:`~captum_attention.presentation.positions.PositionPlan`; a one-line
    ``ValueError`` for what it refuses (``named``: where ``word`` was given)."""
    check_fast(tokenizer, "a token classifier's words are told apart by")
    limit = length_limit(model, tokenizer)
    encoded = tokenizer(text, truncation=True, max_length=limit, return_offsets_mapping=True, return_tensors="pt")
    names, ids, arguments = forward_inputs(encoded, model)
    with torch.no_grad():
        probabilities = model(input_ids=ids, **dict(zip(names, arguments))).logits[0].float().softmax(-1).cpu()
    predicted = probabilities.argmax(-1).tolist()
    id2label = model.config.id2label
    words = first_tokens(encoded)
    if word is not None:
        chosen_words = [given_word(words, text, word, named)]
    else:
        outside = OUTSIDE in id2label.values()
        chosen_words = [first for first in words if not outside or id2label[predicted[first]] != OUTSIDE]
    full_length = len(tokenizer(text)["input_ids"])
    explanation = TokenClassExplanation(
        text=text, tokens=readable_tokens(ids[0], tokenizer), special=special_tokens(ids, tokenizer)[0].tolist(),
        words=[
            WordLabel(text[slice(*words[first])], first, id2label[predicted[first]], float(probabilities[first, predicted[first]]))
            for first in chosen_words
        ],
        given=word is not None, cut_from=full_length if full_length > ids.shape[1] else None,
    )
    _warn_unknown(explanation, tokenizer, ids)
    targets = [(first, predicted[first]) for first in chosen_words]
    return explanation, PositionPlan(ids, arguments, output_forward(model, "logits", names), targets)


def explain_masks(
    model: Any, tokenizer: Any, text: str, token: str | None = None, methods: list[str] | None = None, ig_steps: int = 50,
    ig_batch_size: int | None = None, presence: float = 0.05,
) -> TokenClassExplanation:
    """A masked language model's most probable token at each of ``text``'s mask tokens
    (or, given ``token``, that token's) explained by every method at its mask, all the
    masks in one batch, as :func:`explain_token_labels` explains labels. A text longer than
    the model takes is cut; a text with no mask in what the model reads is refused in one
    line, as is a ``token`` the tokenizer reads as more than one token."""
    chosen = methods or default_method_names()
    check_position_methods(chosen, "the mask whose prediction is read")
    return _scored(*plan_masks(model, tokenizer, text, token), chosen, model, tokenizer, ig_steps, ig_batch_size, presence)


def plan_masks(
    model: Any, tokenizer: Any, text: str, token: str | None = None, named: str = "--target"
) -> tuple[TokenClassExplanation, PositionPlan]:
    """The masks :func:`explain_masks` explains, without scores, and their tokens' logits
    as a :class:`~captum_attention.presentation.positions.PositionPlan`; a one-line
    ``ValueError`` for what it refuses (``named``: where ``token`` was given)."""
    mask = tokenizer.mask_token
    if mask is None:
        raise ValueError("the tokenizer names no mask token, which a masked language model predicts at: save the model's own")
    limit = length_limit(model, tokenizer)
    encoded = tokenizer(text, truncation=True, max_length=limit, return_tensors="pt")
    names, ids, arguments = forward_inputs(encoded, model)
    masks = (ids[0] == tokenizer.mask_token_id).nonzero().flatten().tolist()
    full = tokenizer(text)["input_ids"]
    if not masks:
        where = "lies in the part cut to the model's length limit" if tokenizer.mask_token_id in full else "is not in the text"
        raise ValueError(f"{mask} {where}: put it where the word to predict goes (e.g. 'Paris is the {mask} of France.')")
    with torch.no_grad():
        probabilities = model(input_ids=ids, **dict(zip(names, arguments))).logits[0, masks].float().softmax(-1).cpu()
    classes = probabilities.argmax(-1).tolist() if token is None else [_single_token(tokenizer, token, named)] * len(masks)
    explanation = TokenClassExplanation(
        text=text, tokens=readable_tokens(ids[0], tokenizer), special=special_tokens(ids, tokenizer)[0].tolist(),
        words=[
            WordLabel(mask + (f" {i + 1}" if len(masks) > 1 else ""), position, readable_tokens(torch.tensor([c]), tokenizer)[0],
                      float(probabilities[i, c]))
            for i, (position, c) in enumerate(zip(masks, classes))
        ],
        given=token is not None, cut_from=len(full) if len(full) > ids.shape[1] else None, masked=True,
    )
    _warn_unknown(explanation, tokenizer, ids)
    return explanation, PositionPlan(ids, arguments, output_forward(model, "logits", names), list(zip(masks, classes)))


def _single_token(tokenizer: Any, token: str, named: str = "--target") -> int:
    """The id of ``token`` as one token of the vocabulary (a word after a space, as
    byte-level and SentencePiece vocabularies hold it, or as it is); a one-line
    ``ValueError`` where neither is one token (``named``: where it was given)."""
    for spelled in (" " + token, token):
        found = tokenizer(spelled, add_special_tokens=False)["input_ids"]
        if len(found) == 1 and found[0] != tokenizer.unk_token_id:
            return int(found[0])
    pieces = tokenizer.tokenize(token)
    if len(pieces) < 2:
        raise ValueError(f"{named} {token!r} is not in the tokenizer's vocabulary: a mask predicts one token of it")
    raise ValueError(f"{named} {token!r} is {len(pieces)} tokens to the tokenizer ({' '.join(pieces)}): a mask predicts one "
                     "token of the vocabulary")


def _warn_unknown(explanation: TokenClassExplanation, tokenizer: Any, ids: torch.Tensor) -> None:
    """Warn in ``explanation`` of the text's words the tokenizer does not know."""
    unknown = unknown_words(tokenizer, explanation.text, ids[0].tolist(), named="text")
    explanation.warnings += [] if unknown is None else [unknown]


def _scored(
    explanation: TokenClassExplanation, plan: PositionPlan, chosen: list[str], model: Any, tokenizer: Any, ig_steps: int,
    ig_batch_size: int | None, presence: float,
) -> TokenClassExplanation:
    """``explanation`` with each method's scores of each word's logit, all the words in
    one batch."""
    if not explanation.words:
        return explanation
    for display, info, seconds, scores in score_positions(plan, chosen, model, tokenizer, ig_steps, ig_batch_size, presence):
        explanation.seconds[display] = seconds
        explanation.methods[display] = info
        for labelled, row in zip(explanation.words, scores.tolist()):
            labelled.scores[display] = row
    return explanation
