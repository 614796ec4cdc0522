"""Value Zeroing as a Captum attribution."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from captum.attr import Attribution
from torch import Tensor, nn

from .._compat import StreamingUnsupported, TargetType, UnsupportedModelError
from ..capture import AttentionAdapter, LayerBlocks, Probe, RecordedBlocks
from ..capture.inputs import QueryIndex
from ..capture.guard import ModelChanges
from ..capture.kernel import KernelInterception
from ..capture.probes import BlockCall
from ..capture.record import ForwardRecord
from ..capture.residual import equal_to_rounding
from ..capture.adapters.mixing import calls_sharing_values
from ..capture.runner import resolve_adapter
from ..maps import normalised_mixing, propagate_query_row, value_zeroing_distances
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import RowDescent, layer_calls, matrix_blocks, times_mixing
from ._registry import MethodSpec


class ValueZeroing(RowDescent, AttentionAttributionBase, Attribution):
    r"""Value Zeroing: how much each token's output moves when another token's value is zeroed.

    Mohebbi, Zuidema, Chrupała & Alishahi, "Quantifying Context Mixing in Transformers",
    EACL 2023 (https://arxiv.org/abs/2301.12971). Each layer l is re-run on the previous
    layer's output once per token j with j's value vector zeroed in every head (its keys
    untouched, so every query still attends to it, and gets nothing from it); token i's
    mixing of j is the cosine distance its layer output moves, each row normalised:

    .. math::

        C^l_{ij} = \frac{1 - \cos(\tilde{x}^{l,\neg j}_i,\, x^l_i)}
                        {\sum_k 1 - \cos(\tilde{x}^{l,\neg k}_i,\, x^l_i)}, \qquad
        r = e_q^\top C^L \cdots C^1

    (the layers rolled out without a residual term: the layer's output already holds it).
    Unlike the attention weights, it sees the whole layer: the values, the output
    projection, the residual, the norms and the feed-forward. Its cost is plain: every
    layer is re-run once per real token, as many re-runs at once as the batch has
    examples (so that a re-run holds as many tokens as the forward did): about one forward
    per token, so it suits short inputs; memory stays that of the forward, plus one
    layer's :math:`N^2` float32 distances per example under streaming capture (the
    explained rows carried down from the top layer; eager capture keeps every layer's,
    :math:`L \cdot N^2`, for ``return_maps``). The zeroing runs inside
    transformers' attention function, so it needs a model whose attention goes through it
    (the families that stream) and whose adapter names each attention's layer
    (``layer_block``). Registered
    (``"value_zeroing"``), not yet in the reports.

    Args:
        $constructor_args

    Example::

        >>> scores = ValueZeroing(model).attribute(input_ids, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    spec = MethodSpec("value_zeroing", "Value Zeroing", encoder_decoder=False, rolls_out=True, in_reports=False)

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
    ) -> Scores | tuple[Scores, list[Tensor]]:
        r"""Each token's rolled-out Value Zeroing score at the explained query row.

        Args:
            $inputs
            $target_ignored
            $additional_forward_args
            $query_index
            return_maps (bool, optional): also return each layer's ``(B, N, N)`` matrix
                :math:`C^l` (eager capture). Default: False.

        $returns
        """
        return self._explain(inputs, None, additional_forward_args, query_index, return_maps)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        return [*super()._probes(effective, **options), LayerBlocks()]

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        mixing = _mixing_matrices(self.model, resolve_adapter(self.model, self.adapter), record)
        return propagate_query_row(mixing, record.query_index), mixing

    def _rollout(self, record: ForwardRecord, rows: Tensor) -> Tensor:
        """Each layer's distances computed, used and dropped: one layer's :math:`N^2`
        held at a time, where the eager record keeps every layer's."""
        adapter = resolve_adapter(self.model, self.adapter)
        for call in reversed(_value_calls(self.model, adapter, record)):
            distances = _layer_distances(self.model, adapter, call, record.forward_real)
            rows = times_mixing(rows.to(distances.device), matrix_blocks(distances), record.target_real)
        return rows


def _mixing_matrices(model: nn.Module, adapter: AttentionAdapter, record: ForwardRecord) -> list[Tensor]:
    """Every layer's :math:`C^l` over the record's real tokens, from distances computed once
    per forward (an answer's rows, whose real tokens end at each row's query, share them)."""
    blocks = record.result(RecordedBlocks)
    if "value_zeroing" not in blocks.cache:
        zeroed = record.forward_real
        blocks.cache["value_zeroing"] = [_layer_distances(model, adapter, call, zeroed) for call in _value_calls(model, adapter, record)]
    return [normalised_mixing(distances, record.target_real) for distances in blocks.cache["value_zeroing"]]


def _value_calls(model: nn.Module, adapter: AttentionAdapter, record: ForwardRecord) -> list[BlockCall]:
    """The layer call of each attention call; a refusal in one line where a layer zeroes
    values another layer computed (key-value sharing), which its re-run would take for
    its own."""
    if shared := calls_sharing_values(model, adapter):
        calls = ", ".join(map(str, shared))
        raise UnsupportedModelError(
            f"Value Zeroing zeroes each layer's own values, but attention calls {calls} of {type(model).__name__} reuse an "
            "earlier layer's keys and values (key-value sharing across layers), computed from that layer's input."
        )
    return layer_calls(model, record, "Value Zeroing")


def _layer_distances(model: nn.Module, adapter: AttentionAdapter, call: BlockCall, zeroed: Tensor) -> Tensor:
    if call.output.shape[:2] != zeroed.shape:
        raise UnsupportedModelError(
            f"Value Zeroing needs each layer's output over the tokens; {type(call.block).__name__} returned "
            f"{tuple(call.output.shape)} for {tuple(zeroed.shape)} (batch, tokens)."
        )
    real = zeroed.to(call.output.device)
    examples, tokens = real.nonzero(as_tuple=True)
    batch, length = zeroed.shape
    everyone = torch.arange(batch, device=real.device)
    if not equal_to_rounding(_rerun(model, adapter, call, everyone, torch.ones_like(real, dtype=torch.float32)), call.output, real):
        raise UnsupportedModelError(
            f"Value Zeroing re-runs each layer on its recorded inputs, but {type(call.block).__name__} re-run with no value "
            "zeroed gives other outputs than in the forward (it reads something besides its arguments, as a cache shared "
            "across layers)."
        )
    distances = torch.zeros(batch, length, length, device=call.output.device)
    for start in range(0, len(examples), batch):  # re-runs of as many tokens as the forward's
        chunk, moved = examples[start : start + batch], tokens[start : start + batch]
        keep = torch.ones(len(moved), length, device=real.device)
        keep[torch.arange(len(moved), device=keep.device), moved] = 0.0
        distances[chunk, :, moved] = value_zeroing_distances(call.output[chunk], _rerun(model, adapter, call, chunk, keep))
    return distances


def _rerun(model: nn.Module, adapter: AttentionAdapter, call: BlockCall, examples: Tensor, keep: Tensor) -> Tensor:
    """``(V, N, D)``: the layer re-run on its recorded inputs of ``examples``, each token's
    value vector scaled by ``keep`` ``(V, N)`` (0: zeroed) in re-run v."""
    zeroings: list[nn.Module] = []

    def zero_values(module: nn.Module, kernel: Any, run_kernel: Any) -> Tensor:
        zeroings.append(module)
        return run_kernel(lambda query, key, value: (query, key, value * keep[:, None, : value.shape[2], None].to(value.dtype)))

    def install(stack: ExitStack) -> None:
        stack.enter_context(torch.no_grad())
        stack.enter_context(adapter.prepared(model, streaming=True))
        stack.enter_context(KernelInterception(zero_values))

    args, kwargs = call.rerun_inputs(examples)
    try:
        with ModelChanges(model, install):
            output = call.block(*args, **kwargs)
    except StreamingUnsupported as reason:
        raise UnsupportedModelError(f"Value Zeroing zeroes values inside transformers' sdpa attention, which {reason}.") from None
    if len(zeroings) != 1:
        raise UnsupportedModelError(
            f"Value Zeroing zeroes values inside transformers' sdpa attention, but re-running {type(call.block).__name__} "
            f"made {len(zeroings)} such calls (one expected)."
        )
    return output[0] if isinstance(output, (tuple, list)) else output

