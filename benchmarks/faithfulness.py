"""Which explanation to trust: every method on ground-truth tasks, side by side, one run.

    python benchmarks/faithfulness.py [--tasks planted order shape sentiment] [--examples 64]
                                      [--methods NAME ...] [--sentiment-seed 1] [--sentiment-model-seed 0]
                                      [--paired NAME] [--json results.json]

For each task (see ``tasks.py``) and each method (see ``explainers.py``), explaining the
model's predicted class:

- plausibility against the known decisive tokens/patches: token F1 (top-k, k = number of
  decisive tokens) and AUPRC; for images the pointing game (the top patch is decisive)
  and AUPRC over patches;
- ERASER comprehensiveness and sufficiency (AOPC over bins 1, 5, 10, 20, 50%; text:
  tokens deleted, [CLS]/[SEP] kept; images: patches set to grey) — higher
  comprehensiveness and lower sufficiency are better;
- LDS: Spearman's rho between the kept features' summed scores and the class's
  probability over 32 random half removals (seed 0; the ablation methods fit on others,
  seed 1), removed as above — higher is better;
- decision flip: erase the attention to the keys in the method's order at every layer
  until the prediction changes (Serrano & Smith); the share of examples that flip and the
  mean fraction of tokens erased at the flip (lower = the ranking finds decisive keys
  sooner);
- wall time per example, and as a ratio to one forward+backward of the model on the same
  batch.

Prints one Markdown table per task with the command that produced it. With ``--paired
NAME``, a second table gives, for every other method, the mean of NAME's value minus its
value on the same examples, with the standard error of that paired difference: whether a
gap between two methods is larger than the examples' own spread. The JSON keeps each
example's token F1 (pointing game), comprehensiveness, sufficiency and LDS (``each``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import explainers  # noqa: E402
import tasks  # noqa: E402
from tasks import Task  # noqa: E402

from captum_attention.metrics import (  # noqa: E402
    aopc,
    auprc,
    comprehensiveness,
    datamodeling_score,
    decision_flip_fraction,
    sufficiency,
    token_f1,
)

REPEATS = 3


def _timed(call: Callable[[], Any], repeats: int = 1) -> tuple[Any, float]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def forward_backward_seconds(task: Task) -> float:
    """One forward+backward of the model (gradients of the predicted logits w.r.t. the weights)."""
    params = [p for p in task.model.parameters() if p.requires_grad]

    def step() -> None:
        logits = task.logits(task.inputs, task.attention_mask)
        torch.autograd.grad(logits.max(dim=-1).values.sum(), params)

    return _timed(step, REPEATS)[1]


def evaluate(task: Task, scores: torch.Tensor, target: torch.Tensor) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The method's mean values, and each example's token F1 (pointing game),
    comprehensiveness, sufficiency and LDS (NaN where one is undefined)."""
    if task.is_image:
        flat, gold = scores.flatten(1), task.rationale.flatten(1)
        top = flat.argmax(dim=1)
        plausible = {"pointing game": gold[torch.arange(len(top)), top].float()}
        ranked = auprc(flat, gold)
        prefix = 1
        ranking = torch.cat([torch.full((len(flat), prefix), float("-inf")), flat.float()], dim=1)
        keep = torch.zeros_like(ranking, dtype=torch.bool)
        keep[:, :prefix] = True
        flip_args: tuple[Any, ...] = (task.model, task.inputs, ranking, None)
    else:
        include = (task.attention_mask != 0) & ~task.keep
        plausible = {"token F1": token_f1(scores, task.rationale, include)}
        ranked = auprc(scores, task.rationale, include)
        flat, keep = scores, task.keep
        flip_args = (task.model, task.inputs, scores, (task.attention_mask,))
    forward, ids, mask, removal = explainers.removal(task)
    comp = comprehensiveness(forward, ids, mask, flat, target, **removal)
    suff = sufficiency(forward, ids, mask, flat, target, **removal)
    flips = decision_flip_fraction(*flip_args, keep=keep)
    flipped = flips.flipped.float().mean().item()
    each = {
        **plausible,
        "comprehensiveness": aopc(comp),
        "sufficiency": aopc(suff),
        "LDS": datamodeling_score(forward, ids, mask, flat, target, **removal),
    }
    means = {name: values.nanmean().item() for name, values in {**each, "AUPRC": ranked}.items()}
    return {
        **{name: means[name] for name in [*plausible, "AUPRC", "comprehensiveness", "sufficiency", "LDS"]},
        "flipped": flipped,
        "fraction at flip": flips.fraction[flips.flipped].mean().item() if flipped > 0 else float("nan"),
    }, {name: values.tolist() for name, values in each.items()}


def paired_differences(result: dict[str, Any], reference: str) -> dict[str, dict[str, dict[str, float]]]:
    """For every other method and each metric kept per example: the mean over examples of
    ``reference``'s value minus the method's, its standard error, and the examples counted
    (those where both are defined)."""
    mine = result["each"][reference]
    paired: dict[str, dict[str, dict[str, float]]] = {}
    for name, theirs in result["each"].items():
        if name == reference:
            continue
        paired[name] = {}
        for metric in mine:
            paired[name][metric] = paired_difference(torch.tensor(mine[metric]), torch.tensor(theirs[metric]))
    return paired


def paired_difference(mine: torch.Tensor, theirs: torch.Tensor) -> dict[str, float]:
    """The mean over examples of ``mine`` minus ``theirs``, its standard error, and the
    examples counted (those where both are defined)."""
    difference = mine - theirs
    difference = difference[~difference.isnan()]
    error = difference.std().item() / len(difference) ** 0.5 if len(difference) > 1 else float("nan")
    return {"mean": difference.mean().item() if len(difference) else float("nan"), "standard error": error,
            "examples": len(difference)}


def run_task(task: Task, check_accuracy: bool = True, only: list[str] | None = None) -> dict[str, Any]:
    if check_accuracy and task.accuracy < 0.9:
        raise RuntimeError(f"the {task.name} model reached only {task.accuracy:.0%}: its explanations would mean nothing.")
    torch.manual_seed(0)
    with torch.no_grad():
        target = task.logits(task.inputs, task.attention_mask).argmax(-1)
    baseline = forward_backward_seconds(task)
    rows, each = {}, {}
    for name, method in explainers.methods().items():
        if only and name not in only:
            continue
        repeats = 1 if "SHAP" in name or "Integrated" in name else REPEATS
        scores, seconds = _timed(lambda: method(task, target), repeats)
        means, each[name] = evaluate(task, scores.detach(), target)
        rows[name] = {**means, "ms / example": 1000 * seconds / len(target), "× fwd+bwd": seconds / baseline}
    return {
        "task": task.name,
        "examples": len(target),
        "accuracy": task.accuracy,
        "train seconds": task.train_seconds,
        "fwd+bwd ms / example": 1000 * baseline / len(target),
        "methods": rows,
        "each": each,
    }


def markdown(result: dict[str, Any], command: str) -> str:
    columns = list(next(iter(result["methods"].values())))
    lines = [
        f"**{result['task']}** — {result['examples']} examples, model accuracy "
        f"{100 * result['accuracy']:.1f}%, one forward+backward {result['fwd+bwd ms / example']:.2f} ms/example "
        f"(`{command}`)",
        "",
        "| method | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, values in result["methods"].items():
        cells = [f"{values[c]:.3g}" if c in ("ms / example", "× fwd+bwd") else f"{values[c]:.3f}" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_markdown(result: dict[str, Any], reference: str) -> str:
    metrics = list(result["each"][reference])
    lines = [
        f"**{result['task']}** — {reference} minus each method on the same examples: mean ± standard error "
        "(sufficiency: lower is better)",
        "",
        "| method | " + " | ".join(metrics) + " |",
        "|---|" + "---|" * len(metrics),
    ]
    for name, differences in result["paired"][reference].items():
        cells = [f"{d['mean']:+.3f} ± {d['standard error']:.3f}" for d in differences.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["planted", "order", "shape", "sentiment"])
    parser.add_argument("--examples", type=int, default=None, help="evaluation examples per task (default: the task's)")
    parser.add_argument("--methods", nargs="+", help="only these methods (names as printed; default: all)")
    parser.add_argument("--sentiment-seed", type=int, default=1, help="which held-out sentences the sentiment task "
                        "explains (default: 1)")
    parser.add_argument("--sentiment-model-seed", type=int, default=0, help="the sentiment model: 0 the default "
                        "model, another seed its fine-tuning from that seed (trained and cached on first use)")
    parser.add_argument("--paired", metavar="NAME", help="also print this method's paired differences to every other "
                        "method, with their standard errors")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny budgets, to check that everything runs")
    options = parser.parse_args(argv)
    if options.smoke:
        explainers.IG_STEPS, explainers.SMOOTHGRAD_SAMPLES, explainers.SHAP_EVALS = 4, 2, 40
    chosen = options.methods or list(explainers.methods())
    if options.paired and options.paired not in chosen:
        parser.error(f"--paired {options.paired!r} is not among the methods run: {', '.join(chosen)}.")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    command = shlex.join(["python", "benchmarks/faithfulness.py", *(argv if argv is not None else sys.argv[1:])])
    results = []
    start = time.perf_counter()
    for name in options.tasks:
        sizes: dict[str, int] = {} if options.examples is None else {"eval_size": options.examples}
        if name == "sentiment" and options.sentiment_seed != 1:
            sizes["seed"] = options.sentiment_seed
        if name == "sentiment" and options.sentiment_model_seed:
            sizes["model_seed"] = options.sentiment_model_seed
        if options.smoke:
            sizes = {"eval_size": 4, "train_size": 200, "epochs": 1}
        result = run_task(tasks.build(name, **sizes), check_accuracy=not options.smoke, only=options.methods)
        results.append(result)
        print(markdown(result, command.strip()), "\n", flush=True)
        if options.paired:
            result["paired"] = {options.paired: paired_differences(result, options.paired)}
            print(paired_markdown(result, options.paired), "\n", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s on {torch.get_num_threads()} threads")
    if options.json:
        options.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
