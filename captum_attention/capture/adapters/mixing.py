"""What mixes the tokens besides the attention: read from a model's modules, for the
methods that roll the attention layers out (``MethodSpec.rolls_out``), whose rollout
would skip it."""

from __future__ import annotations

from torch import nn

from .grids import on_grids
from .protocol import AttentionAdapter, enclosing_block, parent_module

CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def tokens_mixed_outside_attention(model: nn.Module, adapter: AttentionAdapter) -> str | None:
    """What mixes the tokens in the stack of the model's attention layers besides their
    attention probabilities, in words; None for most models.

    Two kinds, both read from the modules: layers of that stack that hold no attention
    module of the adapter's (a hybrid's linear attention, convolution or state-space
    layers), and convolutions inside the attention layers whose windows overlap along some
    axis (Falcon-H1's state-space branch beside its attention, Inkling's short
    convolutions, ConvBERT's convolution heads, Nystromformer's convolution of the values).
    A convolution whose stride equals its kernel merges cells without mixing them. On a
    model whose maps are placed on its patch grid (Swin's windows, SegFormer's and
    PVT-v2's reduced keys), a stage token stands for the patches of its cell, and the
    convolutions over that grid (patch merges, the Mix-FFN's depthwise convolution) are
    left to that placing. A layer is the outermost entry of an ``nn.ModuleList`` around an
    attention module (T5's block, not the sub-layers of the block, its feed-forward among
    them)."""
    layers = {
        id(layer): layer
        for site in adapter.attention_sites(model)
        if (layer := enclosing_block(model, site.module, outermost=True)) is not None
    }
    stacks = {id(parent): parent for layer in layers.values() if isinstance(parent := parent_module(model, layer), nn.ModuleList)}
    without = sorted({type(layer).__name__ for stack in stacks.values() for layer in stack if id(layer) not in layers})
    convolving = [] if on_grids(model) else sorted({
        type(holder).__name__
        for layer in layers.values() for holder in layer.modules() for child in holder.children()
        if isinstance(child, CONVOLUTIONS) and any(k > s for k, s in zip(child.kernel_size, child.stride))
    })
    found = ([f"{', '.join(without)} layers without attention"] if without else []) + (
        [f"a convolution over the tokens in {', '.join(convolving)}"] if convolving else []
    )
    return " and ".join(found) or None


def calls_sharing_values(model: nn.Module, adapter: AttentionAdapter) -> list[int]:
    """The attention calls, in the adapter's order, whose keys and values are an earlier
    layer's (transformers' ``is_kv_shared_layer``: Gemma-3n's and Gemma-4's key-value
    sharing), computed from that layer's input rather than their own."""
    return [index for index, site in enumerate(adapter.attention_sites(model)) if getattr(site.module, "is_kv_shared_layer", False) is True]
