"""Attention Flow as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal, overload

from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import attention_flow_scores
from ..maps.common import HEAD_FUSIONS
from ._base import AttentionAttributionBase, Inputs, Maps, Scores, attribute_method
from ._registry import LAYER, MethodSpec, one_of
from ..maps.rollout import rollout_stack_maps


class AttentionFlow(AttentionAttributionBase, Attribution):
    r"""Attention Flow: the maximum flow from each token to the query through the layers.

    Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020
    (https://arxiv.org/abs/2005.00928). With rollout's per-layer matrices

    .. math::

        \hat{A}^l = \mathrm{rownorm}\big(0.5 \cdot \mathrm{fuse}_m(A^{lm}) + 0.5 \cdot I\big)

    as capacities of a layered graph (node (l, i) is token i after layer l; the edge
    (l−1, j) → (l, i) has capacity :math:`\hat{A}^l_{ij}`), the score of token j is the
    value of the maximum flow from (0, j) to the explained position (L, q). Rollout
    multiplies the weights along every path; flow is bounded by each path's narrowest
    edge. A model read out by attention pooling (``pooling`` in
    :class:`~captum_attention.capture.ModuleAdapter`) sends the flow into a sink fed by
    the pooling row, and so does an output read from several rows (``query_index`` as
    row weights, a mean-pooled classifier's own): the sink is fed by (L, k) with row k's
    weight. A forward pass only: the scores do not depend on ``target``.

    Cost: one exact max-flow (``networkx``) per token and example over a graph of L·T²
    edges, on the CPU in Python. Measured on a 6-layer model: 0.18 s per example at
    16 tokens, 1.6 s at 32 and 15 s at 64 (2 CPU cores; rollout: 12-19 ms;
    ``benchmarks/flow_cost.py``); it is meant for short inputs and
    is registered (``"attention_flow"``) but left out of :data:`captum_attention.METHODS`
    (the command line's and benchmarks' set) by its spec's ``in_reports``. Eager capture only; one self-attention stack (not encoder-decoders).

    Args:
        $constructor_args

    Example::

        >>> scores = AttentionFlow(model).attribute(input_ids, additional_forward_args=(mask,))
    """

    spec = MethodSpec(
        "attention_flow", "Attention Flow", streams=False, encoder_decoder=False, spans=False, rolls_out=True, in_reports=False,
        options={"head_fusion": one_of(*HEAD_FUSIONS), "start_layer": LAYER},
    )

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        head_fusion: str = ...,
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
        start_layer: int = 0,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, Maps]:
        r"""Maximum flow from each token to the query row's position.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            head_fusion (str, optional): "mean", "max" or "min" over heads.
                Default: "mean".
            start_layer (int, optional): first layer of the graph (negative counts from
                the end). Default: 0, all layers.
            return_maps (bool, optional): also return the per-layer capacities Â^l.
                Default: False.

        $returns
        """
        return self._explain(
            inputs, target, additional_forward_args, query_index, return_maps, head_fusion=head_fusion, start_layer=start_layer
        )

    def _scores(self, record: ForwardRecord, head_fusion: str = "mean", start_layer: int = 0) -> tuple[Tensor, list[Tensor]]:
        first = record.call_index(start_layer, "start_layer")
        maps = rollout_stack_maps(record.attn_maps, record.pooling, record.target_real, record.query_index, head_fusion)
        token_maps, readout = record.readout(maps, first)
        if readout is None and record.query_index.dim() == 2:  # the rows the output reads, weighted
            readout = record.query_index
        return attention_flow_scores(token_maps, record.target_real, record.query_index, readout), maps
