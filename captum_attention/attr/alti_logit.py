"""ALTI-Logit as a Captum attribution."""

from __future__ import annotations

from typing import Any

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType, UnsupportedModelError
from ..capture import AttendedValues, LayerBlocks, LogProbTarget, Probe
from ..capture.inputs import QueryIndex, resolve_targets
from ..capture.record import ForwardRecord
from ..capture.residual import FinalReadout, FinalStates
from ..maps import last_query, logit_direction, logit_rollout
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import LogitReads, logit_reads, all_pre_norm, alti_matrices, attention_row_at, call_head_vectors
from ._registry import MethodSpec


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

    spec = MethodSpec("alti_logit", "ALTI-Logit", encoder_decoder=False, in_reports=False)

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
        return [*super()._probes(effective, **options), AttendedValues(), LayerBlocks(), FinalReadout()]

    def _explained(self, record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool = False) -> ForwardRecord:
        if record.logits.dim() != 3:
            raise UnsupportedModelError(
                f"ALTI-Logit explains a language model's next-token logit; {type(self.model).__name__} returns "
                f"{tuple(record.logits.shape)} logits, not (batch, seq_len, vocab)."
            )
        return super()._explained(record, target, retain_graph).with_result(logit_reads(record, target))

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        mixing = alti_matrices(self.model, record, "ALTI-Logit")
        if not all_pre_norm(record):
            raise UnsupportedModelError(
                f"ALTI-Logit adds up what each layer adds to the final residual stream, which the post-norm layers of "
                f"{type(self.model).__name__} rescale: use ALTI."
            )
        final = record.result(FinalStates)
        weight, _, final_norm = final.unembedding(record.forward_real)
        reads = record.result(LogitReads)
        final.check_logits(record.logits, reads.positions, reads.tokens)
        shares = []
        for call in range(record.num_calls):
            vectors = call_head_vectors(record, call, "ALTI-Logit")
            share = torch.zeros(vectors.shape[0], vectors.shape[2], device=vectors.device)
            for position, token in zip(reads.positions.t(), reads.tokens.t()):
                direction = logit_direction(weight[token.to(weight.device)], final_norm, position.to(weight.device))
                rows = attention_row_at(record, call, position).to(vectors.device)
                share += torch.einsum("bhn,bhnd,bd->bn", rows, vectors, direction.to(vectors.device))
            shares.append(share)
        return logit_rollout(shares, mixing), mixing

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        return self._scores(record)[0]
