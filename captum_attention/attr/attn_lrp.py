"""AttnLRP as a Captum attribution."""

from __future__ import annotations

from typing import Any, Callable, Literal

from captum.attr import GradientAttribution
from torch import Tensor, nn

from .._compat import TargetType
from ..capture import AttentionAdapter
from ..capture.inputs import QueryIndex
from ..capture.probes import KeyPresence, Probe
from ..capture.runner import CaptureMode
from ..maps import lrp
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._registry import FLAG, MethodSpec, Option

PIXEL_BASELINES = Option(
    lambda value: isinstance(value, (int, float, Tensor)) and not isinstance(value, bool),
    "a number or a tensor broadcastable to pixel_values", TypeError,
)
"""AttnLRP's reference image through a vision tower."""

PRESENCE = Option(lambda value: value is None or isinstance(value, Tensor), "None or a (batch, tokens) tensor", TypeError)
"""Each token's presence in the attention (:class:`~captum_attention.capture.probes.KeyPresence`)."""


class AttnLRP(AttentionAttributionBase, GradientAttribution):
    r"""AttnLRP: attention-aware layer-wise relevance propagation.

    Achtibat, Hatefi, Dreyer, Jain, Wiegand, Lapuschkin & Samek, "AttnLRP:
    Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML 2024
    (https://arxiv.org/abs/2402.05602).

    The explained logit S is propagated back to the input embeddings :math:`e_t` by the
    paper's rules, written as modified gradients :math:`\tilde g` (each rule with its
    equation in :mod:`captum_attention.maps.lrp`): the ordinary gradient through linear
    layers (ε-rule, ε → 0; or the γ-rule, ``gamma``) and through the softmax
    (Proposition 3.1); half of it to each
    factor of :math:`Q K^\top`, :math:`A V` and of a product of two activations (uniform
    rule); :math:`\tilde g_x = \tilde g_y \odot y / x` through element-wise activations
    (identity rule); the normalisation scale held constant in LayerNorm and RMSNorm. The
    relevance of token t is

    .. math::

        R_t = \sum_d e_{td} \, \tilde g_{td}, \qquad \tilde g = \tilde\nabla_e S,

    signed, and :math:`\sum_t R_t = S` up to what biases (linear layers, norms, position
    embeddings, masks) and the softmax absorb. The rules act only during the call,
    through the capture layer (the attention kernel's inputs and output, forward hooks on
    the activation and norm modules, a thread-local ``TorchFunctionMode``); in streaming
    mode the model's own kernel runs, so the cost is one forward and one backward,
    batched, at the kernel's memory. The input embeddings are read from
    ``get_input_embeddings()`` (a vision transformer's patch embedding, so image scores
    are per patch), or are the inputs themselves when embeddings are given (e.g. under
    ``NoiseTunnel``).

    Args:
        $constructor_args
        gamma (float, optional): 0: the ε-rule (ε → 0) in every linear layer; γ > 0: the
            generalised γ-rule there (as zennit's ``Gamma``), which the paper uses for
            vision transformers (a value to tune, e.g. 0.25). Default: 0.

    Example::

        >>> model = BertForSequenceClassification(config).eval()
        >>> explainer = AttnLRP(model)
        >>> relevance = explainer.attribute(input_ids, target=1,
        ...                                 additional_forward_args=(attention_mask,))
        >>> relevance.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec(
        "attn_lrp", "AttnLRP", needs="relevance", signed=True, reads_query_row=False,
        options={"through_vision_tower": FLAG, "pixel_baselines": PIXEL_BASELINES, "presence": PRESENCE},
    )

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
        capture: CaptureMode = "auto",
        block_memory: int | None = None,
        gamma: float = 0.0,
    ) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be 0 (the ε-rule) or positive, got {gamma}.")
        super().__init__(forward_func, model, adapter, capture, block_memory)
        self.propagation_rules = lrp.AttnLRPRules(gamma)

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: Literal[False] = False,
        through_vision_tower: bool = False,
        pixel_baselines: float | Tensor = 0.0,
        presence: Tensor | None = None,
    ) -> Scores:
        r"""AttnLRP relevance of each token for the explained logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            query_index (int or sequence/Tensor of int, optional): for a language model,
                the position whose logits are explained (one for all examples or one per
                example). Default: None, the last real token.
            return_maps (bool, optional): AttnLRP has no attention maps; True is an
                error. Default: False.
            through_vision_tower (bool, optional): for a vision-language model, propagate
                the relevance on through the projector and the vision tower to the
                ``pixel_values`` in ``additional_forward_args`` (a mapping of the image
                inputs), instead of stopping at the image tokens the language model reads.
                Default: False.
            pixel_baselines (float or Tensor, optional): with ``through_vision_tower``, the
                reference image :math:`\bar x` (broadcast to ``pixel_values``) whose
                difference carries the pixels' relevance :math:`(x - \bar x) \odot
                \tilde g_x`; 0 is the processor's mean colour for images it normalises.
                Default: 0.
            presence (Tensor, optional): ``(batch, tokens)``, each token's presence
                :math:`p_j \in (0, 1]` in every attention call of one self-attention stack
                (not an encoder-decoder's), over the tokens the model reads (with
                ``attribute_span``, the prompt's and the answer's): the attention every
                query pays to token j is scaled by :math:`p_j` and each row
                renormalised, softmax(:math:`QK^\top/\sqrt{d} + \log p_j`), and the model
                so weighted is explained. Tokens at a low presence (e.g. 0.05, the
                special tokens at 1) are explained nearly as they act alone, which the
                effect of removing any half of them follows better than their effect in
                the whole input does (:doc:`/which_method`). Pass ``target``: the
                prediction can differ at that presence. Default: None, the model as it is.

        $returns
            With ``through_vision_tower=True``, the pair ``(token scores, pixel
            relevance)``, the pixel relevance shaped as ``pixel_values`` (the image tokens
            then score 0: their relevance is in the pixels).
        """
        self._refuse_maps(return_maps, "propagates relevance to the tokens")
        options: dict[str, Any] = {"through_vision_tower": through_vision_tower, "pixel_baselines": pixel_baselines} if through_vision_tower else {}
        if presence is not None:
            options["presence"] = presence
        return self._explain(inputs, target, additional_forward_args, query_index, False, **options)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        presence = options.get("presence")
        if presence is None:
            return super()._probes(effective, **options)
        return [*super()._probes(effective, **options), KeyPresence(presence)]

