"""Per-method cost against the model's own forward / forward+backward, and against IG-50.

    python benchmarks/overhead.py [--repeats 10] [--ig-repeats 3] [--no-memory]

Prints median wall times over repeated runs in this process (after a warm-up) and each
method's ratio to the matching baseline measured in the same run:

- raw attention and rollout against the model's own forward with attentions
  (eager attention, ``output_attentions=True``, no grad);
- Grad-SAM and Transformer Attribution against the model's own forward + backward
  with attentions (``output_attentions=True``, ``.backward()`` of the explained logits);
- every method against Captum's LayerIntegratedGradients with 50 steps.

The sdpa forward (how transformers 5 loads models by default) is printed for reference.
Peak memory is the peak resident-set growth of one (warm) call, each measured in a fresh
subprocess whose allocator returns freed blocks to the system, as a ratio to its
baseline's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable

import torch
from captum.attr import LayerIntegratedGradients

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ALL_BASELINES,
    RUN_NAMES,
    BATCH,
    MEASURING_ENV,
    SEQ_LEN,
    TARGET,
    attention_runs,
    benchmark_batch,
    benchmark_model,
    median_seconds,
    peak_rss_growth,
)


IG = "LayerIntegratedGradients (50 steps)"


def workloads() -> dict[str, Callable[[], object]]:
    """Name -> a zero-argument callable doing one run on a fresh model and batch."""
    model = benchmark_model()
    ids, mask = benchmark_batch()

    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    lig = LayerIntegratedGradients(forward, model.get_input_embeddings())
    return {
        **attention_runs(model, ids, mask),
        IG: lambda: lig.attribute(ids, target=TARGET, n_steps=50, additional_forward_args=(mask,)),
    }


def peak_growth(name: str) -> int:
    """Peak RSS growth of one call of ``name`` in this process (run warm: once before)."""
    run = workloads()[name]
    run()
    return peak_rss_growth(run)


def peak_growth_in_subprocess(name: str) -> int:
    env = {**os.environ, **MEASURING_ENV}
    out = subprocess.run(
        [sys.executable, __file__, "--memory-of", name], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--ig-repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-ig", action="store_true")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.memory_of:
        print(peak_growth(options.memory_of))
        return

    runs = workloads()
    if options.no_ig:
        runs.pop(IG)
    seconds = median_seconds(
        runs, {name: options.ig_repeats if name == IG else options.repeats for name in runs}
    )
    print(
        f"captum-attention overhead: BERT 6 layers x 384 wide x 12 heads, batch {BATCH} x {SEQ_LEN} "
        f"tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, CPU\n"
    )
    header = f"| {'run':38} | {'median ms':>9} | {'x baseline':>10} | {'IG-50 / this':>12} |"
    print(header)
    print("|" + "|".join("-" * (len(cell) + 0) for cell in header.split("|")[1:-1]) + "|")
    for name, value in seconds.items():
        ratio = f"{value / seconds[ALL_BASELINES[name]]:.2f}" if name in ALL_BASELINES else ""
        speedup = f"{seconds[IG] / value:.0f}" if IG in seconds and name in ALL_BASELINES else ""
        print(f"| {name:38} | {value * 1000:9.1f} | {ratio:>10} | {speedup:>12} |")
    print("\nx baseline: streaming raw/rollout against the sdpa forward, Grad-SAM/Transformer")
    print("Attribution against the sdpa forward+backward; (eager) runs against the eager forward")
    print("(+backward) with attentions.")

    if not options.no_memory:
        print("\nPeak memory growth of one call (fresh process each), against its baseline's:")
        growth = {name: peak_growth_in_subprocess(name) for name in RUN_NAMES}
        for name, base in ALL_BASELINES.items():
            print(f"  {name:32} {growth[name] / 2**20:7.0f} MiB  ({growth[name] / max(growth[base], 1):.2f}x {base})")


if __name__ == "__main__":
    main()
