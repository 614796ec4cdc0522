"""Chefer et al.'s Transformer Attribution as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from captum.attr import GradientAttribution
from torch import Tensor

from ..maps import (
    encoder_decoder_relevance,
    relevance_head_mean,
    relevance_layer_maps,
    transformer_attribution_scores,
)
from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture import ForwardRecord, GradMaps, OutputGrads
from ..maps.kernel import KernelCall, block_shape
from ..maps.streaming import (
    query_row,
    relevance_columns_into,
    relevance_row_step,
    relevance_rows_into,
    without_self_times,
)
from ..maps.encoder_decoder import encoder_decoder_rows
from ._base import AttentionAttributionBase, Inputs, Maps, Scores, attribute_method
from ._registry import LAYER, MethodSpec


class TransformerAttribution(AttentionAttributionBase, GradientAttribution):
    r"""Transformer Attribution by gradient-weighted attention relevance propagation.

    Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting
    Bi-Modal and Encoder-Decoder Transformers", ICCV 2021
    (https://arxiv.org/abs/2103.15679), the rule for self-attention. With Aˡᵐ the
    attention of layer l and head m and Gˡᵐ = dS/dAˡᵐ:

    .. math::

        R = I; \quad \bar{A}^l = \mathrm{mean}_m\big((G^{lm} \odot A^{lm})^+\big); \quad
        R \leftarrow R + \bar{A}^l R \quad (l = 1..L)

    The scores are the query row of R (the query's own entry includes the identity's 1).
    A model read out by attention pooling (``pooling`` in
    :class:`~captum_attention.capture.ModuleAdapter`) starts from the pooling layer's
    :math:`\bar{A}` row instead, with no identity term: the pooled vector has no token of
    its own.

    Args:
        $constructor_args

    Example::

        >>> explainer = TransformerAttribution(model)
        >>> scores = explainer.attribute(input_ids, target=1,
        ...                              additional_forward_args=(attention_mask,))
    """

    spec = MethodSpec(
        "transformer_attribution", "Transformer Attribution", needs="backward", gradient_reduction=relevance_head_mean,
        rolls_out=True, options={"start_layer": LAYER},
    )

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        start_layer: int = ...,
        return_maps: Literal[False] = ...,
    ) -> Inputs: ...

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        start_layer: int = ...,
        *,
        return_maps: Literal[True],
    ) -> tuple[Inputs, Maps]: ...

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        start_layer: int = 0,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, Maps]:
        r"""Relevance of each token for the explained logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            $query_index
            start_layer (int, optional): first layer whose attention is propagated
                (negative counts from the end; one self-attention stack only). Default:
                0, all layers.
            return_maps (bool, optional): also return the per-layer Ā^l. Default: False.

        $returns
        """
        return self._explain(
            inputs, target, additional_forward_args, query_index, return_maps, start_layer=start_layer
        )

    def _scores(self, record: ForwardRecord, start_layer: int = 0) -> tuple[Tensor, list[Tensor]]:
        first = record.call_index(start_layer, "start_layer")
        grad_maps = record.result(GradMaps).maps
        maps = [relevance_layer_maps([head_mean], *record.real_of(role))[0] for head_mean, role in zip(grad_maps, record.roles)]
        token_maps, readout = record.readout(maps, first)
        return transformer_attribution_scores(token_maps, record.query_index, readout), maps

    def _streamed_scores(self, record: ForwardRecord, start_layer: int = 0) -> Scores:
        """The query row of R = (I + Ā^L)···(I + Ā^1), propagated from the last layer down;
        for an encoder-decoder see :meth:`_streamed_encoder_decoder`."""
        if record.is_encoder_decoder:
            if start_layer != 0:
                raise ValueError("start_layer applies to one self-attention stack; leave it at 0 for encoder-decoders.")
            return self._streamed_encoder_decoder(record)
        first = record.call_index(start_layer, "start_layer")
        row = query_row(record.query_index, record.target_real.shape[1])
        for call, grad in list(zip(record.kernel_calls, record.result(OutputGrads).grads))[first:][::-1]:
            row = relevance_row_step(call, grad, row, record.target_real, block_shape(call, self.block_memory))
        return row

    def _streamed_encoder_decoder(self, record: ForwardRecord) -> tuple[Tensor, Tensor]:
        r"""Row q of Chefer et al.'s R^qs and R^qq (rules (6)-(11)) without a matrix.

        Going down from the last layer, ``row`` is :math:`w = e_q^\top P`, P the decoder
        self-attention layers after the current one, so row q of R^qq is ``row`` at the
        end. A cross-attention layer c adds :math:`w^\top (\bar R^{qq}_c)^\top \bar A_c
        \bar R^{ss} = (\bar R^{qq}_c w)^\top \bar A_c \bar R^{ss}` to row q of R^qs, where
        :math:`\bar R^{qq}_c w` comes from (R^qq_c - I) w and (R^qq_c - I) 1 (the decoder
        layers before c applied to two column vectors). The sum y of those rows meets
        :math:`\bar R^{ss}` once: :math:`y^\top \bar R^{ss} = y + z^\top (R^{ss} - I)` with
        :math:`z_i = y_i / ((R^{ss} - I) 1)_i` (0 where a row has no relevance). Every
        R - I is accumulated as a residual (:meth:`_residual_times`), never as a
        difference of nearly equal numbers.
        """
        target_real, source_real = record.target_real, record.input_real
        calls = list(zip(record.kernel_calls, record.result(OutputGrads).grads, record.roles))
        encoder = [(call, grad) for call, grad, role in calls if role == "encoder"]
        decoder_side = [(call, grad, role) for call, grad, role in calls if role != "encoder"]
        row = query_row(record.query_index, target_real.shape[1])
        source_row = torch.zeros_like(source_real, dtype=row.dtype)
        for index in reversed(range(len(decoder_side))):
            call, grad, role = decoder_side[index]
            shape = block_shape(call, self.block_memory)
            if role != "cross":
                row = relevance_row_step(call, grad, row, target_real, shape)
                continue
            before = [(c, g) for c, g, r in decoder_side[:index] if r != "cross"]
            residuals = self._residual_times(before, torch.stack([row, torch.ones_like(row)], dim=-1), target_real)
            weights = without_self_times(row, residuals[..., 0], residuals[..., 1])
            source_row += relevance_rows_into(call, grad, weights, target_real, source_real, shape)
        source_sums = self._residual_times(encoder, torch.ones_like(source_row)[..., None], source_real)[..., 0]
        scaled = torch.where(source_sums > 0, source_row / source_sums.clamp(min=torch.finfo(source_sums.dtype).tiny), 0.0)
        through_encoder = torch.zeros_like(scaled)  # scaledᵀ(R^{ss} - I), accumulated later layers first
        for call, grad in encoder[::-1]:
            shape = block_shape(call, self.block_memory)
            through_encoder += relevance_rows_into(call, grad, scaled + through_encoder, source_real, source_real, shape)
        return source_row + through_encoder, row

    def _residual_times(self, layers: list[tuple[KernelCall, Tensor]], columns: Tensor, real: Tensor) -> Tensor:
        """``((I + Ā^k)···(I + Ā^1) - I)·columns`` over ``layers`` (earlier first), as the
        residual D·x itself: D·x += Ā·(x + D·x) per layer."""
        residual = torch.zeros_like(columns)
        for call, grad in layers:
            residual = residual + relevance_columns_into(call, grad, columns + residual, real, block_shape(call, self.block_memory))
        return residual

    def _encoder_decoder_scores(
        self, record: ForwardRecord, start_layer: int = 0
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """Chefer et al.'s rules (6)-(11) for self- and cross-attention; see
        :func:`captum_attention.maps.encoder_decoder_relevance`."""
        if start_layer != 0:
            raise ValueError("start_layer applies to one self-attention stack; leave it at 0 for encoder-decoders.")
        maps = [
            relevance_layer_maps([head_mean], *record.real_of(role))[0]
            for head_mean, role in zip(record.result(GradMaps).maps, record.roles)
        ]
        return encoder_decoder_rows(maps, record.roles, record.query_index, encoder_decoder_relevance)
