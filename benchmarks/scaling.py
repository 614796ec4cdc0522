"""Time and peak memory of each method against sequence length and batch size.

    python benchmarks/scaling.py [--device cpu|cuda] [--lengths 64 128 ... 2048]
                                 [--batches 1 2 4 8 16] [--repeats 3] [--no-memory]

A 4-layer, 256-wide, 4-head BERT classifier (positions up to 2048), random token ids.
For each (batch, length): the model's own forward with attentions (eager,
``output_attentions=True``) and forward+backward with attentions (``.backward()`` of the
explained logits), and each of our methods; median wall time over ``--repeats`` runs
after a warm-up, and the peak memory of one call: on CUDA ``max_memory_allocated``
above the memory in use before the call; on CPU the peak resident-set growth in a fresh
subprocess whose allocator returns freed blocks to the system. Ratios are against the
matching baseline (forward for raw/rollout, forward+backward for Grad-SAM/Transformer
Attribution), measured in the same run, so the growth of a ratio with length is the
method's cost growing faster than the model's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BASELINE, FORWARD, FORWARD_BACKWARD, MEASURING_ENV, attention_runs, median_seconds, peak_rss_growth  # noqa: E402


def scaling_model(device: str) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=2048, num_labels=2,
    )
    return tf.BertForSequenceClassification(config).eval().to(device)


def workloads(batch: int, seq_len: int, device: str) -> dict[str, Callable[[], object]]:
    ids = torch.randint(5, 1000, (batch, seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    return attention_runs(scaling_model(device), ids, torch.ones_like(ids))


def peak_bytes(run: Callable[[], object], device: str) -> int:
    """Peak memory growth of one warm call of ``run``."""
    run()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return peak_rss_growth(run)


def peak_in_subprocess(name: str, batch: int, seq_len: int) -> int:
    env = {**os.environ, **MEASURING_ENV}
    command = [sys.executable, __file__, "--memory-of", name, "--batches", str(batch), "--lengths", str(seq_len)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def measure(batch: int, seq_len: int, device: str, repeats: int, memory: bool) -> dict[str, dict[str, float]]:
    runs = workloads(batch, seq_len, device)
    seconds = median_seconds(runs, repeats, torch.cuda.synchronize if device == "cuda" else lambda: None)
    rows: dict[str, dict[str, float]] = {}
    for name in runs:
        row = {"ms": 1000 * seconds[name]}
        if name in BASELINE:
            row["× time"] = seconds[name] / seconds[BASELINE[name]]
        rows[name] = row
    if memory:
        for name in runs:
            if device == "cuda":
                rows[name]["MiB"] = peak_bytes(runs[name], device) / 2**20
            else:
                rows[name]["MiB"] = peak_in_subprocess(name, batch, seq_len) / 2**20
        for name, base in BASELINE.items():
            rows[name]["× memory"] = rows[name]["MiB"] / max(rows[base]["MiB"], 1e-9)
    return rows


def table(results: list[dict]) -> str:
    """Markdown: the baselines' time (and memory), then each method as time ratio (/ memory ratio)."""
    has_memory = "MiB" in results[0]["runs"][FORWARD]
    baselines = ["forward ms", "fwd+bwd ms"] + (["forward MiB", "fwd+bwd MiB"] if has_memory else [])
    lines = [
        "| batch | length | " + " | ".join(baselines) + " | " + " | ".join(BASELINE) + " |",
        "|" + "---|" * (2 + len(baselines) + len(BASELINE)),
    ]
    for result in results:
        runs = result["runs"]
        cells = [str(result["batch"]), str(result["length"]), f"{runs[FORWARD]['ms']:.1f}", f"{runs[FORWARD_BACKWARD]['ms']:.1f}"]
        if has_memory:
            cells += [f"{runs[FORWARD]['MiB']:.0f}", f"{runs[FORWARD_BACKWARD]['MiB']:.0f}"]
        for name in BASELINE:
            ratio = f"{runs[name]['× time']:.2f}×"
            cells.append(ratio + (f" / {runs[name]['× memory']:.2f}×" if has_memory else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-length", type=int, default=256, help="length at which batch sizes are varied")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.memory_of:
        runs = workloads(options.batches[0], options.lengths[0], "cpu")
        print(peak_bytes(runs[options.memory_of], "cpu"))
        return []
    if options.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    device_name = torch.cuda.get_device_name() if options.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"scaling on {device_name}, torch {torch.__version__}\n")
    settings = [(1, length) for length in options.lengths]
    settings += [(batch, options.batch_length) for batch in options.batches if batch != 1]
    results = []
    for batch, length in settings:
        runs = measure(batch, length, options.device, options.repeats, not options.no_memory)
        results.append({"batch": batch, "length": length, "runs": runs})
        print(f"batch {batch:3d} length {length:5d}: " + ", ".join(f"{n} {r['ms']:.1f} ms" for n, r in runs.items()), flush=True)
    print()
    print(table(results))
    if options.json:
        options.json.write_text(json.dumps({"device": device_name, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
