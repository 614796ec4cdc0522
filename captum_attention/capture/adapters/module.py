"""The adapter of attention modules a user names."""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

from torch import Tensor, nn

from .protocol import AdapterBase, AttentionSite, Role, bound_argument


class ModuleAdapter(AdapterBase):
    """Adapter for attention modules the user names.

    For a hand-written model (or any module the built-in adapters do not find): list the
    modules whose calls compute the attention, in forward order, and say where the
    post-softmax probabilities are: a function of each call's output, or
    ``probs="softmax"`` for modules that compute them inline with ``F.softmax`` /
    ``torch.softmax`` / ``Tensor.softmax``, or call ``F.scaled_dot_product_attention``,
    and do not return them. With ``"softmax"``, each softmax inside one call of a named
    module is recorded (the very tensor the module goes on to use) and several softmaxes
    in one call are stacked as heads, so a textbook ``MultiHeadAttention`` made of one
    ``Head`` module per head is named once. A call of the fused
    ``F.scaled_dot_product_attention`` (timm's, DINOv2's, nanoGPT's modules) streams: the
    kernel runs as the module asked and each call is recorded, as transformers' ``sdpa``
    calls are; under an eager capture it runs as the computation PyTorch documents for it,
    its masks, causal mask, scale and grouped-query heads included, and its softmax is
    recorded so (a module passing it a ``dropout_p`` is refused: call ``model.eval()``).

    Args:
        modules (sequence of nn.Module): the attention modules, in forward order. A module
            called several times (shared weights) is recorded at each call.
        probs (callable or "softmax", optional): maps one call's output to the
            probability tensor, ``(batch, heads, queries, keys)`` or
            ``(batch, queries, keys)`` for one head; it must be the tensor that weighted
            the values, so that gradients with respect to it are exact. ``"softmax"``:
            the softmax outputs computed inside the call. Default: ``output[1]`` for
            tuple outputs, else the output itself.
        mask_module (nn.Module, optional): module whose first call receives the padding
            mask. Default: None (all tokens real).
        mask_argument (str): name of that module's mask argument (1 = real token).
            Default: ``"attention_mask"``.
        pooling (sequence of nn.Module, optional): the modules among ``modules`` whose
            queries are not tokens: attention pooling with a learned query, or the
            additive (Bahdanau) attention of an RNN classifier, ``(batch, queries, keys)``
            or ``(batch, heads, queries, keys)`` with the tokens as keys. They are the
            model's readout: every method reads their rows (the mean over their queries)
            where it would read the query token's row. Default: none.

    Example::

        >>> adapter = ModuleAdapter([block.attention for block in net.blocks], probs="softmax")
        >>> scores = GradSAM(net, adapter=adapter).attribute(ids, target=0)
        >>> rnn_adapter = ModuleAdapter([rnn.attention], probs=lambda out: out[1],
        ...                             pooling=[rnn.attention])
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        probs: Callable[[Any], Tensor] | Literal["softmax"] | None = None,
        mask_module: nn.Module | None = None,
        mask_argument: str = "attention_mask",
        pooling: Sequence[nn.Module] = (),
    ) -> None:
        if not modules:
            raise ValueError("ModuleAdapter needs at least one attention module.")
        if any(all(module is not named for named in modules) for module in pooling):
            raise ValueError("Every module in pooling=[...] must also be one of the attention modules named first.")
        if isinstance(probs, str) and probs != "softmax":
            raise ValueError(f'probs must be a callable, "softmax" or None, got {probs!r}.')
        self.modules = list(modules)
        self.probs = probs
        self.probs_source = "softmax" if probs == "softmax" else "output"
        self.streams = probs == "softmax"  # where the modules call F.scaled_dot_product_attention
        self.mask_module = mask_module
        self.mask_argument = mask_argument
        self.pooling = list(pooling)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return list(dict.fromkeys(self.modules))

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        if callable(self.probs):
            return self.probs(output)
        return super().read_probs(site, output)

    def role(self, module: nn.Module) -> Role:
        return "pooling" if any(module is pooled for pooled in self.pooling) else "self"

    def is_causal(self, module: nn.Module) -> bool | None:
        return False if self.role(module) == "pooling" else None

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return [] if self.mask_module is None else [self.mask_module]

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return bound_argument(module.forward, self.mask_argument, args, kwargs)
