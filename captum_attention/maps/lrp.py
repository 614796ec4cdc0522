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

A rule given a :class:`RuleSwitch` applies in a backward only while the switch is on, and
passes the ordinary gradient otherwise, so that one forward under the rules serves a
relevance backward and an ordinary one (the activations' own graphs are then kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function


class RuleSwitch:
    """Whether the backward of the rules built with it applies them (``rules``, the
    default) or passes the ordinary gradient; read when each backward runs."""

    def __init__(self) -> None:
        self.rules = True


def _applies(switch: RuleSwitch | None) -> bool:
    return switch is None or switch.rules


class _SharedGradient(Function):
    """Forward: ``x`` unchanged (a view); backward: the gradient times ``share``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, share: float, switch: RuleSwitch | None) -> Tensor:
        ctx.share, ctx.switch = share, switch
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return (grad * ctx.share if _applies(ctx.switch) else grad), None, None


def share_gradient(x: Tensor, share: float, switch: RuleSwitch | None = None) -> Tensor:
    """``x``, passing back ``share`` times the gradient it receives."""
    return _SharedGradient.apply(x, share, switch)


class _IdentityRule(Function):
    """Forward: ``y``; backward to ``x``: the gradient times ``y / x`` (0 where x = 0);
    with the switch off, the gradient to ``y``, through its own graph."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, switch: RuleSwitch | None) -> Tensor:
        ctx.save_for_backward(x, y)  # not y / x: both are kept anyway, by f and by the operation reading y
        ctx.switch = switch
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if not _applies(ctx.switch):
            return None, grad, None
        x, y = ctx.saved_tensors
        return grad * torch.where(x == 0, 0.0, y / x), None, None


def identity_rule(x: Tensor, y: Tensor, switch: RuleSwitch | None = None) -> Tensor:
    """``y = f(x)`` of an element-wise non-linearity ``f``, with relevance passed through
    unchanged: :math:`x \\odot g_x = y \\odot g_y`. ``y`` is the model's output; its graph
    is kept only with a ``switch``, which may ask for its ordinary gradient."""
    return _IdentityRule.apply(x, y if switch is not None else y.detach(), switch)


def _ordinary_grad(function: Any, x: Tensor, grad: Tensor, *args: Any) -> Tensor:
    """The ordinary gradient of ``function(x, *args)`` to ``x``, recomputed."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        return torch.autograd.grad(function(leaf, *args), leaf, grad)[0]


def held_constant(x: Tensor, switch: RuleSwitch | None = None) -> Tensor:
    """``x`` as a constant of the backward: a normalisation's scale under the rules (with a
    switch, a share of 0 of the gradient, so that the switch off passes all of it)."""
    return x.detach() if switch is None else share_gradient(x, 0.0, switch)


def _normalised_dims(x: Tensor, normalized_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(range(x.dim() - len(normalized_shape), x.dim()))


class _LayerNormRule(Function):
    """``F.layer_norm`` whose backward to ``x`` holds the standard deviation constant:
    :math:`g_x = (u - \\bar u) / \\sigma` with :math:`u = w \\odot g_y`."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, bias: Tensor | None, eps: float,
        switch: RuleSwitch | None,
    ) -> Tensor:
        dims = _normalised_dims(x, normalized_shape)
        ctx.dims, ctx.switch, ctx.norm = dims, switch, (normalized_shape, eps)
        inverse_std = torch.rsqrt(x.float().var(dim=dims, unbiased=False, keepdim=True) + eps)
        ctx.save_for_backward(inverse_std, weight, None if switch is None else x)
        return F.layer_norm(x, normalized_shape, weight, bias, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse_std, weight, x = ctx.saved_tensors
        if not _applies(ctx.switch):
            shape, eps = ctx.norm  # the bias does not change the gradient to x
            return _ordinary_grad(F.layer_norm, x, grad, shape, weight, None, eps), None, None, None, None, None
        scaled = grad.float() if weight is None else grad.float() * weight.float()
        centred = scaled - scaled.mean(dim=ctx.dims, keepdim=True)
        return (centred * inverse_std).to(grad.dtype), None, None, None, None, None


def layer_norm_rule(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5,
    switch: RuleSwitch | None = None,
) -> Tensor:
    """``F.layer_norm(x, ...)``, relevance through it by the identity rule on the division
    by the standard deviation (no gradient reaches ``weight`` or ``bias``)."""
    return _LayerNormRule.apply(x, tuple(normalized_shape), weight, bias, eps, switch)


class _RMSNormRule(Function):
    """``F.rms_norm`` whose backward to ``x`` holds the root mean square constant:
    :math:`g_x = w \\odot g_y / \\mathrm{rms}(x)`."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None, eps: float | None, switch: RuleSwitch | None
    ) -> Tensor:
        dims = _normalised_dims(x, normalized_shape)
        floor = torch.finfo(x.dtype).eps if eps is None else eps
        ctx.switch, ctx.norm = switch, (normalized_shape, eps)
        inverse_rms = torch.rsqrt(x.float().pow(2).mean(dim=dims, keepdim=True) + floor)
        ctx.save_for_backward(inverse_rms, weight, None if switch is None else x)
        return F.rms_norm(x, normalized_shape, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        inverse_rms, weight, x = ctx.saved_tensors
        if not _applies(ctx.switch):
            shape, eps = ctx.norm
            return _ordinary_grad(F.rms_norm, x, grad, shape, weight, eps), None, None, None, None
        scaled = grad.float() if weight is None else grad.float() * weight.float()
        return (scaled * inverse_rms).to(grad.dtype), None, None, None, None


def rms_norm_rule(
    x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None,
    switch: RuleSwitch | None = None,
) -> Tensor:
    """``F.rms_norm(x, ...)``, relevance through it by the identity rule on the division by
    the root mean square."""
    return _RMSNormRule.apply(x, tuple(normalized_shape), weight, eps, switch)


class _GammaLinear(Function):
    r"""``F.linear`` whose backward is the generalised γ-rule (Montavon et al., 2019; as
    zennit's ``Gamma``): positive outputs share their relevance in proportion to
    :math:`z^+ = x^+ (W + \gamma W^+)^\top + x^- (W + \gamma W^-)^\top + b + \gamma b^+`,
    negative ones to :math:`z^-` (the signs of the added parts swapped), so that
    contributions of the output's own sign count :math:`1 + \gamma` times."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, gamma: float, stabilizer: float, switch: RuleSwitch | None
    ) -> Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.gamma, ctx.stabilizer, ctx.switch = gamma, stabilizer, switch
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        if not _applies(ctx.switch):
            return grad @ weight, None, None, None, None, None
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
        return torch.where(x > 0, on_positive, torch.where(x < 0, on_negative, 0.0)), None, None, None, None, None


def linear_rule(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, gamma: float = 0.0, stabilizer: float = 1e-6,
    switch: RuleSwitch | None = None,
) -> Tensor:
    """``F.linear(x, weight, bias)`` under the ε-rule with ε → 0 (``gamma=0``: the ordinary
    gradient) or the generalised γ-rule (:class:`_GammaLinear`)."""
    return F.linear(x, weight, bias) if gamma == 0 else _GammaLinear.apply(x, weight, bias, gamma, stabilizer, switch)


@dataclass(frozen=True)
class AttnLRPRules:
    """The rules of this module as the capture layer applies them
    (:class:`~captum_attention.capture.lrp.PropagationRules`), with the linear layers' γ
    and, optionally, the :class:`RuleSwitch` that turns them off in a later backward."""

    gamma: float = 0.0
    switch: RuleSwitch | None = None

    def share_gradient(self, x: Tensor, share: float) -> Tensor:
        return share_gradient(x, share, self.switch)

    def identity_rule(self, x: Tensor, y: Tensor) -> Tensor:
        return identity_rule(x, y, self.switch)

    def held_constant(self, x: Tensor) -> Tensor:
        return held_constant(x, self.switch)

    def layer_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, bias: Tensor | None = None,
        eps: float = 1e-5,
    ) -> Tensor:
        return layer_norm_rule(x, normalized_shape, weight, bias, eps, self.switch)

    def rms_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None
    ) -> Tensor:
        return rms_norm_rule(x, normalized_shape, weight, eps, self.switch)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_rule(x, weight, bias, self.gamma, switch=self.switch)


def token_relevance(embeddings: Tensor, grad: Tensor) -> Tensor:
    """``(B, T)`` float32 relevance per token: :math:`\\sum_d e_{td} \\, g_{td}`; a patch
    convolution's ``(B, d, h, w)`` output gives its ``T = h·w`` patches in row-major order,
    the order in which vision transformers flatten them into tokens."""
    products = embeddings.detach().float() * grad.float()
    return products.sum(dim=1).flatten(1) if products.dim() == 4 else products.sum(dim=-1)
