"""Terminal output: one table per sentence, tokens down, methods across; for a language
model's answer, each method's top prompt tokens."""

from __future__ import annotations

import unicodedata
from collections import Counter

from .answer import AnswerExplanation
from .explain import Explanations, MethodInfo, SentenceExplanation
from .image_class import ImageClassExplanation
from .question_answering import QuestionAnswerExplanation
from .token_class import OUTSIDE, TokenClassExplanation, WordLabel

TOP_K = 3
"""Tokens marked ``*`` per method in the normalised table."""


def terminal_safe(text: str) -> str:
    """``text`` with control, format (bidi, zero-width), private-use and surrogate
    characters written as escapes (``\\x1b``, ``\\u202e``), so that nothing a sentence
    holds can move the cursor, recolour or retitle the terminal, or reorder the line."""
    return "".join(
        char if unicodedata.category(char)[0] != "C" else char.encode("unicode_escape").decode("ascii")
        for char in text
    )


def has_surrogates(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate (an undecodable byte of the command line, or a
    ``\\ud800`` escape in JSON): no valid Unicode, so no tokenizer or terminal takes it."""
    return any(0xD800 <= ord(char) <= 0xDFFF for char in text)


def count(number: int, noun: str) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def shares(scores: list[float], special: list[bool], signed: bool) -> list[float | None]:
    """Each word's share of the method's scores over the words (special tokens: None):
    ``s / Σ s`` for non-negative scores, ``s / Σ |s|`` for signed ones; all 0 when the
    words' scores are."""
    words = [s for s, is_special in zip(scores, special) if not is_special]
    total = sum(abs(s) for s in words) if signed else sum(words)
    return [None if is_special else (s / total if total else 0.0) for s, is_special in zip(scores, special)]


def _legend(methods: dict[str, MethodInfo]) -> str:
    groups = {
        "for the explained class, >= 0": [n for n, i in methods.items() if i.uses_target and not i.signed],
        "for the explained class, signed: + supports, - opposes it": [n for n, i in methods.items() if i.signed],
        "from the forward pass alone, the same for every class": [n for n, i in methods.items() if i.forward_only],
    }
    described = "; ".join(f"{', '.join(names)}: {meaning}" for meaning, names in groups.items() if names)
    return (
        f"scores: each method's share of the words (special tokens: .), * its {TOP_K} largest positive shares "
        f"(the strongest support; none where no word scores above 0); --raw for the scores.\n"
        f"{described}.\n"
        "wall times exclude one warm-up call per method."
    )


def _sentence_header(sentence: SentenceExplanation) -> list[str]:
    probabilities = ", ".join(f"{terminal_safe(label)} {p:.3f}" for label, p in sentence.probabilities.items())
    lines = [
        terminal_safe(sentence.shown_text),
        f"  prediction: {terminal_safe(sentence.label)} ({sentence.output}={sentence.probability:.3f}; {probabilities}); "
        f"explaining: {terminal_safe(sentence.target_label)}",
    ]
    if sentence.all_unknown:
        lines.append("  warning: every word is unknown to the tokenizer, so the model saw no word of this text")
    if sentence.cut_from is not None:
        last = terminal_safe(sentence.tokens[-2] if len(sentence.tokens) > 1 else sentence.tokens[-1])
        lost = (
            "the longer text's last tokens are neither seen nor explained" if sentence.text_pair is not None
            else f"nothing after {last!r} is seen or explained"
        )
        lines.append(f"  note: cut to the model's {len(sentence.tokens)} tokens (of {sentence.cut_from}); {lost}")
    lines += [f"  note: {terminal_safe(method)}: {terminal_safe(note)}" for method, note in sentence.notes.items()]
    return lines


def _cells(sentence: SentenceExplanation, method: str, info: MethodInfo, raw: bool, width: int) -> list[str]:
    scores = sentence.scores[method]
    if raw:
        return [f"{score:>{width}.4e}" for score in scores]
    values = shares(scores, sentence.special, info.signed)
    ranked = sorted((v, i) for i, v in enumerate(values) if v is not None and v > 0)
    top = {i for _, i in ranked[::-1][:TOP_K]}
    signed = "+" if info.signed else ""
    return [
        f"{'.':>{width}}" if v is None else f"{format(v, signed + '.3f') + ('*' if i in top else ' '):>{width}}"
        for i, v in enumerate(values)
    ]


def render_text(explanations: Explanations, raw: bool = False) -> str:
    """The terminal report: prediction, each token's score per method (normalised shares
    with the top tokens marked, or with ``raw`` the scores themselves), wall times."""
    methods = list(explanations.seconds)
    widths = [max(len(name), 11) for name in methods]
    lines = [] if raw else [_legend(explanations.methods), ""]
    for sentence in explanations.sentences:
        tokens = [terminal_safe(token) for token in sentence.tokens]
        token_width = max(8, *(len(token) for token in tokens))
        lines += _sentence_header(sentence)
        lines.append("  " + "token".ljust(token_width) + "".join(f"  {m:>{w}}" for m, w in zip(methods, widths)))
        columns = [
            _cells(sentence, m, explanations.methods[m], raw, w) for m, w in zip(methods, widths)
        ]
        for position, token in enumerate(tokens):
            lines.append("  " + token.ljust(token_width) + "".join(f"  {column[position]}" for column in columns))
        lines.append("")
    times = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in explanations.seconds.items())
    lines.append(f"wall time for {count(len(explanations.sentences), 'sentence')}: {times}")
    return "\n".join(lines)


def token_labels(tokens: list[str]) -> list[str]:
    """Each token as a report names it: a token the prompt holds more than once with its
    position, ``token[i]``."""
    repeated = {token for token, times in Counter(tokens).items() if times > 1}
    return [token + (f"[{i}]" if token in repeated else "") for i, token in enumerate(tokens)]


def _top_tokens(tokens: list[str], scores: list[float], special: list[bool], info: MethodInfo, top: int, raw: bool) -> str:
    """The ``top`` highest-scored prompt tokens (special ones left out), as ``token share``;
    a token the prompt holds more than once shows its position, ``token[i]``."""
    values = scores if raw else shares(scores, special, info.signed)
    ranked = sorted(((v, i) for i, v in enumerate(values) if v is not None and not special[i]), reverse=True)[:top]
    number = "{:.3e}" if raw else ("{:+.3f}" if info.signed else "{:.3f}")
    labels = token_labels(tokens)
    named = [terminal_safe(labels[i]) for _, i in ranked]
    if not ranked:
        return "(no prompt token to rank: every one is a special token)"
    return " | ".join(f"{name} {number.format(v)}" for name, (v, _) in zip(named, ranked))


def render_answer_text(explanation: AnswerExplanation, top: int = 5, raw: bool = False) -> str:
    """The terminal report of an answer: the answer, then per method its top prompt tokens
    for the whole answer and, where computed, for each answer token."""
    how = "generated (greedy)" if explanation.generated else "given"
    lines = [
        f"prompt: {count(len(explanation.prompt_tokens), 'token')}"
        + (f" explained, {len(explanation.skipped)} skipped by --skip" if explanation.skipped else "")
        + f"; answer, {how}, {count(len(explanation.answer_tokens), 'token')}:",
        f"  {terminal_safe(explanation.answer)}",
        "",
        f"top {top} prompt tokens per method, by their share of the method's scores over the prompt's words"
        + (f" (the chat template's {count(sum(explanation.template), 'token')} left out, as the special ones)"
           if any(explanation.template) else "")
        + (" (--raw: the scores)" if raw else "") + "; a token the prompt holds more than once shows its "
        "position among the explained tokens, token[i]:",
    ]
    tokens, special = explanation.prompt_tokens, explanation.left_out
    for method, scores in explanation.seq_attr.items():
        info = explanation.methods[method]
        lines.append(f"{method} ({explanation.seconds[method] * 1000:.0f} ms), the whole answer:")
        lines.append(f"  {_top_tokens(tokens, scores, special, info, top, raw)}")
        grid = explanation.image_grids.get(method)
        if grid is not None:
            lines.append(f"  image: {peak_cell(grid, info)}")
        token_grids = explanation.token_grids.get(method, [])
        for i, (answer_token, row) in enumerate(zip(explanation.answer_tokens, explanation.token_attr.get(method, []))):
            shown = [] if len(tokens) == 1 and token_grids else [_top_tokens(tokens, row, special, info, min(top, 3), raw)]
            shown += [f"image: {peak_cell(token_grids[i], info)}"] if token_grids else []
            lines.append(f"  {terminal_safe(answer_token)!s:>12} <- {'; '.join(shown)}")
    return "\n".join(lines)


def answer_line(explanation: QuestionAnswerExplanation) -> str:
    """An extractive answer, how it was chosen, where it lies and how sure the model is of
    its two ends; the predicted answer beside a given one."""
    how = "given" if explanation.given else "predicted"
    predicted = f"; predicted: {terminal_safe(explanation.predicted)!r}" if explanation.given else ""
    return (
        f"answer, {how}: {terminal_safe(explanation.answer)!r} (tokens {explanation.start}-{explanation.end}; "
        f"p {explanation.start_probability:.3f} at its start, {explanation.end_probability:.3f} at its end, over the "
        f"context{predicted})"
    )


def text_windows_note(explanation: TokenClassExplanation) -> str | None:
    """Where the text was read in windows, how each word (mask) was placed; else None."""
    if len(explanation.windows) == 1:
        return None
    item = "mask" if explanation.masked else "word"
    return (f"the text is longer than the model takes: it was read in {len(explanation.windows)} overlapping windows; each "
            f"{item} is read and explained in the window where it has the most context, named beside it")


def window_name(explanation: TokenClassExplanation, word: WordLabel) -> str:
    """Which window ``word`` is read in, where the text was read in several; else ""."""
    if len(explanation.windows) == 1:
        return ""
    first, end = explanation.windows[word.window].characters
    return f"window {word.window + 1}, characters {first}-{end}"


def window_note(explanation: QuestionAnswerExplanation) -> str | None:
    """Where the context was read in windows, which one is shown; else None."""
    if explanation.windows == 1:
        return None
    first, end = explanation.window
    shown = "the first window that holds the answer" if explanation.given else "the window of the answer, the best of all"
    return (f"the context is longer than the model takes: it was read in {explanation.windows} overlapping windows; shown "
            f"and explained: {shown}, the context's characters {first} to {end}")


def render_question_text(explanation: QuestionAnswerExplanation, top: int = 5, raw: bool = False) -> str:
    """The terminal report of an extractive answer: the answer, then per method its top
    tokens (question and context) for the answer's start and for its end."""
    lines = [f"question: {terminal_safe(explanation.question)}", answer_line(explanation)]
    note = window_note(explanation)
    lines += [] if note is None else [f"note: {note}"]
    lines += [
        "",
        f"top {top} tokens per method for the answer's start and end logits, by their share of the method's scores "
        "over the words of the question and the context" + (" (--raw: the scores)" if raw else "")
        + "; a token the text holds more than once shows its position, token[i]:",
    ]
    labels = token_labels(explanation.tokens)
    for method, rows in explanation.scores.items():
        info = explanation.methods[method]
        lines.append(f"{method} ({explanation.seconds[method] * 1000:.0f} ms):")
        for end, position in (("start", explanation.start), ("end", explanation.end)):
            shown = _top_tokens(explanation.tokens, rows[end], explanation.special, info, top, raw)
            lines.append(f"  {end:>5} ({terminal_safe(labels[position])}) <- {shown}")
    return "\n".join(lines)


def labels_line(explanation: TokenClassExplanation) -> str:
    """The explained words (masks) and their labels (predicted tokens), or why there are
    none."""
    if not explanation.words:
        return f"no word is labelled other than {OUTSIDE!r}: --target WORD explains one word's label"
    listed = " | ".join(
        f"{terminal_safe(word.word)} {terminal_safe(word.label)} (p {word.probability:.3f})" for word in explanation.words
    )
    if explanation.masked:
        return f"{'masks and the token given' if explanation.given else 'masks and their predicted tokens'}: {listed}"
    return f"{'word, given' if explanation.given else 'words and their predicted labels'}: {listed}"


def read_where(explanation: TokenClassExplanation) -> str:
    """What each row of a token classifier's (a masked language model's) report explains."""
    return "each mask's token, read at the mask" if explanation.masked else "each word's label, read at its first token"


def render_token_class_text(explanation: TokenClassExplanation, top: int = 5, raw: bool = False) -> str:
    """The terminal report of a token classifier's labels: the explained words, then per
    method, for each word, its label's top tokens."""
    lines = [f"text: {terminal_safe(explanation.text)}", labels_line(explanation)]
    note = text_windows_note(explanation)
    lines += [] if note is None else [f"note: {note}"]
    if not explanation.words:
        return "\n".join(lines)
    lines += [
        "",
        f"top {top} tokens per method for {read_where(explanation)}, by their share of the method's "
        "scores over the words" + (" (--raw: the scores)" if raw else "") + "; a token the text holds more than once "
        "shows its position, token[i]:",
    ]
    named = [
        f"{terminal_safe(word.word)} ({', '.join(filter(None, [terminal_safe(word.label), window_name(explanation, word)]))})"
        for word in explanation.words
    ]
    width = max(len(name) for name in named)
    for method, info in explanation.methods.items():
        lines.append(f"{method} ({explanation.seconds[method] * 1000:.0f} ms):")
        for word, name in zip(explanation.words, named):
            window = explanation.windows[word.window]
            shown = _top_tokens(window.tokens, word.scores[method], window.special, info, top, raw)
            lines.append(f"  {name:>{width}} <- {shown}")
    return "\n".join(lines)


def render_image_class_text(explanation: ImageClassExplanation, raw: bool = False) -> str:
    """The terminal report of an image classifier's prediction: the class, then per method
    where its scores on the image's patch grid peak (with ``raw``, the grid itself)."""
    how = "given" if explanation.given else "predicted"
    predicted = f"; predicted: {terminal_safe(explanation.predicted)}" if explanation.given else ""
    lines = [
        f"image: {terminal_safe(explanation.image)}; class, {how}: {terminal_safe(explanation.label)} "
        f"({explanation.reads} {explanation.probability:.3f}{predicted})",
        "",
        "per method, where its scores of the image's patches peak" + (" (--raw: the grid's scores, row by row)" if raw else "") + ":",
    ]
    for method, grid in explanation.grids.items():
        lines.append(f"{method} ({explanation.seconds[method] * 1000:.0f} ms): {peak_cell(grid, explanation.methods[method])}")
        lines += [("  " + " ".join(f"{value:+.3g}" for value in row)) for row in grid] if raw else []
    return "\n".join(lines)


def peak_cell(grid: list[list[float]], info: MethodInfo) -> str:
    """Where on the image's grid a method's scores peak, and that cell's share of the
    image's scores (``"peak at row 1, column 0 of its 4 × 4 grid, 6% of the image's scores"``)."""
    values = [abs(v) if info.signed else v for row in grid for v in row]
    total = sum(abs(v) for v in values)
    if total == 0:
        return f"every cell of its {len(grid)} × {len(grid[0])} grid scores 0"
    peak = max(range(len(values)), key=values.__getitem__)
    share = f", {values[peak] / total:.0%} of the image's scores"
    return f"peak at row {peak // len(grid[0])}, column {peak % len(grid[0])} of its {len(grid)} × {len(grid[0])} grid{share}"
