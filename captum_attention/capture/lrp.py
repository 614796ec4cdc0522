"""AttnLRP's rules applied to a model for one call, and nowhere else.

:class:`RelevanceRules` is entered by :class:`~captum_attention.capture.AttentionCapture`
(``relevance_rules=...``) in its ``ExitStack``, so that it is removed with the capture's
other hooks, also on an exception or an interrupt. While active:

- under a streaming capture each attention kernel call (transformers' attention
  interface) runs on its queries and keys passing back half their gradient, and its
  output passes back half of its own: the uniform rule on ``Q·Kᵀ`` and on ``A·V``; the
  softmax between them keeps its ordinary gradient, which is Proposition 3.1 in gradient
  form (see :mod:`captum_attention.maps.lrp`). Under an eager capture the same rule
  reaches the explicit products (below);
- forward hooks on the model's element-wise activation modules give their outputs the
  identity rule;
- a ``TorchFunctionMode`` (this thread only) gives linear layers (``F.linear``, and
  GPT-2's ``Conv1D`` through ``torch.addmm``) their rule (ε or γ), ``F.layer_norm``/``F.rms_norm`` their
  normalisation rule, holds ``rsqrt`` constant inside the model's hand-written norm
  modules (``LlamaRMSNorm``, ``T5LayerNorm``, …), and gives a product of two activations
  (a gated MLP; an eager attention's ``Q·Kᵀ`` and ``A·V``) the uniform rule;
- forward hooks on the adapter's input-embedding modules record their outputs (detached
  and requiring grad, so that the relevance is read there whatever the parameters'
  ``requires_grad``; no gradient reaches a parameter).

Nothing global is patched; other threads run the model's functions unchanged (the mode
is thread-local, and the hooks act only in the capturing thread).
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .guard import ScopedFunctionMode


class PropagationRules(Protocol):
    """The rules as functions (:mod:`captum_attention.maps.lrp` is one): each returns its
    operation's forward value with the rule's backward."""

    def share_gradient(self, x: Tensor, share: float) -> Tensor: ...

    def identity_rule(self, x: Tensor, y: Tensor) -> Tensor: ...

    def layer_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None,
        bias: Tensor | None = None, eps: float = 1e-5,
    ) -> Tensor: ...

    def rms_norm_rule(
        self, x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None = None, eps: float | None = None
    ) -> Tensor: ...

    @property
    def gamma(self) -> float:
        """0: linear layers keep their ordinary gradient (the ε-rule, ε → 0); above: the
        γ-rule of :meth:`linear`."""
        ...

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...


ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.Softplus, nn.Hardswish, nn.LeakyReLU, nn.ReLU,
)
"""torch's element-wise activations; every module defined in ``transformers.activations``
counts too."""

_PRODUCTS = {
    torch.mul, Tensor.mul, Tensor.__mul__, Tensor.__rmul__,
    torch.matmul, Tensor.matmul, Tensor.__matmul__, Tensor.__rmatmul__, torch.bmm, Tensor.bmm,
}
"""Products that take the uniform rule when both factors are activations: element-wise
(gated MLPs) and matrix products (an eager attention's ``Q·Kᵀ`` and ``A·V``)."""


def is_activation(module: nn.Module) -> bool:
    """Whether ``module`` is an element-wise non-linearity (identity rule)."""
    return isinstance(module, ACTIVATION_MODULES) or type(module).__module__ == "transformers.activations"


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (``LayerNorm``, ``*RMSNorm``,
    ``T5LayerNorm``, …): its ``rsqrt`` is held constant."""
    return type(module).__name__.endswith("Norm")


def _is_activation_tensor(value: Any) -> bool:
    """A tensor computed from the inputs: it requires grad and is not a leaf (parameters
    are leaves)."""
    return isinstance(value, Tensor) and value.requires_grad and value.grad_fn is not None and value.is_floating_point()


class RelevanceRules:
    """Context manager: AttnLRP's rules on ``model`` for the calls made while it is active.

    Args:
        model (nn.Module): the model.
        embedding_modules (list of nn.Module): whose outputs are the input embeddings;
            each output is recorded in :attr:`embeddings`, in call order.
        rules (PropagationRules): the rules' functions (the attributions pass
            :mod:`captum_attention.maps.lrp`).
    """

    def __init__(self, model: nn.Module, embedding_modules: list[nn.Module], rules: PropagationRules) -> None:
        self.model = model
        self.rules = rules
        self.embedding_modules = embedding_modules
        self.embeddings: list[Tensor] = []
        self.depth = 0  # how many activation or norm modules the forward is inside
        self._stack = ExitStack()
        self._thread = threading.get_ident()

    def __enter__(self) -> "RelevanceRules":
        self._thread = threading.get_ident()
        with ExitStack() as stack:
            for module in self.model.modules():
                if is_activation(module) or is_norm(module):
                    stack.callback(module.register_forward_pre_hook(self._enter_module).remove)
                    stack.callback(module.register_forward_hook(self._leave_module).remove)
            for module in self.embedding_modules:
                stack.callback(module.register_forward_hook(self._record_embeddings).remove)
            stack.enter_context(_RuleMode(self))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    def attention(self, run_kernel: Callable[..., Tensor]) -> Tensor:
        """One attention kernel call under the uniform rule on ``Q·Kᵀ`` and ``A·V``."""
        share = self.rules.share_gradient
        output = run_kernel(lambda query, key, value: (share(query, 0.5), share(key, 0.5), value))
        return share(output, 0.5)

    def _ours(self) -> bool:
        """Whether the forward running is the capturing thread's (the hooks are on the
        model; another thread's forward goes through them untouched)."""
        return threading.get_ident() == self._thread

    def _enter_module(self, module: nn.Module, args: tuple) -> None:
        if self._ours():
            self.depth += 1

    def _leave_module(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._ours():
            return None
        self.depth -= 1
        if is_activation(module) and args and _is_activation_tensor(args[0]) and isinstance(output, Tensor):
            return self.rules.identity_rule(args[0], output.detach())
        return None

    def _record_embeddings(self, module: nn.Module, args: tuple, output: Any) -> Tensor | None:
        if not isinstance(output, Tensor) or not self._ours():
            return None
        embeddings = output.detach().requires_grad_()
        self.embeddings.append(embeddings)
        return embeddings


class _RuleMode(ScopedFunctionMode):
    """The function-level rules of :class:`RelevanceRules` (see the module docstring)."""

    def __init__(self, relevance: RelevanceRules) -> None:
        super().__init__()
        self.relevance = relevance

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rules = self.relevance.rules
        if func is F.layer_norm and _is_activation_tensor(args[0]):
            return rules.layer_norm_rule(*args, **kwargs)
        if func is F.rms_norm and _is_activation_tensor(args[0]):
            return rules.rms_norm_rule(*args, **kwargs)
        if self.relevance.depth > 0:
            result = func(*args, **kwargs)
            return result.detach() if func in (torch.rsqrt, Tensor.rsqrt) else result
        if func in _PRODUCTS and len(args) == 2 and all(_is_activation_tensor(a) for a in args):
            return func(rules.share_gradient(args[0], 0.5), rules.share_gradient(args[1], 0.5))
        if rules.gamma and func is F.linear and _is_activation_tensor(args[0]):
            return rules.linear(*args, **kwargs)
        if rules.gamma and func is torch.addmm and not kwargs and len(args) == 3 and _is_activation_tensor(args[1]):
            bias, x, weight = args  # GPT-2's Conv1D: x·W + b, a linear layer with W transposed
            return rules.linear(x, weight.t(), bias)
        return func(*args, **kwargs)
