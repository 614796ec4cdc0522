"""Explain and score a whole data set: every chosen method, every chosen metric, resumable.

:func:`evaluate` reads examples (:func:`read_dataset`), sorts them by length into batches
(length-sorted buckets waste little padding), explains each batch with every method and
scores each explanation with every metric. Each batch's rows are written to their own
shard file, atomically (a temporary file renamed into place), so an interrupted run
resumes where it stopped with no row lost or written twice: a shard that exists is done.
Under ``accelerate launch --num_processes K`` each process takes every K-th batch and
writes its own shards; the main process merges them into ``results.jsonl`` and the summary
(mean and 95% bootstrap confidence interval per method and metric) once all are done. A
batch is computed the same way whichever process runs it, so any number of processes gives
the same rows and numbers as one.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from ..metrics import aopc, attention_erasure, auprc, comprehensiveness, decision_flip_fraction, sufficiency, token_f1
from .display import special_tokens
from .explain import ig_baseline, length_limit, method_names, report_methods

METRICS = ("comprehensiveness", "sufficiency", "decision_flip", "erasure_js", "token_f1", "auprc")
"""What ``metrics=`` accepts: ERASER comprehensiveness and sufficiency (AOPC over the
bins 1/5/10/20/50%), the fraction of tokens whose attention is erased (every layer, in the
method's order) before the decision flips (NaN where it never flips), the JS divergence of
the output when the attention paid to the method's top 20% tokens is erased at every layer,
and plausibility against the rationale words (token F1 with k = the rationale's size, and
AUPRC)."""

NEEDS_RATIONALE = ("token_f1", "auprc")
ERASED_SHARE = 0.2


class DatasetError(ValueError):
    """A data set file that cannot be read as asked (the message names the line)."""


@dataclass(frozen=True)
class Example:
    """One row of a data set: its position (0-based, over the kept rows), the line it came
    from, the text, and optionally its label (a class index) and rationale words."""

    index: int
    line: int
    text: str
    label: int | None = None
    rationale: tuple[str, ...] | None = None


def read_dataset(path: str | Path, skip_malformed: bool = False) -> tuple[list[Example], list[str]]:
    """The examples of a JSONL or CSV file (by its suffix), and the problems skipped.

    Each row has ``text``, optionally ``label`` (an int) and ``rationale`` (a list of
    words in JSONL; words separated by spaces in CSV). A malformed row raises
    :class:`DatasetError` naming its line, or with ``skip_malformed`` is skipped and
    reported in the second list.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"data set not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise DatasetError(f"{path}: give a .jsonl or .csv file (one example per row)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DatasetError(f"{path} is not UTF-8 text") from error
    rows = _jsonl_rows(text) if suffix == ".jsonl" else _csv_rows(text)
    examples: list[Example] = []
    skipped: list[str] = []
    for line, row in rows:
        try:
            examples.append(_example(len(examples), line, row))
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


def _csv_rows(text: str) -> Iterable[tuple[int, Any]]:
    reader = csv.DictReader(text.splitlines())
    if reader.fieldnames is None or "text" not in reader.fieldnames:
        raise DatasetError("the CSV file needs a header row with a 'text' column")
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
    label = row.get("label")
    if label in (None, ""):
        label = None
    else:
        try:
            label = int(label)
        except (TypeError, ValueError):
            raise DatasetError(f"'label' must be a class index, got {label!r}") from None
    rationale = row.get("rationale")
    if rationale is not None and (not isinstance(rationale, list) or not all(isinstance(w, str) for w in rationale)):
        raise DatasetError("'rationale' must be a list of words")
    return Example(index, line, text, label, None if rationale is None else tuple(rationale))


def check_request(methods: Sequence[str], metrics: Sequence[str], examples: Sequence[Example]) -> None:
    """A clear error for an unknown method or metric, or plausibility without rationales."""
    unknown = [m for m in methods if m not in evaluation_methods()]
    if unknown or not methods:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(evaluation_methods())}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ValueError(f"unknown metric {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(METRICS)}")
    asked = [m for m in metrics if m in NEEDS_RATIONALE]
    missing = [e.line for e in examples if e.rationale is None]
    if asked and missing:
        raise ValueError(
            f"{', '.join(asked)} need a 'rationale' on every row; line {missing[0]} has none "
            f"({len(missing)} rows in all): add them, or leave these metrics out"
        )


SMOOTHGRAD, SHAP = "smoothgrad", "shap"


def evaluation_methods() -> list[str]:
    """What ``methods=`` accepts: the registered methods, Integrated Gradients, SmoothGrad
    and SHAP."""
    return [*method_names(), SMOOTHGRAD, SHAP]


@dataclass
class Options:
    """How to evaluate: batch size, method budgets, the metrics' settings."""

    batch_size: int = 16
    ig_steps: int = 50
    smoothgrad_samples: int = 10
    shap_evals: int = 300
    bootstrap: int = 1000
    seed: int = 0


def batches(examples: Sequence[Example], tokenizer: Any, batch_size: int) -> list[list[Example]]:
    """The examples in length-sorted buckets of ``batch_size`` (ties in file order)."""
    lengths = [len(ids) for ids in tokenizer([e.text for e in examples], truncation=True)["input_ids"]]
    order = sorted(range(len(examples)), key=lambda i: (lengths[i], i))
    return [[examples[i] for i in order[start : start + batch_size]] for start in range(0, len(order), batch_size)]


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: Options | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> int:
    """Explain and score this process's batches into ``output/shards``; returns how many
    batches it computed. Batches whose shard is there are done: ``on_resume(done, total)``
    hears of them (all processes' batches) before the work starts. See :func:`merge`."""
    options = options or Options()
    check_request(methods, metrics, examples)
    shards = Path(output) / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    every = batches(examples, tokenizer, options.batch_size)
    done = sum(_shard(shards, k).exists() for k in range(len(every)))
    if done and on_resume is not None:
        on_resume(done, len(every))
    todo = [(k, batch) for k, batch in enumerate(every) if k % num_processes == process_index and not _shard(shards, k).exists()]
    explainers = _explainers(model, tokenizer, methods, options)
    for k, batch in progress(todo) if progress is not None else todo:
        rows = _evaluate_batch(model, tokenizer, batch, explainers, metrics)
        _write_atomically(_shard(shards, k), "".join(json.dumps(row) + "\n" for row in rows))
    return len(todo)


def _shard(folder: Path, batch: int) -> Path:
    return folder / f"batch-{batch:06d}.jsonl"


def _write_atomically(path: Path, content: str) -> None:
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


Explainer = Callable[[Tensor, Tensor, Tensor, list[str]], Tensor]


def _explainers(model: Any, tokenizer: Any, names: Sequence[str], options: Options) -> dict[str, Explainer]:
    """Method name -> ``explain(ids, mask, targets, texts) -> (batch, seq_len)`` scores."""
    chosen = report_methods(model, options.ig_steps, [n for n in names if n in method_names()])
    by_display = dict(zip(chosen, [n for n in method_names() if n in names]))

    def from_report(method: Any) -> Explainer:
        return lambda ids, mask, targets, texts: method(ids, targets, mask, ig_baseline(ids, tokenizer)).detach()

    explainers = {by_display[display]: from_report(method) for display, (method, _) in chosen.items()}
    if SMOOTHGRAD in names:
        explainers[SMOOTHGRAD] = _smoothgrad(model, options.smoothgrad_samples)
    if SHAP in names:
        explainers[SHAP] = _shap(model, tokenizer, options.shap_evals)
    return {name: explainers[name] for name in names}


def _smoothgrad(model: Any, samples: int) -> Explainer:
    """SmoothGrad (Captum's ``NoiseTunnel`` over ``Saliency``) on the word embeddings,
    σ = 0.1 · their standard deviation, summed over the hidden dimension."""
    from captum.attr import NoiseTunnel, Saliency

    def forward(embeddings: Tensor, mask: Tensor) -> Tensor:
        return model(inputs_embeds=embeddings, attention_mask=mask).logits

    tunnel = NoiseTunnel(Saliency(forward))

    def explain(ids: Tensor, mask: Tensor, targets: Tensor, texts: list[str]) -> Tensor:
        embeddings = model.get_input_embeddings()(ids).detach()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(0)  # the same noise for a batch whichever process runs it
        try:
            scores = tunnel.attribute(
                embeddings, nt_type="smoothgrad", nt_samples=samples, stdevs=0.1 * float(embeddings.std()),
                target=targets, additional_forward_args=(mask,),
            )
        finally:
            torch.random.set_rng_state(generator_state)
        return scores.sum(dim=-1).detach()

    return explain


def _shap(model: Any, tokenizer: Any, evals: int) -> Explainer:
    from .shap_text import shap_token_values

    def forward(ids: Tensor, mask: Tensor) -> Tensor:
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.cpu()

    def explain(ids: Tensor, mask: Tensor, targets: Tensor, texts: list[str]) -> Tensor:
        return shap_token_values(forward, tokenizer, texts, targets.cpu(), evals).to(ids.device)

    return explain


def _evaluate_batch(
    model: Any, tokenizer: Any, batch: list[Example], explainers: dict[str, Explainer], metrics: Sequence[str]
) -> list[dict[str, Any]]:
    texts = [e.text for e in batch]
    encoded = tokenizer(texts, padding=True, truncation=True, max_length=length_limit(model, tokenizer), return_tensors="pt")
    device = next(model.parameters()).device
    ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    def forward(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits

    with torch.no_grad():
        probabilities = forward(ids, mask).float().softmax(dim=-1)
    predicted = probabilities.argmax(dim=-1)
    keep = special_tokens(ids, tokenizer)
    rationale = _rationale_tokens(encoded, batch).to(device) if any(m in NEEDS_RATIONALE for m in metrics) else None
    rows = []
    for name, explain in explainers.items():
        scores = explain(ids, mask, predicted, texts).float().masked_fill(mask == 0, 0.0)
        values = _scores(forward, model, ids, mask, scores, predicted, keep, rationale, metrics)
        for row, example in enumerate(batch):
            rows.append({
                "index": example.index, "line": example.line, "method": name, "label": example.label,
                "predicted": int(predicted[row]), "probability": float(probabilities[row, predicted[row]]),
                **{metric: _number(value[row]) for metric, value in values.items()},
            })
    return rows


def _scores(
    forward: Callable[..., Tensor], model: Any, ids: Tensor, mask: Tensor, scores: Tensor, targets: Tensor,
    keep: Tensor, rationale: Tensor | None, metrics: Sequence[str],
) -> dict[str, Tensor]:
    """Per metric, ``(batch,)`` values for one method's scores."""
    values: dict[str, Tensor] = {}
    include = (mask == 1) & ~keep
    if "comprehensiveness" in metrics:
        values["comprehensiveness"] = aopc(comprehensiveness(forward, ids, mask, scores, targets, keep=keep))
    if "sufficiency" in metrics:
        values["sufficiency"] = aopc(sufficiency(forward, ids, mask, scores, targets, keep=keep))
    if "decision_flip" in metrics:
        ranking = scores.masked_fill(~include, float("-inf"))
        values["decision_flip"] = decision_flip_fraction(forward, ids, ranking, (mask,), model=model, keep=keep).fraction
    if "erasure_js" in metrics:
        values["erasure_js"] = attention_erasure(forward, ids, _top_share(scores, include), (mask,), model=model).js_divergence
    if rationale is not None and "token_f1" in metrics:
        values["token_f1"] = token_f1(scores, rationale, include)
    if rationale is not None and "auprc" in metrics:
        values["auprc"] = auprc(scores, rationale, include)
    return values


def _top_share(scores: Tensor, include: Tensor, share: float = ERASED_SHARE) -> Tensor:
    """``(batch, seq_len)`` bool: the top ``share`` of each row's included tokens (at
    least one), ties broken by position."""
    ranked = scores.masked_fill(~include, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    counts = (include.sum(dim=-1).float() * share).ceil().clamp(min=1).long()
    chosen = torch.arange(scores.shape[-1], device=scores.device)[None, :] < counts[:, None]
    return torch.zeros_like(include).scatter_(-1, ranked, chosen) & include


def _rationale_tokens(encoded: Any, batch: list[Example]) -> Tensor:
    """``(batch, seq_len)`` bool: tokens of the words named in each example's rationale
    (compared case-insensitively, word by word as the tokenizer splits them)."""
    marked = torch.zeros(encoded["input_ids"].shape, dtype=torch.bool)
    for row, example in enumerate(batch):
        wanted = {w.lower() for w in example.rationale or ()}
        for position, word in enumerate(encoded.word_ids(row)):
            if word is None:
                continue
            span = encoded.word_to_chars(row, word)
            marked[row, position] = example.text[span.start : span.end].lower() in wanted
    return marked


def _number(value: Tensor) -> float | None:
    number = float(value)
    return None if math.isnan(number) else number


def merge(output: str | Path, examples: Sequence[Example], metrics: Sequence[str], bootstrap: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Merge the shards into ``results.jsonl`` (rows by example, then method) and write the
    summary (``summary.md``, ``summary.csv``); returns the summary rows. Raises where a
    batch's shard is missing (a process that has not finished)."""
    output = Path(output)
    rows = [json.loads(line) for shard in sorted((output / "shards").glob("batch-*.jsonl")) for line in shard.read_text(encoding="utf-8").splitlines()]
    seen = {row["index"] for row in rows}
    missing = [e.line for e in examples if e.index not in seen]
    if missing:
        raise RuntimeError(f"{len(missing)} examples have no results yet (first: line {missing[0]}): finish the run first")
    methods = list(dict.fromkeys(row["method"] for row in rows))
    rows.sort(key=lambda row: (row["index"], methods.index(row["method"])))
    _write_atomically(output / "results.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    summary = summarise(rows, methods, metrics, bootstrap, seed)
    _write_atomically(output / "summary.md", summary_markdown(summary, metrics))
    _write_atomically(output / "summary.csv", _summary_csv(summary))
    return summary


def summarise(rows: list[dict[str, Any]], methods: Sequence[str], metrics: Sequence[str], bootstrap: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Per method and metric: the mean over examples (those with a value) and its 95%
    percentile bootstrap confidence interval (``bootstrap`` resamples, seeded)."""
    generator = torch.Generator().manual_seed(seed)
    summary = []
    for method in methods:
        for metric in metrics:
            values = torch.tensor([row[metric] for row in rows if row["method"] == method and row.get(metric) is not None], dtype=torch.float64)
            if len(values) == 0:
                summary.append({"method": method, "metric": metric, "n": 0, "mean": None, "low": None, "high": None})
                continue
            resamples = values[torch.randint(len(values), (bootstrap, len(values)), generator=generator)].mean(dim=1)
            low, high = torch.quantile(resamples, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
            summary.append({"method": method, "metric": metric, "n": len(values), "mean": values.mean().item(), "low": low, "high": high})
    return summary


def summary_markdown(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """The summary as a Markdown table: one row per method, ``mean [low, high]`` per metric."""
    methods = list(dict.fromkeys(entry["method"] for entry in summary))
    cell = {(e["method"], e["metric"]): e for e in summary}

    def shown(entry: dict[str, Any]) -> str:
        return "n/a" if entry["mean"] is None else f"{entry['mean']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    lines = ["| method | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(shown(cell[m, metric]) for metric in metrics) + " |" for m in methods]
    return "\n".join(lines) + "\n"


def _summary_csv(summary: list[dict[str, Any]]) -> str:
    lines = ["method,metric,n,mean,low,high"]
    lines += [",".join("" if e[k] is None else str(e[k]) for k in ("method", "metric", "n", "mean", "low", "high")) for e in summary]
    return "\n".join(lines) + "\n"
