"""Examples per second of ``captum-attention evaluate`` on the default model, one process against two.

    python benchmarks/evaluate_throughput.py [--examples 64] [--methods ...] [--processes 1 2] [--model PATH]

Writes held-out sentences of the generated corpus (with their rationale words) to a JSONL
file, runs the command line on it with every registered method, Integrated Gradients and
SmoothGrad (SHAP on request: ``--methods`` with ``shap``) and every metric, once per
process count (two processes through ``accelerate launch``, joined over gloo on a machine
without CUDA), from an empty output folder each time, and prints the wall time and the
examples per second. Each process runs with one torch thread, so one process against two
compares the same work split across the cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from captum_attention import METHODS
from captum_attention.demo import default_model_path, generate, write_jsonl


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--methods", default=",".join([*METHODS, "integrated_gradients", "smoothgrad"]))
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the cached default model)")
    options = parser.parse_args(argv)
    model = options.model or default_model_path()
    rates = {}
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "data.jsonl"
        write_jsonl(generate("heldout", options.examples, seed=7), data)
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        for processes in options.processes:
            output = Path(folder) / f"out-{processes}"
            command = ["-m", "captum_attention", "evaluate", str(data), "--model", str(model), "--output", str(output),
                       "--methods", options.methods, "--batch-size", str(options.batch_size)]
            if processes == 1:
                command = [sys.executable, *command]
            else:
                command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", *command]
            begin = time.perf_counter()
            subprocess.run(command, env=environment, check=True, capture_output=True)
            seconds = time.perf_counter() - begin
            rates[processes] = options.examples / seconds
            print(f"{processes} process(es): {seconds:.1f} s, {rates[processes]:.2f} examples/s "
                  f"({len(options.methods.split(','))} methods, every metric)")
    return rates


if __name__ == "__main__":
    main()
