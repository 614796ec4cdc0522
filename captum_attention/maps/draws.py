"""Counter-based random draws: each number a pure function of a seed and its integer
coordinates (example, layer, head, row, key, ...).

A generator's numbers depend on how many were drawn before them, so a shuffle drawn over a
batch changes with the batch it comes in, its padding and the order its blocks are
computed in. These do not: an example's draws are the same alone or in any batch, under
left or right padding, in one ``(B, H, Q, K)`` tensor or block by block.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

DRAW_RANGE = 2**32
"""Draws are integers in ``[0, DRAW_RANGE)``."""

_MASK = DRAW_RANGE - 1
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)  # odd and below 2**31: int64 products never overflow


def _round(values: Tensor, multiplier: int = _MULTIPLIERS[0]) -> Tensor:
    """One xor-shift-multiply round over int64 values in ``[0, 2**32)``: a bijection."""
    values = values ^ (values >> 16)
    values = (values * multiplier) & _MASK
    return values ^ (values >> 15)


def _mix(values: Tensor) -> Tensor:
    """A 32-bit integer hash: two rounds."""
    return _round(_round(values, _MULTIPLIERS[0]), _MULTIPLIERS[1])


def hashed_draws(seeds: Tensor | int, *coordinates: Tensor | int) -> Tensor:
    """int64 draws in ``[0, DRAW_RANGE)``, hashed from ``seeds`` and each coordinate in turn.

    Each coordinate is hashed at its own shape and joined to the draws so far by one round
    at the broadcast shape, so that a ``(B, H, Q, K)`` tensor of draws costs a few
    elementwise passes; the orders it gives pass a chi-square test of uniformity
    (``tests/test_metrics_attention.py``).

    Args:
        seeds: one seed per example (or one for all), broadcast with the coordinates.
        coordinates: integer tensors (or ints), broadcast together: where the draw is.

    Returns:
        The draws, of the broadcast shape of the arguments, on the device of the first
        tensor among them.

    Example::

        >>> seeds = example_seeds(input_ids, attention_mask, seed=0)  # (B,), from each example's tokens
        >>> places = real_ranks(attention_mask.bool())  # (B, N), each token's place among the real ones
        >>> draws = hashed_draws(seeds[:, None, None], places[:, :, None], places[:, None, :])  # (B, rows, keys)
        >>> order = draws.masked_fill(attention_mask[:, None] == 0, DRAW_RANGE).argsort(dim=-1)
    """
    device = next((value.device for value in (seeds, *coordinates) if isinstance(value, Tensor)), None)
    draws = _mix(torch.as_tensor(seeds, device=device).long() & _MASK)
    for coordinate in coordinates:
        draws = _round(draws ^ _mix(torch.as_tensor(coordinate, device=draws.device).long() & _MASK))
    return draws


def hashed_normal(seeds: Tensor | int, *coordinates: Tensor | int) -> Tensor:
    """float32 standard normal draws (Box-Muller over two :func:`hashed_draws`).

    Args:
        seeds: as :func:`hashed_draws` takes them.
        coordinates: as :func:`hashed_draws` takes them.

    Returns:
        The draws, of the broadcast shape of the arguments.
    """
    shared = hashed_draws(seeds, *coordinates)  # the two draws' last coordinates, 0 and 1, joined below
    first, second = (_round(shared ^ _mix(torch.tensor(last, device=shared.device))).double() / DRAW_RANGE for last in (0, 1))
    first = first + 0.5 / DRAW_RANGE  # never 0: its log is taken
    return ((-2.0 * first.log()).sqrt() * torch.cos(2.0 * math.pi * second)).float()


def real_ranks(real: Tensor) -> Tensor:
    """``(B, N)`` long: each position's index among its example's real ones (``real``,
    bool): a coordinate that padding does not move."""
    return (real.long().cumsum(dim=-1) - 1).clamp(min=0)
