"""Learned head weights on the needle task: how many examples a fit needs, and how the
learned attention then compares on held-out contexts.

    python benchmarks/head_weights.py [--length 512] [--train 8 16 32 64] [--test 16]
        [--ablations 32] [--json out.json]

The model and task are ``benchmarks/needle.py``'s. Training examples are drawn with another
seed than the held-out ones (``needle.py``'s own, so the figures compare with its tables);
each is explained with the model's own answer, as a user's examples would be. For each
training size: the fit's time (``HeadWeights.fit``, ``--ablations`` random ablations per
example) and, on the held-out contexts the model answers correctly, ``LearnedAttention``'s
pointing accuracy, top-1/top-3 log-probability drop, LDS and time (``needle.evaluate``);
beside it the uniform weights (the mean attention over every layer and head) and AttnLRP.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from needle import evaluate, our_method

from captum_attention import HeadWeights, LearnedAttention
from captum_attention.demo.needle import NeedleExample, load_needle_model, needle_example


def learned(model, weights: HeadWeights | None):
    explainer = LearnedAttention(model, capture="streaming", weights=weights)

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt = e.input_ids[None]
        return explainer.attribute_span(prompt, torch.tensor([[e.answer]]), additional_forward_args=(torch.ones_like(prompt),))[0, :-1]

    return attribute


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--train", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--ablations", type=int, default=32)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_needle_model()
    generator = torch.Generator().manual_seed(options.length + 1_000_003)
    training = [needle_example(options.length, generator) for _ in range(max(options.train))]
    with torch.no_grad():
        own = [int(model(e.input_ids[None]).logits[0, -1].argmax()) for e in training]
    examples = [(e.input_ids, torch.tensor([answer]), e.segments) for e, answer in zip(training, own)]
    generator = torch.Generator().manual_seed(options.length)
    candidates = [needle_example(options.length, generator) for _ in range(options.test)]
    with torch.no_grad():
        held_out = [e for e in candidates if int(model(e.input_ids[None]).logits[0, -1].argmax()) == e.answer]
    print(f"{options.length} tokens: {len(held_out)} of {len(candidates)} held-out contexts answered correctly", flush=True)
    rows = {"uniform weights": evaluate(model, learned(model, None), held_out), "attn_lrp": evaluate(model, our_method(model, "attn_lrp"), held_out)}
    for name, row in rows.items():
        print(f"  {name}: {row}", flush=True)
    for size in options.train:
        started = time.perf_counter()
        weights = HeadWeights.fit(model, examples[:size], num_ablations=options.ablations, progress=False)
        fit_seconds = time.perf_counter() - started
        rows[f"learned, {size} examples"] = {**evaluate(model, learned(model, weights), held_out), "fit_seconds": fit_seconds}
        print(f"  learned, {size} examples: {rows[f'learned, {size} examples']}", flush=True)
    if options.json:
        options.json.write_text(json.dumps({"length": options.length, "held_out": len(held_out), "ablations": options.ablations,
                                            "results": rows}, indent=1))
    print("\n| method | points at the needle | top-1 drop | top-3 drop | LDS | s / example | fit s |\n|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['pointing']:.0%} | {row['top1_drop']:.2f} | {row['top3_drop']:.2f} | {row['lds']:.2f} "
              f"| {row['seconds']:.2f} | {row.get('fit_seconds', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
