"""Vision transformers: token scores on the patch grid.

A ViT's sequence is its prefix tokens ([CLS], and DeiT's distillation token) followed by
one token per patch in row-major order.
"""

from __future__ import annotations

import torch
from torch import Tensor


def patch_grid(token_scores: Tensor, grid: tuple[int, int]) -> Tensor:
    """The patch tokens' scores ``(..., T)`` as ``(..., rows, columns)``; prefix tokens dropped.

    The prefix is the ``T - rows·columns`` leading tokens ([CLS], distillation token).
    """
    rows, columns = grid
    prefix = token_scores.shape[-1] - rows * columns
    if prefix < 0:
        raise ValueError(
            f"{token_scores.shape[-1]} tokens cannot hold a {rows}×{columns} patch grid: the "
            "images do not match the model's image size and patch size."
        )
    return token_scores[..., prefix:].reshape(*token_scores.shape[:-1], rows, columns)


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
    device, tokens = window_maps.device, rows * columns
    positions = torch.arange(padded_rows * padded_columns, device=device).view(padded_rows, padded_columns)
    slots = (
        positions.roll((-shift, -shift), (0, 1))
        .view(padded_rows // window, window, padded_columns // window, window)
        .permute(0, 2, 1, 3)
        .reshape(-1, window * window)
    )  # (windows, w²): the padded grid position each window slot holds
    slot_rows, slot_columns = slots // padded_columns, slots % padded_columns
    real = (slot_rows < rows) & (slot_columns < columns)
    token = slot_rows * columns + slot_columns
    pairs = real[:, :, None] & real[:, None, :]  # (windows, w², w²): both tokens inside the grid
    batch, heads = window_maps.shape[0] // slots.shape[0], window_maps.shape[1]
    maps = window_maps.reshape(batch, slots.shape[0], heads, window * window, window * window).transpose(1, 2)
    stage_map = window_maps.new_zeros(batch, heads, tokens * tokens)
    stage_map.index_copy_(-1, (token[:, :, None] * tokens + token[:, None, :])[pairs], maps[:, :, pairs] / scale**2)
    blocks = stage_map.view(batch, heads, rows, 1, columns, 1, rows, 1, columns, 1)
    patches = tokens * scale**2
    return blocks.expand(-1, -1, -1, scale, -1, scale, -1, scale, -1, scale).reshape(batch, heads, patches, patches)


def stage_keys_on_patch_grid(maps: Tensor, stage: tuple[int, int], scale: int) -> Tensor:
    r"""Attention over a stage's tokens ``(B, H, Q, rows·columns)`` (a decoder's
    cross-attention to a window encoder's last stage, Donut's) as maps over the first
    stage's patches, ``(B, H, Q, N)`` with ``N = rows·scale · columns·scale``: each key's
    weight shared equally among the ``scale × scale`` patches merged into it,

    .. math:: \tilde A_{qj} = A_{q\,t(j)} / \mathrm{scale}^2,

    so rows keep their sums.

    Args:
        maps: ``(B, heads, queries, rows·columns)``, keys row-major.
        stage: ``(rows, columns)`` of the stage's tokens.
        scale: first-stage patches per stage token along each side.

    Returns:
        ``(B, heads, queries, N)`` tensor, patches in row-major order.
    """
    rows, columns = stage
    batch, heads, queries = maps.shape[:3]
    cells = maps.reshape(batch, heads, queries, rows, 1, columns, 1) / scale**2
    return cells.expand(-1, -1, -1, -1, scale, -1, scale).reshape(batch, heads, queries, rows * columns * scale**2)


def reduced_keys_on_patch_grid(maps: Tensor, stage: tuple[int, int], reduction: int, scale: int) -> Tensor:
    r"""One stage's attention over spatially reduced keys ``(B, H, N_s, N_s / reduction²)``
    as maps over the first stage's patches, ``(B, H, N, N)`` with
    ``N = rows·scale · columns·scale``.

    As SegFormer reduces them: key ``u`` is one ``reduction × reduction`` cell of the
    stage's ``rows × columns`` token grid (a strided convolution), cells in row-major
    order. A stage token stands for the ``scale × scale`` first-stage patches merged into
    it, so a key for ``(scale·reduction)²`` patches; every patch takes its token's row and
    each key's weight is shared equally among its patches:

    .. math:: \tilde A_{ij} = A_{t(i)\,u(j)} / (\mathrm{scale} \cdot \mathrm{reduction})^2

    so rows keep their sums.

    Args:
        maps: ``(B, heads, rows·columns, rows·columns / reduction²)``.
        stage: ``(rows, columns)`` of the stage's tokens in this call, multiples of
            ``reduction``.
        reduction: the side of the cell each key is reduced from.
        scale: first-stage patches per stage token along each side.

    Returns:
        ``(B, heads, N, N)`` tensor, patches in row-major order.
    """
    rows, columns = stage
    batch, heads = maps.shape[:2]
    cells = maps.reshape(batch, heads, rows, 1, columns, 1, rows // reduction, 1, columns // reduction, 1)
    cells = cells / (scale * reduction) ** 2
    side = scale * reduction
    patches = rows * columns * scale**2
    return cells.expand(-1, -1, -1, scale, -1, scale, -1, side, -1, side).reshape(batch, heads, patches, patches)
