"""Explain an extractive question answerer's answer (BERT, RoBERTa, DistilBERT, ...
``*ForQuestionAnswering``): the answer's span in the context, its start and its end each
explained by every method, as Captum's BERT question-answering tutorial explains them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .answer import unknown_words
from .display import readable_tokens, special_tokens
from .explain import MethodInfo, check_one_stack, default_method_names, length_limit
from .positions import PositionPlan, check_fast, check_position_methods, forward_inputs, score_positions

MAX_ANSWER_TOKENS = 15
"""The longest answer chosen, in tokens (the ``max_answer_len`` of transformers' former
question-answering pipeline)."""

DOC_STRIDE = 128
"""The context's tokens that two consecutive windows share where the context is longer than
the model takes (the ``doc_stride`` of transformers' former question-answering pipeline),
at most half of a window's context."""

ENDS = ("start", "end")
"""The two heads of an answer, as a model's outputs name them (``start_logits``,
``end_logits``)."""


@dataclass
class QuestionAnswerExplanation:
    """What the report of an extractive question answerer's answer shows.

    Attributes:
        question, context: the texts as given.
        tokens: the tokens the model read (question, context and special tokens), readable.
        special: whether each token is a special one.
        in_context: whether each token is the context's (where an answer can lie).
        answer: the explained answer's text, as the context spells it.
        start, end: the answer's first and last token (positions in ``tokens``).
        start_probability, end_probability: the softmax of the start and end logits over
            the context's tokens at ``start`` and ``end``.
        given: whether the answer was given (``--target``) rather than predicted.
        predicted: the predicted answer's text.
        windows: how many windows of the context the model read (a context longer than the
            model takes is read in overlapping windows, :data:`DOC_STRIDE`); 1: all at once.
        window: the characters ``(first, end)`` of the context in the window shown and
            explained: the one that holds the predicted answer (the best over all windows),
            or the first that holds the given one.
        scores: method -> ``{"start": scores, "end": scores}``, a score per token of each of
            the answer's start and end logits.
        seconds: method -> wall time of both.
        methods: method -> how to read its scores.
        warnings: what the reader should know (words the tokenizer does not know).
    """

    question: str
    context: str
    tokens: list[str]
    special: list[bool]
    in_context: list[bool]
    answer: str
    start: int
    end: int
    start_probability: float
    end_probability: float
    given: bool
    predicted: str
    windows: int = 1
    window: tuple[int, int] = (0, 0)
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def question_first(tokenizer: Any) -> bool:
    """Whether the tokenizer puts the question before the context: unless it pads on the
    left (XLNet's), whose models read the context first."""
    return tokenizer.padding_side == "right"


def question_inputs(tokenizer: Any, question: str, context: str, max_length: int | None = None, stride: int = 0) -> Any:
    """The question and context tokenized as a pair in the tokenizer's order
    (:func:`question_first`), with offsets, as tensors; given ``max_length``, the context
    in windows that fit it, consecutive ones sharing ``stride`` tokens, as each window's
    lists (unpadded: a tokenizer may have no padding token, GPT-2's)."""
    first = question_first(tokenizer)
    pair = (question, context) if first else (context, question)
    windows = {"return_tensors": "pt"} if max_length is None else {
        "truncation": "only_second" if first else "only_first", "max_length": max_length, "stride": stride,
        "return_overflowing_tokens": True,
    }
    return tokenizer(*pair, return_offsets_mapping=True, **windows)


def context_tokens(encoded: Any, tokenizer: Any, window: int = 0) -> torch.Tensor:
    """``(tokens,)`` bool: whether each token of ``encoded``'s ``window`` (:func:`question_inputs`)
    is the context's."""
    context_index = 1 if question_first(tokenizer) else 0
    return torch.tensor([index == context_index for index in encoded.sequence_ids(window)])


@dataclass
class _Window:
    """One window of the question and context, unpadded: its ids ``(1, tokens)``, what the
    model takes beside them (:func:`~captum_attention.presentation.positions.forward_inputs`),
    each token's characters and whether it is the context's, and the start and end logits."""

    ids: torch.Tensor
    arguments: tuple[torch.Tensor, ...]
    offsets: list[tuple[int, int]]
    in_context: torch.Tensor
    logits: dict[str, torch.Tensor]

    def span_text(self, context: str, start: int, end: int) -> str:
        """The context's characters from token ``start``'s first to token ``end``'s last,
        without the space a SentencePiece or byte-level token's offsets may begin with."""
        return context[self.offsets[start][0] : self.offsets[end][1]].strip()

    def log_probabilities(self) -> dict[str, torch.Tensor]:
        """Each end's log-softmax over the window's context tokens."""
        return {end: self.logits[end].float().masked_fill(~self.in_context, float("-inf")).log_softmax(-1) for end in ENDS}

    def characters(self) -> tuple[int, int]:
        """The characters of the context the window reads."""
        held = [offset for offset, inside in zip(self.offsets, self.in_context.tolist()) if inside]
        return held[0][0], held[-1][1]


def _windows(model: Any, tokenizer: Any, question: str, context: str, limit: int, question_length: int) -> tuple[list[_Window], list[str]]:
    """The windows of the context the model reads (one where it takes the whole context),
    each run alone, and the names of what the model takes beside the ids."""
    stride = min(DOC_STRIDE, (limit - question_length) // 2)
    encoded = question_inputs(tokenizer, question, context, limit, stride)
    windows: list[_Window] = []
    names: list[str] = []
    for row in range(len(encoded["input_ids"])):
        names, ids, arguments = forward_inputs(encoded, model, row)
        with torch.no_grad():
            outputs = model(input_ids=ids, **dict(zip(names, arguments)))
        windows.append(_Window(ids, arguments, encoded["offset_mapping"][row], context_tokens(encoded, tokenizer, row),
                               {end: getattr(outputs, f"{end}_logits")[0].cpu() for end in ENDS}))
    return windows, names


def best_span(start_logits: torch.Tensor, end_logits: torch.Tensor, in_context: torch.Tensor) -> tuple[int, int]:
    """The span ``(start, end)`` of the context's tokens of the highest start plus end
    logit, ``end`` at most :data:`MAX_ANSWER_TOKENS` - 1 tokens after ``start``: the span of
    the largest product of the two softmaxes over the context, as SQuAD's fine-tuned models
    are read."""
    n = len(start_logits)
    offsets = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    allowed = (offsets >= 0) & (offsets < MAX_ANSWER_TOKENS) & in_context[:, None] & in_context[None, :]
    totals = (start_logits.float()[:, None] + end_logits.float()[None, :]).masked_fill(~allowed, float("-inf"))
    best = int(totals.argmax())
    return best // n, best % n


def given_span(windows: list[_Window], context: str, answer: str, named: str = "--target") -> tuple[int, int, int]:
    """The first window ``(index, start, end)`` of :func:`_windows` whose context tokens
    hold all of ``answer``'s first occurrence in ``context``, by the tokens' character
    offsets; a one-line ``ValueError`` where none does (``named``: where the answer was
    given, for the message)."""
    begin = context.find(answer)
    if begin < 0 or not answer.strip():
        raise ValueError(f"{named} {answer!r} is not in the context: give the answer as the context spells it")
    finish = begin + len(answer)
    for index, window in enumerate(windows):
        covered = [i for i, (a, b) in enumerate(window.offsets) if window.in_context[i] and a < finish and b > begin]
        if covered and window.offsets[covered[0]][0] <= begin and window.offsets[covered[-1]][1] >= finish:
            return index, covered[0], covered[-1]
    raise ValueError(f"{named} {answer!r} is longer than the windows of the context the model reads: give a shorter answer")


def explain_question(
    model: Any, tokenizer: Any, question: str, context: str, answer: str | None = None, methods: list[str] | None = None,
    ig_steps: int = 50, ig_batch_size: int | None = None, presence: float = 0.05,
) -> QuestionAnswerExplanation:
    """An extractive question answerer's answer to ``question`` in ``context`` (the
    span :func:`best_span` chooses, or the given ``answer``'s first occurrence), its start
    and end logits each explained by every method at the answer's first and last token:
    each registered method's ``attribute`` of the ``start_logits`` at ``start`` and the
    ``end_logits`` at ``end``, both in one batch (:func:`_ends_forward`); ``integrated_gradients``, Captum's
    ``LayerIntegratedGradients`` on the word embeddings against padding (special tokens
    kept), as Captum's tutorial; :data:`~captum_attention.presentation.explain.PRESENCE`,
    AttnLRP with the words at ``presence``. A context longer than the model takes is read
    in overlapping windows (:data:`DOC_STRIDE`), as transformers' former pipeline read
    it: the answer is the best span of all (or the given one's first window), explained
    in its window. An encoder-decoder's answerer (BART's, T5's) is refused in one line."""
    chosen = methods or default_method_names()
    check_position_methods(chosen, "an answer's start and end")
    explanation, plan = plan_question(model, tokenizer, question, context, answer)
    for display, info, seconds, scores in score_positions(plan, chosen, model, tokenizer, ig_steps, ig_batch_size, presence):
        explanation.seconds[display] = seconds
        explanation.scores[display] = dict(zip(ENDS, scores.tolist()))
        explanation.methods[display] = info
    return explanation


def plan_question(
    model: Any, tokenizer: Any, question: str, context: str, answer: str | None = None, named: str = "--target"
) -> tuple[QuestionAnswerExplanation, PositionPlan]:
    """The answer :func:`explain_question` explains, without scores, and its start and end
    logits as a :class:`~captum_attention.presentation.positions.PositionPlan` (their
    softmaxes over the context's tokens); a one-line ``ValueError`` for what it refuses (``named``:
    where ``answer`` was given, for the messages)."""
    check_one_stack(model, "the question and context", "the start and end logits", "an encoder's answers (BERT, RoBERTa, DistilBERT, ...)")
    check_fast(tokenizer, "a question answerer's answer is placed in its context by")
    limit = length_limit(model, tokenizer)
    question_length = len(tokenizer(question, add_special_tokens=False)["input_ids"]) + tokenizer.num_special_tokens_to_add(pair=True)
    if question_length >= limit:
        raise ValueError(f"the question and the special tokens are {question_length} tokens, leaving no room for the context "
                         f"within the {limit} the model takes: shorten the question")
    windows, names = _windows(model, tokenizer, question, context, limit, question_length)
    spans = [best_span(window.logits["start"], window.logits["end"], window.in_context) for window in windows]
    scores = [float(sum(window.log_probabilities()[end][at] for end, at in zip(ENDS, span))) for window, span in zip(windows, spans)]
    best = max(range(len(windows)), key=lambda index: scores[index])  # the first of equals
    index, *span = (best, *spans[best]) if answer is None else given_span(windows, context, answer, named)
    window = windows[index]
    probabilities = {end: values.exp() for end, values in window.log_probabilities().items()}
    explanation = QuestionAnswerExplanation(
        question=question, context=context, tokens=readable_tokens(window.ids[0], tokenizer),
        special=special_tokens(window.ids, tokenizer)[0].tolist(), in_context=window.in_context.tolist(),
        answer=window.span_text(context, *span), start=span[0], end=span[1],
        start_probability=float(probabilities["start"][span[0]]), end_probability=float(probabilities["end"][span[1]]),
        given=answer is not None, predicted=windows[best].span_text(context, *spans[best]), windows=len(windows),
        window=window.characters(),
    )
    read = "question and context" if len(windows) == 1 else "question and the context's window"
    unknown = unknown_words(tokenizer, question + " " + context, window.ids[0].tolist(), named=read)
    explanation.warnings += [] if unknown is None else [unknown]
    plan = PositionPlan(window.ids, window.arguments, _ends_forward(model, names), [(span[0], 0), (span[1], 1)], window.in_context)
    return explanation, plan


def _ends_forward(model: Any, names: list[str]) -> Callable[..., torch.Tensor]:
    """``forward(ids, *arguments)``: the start and end logits as the two classes of each
    token, ``(batch, tokens, 2)``; the answer's start and end are explained as one batch of
    two, ``(start, 0)`` and ``(end, 1)``."""
    def forward(ids: torch.Tensor, *arguments: torch.Tensor) -> torch.Tensor:
        outputs = model(input_ids=ids, **dict(zip(names, arguments)))
        return torch.stack([outputs.start_logits, outputs.end_logits], dim=-1)

    return forward
