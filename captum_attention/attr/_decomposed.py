"""What the methods that decompose an attention block share: each layer's calls, its
attention rows in either capture mode, and the block written as a sum over tokens
(:func:`~captum_attention.maps.transformed_vectors`), ALTI's matrices once per forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch import Tensor, nn

from .._compat import TargetType, UnsupportedModelError
from ..capture import LogProbTarget, RecordedBlocks, RecordedValues
from ..capture.inputs import resolve_targets
from ..capture.probes import BlockCall
from ..capture.record import ForwardRecord
from ..capture.residual import AttentionResidual, attention_residual, check_one_stream, equal_to_rounding
from ..maps import (
    KeyTiles,
    LinearNorm,
    alti_contributions,
    alti_tile,
    head_vectors,
    key_tiles,
    last_query,
    normalised_mixing,
    query_weights,
    weighted_mixing,
)

BLOCK_ELEMENTS = {"cpu": 2**24, "cuda": 2**27}
"""How many float32 numbers a block of query rows' largest tensor holds, per device type (its
transformed vectors, or where :data:`~captum_attention.maps.context_mixing.ALTI_TILE` cuts
it in pieces, its attention rows): 64 MiB on the CPU, 512 MiB on a card (whose blocks of a
few rows each would leave it idle)."""

CHECKED_ROWS = 64
"""How many query rows :func:`checked_rows` holds."""

CHECKED_RUN = 8
"""How many consecutive rows each run of :func:`checked_rows` holds (one block of attention
rows recomputed per run)."""

MIXING_BLOCK_ELEMENTS = 2**18
"""How many entries of a mixing matrix one block of :func:`matrix_blocks` holds: its
normalisation in float64 then takes a few MiB beside the matrix."""


@dataclass
class LogitReads:
    """The logits explained: token ``tokens[b, k]`` at position ``positions[b, k]`` of a
    language model's logits, or class ``tokens[b, 0]`` of a classifier's (positions 0)."""

    positions: Tensor
    tokens: Tensor


def logit_reads(record: ForwardRecord, target: TargetType | LogProbTarget) -> LogitReads:
    """The logits ``target`` names: an answer's tokens at their positions, else the
    target class or token at the explained query (the predicted one by default)."""
    if isinstance(target, LogProbTarget):
        return LogitReads(target.positions, target.tokens)
    tokens = resolve_targets(record.explained_logits(), target)
    return LogitReads(last_query(record.query_index)[:, None], tokens[:, None])


@dataclass
class LayerSum:
    """One layer's attention block as a sum over tokens: each head's transformed values
    :math:`f^m(x_j)` ``(B, H, N, D)`` and where their sum joins the residual."""

    vectors: Tensor
    residual: AttentionResidual


class RowDescent:
    """Streaming scores of a method whose layers' mixing matrices are rolled out, from
    :meth:`_rollout` of the explained row (a span's weighted rows) or of an answer's rows
    together, carried down from the top layer in one descent."""

    def _rollout(self, record: ForwardRecord, rows: Tensor) -> Tensor:
        """``rows`` ``(B, R, N)`` float64 times every layer's mixing matrix, top first."""
        raise NotImplementedError

    def _streamed_scores(self, record: ForwardRecord) -> Tensor:
        rows = query_weights(record.query_index, record.target_real.shape[1], torch.float64)[:, None]
        return self._rollout(record, rows)[:, 0].float()

    def _streamed_rows(self, record: ForwardRecord, positions: Tensor, tokens: Tensor) -> Tensor:
        """The rows at ``positions`` ``(B, T)`` of a decoder in one descent (a causal row
        never reaches a later token, so each equals its own prefix's row)."""
        rows = torch.nn.functional.one_hot(positions, record.target_real.shape[1]).double()
        return self._rollout(record, rows).float()


def layer_calls(model: nn.Module, record: ForwardRecord, method: str) -> list[BlockCall]:
    """The recorded call of the layer of each attention call, in order; a refusal in one
    line where the adapter's ``layer_block`` does not pair them."""
    blocks = record.result(RecordedBlocks)
    if len(blocks.calls) != record.num_calls:
        raise UnsupportedModelError(
            f"{method} reads the layer of each attention call, but {type(model).__name__}'s adapter found "
            f"{len(blocks.calls)} layer calls for {record.num_calls} attention calls (layer_block)."
        )
    if model.training:
        raise ValueError(f"{method} decomposes each layer as it runs without dropout: call model.eval().")
    return blocks.calls


def attention_rows(record: ForwardRecord, call: int, rows: slice, padded: bool = True) -> Tensor:
    """``(B, H, r, N)`` float32 attention of the query rows ``rows`` of one call, from the
    maps (eager) or recomputed from the kernel call (streaming; ``padded=False``: only the
    first K ≤ N keys, up to the last one a causal call's rows attend to, ``(B, H, r, K)``)."""
    if not record.streaming:
        return record.attn_maps[call][:, :, rows].float()
    kernel = record.kernel_calls[call]
    probs = kernel.probs(rows)
    return torch.nn.functional.pad(probs, (0, kernel.num_keys - probs.shape[-1])) if padded else probs


def attention_row_at(record: ForwardRecord, call: int, position: Tensor) -> Tensor:
    """``(B, H, N)`` float32 attention of each example's row ``position[b]``."""
    if record.streaming:
        kernel = record.kernel_calls[call]
        return kernel.rows_at(position.to(kernel.query.device))
    maps = record.attn_maps[call]
    return maps[torch.arange(maps.shape[0], device=maps.device), :, position.to(maps.device)].float()


def row_blocks(batch: int, tokens: int, row_elements: int, device: torch.device, most: int | None = None) -> Iterator[slice]:
    """Consecutive query rows, as many at a time as keep a block's largest tensor,
    ``row_elements`` numbers per row of each of ``batch`` examples, within
    :data:`BLOCK_ELEMENTS` of ``device``'s type, and at ``most`` rows (None: no limit)."""
    elements = BLOCK_ELEMENTS.get(device.type, BLOCK_ELEMENTS["cpu"])
    step = max(1, min(elements // max(1, batch * row_elements), most or tokens))
    return (slice(start, min(start + step, tokens)) for start in range(0, tokens, step))


def call_values(record: ForwardRecord, call: int, method: str) -> tuple[Tensor, Tensor]:
    """One call's values, one per query head ``(B, H, K, Dv)``, and its output projection
    ``(D, H · Dv)`` (detached); a refusal in one line where the adapter does not name the
    projection or the projection does not take the heads' values side by side."""
    recorded = record.result(RecordedValues)
    projection, module = recorded.projections[call], type(record.capture.modules[call]).__name__
    if projection is None:
        raise UnsupportedModelError(
            f"{method} needs the output projection of {module} as a floating-point weight, which its adapter does not "
            "give (output_projection): one wrapped by PEFT's adapters is read once they are merged "
            "(model.merge_and_unload()); a quantized one is not read."
        )
    values = recorded.per_head(call).detach()
    heads, head_dim = values.shape[1], values.shape[-1]
    if projection.shape[1] != heads * head_dim:
        raise UnsupportedModelError(
            f"{method} splits the output projection of {module} by head, but it "
            f"takes {projection.shape[1]} features, not its {heads} heads' {heads}×{head_dim} values."
        )
    return values, projection.detach()


def call_head_vectors(record: ForwardRecord, call: int, method: str) -> Tensor:
    """``(B, H, N, D)`` :func:`~captum_attention.maps.head_vectors` of one call (detached)."""
    return head_vectors(*call_values(record, call, method))


def head_outputs(record: ForwardRecord, call: int, values: Tensor, rows: slice) -> Tensor:
    r"""``(B, r, H · Dv)`` float32: the heads' attention-weighted values of the query rows
    ``rows`` side by side, :math:`\sum_k \alpha^m_{ik} v^m_k` for each head m: what the
    output projection receives."""
    probs = attention_rows(record, call, rows).to(values.device)
    return torch.einsum("bhrk,bhkv->brhv", probs, values.float()).flatten(2)


def checked_call_values(record: ForwardRecord, call: int, method: str) -> tuple[Tensor, Tensor]:
    """:func:`call_values`, once the call's output projection is seen to have received its
    heads' attention-weighted values on the :func:`checked_rows` (recorded by
    :class:`~captum_attention.capture.AttendedValues` ``(projected_rows=checked_rows)``);
    else a refusal in one line: a gate on the attention output before the projection
    (HY-V4's, Laguna's) is no sum over tokens."""
    values, projection = call_values(record, call, method)
    received = record.result(RecordedValues).projected[call]
    module = type(record.capture.modules[call]).__name__
    if received is None:
        raise UnsupportedModelError(f"{method} checks what the output projection of {module} receives, but saw no (batch, tokens, features) input to it.")
    rows = checked_rows(values.shape[2])
    sums = torch.cat([head_outputs(record, call, values, r) for r in rows], dim=1)
    real = torch.cat([record.forward_real[:, r] for r in rows], dim=1)
    if not equal_to_rounding(sums, received.to(sums.device), real):
        raise UnsupportedModelError(
            f"{method} splits by head what the output projection of {module} receives, but it receives something other "
            "than the heads' attention-weighted values (a gate or a norm on the attention output)."
        )
    return values, projection


def layer_sum(record: ForwardRecord, call: int, block: BlockCall, method: str) -> LayerSum:
    """Call ``call``'s layer as a sum over tokens, checked against the model's own states
    (:func:`~captum_attention.capture.residual.attention_residual`) on the
    :func:`checked_rows`."""
    vectors = call_head_vectors(record, call, method)
    tokens, width = vectors.shape[2:]
    if width != block.output.shape[-1]:
        raise UnsupportedModelError(
            f"{method} adds the attention output to the hidden states of {type(block.block).__name__}, but its output "
            f"projection gives {width} features and the layer's states have {block.output.shape[-1]} (a bottleneck)."
        )
    values, projection = call_values(record, call, method)
    values, projection = values.float().to(vectors.device), projection.float().to(vectors.device)
    sums = vectors.new_zeros(vectors.shape[0], tokens, width)
    for rows in checked_rows(tokens):  # Σ_h (α_h V_h) W_O^h, not every f^h(x_j)
        sums[:, rows] = head_outputs(record, call, values, rows) @ projection.t()
    return LayerSum(vectors, attention_residual(block, sums, checked_real(record.forward_real)))


def checked_rows(tokens: int) -> list[slice]:
    """The query rows on which :func:`layer_sum` checks the attention's sum over tokens
    against the model's states: :data:`CHECKED_ROWS` of them, in runs of
    :data:`CHECKED_RUN` consecutive rows spread evenly from the first row to the last
    (every row of a shorter input, as one run), so that a wrong projection, mask or window
    shows on some of them, without recomputing every row's attention once more."""
    if tokens <= CHECKED_ROWS:
        return [slice(0, tokens)]
    starts = torch.linspace(0, tokens - CHECKED_RUN, CHECKED_ROWS // CHECKED_RUN).round().long().tolist()
    return [slice(start, start + CHECKED_RUN) for start in starts]


def checked_real(real: Tensor) -> Tensor:
    """``real`` ``(B, N)`` on the :func:`checked_rows` alone (False elsewhere)."""
    compared = torch.zeros_like(real)
    for rows in checked_rows(real.shape[1]):
        compared[:, rows] = real[:, rows]
    return compared


def layer_sums(model: nn.Module, record: ForwardRecord, method: str) -> Iterator[LayerSum]:
    """:func:`layer_sum` of every layer, in order, one at a time."""
    for call, block in enumerate(decomposed_layer_calls(model, record, method)):
        yield layer_sum(record, call, block, method)


def decomposed_layer_calls(model: nn.Module, record: ForwardRecord, method: str) -> list[BlockCall]:
    """:func:`layer_calls`, for a rollout of the layers' decompositions, each carried
    through the previous layer's output (the base class has refused a model whose tokens
    also mix outside its attention, ``MethodSpec.rolls_out``): a refusal in one line where
    anything between two attention layers changes the residual stream (each one's input
    must be the previous one's output, on the :func:`checked_rows`; a layer skipped for
    want of its input, as Mllama's cross-attention without an image, passes), or where a
    layer's attention weights the values of another (Gemma-4's and Gemma-3n's key-value
    sharing), whose vectors come from that layer's input, not from this layer's, or where
    a layer carries several streams per token (:func:`check_one_stream`)."""
    calls = layer_calls(model, record, method)
    for layer in calls:
        check_one_stream(layer)
    real = checked_real(record.forward_real)
    for index, (earlier, later) in enumerate(zip(calls, calls[1:])):
        if not equal_to_rounding(later.hidden_input, earlier.output, real):
            raise UnsupportedModelError(
                f"{method} rolls out the layers with attention, but the input of {type(model).__name__}'s attention layer "
                f"{index + 1} is not the output of its attention layer {index}: something between them changes the "
                "residual stream."
            )
    values = record.result(RecordedValues).values
    for call, own in enumerate(values):
        for source in range(call):
            other = values[source]
            if own.shape == other.shape and torch.equal(own[..., :1, :], other[..., :1, :]) and torch.equal(own, other):
                raise UnsupportedModelError(
                    f"{method} rolls out each layer's vectors through that layer's input, but attention call {call} of "
                    f"{type(model).__name__} weights the values of call {source} (key-value sharing across layers)."
                )
    return calls


class LayerJoin(NamedTuple):
    """How a layer's attention output joins the residual stream, without its states
    (:class:`~captum_attention.capture.residual.AttentionResidual`): its post-norm, its
    norm on the attention output and the number it multiplies its output by."""

    norm: LinearNorm | None
    attention_norm: LinearNorm | None
    scale: float


def alti_matrices(model: nn.Module, record: ForwardRecord, method: str = "ALTI") -> list[Tensor]:
    """Every layer's ALTI matrix ``(B, N, N)`` over the record's real tokens, from
    contributions computed once per forward (an answer's rows share them) and, with them,
    how each layer joins the residual (:func:`layer_joins`)."""
    blocks = record.result(RecordedBlocks)
    if "alti" not in blocks.cache:
        blocks.cache["alti"] = [
            (_contributions(record, call, layer), LayerJoin(layer.residual.norm, layer.residual.attention_norm, layer.residual.scale))
            for call, layer in enumerate(layer_sums(model, record, method))
        ]
    return [normalised_mixing(contributions, record.target_real) for contributions, _ in blocks.cache["alti"]]


def layer_joins(record: ForwardRecord) -> list[LayerJoin]:
    """How each layer :func:`alti_matrices` decomposed joins the residual stream."""
    return [join for _, join in record.result(RecordedBlocks).cache["alti"]]


def alti_rollout(
    model: nn.Module, record: ForwardRecord, method: str, rows: Tensor, added: Callable[[int, LayerSum], Tensor] | None = None
) -> Tensor:
    r"""``(B, R, N)`` float64: the rows ``rows`` ``(B, R, N)`` (weights over the last
    layer's outputs) carried down through every layer's ALTI matrix from the top,
    :math:`v \leftarrow v\, C^l + \Delta^l` (``added(call, layer)``: ALTI-Logit's
    layer shares ``(B, R, N)``; None: ALTI's rollout, :math:`\Delta^l = 0`).

    Each matrix is computed in blocks of query rows and used at once, a block only where
    a row weighs on it: no matrix is ever held whole (memory: one block), and a layer
    whose rows weigh nothing yet (ALTI-Logit's top) costs no contribution at all."""
    calls = decomposed_layer_calls(model, record, method)
    for call in reversed(range(len(calls))):
        layer = layer_sum(record, call, calls[call], method)
        rows = rows.to(layer.vectors.device)
        rows = times_mixing(rows, _contribution_blocks(record, call, layer, rows), record.target_real)
        if added is not None:
            rows = rows + added(call, layer).double()
    return rows


def times_mixing(rows: Tensor, blocks: Iterable[tuple[slice, Tensor]], real: Tensor) -> Tensor:
    """``rows`` ``(B, R, N)`` float64 times one layer's mixing matrix, given as the
    contributions ``(B, r, N)`` of blocks of its query rows (:func:`normalised_mixing`
    over the ``real`` tokens ``(B, N)``; a block left out adds nothing): the normalised
    matrix is never held whole."""
    product, real = torch.zeros_like(rows), real.to(rows.device)
    for block, contributions in blocks:
        product += weighted_mixing(rows[:, :, block], contributions, real, block)
    return product


def matrix_blocks(matrix: Tensor) -> Iterator[tuple[slice, Tensor]]:
    """A layer's ``(B, N, N)`` contributions in blocks of query rows for
    :func:`times_mixing`, each of at most :data:`MIXING_BLOCK_ELEMENTS` numbers."""
    batch, tokens = matrix.shape[:2]
    step = max(1, MIXING_BLOCK_ELEMENTS // max(1, batch * tokens))
    for start in range(0, tokens, step):
        rows = slice(start, min(start + step, tokens))
        yield rows, matrix[:, rows]


def _contributions(record: ForwardRecord, call: int, layer: LayerSum) -> Tensor:
    return torch.cat([contributions for _, contributions in _contribution_blocks(record, call, layer)], dim=1)


def _contribution_blocks(
    record: ForwardRecord, call: int, layer: LayerSum, weights: Tensor | None = None
) -> Iterator[tuple[slice, Tensor]]:
    """The layer's ALTI contributions ``(B, r, N)``, one block of query rows at a time:
    every block, or those where ``weights`` ``(B, R, N)`` weigh on a row."""
    batch, heads, tokens, width = layer.vectors.shape
    norm, device = layer.residual.mixing_norm, layer.vectors.device
    inputs, outputs = layer.residual.inputs.to(device).float(), layer.residual.outputs.to(device)
    residual = inputs if layer.residual.norm is None else layer.residual.norm.linear(inputs)
    scale = None if norm is None else norm.scale.to(device)
    tile = alti_tile(tokens, device)
    tiles: KeyTiles | None = None  # laid out at the first block used: a layer whose rows weigh nothing copies nothing
    if tile is None:  # a block's transformed vectors (B, r, N, D)
        blocks = row_blocks(batch, tokens, tokens * width, device)
    else:  # its attention rows (B, H, r, N), or one piece's transformed vectors
        blocks = row_blocks(batch, tokens, max(heads * tokens, tile[1] * width), device, most=tile[0])
    for rows in blocks:
        if weights is None or bool(weights[:, :, rows].any()):
            if tiles is None:
                tiles = key_tiles(layer.vectors if norm is None else norm.features(layer.vectors), tokens if tile is None else tile[1])
            probs = attention_rows(record, call, rows, padded=False).to(device)
            yield rows, alti_contributions(probs, tiles, residual, outputs[:, rows], rows, scale)
