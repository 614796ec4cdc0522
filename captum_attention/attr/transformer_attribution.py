"""Chefer et al.'s Transformer Attribution as a Captum attribution."""

from __future__ import annotations

from typing import Any

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
from ..capture.kernel import block_rows
from ..capture.record import ForwardRecord
from ..maps.streaming import query_row, relevance_row_step
from ._base import AttentionAttributionBase, Maps, Scores, attribute_method, encoder_decoder_rows


class TransformerAttribution(AttentionAttributionBase, GradientAttribution):
    r"""Transformer Attribution by gradient-weighted attention relevance propagation.

    Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting
    Bi-Modal and Encoder-Decoder Transformers", ICCV 2021
    (https://arxiv.org/abs/2103.15679), the rule for self-attention. With A^{lm} the
    attention of layer l and head m and G^{lm} = dS/dA^{lm}:

    .. math::

        R = I; \quad \bar{A}^l = \mathrm{mean}_m\big((G^{lm} \odot A^{lm})^+\big); \quad
        R \leftarrow R + \bar{A}^l R \quad (l = 1..L)

    The scores are the query row of R (the query's own entry includes the identity's 1).

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``; a Hugging Face
            model (its ``.logits`` is used) or any function of
            ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module holding the attention layers. Default:
            ``forward_func`` when it is a module.
        adapter (AttentionAdapter, optional): how to find the attention. Default: the
            Hugging Face adapter.

    Example::

        >>> explainer = TransformerAttribution(model)
        >>> scores = explainer.attribute(input_ids, target=1,
        ...                              additional_forward_args=(attention_mask,))
    """

    gradient_reduction = staticmethod(relevance_head_mean)
    method_name = "transformer_attribution"
    readable_name = "Transformer Attribution"

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
        assert record.grad_maps is not None
        first = record.layer(start_layer, "start_layer")
        maps = relevance_layer_maps(record.grad_maps, record.target_real)
        return transformer_attribution_scores(maps[first:], record.query_index), maps

    def _streamed_scores(self, record: ForwardRecord, start_layer: int = 0) -> Tensor:
        assert record.kernel_calls is not None and record.output_grads is not None
        first = record.layer(start_layer, "start_layer")
        row = query_row(record.query_index, record.target_real.shape[1])
        for call, grad in list(zip(record.kernel_calls, record.output_grads))[first:][::-1]:
            row = relevance_row_step(call, grad, row, record.target_real, block_rows(call, self.block_memory))
        return row

    def _encoder_decoder_scores(
        self, record: ForwardRecord, start_layer: int = 0
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        """Chefer et al.'s rules (6)-(11) for self- and cross-attention; see
        :func:`captum_attention.maps.encoder_decoder_relevance`."""
        assert record.grad_maps is not None and record.source_real is not None
        if start_layer != 0:
            raise ValueError("start_layer applies to one self-attention stack; leave it at 0 for encoder-decoders.")
        maps = [
            relevance_layer_maps([head_mean], *record.real_of(role))[0]
            for head_mean, role in zip(record.grad_maps, record.roles)
        ]
        return encoder_decoder_rows(record, maps, encoder_decoder_relevance)
