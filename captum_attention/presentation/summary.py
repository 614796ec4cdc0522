"""The results of ``evaluate``: merging the shards and summarising each method and metric
(mean and 95% bootstrap confidence interval)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from .dataset import AnswerExample, Example, write_atomically
from .html import render_evaluation_html


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
    """The summary as a Markdown table: one row per method, ``mean [low, high]`` per metric,
    each metric's name marked with its direction (↑ higher is better, ↓ lower)."""
    from ..metrics import METRICS

    methods = list(dict.fromkeys(entry["method"] for entry in summary))
    cell = {(e["method"], e["metric"]): e for e in summary}

    def shown(entry: dict[str, Any]) -> str:
        return "n/a" if entry["mean"] is None else f"{entry['mean']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    arrows = {"higher": "↑", "lower": "↓"}
    named = [f"{metric} {arrows[METRICS[metric].better]}" if metric in METRICS else metric for metric in metrics]
    lines = ["| method | " + " | ".join(named) + " |", "|---" * (len(metrics) + 1) + "|"]
    lines += [f"| {m} | " + " | ".join(shown(cell[m, metric]) for metric in metrics) + " |" for m in methods]
    lines += ["", "↑: higher is better, ↓: lower is better; mean [95% bootstrap interval] over the examples."]
    return "\n".join(lines) + "\n"


def _summary_csv(summary: list[dict[str, Any]]) -> str:
    lines = ["method,metric,n,mean,low,high"]
    lines += [",".join("" if e[k] is None else str(e[k]) for k in ("method", "metric", "n", "mean", "low", "high")) for e in summary]
    return "\n".join(lines) + "\n"
