r"""AttnLRP's propagation rules (Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise
Relevance Propagation for Transformers", ICML 2024) as modified gradients.

Relevance is written as input times a modified gradient: an operation ``y = f(x)`` that
receives the gradient :math:`g_y` (so its output holds :math:`R_y = y \odot g_y`) passes
:math:`g_x` back, and its input holds :math:`R_x = x \odot g_x`. Each rule below changes
only the backward of its operation; the forward values are the model's own.

- **Linear layers** (ε-rule with ε → 0): the ordinary gradient. :math:`R_x = x \odot
  W^\top (R_y / y)` is :math:`x \odot W^\top g_y`; a bias absorbs :math:`b \odot g_y`.
  Optionally the generalised γ-rule (:func:`linear_rule`), which the paper uses in vision
  transformers to favour the contributions of an output's own sign.
- **Softmax** (Proposition 3.1): :math:`R_x = x \odot (R_y - s \odot \sum_j R_{y,j})`.
  With :math:`R_y = s \odot g_y` this is :math:`x \odot s \odot (g_y - \sum_j s_j g_{y,j})`,
  :math:`x` times the ordinary softmax gradient: the attention kernel's own backward
  applies it (the part :math:`\sum_j R_{y,j} - \sum_i R_{x,i}` is absorbed, as a bias).
- **Bilinear products** (uniform rule), :math:`Q K^\top`, :math:`A V` and the
  element-wise product of two activations (gated MLPs): each factor gets half of
  :math:`R_y`, i.e. half the ordinary gradient (:func:`share_gradient` with ½). Since the
  product is homogeneous of degree 2, the halves sum to :math:`R_y` exactly.
- **Element-wise non-linearities** (identity rule), GELU, SiLU, tanh, …:
  :math:`R_x = R_y`, i.e. :math:`g_x = g_y \odot y / x` (:func:`identity_rule`).
- **LayerNorm and RMSNorm**: the identity rule on the division by the standard deviation
  (or root mean square), i.e. the ordinary gradient with that scale held constant
  (:func:`layer_norm_rule`, :func:`rms_norm_rule`); the mean subtraction is linear and
  kept, the affine bias absorbs its share.

Every rule conserves relevance except where a bias (of a linear layer, a norm, the
attention mask or a position bias) or the softmax absorbs some; the conservation tests
account for each absorbed term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function


class _SharedGradient(Function):
    """Forward: ``x`` unchanged (a view); backward: the gradient times ``share``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, share: float) -> Tensor:
        ctx.share = share
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.share, None


def share_gradient(x: Tensor, share: float) -> Tensor:
    """``x``, passing back ``share`` times the gradient it receives."""
    return _SharedGradient.apply(x, share)


class _IdentityRule(Function):
    """Forward: ``y``; backward to ``x``: the gradient times ``y / x`` (0 where x = 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor) -> Tensor:
        ctx.save_for_backward(torch.where(x == 0, 0.0, y / x))
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (ratio,) = ctx.saved_tensors
        return grad * ratio, None


def identity_rule(x: Tensor, y: Tensor) -> Tensor:
    """``y = f(x)`` of an element-wise non-linearity ``f``, with relevance passed through
    unchanged: :math:`x \\odot g_x = y \\odot g_y`. ``y`` is the model's output, detached."""
    return _IdentityRule.apply(x, y)


def _normalised_dims(x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


class _LayerNormRule(Function):
    """``F.layer_norm`` whose backward to ``x`` holds the standard deviation constant:
    :math:`g_x = (u - \\bar u) / \\sigma` with :math:`u = w \\odot g_y`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        dims = _normalised_dims(x, normalized_shape)
        ctx.dims = dims
        ctx.save_for_backward(torch.rsqrt(x.float().var(dim=dims, unbiased=False, keepdim=True) + eps), weight)
        return F.layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse_std, weight = ctx.saved_tensors
        scaled = grad.float() if weight is None else grad.float() * weight.float()
        centred = scaled - scaled.mean(dim=ctx.dims, keepdim=True)
        return (centred * inverse_std).to(grad.dtype), None, None, None, None


def layer_norm_rule(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5
) -> Tensor:
    """``F.layer_norm(x, ...)``, relevance through it by the identity rule on the division
    by the standard deviation (no gradient reaches ``weight`` or ``bias``)."""
    return _LayerNormRule.apply(x, tuple(normalized_shape), weight, bias, eps)


class _RMSNormRule(Function):
    """``F.rms_norm`` whose backward to ``x`` holds the root mean square constant:
    :math:`g_x = w \\odot g_y / \\mathrm{rms}(x)`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None) -> Tensor:
        dims = _normalised_dims(x, normalized_shape)
        floor = torch.finfo(x.dtype).eps if eps is None else eps
        ctx.save_for_backward(torch.rsqrt(x.float().pow(2).mean(dim=dims, keepdim=True) + floor), weight)
        return F.rms_norm(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse_rms, weight = ctx.saved_tensors
        scaled = grad.float() if weight is None else grad.float() * weight.float()
        return (scaled * inverse_rms).to(grad.dtype), None, None, None


def rms_norm_rule(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """``F.rms_norm(x, ...)``, relevance through it by the identity rule on the division by
    the root mean square."""
    return _RMSNormRule.apply(x, tuple(normalized_shape), weight, eps)


class _GammaLinear(Function):
    r"""``F.linear`` whose backward is the generalised γ-rule (Montavon et al., 2019; as
    zennit's ``Gamma``): positive outputs share their relevance in proportion to
    :math:`z^+ = x^+ (W + \gamma W^+)^\top + x^- (W + \gamma W^-)^\top + b + \gamma b^+`,
    negative ones to :math:`z^-` (the signs of the added parts swapped), so that
    contributions of the output's own sign count :math:`1 + \gamma` times."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, gamma: float, stabilizer: float) -> Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.gamma, ctx.stabilizer = gamma, stabilizer
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        gamma = ctx.gamma
        favour_positive = weight + gamma * weight.clamp(min=0)
        favour_negative = weight + gamma * weight.clamp(max=0)
        positive_x, negative_x = x.clamp(min=0), x.clamp(max=0)
        output = F.linear(x, weight, bias)
        positive_bias = None if bias is None else bias + gamma * bias.clamp(min=0)
        negative_bias = None if bias is None else bias + gamma * bias.clamp(max=0)
        z_positive = F.linear(positive_x, favour_positive, positive_bias) + F.linear(negative_x, favour_negative)
        z_negative = F.linear(positive_x, favour_negative, negative_bias) + F.linear(negative_x, favour_positive)

        def share(z: Tensor, sign: Tensor) -> Tensor:  # R_y / z on the outputs of that sign, R_y = y·g
            stabilised = z + ctx.stabilizer * torch.where(z >= 0, 1.0, -1.0)
            return torch.where(sign, output * grad / stabilised, 0.0)

        up, down = share(z_positive, output > 0), share(z_negative, output < 0)
        on_positive = up @ favour_positive + down @ favour_negative
        on_negative = up @ favour_negative + down @ favour_positive
        return torch.where(x > 0, on_positive, torch.where(x < 0, on_negative, 0.0)), None, None, None, None


def linear_rule(x: Tensor, weight: Tensor, bias: Tensor | None = None, gamma: float = 0.0, stabilizer: float = 1e-6) -> Tensor:
    """``F.linear(x, weight, bias)`` under the ε-rule with ε → 0 (``gamma=0``: the ordinary
    gradient) or the generalised γ-rule (:class:`_GammaLinear`)."""
    return F.linear(x, weight, bias) if gamma == 0 else _GammaLinear.apply(x, weight, bias, gamma, stabilizer)


@dataclass(frozen=True)
class AttnLRPRules:
    """The rules of this module as the capture layer applies them
    (:class:`~captum_attention.capture.lrp.PropagationRules`), with the linear layers' γ."""

    gamma: float = 0.0

    share_gradient = staticmethod(share_gradient)
    identity_rule = staticmethod(identity_rule)
    layer_norm_rule = staticmethod(layer_norm_rule)
    rms_norm_rule = staticmethod(rms_norm_rule)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_rule(x, weight, bias, self.gamma)


def token_relevance(embeddings: Tensor, grad: Tensor) -> Tensor:
    """``(B, T)`` float32 relevance per token: :math:`\\sum_d e_{td} \\, g_{td}`; a patch
    convolution's ``(B, d, h, w)`` output gives its ``T = h·w`` patches in row-major order,
    the order in which vision transformers flatten them into tokens."""
    products = embeddings.detach().float() * grad.float()
    return products.sum(dim=1).flatten(1) if products.dim() == 4 else products.sum(dim=-1)
