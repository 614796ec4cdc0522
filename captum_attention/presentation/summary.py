"""The results of ``evaluate``: merging the shards and summarising each method and metric
(mean and 95% bootstrap confidence interval, and the paired difference to the metric's
best method on the same examples)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from .dataset import AnswerExample, Example, write_atomically
from .html import difference_parts, metric_better, render_evaluation_html


def merge(output: str | Path, examples: Sequence[Example | AnswerExample], metrics: Sequence[str], bootstrap: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Merge the shards into ``results.jsonl`` (rows by example, then method) and write the
    summary (``summary.md``, ``summary.csv``) and the report (``report.html``); returns the
    summary rows. Raises where a
    batch's shard is missing (a process that has not finished)."""
    output = Path(output)
    rows = [json.loads(line) for shard in sorted((output / "shards").glob("batch-*.jsonl")) for line in shard.read_text(encoding="utf-8").splitlines()]
    seen = {row["index"] for row in rows}
    missing = [e.line for e in examples if e.index not in seen]
    if missing:
        raise RuntimeError(f"{len(missing)} examples have no results yet (first: line {missing[0]}): finish the run first")
    methods = list(dict.fromkeys(row["method"] for row in rows))
    rows.sort(key=lambda row: (row["index"], methods.index(row["method"])))
    write_atomically(output / "results.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    summary = summarise(rows, methods, metrics, bootstrap, seed)
    write_atomically(output / "summary.md", summary_markdown(summary, metrics))
    write_atomically(output / "summary.csv", _summary_csv(summary))
    write_atomically(output / "report.html", render_evaluation_html(summary, rows, list(metrics), str(output)))
    return summary


def _mean_and_interval(values: list[float], bootstrap: int, generator: torch.Generator) -> dict[str, Any]:
    """``n``, the mean and its 95% percentile bootstrap interval (``low``, ``high``); None
    for each where there are no values."""
    if not values:
        return {"n": 0, "mean": None, "low": None, "high": None}
    sample = torch.tensor(values, dtype=torch.float64)
    resamples = sample[torch.randint(len(sample), (bootstrap, len(sample)), generator=generator)].mean(dim=1)
    low, high = torch.quantile(resamples, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return {"n": len(sample), "mean": sample.mean().item(), "low": low, "high": high}


def summarise(rows: list[dict[str, Any]], methods: Sequence[str], metrics: Sequence[str], bootstrap: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """Per method and metric: the mean over examples (those with a value) and its 95%
    percentile bootstrap confidence interval (``bootstrap`` resamples, seeded). For a metric
    with a direction, also ``best``, the method of the best mean, and ``difference``: the
    method's value minus the best's on the examples where both have one, its mean and
    bootstrap interval (None for the best itself); an interval that holds 0 says that these
    examples do not tell the two methods apart, however far apart their own intervals."""
    generator = torch.Generator().manual_seed(seed)
    by_example = {(row["method"], row["index"]): row for row in rows}
    indices = list(dict.fromkeys(row["index"] for row in rows))

    def values(method: str, metric: str) -> dict[int, float]:
        found = (by_example.get((method, index)) for index in indices)
        return {row["index"]: row[metric] for row in found if row is not None and row.get(metric) is not None}

    summary: list[dict[str, Any]] = []
    for metric in metrics:
        per_method = {method: values(method, metric) for method in methods}
        entries = {method: {"method": method, "metric": metric, **_mean_and_interval(list(per_method[method].values()), bootstrap, generator)}
                   for method in methods}
        better = metric_better(metric)
        ranked = [method for method in methods if entries[method]["mean"] is not None]
        if better is not None and ranked:
            sign = 1.0 if better == "higher" else -1.0
            best = max(ranked, key=lambda method: sign * entries[method]["mean"])
            for method in methods:
                common = [index for index in per_method[method] if index in per_method[best]]
                differences = [per_method[method][index] - per_method[best][index] for index in common]
                entries[method]["best"] = best
                entries[method]["difference"] = None if method == best else _mean_and_interval(differences, bootstrap, generator)
        summary += entries.values()
    return sorted(summary, key=lambda entry: (methods.index(entry["method"]), metrics.index(entry["metric"])))


def summary_markdown(summary: list[dict[str, Any]], metrics: Sequence[str]) -> str:
    """The summary as a Markdown table: one row per method, ``mean [low, high]`` per metric,
    each metric's name marked with its direction (↑ higher is better, ↓ lower); then, with
    more than one method, each method's paired difference to the best of each metric with
    a direction."""
    methods = list(dict.fromkeys(entry["method"] for entry in summary))
    cell = {(e["method"], e["metric"]): e for e in summary}

    def shown(entry: dict[str, Any]) -> str:
        return "n/a" if entry["mean"] is None else f"{entry['mean']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    arrows = {"higher": "↑", "lower": "↓"}
    named = [f"{metric} {arrows[better]}" if (better := metric_better(metric)) else metric for metric in metrics]
    lines = ["| method | " + " | ".join(named) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(shown(cell[m, metric]) for metric in metrics) + " |" for m in methods]
    lines += ["", "↑: higher is better, ↓: lower is better; mean [95% bootstrap interval] over the examples."]
    paired = [(metric, name) for metric, name in zip(metrics, named) if any("best" in cell[m, metric] for m in methods)]
    if paired and len(methods) > 1:
        lines += ["", "| method | " + " | ".join(f"{name} − best" for _, name in paired) + " |", "|---" * (len(paired) + 1) + "|"]
        lines += [f"| {m} | " + " | ".join(" ".join(difference_parts(cell[m, metric])).strip() for metric, _ in paired) + " |" for m in methods]
        lines += ["", "Each method's value minus the best method's on the same examples: mean [95% bootstrap interval]; "
                  "an interval that holds 0: these examples do not tell the two apart."]
    return "\n".join(lines) + "\n"


def _summary_csv(summary: list[dict[str, Any]]) -> str:
    lines = ["method,metric,n,mean,low,high,best,difference,difference_low,difference_high"]
    for entry in summary:
        difference = entry.get("difference") or {}
        fields = [entry[k] for k in ("method", "metric", "n", "mean", "low", "high")]
        fields += [entry.get("best"), *(difference.get(k) for k in ("mean", "low", "high"))]
        lines.append(",".join("" if field is None else str(field) for field in fields))
    return "\n".join(lines) + "\n"
