r"""Context mixing: attention weighed by what it moves (pure tensor math).

Kobayashi, Kuribayashi, Yokoi & Inui, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms", EMNLP 2020: head m of a layer adds
:math:`\alpha^m_{ij} f^m(x_j)` to query i, with :math:`f^m(x_j) = v^m_j W_O^{m\top}` the
value of token j (its projection's bias included) through head m's slice of the output
projection. The layer's mixing of token j into query i is the norm of their sum over
heads, :math:`\lVert \sum_m \alpha^m_{ij} f^m(x_j) \rVert` (the authors'
``summed_weighted_norm``; the output projection's bias, shared by every token, left out).

Mohebbi, Zuidema, Chrupała & Alishahi, "Quantifying Context Mixing in Transformers", EACL
2023 (Value Zeroing): layer l mixes token j into token i by how far token i's layer output
moves when token j's value vector is zeroed in every head, the layer re-run on the
previous layer's output,
:math:`C^l_{ij} = 1 - \cos(\tilde{x}^{l,\neg j}_i, x^l_i)`, each row divided by its sum
(:func:`normalised_mixing`); the layers' matrices are then rolled out without a residual
term (the layer output already holds it).

Kobayashi, Kuribayashi, Yokoi & Inui, "Incorporating Residual and Normalization Layers into
Analysis of Masked Language Models", EMNLP 2021, and Ferrando, Gállego & Costa-jussà,
"Measuring the Mixing of Contextual Information in the Transformer", EMNLP 2022 (ALTI): the
attention block's output at token i, its residual and its norm included, is a sum over the
tokens j of transformed vectors plus a bias,
:math:`y_i = \sum_j T_i(x_j) + b_i` with
:math:`T_i(x_j) = L_i\big(\sum_m \alpha^m_{ij} f^m(x_j) + \delta_{ij} x_j\big)`, where
:math:`L_i` is the norm after the residual (post-norm layers) as the linear map it is at
token i's statistics (:class:`LinearNorm`), the identity in pre-norm layers. ALTI's
contribution of j to i is :math:`\max(0, \lVert y_i \rVert_1 - \lVert y_i - T_i(x_j)
\rVert_1)`, each row divided by its sum (:func:`alti_contributions`), rolled out over the
layers without a residual term.

Ferrando, Gállego, Tsiamas & Costa-jussà, "Explaining How Transformers Use Context to Build
Predictions", ACL 2023 (ALTI-Logit): layer l's attention adds to the logit of token w at
position q, through token j, :math:`\Delta^l_j = \sum_m \alpha^{lm}_{qj} f^{lm}(x_j)
\cdot u_q` with :math:`u_q` the unembedding row of w through the final norm's linear map
at q (:func:`logit_direction`); each layer's share is carried to the input tokens by ALTI's
rollout of the layers below it, :math:`r = \sum_l \Delta^l C^{l-1} \cdots C^1`
(:func:`logit_rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .streaming import FUSED_DEVICES, compiled_block, device_kind


def summed_weighted_norm(rows: Tensor, values: Tensor, projection: Tensor) -> Tensor:
    r"""``(B, K)``: :math:`\lVert \sum_m \alpha^m_j f^m(x_j) \rVert` per key j, in float32.

    Args:
        rows: ``(B, H, K)`` attention of one query row per example (each head's).
        values: ``(B, H, K, Dv)`` the values each head weighted.
        projection: ``(hidden, H · Dv)`` output projection weight (head m's slice its
            columns ``m·Dv`` to ``(m+1)·Dv``).
    """
    weighted = rows.float()[..., None] * values.float()  # (B, H, K, Dv): α^m_j v^m_j
    mixed = weighted.transpose(1, 2).flatten(2) @ projection.float().t()  # (B, K, hidden): Σ_m α^m_j f^m(x_j)
    return mixed.norm(dim=-1)


def value_zeroing_distances(original: Tensor, zeroed: Tensor) -> Tensor:
    r"""``(V, N)`` float32: how far each token's layer output moves in each re-run,
    :math:`1 - \cos(\tilde{x}^{\neg j}_i, x_i)` (computed in float64).

    Args:
        original: ``(V, N, ...)`` the layer's outputs of the re-runs' examples (a token's
            several streams, as hyper-connections keep them, compared as one vector).
        zeroed: ``(V, N, ...)`` the layer's outputs re-run with one token's value zeroed.
    """
    return (1.0 - F.cosine_similarity(zeroed.double().flatten(2), original.double().flatten(2), dim=-1)).float()


def normalised_mixing(contributions: Tensor, real: Tensor, rows: slice = slice(None)) -> Tensor:
    """``(B, r, N)`` float32: the query rows ``rows`` (default: all) of one layer's mixing
    matrix over the ``real`` tokens ``(B, N)`` bool, from their non-negative contributions
    ``(B, r, N)`` (entry ``(b, i, j)``: what token j gives token i; Value Zeroing's
    :func:`value_zeroing_distances`, ALTI's :func:`alti_contributions`): the pairs of a
    non-real token 0, each row divided by its sum (a row without any contribution stays 0)."""
    pairs = real[:, rows, None] & real[:, None, :]
    mixing = torch.where(pairs.to(contributions.device), contributions.double(), 0.0)
    totals = mixing.sum(dim=-1, keepdim=True)
    return torch.where(totals > 0, mixing / totals.clamp(min=torch.finfo(mixing.dtype).tiny), 0.0).float()


def weighted_mixing(weights: Tensor, contributions: Tensor, real: Tensor, rows: slice) -> Tensor:
    """``(B, R, N)`` float64: ``weights`` ``(B, R, r)`` times the query rows ``rows`` of
    :func:`normalised_mixing`, from their contributions ``(B, r, N)``, the rows never
    normalised: each row's sum divides its weights instead (one pass over the block
    where normalising took six)."""
    kept = contributions.double()
    if not bool(real.all()):
        kept.masked_fill_(~real[:, None, :].to(kept.device), 0.0)
    totals = kept.sum(dim=-1)
    scale = torch.where(totals > 0, 1.0 / totals.clamp(min=torch.finfo(kept.dtype).tiny), 0.0)
    scale = scale * real[:, rows].to(scale.device)
    return torch.bmm(weights * scale[:, None, :], kept)


@dataclass(frozen=True)
class LinearNorm:
    r"""A token-wise norm (LayerNorm, RMSNorm) as the linear map it is at the statistics of
    the states it normalised: :math:`N(x_i) = L_i(x_i) + \beta` with
    :math:`L_i(z) = \gamma \odot P(z) \, s_i`, :math:`P` the centring (LayerNorm) or the
    identity (RMSNorm) and :math:`s_i` one over token i's standard deviation (or root mean
    square), its epsilon included.

    Attributes:
        weight: ``(D,)`` float32 :math:`\gamma` as the norm multiplies it.
        scale: ``(B, N)`` float32 :math:`s_i` per token.
        centred: whether the norm subtracts the mean.
        bias: ``(D,)`` float32 :math:`\beta`, or None.
    """

    weight: Tensor
    scale: Tensor
    centred: bool
    bias: Tensor | None

    def linear(self, vectors: Tensor, rows: slice | None = None) -> Tensor:
        """:math:`L_i` of ``vectors`` ``(B, r, ..., D)`` whose second dimension is the
        tokens ``rows`` (default: all)."""
        scale = self.scale[:, rows if rows is not None else slice(None)]
        return self.features(vectors) * scale.reshape(*scale.shape, *[1] * (vectors.dim() - 2))

    def features(self, vectors: Tensor) -> Tensor:
        r""":math:`\gamma \odot P(z)` of ``vectors`` ``(..., D)``: :math:`L_i` without token
        i's scale :math:`s_i`, the same for every token."""
        if self.centred:
            vectors = vectors - vectors.mean(dim=-1, keepdim=True)
        return vectors * self.weight

    def __call__(self, states: Tensor) -> Tensor:
        """The norm itself, ``(B, N, D)`` from ``(B, N, D)`` states it was measured on."""
        normed = self.linear(states.float())
        return normed if self.bias is None else normed + self.bias


def head_vectors(values: Tensor, projection: Tensor) -> Tensor:
    r"""``(B, H, K, D)`` float32 :math:`f^m(x_j) = v^m_j W_O^{m\top}`: each head's value of
    each key through its slice of the output projection ``(D, H · Dv)``; ``values``
    ``(B, H, K, Dv)``."""
    heads, head_dim = values.shape[1], values.shape[-1]
    per_head = projection.float().reshape(projection.shape[0], heads, head_dim)
    return torch.einsum("bhkv,dhv->bhkd", values.float(), per_head)


def transformed_vectors(
    rows_probs: Tensor, vectors: Tensor, inputs: Tensor, rows: slice, norm: LinearNorm | None,
    attention_norm: LinearNorm | None = None,
) -> Tensor:
    """``(B, r, N, D)`` float32 :math:`T_i(x_j)` for the query rows ``rows``: the attention
    ``rows_probs`` ``(B, H, r, N)`` of those rows over :func:`head_vectors` ``vectors``
    (through ``attention_norm``'s linear map: a norm on the attention output before the
    residual), plus each row's own input (``inputs`` ``(B, N, D)``, the residual), through
    ``norm``'s linear map (None: a pre-norm layer)."""
    mixed = torch.einsum("bhik,bhkd->bikd", rows_probs.float(), vectors)
    if attention_norm is not None:
        mixed = attention_norm.linear(mixed, rows)
    own = torch.arange(rows.start, rows.stop, device=mixed.device)
    mixed[:, own - rows.start, own] += inputs[:, rows].float()
    return mixed if norm is None else norm.linear(mixed, rows)


ALTI_COMPILE_MIN_PAIRS = 512 * 512
"""Layers of at least this many (query, key) pairs compute ALTI's contributions through
:func:`~captum_attention.maps.streaming.compiled_block` (on the CPU, once its eager budget is
spent): one C++ loop over a block of rows that never holds the block's transformed
vectors, where the eager computation writes and reads them about five times over."""

ALTI_TILE = {"cpu": (128, 32)}
"""The query rows of one block of a layer's contributions and the keys of one tile
(:class:`KeyTiles`), per device type, in the layers that :data:`ALTI_COMPILE_MIN_PAIRS`
compiles (elsewhere a block takes as many rows as memory allows, over every key they
attend to, as one tile): 32 keys' vectors of every head (256 KiB at 8 heads of a 256-wide
model) stay in a core's cache while the block's 128 rows read them, where a whole row's
keys (128 MiB at 16k tokens) came from memory once per row, four times slower, compiled or
eager. The compiled loop takes the whole block, tile after tile; eagerly, one tile's
transformed vectors are built at a time."""


def _compiles(tokens: int) -> bool:
    """Whether a layer over ``tokens`` keys is large enough to compile its contributions
    (:data:`ALTI_COMPILE_MIN_PAIRS`)."""
    return tokens**2 >= ALTI_COMPILE_MIN_PAIRS


def alti_tile(tokens: int, device: torch.device) -> tuple[int, int] | None:
    """The rows and keys of one piece of :func:`alti_contributions` over ``tokens`` keys on
    ``device`` (:data:`ALTI_TILE`); None where a block takes every key at once (a device
    without pieces computes its compiled blocks whole)."""
    kind = device_kind(device)
    if _compiles(tokens) and FUSED_DEVICES.get(kind, False):
        return ALTI_TILE.get(kind)
    return None


@dataclass(frozen=True)
class KeyTiles:
    r"""A layer's :func:`head_vectors` :math:`f^m(x_j)` as ALTI's contributions read them:
    in tiles of ``size`` consecutive keys, ``vectors`` ``(B, T, H, size, D)``, the last
    tile's missing keys zero (:func:`key_tiles`). One tile's vectors of every head lie
    together in memory, where a block of rows reads them over and over."""

    vectors: Tensor
    size: int

    def of_keys(self, keys: Tensor) -> Tensor:
        """``(B, H, k, D)`` the vectors of the keys ``keys`` ``(k,)``."""
        return self.vectors[:, keys // self.size, :, keys % self.size].permute(1, 2, 0, 3)

    def pieces(self, probs: Tensor, first_key: int, stop_key: int) -> tuple[slice, Tensor, Tensor]:
        """The keys, the attention ``(B, t, H, r, k)`` and the vectors ``(B, t, H, k, D)``
        of the tiles that hold the keys ``first_key`` to ``stop_key``, from the attention
        ``probs`` ``(B, H, r, K)`` (keys past K: 0); with one tile, exactly those keys."""
        if self.vectors.shape[1] == 1:
            keys = slice(first_key, stop_key)
            return keys, probs[:, None, ..., keys], self.vectors[..., keys, :]
        used = slice(first_key // self.size, (stop_key - 1) // self.size + 1)
        keys = slice(used.start * self.size, used.stop * self.size)
        block = probs[..., keys]
        if block.shape[-1] < keys.stop - keys.start:
            block = F.pad(block, (0, keys.stop - keys.start - block.shape[-1]))
        laid_out = block.unflatten(-1, (used.stop - used.start, self.size)).permute(0, 3, 1, 2, 4).contiguous()
        return keys, laid_out, self.vectors[:, used]


def key_tiles(vectors: Tensor, size: int) -> KeyTiles:
    """:class:`KeyTiles` of ``vectors`` ``(B, H, N, D)``, ``size`` keys a tile (N: one
    tile, the vectors as they are)."""
    tokens = vectors.shape[2]
    count = -(-tokens // size)
    padded = vectors if count * size == tokens else F.pad(vectors, (0, 0, 0, count * size - tokens))
    laid_out = padded.unflatten(2, (count, size)).transpose(1, 2)
    return KeyTiles(laid_out if count == 1 else laid_out.contiguous(), size)


def alti_contributions(
    rows_probs: Tensor, tiles: KeyTiles, residual: Tensor, outputs: Tensor, rows: slice, scale: Tensor | None = None
) -> Tensor:
    r"""``(B, r, N)`` float32 ALTI's :math:`\max(0, \lVert y_i \rVert_1 - \lVert y_i -
    T_i(x_j) \rVert_1)` for the query rows ``rows`` (:func:`transformed_vectors`' :math:`T_i`),
    summed feature by feature, :math:`\sum_d |y_{id}| - |y_{id} - T_i(x_j)_d|`, so that no
    two large norms cancel.

    Args:
        rows_probs: ``(B, H, r, K)`` the rows' attention over the first K ≤ N keys (the
            later ones not attended).
        tiles: :func:`key_tiles` of the :func:`head_vectors` ``(B, H, N, D)``, in a
            post-norm layer (or one with a norm on the attention output) through the
            norm's :meth:`LinearNorm.features`.
        residual: ``(B, N, D)`` each token's own input, in a post-norm layer through the
            norm's :meth:`LinearNorm.linear`.
        outputs: ``(B, r, D)`` the block's outputs :math:`y_i` at the rows.
        rows: the query rows, as a slice of the keys.
        scale: ``(B, N)`` that norm's :attr:`LinearNorm.scale`; None in a pre-norm layer
            without one.
    """
    probs = rows_probs.float() if scale is None else rows_probs.float() * scale[:, None, rows, None]
    outputs = outputs.float()
    tokens = residual.shape[1]
    contributions = probs.new_zeros(probs.shape[0], probs.shape[2], tokens)
    attended = (probs.amax(dim=(0, 1, 2)) > 0).nonzero()[:, 0]  # probabilities (times a norm's scale) are never negative
    if len(attended):  # a key no row attends to adds nothing (T = 0): a causal block's later keys, a window's far ones
        covered, attention, vectors = tiles.pieces(probs, int(attended[0]), int(attended[-1]) + 1)
        near = compiled_block(_mixed_nearness, device_kind(probs.device), _compiles(tokens), attention, vectors, outputs)
        stop = min(covered.stop, tokens)
        contributions[:, :, covered.start : stop] = near.transpose(1, 2).flatten(2)[..., : stop - covered.start]
    own = torch.arange(probs.shape[2], device=probs.device)
    keys = own + rows.start
    own_vectors = (probs[:, :, own, keys, None] * tiles.of_keys(keys)).sum(dim=1) + residual[:, rows].float()
    contributions[:, own, keys] = _nearness(outputs, own_vectors)
    return contributions.clamp_(min=0.0)


def _mixed_nearness(probs: Tensor, vectors: Tensor, outputs: Tensor) -> Tensor:
    r"""``(B, t, r, k)`` :func:`_nearness` of each row's output ``(B, r, D)`` to
    :math:`\sum_m \alpha^m_{ij} f^m(x_j)` (the residual left out), from the attention
    ``(B, t, H, r, k)`` and the vectors ``(B, t, H, k, D)`` of t tiles of k keys."""
    if torch.compiler.is_compiling():  # one loop over the tiles that keeps the sum in registers, never a (B, r, k, D) tensor
        mixed = probs[:, :, 0, :, :, None] * vectors[:, :, 0, None]
        for head in range(1, vectors.shape[2]):
            mixed = mixed + probs[:, :, head, :, :, None] * vectors[:, :, head, None]
        return _nearness(outputs[:, None, :, None], mixed)
    return torch.stack(  # eagerly, one tile's transformed vectors (B, r, k, D) at a time
        [_nearness(outputs[:, :, None], torch.einsum("bhik,bhkd->bikd", probs[:, t], vectors[:, t])) for t in range(probs.shape[1])],
        dim=1,
    )


def _nearness(outputs: Tensor, vectors: Tensor) -> Tensor:
    r""":math:`\sum_d |y_d| - |y_d - t_d|` over the last dimension, ``outputs`` broadcast
    against ``vectors``."""
    return (outputs - vectors).abs_().neg_().add_(outputs.abs()).sum(dim=-1)


def logit_direction(unembedding: Tensor, final_norm: LinearNorm | None, query: Tensor) -> Tensor:
    r"""``(B, D)`` float32 :math:`u_q`: the direction whose dot product with a vector added
    to the residual stream at ``query`` ``(B,)`` is what it adds to a logit, the
    unembedding rows ``(B, D)`` through the final norm's linear map there (its transpose:
    :math:`P(\gamma \odot U_w) s_q`)."""
    if final_norm is None:
        return unembedding.float()
    weighted = unembedding.float() * final_norm.weight
    if final_norm.centred:
        weighted = weighted - weighted.mean(dim=-1, keepdim=True)
    batch = torch.arange(len(query), device=query.device)
    return weighted * final_norm.scale[batch, query][:, None]


def logit_rollout(layer_logits: Sequence[Tensor], mixing: Sequence[Tensor]) -> Tensor:
    r"""``(B, N)``: :math:`\sum_l \Delta^l C^{l-1} \cdots C^1` from each layer's
    ``(B, N)`` logit shares :math:`\Delta^l` and ``(B, N, N)`` mixing matrices
    :math:`C^l` (in forward order; the last layer's is not used), in float64."""
    total = layer_logits[-1].double()
    for shares, layer_mixing in zip(reversed(layer_logits[:-1]), reversed(mixing[:-1])):
        total = torch.bmm(total[:, None, :], layer_mixing.double())[:, 0] + shares.double()
    return total.float()
