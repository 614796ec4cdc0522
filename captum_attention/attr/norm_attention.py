"""Norm-based attention as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType, UnsupportedModelError
from ..capture import AttendedValues, Probe, RecordedValues
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import query_weights, summed_weighted_norm
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._registry import LAYER, MethodSpec


class NormAttention(AttentionAttributionBase, Attribution):
    r"""Norm-based attention: attention weighed by the norm of what it moves.

    Kobayashi, Kuribayashi, Yokoi & Inui, "Attention is Not Only a Weight: Analyzing
    Transformers with Vector Norms", EMNLP 2020 (https://arxiv.org/abs/2004.10102). Head
    m of layer l adds :math:`\alpha^{lm}_{qj} f^{lm}(x_j)` to the query q, with
    :math:`f^{lm}(x_j) = (x_j W_V^{m} + b_V^{m}) W_O^{m\top}` token j's value through the
    head's slice of the output projection; the score of token j is the norm of their sum
    over heads,

    .. math::

        r_j = \Big\lVert \sum_m \alpha^{lm}_{qj} \, f^{lm}(x_j) \Big\rVert_2

    for the chosen layer l (the last by default) and the explained query row q (for a
    span of rows, the weighted sum of each row's norms). Where raw attention gives a token
    with a small value vector as much as any other, this gives it what it actually adds
    to the query. A forward pass only; the values and the output projection are read from
    the call (the adapter's ``output_projection``), in both capture modes. Registered
    (``"norm_attention"``), not yet in the reports.

    Args:
        $constructor_args

    Example::

        >>> scores = NormAttention(model).attribute(input_ids, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec(
        "norm_attention", "Norm-based Attention", options={"layer": LAYER}, encoder_decoder=False, in_reports=False
    )

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: Literal[False] = False,
        layer: int = -1,
    ) -> Scores:
        r"""The norm of each token's attention-weighted, transformed value at the query.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            return_maps (bool, optional): the method has no per-layer maps; True is an
                error. Default: False.
            layer (int, optional): which attention layer (negative counts from the end).
                Default: -1, the last.

        $returns
        """
        if return_maps:
            raise ValueError("NormAttention gives one layer's scores and no maps: leave return_maps=False.")
        return self._explain(inputs, None, additional_forward_args, query_index, False, layer=layer)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        return [*super()._probes(effective, **options), AttendedValues()]

    def _scores(self, record: ForwardRecord, layer: int = -1) -> tuple[Tensor, list[Tensor]]:
        attn = record.attn_maps[record.call_index(layer)]
        return _weighted_norms(record, layer, lambda position: attn[:, :, position]), []

    def _streamed_scores(self, record: ForwardRecord, layer: int = -1) -> Scores:
        call = record.kernel_calls[record.call_index(layer)]
        batch = record.target_real.shape[0]
        return _weighted_norms(
            record, layer, lambda position: call.rows_at(torch.full((batch,), position, device=call.query.device))
        )


def _weighted_norms(record: ForwardRecord, layer: int, rows_at: Any) -> Tensor:
    """``(B, T)``: Σ over the explained query rows q (their weights w_q) of
    ``w_q · summed_weighted_norm`` at the chosen call; ``rows_at(q)`` gives ``(B, H, K)``."""
    chosen = record.call_index(layer)
    recorded = record.result(RecordedValues)
    projection = recorded.projections[chosen]
    if projection is None:
        raise UnsupportedModelError(
            f"NormAttention needs the output projection of {type(record.capture.modules[chosen]).__name__}, "
            "which its adapter does not name (output_projection)."
        )
    values = recorded.per_head(chosen)
    weights = query_weights(record.query_index, record.target_real.shape[1])
    scores = torch.zeros(weights.shape, device=weights.device)
    for position in weights.ne(0).any(dim=0).nonzero().flatten().tolist():
        norms = summed_weighted_norm(rows_at(position), values, projection).to(weights.device)
        scores[:, : norms.shape[1]] += weights[:, position, None] * norms
    return scores
