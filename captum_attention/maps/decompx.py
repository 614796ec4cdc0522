r"""DecompX: every hidden state as a sum of its input tokens' shares (pure tensor math).

Modarressi, Fayyaz, Aghazadeh, Yaghoobzadeh & Pilehvar, "DecompX: Explaining Transformers
Decisions by Propagating Token Decomposition", ACL 2023. Token i's state is kept as
:math:`x_i = \sum_k x_{i,k}`, one vector per input token k, and carried through every
module as the linear map the module is at the forward's own point:

- attention at its probabilities: :math:`\sum_j \alpha_{ij} W_O W_V x_{j,k}`;
- a norm at its token's statistics, :math:`\gamma \odot P(x_{i,k})\, s_i`
  (:class:`~captum_attention.maps.LinearNorm`);
- an activation neuron by neuron at its zero-origin slope,
  :math:`x_{i,k} \cdot \mathrm{act}(z_i) / z_i` with :math:`z_i` the actual
  pre-activation (the authors' ``GeLU_ZO``; their pooler's ``tanh`` the same way);
- a linear map as itself, its bias :math:`b` shared among the tokens by the absolute
  dot products of their shares with it (the authors' ``absdot``,
  :func:`distribute_bias`).

The value projection's bias is carried into the output projection's,
:math:`b = W_O b_V + b_O` (the probabilities of a row sum to one), and shared at the
residual sum by the shares of attention and residual together; in the first layer, where
every token is its own share, each token's value keeps its bias. The shares add up to
the model's logits exactly, bias included.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.autograd import Function

DOT_FLOOR = 1e-12
"""What the authors add to the sum of the absolute dot products, and to the
pre-activation they divide by."""


def distribute_bias(shares: Tensor, bias: Tensor, by: Tensor | None = None) -> Tensor:
    r"""``shares`` ``(B, K, ..., F)`` with ``bias`` (broadcastable to them) added, token k
    taking :math:`|\langle y_k, b\rangle| / (\sum_{k'} |\langle y_{k'}, b\rangle| + 10^{-12})`
    of it, with :math:`y` the shares themselves or ``by`` (the authors'
    ``bias_decomposer``, ``absdot``; at the residual sum, by attention and residual
    together)."""
    weights = ((shares if by is None else by) * bias).sum(dim=-1, keepdim=True).abs()
    weights = weights / (weights.sum(dim=1, keepdim=True) + DOT_FLOOR)
    return shares + weights * bias


def zero_origin_slope(pre_activation: Tensor, activation: Tensor) -> Tensor:
    r""":math:`\mathrm{act}(z) / (z + 10^{-12})` neuron by neuron (the authors' ``GeLU_ZO``
    and ``tanh`` ``ZO``)."""
    return activation / (pre_activation + DOT_FLOOR)


LinearAt = Callable[[Tensor, Tensor], Callable[[Tensor], Tensor] | None]
"""``at(input, output)``: the linear map a module was at that call, or None where it is
held (no gradient passes); asked in the backward, so that the forward may decide later."""


class _Linearised(Function):
    """Forward: the module's own ``output``; backward: the vector-Jacobian product of the
    linear map ``at(x, output)`` gives (none where it gives None)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output: Tensor, at: LinearAt) -> Tensor:
        ctx.save_for_backward(x, output)
        ctx.at = at
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        x, output = ctx.saved_tensors
        linear = ctx.at(x, output)
        if linear is None:
            return None, None, None
        with torch.enable_grad():
            leaf = x.detach().float().requires_grad_()
            (passed,) = torch.autograd.grad(linear(leaf), leaf, grad.float())
        return passed.to(x.dtype), None, None


def linearised(x: Tensor, output: Tensor, at: LinearAt) -> Tensor:
    """``output`` of a module on ``x``, its values the module's own, its backward the
    linear map ``at`` names (DecompX's point of that module: a norm at its statistics,
    an activation at its zero-origin slope, a gate held)."""
    return _Linearised.apply(x, output.detach(), at)


def held_attention(probs: Tensor, values: Tensor, groups: int) -> Tensor:
    """``(B, S, Q, H, Dv)``: each of ``S`` rows' values ``(B, S, H / groups, K, Dv)``
    mixed by the forward's probabilities ``(B, H, Q, K)`` (the same for every row)."""
    return torch.einsum("bhqk,bshkd->bsqhd", probs.to(values.dtype), values.repeat_interleave(groups, dim=2))


def unbiased_outputs(outputs: Tensor, probs: Tensor, first_layer: bool) -> Tensor:
    r"""``(B, 1 + K, Q, H, Dv)``: the attention outputs of a zero input (index 0) and of
    each token's share, with the value bias taken out of the shares.

    Args:
        outputs: ``(B, 1 + K, Q, H, Dv)`` the attention's outputs on those rows, whose
            values each carry the bias :math:`b_V` (the zero input's output is
            :math:`\sum_j \alpha_{ij} b_V`, :math:`b_V` where the row sums to one).
        probs: ``(B, H, Q, K)`` the probabilities that mixed them.
        first_layer: each token is its own share, and its value keeps the bias: share k
            gets :math:`\alpha_{ik} b_V` back, and the zero input nothing.
    """
    bias = outputs[:, :1]
    shares = outputs[:, 1:] - bias
    if not first_layer:
        return torch.cat([bias, shares], dim=1)
    own = probs.permute(0, 3, 2, 1)[..., None].to(outputs.dtype)  # (B, K, Q, H, 1): α_ik per head
    totals = own.sum(dim=1, keepdim=True)  # Σ_j α_ij: 1, or less where a sink takes a share
    value_bias = torch.where(totals > 0, bias / totals.clamp(min=torch.finfo(totals.dtype).tiny), 0.0)
    return torch.cat([torch.zeros_like(bias), shares + own * value_bias], dim=1)
