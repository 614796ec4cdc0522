"""ALTI as a Captum attribution."""

from __future__ import annotations

from typing import Any

from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType
from ..capture import AttendedValues, LayerBlocks, Probe
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps import propagate_query_row
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import RowDescent, alti_matrices, alti_rollout
from ._registry import MethodSpec


class ALTI(RowDescent, AttentionAttributionBase, Attribution):
    r"""ALTI: Aggregation of Layer-wise Token-to-token Interactions.

    Ferrando, Gállego & Costa-jussà, "Measuring the Mixing of Contextual Information in the
    Transformer", EMNLP 2022 (https://arxiv.org/abs/2203.04212). Each layer's attention
    block, its residual and its norm included, is a sum over tokens,
    :math:`y_i = \sum_j T_i(x_j) + b_i` with
    :math:`T_i(x_j) = L_i\big(\sum_m \alpha^m_{ij} f^m(x_j) + \delta_{ij} x_j\big)`
    (:math:`f^m(x_j)`: token j's value through head m's slice of the output projection;
    :math:`L_i`: the norm after the residual as the linear map it is at token i, in a
    post-norm layer such as BERT's, the identity in a pre-norm layer such as Llama's; a
    norm on the attention output before the residual, Gemma-2's, maps the attention's
    terms alone, as the linear map it is at token i). Token j's share of token i is how
    close :math:`T_i(x_j)` lies to :math:`y_i` in the Manhattan distance, the layers
    rolled out without a residual term:

    .. math::

        C^l_{ij} = \frac{\max(0,\, \lVert y_i \rVert_1 - \lVert y_i - T_i(x_j) \rVert_1)}
                        {\sum_k \max(0,\, \lVert y_i \rVert_1 - \lVert y_i - T_i(x_k) \rVert_1)},
        \qquad r = e_q^\top C^L \cdots C^1 .

    Where each layer's output joins the residual is read from the model's own modules and
    checked against its states (attention beside the feed-forward, GPT-J's, leaves the
    input plus the attention output; a layer of another wiring, such as a scaled
    residual, is refused in one line). A forward pass that also keeps the states
    of each layer's modules (to read its norms) and :math:`O(H N^2 D)` per layer for the
    transformed vectors, in blocks of query rows. Streaming, the explained rows descend
    the layers from the top, each layer's matrix computed block by block and used at
    once: memory the forward's and one block's, the top layer only the explained rows'
    blocks. Eager capture keeps
    every layer's :math:`N^2` contributions per example, for ``return_maps`` and for an
    answer's rows to share. Both capture modes. Registered (``"alti"``), not yet in the
    reports.

    Args:
        $constructor_args

    Example::

        >>> scores = ALTI(model).attribute(input_ids, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec("alti", "ALTI", encoder_decoder=False, reads_weights=True, rolls_out=True, in_reports=False)

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, list[Tensor]]:
        r"""Each token's rolled-out ALTI contribution to the explained query row.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            return_maps (bool, optional): also return each layer's ``(B, N, N)`` matrix
                :math:`C^l` (eager capture). Default: False.

        $returns
        """
        return self._explain(inputs, target, additional_forward_args, query_index, return_maps)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        return [*super()._probes(effective, **options), AttendedValues(), LayerBlocks(states=True)]

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        mixing = alti_matrices(self.model, record)
        return propagate_query_row(mixing, record.query_index), mixing

    def _rollout(self, record: ForwardRecord, rows: Tensor) -> Tensor:
        return alti_rollout(self.model, record, "ALTI", rows)
