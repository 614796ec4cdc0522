"""Value Zeroing on a half-precision model: its layers re-run as float32 copies (the
library's way) against re-runs in the model's own dtype, on the same model and tokens.

    python benchmarks/value_zeroing_precision.py [--lengths 64 256 512] [--device cuda] [--repeats 3]

A Value Zeroing distance is that of two nearly equal layer outputs (one token's value of
N removed), so the re-runs' rounding weighs about N times more in it than in the outputs.
For each length the table gives, on the 4-layer Llama of ``scaling.py`` in bfloat16: the
time of each way as a multiple of the model's own forward+backward (sdpa) in the same run,
and each way's largest distance to the same computation in float64 (from the same
bfloat16 weights), relative to the scores' scale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch
from common import device_description, median_seconds
from scaling import scaling_model

from captum_attention import ValueZeroing
from captum_attention.attr import value_zeroing

WAYS = ("float32 copies", "bfloat16 re-runs")


def _scores(model: torch.nn.Module, ids: torch.Tensor, float32_copies: bool) -> torch.Tensor:
    """Value Zeroing's scores, its half-precision layers re-run as float32 copies or as they are."""
    copies = value_zeroing._half_precision
    if not float32_copies:
        value_zeroing._half_precision = lambda block: False  # type: ignore[assignment]
    try:
        return ValueZeroing(model).attribute(ids, additional_forward_args=(torch.ones_like(ids),)).float()
    finally:
        value_zeroing._half_precision = copies  # type: ignore[assignment]


def measure(length: int, device: str, repeats: int) -> dict[str, Any]:
    model = scaling_model("llama", length, device, torch.bfloat16)
    twin = scaling_model("llama", length, device, torch.float32)
    twin.load_state_dict(model.state_dict())
    twin = twin.double()
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)).to(device)
    exact = _scores(twin, ids, True)
    scale = float(exact.abs().max())

    def forward_backward() -> None:
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0].sum().backward()
        model.zero_grad(set_to_none=True)

    runs: dict[str, Callable[[], object]] = {
        "forward+backward": forward_backward,
        WAYS[0]: lambda: _scores(model, ids, True),
        WAYS[1]: lambda: _scores(model, ids, False),
    }
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    seconds = median_seconds(runs, repeats, sync)
    row: dict[str, Any] = {"tokens": length, "forward+backward ms": 1e3 * seconds["forward+backward"]}
    for way, float32_copies in zip(WAYS, (True, False)):
        error = float((_scores(model, ids, float32_copies) - exact).abs().max()) / scale
        row[way] = {"× fwd+bwd": seconds[way] / seconds["forward+backward"], "error / scale": error}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| tokens | fwd+bwd ms | " + " | ".join(f"{way}: × fwd+bwd | {way}: error / scale" for way in WAYS) + " |",
        "|---" * (2 + 2 * len(WAYS)) + "|",
    ]
    for row in rows:
        cells = [f"{row[way]['× fwd+bwd']:.0f}× | {row[way]['error / scale']:.1e}" for way in WAYS]
        lines.append(f"| {row['tokens']} | {row['forward+backward ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    rows = [measure(length, options.device, options.repeats) for length in options.lengths]
    print(f"Value Zeroing of a bfloat16 4-layer Llama, {device_description(options.device)}\n")
    print(table(rows))
    if options.json is not None:
        options.json.write_text(json.dumps({"device": device_description(options.device), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
