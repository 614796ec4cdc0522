"""Raw attention as a Captum attribution."""

from __future__ import annotations

from typing import Any, Sequence

from captum._utils.typing import TargetType
from captum.attr import Attribution
from captum.log import log_usage
from torch import Tensor

from ..maps import query_rows, raw_attention_maps
from ._base import AttentionAttributionBase, format_inputs, format_scores


class RawAttention(AttentionAttributionBase, Attribution):
    r"""Raw attention: the head-mean attention the query pays to each token in one layer.

    The "standard attention" baseline of the attention-as-explanation literature (e.g.
    Jain & Wallace, NAACL 2019; Serrano & Smith, ACL 2019):

    .. math::

        S = \mathrm{mean}_m A^{lm}_{q,\cdot}

    for the chosen layer l (the last by default) and query row q. A forward pass only:
    the scores do not depend on ``target``.

    Args:
        forward_func (Callable): the model's forward; a Hugging Face model or any
            function of ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module holding the attention layers. Default:
            ``forward_func`` when it is a module.
        adapter (AttentionAdapter, optional): how to find the attention. Default: the
            Hugging Face adapter.

    Example::

        >>> scores = RawAttention(model).attribute(input_ids, layer=0,
        ...                                        additional_forward_args=(mask,))
    """

    readable_name = "Raw Attention"

    @log_usage(part_of_slo=True)
    def attribute(  # type: ignore[override]
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: int | Sequence[int] | Tensor = 0,
        layer: int = -1,
        return_maps: bool = False,
    ) -> Any:
        r"""Head-mean attention of the query row in one layer.

        Args:
            inputs (Tensor or 1-tuple of Tensor): token ids ``(batch, seq_len)`` or
                embeddings ``(batch, seq_len, hidden)``, passed to ``forward_func`` first.
            target (Any, optional): accepted for a drop-in Captum call and ignored.
                Default: None.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``, e.g. ``(attention_mask,)``. Default: None.
            query_index (int or sequence/Tensor of int, optional): the query row, one for
                all examples or one per example. Default: 0 ([CLS]).
            layer (int, optional): which attention layer (negative counts from the end).
                Default: -1, the last.
            return_maps (bool, optional): also return every layer's head-mean attention,
                ``(batch, layers, seq_len, seq_len)``. Default: False.

        Returns:
            Tensor (or 1-tuple, like ``inputs``) of float32 scores ``(batch, seq_len)``,
            0 at padding; with ``return_maps``, a pair ``(scores, maps)``.
        """
        is_tuple, tensor = format_inputs(inputs)
        captured = self._capture(tensor, None, additional_forward_args, query_index)
        chosen = captured.layer(layer)
        maps = raw_attention_maps(captured.attn_probs, captured.real)
        scores = query_rows(maps[chosen], captured.query_index)
        return format_scores(is_tuple, scores, maps, return_maps)
