"""Vision transformers: token scores on the patch grid.

A ViT's sequence is its prefix tokens ([CLS], and DeiT's distillation token) followed by
one token per patch in row-major order.
"""

from __future__ import annotations

from torch import Tensor


def patch_grid(token_scores: Tensor, grid: tuple[int, int]) -> Tensor:
    """The patch tokens' scores ``(B, T)`` as ``(B, rows, columns)``; prefix tokens dropped.

    The prefix is the ``T - rows·columns`` leading tokens ([CLS], distillation token).
    """
    rows, columns = grid
    prefix = token_scores.shape[1] - rows * columns
    if prefix < 0:
        raise ValueError(
            f"{token_scores.shape[1]} tokens cannot hold a {rows}×{columns} patch grid: the "
            "images do not match the model's image size and patch size."
        )
    return token_scores[:, prefix:].reshape(token_scores.shape[0], rows, columns)
