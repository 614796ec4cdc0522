"""Attention-calibrated surrogates on the needle task: LDS against the number of forwards.

    python benchmarks/calibrated.py [--length 512] [--examples 16] [--forwards 1 4 8 16 32]
        [--json out.json]

The model, task and metrics are ``benchmarks/needle.py``'s (LDS over 32 ablations drawn with
seed 0). For each number of forwards A: ``metrics.calibrated_scores`` with AttnLRP's span
scores as the prior, and ContextCite's Lasso surrogate (``needle.context_cite``), both on
A ablations drawn with seed 1, apart from the LDS's own; beside them AttnLRP alone (one
forward and one backward) and ContextCite on 64 ablations, of seed 1 (out of sample, the
needle benchmark's setting) and of seed 0, whose first 32 ablations are the LDS's (its LDS
in-sample).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from needle import calibrated, context_cite, evaluate, needle_decides, our_method

from captum_attention.demo.needle import load_needle_model, needle_example


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--forwards", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_needle_model()
    generator = torch.Generator().manual_seed(options.length)
    candidates = [needle_example(options.length, generator) for _ in range(options.examples)]
    with torch.no_grad():
        correct = [e for e in candidates if int(model(e.input_ids[None]).logits[0, -1].argmax()) == e.answer]
    print(f"{options.length} tokens: {len(correct)} of {len(candidates)} contexts answered correctly", flush=True)
    decides = [needle_decides(model, e) for e in correct]
    rows = {
        "attn_lrp": evaluate(model, our_method(model, "attn_lrp"), correct, decides),
        "context_cite, 64 ablations of the LDS's seed": evaluate(model, context_cite(model, 64, seed=0), correct, decides),
        "context_cite, 64": evaluate(model, context_cite(model, 64, seed=1), correct, decides),
    }
    for forwards in options.forwards:
        rows[f"calibrated AttnLRP, {forwards}"] = evaluate(model, calibrated(model, forwards), correct, decides)
        if forwards >= 2:
            rows[f"context_cite, {forwards}"] = evaluate(model, context_cite(model, forwards, seed=1), correct, decides)
        for name in [n for n in rows if n.endswith(f", {forwards}")]:
            print(f"  {name}: { {k: v for k, v in rows[name].items() if k != 'each'} }", flush=True)
    if options.json:
        options.json.write_text(json.dumps({"length": options.length, "examples": len(correct), "results": rows}, indent=1))
    print("\n| method | forwards | points at the needle | top-1 drop | LDS | s / example |\n|---|---|---|---|---|---|")
    for name, row in rows.items():
        forwards = re.search(r", (\d+)", name)
        print(f"| {name} | {forwards.group(1) if forwards else 1} | {row['pointing']:.0%} | {row['top1_drop']:.2f} | {row['lds']:.2f} "
              f"| {row['seconds']:.2f} |")


if __name__ == "__main__":
    main()
