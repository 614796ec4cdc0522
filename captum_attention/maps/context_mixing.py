"""Context mixing: attention weighed by what it moves (pure tensor math).

Kobayashi, Kuribayashi, Yokoi & Inui, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms", EMNLP 2020: head m of a layer adds
:math:`\\alpha^m_{ij} f^m(x_j)` to query i, with :math:`f^m(x_j) = v^m_j W_O^{m\\top}` the
value of token j (its projection's bias included) through head m's slice of the output
projection. The layer's mixing of token j into query i is the norm of their sum over
heads, :math:`\\lVert \\sum_m \\alpha^m_{ij} f^m(x_j) \\rVert` (the authors'
``summed_weighted_norm``; the output projection's bias, shared by every token, left out).

Mohebbi, Zuidema, Chrupała & Alishahi, "Quantifying Context Mixing in Transformers", EACL
2023 (Value Zeroing): layer l mixes token j into token i by how far token i's layer output
moves when token j's value vector is zeroed in every head, the layer re-run on the
previous layer's output,
:math:`C^l_{ij} = 1 - \\cos(\\tilde{x}^{l,\\neg j}_i, x^l_i)`, each row divided by its sum
(:func:`value_zeroing_mixing`); the layers' matrices are then rolled out without a residual
term (the layer output already holds it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def summed_weighted_norm(rows: Tensor, values: Tensor, projection: Tensor) -> Tensor:
    """``(B, K)``: :math:`\\lVert \\sum_m \\alpha^m_j f^m(x_j) \\rVert` per key j, in float32.

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
    """``(V, N)`` float32: how far each token's layer output moves in each re-run,
    :math:`1 - \\cos(\\tilde{x}^{\\neg j}_i, x_i)` (computed in float64).

    Args:
        original: ``(V, N, D)`` the layer's outputs of the re-runs' examples.
        zeroed: ``(V, N, D)`` the layer's outputs re-run with one token's value zeroed.
    """
    return (1.0 - F.cosine_similarity(zeroed.double(), original.double(), dim=-1)).float()


def value_zeroing_mixing(distances: Tensor, real: Tensor) -> Tensor:
    """``(B, N, N)`` float32: one layer's Value Zeroing matrix over the ``real`` tokens
    ``(B, N)`` bool, from its distances ``(B, N, N)`` (entry ``(b, i, j)``: token i's
    :func:`value_zeroing_distances` when token j's value is zeroed): the pairs of a
    non-real token 0, each row divided by its sum (a row without any change stays 0)."""
    pairs = real[:, :, None] & real[:, None, :]
    mixing = torch.where(pairs.to(distances.device), distances.double(), 0.0)
    totals = mixing.sum(dim=-1, keepdim=True)
    return torch.where(totals > 0, mixing / totals.clamp(min=torch.finfo(mixing.dtype).tiny), 0.0).float()
