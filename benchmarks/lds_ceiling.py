"""How high can a linear surrogate's LDS go on the needle task? Feature Ablation against a
least-squares fit on many random ablations.

    python benchmarks/lds_ceiling.py [--lengths 512 2048] [--examples 24] [--ablations 1024 512] [--json out.json]

On the contexts of ``benchmarks/needle.py`` (the same seeds, those the shipped needle model
answers correctly), per context: the least-squares weights of the segments on
``--ablations`` random ablations that keep each segment with probability 1/2 (seed 7:
ContextCite's objective, with an intercept, without its sparsity, against the answer's
log-probability, which the LDS scores), and Feature Ablation's scores (each segment's
leave-one-out effect). Both are scored by the same LDS
(:func:`~captum_attention.metrics.linear_datamodeling_score`, 32 ablations of seed 0), so
the fit is out of sample. The fit minimises the squared error over the distribution the
LDS draws from; the LDS ranks. Where Feature Ablation's LDS is above the fit's, the gap of
a one-pass method to Feature Ablation is a gap to a score no linear surrogate fitted to
ContextCite's objective reaches here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from common import device_description
from needle import _on_first_tokens, answered_contexts

from captum_attention.demo.needle import NeedleExample, load_needle_model
from captum_attention.metrics import ablated_log_probs, leave_one_out_estimates, linear_datamodeling_score


def least_squares_weights(kept: torch.Tensor, outcomes: torch.Tensor) -> torch.Tensor:
    """``(S,)`` float64 weights of the segments, with an intercept, least squares on the
    keep-masks ``kept`` ``(A, S)`` against ``outcomes`` ``(A,)``."""
    design = torch.cat([torch.ones(len(kept), 1, dtype=torch.float64), kept.double()], dim=1)
    return torch.linalg.lstsq(design, outcomes.double()[:, None]).solution[1:, 0]


def context_lds(model: Any, e: NeedleExample, ablations: int, seed: int = 7) -> dict[str, float]:
    """The LDS of the least-squares surrogate on ``ablations`` random ablations and of
    Feature Ablation, on one context."""
    prompt = e.input_ids[None]
    mask, answer, segments = torch.ones_like(prompt), torch.tensor([[e.answer]]), e.segments[None]
    count = int(e.segments.max()) + 1
    kept = torch.rand(ablations, count, generator=torch.Generator().manual_seed(seed)) < 0.5
    fitted = least_squares_weights(kept, ablated_log_probs(model, prompt, mask, answer, kept[None], segments)[0])
    nothing = torch.zeros(prompt.shape)  # every segment deleted exactly: no first-order part, no prior needed
    scores = {
        "least squares": _on_first_tokens(e, fitted.float())[None],
        "Feature Ablation": leave_one_out_estimates(model, prompt, mask, answer, nothing, nothing, segments, exact=count),
    }
    return {
        name: float(linear_datamodeling_score(model, prompt, mask, answer, values, segments)[0]) for name, values in scores.items()
    }


def run(model: Any, length: int, examples: int, ablations: int) -> dict[str, list[float]]:
    """Each scoring's LDS per context of ``benchmarks/needle.py`` at ``length`` that the
    model answers correctly."""
    found: dict[str, list[float]] = {}
    for e in answered_contexts(model, length, examples):
        for name, value in context_lds(model, e, ablations).items():
            found.setdefault(name, []).append(value)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--ablations", type=int, nargs="+", default=[1024, 512], help="per length (the last for the rest)")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_needle_model()
    results = []
    print("| tokens | contexts | ablations | least squares | Feature Ablation |\n|---|---|---|---|---|")
    for index, length in enumerate(options.lengths):
        ablations = options.ablations[min(index, len(options.ablations) - 1)]
        found = run(model, length, options.examples, ablations)
        means = {name: float(torch.tensor(values).nanmean()) for name, values in found.items()}
        contexts = len(found.get("Feature Ablation", []))
        results.append({"length": length, "contexts": contexts, "ablations": ablations, "lds": means, "each": found})
        print(f"| {length} | {contexts} | {ablations} | {means.get('least squares', float('nan')):.4f} "
              f"| {means.get('Feature Ablation', float('nan')):.4f} |", flush=True)
        if options.json:
            options.json.write_text(json.dumps({"device": device_description(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
