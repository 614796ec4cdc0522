"""Reference maps of models that attend over coarser grids than their first patches, by
another road.

Shifted windows (Swin, Swin-v2, Donut-Swin): the library scatters each window's
probabilities to their tokens by index arithmetic. Here a window attention is taken for
the linear map it is: run on one-hot token features through the model's own
``window_partition``/``window_reverse`` and shifts, it returns the dense ``(tokens ×
tokens)`` map of its stage. Each stage token then stands for the ``scale × scale``
first-stage patches merged into it (``P``, patches × tokens): ``Ã = P·M·Pᵀ / scale²``, for
the maps and, by the same map, their gradients.

Reduced keys (SegFormer, PVTv2): ``output_attentions`` gives ``(tokens × keys)`` maps; with ``P``
(patches × tokens) and ``K`` (patches × keys, each key one ``reduction × reduction`` cell of
tokens), ``Ã = P·M·Kᵀ / (scale·reduction)²`` and ``G̃ = P·G·Kᵀ / scale²``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn


def window_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "window_size") and hasattr(m, "shift_size") and hasattr(m, "attention")]


def dense_stage_map(layer: nn.Module, windows: torch.Tensor, stage: tuple[int, int], batch: int) -> torch.Tensor:
    """``(B·windows, H, w², w²)`` window attention of ``layer`` as ``(B, H, N, N)`` over the
    stage's ``N = rows·columns`` tokens."""
    modeling = sys.modules[type(layer).__module__]
    rows, columns = stage
    window, shift, heads, tokens = int(layer.window_size), int(layer.shift_size), windows.shape[1], rows * columns
    one_hot = torch.eye(tokens, dtype=windows.dtype).view(1, rows, columns, tokens).expand(batch, -1, -1, -1)
    padded = nn.functional.pad(one_hot, (0, 0, 0, -columns % window, 0, -rows % window))
    padded_rows, padded_columns = padded.shape[1:3]
    shifted = torch.roll(padded, shifts=(-shift, -shift), dims=(1, 2))
    features = modeling.window_partition(shifted, window).reshape(-1, 1, window * window, tokens)
    mixed = (windows @ features).permute(0, 2, 1, 3).reshape(-1, window, window, heads * tokens)
    merged = modeling.window_reverse(mixed, window, padded_rows, padded_columns)
    merged = torch.roll(merged, shifts=(shift, shift), dims=(1, 2))[:, :rows, :columns]
    return merged.reshape(batch, tokens, heads, tokens).permute(0, 2, 1, 3)


def _assignment(stage: tuple[int, int], scale: int, cell: int = 1) -> torch.Tensor:
    """(patches × cells) one-hot: the ``cell × cell`` block of stage tokens each first-stage
    patch lies in, cells row-major."""
    rows, columns = stage
    patch_rows = torch.arange(rows * scale) // (scale * cell)
    patch_columns = torch.arange(columns * scale) // (scale * cell)
    index = (patch_rows[:, None] * (columns // cell) + patch_columns[None, :]).flatten()
    return nn.functional.one_hot(index, (rows // cell) * (columns // cell)).double()


def on_patches(stage_map: torch.Tensor, stage: tuple[int, int], scale: int) -> torch.Tensor:
    """``P·M·Pᵀ / scale²``: a stage map over the first stage's patches."""
    assign = _assignment(stage, scale).to(stage_map.dtype)  # P
    return assign @ stage_map @ assign.T / scale**2


def _window_run(twin: nn.Module, keywords: dict[str, Any]) -> tuple[Any, list[tuple[nn.Module, tuple[int, int], torch.Tensor]]]:
    """The eager float64 ``twin``'s output with ``output_attentions`` and each window
    layer's call: the layer, its stage grid and its window probabilities."""
    layers = window_layers(twin)
    calls: list[tuple[nn.Module, tuple[int, int], torch.Tensor]] = []
    stages: dict[nn.Module, tuple[int, int]] = {}

    def on_layer(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        stages[layer] = tuple(int(s) for s in (args[1] if len(args) > 1 else kwargs["input_dimensions"]))

    def on_attention(layer: nn.Module) -> Any:
        return lambda _module, _args, output: calls.append((layer, stages[layer], output[1]))

    hooks = [layer.register_forward_pre_hook(on_layer, with_kwargs=True) for layer in layers]
    hooks += [layer.attention.register_forward_hook(on_attention(layer)) for layer in layers]
    try:
        out = twin(**{k: v.double() if v.is_floating_point() else v for k, v in keywords.items()}, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    return out, calls


def _on_first_stage(calls, grads, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    first = calls[0][1]
    maps, map_grads = [], []
    for (layer, stage, probs), grad in zip(calls, grads):
        scale = first[0] // stage[0]
        maps.append(on_patches(dense_stage_map(layer, probs.detach(), stage, batch), stage, scale))
        map_grads.append(on_patches(dense_stage_map(layer, grad, stage, batch), stage, scale))
    return maps, map_grads


def _eager_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model).double()
    twin.set_attn_implementation("eager")
    return twin


def window_maps_and_grads(model: nn.Module, keywords: dict[str, Any], score: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every window layer's attention and its gradient of ``score(logits)``, float64, on
    the first stage's patches, from an eager twin of ``model`` with ``output_attentions``."""
    out, calls = _window_run(_eager_twin(model), keywords)
    grads = torch.autograd.grad(score(out.logits), [probs for _, _, probs in calls])
    return _on_first_stage(calls, grads, out.logits.shape[0])


def window_encoder_decoder_maps(model: nn.Module, keywords: dict[str, Any], score: Any) -> tuple[list, list, list]:
    """An encoder-decoder with a window encoder (Donut's): ``(encoder, decoder, cross)``
    lists of ``(map, gradient of score(logits))`` pairs, float64, from an eager twin; the
    encoder's on the first stage's patches, the cross-attention's keys (the last stage's
    tokens) shared among the patches merged into them (``M·Kᵀ / scale²``, gradients
    ``G·Kᵀ``)."""
    out, calls = _window_run(_eager_twin(model), keywords)
    decoder, cross = list(out.decoder_attentions), list(out.cross_attentions)
    grads = torch.autograd.grad(score(out.logits), [probs for _, _, probs in calls] + decoder + cross)
    batch = out.logits.shape[0]
    encoder = list(zip(*_on_first_stage(calls, grads[: len(calls)], batch)))
    stage, scale = calls[-1][1], calls[0][1][0] // calls[-1][1][0]
    keys = _assignment(stage, scale)
    cross_grads = grads[len(calls) + len(decoder):]
    return (
        encoder,
        [(a.detach(), g) for a, g in zip(decoder, grads[len(calls) : len(calls) + len(decoder)])],
        [(a.detach() @ keys.T / scale**2, g @ keys.T) for a, g in zip(cross, cross_grads)],
    )


def reduced_maps_and_grads(model: nn.Module, keywords: dict[str, Any], score: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every reduced-key attention's ``output_attentions`` map and its gradient of
    ``score(logits)``, float64, on the first stage's patches, from an eager twin."""
    twin = copy.deepcopy(model).double()
    twin.set_attn_implementation("eager")
    reduced = [m for m in twin.modules() if hasattr(m, "sequence_reduction_ratio") or hasattr(m, "spatial_reduction_ratio")]
    stages: list[tuple[nn.Module, tuple[int, int]]] = []

    def on_attention(module: nn.Module, args: tuple, kwargs: dict) -> None:
        height, width = (args[1], args[2]) if len(args) > 2 else (kwargs["height"], kwargs["width"])
        stages.append((module, (int(height), int(width))))

    hooks = [m.register_forward_pre_hook(on_attention, with_kwargs=True) for m in reduced]
    try:
        out = twin(**{k: v.double() for k, v in keywords.items()}, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    attentions = [a for item in out.attentions for a in (item if isinstance(item, tuple) else (item,))]  # PVTv2: per stage
    grads = torch.autograd.grad(score(out.logits), attentions)
    first = stages[0][1]
    maps, map_grads = [], []
    for (module, stage), probs, grad in zip(stages, attentions, grads):
        scale = first[0] // stage[0]
        reduction = int(getattr(module, "sequence_reduction_ratio", None) or module.spatial_reduction_ratio)
        queries, keys = _assignment(stage, scale), _assignment(stage, scale, reduction)
        maps.append(queries @ probs.detach() @ keys.T / (scale * reduction) ** 2)
        map_grads.append(queries @ grad @ keys.T / scale**2)
    return maps, map_grads
