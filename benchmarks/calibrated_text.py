"""Attention-calibrated surrogates on real text: LDS against the number of forwards.

    python benchmarks/calibrated_text.py [--examples 128] [--seed 1] [--presence 0.05]
        [--forwards 1 4 8 16 32 64] [--draws 1] [--json out.json] [--smoke]

The default sentiment model on ``--examples`` held-out sentences (``tasks.build('sentiment',
...)``; ``--seed``: which ones), each explained for its predicted class. For each number of
forwards A: AttnLRP at ``--presence`` calibrated on A random ablations
(``metrics.calibrated_attribution``, ``explainers.calibrated_over``) and ContextCite's Lasso
surrogate on A ablations (``explainers.context_cite``), and, for an even A, AttnLRP in A
random half contexts with the presence's scores ("in half contexts":
``metrics.context_averaged_attribution``, ``explainers.context_averaged_over``; a forward
and a backward per context), all drawn with seed 1, apart from the LDS's own
(``metrics.datamodeling_score``: 32 random halves of seed 0, the faithfulness benchmark's);
beside them AttnLRP at that presence alone (one forward and one backward). Each method's
seconds over the sentences (one draw) are printed and saved beside its rows.
Each row's paired differences to ContextCite on the most forwards and to the presence
alone, with their standard errors, say whether it is above or below them. With several
``--draws`` (seeds of both surrogates' ablations, in place of 1) each draw has its rows,
and "mean over draws" averages each sentence's LDS over them, ContextCite's reference
too: what a surrogate gains whichever ablations are drawn. ``--smoke``: the planted task's
model, trained on 1,000 sentences, on 4 examples instead, to check that everything runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import explainers  # noqa: E402
import tasks  # noqa: E402
from faithfulness import paired_difference  # noqa: E402

from captum_attention.metrics import datamodeling_score  # noqa: E402

HALVES = "in half contexts"


def lds(task: tasks.Task, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each example's LDS, as the faithfulness benchmark measures it."""
    forward, ids, mask, removal = explainers.removal(task)
    return datamodeling_score(forward, ids, mask, scores.detach(), target, **removal)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--presence", type=float, default=explainers.PRESENCES[-1])
    parser.add_argument("--forwards", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--draws", type=int, nargs="+", default=[1])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true")
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if options.smoke:
        task = tasks.build("planted", eval_size=4, train_size=1000, epochs=3)
    else:
        task = tasks.build("sentiment", eval_size=options.examples, seed=options.seed)
    with torch.no_grad():
        target = task.logits(task.inputs, task.attention_mask).argmax(-1)
    started = time.perf_counter()
    prior = explainers.attn_lrp_at_presence(options.presence)(task, target).detach()
    presence = f"AttnLRP at presence {options.presence}"
    seconds = {presence: time.perf_counter() - started}

    def given_prior(task: tasks.Task, target: torch.Tensor) -> torch.Tensor:  # computed once, for every budget
        return prior

    each = {presence: (1, lds(task, prior, target))}
    surrogates = {
        "calibrated": lambda forwards, seed: explainers.calibrated_over(given_prior, forwards, seed)(task, target),
        "ContextCite": lambda forwards, seed: explainers.context_cite(task, target, forwards, seed),
        HALVES: lambda forwards, seed: explainers.context_averaged_over(given_prior, forwards, seed)(task, target),
    }
    for forwards in options.forwards:
        for name, surrogate in surrogates.items():
            if name == HALVES and forwards % 2:
                continue
            started = time.perf_counter()
            scores = {seed: surrogate(forwards, seed) for seed in options.draws}
            seconds[f"{name}, {forwards}"] = (time.perf_counter() - started) / len(options.draws)
            draws = {seed: lds(task, values, target) for seed, values in scores.items()}
            if len(draws) == 1:
                each[f"{name}, {forwards}"] = (forwards, draws[options.draws[0]])
            else:
                each.update({f"{name}, {forwards}, draw {seed}": (forwards, values) for seed, values in draws.items()})
                each[f"{name}, {forwards}, mean over draws"] = (forwards, torch.stack(list(draws.values())).nanmean(0))
    reference = f"ContextCite, {max(options.forwards)}" + (", mean over draws" if len(options.draws) > 1 else "")
    rows = {name: _row(forwards, values, each[reference][1], each[presence][1]) for name, (forwards, values) in each.items()}
    command = "python benchmarks/calibrated_text.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "examples": len(target), "accuracy": task.accuracy, "reference": reference, "rows": rows,
              "seconds": seconds, "each": {name: values.tolist() for name, (_, values) in each.items()}}
    if options.json:
        options.json.write_text(json.dumps(result, indent=1))
    print(f"{command}\n\n{len(target)} sentences; paired differences to {reference}\n")
    print("| method | forwards | LDS | defined on | minus the reference | standard error | minus the presence | standard error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['forwards']} | {row['LDS']:.3f} | {row['defined on']} | {row['difference']:+.3f} | "
              f"{row['standard error']:.3f} | {row['minus the presence']:+.3f} | {row['its standard error']:.3f} |")
    print("\nseconds over the sentences (one draw each; the prior once, apart from the surrogates): "
          + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items()))
    return result


def _row(forwards: int, values: torch.Tensor, reference: torch.Tensor, presence: torch.Tensor) -> dict[str, float]:
    """The mean LDS over the examples where it is defined, and the paired differences to the
    reference's and to the presence's over those where both are, with their standard errors."""
    paired, gain = paired_difference(values, reference), paired_difference(values, presence)
    return {
        "forwards": forwards, "LDS": values.nanmean().item(), "defined on": int((~values.isnan()).sum()),
        "difference": paired["mean"], "standard error": paired["standard error"],
        "minus the presence": gain["mean"], "its standard error": gain["standard error"],
    }


if __name__ == "__main__":
    main()
