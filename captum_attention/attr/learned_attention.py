"""Attention weighted per head by coefficients learned from ablations, as a Captum attribution."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..capture.identity import check_fitted_model
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._registry import MethodSpec


@runtime_checkable
class PerHeadWeights(Protocol):
    """What holds the coefficients: a ``weights`` tensor ``(layers, heads)``
    (:class:`~captum_attention.HeadWeights`)."""

    weights: Tensor


class LearnedAttention(AttentionAttributionBase, Attribution):
    r"""Attention summed over every layer and head with a coefficient per head.

    The idea of Cohen-Wang, Chuang & Mądry, "Learning to Attribute with Attention" (AT2,
    2025), on any architecture the capture reads: token j scores

    .. math::

        r_j = \sum_{l,h} \theta_{lh} \sum_q w_q A^{lh}_{qj}

    over the explained query rows q (their weights :math:`w_q`; an answer's rows for a
    span), with :math:`\theta` a :class:`~captum_attention.HeadWeights` fitted once per model
    to ablations of the user's own examples (``HeadWeights.fit``), or the mean over every
    layer and head without one. One forward, in both capture modes (streaming recomputes only the
    explained rows). Registered (``"learned_attention"``), not in the reports: its
    quality is its fit's.

    Args:
        $constructor_args
        weights (HeadWeights or Tensor, optional): the coefficients, ``(layers, heads)``
            of the model's attention calls; a fit recorded for other weights of the
            model in the same dtype (trained again since) is refused. Default: None,
            uniform: ``1 / (L · H)`` each.

    Example::

        >>> weights = HeadWeights.fit(model, examples)  # (prompt_ids, answer_ids) pairs
        >>> weights.save(model_dir)
        >>> explainer = LearnedAttention(model, weights=HeadWeights.load(model_dir))
        >>> scores = explainer.attribute_span(prompt_ids, answer_ids)
    """

    spec = MethodSpec("learned_attention", "Learned Attention", encoder_decoder=False, in_reports=False)

    def __init__(self, forward_func: Any, *args: Any, weights: PerHeadWeights | Tensor | None = None, **kwargs: Any) -> None:
        if args and isinstance(args[0], (PerHeadWeights, Tensor)):  # the second positional argument is Captum's model
            raise TypeError(
                f"LearnedAttention's second argument is the model, as in every Captum attribution, and it got "
                f"{type(args[0]).__name__}: give the head weights by name, LearnedAttention(model, weights=...)."
            )
        super().__init__(forward_func, *args, **kwargs)
        recorded = getattr(weights, "settings", {}).get("model")
        refit = "fit them on this model (HeadWeights.fit, or captum-attention fit-head-weights ANSWERS --model DIR)"
        check_fitted_model(recorded, self.model, "These head weights", refit)
        self.weights = weights
        coefficients = self._coefficients()
        if coefficients is not None and not bool(torch.isfinite(coefficients).all()):
            raise ValueError(f"The head weights hold NaN or ±inf, which would make every score so: {refit}.")

    @property
    def signed(self) -> bool:
        """Whether a coefficient is negative: a fit's scores then take both signs."""
        weights = self._coefficients()
        return weights is not None and bool((weights < 0).any())

    def _coefficients(self) -> Tensor | None:
        return self.weights.weights if isinstance(self.weights, PerHeadWeights) else self.weights

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
        self._refuse_maps(return_maps, "gives one row of scores")
        return self._explain(inputs, target, additional_forward_args, query_index, False)

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        return self._weighted(record.head_rows()), []  # from the maps or the kernel calls, as the record holds them

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        return self._scores(record)[0]

    def _weighted(self, rows: Tensor) -> Tensor:
        layers, heads = rows.shape[1:3]
        weights = self._coefficients()
        if weights is None:
            weights = torch.full((layers, heads), 1.0 / (layers * heads), dtype=torch.float32)
        if tuple(weights.shape) != (layers, heads):
            raise ValueError(
                f"The head weights are {tuple(weights.shape)} (layers, heads) but the model's attention has "
                f"({layers}, {heads}): fit them on this model (HeadWeights.fit)."
            )
        return torch.einsum("blhk,lh->bk", rows, weights.to(rows.device, torch.float32))

