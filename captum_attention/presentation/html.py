"""A self-contained HTML report: no scripts, no external resources, every token escaped."""

from __future__ import annotations

from html import escape as _escape_markup
from typing import Any, Iterable, Iterator, Sequence

from .answer import AnswerExplanation
from .explain import Explanations, MethodInfo
from .image_class import ImageClassExplanation
from .question_answering import QuestionAnswerExplanation
from .token_class import TokenClassExplanation
from .text import (
    answer_line, count, labels_line, peak_cell, read_where, shares, terminal_safe, text_windows_note, token_labels, window_name,
    window_note,
)


def escape(text: str) -> str:
    """``text`` safe inside the page's markup, control and format characters (bidi
    overrides, zero-width, escape bytes) written as visible escapes as in the terminal."""
    return _escape_markup(terminal_safe(text))


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
section { margin-bottom: 2.5em; }
table { border-collapse: collapse; }
th, td { text-align: left; padding: 0.3em 0.6em; border-bottom: 1px solid #ddd; vertical-align: top; }
td.time { text-align: right; white-space: nowrap; color: #555; }
td.word { white-space: nowrap; }
.tok { display: inline-block; padding: 0.1em 0.25em; margin: 0.1em; border-radius: 0.2em;
       font-family: ui-monospace, monospace; unicode-bidi: isolate; }
.tok.special { color: #888; border: 1px dashed #bbb; }
.tok.marked { text-decoration: underline 2px; text-underline-offset: 0.2em; }
.meaning, .window { color: #555; font-size: 0.9em; }
.note { color: #8a5a00; }
h2.sentence { font-size: 1.05em; font-weight: 600; }
.scroll { overflow-x: auto; max-width: 100%; }
.grids { display: flex; flex-wrap: wrap; gap: 0.8em; }
.grids figure { margin: 0; max-width: 12em; font-size: 0.85em; }
"""

TITLE_CHARACTERS = 80
"""A sentence's heading shows at most this many characters (its tokens show all of it)."""

DARK_CELL = 0.55
"""Colour strengths from which a token's text turns white, to stay readable."""


def _colour(score: float, scale: float, info: MethodInfo) -> str:
    strength = 0.0 if scale == 0 else min(abs(score) / scale, 1.0)
    if info.forward_only:
        rgb = "40, 90, 200"  # blue: the forward pass's mixing, not support for a class
    else:
        rgb = "0, 140, 60" if score >= 0 else "210, 40, 40"
    return f"rgba({rgb}, {strength:.3f})"


def _style(score: float, scale: float, info: MethodInfo) -> str:
    """A coloured cell's style: white text where the colour is dark."""
    dark = scale > 0 and abs(score) / scale >= DARK_CELL
    return f"background: {_colour(score, scale, info)}" + ("; color: #fff" if dark else "")


def _hover(share: float | None, score: float, info: MethodInfo) -> str:
    """A token's hover text: its share of the words' scores, as the terminal table shows
    it, then the score itself."""
    if share is None:
        return escape(f"special token, not coloured (score {score:.3e})")
    return escape(f"share {format(share, '+.3f' if info.signed else '.3f')} of the words (score {score:.3e})")


def _token(token: str, score: float, share: float | None, scale: float, info: MethodInfo, marked: bool = False) -> str:
    title = _hover(share, score, info)
    mark = " marked" if marked else ""
    if share is None:  # left out of the colour scale: rollout and relevance put most mass on [CLS]
        return f'<span class="tok special{mark}" title="{title}">{escape(token)}</span>'
    return f'<span class="tok{mark}" style="{_style(score, scale, info)}" title="{title}">{escape(token)}</span>'


def _scale(scores: list[float], special: list[bool]) -> float:
    """A row's colour scale: its largest absolute word score (special tokens left out)."""
    return max((abs(s) for s, is_special in zip(scores, special) if not is_special), default=0.0)


def _heading(text: str) -> str:
    """A sentence's heading: its first :data:`TITLE_CHARACTERS` characters."""
    return text if len(text) <= TITLE_CHARACTERS else text[: TITLE_CHARACTERS - 1].rstrip() + "…"


def _meaning(
    info: MethodInfo, explained: str = "the explained class", untargeted: str = "from the forward pass alone, the same for every class"
) -> str:
    if info.forward_only:
        return f"blue: {untargeted}"
    if info.signed:
        return f"green supports, red opposes {explained}"
    return f"green: support for {explained} (never negative)"


def _page_head(style: str, title: str = "captum-attention report") -> list[str]:
    """A report page's first lines: its head with ``style``, and its ``title`` as the heading."""
    return [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title>",
        f"<style>{style}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]


def render_html(explanations: Explanations, model_name: str) -> str:
    """The report page: per sentence the prediction and a coloured token row per method."""
    count = len(explanations.sentences)
    parts = [
        *_page_head(_STYLE),
        f"<p>Model: <code>{escape(model_name)}</code>. Wall times are for the whole batch of "
        f"{count} sentence{'s' if count != 1 else ''}.</p>",
        "<p class=\"legend\">Colour strength is relative to the largest score of the row's words; "
        f"special tokens ({_special_example(t for s in explanations.sentences for t in _specials(s.tokens, s.special))}) "
        "are left out of the scale and not coloured. Under each method: what its colour means. Hover a token for its "
        f"share of the words' scores (as in the terminal table) and the score itself. Sentences of more than {LONG_PROMPT} "
        f"tokens show {SHOWN_AROUND} tokens around each method's top {TOP_TOKENS}.</p>",
    ]
    for sentence in explanations.sentences:
        parts.append("<section>")
        parts.append(f'<h2 class="sentence"><bdi>{escape(_heading(sentence.shown_text))}</bdi></h2>')
        probabilities = ", ".join(f"<bdi>{escape(label)}</bdi> {p:.3f}" for label, p in sentence.probabilities.items())
        parts.append(
            f"<p>Prediction: <b><bdi>{escape(sentence.label)}</bdi></b> ({sentence.output} = {sentence.probability:.3f}; "
            f"{probabilities}); explaining <b><bdi>{escape(sentence.target_label)}</bdi></b>.</p>"
        )
        if sentence.all_unknown:
            parts.append('<p class="note">Every word is unknown to the tokenizer: the model saw no word of this text.</p>')
        if sentence.cut_from is not None:
            lost = "the longer text's last tokens are" if sentence.text_pair is not None else "the rest is"
            parts.append(
                f'<p class="note">Cut to the model\'s {len(sentence.tokens)} tokens (of {sentence.cut_from}): '
                f"{escape(lost)} neither seen nor explained.</p>"
            )
        parts += [f'<p class="note"><bdi>{escape(method)}</bdi>: {escape(note)}.</p>' for method, note in sentence.notes.items()]
        parts.append("<table><tr><th>method</th><th>wall time</th><th>tokens</th></tr>")
        for method, seconds in explanations.seconds.items():
            info = explanations.methods[method]
            row = _token_row(sentence.tokens, sentence.scores[method], sentence.special, info)
            parts.append(
                f"<tr><td>{escape(method)}<br><span class=\"meaning\">{escape(_meaning(info))}</span></td>"
                f"<td class=\"time\">{seconds * 1000:.0f} ms</td><td>{row}</td></tr>"
            )
        parts.append("</table></section>")
    parts.append("</body></html>")
    return "\n".join(parts)


SHOWN_AROUND = 6
"""A long prompt shows this many tokens either side of each method's top tokens."""

LONG_PROMPT = 200
"""Prompts of more tokens than this are collapsed around the top tokens."""

TOP_TOKENS = 10
"""Top tokens per method in the summary, and per row kept in a long prompt's heat matrix."""

NEAR_UNIFORM = 1.5
"""A row whose largest word score is less than this many times the mean is near uniform."""


def _top(scores: list[float], special: list[bool], count: int) -> list[int]:
    """The positions of the ``count`` highest-scored words."""
    return sorted((i for i, is_special in enumerate(special) if not is_special), key=lambda i: -scores[i])[:count]


def _peak(scores: list[float], special: list[bool]) -> str:
    """How far the row's largest word score stands above the words' mean: ``×1.1, near
    uniform`` tells a flat row from a peaked one, which the row's own colour scale hides."""
    words = [abs(s) for s, is_special in zip(scores, special) if not is_special]
    mean = sum(words) / len(words) if words else 0.0
    if mean == 0:
        return "all 0"
    ratio = max(words) / mean
    return f"peak ×{ratio:.1f} the mean" + (", near uniform" if ratio < NEAR_UNIFORM else "")


def _shown(keep: set[int], count: int) -> list[int | tuple[int, int]]:
    """Positions ``0..count-1`` with the runs outside ``keep`` (and its neighbourhoods)
    folded into ``(first, last)`` pairs; all positions when the prompt is short."""
    if count <= LONG_PROMPT:
        return list(range(count))
    near = {j for i in keep for j in range(i - SHOWN_AROUND, i + SHOWN_AROUND + 1) if 0 <= j < count}
    shown: list[int | tuple[int, int]] = []
    for position in range(count):
        if position in near:
            shown.append(position)
        elif shown and isinstance(shown[-1], tuple):
            shown[-1] = (shown[-1][0], position)
        else:
            shown.append((position, position))
    return shown


def _token_row(
    tokens: list[str], scores: list[float], special: list[bool], info: MethodInfo, marked: range = range(0)
) -> str:
    """The tokens coloured by ``scores`` on the row's own scale (more than
    :data:`LONG_PROMPT` of them folded around the top tokens), those at the ``marked``
    positions underlined (an extractive answer's)."""
    scale = _scale(scores, special)
    row_shares = shares(scores, special, info.signed)
    parts = []
    for item in _shown(set(_top(scores, special, TOP_TOKENS)), len(tokens)):
        if isinstance(item, tuple):
            parts.append(f'<span class="fold">… {item[1] - item[0] + 1} tokens …</span>')
        else:
            parts.append(_token(tokens[item], scores[item], row_shares[item], scale, info, item in marked))
    return " ".join(parts)


def _heat_matrix(rows: list[list[float]], answer_tokens: list[str], tokens: list[str], special: list[bool], info: MethodInfo) -> str:
    """A table: one row per answer token, one coloured cell per prompt token, each row on
    its own scale (its largest word score) with how peaked it is; special tokens
    uncoloured; a long prompt's columns cut to each row's top tokens."""
    keep = set().union(*(_top(row, special, TOP_TOKENS) for row in rows))
    columns = sorted(keep) if len(tokens) > LONG_PROMPT else list(range(len(tokens)))
    labels = token_labels(tokens)
    header = "".join(f'<th class="col"><bdi>{escape(labels[i])}</bdi></th>' for i in columns)
    body = []
    for answer_token, row in zip(answer_tokens, rows):
        scale = _scale(row, special)
        row_shares = shares(row, special, info.signed)
        cells = "".join(
            f'<td class="cell" title="{_hover(row_shares[i], row[i], info)}"'
            + ("" if special[i] else f' style="{_style(row[i], scale, info)}"')
            + "></td>"
            for i in columns
        )
        body.append(f'<tr><th><bdi>{escape(answer_token)}</bdi></th>{cells}<td class="peak">{escape(_peak(row, special))}</td></tr>')
    return f'<table class="matrix"><tr><th></th>{header}<th></th></tr>{"".join(body)}</table>'


def _answer_spread(explanation: AnswerExplanation, method: str) -> str:
    """How peaked a method's scores for the whole answer are: over the prompt's words; over
    the image's grid where the image is the prompt's one token (an image captioner's)."""
    grid = explanation.image_grids.get(method)
    if grid is not None and len(explanation.prompt_tokens) == 1:
        return f"the image's patches: {_grid_spread(grid)}"
    return _peak(explanation.seq_attr[method], explanation.left_out)


def _summary(explanation: AnswerExplanation) -> str:
    """Per method, its top prompt tokens for the whole answer with their shares."""
    labels, special = token_labels(explanation.prompt_tokens), explanation.left_out
    rows = []
    for method, scores in explanation.seq_attr.items():
        info = explanation.methods[method]
        row_shares = shares(scores, special, info.signed)
        top = ", ".join(
            f"<bdi>{escape(labels[i])}</bdi>&nbsp;{format(row_shares[i] or 0.0, '+.3f' if info.signed else '.3f')}"
            for i in _top(scores, special, 5)
        )
        rows.append(f"<tr><td>{escape(method)}</td><td>{top}</td><td>{escape(_answer_spread(explanation, method))}</td></tr>")
    return "<table><tr><th>method</th><th>top prompt tokens (share)</th><th>spread</th></tr>" + "".join(rows) + "</table>"


_MATRIX_STYLE = """
table.matrix th.col { writing-mode: vertical-rl; font-weight: normal; font-family: ui-monospace, monospace; }
table.matrix td.cell { width: 1em; height: 1.2em; padding: 0; border: 1px solid #eee; }
table.matrix td.peak { white-space: nowrap; color: #555; font-size: 0.85em; padding-left: 0.6em; }
.fold { color: #888; font-style: italic; }
"""


_ANSWER_UNTARGETED = "from the forward pass alone, read at the answer's positions, whatever its tokens"


def render_answer_html(explanation: AnswerExplanation, model_name: str) -> str:
    """The report page of an answer: per method, the prompt coloured by its scores for the
    whole answer and, where computed, a heat matrix of answer tokens × prompt tokens."""
    how = "generated (greedy)" if explanation.generated else "given"
    parts = [
        *_page_head(_STYLE + _MATRIX_STYLE),
        f"<p>Model: <code>{escape(model_name)}</code>. Prompt: {count(len(explanation.prompt_tokens), 'token')}"
        + (f" explained, {len(explanation.skipped)} skipped" if explanation.skipped else "") + ".</p>",
        f"<p>Answer ({how}, {count(len(explanation.answer_tokens), 'token')}): "
        f"<b><bdi>{escape(explanation.answer)}</bdi></b></p>",
        *(f'<p class="note">Warning: {escape(warning)}.</p>' for warning in explanation.warnings),
        '<p class="legend">Each method explains the answer\'s log-probability. Each row of tokens or cells is '
        "coloured on its own scale, relative to its largest word score; its spread says how far that peak stands "
        "above the mean (near uniform below ×1.5, where even faint differences look strong). Special tokens "
        + ("and the chat template's own are" if any(explanation.template) else "are") + " left "
        f"out of the scale. Prompts of more than {LONG_PROMPT} tokens show {SHOWN_AROUND} tokens around each "
        f"method's top {TOP_TOKENS}, and the heat matrices only each row's top {TOP_TOKENS} columns. Hover for a score.</p>",
        "<h2>Summary</h2>",
        _summary(explanation),
    ]
    tokens, special = explanation.prompt_tokens, explanation.left_out
    for method, scores in explanation.seq_attr.items():
        info = explanation.methods[method]
        parts.append(f"<section><h2>{escape(method)}</h2>")
        parts.append(
            f'<p class="meaning">{escape(_meaning(info, "the answer", _ANSWER_UNTARGETED))}; '
            f"{explanation.seconds[method] * 1000:.0f} ms.</p>"
        )
        parts.append(
            f"<p>The whole answer ({escape(_answer_spread(explanation, method))}):</p><p>{_token_row(tokens, scores, special, info)}</p>"
        )
        grid = explanation.image_grids.get(method)
        if grid is not None and explanation.image is not None:
            parts.append(_image_figure(explanation.image, grid, explanation.grid_covers_image, info))
        rows = explanation.token_attr.get(method)
        token_grids = explanation.token_grids.get(method) if explanation.image is not None else None
        if rows and not (token_grids and len(tokens) == 1):  # an image captioner's rows: the grids alone
            parts.append("<p>Each answer token (rows) over the prompt's tokens (columns), each row on its own scale:</p>")
            parts.append(f'<div class="scroll">{_heat_matrix(rows, explanation.answer_tokens, tokens, special, info)}</div>')
        if rows and token_grids and explanation.image is not None:
            where = "over the image" if explanation.grid_covers_image else "alone (not laid over the image: see above)"
            parts.append(f"<p>Each answer token's grid {where}, on its own scale:</p><div class=\"grids\">" + "".join(
                _image_figure(explanation.image, grid, explanation.grid_covers_image, info, TOKEN_IMAGE_INCHES, answer_token)
                for answer_token, grid in zip(explanation.answer_tokens, token_grids)
            ) + "</div>")
        elif explanation.token_attr and not rows:
            parts.append('<p class="meaning">No rows per answer token: this method explains the whole answer only.</p>')
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def render_image_class_html(explanation: ImageClassExplanation, model_name: str) -> str:
    """The report page of an image classifier's prediction: per method, its scores of the
    image's patches drawn over the image."""
    how = "given" if explanation.given else "predicted"
    predicted = f" (predicted: <b>{escape(explanation.predicted)}</b>)" if explanation.given else ""
    parts = [
        *_page_head(_STYLE),
        f"<p>Model: <code>{escape(model_name)}</code>. Image: <code>{escape(explanation.image)}</code>.</p>",
        f"<p>Class ({how}): <b>{escape(explanation.label)}</b>, {explanation.reads} {explanation.probability:.3f}{predicted}</p>",
        *(f'<p class="note">Warning: {escape(warning)}.</p>' for warning in explanation.warnings),
        '<p class="legend">Each method explains the class\'s logit by its scores of the image\'s patches, drawn '
        "over the image where the grid covers it whole (Captum's blended heat map), each on its own scale, relative "
        "to its largest score; its spread "
        "says how far that peak stands above the mean (near uniform below ×1.5, where even faint differences look "
        "strong).</p>",
        "<h2>Summary</h2>",
        "<table><tr><th>method</th><th>peak</th><th>spread</th></tr>" + "".join(
            f"<tr><td>{escape(method)}</td><td>{escape(peak_cell(grid, explanation.methods[method]))}</td>"
            f"<td>{escape(_grid_spread(grid))}</td></tr>"
            for method, grid in explanation.grids.items()
        ) + "</table>",
    ]
    for method, grid in explanation.grids.items():
        info = explanation.methods[method]
        parts.append(f"<section><h2>{escape(method)}</h2>")
        parts.append(f'<p class="meaning">{escape(_meaning(info, "the class"))}; {explanation.seconds[method] * 1000:.0f} ms.</p>')
        parts.append(_image_figure(explanation.image, grid, explanation.grid_covers_image, info, explained="the class"))
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


_QUESTION_UNTARGETED = "from the forward pass alone, read at the answer's first or last token, whatever the logit"
def _specials(tokens: Sequence[str], special: Sequence[bool]) -> Iterator[str]:
    """The special ones of ``tokens``."""
    return (token for token, is_special in zip(tokens, special) if is_special)


def _special_example(specials: Iterable[str]) -> str:
    """The first of a report's ``specials`` as its legend shows it (markup), else BERT's [CLS]."""
    return f'<span class="tok special">{escape(next(iter(specials), "[CLS]"))}</span>'


def _row_scale(specials: Iterable[str]) -> str:
    """The legend of a report's coloured token rows (markup), a special token of the
    report's (``specials``) as its example."""
    return (
        f"Colour strength is relative to the largest score of the row's words; special tokens ({_special_example(specials)}) "
        "are left out of the scale and not coloured. Hover a token for its share of the words' scores and the score itself."
    )


def _method_cells(method: str, meaning: str, seconds: float, rows: int) -> str:
    """A method's name with what its colours mean, and its wall time, each a cell over its
    ``rows`` rows of a report's table."""
    return (
        f"<td rowspan=\"{rows}\">{escape(method)}<br><span class=\"meaning\">{escape(meaning)}</span></td>"
        f"<td rowspan=\"{rows}\" class=\"time\">{seconds * 1000:.0f} ms</td>"
    )


def render_question_html(explanation: QuestionAnswerExplanation, model_name: str) -> str:
    """The report page of an extractive answer: the question, the answer, and per method a
    coloured token row for the answer's start logit and one for its end logit."""
    note, answer = window_note(explanation), answer_line(explanation)
    parts = [
        *_page_head(_STYLE),
        f"<p>Model: <code>{escape(model_name)}</code>.</p>",
        f"<p>Question: <b><bdi>{escape(explanation.question)}</bdi></b></p>",
        f"<p><bdi>{escape(answer[:1].upper() + answer[1:])}</bdi>, underlined in the rows below.</p>",
        *([] if note is None else [f'<p class="note">Note: {escape(note)}.</p>']),
        "<p class=\"legend\">Each method explains the logit of the answer's first token being its start, then that "
        f"of its last token being its end. {_row_scale(_specials(explanation.tokens, explanation.special))}</p>",
        "<table><tr><th>method</th><th>wall time</th><th>logit</th><th>tokens</th></tr>",
    ]
    for method, rows in explanation.scores.items():
        info = explanation.methods[method]
        for end in ("start", "end"):
            described = (
                _method_cells(method, _meaning(info, "the answer", _QUESTION_UNTARGETED), explanation.seconds[method], 2)
                if end == "start" else ""
            )
            row = _token_row(explanation.tokens, rows[end], explanation.special, info, range(explanation.start, explanation.end + 1))
            parts.append(f"<tr>{described}<td>{end}</td><td>{row}</td></tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)


def render_token_class_html(explanation: TokenClassExplanation, model_name: str) -> str:
    """The report page of a token classifier's labels (a masked language model's
    predictions): per method, a coloured token row for each explained word's label (each
    mask's token), the token where it is read underlined."""
    note, words = text_windows_note(explanation), labels_line(explanation)
    parts = [
        *_page_head(_STYLE),
        f"<p>Model: <code>{escape(model_name)}</code>.</p>",
        f"<p>Text: <bdi>{escape(explanation.text)}</bdi></p>",
        f"<p><bdi>{escape(words[:1].upper() + words[1:])}</bdi>.</p>",
        *([] if note is None else [f'<p class="note">Note: {escape(note)}.</p>']),
    ]
    if explanation.words:
        parts += [
            f"<p class=\"legend\">Each method explains the logit of {escape(read_where(explanation))} (underlined). "
            f"{_row_scale(t for w in explanation.windows for t in _specials(w.tokens, w.special))}</p>",
            f"<table><tr><th>method</th><th>wall time</th><th>{'mask' if explanation.masked else 'word'}</th><th>tokens</th></tr>",
        ]
    for method, info in explanation.methods.items():
        for index, word in enumerate(explanation.words):
            meaning = _meaning(info, "the token" if explanation.masked else "the label", _TOKEN_UNTARGETED)
            described = _method_cells(method, meaning, explanation.seconds[method], len(explanation.words)) if index == 0 else ""
            window = explanation.windows[word.window]
            row = _token_row(window.tokens, word.scores[method], window.special, info, range(word.position, word.position + 1))
            where = window_name(explanation, word)
            placed = f'<br><span class="window">{escape(where)}</span>' if where else ""
            parts.append(f"<tr>{described}<td class=\"word\"><bdi>{escape(word.word)}</bdi> ({escape(word.label)}){placed}</td>"
                         f"<td>{row}</td></tr>")
    parts.append(("</table>" if explanation.words else "") + "</body></html>")
    return "\n".join(parts)


_TOKEN_UNTARGETED = "from the forward pass alone, read at the token explained, whatever its label"


def _grid_spread(grid: list[list[float]]) -> str:
    """:func:`_peak` over an image's grid of scores."""
    cells = [cell for row in grid for cell in row]
    return _peak(cells, [False] * len(cells))


IMAGE_INCHES = 3
"""The side of an image's figure in the report, in inches (at 100 dpi)."""

TOKEN_IMAGE_INCHES = 1.5
"""The side of each answer token's figure."""


def _image_figure(
    image_path: str, grid: list[list[float]], covers: bool, info: MethodInfo, inches: float = IMAGE_INCHES,
    label: str | None = None, explained: str = "the whole answer",
) -> str:
    """The image tokens' scores for the whole answer (``explained``: an image classifier's
    class), or the answer token ``label`` (its caption), over the image (Captum's blended
    heat map, the grid upsampled to the image) where it ``covers`` the whole image, else on
    their grid alone (a processor that crops or pads it), as an embedded PNG ``inches`` wide."""
    import base64
    import io

    import numpy as np
    import torch
    from captum.attr import visualization
    from matplotlib.figure import Figure
    from PIL import Image

    from ..attr import upsample_to_image

    scores = torch.tensor(grid)[None]
    rows, columns = scores.shape[1:]
    if not bool(scores.any()):  # Grad-SAM on features no query reads (Mllama's image states)
        return f'<p class="meaning">Every cell of the image\'s {rows} × {columns} grid scores 0 under this method{"" if label is None else ", " + escape(label)}.</p>'
    scores = scores / scores.abs().max()  # drawn relative to its peak; Captum warns of tiny scales
    sign = "all" if info.signed else "absolute_value"
    unsigned = "Blues" if info.forward_only else "Greens"  # as the tokens are coloured
    if covers:
        image = np.asarray(Image.open(image_path).convert("RGB"), dtype=np.float64) / 255
        upsampled = upsample_to_image(scores, torch.zeros(1, 1, *image.shape[:2]))[0].numpy()
        figure, _ = visualization.visualize_image_attr(
            upsampled, image, method="blended_heat_map", sign=sign, use_pyplot=False, alpha_overlay=0.55,
            cmap=None if info.signed else unsigned,
            fig_size=(inches, inches),
        )
        caption = f"The image's {rows} × {columns} grid over the image, {explained}."
    else:
        figure = Figure(figsize=(inches, inches))
        axes = figure.add_subplot()
        peak = float(scores.abs().max()) or 1.0  # green supports, red opposes, as the tokens are coloured
        axes.imshow(scores[0].numpy(), cmap="RdYlGn" if info.signed else unsigned, vmin=-peak if info.signed else 0, vmax=peak)
        axes.set_axis_off()
        caption = (f"The image's {rows} × {columns} grid, {explained}; not laid over the image, of which it covers "
                   "another part or shape (its processor crops or pads it).")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight", dpi=100)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    caption = caption if label is None else label
    return (f'<figure><img alt="{escape(caption)}" src="data:image/png;base64,{encoded}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


_EVALUATION_STYLE = """
.scroll.rows { max-height: 80vh; overflow-y: auto; }
.scroll.rows th { position: sticky; top: 0; background: #fff; }
.interval { display: block; white-space: nowrap; color: #555; font-size: 0.85em; }
.rows td.answer { min-width: 16em; }
"""

SHOWN_ROWS = 500
"""The evaluation report lists at most this many result rows (``results.jsonl`` has all)."""


IMAGE_METRIC_PREFIX = "image_"
"""What names a metric's column over a vision-language model's image patches (``evaluate``'s
``image_top_k_log_prob_drop``, ...)."""


def metric_better(metric: str) -> str | None:
    """``"higher"`` or ``"lower"``: which values of a results column are the better (an image
    column's: its metric's, :data:`IMAGE_METRIC_PREFIX`); None for a metric not registered."""
    from ..metrics import METRICS

    name = metric if metric in METRICS else metric.removeprefix(IMAGE_METRIC_PREFIX)
    return METRICS[name].better if name in METRICS else None


def render_evaluation_html(summary: list[dict], rows: list[dict], metrics: list[str], title: str) -> str:
    """The report of an ``evaluate`` run: per method and metric the mean and its 95%
    bootstrap interval (the best mean of each metric in bold), each method's paired
    difference to the best, how often each method was the best on an example, and the rows
    themselves (the first :data:`SHOWN_ROWS`)."""
    methods = list(dict.fromkeys(entry["method"] for entry in summary))
    better = {metric: metric_better(metric) for metric in metrics}
    arrows = {"higher": " ↑", "lower": " ↓", None: ""}
    header = "".join(f"<th>{escape(metric)}{arrows[better[metric]]}</th>" for metric in metrics)
    parts = [
        *_page_head(_STYLE + _EVALUATION_STYLE, "captum-attention evaluation"),
        f"<p><code>{escape(title)}</code>: {len({row['index'] for row in rows})} examples, "
        f"{len(methods)} methods. ↑: higher is better, ↓: lower is better.</p>",
        "<section><h2>Summary</h2>",
        "<p>Mean over the examples with a value, under it its 95% bootstrap interval and n; the best mean of each "
        "metric in bold.</p>",
        f'<div class="scroll"><table><tr><th>method</th>{header}</tr>',
    ]
    cell = {(entry["method"], entry["metric"]): entry for entry in summary}
    best = {metric: _best([cell[m, metric]["mean"] for m in methods], better[metric]) for metric in metrics}
    for method in methods:
        cells = []
        for metric in metrics:
            entry = cell[method, metric]
            if entry["mean"] is None:
                cells.append("<td>n/a</td>")
                continue
            mean = f"{entry['mean']:.3f}"
            interval = f"[{entry['low']:.3f}, {entry['high']:.3f}] n={entry['n']}"
            cells.append(f"<td>{'<b>' + mean + '</b>' if entry['mean'] == best[metric] else mean}"
                         f'<span class="interval">{interval}</span></td>')
        parts.append(f"<tr><td>{escape(method)}</td>{''.join(cells)}</tr>")
    paired = [metric for metric in metrics if any("best" in cell[m, metric] for m in methods)]
    if paired and len(methods) > 1:
        parts += ["</table></div></section>", "<section><h2>Against the best</h2>",
                  "<p>Each method's value minus the best method's on the same examples: the mean, under it its 95% "
                  "bootstrap interval. An interval that holds 0: these examples do not tell the two apart.</p>",
                  '<div class="scroll"><table><tr><th>method</th>'
                  + "".join(f"<th>{escape(metric)}{arrows[better[metric]]}</th>" for metric in paired) + "</tr>"]
        for method in methods:
            parts.append(f"<tr><td>{escape(method)}</td>" + "".join(_difference_cell(cell[method, metric]) for metric in paired) + "</tr>")
    parts += ["</table></div></section>", "<section><h2>Wins</h2>",
              "<p>On how many examples each method had the best value of each metric (ties count for each).</p>",
              f'<div class="scroll"><table><tr><th>method</th>{header}</tr>']
    wins = _wins(rows, methods, metrics, better)
    for method in methods:
        parts.append(f"<tr><td>{escape(method)}</td>" + "".join(f"<td>{wins[method, metric]}</td>" for metric in metrics) + "</tr>")
    extra = [key for key in ("answer", "generated", "answer_log_prob", "explained", "label", "predicted", "probability") if any(key in row for row in rows)]
    parts += ["</table></div></section>", "<section><h2>Results</h2>"]
    if len(rows) > SHOWN_ROWS:
        parts.append(f'<p class="note">The first {SHOWN_ROWS} of {len(rows)} rows; results.jsonl holds them all.</p>')
    parts.append('<div class="scroll rows"><table><tr><th>line</th><th>method</th>' + "".join(f"<th>{escape(k)}</th>" for k in extra) + header + "</tr>")
    for row in rows[:SHOWN_ROWS]:
        shown_extra = "".join(f'<td class="{key}"><bdi>{escape(_value(row.get(key)))}</bdi></td>' for key in extra)
        values = "".join(f"<td>{escape(_value(row.get(metric)))}</td>" for metric in metrics)
        parts.append(f"<tr><td>{row.get('line', '')}</td><td>{escape(row['method'])}</td>{shown_extra}{values}</tr>")
    parts.append("</table></div></section></body></html>")
    return "\n".join(parts)


def difference_parts(entry: dict[str, Any]) -> tuple[str, str]:
    """An entry's paired difference to its metric's best method as the summaries show it:
    the mean (or "best", "n/a", "" where the metric has no direction) and its interval."""
    if "best" not in entry:
        return "", ""
    difference = entry["difference"]
    if difference is None:
        return "best", ""
    if difference["mean"] is None:
        return "n/a", ""
    mean, low, high = (f"{round(difference[key], 3) + 0.0:+.3f}" for key in ("mean", "low", "high"))  # + 0.0: no "-0.000"
    return mean, f"[{low}, {high}]"


def _difference_cell(entry: dict[str, Any]) -> str:
    mean, interval = difference_parts(entry)
    return f"<td>{escape(mean)}" + (f'<span class="interval">{escape(interval)}</span>' if interval else "") + "</td>"


def _best(means: list, better: str | None) -> float | None:
    known = [m for m in means if m is not None]
    if better is None or not known:
        return None
    return max(known) if better == "higher" else min(known)


def _wins(rows: list[dict], methods: list[str], metrics: list[str], better: dict) -> dict[tuple[str, str], int]:
    wins = {(method, metric): 0 for method in methods for metric in metrics}
    by_example: dict = {}
    for row in rows:
        by_example.setdefault(row["index"], []).append(row)
    for example_rows in by_example.values():
        for metric in metrics:
            best = _best([row.get(metric) for row in example_rows], better[metric])
            for row in example_rows:
                if best is not None and row.get(metric) == best:
                    wins[row["method"], metric] += 1
    return wins


def _value(value: object) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
