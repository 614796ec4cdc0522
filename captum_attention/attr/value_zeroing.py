"""Value Zeroing as a Captum attribution."""

from __future__ import annotations

import copy
import warnings
from contextlib import ExitStack
from typing import Any

import torch
from captum.attr import Attribution
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from .._compat import StreamingUnsupported, TargetType, UnsupportedModelError, model_configs
from ..capture import AttentionAdapter, LayerBlocks, Probe, RecordedBlocks
from ..capture.inputs import QueryIndex
from ..capture.guard import ModelChanges
from ..capture.kernel import KernelInterception
from ..capture.probes import BlockCall
from ..capture.record import ForwardRecord
from ..capture.residual import equal_to_rounding
from ..capture.adapters.mixing import calls_sharing_values
from ..capture.runner import resolve_adapter
from ..maps import half_precision, normalised_mixing, propagate_query_row, value_zeroing_distances
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import RowDescent, layer_calls, matrix_blocks, times_mixing
from ._registry import MethodSpec

HALF_PRECISION_RERUN = 5e-2
"""How far, relative to its scale, a half-precision layer's re-run may be from its output
in the forward: a bfloat16 layer moves by a few percent between kernels (the eager
forward's explicit softmax and the re-run's sdpa) and against its float32 copy, where a
layer that reads something besides its arguments moves by its whole scale."""


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
    :math:`L \cdot N^2`, for ``return_maps``). A layer whose weights are all half
    precision is re-run as a float32 copy: a distance of two nearly equal outputs carries
    about N times the re-runs' rounding, 3-9% of the scores' scale at 64-512 tokens in
    bfloat16. The zeroing runs inside transformers' attention function, so it needs a
    model whose attention goes through it (the families that stream) and whose adapter
    names each attention's layer (``layer_block``). Registered (``"value_zeroing"``), not
    yet in the reports.

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
        return self._explain(inputs, target, additional_forward_args, query_index, return_maps)

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
    block, original = _rerun_block(model, adapter, call, real)
    distances = torch.zeros(batch, length, length, device=call.output.device, dtype=torch.float32)
    for start in range(0, len(examples), batch):  # re-runs of as many tokens as the forward's
        chunk, moved = examples[start : start + batch], tokens[start : start + batch]
        keep = torch.ones(len(moved), length, device=real.device, dtype=torch.float32)
        keep[torch.arange(len(moved), device=keep.device), moved] = 0.0
        distances[chunk, :, moved] = value_zeroing_distances(original[chunk], _rerun(model, adapter, call, block, chunk, keep))
    return distances


def _rerun_block(model: nn.Module, adapter: AttentionAdapter, call: BlockCall, real: Tensor) -> tuple[nn.Module, Tensor]:
    """The layer the distances re-run, and its output re-run with no value zeroed, which
    they are measured from (the forward's own output may come from another kernel, whose
    rounding would enter each distance).

    A distance is that of two nearly equal outputs (one token's value of N removed), so
    the re-runs' rounding weighs about N times more in it than in the outputs: in half
    precision it ran to 3-9% of the scores' scale at 64-512 tokens. A layer whose
    weights are all half precision is re-run as a float32 copy, on its recorded inputs
    made float32, where that copy runs and gives the forward's outputs to rounding; else
    the model's own layer, with a warning in half precision."""
    everyone = torch.arange(real.shape[0], device=real.device)
    unzeroed = torch.ones_like(real, dtype=torch.float32)
    if _half_precision(call.block):
        try:
            single = _float32_copy(model, call.block)
            original = _rerun(model, adapter, call, single, everyone, unzeroed)
        except (RuntimeError, TypeError, ValueError):  # a layer that casts to its own dtype, or cannot be copied
            pass
        else:
            if equal_to_rounding(original, call.output, real, half=HALF_PRECISION_RERUN):
                return single, original
        warnings.warn(
            f"Value Zeroing re-runs {type(call.block).__name__} in {next(call.block.parameters()).dtype}: its float32 copy could not "
            "be run, or gave other outputs than the forward. A distance of two nearly equal outputs carries about N times the "
            "re-runs' rounding (3-9% of the scores' scale at 64-512 tokens in bfloat16): explain the model in float32 "
            "(model.float()) for exact scores.",
            stacklevel=2,
        )
    original = _rerun(model, adapter, call, call.block, everyone, unzeroed)
    if not equal_to_rounding(original, call.output, real, half=HALF_PRECISION_RERUN):
        raise UnsupportedModelError(
            f"Value Zeroing re-runs each layer on its recorded inputs, but {type(call.block).__name__} re-run with no value "
            "zeroed gives other outputs than in the forward (it reads something besides its arguments, as a cache shared "
            "across layers, or forward_func runs it under torch.autocast)."
        )
    return call.block, original


def _float32_copy(model: nn.Module, block: nn.Module) -> nn.Module:
    """A float32 copy of ``block`` that shares, rather than copies, what the layer reads
    besides its weights: the model's configurations (so that the copy runs the attention
    implementation the capture gives the model) and the hooks on its modules (the user's,
    Accelerate's, whose offloaded weights are the model's)."""
    shared: list[Any] = list(model_configs(model))
    for module in block.modules():
        shared.extend(hook for hooks in _hook_dicts(module) for hook in hooks.values())
        if hasattr(module, "_hf_hook"):
            shared.append(module._hf_hook)
    return copy.deepcopy(block, memo={id(kept): kept for kept in shared}).float()


def _hook_dicts(module: nn.Module) -> list[dict]:
    return [value for name, value in vars(module).items() if name.endswith("hooks") and isinstance(value, dict)]


def _half_precision(block: nn.Module) -> bool:
    weights = list(block.parameters())
    return bool(weights) and all(half_precision(weight.dtype) for weight in weights)


def _single_precision(value: Any) -> Any:
    return value.float() if isinstance(value, Tensor) and half_precision(value.dtype) else value


def _rerun(model: nn.Module, adapter: AttentionAdapter, call: BlockCall, block: nn.Module, examples: Tensor, keep: Tensor) -> Tensor:
    """``(V, N, D)``: ``block`` (the layer or its float32 copy) re-run on the layer's
    recorded inputs of ``examples``, each token's value vector scaled by ``keep``
    ``(V, N)`` (0: zeroed) in re-run v."""
    zeroings: list[nn.Module] = []

    def zero_values(module: nn.Module, kernel: Any, run_kernel: Any) -> Tensor:
        zeroings.append(module)
        return run_kernel(lambda query, key, value: (query, key, value * keep[:, None, : value.shape[2], None].to(value.dtype)))

    def install(stack: ExitStack) -> None:
        stack.enter_context(torch.no_grad())
        stack.enter_context(adapter.prepared(model, streaming=True))
        stack.enter_context(KernelInterception(zero_values))

    args, kwargs = call.rerun_inputs(examples)
    if block is not call.block:
        args, kwargs = tree_map(_single_precision, args), tree_map(_single_precision, kwargs)
    try:
        with ModelChanges(model, install):
            output = block(*args, **kwargs)
    except StreamingUnsupported as reason:
        raise UnsupportedModelError(f"Value Zeroing zeroes values inside transformers' sdpa attention, which {reason}.") from None
    if len(zeroings) != 1:
        raise UnsupportedModelError(
            f"Value Zeroing zeroes values inside transformers' sdpa attention, but re-running {type(call.block).__name__} "
            f"made {len(zeroings)} such calls (one expected)."
        )
    return output[0] if isinstance(output, (tuple, list)) else output

