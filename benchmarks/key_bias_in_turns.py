"""The knockout slope from the kernel's own backward against the block reduction, in turns.

    python benchmarks/key_bias_in_turns.py [--model llama|gpt-oss|...] [--lengths 1024 4096 16384]
        [--repeats 3] [--json out.json]

KnockoutGradient and KnockoutLRP, streaming, on ``scaling.py``'s model (one sequence per
length, the class-1 logit), each with the zero key bias that the attention kernel's own
backward sums (:class:`~captum_attention.capture.probes.ZeroKeyBiases`, what a CPU call in
float32 or float64 takes) and with it switched off (the column sums then reduced block by
block from the kernel's inputs and dS/dO), beside the model's own forward+backward, their
rounds interleaved in one process (``common.median_seconds``): on a shared machine single
runs differ by up to 30%, and runs taken in turns share its load. Checks first that both
paths give the same scores. Time only; ``scaling.py`` measures memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SDPA_FORWARD_BACKWARD, TARGET, attention_runs, device_description, median_seconds  # noqa: E402
from scaling import MODELS, scaling_model  # noqa: E402

from captum_attention import KnockoutGradient, KnockoutLRP  # noqa: E402
from captum_attention.capture import probes  # noqa: E402

BLOCKS = " (block reduction)"


@contextlib.contextmanager
def without_key_bias() -> Iterator[None]:
    """No call carries the key bias: the column sums are reduced block by block."""
    applies = probes.key_bias_applies
    probes.key_bias_applies = lambda call: False
    try:
        yield
    finally:
        probes.key_bias_applies = applies


def runs_at(model_name: str, length: int) -> dict[str, Callable[[], torch.Tensor]]:
    model = scaling_model(model_name, length, "cpu", torch.float32)
    ids = torch.randint(5, 1000, (1, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    runs: dict[str, Callable[[], torch.Tensor]] = {SDPA_FORWARD_BACKWARD: attention_runs(model, ids, mask, eager=False)[SDPA_FORWARD_BACKWARD]}
    for cls in (KnockoutGradient, KnockoutLRP):
        def run(cls: type = cls) -> torch.Tensor:
            return cls(model, capture="streaming").attribute(ids, target=TARGET, additional_forward_args=(mask,))

        def blocks(run: Callable[[], torch.Tensor] = run) -> torch.Tensor:
            with without_key_bias():
                return run()

        runs[cls.__name__], runs[cls.__name__ + BLOCKS] = run, blocks
    return runs


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=MODELS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = []
    for length in options.lengths:
        runs = runs_at(options.model, length)
        for cls in (KnockoutGradient, KnockoutLRP):
            with_bias, blocks = runs[cls.__name__](), runs[cls.__name__ + BLOCKS]()
            scale = float(blocks.abs().max())
            torch.testing.assert_close(with_bias, blocks, rtol=1e-4, atol=1e-5 * scale)
        seconds = median_seconds(runs, options.repeats)
        base = seconds[SDPA_FORWARD_BACKWARD]
        row = {"length": length, "seconds": seconds, "ratios": {name: value / base for name, value in seconds.items()}}
        results.append(row)
        print(f"{length} tokens: " + ", ".join(f"{name} {value:.3g} s ({value / base:.2f}×)" for name, value in seconds.items()), flush=True)
        if options.json:
            options.json.write_text(json.dumps({"model": options.model, "device": device_description(),
                                                "repeats": options.repeats, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
