"""Chefer et al.'s Transformer Attribution as a Captum attribution."""

from __future__ import annotations

from typing import Any, Sequence

from captum._utils.typing import TargetType
from captum.attr import GradientAttribution
from captum.log import log_usage
from torch import Tensor

from ..maps import relevance_layer_maps, transformer_attribution_scores
from ._base import AttentionAttributionBase, format_inputs, format_scores


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

    needs_gradients = True
    readable_name = "Transformer Attribution"

    @log_usage(part_of_slo=True)
    def attribute(  # type: ignore[override]
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: int | Sequence[int] | Tensor = 0,
        start_layer: int = 0,
        return_maps: bool = False,
    ) -> Any:
        r"""Relevance of each token for the query position's prediction.

        Args:
            inputs (Tensor or 1-tuple of Tensor): token ids ``(batch, seq_len)`` or
                embeddings ``(batch, seq_len, hidden)``, passed to ``forward_func`` first.
            target (int, list, Tensor or None, optional): the class whose logit is
                explained (Captum's convention). Default: None, the predicted class.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``, e.g. ``(attention_mask,)``. Default: None.
            query_index (int or sequence/Tensor of int, optional): the row of R to return,
                one for all examples or one per example. Default: 0 ([CLS]).
            start_layer (int, optional): first layer whose attention is propagated
                (negative counts from the end). Default: 0, all layers.
            return_maps (bool, optional): also return the per-layer Ā^l,
                ``(batch, layers, seq_len, seq_len)``. Default: False.

        Returns:
            Tensor (or 1-tuple, like ``inputs``) of float32 scores ``(batch, seq_len)``,
            0 at padding; with ``return_maps``, a pair ``(scores, maps)``.
        """
        is_tuple, tensor = format_inputs(inputs)
        captured = self._capture(tensor, target, additional_forward_args, query_index)
        first = captured.layer(start_layer, "start_layer")
        assert captured.attn_grads is not None
        maps = relevance_layer_maps(captured.attn_probs, captured.attn_grads, captured.real)
        scores = transformer_attribution_scores(maps[first:], captured.query_index)
        return format_scores(is_tuple, scores, maps, return_maps)
