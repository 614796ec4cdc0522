"""Leave-one-out estimates on a second model, with rotary positions: key-value recall.

    python benchmarks/recall_estimates.py [--examples 64] [--json out.json]

:mod:`captum_attention.demo.recall`'s model (a 2-layer Llama with rotary positions) reads
``c=7 a=3 f=1 ... ; a`` and answers the asked key's value. On the held-out sequences it
answers correctly (the first asked key; its prompt the pairs, ``;`` and the key), each pair
is a segment (``;`` and the key never removed), and per method the LDS over 32 seeded half
ablations (:func:`~captum_attention.metrics.linear_datamodeling_score`): AttnLRP,
KnockoutGradient, KnockoutLRP (the two joined, no deletion),
:func:`~captum_attention.metrics.leave_one_out_estimates` with 1 and 2
segments deleted exactly (those AttnLRP ranks highest; or, "by share", those of largest
first-order effect over one minus their :func:`~captum_attention.metrics.attention_shares`),
every segment deleted (leave-one-out itself, Feature Ablation's scores), and AttnLRP in 8
random half contexts of the pairs beside its scores on the whole prompt
(:func:`~captum_attention.metrics.context_averaged_scores`, seed 1). Here deleting a pair
moves the later tokens' positions, which masking it (the first-order effect) does not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from captum_attention import AttnLRP, KnockoutGradient, KnockoutLRP
from captum_attention.demo.recall import RecallTraining, load_recall_model, recall_batch
from captum_attention.metrics import (
    attention_shares,
    context_averaged_scores,
    leave_one_out_estimates,
    linear_datamodeling_score,
)


def sequence_lds(model: Any, ids: torch.Tensor, answer: torch.Tensor) -> dict[str, float]:
    """Each method's LDS on one prompt ``(1, T)`` (pairs, ``;``, key) and its answer ``(1, 1)``."""
    mask = torch.ones_like(ids)
    segments = torch.arange(ids.shape[1])[None].masked_fill(torch.arange(ids.shape[1]) >= ids.shape[1] - 2, -1)
    first_order, prior, joined = (
        explainer(model).attribute_span(ids, answer, additional_forward_args=(mask,))[:, :-1]
        for explainer in (KnockoutGradient, AttnLRP, KnockoutLRP)
    )
    pairs = int(segments.max()) + 1
    scores = {"AttnLRP": prior, "KnockoutGradient": first_order, "KnockoutLRP": joined}
    for exact, name in ((1, "estimates, 1 exact"), (2, "estimates, 2 exact"), (pairs, "leave-one-out (every pair deleted)")):
        scores[name] = leave_one_out_estimates(model, ids, mask, answer, first_order, prior, segments, exact=exact)
    shares = attention_shares(model, ids, mask, answer, segments)
    for exact in (1, 2):
        scores[f"estimates, {exact} exact, by share"] = leave_one_out_estimates(
            model, ids, mask, answer, first_order, first_order, segments, exact=exact, shares=shares
        )
    lrp = AttnLRP(model)

    def in_context(context_ids: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        return lrp.attribute_span(context_ids, answer, additional_forward_args=(context_mask,))[:, : context_ids.shape[1]]

    scores["AttnLRP in 8 half contexts"] = context_averaged_scores(model, in_context, ids, mask, answer, prior, segments)
    return {name: float(linear_datamodeling_score(model, ids, mask, answer, values, segments)[0]) for name, values in scores.items()}


def run(model: Any, examples: int, seed: int = 123) -> dict[str, list[float]]:
    """Each method's LDS per correctly answered sequence of ``recall_batch(examples, seed)``."""
    batch = recall_batch(examples, RecallTraining(), seed=seed)
    found: dict[str, list[float]] = {}
    for row in range(examples):
        ids, answer = batch.input_ids[row : row + 1, : int(batch.answer_positions[row, 0])], batch.answers[row : row + 1, :1]
        with torch.no_grad():
            if int(model(ids).logits[0, -1].argmax()) != int(answer):
                continue
        for name, value in sequence_lds(model, ids, answer).items():
            found.setdefault(name, []).append(value)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    found = run(load_recall_model(), options.examples)
    means = {name: sum(v for v in values if v == v) / max(sum(v == v for v in values), 1) for name, values in found.items()}
    count = len(next(iter(found.values()), []))
    if options.json:
        options.json.write_text(json.dumps({"sequences": count, "lds": means, "each": found}, indent=1))
    print(f"{count} sequences answered correctly\n\n| method | LDS |\n|---|---|")
    for name, value in means.items():
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
