"""Norm-based attention as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from .._compat import TargetType
from ..capture import AttendedValues, LayerBlocks, Probe
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import query_weights, summed_weighted_norm, transformed_vectors
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import attention_rows, checked_call_values, checked_rows, layer_calls, layer_sum
from ._registry import FLAG, LAYER, MethodSpec


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
    the call (the adapter's ``output_projection``), in both capture modes.

    With ``residual=True``, the variant of Kobayashi, Kuribayashi, Yokoi & Inui,
    "Incorporating Residual and Normalization Layers into Analysis of Masked Language
    Models", EMNLP 2021 (https://arxiv.org/abs/2109.07152): the residual and the norm after
    it join the sum,

    .. math::

        r_j = \Big\lVert L_q\Big(\sum_m \alpha^{lm}_{qj} f^{lm}(x_j) + \delta_{qj} x_j\Big) \Big\rVert_2

    (AttnResLn-N; :math:`L_q` the norm's linear map at q, its bias left out, in a post-norm
    layer; AttnRes-N in a pre-norm layer, which has no norm there; a norm on the attention
    output before the residual, Gemma-2's, maps the attention's terms alone), read from
    the model's own modules as :class:`~captum_attention.ALTI` reads them (the forward
    keeps the states of the chosen layer's modules). Registered (``"norm_attention"``), not yet in the reports.

    Args:
        $constructor_args

    Example::

        >>> scores = NormAttention(model).attribute(input_ids, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec(
        "norm_attention", "Norm-based Attention", options={"layer": LAYER, "residual": FLAG}, encoder_decoder=False,
        reads_weights=True, in_reports=False,
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
        residual: bool = False,
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
            residual (bool, optional): add the residual and the norm after it
                (Kobayashi et al., 2021). Default: False.

        $returns
        """
        self._refuse_maps(return_maps, "gives one layer's scores")
        return self._explain(inputs, target, additional_forward_args, query_index, False, layer=layer, residual=residual)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        if options.get("residual"):  # the layer's sum is checked against its states
            return [*super()._probes(effective, **options), AttendedValues(), LayerBlocks(states=options.get("layer", -1))]
        return [*super()._probes(effective, **options), AttendedValues(projected_rows=checked_rows)]

    def _scores(self, record: ForwardRecord, layer: int = -1, residual: bool = False) -> tuple[Tensor, list[Tensor]]:
        if residual:
            return _residual_norms(self.model, record, layer), []
        attn = record.attn_maps[record.call_index(layer)]
        return _weighted_norms(record, layer, lambda position: attn[:, :, position]), []

    def _streamed_scores(self, record: ForwardRecord, layer: int = -1, residual: bool = False) -> Scores:
        if residual:
            return _residual_norms(self.model, record, layer)
        call = record.kernel_calls[record.call_index(layer)]
        batch = record.target_real.shape[0]
        return _weighted_norms(
            record, layer, lambda position: call.rows_at(torch.full((batch,), position, device=call.query.device))
        )


def _weighted_norms(record: ForwardRecord, layer: int, rows_at: Any) -> Tensor:
    """``(B, T)``: Σ over the explained query rows q (their weights w_q) of
    ``w_q · summed_weighted_norm`` at the chosen call; ``rows_at(q)`` gives ``(B, H, K)``."""
    chosen = record.call_index(layer)
    values, projection = checked_call_values(record, chosen, "NormAttention")
    weights = query_weights(record.query_index, record.target_real.shape[1])
    scores = torch.zeros(weights.shape, device=weights.device, dtype=torch.float32)
    for position in weights.ne(0).any(dim=0).nonzero().flatten().tolist():
        norms = summed_weighted_norm(rows_at(position), values, projection).to(weights.device)
        scores[:, : norms.shape[1]] += weights[:, position, None] * norms
    return scores


def _residual_norms(model: nn.Module, record: ForwardRecord, layer: int) -> Tensor:
    """``(B, T)``: Σ over the explained query rows q (their weights w_q) of
    ``w_q · ‖T_q(x_j)‖`` at the chosen call (the block with its residual and norm)."""
    chosen = record.call_index(layer)
    block = layer_calls(model, record, "NormAttention(residual=True)")[chosen]
    summed = layer_sum(record, chosen, block, "NormAttention")
    inputs = summed.residual.inputs.to(summed.vectors.device)
    weights = query_weights(record.query_index, record.target_real.shape[1])
    scores = torch.zeros(weights.shape, device=weights.device, dtype=torch.float32)
    for position in weights.ne(0).any(dim=0).nonzero().flatten().tolist():
        rows = slice(position, position + 1)
        probs = attention_rows(record, chosen, rows).to(inputs.device)
        vectors = transformed_vectors(probs, summed.vectors, inputs, rows, summed.residual.norm, summed.residual.attention_norm)
        scores += weights[:, position, None] * vectors[:, 0].norm(dim=-1).to(weights.device)
    return scores
