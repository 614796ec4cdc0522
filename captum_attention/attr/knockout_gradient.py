"""The first-order knockout effect of each token as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal

import torch
from captum.attr import GradientAttribution
from torch import Tensor

from .._compat import TargetType
from ..capture import ForwardRecord, GradMaps, OutputGrads, Probe
from ..capture.inputs import QueryIndex
from ..capture.probes import ZeroKeyBiases
from ..capture.record import KeyBiasGrads
from ..maps import knockout_head_sum
from ..maps.kernel import block_shape, live_rows
from ..maps.streaming import key_bias_column_sums, knockout_column_sums
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._registry import MethodSpec


class KnockoutGradient(AttentionAttributionBase, GradientAttribution):
    r"""The first-order effect on the explained score of knocking each token out of every
    attention call: attribution patching on the attention's keys.

    Syed, Rager & Conmy, "Attribution Patching Outperforms Automated Circuit Discovery",
    2023 (https://arxiv.org/abs/2310.10348); Kramár, Lieberum, Shah & Nanda, "AtP*: An
    efficient and scalable method for localizing LLM behaviour to components", 2024
    (https://arxiv.org/abs/2403.00745). Deleting token j's key from a call gates its
    softmax weight, :math:`A'_{ij} \propto A_{ij} g_j`; with :math:`G = dS/dA`, the slope
    of S in :math:`\log g_j` at :math:`g = 1`, summed over every layer l, head m and query
    row i, is

    .. math::

        r_j = \sum_l \sum_m \sum_i A^{lm}_{ij} \Big(G^{lm}_{ij} - \sum_{j'} A^{lm}_{ij'} G^{lm}_{ij'}\Big),

    a first-order estimate of :math:`S(x) - S(x \setminus j)`, the token's leave-one-out
    effect where its keys are masked out of every call (deletion itself, for a model whose
    positions do not move, as one without position encoding). Where one token holds nearly
    all of a row's attention, or the answer is near-certain, the slope is flat and the
    estimate far too small: :func:`~captum_attention.metrics.leave_one_out_estimates`
    deletes the few segments a prior ranks highest exactly and keeps this estimate for the
    rest. One forward and one ``torch.autograd.grad``, in both capture modes; the scores
    are in the units of the explained score. Registered (``"knockout_gradient"``), not in
    the reports.

    Args:
        $constructor_args

    Example::

        >>> scores = KnockoutGradient(model).attribute_span(input_ids, answer, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, prompt_len + answer_len): each token's estimated leave-one-out effect
    """

    spec = MethodSpec(
        "knockout_gradient", "Knockout Gradient", needs="backward", gradient_reduction=knockout_head_sum, encoder_decoder=False,
        signed=True, reads_query_row=False, in_reports=False,
    )

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: Literal[False] = False,
    ) -> Scores:
        r"""Each token's first-order knockout effect on the explained logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            $query_index
            return_maps (bool, optional): the method has no per-layer maps; True is an
                error. Default: False.

        $returns
        """
        self._refuse_maps(return_maps, "sums every call into one score per token")
        return self._explain(inputs, target, additional_forward_args, query_index, False)

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        scores = torch.zeros(record.target_real.shape, device=record.target_real.device, dtype=torch.float32)
        for head_sum, role in zip(record.result(GradMaps).maps, record.roles):
            real_queries, real_keys = record.real_of(role)
            column_sums = (head_sum * real_queries[:, :, None].to(head_sum.device)).sum(dim=1)
            scores[:, : column_sums.shape[1]] += column_sums.masked_fill(~real_keys.to(head_sum.device), 0.0).to(scores.device)
        return scores, []

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        return [*super()._probes(effective, **options), ZeroKeyBiases()]

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        scores = torch.zeros(record.target_real.shape, device=record.target_real.device, dtype=torch.float32)
        slopes = record.results.get(KeyBiasGrads)
        for index, (call, grad, role) in enumerate(zip(record.kernel_calls, record.result(OutputGrads).grads, record.roles)):
            real_queries, real_keys = record.real_of(role)
            bias_grad = None if slopes is None else slopes.grads[index]
            if bias_grad is None or bool((live_rows(grad) & ~real_queries.to(grad.device)).any()):
                # no bias on this call, or a row it summed that is no real query: the rows recomputed
                column_sums = knockout_column_sums(call, grad, real_queries, real_keys, block_shape(call, self.block_memory))
            else:
                column_sums = key_bias_column_sums(bias_grad, real_keys.to(bias_grad.device))
            scores[:, : column_sums.shape[1]] += column_sums.to(scores.device)
        return scores
