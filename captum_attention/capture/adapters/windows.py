"""Shifted-window attention (Swin, Swin-v2, Donut-Swin): the per-window maps placed back on
the image's patch grid.

Such a model attends inside ``w × w`` windows of each stage's token grid (every other
block after a cyclic shift) and merges 2 × 2 tokens between stages. Its window layers are
found by what they hold (an ``attention`` module, ``window_size`` and ``shift_size``, and
``input_dimensions`` among their forward's parameters); during a capture a hook on each
notes the stage grid it ran on and its window and shift, and the adapter reads that
layer's attention as maps over the first stage's patches
(:func:`~captum_attention.maps.windows_on_patch_grid`): every layer then has the same
tokens, so the methods run unchanged.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ...maps import windows_on_patch_grid
from .protocol import AttentionSite, UnsupportedModelError, bound_argument


@dataclass(frozen=True)
class WindowCall:
    """Where one window layer ran: its stage grid, window and shift, and how many
    first-stage patches each of its tokens stands for along a side."""

    stage: tuple[int, int]
    window: int
    shift: int
    scale: int


_CALLS: "weakref.WeakKeyDictionary[nn.Module, dict[int, WindowCall]]" = weakref.WeakKeyDictionary()
"""Per attention module, per thread: the layer call it last made under a capture (the
capture reads its probabilities and gradients after the forward)."""


def window_layers(model: nn.Module) -> list[nn.Module]:
    """The model's shifted-window layers, in forward order."""
    return [m for m in model.modules() if _is_window_layer(m)]


def _is_window_layer(module: nn.Module) -> bool:
    if not all(isinstance(getattr(module, name, None), int) for name in ("window_size", "shift_size")):
        return False
    if not isinstance(getattr(module, "attention", None), nn.Module):
        return False
    return "input_dimensions" in inspect.signature(module.forward).parameters


def window_sites(layers: list[nn.Module], found: list[AttentionSite]) -> list[AttentionSite]:
    """One site per window layer: the module of the found sites' class inside its
    ``attention`` (Swin-v2 and Donut-Swin declare the inner self-attention), else the
    ``attention`` itself, whose output holds the probabilities second (Swin declares
    whole stages)."""
    index_of = {type(site.module): site.output_index for site in found}
    sites = []
    for layer in layers:
        attention: nn.Module = getattr(layer, "attention")
        inner = next((m for m in attention.modules() if type(m) in index_of), None)
        sites.append(AttentionSite(inner, "self", False, index_of[type(inner)]) if inner else AttentionSite(attention, "self", False, 1))
    return sites


def note_window_calls(layers: list[nn.Module], sites: list[AttentionSite], stack: ExitStack) -> None:
    """Hooks (removed by ``stack``) that note each layer's call for its attention site, in
    the thread that set them (and forget the previous call as the layer starts)."""
    thread = threading.get_ident()
    first_stage: list[tuple[int, int]] = []

    def forget(site: AttentionSite) -> Any:
        def hook(layer: nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() == thread:
                _CALLS.get(site.module, {}).pop(thread, None)

        return hook

    def noted(site: AttentionSite) -> Any:
        def hook(layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if threading.get_ident() != thread:
                return
            rows, columns = (int(size) for size in bound_argument(layer.forward, "input_dimensions", args, kwargs))
            stage = (rows, columns)
            if layer is layers[0]:
                first_stage[:] = [stage]
            grid = first_stage[0] if first_stage else stage
            scale = grid[0] // stage[0]
            if (grid[0], grid[1]) != (stage[0] * scale, stage[1] * scale):
                raise UnsupportedModelError(
                    f"A patch grid of {grid[0]}×{grid[1]} does not halve evenly down to the "
                    f"{stage[0]}×{stage[1]} stage: the merged tokens do not cover equal patches. "
                    "Resize the images so that the patch grid's sides divide by 2 per stage."
                )
            call = WindowCall(stage, int(getattr(layer, "window_size")), int(getattr(layer, "shift_size")), scale)
            _CALLS.setdefault(site.module, {})[thread] = call

        return hook

    for layer, site in zip(layers, sites):
        stack.callback(layer.register_forward_pre_hook(forget(site), with_kwargs=True).remove)
        stack.callback(layer.register_forward_hook(noted(site), with_kwargs=True).remove)


def on_patch_grid(module: nn.Module, probs: Tensor) -> Tensor | None:
    """``probs`` of a window layer's attention as maps over the first stage's patches;
    None for a module that is no window layer's."""
    calls = _CALLS.get(module)
    if calls is None:
        return None
    call = calls.get(threading.get_ident())
    if call is None or probs.shape[-1] != call.window**2:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends within shifted windows, whose maps are read only "
            "after its layer has run (interventions inside the attention are not supported)."
        )
    return windows_on_patch_grid(probs, call.stage, call.window, call.shift, call.scale)
