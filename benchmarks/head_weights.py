"""Learned head weights on the needle task: how many examples a fit needs, and how the
learned attention then compares on held-out contexts.

    python benchmarks/head_weights.py [--length 512] [--train 8 16 32 64] [--test 16]
        [--ablations 32] [--over-relevance] [--json out.json]

The model and task are ``benchmarks/needle.py``'s. Training examples are drawn with another
seed than the held-out ones (``needle.py``'s own, so the figures compare with its tables);
each is explained with the model's own answer, as a user's examples would be. For each
training size: the fit's time (``HeadWeights.fit``, ``--ablations`` random ablations per
example) and, on the held-out contexts the model answers correctly, ``LearnedAttention``'s
pointing accuracy, top-1/top-3 log-probability drop, LDS and time (``needle.evaluate``);
beside it the uniform weights (the mean attention over every layer and head) and AttnLRP.

``--over-relevance`` fits the same ridge objective over AttnLRP's relevance per layer and
key-value head instead of the attention: the relevance each key token's value vector
receives in AttnLRP's backward (value times its gradient, summed over the head's
dimensions, read by hooks on the Llama's ``v_proj``); their plain sum is the "uniform"
row of that fit.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from needle import evaluate, our_method

from captum_attention import HeadWeights, LearnedAttention
from captum_attention.demo.needle import NeedleExample, load_needle_model, needle_example
from captum_attention.metrics import random_ablations


def learned(model, weights: HeadWeights | None):
    explainer = LearnedAttention(model, capture="streaming", weights=weights)

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt = e.input_ids[None]
        return explainer.attribute_span(prompt, torch.tensor([[e.answer]]), additional_forward_args=(torch.ones_like(prompt),))[0, :-1]

    return attribute


def value_relevance(model, e: NeedleExample) -> torch.Tensor:
    """``(N, L·KV)`` float64: in AttnLRP's backward from ``e``'s answer, the relevance of
    each token's value vector per layer and key-value head."""
    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    caught: list[torch.Tensor] = []

    def catch(module: torch.nn.Module, inputs: tuple, values: torch.Tensor) -> None:
        values.register_hook(lambda grads: caught.append((values.detach() * grads)[0].unflatten(-1, (kv_heads, head_dim)).sum(-1)))

    handles = [layer.self_attn.v_proj.register_forward_hook(catch) for layer in model.model.layers]
    try:
        length = len(our_method(model, "attn_lrp")(e))
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(caught[::-1], dim=1)[:length].double()  # the backward reaches the last layer first


def relevance_fit(model, examples: list[NeedleExample], ablations: int, ridge: float = 1e-3) -> torch.Tensor:
    """The ridge coefficients over :func:`value_relevance`'s columns, as ``HeadWeights.fit``
    solves them over the attention (its module docstring); example i's ablations of seed i."""
    gram, moment = torch.zeros(()), torch.zeros(())
    for index, e in enumerate(examples):
        prompt = e.input_ids[None]
        kept, outcomes, _ = random_ablations(model, prompt, torch.ones_like(prompt), torch.tensor([[e.answer]]), e.segments[None],
                                             ablations, index)
        relevance = value_relevance(model, e)
        per_segment = torch.zeros(kept.shape[-1], relevance.shape[1], dtype=torch.float64)
        per_segment.index_add_(0, e.segments.clamp(min=0), relevance * (e.segments >= 0)[:, None])
        design = kept[0].double() @ per_segment
        design, outcome = design - design.mean(dim=0), outcomes[0].double() - outcomes[0].double().mean()
        gram, moment = gram + design.T @ design, moment + design.T @ outcome
    penalty = ridge * float(gram.diagonal().mean())
    return torch.linalg.solve(gram + penalty * torch.eye(len(gram), dtype=torch.float64), moment)


def weighted_relevance(model, theta: torch.Tensor | None):
    """:func:`value_relevance`'s columns weighed by ``theta`` (None: summed)."""

    def attribute(e: NeedleExample) -> torch.Tensor:
        relevance = value_relevance(model, e)
        return (relevance.sum(dim=1) if theta is None else relevance @ theta).float()

    return attribute


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--train", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--ablations", type=int, default=32)
    parser.add_argument("--over-relevance", action="store_true", help="fit over AttnLRP's value relevance per head")
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
    if options.over_relevance:
        answered = [replace(e, answer=answer) for e, answer in zip(training, own)]
        uniform = ("relevance summed", weighted_relevance(model, None))
        fit = lambda size: weighted_relevance(model, relevance_fit(model, answered[:size], options.ablations))  # noqa: E731
    else:
        uniform = ("uniform weights", learned(model, None))
        fit = lambda size: learned(model, HeadWeights.fit(model, examples[:size], num_ablations=options.ablations, progress=False))  # noqa: E731
    rows = {uniform[0]: evaluate(model, uniform[1], held_out), "attn_lrp": evaluate(model, our_method(model, "attn_lrp"), held_out)}
    for name, row in rows.items():
        print(f"  {name}: {row}", flush=True)
    for size in options.train:
        started = time.perf_counter()
        attribute = fit(size)
        fit_seconds = time.perf_counter() - started
        rows[f"learned, {size} examples"] = {**evaluate(model, attribute, held_out), "fit_seconds": fit_seconds}
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
