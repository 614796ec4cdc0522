"""ALTI-Logit as a Captum attribution."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType, UnsupportedModelError
from ..capture import AttendedValues, LayerBlocks, LogProbTarget, Probe
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..capture.residual import FinalReadout, FinalStates
from ..maps import LinearNorm, logit_direction, logit_rollout
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import (
    LayerSum,
    LogitReads,
    alti_matrices,
    alti_rollout,
    attention_row_at,
    call_head_vectors,
    layer_joins,
    logit_reads,
)
from ._registry import MethodSpec

Shares = Callable[[int, Tensor, LinearNorm | None], Tensor]
"""A layer's logit shares from its call, head vectors and norm on the attention output."""


class ALTILogit(AttentionAttributionBase, Attribution):
    r"""ALTI-Logit: each context token's share of a language model's next-token logit.

    Ferrando, Gállego, Tsiamas & Costa-jussà, "Explaining How Transformers Use Context to
    Build Predictions", ACL 2023 (https://arxiv.org/abs/2305.12535). In a pre-norm model
    the final residual stream at the query q is the input plus what every layer adds, so
    the logit of token w is a sum of their shares through the unembedding :math:`U_w` and
    the final norm's linear map at q (:math:`u_q = P(\gamma \odot U_w)\, s_q`). Layer l's
    attention adds, through token j, :math:`\Delta^l_j = \sum_m \alpha^{lm}_{qj}\,
    f^{lm}(x_j) \cdot u_q`; its input :math:`x_j` is itself a mixture of the input tokens,
    which :class:`ALTI`'s rollout of the layers below gives:

    .. math::

        r = \sum_l \Delta^l \, C^{l-1} \cdots C^1 .

    A layer that multiplies its output by a number :math:`s^l` (Gemma-4's
    ``layer_scalar``) multiplies all that reaches it: :math:`\Delta^l` is taken times
    :math:`s^l s^{l+1} \cdots`.

    Scores are in logit units and signed (a token can argue against w); the feed-forward
    layers' and the biases' shares are not among them. ``target`` names w (default: the
    predicted token); an answer's span sums its tokens' logits (the logits, not their
    log-probabilities: the softmax's normaliser is not a sum over tokens). Refused in one
    line for a model that is not pre-norm, whose head does not read the last layer
    through a norm, or whose logits are capped or scaled. Cost: :class:`ALTI`'s. Both
    capture modes. Registered (``"alti_logit"``), not yet in the reports.

    Args:
        $constructor_args

    Example::

        >>> scores = ALTILogit(model).attribute(input_ids, target=token_id, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec(
        "alti_logit", "ALTI-Logit", encoder_decoder=False, classifiers=False, signed=True, reads_target=True, rolls_out=True,
        in_reports=False,
    )

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, list[Tensor]]:
        r"""Each token's share of the target token's logit at the explained query.

        Args:
            $inputs
            $target
            $additional_forward_args
            $query_index
            return_maps (bool, optional): also return each layer's ``(B, N, N)`` ALTI
                matrix (eager capture). Default: False.

        $returns
        """
        return self._explain(inputs, target, additional_forward_args, query_index, return_maps)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        return [*super()._probes(effective, **options), AttendedValues(), LayerBlocks(states=True), FinalReadout()]

    def _explained(self, record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool = False) -> ForwardRecord:
        if record.logits.dim() != 3:
            raise UnsupportedModelError(
                f"ALTI-Logit explains a language model's next-token logit; {type(self.model).__name__} returns "
                f"{tuple(record.logits.shape)} logits, not (batch, seq_len, vocab)."
            )
        return super()._explained(record, target, retain_graph).with_result(logit_reads(record, target))

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        mixing = alti_matrices(self.model, record, "ALTI-Logit")
        joins = layer_joins(record)
        if any(join.norm is not None for join in joins):
            raise self._post_norm()
        shares = self._logit_shares(record)
        reach = torch.tensor([join.scale for join in joins], dtype=torch.float64).flip(0).cumprod(0).flip(0).tolist()
        added = [shares(call, call_head_vectors(record, call, "ALTI-Logit"), join.attention_norm).sum(dim=1) * reach[call]
                 for call, join in enumerate(joins)]
        return logit_rollout(added, mixing), mixing

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        shares = self._logit_shares(record)
        summed: Shares = lambda call, vectors, norm: shares(call, vectors, norm).sum(dim=1, keepdim=True)
        return self._descent(record, summed, 1)[:, 0].float()

    def _streamed_rows(self, record: ForwardRecord, positions: Tensor, tokens: Tensor) -> Tensor:
        """The logit rows of ``tokens`` at ``positions`` ``(B, T)`` of a decoder in one
        descent (a causal row never reaches a later token)."""
        explained = self._explained(record, LogProbTarget(positions, tokens))
        return self._descent(explained, self._logit_shares(explained), positions.shape[1]).float()

    def _descent(self, record: ForwardRecord, shares: Shares, rows: int) -> Tensor:
        """``(B, rows, N)``: :func:`alti_rollout` from no share, each layer adding ``shares``
        times the numbers it and the layers above multiply their outputs by (the rollout
        descends from the top)."""
        reach = 1.0

        def added(call: int, layer: LayerSum) -> Tensor:
            nonlocal reach
            if layer.residual.norm is not None:
                raise self._post_norm()
            reach *= layer.residual.scale
            return shares(call, layer.vectors, layer.residual.attention_norm) * reach

        start = torch.zeros(*record.target_real.shape[:1], rows, record.target_real.shape[1], dtype=torch.float64)
        return alti_rollout(self.model, record, "ALTI-Logit", start, added)

    def _logit_shares(self, record: ForwardRecord) -> Shares:
        r"""``shares(call, vectors, attention_norm)``: the layer's :math:`\Delta^l` ``(B, K,
        N)`` of each explained logit (the K positions and tokens :class:`LogitReads` names)
        from its :func:`~captum_attention.maps.head_vectors`, through its norm on the
        attention output where it has one; the unembedding read and the logits checked at
        the first call."""
        reads = record.result(LogitReads)

        @functools.cache
        def readout() -> tuple[Tensor, LinearNorm | None]:
            final = record.result(FinalStates)
            weight, _, final_norm = final.unembedding(record.forward_real)
            final.check_logits(record.logits, reads.positions, reads.tokens)
            return weight, final_norm

        def shares(call: int, vectors: Tensor, norm: LinearNorm | None) -> Tensor:
            weight, final_norm = readout()
            vectors = vectors if norm is None else norm.features(vectors)
            per_read = []
            for position, token in zip(reads.positions.t(), reads.tokens.t()):
                direction = logit_direction(weight[token.to(weight.device)], final_norm, position.to(weight.device))
                rows = attention_row_at(record, call, position).to(vectors.device)
                if norm is not None:  # the norm's scale at the query row
                    rows = rows * norm.scale.to(rows.device).gather(1, position.to(rows.device)[:, None])[:, :, None]
                per_read.append(torch.einsum("bhn,bhnd,bd->bn", rows, vectors, direction.to(vectors.device)))
            return torch.stack(per_read, dim=1)

        return shares

    def _post_norm(self) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"ALTI-Logit adds up what each layer adds to the final residual stream, which the post-norm layers of "
            f"{type(self.model).__name__} rescale: use ALTI."
        )
