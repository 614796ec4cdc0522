"""The data files of ``evaluate``: reading examples from JSONL or CSV, batching them by
length, and writing results so that a file is either whole or absent."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .text import has_surrogates


class DatasetError(ValueError):
    """A data set file that cannot be read as asked (the message names the line)."""


@dataclass(frozen=True)
class Example:
    """One row of a data set: its position (0-based, over the kept rows), the line it came
    from, the text, and optionally its label (a class index, or a label's name until the
    model's labels map it), rationale words and the second text of a pair the classifier
    reads with the first (an NLI model's hypothesis)."""

    index: int
    line: int
    text: str
    label: int | str | None = None
    rationale: tuple[str, ...] | None = None
    text_pair: str | None = None

    @property
    def inputs(self) -> str | tuple[str, str]:
        """What the tokenizer reads: the text, or the pair ``(text, text_pair)``."""
        return self.text if self.text_pair is None else (self.text, self.text_pair)


def read_dataset(path: str | Path, skip_malformed: bool = False) -> tuple[list[Example], list[str]]:
    """The examples of a JSONL or CSV file (by its suffix), and the problems skipped.

    Each row has ``text``, optionally ``text_pair`` (the second text of a pair, as
    transformers' tokenizers and pipelines name it), ``label`` (a class index, or the name
    of one of the model's labels, kept as a string) and ``rationale`` (a list of words, of
    either text, in JSONL; words separated by spaces in CSV). A malformed row raises
    :class:`DatasetError` naming its line, or with ``skip_malformed`` is skipped and
    reported in the second list.
    """
    path = Path(path)
    text = _text(path, (".jsonl", ".csv"), "give a .jsonl or .csv file (one example per row)")
    rows = _jsonl_rows(text) if path.suffix.lower() == ".jsonl" else _csv_rows(text)
    return _examples(path, rows, _example, skip_malformed)


def _text(path: Path, suffixes: tuple[str, ...], advice: str) -> str:
    """The data file's text, without the byte-order mark some editors and spreadsheets
    write first (Excel's "CSV UTF-8"), or a clear error (missing, another kind of file, not
    UTF-8)."""
    if not path.is_file():
        raise DatasetError(f"data set not found: {path}")
    if path.suffix.lower() not in suffixes:
        raise DatasetError(f"{path}: {advice}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text") from error


def _examples(path: Path, rows: Iterable[tuple[int, Any]], make: Any, skip_malformed: bool) -> tuple[list[Any], list[str]]:
    """``make(index, line, row)`` of each row; a malformed row stops with its line, or with
    ``skip_malformed`` is skipped and reported."""
    examples: list[Any] = []
    skipped: list[str] = []
    for line, row in rows:
        try:
            examples.append(make(len(examples), line, row))
        except DatasetError as error:
            if not skip_malformed:
                raise DatasetError(f"{path}, line {line}: {error} (pass --skip-malformed to skip such rows)") from None
            skipped.append(f"line {line}: {error}")
    if not examples:
        raise DatasetError(f"{path} has no example" + (f" ({len(skipped)} malformed rows skipped)" if skipped else ""))
    return examples, skipped


def _jsonl_rows(text: str) -> Iterable[tuple[int, Any]]:
    for line, content in enumerate(text.splitlines(), start=1):
        if not content.strip():
            continue
        try:
            yield line, json.loads(content)
        except json.JSONDecodeError as error:
            yield line, DatasetError(f"not JSON ({error.msg})")


def _csv_rows(text: str, column: str = "text") -> Iterable[tuple[int, Any]]:
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or column not in reader.fieldnames:
        raise DatasetError(f"the CSV file needs a header row with a '{column}' column")
    for row in reader:
        rationale = row.get("rationale")
        yield reader.line_num, {**row, "rationale": rationale.split() if rationale else None}


def _example(index: int, line: int, row: Any) -> Example:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError("a row must be an object with a 'text' field")
    text = row.get("text")
    if not isinstance(text, str) or not text.strip():
        raise DatasetError("'text' is missing or empty")
    text_pair = row.get("text_pair")
    if text_pair == "":  # a CSV row without one
        text_pair = None
    if text_pair is not None and (not isinstance(text_pair, str) or not text_pair.strip()):
        raise DatasetError("'text_pair' must be a non-empty string (leave it out for one text)")
    for name, value in (("text", text), ("text_pair", text_pair or "")):
        if has_surrogates(value):
            raise DatasetError(f"'{name}' holds a lone surrogate (an escape such as \\ud800 that is no character)")
    label = _label(row)
    rationale = row.get("rationale")
    if rationale is not None and (not isinstance(rationale, list) or not all(isinstance(w, str) for w in rationale)):
        raise DatasetError("'rationale' must be a list of words")
    return Example(index, line, text, label, None if rationale is None else tuple(rationale), text_pair)


def _label(row: dict[str, Any]) -> int | str | None:
    """A row's ``label``: a class index, a label's name (kept as a string), or None."""
    label = row.get("label")
    if label in (None, ""):
        return None
    if isinstance(label, float) and label.is_integer():  # 1.0, as pandas writes an int column with gaps
        return int(label)
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise DatasetError(f"'label' must be a class index or a label's name, got {label!r}")
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return label


BOX_FORMAT = "[x0, y0, x1, y1]: the object's left, top, right and bottom edges in the image's pixels"


def _box(row: dict[str, Any], image: str) -> tuple[float, float, float, float] | None:
    """A row's ``box`` within its ``image`` (a list of four numbers, or a CSV field of
    them), or None."""
    box = row.get("box")
    if box in (None, ""):
        return None
    if isinstance(box, str):
        try:
            box = [float(part) for part in box.strip().strip("[]").replace(",", " ").split()]
        except ValueError:
            box = None
    numbers = isinstance(box, list) and len(box) == 4 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box
    )
    if not numbers:
        raise DatasetError(f"'box' must be {BOX_FORMAT}, got {row.get('box')!r}")
    assert isinstance(box, list)  # checked above
    x0, y0, x1, y1 = (float(v) for v in box)
    from PIL import Image

    with Image.open(image) as picture:
        width, height = picture.size
    if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise DatasetError(f"'box' {row.get('box')!r} is not within the {width} × {height} image: give {BOX_FORMAT}, x0 < x1 and y0 < y1")
    return x0, y0, x1, y1


@dataclass(frozen=True)
class ImageExample:
    """One row of an image classifier's data set: its position, its line, the image file
    (resolved against the data file's folder), the SHA-256 of its bytes (two runs on other
    images are not the same run), and optionally its label and the box of the object the
    class names (``(x0, y0, x1, y1)``: left, top, right and bottom edges, in the image's
    pixels)."""

    index: int
    line: int
    image: str
    image_sha256: str
    label: int | str | None = None
    box: tuple[float, float, float, float] | None = None


def read_images(path: str | Path, skip_malformed: bool = False) -> tuple[list[ImageExample], list[str]]:
    """The examples of an image classifier's JSONL or CSV file (by its suffix), and the
    problems skipped: each row has ``image`` (a path, relative to the data file's folder or
    absolute), optionally ``label`` (a class index, or the name of one of the model's
    labels) and ``box`` (the object's ``[x0, y0, x1, y1]`` in the image's pixels; in a CSV
    file the four numbers in one field, e.g. ``"10 20 64 80"``). Malformed rows as
    :func:`read_dataset`'s."""
    path = Path(path)
    text = _text(path, (".jsonl", ".csv"), "give a .jsonl or .csv file (one image per row)")
    rows = _jsonl_rows(text) if path.suffix.lower() == ".jsonl" else _csv_rows(text, "image")
    folder = path.parent

    def example(index: int, line: int, row: Any) -> ImageExample:
        if isinstance(row, DatasetError):
            raise row
        if not isinstance(row, dict) or row.get("image") in (None, ""):
            raise DatasetError("a row must be an object with an 'image' field (the image to classify)")
        if row.get("text") not in (None, ""):
            raise DatasetError("an image classifier reads no text: leave 'text' out")
        image, digest = _image_file(row["image"], folder)
        assert image is not None and digest is not None  # given
        return ImageExample(index, line, image, digest, _label(row), _box(row, image))

    return _examples(path, rows, example, skip_malformed)


@dataclass(frozen=True)
class AnswerExample:
    """One row of a language model's data set: its position, its line, the prompt, and
    optionally the answer to explain (None: generate it), the prompt's segments (the
    parts the context metrics remove; they concatenate to the prompt) and, where the prompt
    is the user's message put in a chat template, the characters of ``text`` that hold the
    message (the segments make up the message; the template around it is never removed);
    for a vision-language model, the image file the prompt is about and the SHA-256 of its
    bytes (two runs on other images are not the same run)."""

    index: int
    line: int
    text: str
    answer: str | None = None
    segments: tuple[str, ...] | None = None
    message: tuple[int, int] | None = None
    image: str | None = None
    image_sha256: str | None = None


def read_answers(path: str | Path, skip_malformed: bool = False, captions: bool = False) -> tuple[list[AnswerExample], list[str]]:
    """The examples of a JSONL file of prompts, and the problems skipped.

    Each row has ``prompt`` (a string), or ``segments`` (a list of strings that make up
    the prompt, in order), or both (then the segments must join to the prompt); and
    optionally ``answer``, and ``image`` (a vision-language model's image file, relative to
    the JSONL file's folder or absolute). With ``captions`` (an image captioner's rows),
    each row has an ``image`` and optionally its caption as ``answer``, and no prompt.
    Malformed rows as :func:`read_dataset` treats them.
    """
    path = Path(path)
    text = _text(path, (".jsonl",), "give a .jsonl file of prompts (one object per line)")
    example = _caption_example if captions else _answer_example
    return _examples(path, _jsonl_rows(text), lambda index, line, row: example(index, line, row, path.parent), skip_malformed)


def holds_prompts(path: str | Path) -> bool:
    """Whether a row of the JSONL file of answers at ``path`` gives a prompt (``prompt`` or
    ``segments``): a model that captions an image alone reads rows that give none as
    captions. True for a file :func:`read_answers` cannot read (it says why)."""
    try:
        text = _text(Path(path), (".jsonl",), "")
    except DatasetError:
        return True
    return any(isinstance(row, dict) and ("prompt" in row or "segments" in row) for _, row in _jsonl_rows(text))


def _caption_example(index: int, line: int, row: Any, folder: Path) -> AnswerExample:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict) or row.get("image") is None:
        raise DatasetError("a row must be an object with an 'image' field (the image to caption)")
    if "prompt" in row or "segments" in row:
        raise DatasetError("an image captioner reads no prompt: leave 'prompt' and 'segments' out (its features are the image's patches)")
    answer = _answer_text(row)
    image, digest = _image_file(row["image"], folder)
    return AnswerExample(index, line, "", answer, None, None, image, digest)


def _answer_text(row: dict[str, Any]) -> str | None:
    """A row's ``answer``, checked (None: generate one)."""
    answer = row.get("answer")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        raise DatasetError("'answer' must be a non-empty string (leave it out to generate one)")
    if answer is not None and has_surrogates(answer):
        raise DatasetError("'answer' holds a lone surrogate (an escape such as \\ud800 that is no character)")
    return answer


def _answer_example(index: int, line: int, row: Any, folder: Path) -> AnswerExample:
    if isinstance(row, DatasetError):
        raise row
    if not isinstance(row, dict):
        raise DatasetError("a row must be an object with a 'prompt' or 'segments' field")
    segments = row.get("segments")
    if segments is not None and (not isinstance(segments, list) or not segments or not all(isinstance(s, str) for s in segments)):
        raise DatasetError("'segments' must be a non-empty list of strings")
    prompt = row.get("prompt", "".join(segments) if segments else None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError("'prompt' is missing or empty")
    if segments is not None and "".join(segments) != prompt:
        raise DatasetError("'segments' do not join to 'prompt': give segments that make up the prompt, in order")
    if has_surrogates(prompt):
        raise DatasetError("'prompt' holds a lone surrogate (an escape such as \\ud800 that is no character)")
    answer = _answer_text(row)
    image, digest = _image_file(row.get("image"), folder)
    return AnswerExample(index, line, prompt, answer, None if segments is None else tuple(segments), None, image, digest)


def _image_file(image: Any, folder: Path) -> tuple[str | None, str | None]:
    """A row's ``image`` resolved against the data's ``folder``, and the SHA-256 of its bytes."""
    if image is None:
        return None, None
    if not isinstance(image, str) or not image.strip():
        raise DatasetError("'image' must be the path of an image file")
    from PIL import Image, UnidentifiedImageError

    path = folder / image
    if not path.is_file():
        raise DatasetError(f"'image' {image}: no such file (paths are read from the data file's folder)")
    try:
        with Image.open(path) as picture:
            picture.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:  # PIL's verify raises SyntaxError on broken files
        raise DatasetError(f"'image' {image}: not an image PIL reads ({error})") from None
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class PositionExample:
    """One row of a data set whose outputs are read at tokens: its position, its line, the
    text (a question answerer's context), a question answerer's question, and optionally
    what to explain (None: the prediction): an answer as the context spells it, a word of
    the text (a token classifier's), a token (a masked language model's, at each mask)."""

    index: int
    line: int
    text: str
    question: str | None = None
    target: str | None = None


POSITION_FIELDS = {
    "question-answering": ("context", "answer"),
    "token-classification": ("text", "word"),
    "fill-mask": ("text", "target"),
}
"""Each task's field of the text and of what to explain, in a row of
:func:`read_positions` (a question answerer's rows have a ``question`` too)."""


def read_positions(path: str | Path, task: str, skip_malformed: bool = False) -> tuple[list[PositionExample], list[str]]:
    """The examples of a JSONL or CSV file for a model of ``task`` (a key of
    :data:`POSITION_FIELDS`), and the problems skipped.

    A question answerer's rows have ``question`` and ``context`` and optionally
    ``answer`` (else SQuAD's ``answers``, whose first ``text`` is taken, none where it
    is empty: SQuAD 2's unanswerable questions); a token
    classifier's have ``text`` (or, in JSONL, ``tokens``: the text's words as a list, as
    the CoNLL-2003 and WikiANN datasets give them, joined by spaces; their gold tags are
    not read: the predicted labels are explained) and optionally ``word``; a masked language model's have
    ``text`` (with the tokenizer's mask token) and optionally ``target``. Malformed rows as
    :func:`read_dataset` treats them.
    """
    path = Path(path)
    text_field, target_field = POSITION_FIELDS[task]
    data = _text(path, (".jsonl", ".csv"), "give a .jsonl or .csv file (one example per row)")
    rows = _jsonl_rows(data) if path.suffix.lower() == ".jsonl" else _csv_rows(data, text_field)
    needed = ("question", text_field) if task == "question-answering" else (text_field,)

    def example(index: int, line: int, row: Any) -> PositionExample:
        if isinstance(row, DatasetError):
            raise row
        if not isinstance(row, dict):
            raise DatasetError(f"a row must be an object with {' and '.join(repr(name) for name in needed)} fields")
        values = {name: value for name in needed if (value := _string(row, name)) is not None}
        if task == "token-classification" and text_field not in values and "tokens" in row:
            values[text_field] = _joined_words(row["tokens"])
        missing = [name for name in needed if name not in values]
        if missing:
            raise DatasetError(f"'{missing[0]}' is missing or empty")
        target = _string(row, target_field)
        if row.get(target_field) not in (None, "") and target is None:
            raise DatasetError(f"'{target_field}' must be a non-empty string (leave it out to explain the prediction)")
        if target is None and task == "question-answering" and row.get("answers") is not None:
            target = _squad_answer(row)
        return PositionExample(index, line, values[text_field], values.get("question"), target)

    return _examples(path, rows, example, skip_malformed)


def _joined_words(words: Any) -> str:
    """A row's ``tokens``, a list of words, as one text (joined by spaces)."""
    if not isinstance(words, list) or not words or not all(isinstance(word, str) and word.strip() for word in words):
        raise DatasetError("'tokens' must be a non-empty list of words (strings), as CoNLL-2003's rows give them")
    return _string({"tokens": " ".join(words)}, "tokens") or ""


def _string(row: dict[str, Any], name: str) -> str | None:
    """A row's field ``name`` where it is a string with a visible character, else None; a
    lone surrogate is refused."""
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        return None
    if has_surrogates(value):
        raise DatasetError(f"'{name}' holds a lone surrogate (an escape such as \\ud800 that is no character)")
    return value


def _squad_answer(row: dict[str, Any]) -> str | None:
    """The first answer of SQuAD's ``answers`` (``{"text": [...], "answer_start": [...]}``);
    None for an empty list (SQuAD 2's unanswerable question: the prediction is explained)."""
    answers = row["answers"]
    texts = answers.get("text") if isinstance(answers, dict) else None
    if texts == []:
        return None
    if not isinstance(texts, list) or not isinstance(texts[0], str) or not texts[0].strip():
        raise DatasetError("'answers' must be SQuAD's {\"text\": [answer, ...], ...}")
    return texts[0]


def unrankable(examples: Sequence[Example], tokenizer: Any, max_length: int) -> list[Example]:
    """The examples with no token a metric can rank: every token of theirs is one of the
    tokenizer's special tokens (a lone emoji becomes ``[CLS] [UNK] [SEP]``)."""
    special = set(tokenizer.all_special_ids)
    encoded = tokenizer([e.inputs for e in examples], truncation=True, max_length=max_length)["input_ids"]
    return [e for e, ids in zip(examples, encoded) if all(i in special for i in ids)]


def batches(examples: Sequence[Example], tokenizer: Any, batch_size: int) -> list[list[Example]]:
    """The examples in length-sorted buckets of ``batch_size`` (ties in file order)."""
    lengths = [len(ids) for ids in tokenizer([e.inputs for e in examples], truncation=True)["input_ids"]]
    order = sorted(range(len(examples)), key=lambda i: (lengths[i], i))
    return [[examples[i] for i in order[start : start + batch_size]] for start in range(0, len(order), batch_size)]


def write_atomically(path: Path, content: str) -> None:
    """``content`` into ``path`` all at once: written beside it, then renamed."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
