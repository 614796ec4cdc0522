"""Fit Learned Attention's head weights on a file of answers and save them beside the
model (``captum-attention fit-head-weights``), where ``explain`` and ``evaluate`` read them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..metrics.head_weights import WEIGHTS_FILE, HeadWeights
from .dataset import AnswerExample
from .evaluate import ResumableInterrupt, answer_tensors, data_digest, model_identity, removable_segments


@dataclass
class FitOptions:
    """How to fit: ablations per example, the ablations' seed, the ridge penalty, and the
    longest answer generated for a row without one."""

    num_ablations: int = 32
    seed: int = 0
    ridge: float = 1e-3
    max_new_tokens: int = 20


def fit_beside_model(
    model: Any, tokenizer: Any, examples: Sequence[AnswerExample], folder: str | Path, options: FitOptions | None = None,
    progress: bool = True,
) -> tuple[HeadWeights, Path]:
    """Fit :class:`~captum_attention.HeadWeights` on ``examples`` (each answer given, or
    generated greedily; a row's segments, else each prompt token its own, the special
    tokens never removed) and save them into ``folder`` as
    :data:`~captum_attention.metrics.head_weights.WEIGHTS_FILE`. Resumable: the running sums
    go to a checkpoint in ``folder`` named after the run (the rows, the model and the
    options), which a rerun of the same run resumes and the saved fit removes; Ctrl-C raises
    :class:`~captum_attention.presentation.evaluate.ResumableInterrupt`."""
    options = options or FitOptions()
    folder = Path(folder)
    fit_examples = []
    for example in examples:
        ids, answer, keep, segments = answer_tensors(model, tokenizer, example, options.max_new_tokens)
        fit_examples.append((ids[0], answer[0], removable_segments(keep, segments)[0]))
    checkpoint = folder / f"head_weights.{_run_digest(model, examples, options)[:16]}.partial.safetensors"
    try:
        weights = HeadWeights.fit(
            model, fit_examples, num_ablations=options.num_ablations, seed=options.seed, ridge=options.ridge,
            checkpoint=checkpoint, progress=progress,
        )
    except KeyboardInterrupt as interrupt:
        raise ResumableInterrupt("interrupted; rerun the same command to resume the fit from its checkpoint") from interrupt
    path = weights.save(folder / WEIGHTS_FILE)
    checkpoint.unlink(missing_ok=True)
    return weights, path


def _run_digest(model: Any, examples: Sequence[AnswerExample], options: FitOptions) -> str:
    """What makes two fits the same fit: the rows, the model and the options."""
    run = [data_digest(examples), model_identity(model), dataclasses.asdict(options)]
    return hashlib.sha256(json.dumps(run).encode("utf-8")).hexdigest()
