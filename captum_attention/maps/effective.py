"""Effective attention and the identifiability of attention (Brunner et al., ICLR 2020).

A head's contribution to its layer's output is ``A·T`` with ``T = V·H``: the values
``V = E·W^V`` (``K × d_v``) through the head's slice ``H`` (``d_v × d``) of the output
projection. Any change of a row of ``A`` inside the left null space of ``T`` leaves the
output unchanged, and ``dim null(Tᵀ) = K − rank(T) ≥ K − d_v``: once a row sees more keys
than the head has dimensions, its attention is not identifiable. Effective attention keeps
only the part of each row that can reach the output: its orthogonal projection onto the
column space of ``T``, taken over the keys the row can see.

The column space of ``T`` is computed without forming ``T``: with the reduced QR
decomposition ``Hᵀ = Q·R``, ``T = V·Rᵀ·Qᵀ`` and ``Qᵀ`` has full row rank, so
``col(T) = col(V·Rᵀ)``. Ranks follow numpy's ``matrix_rank``: singular values above
``σ_max · max(rows, columns) · ε`` of the values' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def value_basis(values: Tensor, projection: Tensor | None = None) -> Tensor:
    """``(B, H, K, d_v)`` float64 matrices whose column space is that of each head's T.

    Args:
        values: ``(B, H, K, d_v)``, the values the attention weights.
        projection: ``(d, H * d_v)``, the output projection's weight (heads
            concatenated along its input features), or None for ``T = V`` (the same
            column space whenever each head's slice has full row rank, as in trained
            models).
    """
    basis = values.double()
    if projection is None:
        return basis
    heads, head_dim = values.shape[1], values.shape[-1]
    if projection.shape[-1] != heads * head_dim:
        raise ValueError(
            f"The output projection takes {projection.shape[-1]} features but the attention "
            f"has {heads} heads of {head_dim} values: the adapter's output_projection "
            "names the wrong weight."
        )
    slices = projection.detach().double().reshape(projection.shape[0], heads, head_dim).transpose(0, 1)
    triangular = torch.linalg.qr(slices.to(values.device)).R  # (H, d_v, d_v)
    return basis @ triangular.transpose(-1, -2)


def column_space(basis: Tensor, visible: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Orthonormal bases of ``col(T)`` over each row's visible keys, and their ranks.

    Args:
        basis: ``(B, H, K, r)`` from :func:`value_basis`.
        visible: ``(B, Q or 1, K)`` bool, the keys each query row sees.
        dtype: the dtype the values were computed in (it sets the rank tolerance).

    Returns:
        ``(B, H, Q or 1, K, r)`` basis vectors (zero columns beyond the rank, zero on the
        keys a row cannot see) and ``(B, H, Q or 1)`` ranks.
    """
    restricted = basis[:, :, None] * visible[:, None, :, :, None].to(basis.dtype)
    vectors, singular, _ = torch.linalg.svd(restricted, full_matrices=False)
    tolerance = singular[..., :1] * max(restricted.shape[-2:]) * torch.finfo(dtype).eps
    kept = singular > tolerance
    return vectors * kept[..., None, :], kept.sum(dim=-1)


def effective_attention(
    attn_probs: Tensor, values: Tensor, visible: Tensor, real_queries: Tensor, projection: Tensor | None = None
) -> Tensor:
    r"""Each row of ``attn_probs`` without its component in the left null space of T.

    Brunner et al., "On Identifiability in Transformers", ICLR 2020, §4.3:

    .. math::

        \tilde A_{i\cdot} = P_i\,A_{i\cdot}, \qquad P_i = U_i U_i^\top,

    with ``U_i`` an orthonormal basis of the column space of ``T = V·H`` restricted to the
    keys row i sees. ``Ã·T = A·T`` exactly, so the head's output is unchanged; the rows
    of ``Ã`` need not be distributions (they can hold negative weights).

    Args:
        attn_probs: ``(B, H, Q, K)`` probabilities.
        values: ``(B, H, K, d_v)`` values they weight.
        visible: ``(B, Q or 1, K)`` bool, the keys each row sees (its real keys, and
            under a causal mask only those up to the row).
        real_queries: ``(B, Q or 1)`` bool; the rows of padding queries are left as they
            are (they explain nothing, and the model may let them see any key).
        projection: ``(d, H * d_v)`` output projection weight, or None (see
            :func:`value_basis`).

    Returns:
        ``(B, H, Q, K)`` effective attention, in ``attn_probs``' dtype.
    """
    vectors, _ = column_space(value_basis(values, projection), visible, values.dtype)
    rows = attn_probs.double()[..., None, :]  # (B, H, Q, 1, K)
    projected = (rows @ vectors) @ vectors.transpose(-1, -2)
    kept = ~real_queries[:, None, :, None].to(attn_probs.device)
    return torch.where(kept, attn_probs.double(), projected[..., 0, :]).to(attn_probs.dtype)


def null_space_dims(values: Tensor, real_keys: Tensor, projection: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(rank(T), dim null(Tᵀ))`` per example and head, ``(B, H)`` long, over each
    example's real keys: the attention of a row that sees them all is identifiable exactly
    when the null dimension is 0."""
    _, rank = column_space(value_basis(values, projection), real_keys[:, None, :], values.dtype)
    rank = rank[:, :, 0]
    return rank, real_keys.sum(dim=-1, keepdim=True) - rank
