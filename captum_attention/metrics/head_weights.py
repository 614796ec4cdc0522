r"""Fit :class:`HeadWeights` to ContextCite's
objective: per-head coefficients :math:`\theta` whose attention scores predict what
ablating parts of a prompt does to the answer.

For each example (a prompt, the answer to explain, optionally the prompt's segments),
:func:`~captum_attention.metrics.random_ablations` keeps each segment with probability
1/2, ``num_ablations`` times (seeded per example), and records the answer's
:math:`y_a = \log p(\text{answer} \mid \text{kept segments})`. One forward of prompt and
answer gives every head's attention from the answer's rows to each segment,
:math:`F_{lh,s}`. The surrogate of ablation :math:`a` is
:math:`\hat y_a = b + \sum_s m_{as} \sum_{l,h} \theta_{lh} F_{lh,s}`, linear in
:math:`\theta`: with :math:`X_a = \sum_s m_{as} F_{\cdot,s}` centred within each example
(the intercept :math:`b` is the example's own), :math:`\theta` solves the ridge problem

.. math::

    \min_\theta \sum_{e,a} \big(X_{ea}\theta - (y_{ea} - \bar y_e)\big)^2 + \lambda \lVert\theta\rVert^2,
    \qquad \lambda = \text{ridge} \cdot \operatorname{mean}\operatorname{diag}(X^\top X),

from its sufficient statistics :math:`X^\top X` and :math:`X^\top y`, summed example by
example in float64: a fit interrupted and resumed from its checkpoint gives the very same
coefficients.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import torch
from torch import Tensor, nn

from ..capture.guard import ctrl_c_noticed
from ..capture.inputs import LogProbTarget
from ..capture.identity import fitted_model
from ..capture.record import without_autocast
from ._forward import run_model
from .context import random_ablations

WEIGHTS_FILE = "head_weights.safetensors"
"""The file name :meth:`HeadWeights.save` gives a folder (a model's, say)."""

Example = Union[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""``(prompt_ids (N,), answer_ids (n,))`` or with ``segments (N,)`` (long; -1 for the
tokens never removed, as :func:`~captum_attention.metrics.linear_datamodeling_score`
takes them; default: each token its own segment, the first kept)."""


@dataclass
class HeadWeights:
    """One coefficient per attention layer and head, ``(L, H)`` float32, and the settings
    of the fit that gave them, saved with them: what
    :class:`~captum_attention.LearnedAttention` weighs the heads' attention by.

    Attributes:
        weights: ``(layers, heads)``, in the order of the model's attention calls.
        settings: how they were fitted (examples, ablations, seed, ridge, ...).
    """

    weights: Tensor
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def uniform(cls, layers: int, heads: int) -> "HeadWeights":
        """``1 / (L · H)`` each: the mean attention over every layer and head."""
        return cls(torch.full((layers, heads), 1.0 / (layers * heads), dtype=torch.float32), {"fit": "uniform"})

    @classmethod
    def fit(cls, model: nn.Module, examples: Sequence["Example"], **options: Any) -> "HeadWeights":
        """Fit the coefficients to ContextCite's objective on ablations of ``examples``:
        :func:`~captum_attention.metrics.head_weights.fit_head_weights` (its options)."""
        return fit_head_weights(model, examples, **options)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (a folder, or a path without a suffix, made a folder if it is
        none yet, gets :data:`~captum_attention.metrics.head_weights.WEIGHTS_FILE`) as
        safetensors, the settings in its metadata, through a temporary file moved over it
        (an interruption leaves the previous file whole); returns the file's path."""
        path = Path(path)
        if path.is_dir() or not path.suffix:
            path.mkdir(parents=True, exist_ok=True)
            path = path / WEIGHTS_FILE
        _save_whole(path, {"weights": self.weights.float().contiguous().cpu()}, {"settings": json.dumps(self.settings)})
        return path

    @classmethod
    def load(cls, path: str | Path) -> "HeadWeights":
        """Read what :meth:`save` wrote (``path``: the file, or the folder holding it)."""
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            path = path / WEIGHTS_FILE
        with safe_open(str(path), framework="pt") as saved:
            metadata = saved.metadata() or {}
            return cls(saved.get_tensor("weights"), json.loads(metadata.get("settings", "{}")))


@without_autocast("fit_head_weights")
def fit_head_weights(
    model: nn.Module,
    examples: Sequence[Example],
    num_ablations: int = 32,
    seed: int = 0,
    ridge: float = 1e-3,
    max_batch_size: int = 64,
    checkpoint: str | Path | None = None,
    progress: bool = True,
    forward_func: Callable[..., Any] | None = None,
) -> HeadWeights:
    """The per-head coefficients that best predict ``examples``' ablations (module docstring).

    Args:
        model (nn.Module): a causal language model (its attention calls give the heads).
        examples (sequence): :data:`Example` tuples.
        num_ablations (int, optional): random ablations per example. Default: 32.
        seed (int, optional): example i's ablations are drawn with seed ``seed + i``.
            Default: 0.
        ridge (float, optional): the ridge penalty relative to the mean diagonal of
            :math:`X^\\top X`. Default: 1e-3.
        max_batch_size (int, optional): ablated prompts per forward. Default: 64.
        checkpoint (str or Path, optional): a safetensors file the running sums are saved
            to after each example, and resumed from (its settings must match, the
            examples' digest among them). Default: None.
        progress (bool, optional): show a progress bar. Default: True.
        forward_func (Callable, optional): what runs the model on ``(ids, mask)``.
            Default: ``model``.

    Returns:
        HeadWeights, with the fit's settings; among them ``model``, the digest of the
        model's weights (``captum_attention.capture.identity.fitted_model``), by which
        :class:`~captum_attention.LearnedAttention` refuses them for a model trained again.
    """
    if not examples:
        raise ValueError("Fitting head weights needs at least one example.")
    if num_ablations < 2:
        raise ValueError(f"num_ablations must be at least 2 (each example's mean is removed), got {num_ablations}.")
    forward = forward_func or model
    settings = {
        "examples": len(examples), "examples_sha256": _examples_digest(examples), "num_ablations": num_ablations,
        "seed": seed, "ridge": ridge, "model": fitted_model(model),
    }
    done, sums = _resume(checkpoint, settings)
    from tqdm.auto import tqdm

    with ctrl_c_noticed() as ctrl_c:
        for index in tqdm(range(done, len(examples)), initial=done, total=len(examples), disable=not progress, desc="head weights"):
            design, outcomes, shape = _example_statistics(forward, model, examples[index], num_ablations, seed + index, max_batch_size)
            if sums is None:
                sums = {"gram": torch.zeros(design.shape[1], design.shape[1], dtype=torch.float64),
                        "moment": torch.zeros(design.shape[1], dtype=torch.float64), "shape": torch.tensor(shape)}
            sums["gram"] += design.T @ design
            sums["moment"] += design.T @ outcomes
            if checkpoint is not None:
                _save(Path(checkpoint), settings, index + 1, sums)
            if ctrl_c():  # its KeyboardInterrupt was swallowed on the way
                raise KeyboardInterrupt
    assert sums is not None
    gram, moment = sums["gram"], sums["moment"]
    penalty = ridge * float(gram.diagonal().mean().clamp(min=torch.finfo(torch.float64).tiny))
    theta = torch.linalg.solve(gram + penalty * torch.eye(len(gram), dtype=gram.dtype), moment)
    return HeadWeights(theta.view(*sums["shape"].tolist()).float(), {**settings, "fit": "ridge"})


def _examples_digest(examples: Sequence[Example]) -> str:
    """The SHA-256 of every example's tensors (dtype, shape and values): a checkpoint of other
    examples, as many, is not resumed."""
    digest = hashlib.sha256()
    for example in examples:
        for tensor in example:
            digest.update(f"{tensor.dtype} {tuple(tensor.shape)}\n".encode("utf-8"))
            digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _example_statistics(
    forward: Callable[..., Any], model: nn.Module, example: Example, num_ablations: int, seed: int, max_batch_size: int
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """``(A, L·H)`` design rows and ``(A,)`` outcomes of one example, both centred, in
    float64 on the CPU; and ``(L, H)``."""
    prompt, answer, *rest = example
    prompt, answer = prompt.reshape(1, -1), answer.reshape(1, -1).to(prompt.device)
    segments = rest[0].reshape(1, -1) if rest else None
    mask = torch.ones_like(prompt)
    kept, outcomes, token_segments = random_ablations(
        forward, prompt, mask, answer, segments, num_ablations, seed, max_batch_size
    )
    features = _segment_features(model, forward, prompt, answer, token_segments, kept.shape[-1])  # (L, H, S)
    design = kept[0].double().cpu() @ features.flatten(0, 1).T  # (A, L·H)
    outcome = outcomes[0].double().cpu()
    return design - design.mean(dim=0), outcome - outcome.mean(), (features.shape[0], features.shape[1])


def _segment_features(
    model: nn.Module, forward: Callable[..., Any], prompt: Tensor, answer: Tensor, segments: Tensor, count: int
) -> Tensor:
    """``(L, H, S)`` float64: each head's attention from the answer's rows (the positions
    that predict its tokens) to each segment's tokens, summed."""
    ids = torch.cat([prompt, answer], dim=1)
    length = prompt.shape[1]
    answer_rows = LogProbTarget(torch.arange(length - 1, ids.shape[1] - 1, device=ids.device)[None], answer)
    record = run_model(forward, model, ids, (torch.ones_like(ids),), compares_probabilities=False)
    record = record.at_query(answer_rows.query_weights(ids.shape[1]))
    per_head = record.head_rows()[0, :, :, :length].double().cpu()  # (L, H, N)
    token_segments = segments[0].cpu()
    summed = torch.zeros(*per_head.shape[:2], count, dtype=torch.float64)
    summed.index_add_(2, token_segments.clamp(min=0), per_head.masked_fill(token_segments < 0, 0.0))
    return summed


def _resume(checkpoint: str | Path | None, settings: dict[str, Any]) -> tuple[int, dict[str, Tensor] | None]:
    """How many examples a checkpoint has summed, and its sums; (0, None) without one."""
    if checkpoint is None or not Path(checkpoint).exists():
        return 0, None
    from safetensors import safe_open

    with safe_open(str(checkpoint), framework="pt") as saved:
        metadata = saved.metadata() or {}
        if json.loads(metadata.get("settings", "{}")) != settings:
            raise ValueError(
                f"The checkpoint {checkpoint} was written by a fit with settings {metadata.get('settings')}, not "
                f"{json.dumps(settings)}: give another checkpoint path, or the same settings to resume."
            )
        return int(metadata["done"]), {name: saved.get_tensor(name) for name in ("gram", "moment", "shape")}


def _save(checkpoint: Path, settings: dict[str, Any], done: int, sums: dict[str, Tensor]) -> None:
    """The running sums, with the settings and how many examples they hold."""
    _save_whole(checkpoint, sums, {"settings": json.dumps(settings), "done": str(done)})


def _save_whole(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """``tensors`` as safetensors at ``path``, written to a temporary file moved over it (an
    interruption leaves the previous file whole)."""
    from safetensors.torch import save_file

    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)
