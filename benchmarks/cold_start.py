"""The first call of a fresh process against a warm call: does explaining one long text
stall on compiling?

    python benchmarks/cold_start.py [--length 4096] [--processes 3] [--json out.json]

Per method and process: a fresh Python process builds the 4-layer Llama of
``scaling.py`` (random weights, 2 threads) and times its first call (``cold``: the
library's default, which reduces eagerly until compiling pays, see
``maps.streaming.COMPILE_AFTER_SECONDS``), then compiles the block reductions and times
the median of three further calls (``warm``); a second process times the first call with
compiling at once (``cold, compiling at once``: the behaviour before). The cold and warm
scores must agree to 1e-5 of their scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from scaling import scaling_model  # noqa: E402

from captum_attention import METHODS  # noqa: E402
from captum_attention.maps import streaming  # noqa: E402


def one_process(method: str, length: int, compile_at_once: bool) -> dict:
    torch.set_num_threads(2)
    if compile_at_once:
        streaming.COMPILE_AFTER_SECONDS = 0.0
    model = scaling_model("llama", length, "cpu", torch.float32)
    ids = torch.randint(3, 1000, (1, length), generator=torch.Generator().manual_seed(0))
    explainer = METHODS[method](model)
    start = time.perf_counter()
    cold = explainer.attribute(ids, target=1)
    cold_seconds = time.perf_counter() - start
    if compile_at_once:
        return {"cold": cold_seconds}
    streaming.COMPILE_AFTER_SECONDS = 0.0
    explainer.attribute(ids, target=1)  # compiles
    times = []
    for _ in range(3):
        start = time.perf_counter()
        warm = explainer.attribute(ids, target=1)
        times.append(time.perf_counter() - start)
    scale = float(warm.abs().max())
    return {"cold": cold_seconds, "warm": statistics.median(times), "max_difference": float((cold - warm).abs().max()) / scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=["grad_sam", "transformer_attribution"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        method, at_once = options.one
        print(json.dumps(one_process(method, options.length, at_once == "at-once")))
        return
    rows = []
    for method in options.methods:
        runs = {"default": [], "at-once": []}
        for _ in range(options.processes):
            for mode in runs:
                command = [sys.executable, __file__, "--length", str(options.length), "--one", method, mode]
                runs[mode].append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1]))
        cold = statistics.median(r["cold"] for r in runs["default"])
        warm = statistics.median(r["warm"] for r in runs["default"])
        at_once = statistics.median(r["cold"] for r in runs["at-once"])
        worst = max(r["max_difference"] for r in runs["default"])
        assert worst <= 1e-5, f"{method}: cold and warm scores differ by {worst:.1e} of their scale"
        rows.append({"method": method, "length": options.length, "cold_s": round(cold, 2), "warm_s": round(warm, 2),
                     "cold_over_warm": round(cold / warm, 2), "cold_compiling_at_once_s": round(at_once, 2),
                     "at_once_over_warm": round(at_once / warm, 2), "processes": options.processes})
        print(json.dumps(rows[-1]), flush=True)
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
