"""Attention Rollout as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import encoder_decoder_rollout, raw_attention_maps, rollout_layer_maps, rollout_scores
from ..maps.common import HEAD_FUSIONS
from ..maps.encoder_decoder import encoder_decoder_rows
from ..maps.kernel import block_shape
from ..maps.rollout import rollout_stack_maps
from ..maps.streaming import cross_rollout_row_step, query_row, rollout_row_step
from ._base import AttentionAttributionBase, Inputs, Maps, Scores, attribute_method
from ._registry import FRACTION, LAYER, MethodSpec, one_of


class AttentionRollout(AttentionAttributionBase, Attribution):
    r"""Attention Rollout: attention propagated through the layers with the residual.

    Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020
    (https://arxiv.org/abs/2005.00928). Per layer,

    .. math::

        \hat{A}^l = \mathrm{rownorm}\big(0.5 \cdot \mathrm{fuse}_m(A^{lm}) + 0.5 \cdot I\big),
        \qquad R = \hat{A}^L \cdots \hat{A}^2 \hat{A}^1

    and the scores are the query row of R (they sum to 1). A model read out by attention
    pooling (``pooling`` in :class:`~captum_attention.capture.ModuleAdapter`) starts from
    its fused attention row instead of the query's: scores ``= fuse_m(A^pool) R``,
    with no residual term, since the pooled vector has no token of its own. ``fuse`` is the head mean (the
    paper), max or min; ``discard_ratio`` zeroes the lowest fraction of each fused map
    first (jacobgil/vit-explain), never the query's own entry. A forward pass only, no
    gradient: the scores do not depend on ``target``.

    Args:
        $constructor_args

    Example::

        >>> explainer = AttentionRollout(model)
        >>> scores = explainer.attribute(input_ids, additional_forward_args=(mask,),
        ...                              head_fusion="max", discard_ratio=0.9)
    """

    spec = MethodSpec(
        "rollout", "Attention Rollout", rolls_out=True,
        options={"head_fusion": one_of(*HEAD_FUSIONS), "discard_ratio": FRACTION, "start_layer": LAYER},
        eager_options={"discard_ratio": "discard_ratio ranks every entry of each fused map"},
    )

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        head_fusion: str = ...,
        discard_ratio: float = ...,
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
        head_fusion: str = ...,
        discard_ratio: float = ...,
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
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        start_layer: int = 0,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, Maps]:
        r"""Rolled-out attention of the query row.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            head_fusion (str, optional): "mean", "max" or "min" over heads.
                Default: "mean".
            discard_ratio (float, optional): fraction in [0, 1) of each fused map's
                lowest entries to zero (one self-attention stack only). Default: 0.0.
            start_layer (int, optional): first layer rolled out (negative counts from
                the end; one self-attention stack only). Default: 0, all layers.
            return_maps (bool, optional): also return the per-layer Â^l (for an
                encoder-decoder's cross-attention: the fused A^qs). Default: False.

        $returns
        """
        return self._explain(
            inputs, target, additional_forward_args, query_index, return_maps,
            head_fusion=head_fusion, discard_ratio=discard_ratio, start_layer=start_layer,
        )

    def _scores(
        self, record: ForwardRecord, head_fusion: str = "mean", discard_ratio: float = 0.0, start_layer: int = 0
    ) -> tuple[Tensor, list[Tensor]]:
        first = record.call_index(start_layer, "start_layer")
        maps = rollout_stack_maps(record.attn_maps, record.pooling, record.target_real, record.query_index, head_fusion, discard_ratio)
        token_maps, readout = record.readout(maps, first)
        return rollout_scores(token_maps, record.query_index, readout), maps

    def _streamed_scores(
        self, record: ForwardRecord, head_fusion: str = "mean", discard_ratio: float = 0.0, start_layer: int = 0
    ) -> Scores:
        """The query row of R propagated from the last layer down; for an encoder-decoder
        over the joint source-target graph (the source part ``source_row``)."""
        if record.is_encoder_decoder and start_layer:
            raise ValueError("start_layer applies to one self-attention stack; leave it at 0 for encoder-decoders.")
        first = record.call_index(start_layer, "start_layer")
        row = query_row(record.query_index, record.target_real.shape[1])
        source_row = torch.zeros_like(record.input_real, dtype=row.dtype)
        for call, role in list(zip(record.kernel_calls, record.roles))[first:][::-1]:
            shape = block_shape(call, self.block_memory)
            if role == "cross":
                source_row, row = cross_rollout_row_step(call, source_row, row, *record.real_of(role), head_fusion, shape)
            elif role == "encoder":
                source_row = rollout_row_step(call, source_row, record.input_real, head_fusion, shape)
            else:
                row = rollout_row_step(call, row, record.target_real, head_fusion, shape)
        return (source_row, row) if record.is_encoder_decoder else row

    def _streamed_rows(
        self, record: ForwardRecord, positions: Tensor, tokens: Tensor, head_fusion: str = "mean", discard_ratio: float = 0.0,
        start_layer: int = 0,
    ) -> Tensor | None:
        """The query rows of R at ``positions`` ``(B, T)`` of a decoder, ``(B, T, N)``, from
        one recomputation of each block for all T rows (a causal row never reaches a later
        token, so each equals its own prefix's row; rollout reads no target ``tokens``)."""
        if record.is_encoder_decoder:
            return None
        first = record.call_index(start_layer, "start_layer")
        num_tokens = record.target_real.shape[1]
        row = torch.stack([query_row(positions[:, k], num_tokens) for k in range(positions.shape[1])], dim=1)
        for call in record.kernel_calls[first:][::-1]:
            row = rollout_row_step(call, row, record.target_real, head_fusion, block_shape(call, self.block_memory))
        return row

    def _encoder_decoder_scores(
        self, record: ForwardRecord, head_fusion: str = "mean", discard_ratio: float = 0.0, start_layer: int = 0
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """Rollout over the joint source-target graph; see
        :func:`captum_attention.maps.encoder_decoder_rollout`."""
        if discard_ratio or start_layer:
            raise ValueError(
                "discard_ratio and start_layer apply to one self-attention stack; leave them "
                "at 0 for encoder-decoders."
            )
        maps = []
        for attn, role in zip(record.attn_maps, record.roles):
            real_queries, real_keys = record.real_of(role)
            if role == "cross":
                maps += raw_attention_maps([attn], real_queries, real_keys, head_fusion)
            else:  # the query index only matters to discard_ratio, refused above
                maps += rollout_layer_maps([attn], real_queries, record.query_index, head_fusion)
        return encoder_decoder_rows(maps, record.roles, record.query_index, encoder_decoder_rollout)
