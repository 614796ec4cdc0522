"""A new attribution method written against the public extension points only.

"Max-head attention": the largest attention any head of one layer pays from the
explained query to each token. It needs one forward pass, reads explicit
probabilities under eager capture and recomputes the query's row block by block
under streaming capture.
"""

from __future__ import annotations

from typing import Any

from captum.attr import Attribution
from torch import Tensor

from captum_attention.attr import (
    LAYER,
    AttentionAttributionBase,
    MethodSpec,
    attribute_method,
)
from captum_attention.capture import ForwardRecord


class MaxHeadAttention(AttentionAttributionBase, Attribution):
    r"""The largest attention any head of layer l pays from the query q to token j:
    :math:`r_j = \max_m A^{lm}_{qj}`.

    Example::

        >>> explainer = MaxHeadAttention(model)
        >>> scores = explainer.attribute(ids, additional_forward_args=(mask,))
    """

    spec = MethodSpec("max_head", "Max-Head Attention", options={"layer": LAYER})

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: Any = None,
        additional_forward_args: Any = None,
        query_index: Any = None,
        return_maps: bool = False,
        layer: int = -1,
    ) -> Any:
        """Max-head attention of the query row in ``layer`` (default: the last)."""
        return self._explain(
            inputs, None, additional_forward_args, query_index, return_maps,
            layer=layer,
        )

    def _scores(
        self, record: ForwardRecord, layer: int = -1
    ) -> tuple[Tensor, list[Tensor]]:
        """Eager capture: every call's head-max map, and the query row of
        ``layer``'s."""
        maps = [attn.amax(dim=1) for attn in record.attn_maps]
        chosen = record.call_index(layer)
        return record.explained_row(chosen, maps[chosen]), maps

    def _streamed_scores(self, record: ForwardRecord, layer: int = -1) -> Tensor:
        """Streaming capture: the query's row of ``layer``, recomputed from the
        kernel call."""
        call = record.kernel_calls[record.call_index(layer)]
        return call.rows_at(record.query_index).amax(dim=1)
