"""Context mixing: attention weighed by what it moves (pure tensor math).

Kobayashi, Kuribayashi, Yokoi & Inui, "Attention is Not Only a Weight: Analyzing
Transformers with Vector Norms", EMNLP 2020: head m of a layer adds
:math:`\\alpha^m_{ij} f^m(x_j)` to query i, with :math:`f^m(x_j) = v^m_j W_O^{m\\top}` the
value of token j (its projection's bias included) through head m's slice of the output
projection. The layer's mixing of token j into query i is the norm of their sum over
heads, :math:`\\lVert \\sum_m \\alpha^m_{ij} f^m(x_j) \\rVert` (the authors'
``summed_weighted_norm``; the output projection's bias, shared by every token, left out).
"""

from __future__ import annotations

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
