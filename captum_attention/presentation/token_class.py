"""Explain a token classifier's labels (named entities, parts of speech: a
``*ForTokenClassification`` checkpoint), each labelled word's label read at the word's
first token, and a masked language model's predictions (BERT's ``[MASK]``), each read at
its mask: explained by every method. A text longer than the model takes is read in
overlapping windows, each word (mask) in the one where it has the most context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .answer import unknown_words
from .display import readable_tokens, special_tokens
from .explain import MethodInfo, check_one_stack, default_method_names, length_limit
from .positions import (
    PositionPlan, check_fast, check_position_methods, forward_inputs, output_forward, score_positions,
)
from .question_answering import DOC_STRIDE

OUTSIDE = "O"
"""The label of the words outside every entity (the IOB schemes'): a report explains the
others' labels."""


@dataclass
class WordLabel:
    """One explained word.

    Attributes:
        word: the word as the text spells it.
        position: its first token's position in its window's tokens: where its label is read.
        label: the label explained, the predicted one.
        probability: the softmax of the labels' logits at ``position``, at ``label``.
        window: the index of the window (:class:`TextWindow`) its label is read and
            explained in: of those that hold its first token, the one where the fewer
            tokens on either side of it are the most (BERT's "max context").
        scores: method -> a score per token of its window of the label's logit.
    """

    word: str
    position: int
    label: str
    probability: float
    window: int = 0
    scores: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class TextWindow:
    """A part of the text the model read at once: the whole text, or one of the
    overlapping windows of a text longer than the model takes (consecutive ones sharing
    :data:`~captum_attention.presentation.question_answering.DOC_STRIDE` tokens, at most
    half of a window's).

    Attributes:
        tokens: its tokens, readable.
        special: whether each token is a special one.
        characters: the text's characters ``(first, end)`` it reads.
    """

    tokens: list[str]
    special: list[bool]
    characters: tuple[int, int]


@dataclass
class TokenClassExplanation:
    """What the report of a token classifier's labels of one text shows.

    Attributes:
        text: the text as given.
        windows: the windows the model read the text in (one where it takes the whole
            text).
        words: the explained words, in the text's order: each word labelled other than
            :data:`OUTSIDE` (every word where the model has no such label), or the one
            given.
        given: whether the word was given (``--target``).
        seconds: method -> wall time over all the words.
        methods: method -> how to read its scores.
        warnings: what the reader should know (words the tokenizer does not know).
        masked: whether the words are a masked language model's masks, their labels the
            tokens it predicts there.
    """

    text: str
    windows: list[TextWindow]
    words: list[WordLabel]
    given: bool
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    masked: bool = False


@dataclass
class _Read:
    """One window of the text as the model reads it: its ids ``(1, tokens)``, what the
    model takes beside them (:func:`~captum_attention.presentation.positions.forward_inputs`),
    and each token's characters and word (its index among the text's words; None: a
    special token)."""

    ids: torch.Tensor
    arguments: tuple[torch.Tensor, ...]
    offsets: list[tuple[int, int]]
    words: list[int | None]

    def shown(self, tokenizer: Any) -> TextWindow:
        """The window as the report shows it."""
        read = [offset for offset in self.offsets if offset[1] > offset[0]]
        characters = (read[0][0], read[-1][1]) if read else (0, 0)
        return TextWindow(readable_tokens(self.ids[0], tokenizer), special_tokens(self.ids, tokenizer)[0].tolist(), characters)

    def probabilities(self, model: Any, names: list[str], positions: list[int]) -> torch.Tensor:
        """``(positions, classes)`` the softmax of the logits at ``positions``."""
        with torch.no_grad():
            logits = model(input_ids=self.ids, **dict(zip(names, self.arguments))).logits[0, positions]
        return logits.float().softmax(-1).cpu()


def _read(model: Any, tokenizer: Any, text: str) -> tuple[list[str], list[_Read]]:
    """The names of what the model takes beside the ids, and the windows of ``text`` it
    reads: one where it takes the whole text, else overlapping ones (consecutive ones
    sharing :data:`~captum_attention.presentation.question_answering.DOC_STRIDE` tokens,
    at most half of a window's text)."""
    limit = length_limit(model, tokenizer)
    stride = min(DOC_STRIDE, (limit - tokenizer.num_special_tokens_to_add()) // 2)
    encoded = tokenizer(text, truncation=True, max_length=limit, stride=max(stride, 0), return_overflowing_tokens=True,
                        return_offsets_mapping=True)
    names: list[str] = []
    reads = []
    for row in range(len(encoded["input_ids"])):
        names, ids, arguments = forward_inputs(encoded, model, row)
        reads.append(_Read(ids, arguments, encoded["offset_mapping"][row], encoded.word_ids(row)))
    return names, reads


def _placed(found: list[dict[int, int]], reads: list[_Read]) -> dict[int, tuple[int, int]]:
    """Each item's ``(window, position)`` (items: words, masks), from ``found``: per window
    of ``reads``, each item it holds -> its position there. Of an item's windows, the one
    where the fewer of the text's tokens on either side of it are the most, then the
    longer, then the first (the "max context" of BERT's reading of long SQuAD contexts);
    in the text's order."""
    best: dict[int, tuple[float, int, int]] = {}
    for index, (items, read) in enumerate(zip(found, reads)):
        read_text = [position for position, offset in enumerate(read.offsets) if offset[1] > offset[0]]
        for item, position in items.items():
            context = min(position - read_text[0], read_text[-1] - position) + 0.01 * len(read_text)
            if item not in best or context > best[item][0]:
                best[item] = (context, index, position)
    return {item: (index, position) for item, (_, index, position) in sorted(best.items(), key=lambda pair: pair[1][1:])}


def _word_spans(reads: list[_Read]) -> dict[int, tuple[int, int]]:
    """Each of the text's words -> its characters ``(begin, end)``, by its tokens' offsets
    in every window."""
    spans: dict[int, tuple[int, int]] = {}
    for read in reads:
        for word, (begin, end) in zip(read.words, read.offsets):
            if word is not None:
                known = spans.get(word, (begin, end))
                spans[word] = (min(known[0], begin), max(known[1], end))
    return spans


def given_word(spans: dict[int, tuple[int, int]], text: str, word: str, named: str = "--target") -> int:
    """The word of ``spans`` (:func:`_word_spans`) where ``word`` first occurs in ``text``;
    a one-line ``ValueError`` where the text (as the tokenizer reads it) does not hold it
    (``named``: where the word was given, for the message)."""
    begin = text.find(word)
    held = [index for index, (start, end) in spans.items() if start <= begin < end]
    if begin < 0 or not word.strip() or not held:
        raise ValueError(f"{named} {word!r} is not in the text: give a word as the text spells it")
    return held[0]


def explain_token_labels(
    model: Any, tokenizer: Any, text: str, word: str | None = None, methods: list[str] | None = None, ig_steps: int = 50,
    ig_batch_size: int | None = None, presence: float = 0.05,
) -> TokenClassExplanation:
    """A token classifier's predicted labels of ``text``'s words, each labelled word's
    label (or, given ``word``, that word's) explained by every method at the word's first
    token, the words of a window in one batch: each registered method's ``attribute(ids,
    target=[(position, label), ...], query_index=positions)`` of the logits, Integrated
    Gradients and AttnLRP at a presence as
    :func:`~captum_attention.presentation.positions.position_method` runs them. A text
    longer than the model takes is read in overlapping windows, as transformers'
    token-classification pipeline reads it with a ``stride``: each word is labelled and
    explained in the window where it has the most context (:class:`WordLabel`)."""
    chosen = methods or default_method_names()
    check_position_methods(chosen, "the word whose label is read")
    return _scored(*plan_token_labels(model, tokenizer, text, word), chosen, model, tokenizer, ig_steps, ig_batch_size, presence)


def plan_token_labels(
    model: Any, tokenizer: Any, text: str, word: str | None = None, named: str = "--target"
) -> tuple[TokenClassExplanation, list[PositionPlan]]:
    """The words :func:`explain_token_labels` explains, without scores, and their labels'
    logits as a :class:`~captum_attention.presentation.positions.PositionPlan` per window
    that holds some; a one-line ``ValueError`` for what it refuses (``named``: where
    ``word`` was given)."""
    check_fast(tokenizer, "a token classifier's words are told apart by")
    check_one_stack(model, "the text", "the labels", "an encoder's labels (BERT, RoBERTa, T5's encoder, ...)")
    names, reads = _read(model, tokenizer, text)
    spans = _word_spans(reads)
    found = [{w: p for p, w in enumerate(read.words) if w is not None and read.offsets[p][0] == spans[w][0]} for read in reads]
    placed = _placed(found, reads)
    wanted = [given_word(spans, text, word, named)] if word is not None else list(placed)
    outside = word is None and OUTSIDE in model.config.id2label.values()
    words, classes = [], []
    for w, (window, position, probabilities) in zip(wanted, _probabilities(model, names, reads, [placed[w] for w in wanted])):
        label = int(probabilities.argmax())
        if not outside or model.config.id2label[label] != OUTSIDE:
            words.append(WordLabel(text[slice(*spans[w])].strip(), position, model.config.id2label[label], float(probabilities[label]), window))
            classes.append(label)
    return _planned(text, words, classes, reads, model, tokenizer, names, given=word is not None, masked=False)


def explain_masks(
    model: Any, tokenizer: Any, text: str, token: str | None = None, methods: list[str] | None = None, ig_steps: int = 50,
    ig_batch_size: int | None = None, presence: float = 0.05,
) -> TokenClassExplanation:
    """A masked language model's most probable token at each of ``text``'s mask tokens
    (or, given ``token``, that token's) explained by every method at its mask, the masks
    of a window in one batch, as :func:`explain_token_labels` explains labels (a text
    longer than the model takes in windows, each mask in the one where it has the most
    context). A text with no mask is refused in one line, as is a ``token`` the tokenizer
    reads as more than one token."""
    chosen = methods or default_method_names()
    check_position_methods(chosen, "the mask whose prediction is read")
    return _scored(*plan_masks(model, tokenizer, text, token), chosen, model, tokenizer, ig_steps, ig_batch_size, presence)


def plan_masks(
    model: Any, tokenizer: Any, text: str, token: str | None = None, named: str = "--target"
) -> tuple[TokenClassExplanation, list[PositionPlan]]:
    """The masks :func:`explain_masks` explains, without scores, and their tokens' logits
    as a :class:`~captum_attention.presentation.positions.PositionPlan` per window that
    holds some; a one-line ``ValueError`` for what it refuses (``named``: where ``token``
    was given)."""
    mask = tokenizer.mask_token
    if mask is None:
        raise ValueError("the tokenizer names no mask token, which a masked language model predicts at: save the model's own")
    check_one_stack(model, "the text", "the masks' tokens", "an encoder's masks (BERT, RoBERTa, DistilBERT, ...)")
    names, reads = _read(model, tokenizer, text)
    found = [{read.offsets[p][0]: p for p in (read.ids[0] == tokenizer.mask_token_id).nonzero().flatten().tolist()} for read in reads]
    places = list(_placed(found, reads).values())
    if not places:
        raise ValueError(f"{mask} is not in the text: put it where the word to predict goes (e.g. 'Paris is the {mask} of France.')")
    given = None if token is None else _single_token(tokenizer, token, named)
    words, classes = [], []
    for i, (window, position, probabilities) in enumerate(_probabilities(model, names, reads, places)):
        predicted = int(probabilities.argmax()) if given is None else given
        shown = readable_tokens(torch.tensor([predicted]), tokenizer)[0]
        words.append(WordLabel(mask + (f" {i + 1}" if len(places) > 1 else ""), position, shown, float(probabilities[predicted]), window))
        classes.append(predicted)
    return _planned(text, words, classes, reads, model, tokenizer, names, given=token is not None, masked=True)


def _probabilities(
    model: Any, names: list[str], reads: list[_Read], places: list[tuple[int, int]]
) -> list[tuple[int, int, torch.Tensor]]:
    """``(window, position, probabilities)`` at each of ``places`` ``(window, position)``
    (in the text's order, :func:`_placed`): the softmax over the classes there, one
    forward a window."""
    read: list[tuple[int, int, torch.Tensor]] = []
    for window in dict.fromkeys(window for window, _ in places):
        positions = [position for at, position in places if at == window]
        read += [(window, position, row) for position, row in zip(positions, reads[window].probabilities(model, names, positions))]
    return read


def _planned(
    text: str, words: list[WordLabel], classes: list[int], reads: list[_Read], model: Any, tokenizer: Any, names: list[str],
    given: bool, masked: bool,
) -> tuple[TokenClassExplanation, list[PositionPlan]]:
    """The explanation of ``words`` (in the text's order, each of its class of
    ``classes``) without scores, and a plan of their logits per window that holds some."""
    explanation = TokenClassExplanation(text=text, windows=[read.shown(tokenizer) for read in reads], words=words, given=given,
                                        masked=masked)
    unknown = unknown_words(tokenizer, text, _text_ids(reads), named="text")
    explanation.warnings += [] if unknown is None else [unknown]
    forward = output_forward(model, "logits", names)
    plans = []
    for window in dict.fromkeys(word.window for word in words):
        targets = [(word.position, label) for word, label in zip(words, classes) if word.window == window]
        plans.append(PositionPlan(reads[window].ids, reads[window].arguments, forward, targets))
    return explanation, plans


def _text_ids(reads: list[_Read]) -> list[int]:
    """The ids of the text's tokens, each once (the windows' shared tokens too)."""
    ids = {tuple(offset): token for read in reads for offset, token in zip(read.offsets, read.ids[0].tolist()) if offset[1] > offset[0]}
    return list(ids.values())


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


def _scored(
    explanation: TokenClassExplanation, plans: list[PositionPlan], chosen: list[str], model: Any, tokenizer: Any,
    ig_steps: int, ig_batch_size: int | None, presence: float,
) -> TokenClassExplanation:
    """``explanation`` with each method's scores of each word's logit, the words of a
    window (``plans``, in the words' order) in one batch; a method's time summed over the
    windows."""
    words = iter(explanation.words)
    for plan in plans:
        in_window = [next(words) for _ in plan.targets]
        for display, info, seconds, scores in score_positions(plan, chosen, model, tokenizer, ig_steps, ig_batch_size, presence):
            explanation.seconds[display] = explanation.seconds.get(display, 0.0) + seconds
            explanation.methods[display] = info
            for labelled, row in zip(in_window, scores.tolist()):
                labelled.scores[display] = row
    return explanation
