"""Grad-SAM as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from captum.attr import GradientAttribution
from torch import Tensor

from ..maps.kernel import block_shape
from ..maps import grad_sam_head_mean, grad_sam_layer_maps, grad_sam_normalised, grad_sam_scores
from ..maps.grad_sam import AXES
from ..maps.streaming import grad_sam_row_sums
from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture import ForwardRecord, GradMaps, OutputGrads
from ._base import AttentionAttributionBase, Inputs, Maps, Scores, attribute_method
from ._registry import FLAG, MethodSpec, one_of


class GradSAM(AttentionAttributionBase, GradientAttribution):
    r"""Grad-SAM: gradient self-attention maps.

    Barkan, Hauon, Caciularu, Katz, Malkiel, Armstrong & Koenigstein, "Grad-SAM:
    Explaining Transformers via Gradient Self-Attention Maps", CIKM 2021
    (https://arxiv.org/abs/2204.11073).

    With Aˡᵐ the post-softmax attention of layer l and head m and Gˡᵐ = dS/dAˡᵐ
    the gradient of the explained logit S:

    .. math::

        H^{lm} = A^{lm} \odot \mathrm{ReLU}(G^{lm}), \qquad
        r_i = \frac{1}{L \cdot M \cdot N} \sum_l \sum_m \sum_j H^{lm}_{ij}

    where N is the number of real tokens of the sample and the sum over j runs along the
    row of token i's query: a token is credited for the attention it pays where that
    helps the logit. ``axis="key"`` sums down token j's key column instead,
    :math:`r_j = \frac{1}{L M N} \sum_l \sum_m \sum_i H^{lm}_{ij}`: the attention it
    receives where that helps (on the key-value recall task of the tutorials the key
    column points at the decisive token where the row does not). ``effective=True``
    replaces A by effective attention (Brunner et al., ICLR 2020). An attention whose queries are not tokens (``pooling`` in
    :class:`~captum_attention.capture.ModuleAdapter`) credits its keys instead:
    :math:`\sum_q H^{lm}_{qi}`. One forward and one ``torch.autograd.grad``; the model's
    parameters' ``.grad`` are never written.

    Args:
        $constructor_args

    Example::

        >>> model = BertForSequenceClassification(config).eval()
        >>> explainer = GradSAM(model)
        >>> scores = explainer.attribute(input_ids, target=1,
        ...                              additional_forward_args=(attention_mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec(
        "grad_sam", "Grad-SAM", needs="backward", gradient_reduction=grad_sam_head_mean,
        options={"axis": one_of(*AXES), "effective": FLAG}, reads_query_row=False,
    )

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        return_maps: Literal[False] = ...,
        axis: str = ...,
        effective: bool = ...,
    ) -> Inputs: ...

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        *,
        return_maps: Literal[True],
        axis: str = ...,
        effective: bool = ...,
    ) -> tuple[Inputs, Maps]: ...

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
        axis: str = "query",
        effective: bool = False,
    ) -> Scores | tuple[Scores, Maps]:
        r"""Grad-SAM relevance of each token for the explained logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            $query_index
            return_maps (bool, optional): also return the per-layer head-mean
                mean_m(Hˡᵐ). Default: False.
            axis (str, optional): ``"query"``: the paper's sum along each token's query
                row, crediting the attention a token pays where it helps (the tokens
                that gather evidence); ``"key"``: the sum down each token's key column,
                crediting the attention it receives (the evidence gathered). One
                self-attention stack only. Default: ``"query"``.
            effective (bool, optional): use effective attention (Brunner et al., ICLR
                2020) for A: each row without its component in the left null space of
                the head's values through the output projection, the part that cannot
                change the output (:func:`~captum_attention.maps.effective_attention`);
                G stays dS/dA. Eager capture. Default: False.

        $returns
        """
        return self._explain(
            inputs, target, additional_forward_args, query_index, return_maps, axis=axis, effective=effective
        )

    def _scores(self, record: ForwardRecord, axis: str = "query") -> tuple[Tensor, list[Tensor]]:
        grad_maps = record.result(GradMaps).maps
        maps = [grad_sam_layer_maps([head_mean], *record.real_of(role))[0] for head_mean, role in zip(grad_maps, record.roles)]
        return grad_sam_scores(maps, record.head_counts, record.target_real, record.pooling, axis), maps

    def _streamed_scores(self, record: ForwardRecord, axis: str = "query") -> Scores:
        """The row (or column) sums of every call; for an encoder-decoder the encoder's
        score the source and the decoder's self- and cross-attention the target, as in
        :meth:`_encoder_decoder_scores`."""
        output_grads = record.result(OutputGrads).grads
        _one_stack(record, axis)
        sides = [("self", "decoder", "cross"), ("encoder",)] if record.is_encoder_decoder else [("self",)]
        scores = []
        for roles in sides:
            calls = [i for i, role in enumerate(record.roles) if role in roles]
            real = record.target_real if roles[0] == "self" else record.input_real
            if not calls:  # no encoder: image features cross-attended are never queries
                scores.append(torch.zeros(real.shape, device=real.device, dtype=torch.float32))
                continue
            total = sum(
                grad_sam_row_sums(
                    record.kernel_calls[i], output_grads[i], *record.real_of(record.roles[i]),
                    block_shape(record.kernel_calls[i], self.block_memory), axis,
                )
                for i in calls
            )
            scores.append(grad_sam_normalised(torch.as_tensor(total), [record.head_counts[i] for i in calls], real))
        return scores[0] if len(scores) == 1 else (scores[1], scores[0])

    def _encoder_decoder_scores(
        self, record: ForwardRecord, axis: str = "query"
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """Each map credits its query tokens: encoder maps score the source, decoder self-
        and cross-attention maps (whose queries are target tokens) score the target."""
        _one_stack(record, axis)
        role_maps: dict[str, list[Tensor]] = {role: [] for role in dict.fromkeys(record.roles)}
        for head_mean, role in zip(record.result(GradMaps).maps, record.roles):
            role_maps[role] += grad_sam_layer_maps([head_mean], *record.real_of(role))
        heads = dict(zip(record.roles, record.head_counts))
        if "encoder" in role_maps:
            source = grad_sam_scores(role_maps["encoder"], [heads["encoder"]] * len(role_maps["encoder"]), record.input_real)
        else:  # no encoder: image features cross-attended are never queries
            source = torch.zeros(record.input_real.shape, device=record.input_real.device, dtype=torch.float32)
        target_maps = role_maps["decoder"] + role_maps["cross"]
        target_heads = [heads["decoder"]] * len(role_maps["decoder"]) + [heads["cross"]] * len(role_maps["cross"])
        target = grad_sam_scores(target_maps, target_heads, record.target_real)
        return (source, target), {role: torch.stack(maps, dim=1) for role, maps in role_maps.items()}


def _one_stack(record: ForwardRecord, axis: str) -> None:
    if axis == "key" and record.is_encoder_decoder:
        raise ValueError(
            "axis='key' sums the attention each token receives in one self-attention stack; an "
            "encoder-decoder's cross-attention keys are another sequence: use axis='query'."
        )
