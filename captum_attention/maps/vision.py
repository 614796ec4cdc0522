"""Vision transformers: token scores on the patch grid.

A ViT's sequence is its prefix tokens ([CLS], and DeiT's distillation token) followed by
one token per patch in row-major order.
"""

from __future__ import annotations

import torch
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


def windows_on_patch_grid(window_maps: Tensor, stage: tuple[int, int], window: int, shift: int, scale: int) -> Tensor:
    r"""One stage's shifted-window attention ``(B·windows, H, w², w²)`` as maps over the
    first stage's patches, ``(B, H, N, N)`` with ``N = rows·scale · columns·scale``.

    As Swin partitions them: the stage's ``rows × columns`` token grid, padded to multiples
    of ``window`` and rolled by ``-shift`` along both axes, cut into ``window × window``
    windows in row-major order, each read row-major. A stage token stands for the
    ``scale × scale`` first-stage patches it was merged from; every patch takes its
    token's row, and each key's weight is shared equally among its patches:

    .. math:: \tilde A_{ij} = A_{t(i)\,t(j)} / \mathrm{scale}^2

    (zero where :math:`t(i)` and :math:`t(j)` lie in different windows), so rows keep
    their sums, less the weight the model put on the window padding. Gradients use the
    same map: summed over a token pair's patches, :math:`\tilde A \odot \tilde G` gives
    back :math:`A \odot G`.

    Args:
        window_maps: ``(B·windows, heads, w², w²)``, as the model's window attention
            computed them.
        stage: ``(rows, columns)`` of the stage's tokens in this call.
        window: the window's side ``w`` in this call.
        shift: the cyclic shift (0 for unshifted windows).
        scale: first-stage patches per stage token along each side (``2^stage``).

    Returns:
        ``(B, heads, N, N)`` tensor, patches in row-major order.
    """
    rows, columns = stage
    padded_rows, padded_columns = -(-rows // window) * window, -(-columns // window) * window
    device = window_maps.device
    positions = torch.arange(padded_rows * padded_columns, device=device).view(padded_rows, padded_columns)
    slots = (
        positions.roll((-shift, -shift), (0, 1))
        .view(padded_rows // window, window, padded_columns // window, window)
        .permute(0, 2, 1, 3)
        .reshape(-1, window * window)
    )  # (windows, w²): the position each window slot holds
    windows = slots.shape[0]
    window_of = torch.empty(padded_rows * padded_columns, dtype=torch.long, device=device)
    slot_of = torch.empty_like(window_of)
    window_of[slots.flatten()] = torch.arange(windows, device=device).repeat_interleave(window * window)
    slot_of[slots.flatten()] = torch.arange(window * window, device=device).repeat(windows)
    token_rows = torch.arange(rows * scale, device=device) // scale
    token_columns = torch.arange(columns * scale, device=device) // scale
    token = (token_rows[:, None] * padded_columns + token_columns[None, :]).flatten()  # each patch's position
    patch_window, patch_slot = window_of[token], slot_of[token]
    batch, heads = window_maps.shape[0] // windows, window_maps.shape[1]
    maps = window_maps.reshape(batch, windows, heads, window * window, window * window)
    lifted = maps[:, patch_window[:, None], :, patch_slot[:, None], patch_slot[None, :]].permute(2, 3, 0, 1)
    same_window = patch_window[:, None] == patch_window[None, :]
    return lifted * same_window.to(lifted.dtype) / scale**2
