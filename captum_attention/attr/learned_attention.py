"""Attention weighted per head by coefficients learned from ablations, as a Captum attribution."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import query_weights
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._registry import MethodSpec

if TYPE_CHECKING:
    from ..metrics.head_weights import Example

WEIGHTS_FILE = "head_weights.safetensors"
"""The file name :meth:`HeadWeights.save` gives a folder (a model's, say)."""


@dataclass
class HeadWeights:
    """One coefficient per attention layer and head, ``(L, H)`` float32, and the settings
    of the fit that gave them (:meth:`fit`), saved with them.

    Attributes:
        weights: ``(layers, heads)``, in the order of the model's attention calls.
        settings: how they were fitted (examples, ablations, seed, ridge, ...).
    """

    weights: Tensor
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def uniform(cls, layers: int, heads: int) -> "HeadWeights":
        """``1 / (L · H)`` each: the mean attention over every layer and head."""
        return cls(torch.full((layers, heads), 1.0 / (layers * heads)), {"fit": "uniform"})

    @classmethod
    def fit(cls, model: nn.Module, examples: Sequence["Example"], **options: Any) -> "HeadWeights":
        """Fit the coefficients to ContextCite's objective on ablations of ``examples``:
        :func:`~captum_attention.metrics.head_weights.fit_head_weights` (its options)."""
        from ..metrics.head_weights import fit_head_weights

        return fit_head_weights(model, examples, **options)

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (a folder gets :data:`WEIGHTS_FILE`) as safetensors, the settings
        in its metadata; returns the file's path."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.is_dir():
            path = path / WEIGHTS_FILE
        save_file({"weights": self.weights.float().contiguous().cpu()}, str(path), metadata={"settings": json.dumps(self.settings)})
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


class LearnedAttention(AttentionAttributionBase, Attribution):
    r"""Attention summed over every layer and head with a coefficient per head.

    The idea of Cohen-Wang, Chuang & Mądry, "Learning to Attribute with Attention" (AT2,
    2025), on any architecture the capture reads: token j scores

    .. math::

        r_j = \sum_{l,h} \theta_{lh} \sum_q w_q A^{lh}_{qj}

    over the explained query rows q (their weights :math:`w_q`; an answer's rows for a
    span), with :math:`\theta` a :class:`HeadWeights` fitted once per model to ablations of
    the user's own examples (:meth:`HeadWeights.fit`), or the mean over every layer and head
    without one. One forward, in both capture modes (streaming recomputes only the
    explained rows). Registered (``"learned_attention"``), not in the reports: its
    quality is its fit's.

    Args:
        $constructor_args
        weights (HeadWeights, optional): the coefficients, ``(layers, heads)`` of the
            model's attention calls. Default: None, uniform (:meth:`HeadWeights.uniform`).

    Example::

        >>> weights = HeadWeights.fit(model, examples)  # (prompt_ids, answer_ids) pairs
        >>> weights.save(model_dir)
        >>> explainer = LearnedAttention(model, weights=HeadWeights.load(model_dir))
        >>> scores = explainer.attribute_span(prompt_ids, answer_ids)
    """

    spec = MethodSpec("learned_attention", "Learned Attention", encoder_decoder=False, in_reports=False)

    def __init__(self, forward_func: Any, *args: Any, weights: HeadWeights | None = None, **kwargs: Any) -> None:
        super().__init__(forward_func, *args, **kwargs)
        self.weights = weights

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
    ) -> Scores:
        r"""Each token's learned-weight attention at the explained query row.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            return_maps (bool, optional): the method has no per-layer maps; True is an
                error. Default: False.

        $returns
        """
        if return_maps:
            raise ValueError("LearnedAttention gives one row of scores and no maps: leave return_maps=False.")
        return self._explain(inputs, None, additional_forward_args, query_index, False)

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        return self._weighted(head_rows(record)), []

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        return self._weighted(head_rows(record))

    def _weighted(self, rows: Tensor) -> Tensor:
        layers, heads = rows.shape[1:3]
        weights = self.weights.weights if self.weights is not None else HeadWeights.uniform(layers, heads).weights
        if tuple(weights.shape) != (layers, heads):
            raise ValueError(
                f"The head weights are {tuple(weights.shape)} (layers, heads) but the model's attention has "
                f"({layers}, {heads}): fit them on this model (HeadWeights.fit)."
            )
        return torch.einsum("blhk,lh->bk", rows, weights.to(rows.device, torch.float32))


def head_rows(record: ForwardRecord) -> Tensor:
    """``(B, L, H, K)`` float32: every layer's and head's attention at the record's
    explained query rows (a span's weighted sum of rows), from the maps (eager) or
    recomputed from each kernel call (streaming)."""
    if record.streaming:
        per_call = [call.rows_at(record.query_index.to(call.query.device)) for call in record.kernel_calls]
    else:
        weights = query_weights(record.query_index, record.target_real.shape[1])
        per_call = [torch.einsum("bq,bhqk->bhk", weights.to(maps.device), maps.float()) for maps in record.attn_maps]
    if len({tuple(rows.shape) for rows in per_call}) != 1:
        raise ValueError(
            "LearnedAttention weighs every attention call's heads, but this model's calls differ in shape "
            f"({sorted({tuple(rows.shape) for rows in per_call})})."
        )
    return torch.stack([rows.float().to(per_call[0].device) for rows in per_call], dim=1)
