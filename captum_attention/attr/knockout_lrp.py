"""First-order knockout effects, with AttnLRP's relevance at the decisive tokens, as a Captum attribution."""

from __future__ import annotations

from typing import Any, Callable, Literal

from torch import Tensor, nn

from .._compat import TargetType
from ..capture import AttentionAdapter, ForwardRecord, Probe
from ..capture.inputs import LogProbTarget, QueryIndex
from ..capture.lrp import RelevanceRules
from ..capture.runner import CaptureMode
from ..maps import knockout_head_sum, lrp, with_decisive_tokens
from ._base import Scores, attribute_method, relevance_scores, with_relevance
from ._registry import MethodSpec
from .knockout_gradient import KnockoutGradient


class KnockoutLRP(KnockoutGradient):
    r"""Each token's first-order knockout effect (:class:`KnockoutGradient`), except at
    the tokens AttnLRP ranks highest, which take AttnLRP's relevance: an estimate of every
    token's leave-one-out effect without deleting any.

    The knockout slope :math:`r_j` (attribution patching on the keys: Syed, Rager &
    Conmy, 2023, https://arxiv.org/abs/2310.10348) estimates :math:`S(x) - S(x \setminus
    j)` well where deleting token j changes S a little, and far too small where j decides
    the answer: one key then holds nearly all of a row's attention, or the answer is
    near-certain, and the slope at the full context is flat. AttnLRP's relevance
    :math:`R_j` (Achtibat et al., ICML 2024, https://arxiv.org/abs/2402.05602), in the
    same units, does not flatten there and ranks the decisive token first. With :math:`D`
    the ``decisive`` tokens of largest :math:`|R_j|` in each explained row,

    .. math::

        s_j = \begin{cases} R_j & j \in D \\ r_j & \text{otherwise,} \end{cases}

    so that a linear surrogate :math:`\sum_{j \in \text{kept}} s_j` sets the contexts
    without the decisive token apart and ranks the rest by their small effects, as
    deleting does. Where the relevance's top token does not decide the answer, the
    surrogate still sets it apart: :func:`~captum_attention.metrics.leave_one_out_estimates`
    deletes it exactly instead, at one forward more. One forward, under AttnLRP's rules,
    and two backwards on its graph: the relevance's, then, the rules switched off
    (:class:`~captum_attention.maps.lrp.RuleSwitch`), the ordinary gradient's for the
    slope; in both capture modes; signed, in the units of the explained score. Registered
    (``"knockout_lrp"``), not in the reports.

    Args:
        $constructor_args
        decisive (int, optional): how many tokens of each explained row, those AttnLRP
            ranks highest by magnitude, take its relevance. Default: 1.

    Example::

        >>> explainer = KnockoutLRP(model)
        >>> scores = explainer.attribute_span(input_ids, answer, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, prompt_len + answer_len): each token's estimated leave-one-out effect
    """

    spec = MethodSpec(
        "knockout_lrp", "Knockout Gradient + AttnLRP", needs="backward", gradient_reduction=knockout_head_sum,
        encoder_decoder=False, signed=True, reads_query_row=False, in_reports=False,
    )

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
        capture: CaptureMode = "auto",
        block_memory: int | None = None,
        decisive: int = 1,
    ) -> None:
        if isinstance(decisive, bool) or not isinstance(decisive, int) or decisive < 1:
            raise ValueError(f"decisive must be a number of tokens, 1 or more, got {decisive!r}.")
        super().__init__(forward_func, model, adapter, capture, block_memory)
        self.decisive = decisive

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: Literal[False] = False,
    ) -> Scores:
        r"""Each token's estimated leave-one-out effect on the explained logit.

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

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        rules = RelevanceRules(lrp.AttnLRPRules(switch=lrp.RuleSwitch()))
        return [*super()._probes(effective, **options), rules]

    def _explained(self, record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool = False) -> ForwardRecord:
        rules = next(probe.rules for probe in record.capture.probes if isinstance(probe, RelevanceRules))
        assert isinstance(rules, lrp.AttnLRPRules) and rules.switch is not None  # the rules of _probes
        rules.switch.rules = True
        record = with_relevance(record, target, retain_graph=True)
        rules.switch.rules = False
        return super()._explained(record, target, retain_graph)

    def _method_scores(self, record: ForwardRecord, **options: Any) -> tuple[Scores, Any]:
        first_order, maps = super()._method_scores(record, **options)
        relevance = relevance_scores(record)
        assert isinstance(first_order, Tensor) and isinstance(relevance, Tensor)  # one stack's tokens, no pixels
        return with_decisive_tokens(first_order, relevance, self.decisive), maps
