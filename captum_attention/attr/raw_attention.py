"""Raw attention as a Captum attribution."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from captum.attr import Attribution
from torch import Tensor

from ..maps import query_rows, raw_attention_maps
from .._compat import TargetType
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord
from ..maps.streaming import raw_attention_row
from ._base import AttentionAttributionBase, Inputs, Maps, Scores, attribute_method
from ._registry import FLAG, LAYER, MethodSpec


class RawAttention(AttentionAttributionBase, Attribution):
    r"""Raw attention: the head-mean attention the query pays to each token in one layer.

    The "standard attention" baseline of the attention-as-explanation literature (e.g.
    Jain & Wallace, NAACL 2019; Serrano & Smith, ACL 2019):

    .. math::

        S = \mathrm{mean}_m A^{lm}_{q,\cdot}

    for the chosen layer l (the last by default) and query row q (for a pooling
    attention, whose queries are not tokens, the mean of its rows). A forward pass only:
    the scores do not depend on ``target``. ``effective=True`` reads effective attention
    instead (Brunner et al., "On Identifiability in Transformers", ICLR 2020).

    Args:
        $constructor_args

    Example::

        >>> scores = RawAttention(model).attribute(input_ids, layer=0,
        ...                                        additional_forward_args=(mask,))
    """

    spec = MethodSpec("raw", "Raw Attention", options={"layer": LAYER, "effective": FLAG})

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        layer: int = ...,
        return_maps: Literal[False] = ...,
        effective: bool = ...,
    ) -> Inputs: ...

    @overload
    def attribute(
        self,
        inputs: Inputs,
        target: TargetType = ...,
        additional_forward_args: Any = ...,
        query_index: QueryIndex = ...,
        layer: int = ...,
        *,
        return_maps: Literal[True],
        effective: bool = ...,
    ) -> tuple[Inputs, Maps]: ...

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        layer: int = -1,
        return_maps: bool = False,
        effective: bool = False,
    ) -> Scores | tuple[Scores, Maps]:
        r"""Head-mean attention of the query row in one layer.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            layer (int, optional): which attention layer (negative counts from the end;
                for an encoder-decoder, which decoder layer: its self-attention gives the
                target scores, its cross-attention the source scores; for Mllama, which of
                its self-attention layers gives the text scores and which of its
                cross-attention layers the image scores). Default: -1, the last.
            return_maps (bool, optional): also return every layer's head-mean attention.
                Default: False.
            effective (bool, optional): effective attention instead (Brunner et al.,
                ICLR 2020): each row without its component in the left null space of the
                head's values through the output projection, the part that cannot change
                the output (:func:`~captum_attention.maps.effective_attention`); its rows
                need not sum to 1 and can be negative. Eager capture. Default: False.

        $returns
        """
        return self._explain(inputs, target, additional_forward_args, query_index, return_maps, layer=layer, effective=effective)

    def _scores(self, record: ForwardRecord, layer: int = -1) -> tuple[Tensor, list[Tensor]]:
        chosen = record.call_index(layer)
        maps = [raw_attention_maps([attn], *record.real_of(role))[0] for attn, role in zip(record.attn_maps, record.roles)]
        return record.explained_row(chosen, maps[chosen]), maps

    def _streamed_scores(self, record: ForwardRecord, layer: int = -1) -> Scores:
        """The query row of the chosen layer; for an encoder-decoder that decoder layer's
        cross-attention (source) and self-attention (target) rows."""
        if not record.is_encoder_decoder:
            return raw_attention_row(record.kernel_calls[record.call_index(layer)], record.query_index, record.target_real)
        decoder, cross = record.of_role("decoder"), record.of_role("cross")
        return (
            raw_attention_row(cross.kernel_calls[cross.call_index(layer)], record.query_index, record.input_real),
            raw_attention_row(decoder.kernel_calls[decoder.call_index(layer)], record.query_index, record.target_real),
        )

    def _encoder_decoder_scores(
        self, record: ForwardRecord, layer: int = -1
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        decoder, cross = record.of_role("decoder"), record.of_role("cross")
        encoder = record.of_role("encoder")
        decoder_maps = raw_attention_maps(decoder.attn_maps, record.target_real)
        cross_maps = raw_attention_maps(cross.attn_maps, record.target_real, record.input_real)
        encoder_maps = raw_attention_maps(encoder.attn_maps, record.input_real)
        scores = (
            query_rows(cross_maps[cross.call_index(layer)], record.query_index),
            query_rows(decoder_maps[decoder.call_index(layer)], record.query_index),
        )
        maps = {"encoder": encoder_maps, "decoder": decoder_maps, "cross": cross_maps}
        return scores, {role: torch.stack(role_maps, dim=1) for role, role_maps in maps.items() if role_maps}
