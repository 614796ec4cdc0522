"""Attention Rollout as a Captum attribution."""

from __future__ import annotations

from typing import Any, Sequence

from captum._utils.typing import TargetType
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor

from ..maps import HEAD_FUSIONS, rollout_layer_maps, rollout_scores
from ._base import AttentionAttributionBase, format_inputs, format_scores


class AttentionRollout(AttentionAttributionBase, Attribution):
    r"""Attention Rollout: attention propagated through the layers with the residual.

    Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020
    (https://arxiv.org/abs/2005.00928). Per layer,

    .. math::

        \hat{A}^l = \mathrm{rownorm}\big(0.5 \cdot \mathrm{fuse}_m(A^{lm}) + 0.5 \cdot I\big),
        \qquad R = \hat{A}^L \cdots \hat{A}^2 \hat{A}^1

    and the scores are the query row of R (they sum to 1). ``fuse`` is the head mean (the
    paper), max or min; ``discard_ratio`` zeroes the lowest fraction of each fused map
    first (jacobgil/vit-explain), never the query's own entry. A forward pass only, no
    gradient: the scores do not depend on ``target``.

    Args:
        forward_func (Callable): the model's forward; a Hugging Face model or any
            function of ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module holding the attention layers. Default:
            ``forward_func`` when it is a module.
        adapter (AttentionAdapter, optional): how to find the attention. Default: the
            Hugging Face adapter.

    Example::

        >>> explainer = AttentionRollout(model)
        >>> scores = explainer.attribute(input_ids, additional_forward_args=(mask,),
        ...                              head_fusion="max", discard_ratio=0.9)
    """

    readable_name = "Attention Rollout"

    @log_usage(part_of_slo=True)
    def attribute(  # type: ignore[override]
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: int | Sequence[int] | Tensor = 0,
        head_fusion: str = "mean",
        discard_ratio: float = 0.0,
        start_layer: int = 0,
        return_maps: bool = False,
    ) -> Any:
        r"""Rollout scores of each token for the query position.

        Args:
            inputs (Tensor or 1-tuple of Tensor): token ids ``(batch, seq_len)`` or
                embeddings ``(batch, seq_len, hidden)``, passed to ``forward_func`` first.
            target (Any, optional): accepted for a drop-in Captum call and ignored:
                attention does not depend on the explained class. Default: None.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``, e.g. ``(attention_mask,)``. Default: None.
            query_index (int or sequence/Tensor of int, optional): the row of R to return,
                one for all examples or one per example. Default: 0 ([CLS]).
            head_fusion (str, optional): "mean", "max" or "min" over heads. Default: "mean".
            discard_ratio (float, optional): fraction in [0, 1) of each sample's real
                fused map set to 0 before the residual is added. Default: 0.0.
            start_layer (int, optional): first layer in the product (negative counts from
                the end). Default: 0, all layers.
            return_maps (bool, optional): also return the per-layer Â^l,
                ``(batch, layers, seq_len, seq_len)``. Default: False.

        Returns:
            Tensor (or 1-tuple, like ``inputs``) of float32 scores ``(batch, seq_len)``,
            0 at padding; with ``return_maps``, a pair ``(scores, maps)``.
        """
        if head_fusion not in HEAD_FUSIONS:
            raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {head_fusion!r}.")
        if not 0.0 <= discard_ratio < 1.0:
            raise ValueError(f"discard_ratio must be in [0, 1), got {discard_ratio}.")
        is_tuple, tensor = format_inputs(inputs)
        captured = self._capture(tensor, None, additional_forward_args, query_index)
        first = captured.layer(start_layer, "start_layer")
        maps = rollout_layer_maps(
            captured.attn_probs, captured.real, captured.query_index, head_fusion, discard_ratio
        )
        scores = rollout_scores(maps[first:], captured.query_index)
        return format_scores(is_tuple, scores, maps, return_maps)
