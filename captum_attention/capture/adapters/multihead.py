"""The adapter of ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from torch import Tensor, nn

from .protocol import AdapterBase, AttentionNotFoundError, ProbsSource, bound_argument


class MultiheadAttentionAdapter(AdapterBase):
    """Adapter for ``torch.nn.MultiheadAttention`` (per-head probabilities, exact gradients).

    For the call, every ``nn.MultiheadAttention`` of the model is asked for
    ``need_weights=True`` (so that it computes an explicit softmax, off the fused fast
    path), the per-head probabilities are the softmax output inside
    ``F.multi_head_attention_forward`` (the very tensor that multiplies the values, so
    gradients and interventions are exact), and the output is handed back to the caller
    exactly as it asked for it (no weights, or head-averaged weights). The padding mask
    is the ``key_padding_mask`` of the first attention call (True or -inf = padding),
    turned into 1 = real token.
    """

    probs_source: ProbsSource = "softmax"

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        modules: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        if not modules:
            raise AttentionNotFoundError(
                f"{type(model).__name__} has no nn.MultiheadAttention module. Name the "
                "attention modules yourself with ModuleAdapter (see the AttentionAdapter "
                "protocol)."
            )
        return modules

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        assert isinstance(module, nn.MultiheadAttention)
        return probs.view(-1, module.num_heads, *probs.shape[-2:])

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return self.attention_modules(model)[:1]

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        assert isinstance(module, nn.MultiheadAttention)
        return module.out_proj.weight

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        key_padding_mask = bound_argument(module.forward, "key_padding_mask", args, kwargs)
        return None if key_padding_mask is None else (key_padding_mask == 0).long()

    @contextmanager
    def prepared(self, model: nn.Module, streaming: bool) -> Iterator[None]:
        asked: dict[nn.Module, list[bool]] = {}

        def ask_for_weights(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
            bound.apply_defaults()
            asked.setdefault(module, []).append(bound.arguments["need_weights"])
            bound.arguments["need_weights"] = True
            return bound.args, bound.kwargs

        def hand_back(module: nn.Module, args: tuple, output: Any) -> Any:
            return output if asked[module].pop() else (output[0], None)

        with ExitStack() as stack:
            for module in self.attention_modules(model):
                stack.callback(module.register_forward_pre_hook(ask_for_weights, with_kwargs=True).remove)
                stack.callback(module.register_forward_hook(hand_back, prepend=True).remove)
            yield
