"""Attention over a coarser grid than the image's first patches, placed back on those
patches: Swin's shifted windows (Swin, Swin-v2, Donut-Swin) and the spatially reduced keys
of SegFormer and PVTv2, in models whose stages merge tokens 2 × 2; and a decoder's
cross-attention to a window encoder's last stage (Donut's), each key shared among the
patches merged into it.

Such a model's layers have no common tokens, and a window or reduced-key layer has no
``(N, N)`` map. During a capture a hook notes where each of its calls ran (the stage grid,
and the window and shift, or the key reduction) in a context variable of the capturing
context, which the capture ends with; the adapter then reads the call's probabilities and
gradients, in the context the forward ran in, as maps over the first stage's patches
(:func:`~captum_attention.maps.windows_on_patch_grid`,
:func:`~captum_attention.maps.reduced_keys_on_patch_grid`): every layer has the same
tokens, and the methods run unchanged.

Found by what the modules hold: a window layer has an ``attention`` module,
``window_size`` and ``shift_size``, and ``input_dimensions`` among its forward's
parameters; a reduced-key attention has one of :data:`REDUCTIONS` and ``height`` and
``width`` among its forward's parameters (SegFormer, PVTv2).
"""

from __future__ import annotations

import contextvars
import inspect
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import Tensor, nn

from ...maps import reduced_keys_on_patch_grid, stage_keys_on_patch_grid, windows_on_patch_grid
from ..guard import current_thread
from .protocol import AttentionSite, Role, UnsupportedModelError, bound_argument


@dataclass(frozen=True)
class WindowCall:
    """Where a window layer ran: its stage grid, window and shift, and how many first-stage
    patches each of its tokens stands for along a side."""

    stage: tuple[int, int]
    window: int
    shift: int
    scale: int

    def maps(self, probs: Tensor) -> Tensor:
        return windows_on_patch_grid(probs, self.stage, self.window, self.shift, self.scale)

    def gradients(self, grads: Tensor) -> Tensor:
        return self.maps(grads)  # a query's and a key's patches are as many


@dataclass(frozen=True)
class ReducedCall:
    """Where a reduced-key attention ran: its stage grid, the reduction of its keys along
    a side, and how many first-stage patches each of its tokens stands for along a side."""

    stage: tuple[int, int]
    reduction: int
    scale: int

    def maps(self, probs: Tensor) -> Tensor:
        return reduced_keys_on_patch_grid(probs, self.stage, self.reduction, self.scale)

    def gradients(self, grads: Tensor) -> Tensor:
        """A key stands for ``reduction²`` times a query's patches: the gradient is shared
        among the query's patches, the map among the key's, so that summed over a pair's
        patches their product is the stage's."""
        return self.maps(grads) * self.reduction**2


@dataclass(frozen=True)
class StageKeysCall:
    """A cross-attention whose keys are the tokens of a window encoder's last stage (an
    encoder-decoder's: Donut's decoder reading its Swin), and how many first-stage patches
    each of them stands for along a side."""

    stage: tuple[int, int]
    scale: int

    def maps(self, probs: Tensor) -> Tensor:
        if probs.shape[-1] != self.stage[0] * self.stage[1]:
            raise UnsupportedModelError(
                f"A cross-attention reads {probs.shape[-1]} keys where the window encoder's last stage holds "
                f"{self.stage[0]}×{self.stage[1]} tokens: its keys cannot be placed on the image's patches."
            )
        return stage_keys_on_patch_grid(probs, self.stage, self.scale)

    def gradients(self, grads: Tensor) -> Tensor:
        """The gradient is a query's alone, the map shared among the key's patches."""
        return self.maps(grads) * self.scale**2


GridCall = WindowCall | ReducedCall | StageKeysCall


@dataclass(frozen=True)
class _Notes:
    """The grid attention modules of the capture's model, and where each of them ran."""

    sites: frozenset[nn.Module]
    calls: dict[nn.Module, GridCall] = field(default_factory=dict)


_NOTES: contextvars.ContextVar[_Notes | None] = contextvars.ContextVar("captum_attention_grid_notes", default=None)
"""Set by a capture of a grid model for its context; the capture reads its calls'
probabilities and gradients after the forward in a copy of that context."""


def window_layers(model: nn.Module) -> list[nn.Module]:
    """The model's shifted-window layers, in forward order."""
    return [m for m in model.modules() if _is_window_layer(m)]


def _is_window_layer(module: nn.Module) -> bool:
    if not all(isinstance(getattr(module, name, None), int) for name in ("window_size", "shift_size")):
        return False
    if not isinstance(getattr(module, "attention", None), nn.Module):
        return False
    return "input_dimensions" in inspect.signature(module.forward).parameters


REDUCTIONS = ("sequence_reduction_ratio", "spatial_reduction_ratio")
"""What SegFormer's and PVTv2's attention call the side of the cells their keys are reduced from."""


def reduced_key_attentions(model: nn.Module) -> list[nn.Module]:
    """The model's attention modules with spatially reduced keys, in forward order."""
    return [
        m for m in model.modules()
        if any(isinstance(getattr(m, name, None), int) for name in REDUCTIONS)
        and {"height", "width"} <= set(inspect.signature(m.forward).parameters)
    ]


def on_grids(model: nn.Module) -> bool:
    """Whether the model's attention runs on coarser grids than its first patches."""
    return bool(window_layers(model) or reduced_key_attentions(model))


def grid_sites(model: nn.Module, found: list[AttentionSite], role: Role = "self") -> list[AttentionSite]:
    """The sites of a window model: one per window layer, the module of the found sites'
    class inside its ``attention`` (Swin-v2 and Donut-Swin declare the inner
    self-attention), else the ``attention`` itself, whose output holds the probabilities
    second (Swin declares whole stages), with ``role`` (an encoder-decoder's window
    encoder: ``"encoder"``); then the found sites outside the window layers (its
    decoder's); other models' sites as found."""
    layers = window_layers(model)
    if not layers:
        return found
    index_of = {type(site.module): site.output_index for site in found}
    in_windows = {module for layer in layers for module in layer.modules()}
    sites = []
    for layer in layers:
        attention: nn.Module = getattr(layer, "attention")
        inner = next((m for m in attention.modules() if type(m) in index_of), None)
        sites.append(AttentionSite(inner, role, False, index_of[type(inner)]) if inner else AttentionSite(attention, role, False, 1))
    outside = [site for site in found if not in_windows & set(site.module.modules())]
    return sites + outside


def note_grid_calls(model: nn.Module, sites: list[AttentionSite], stack: ExitStack) -> None:
    """Hooks (removed by ``stack``) that note each call's grid for its attention site in
    this context, for calls in the thread that set them (forgetting the previous call as
    the call starts); ``stack`` resets the notes. The first call of a forward runs on the
    first stage's patches."""
    thread = current_thread()
    first_stage: list[tuple[int, int]] = []
    last_call: list[GridCall] = []
    layers = window_layers(model)
    if layers:
        pairs: list[tuple[nn.Module, AttentionSite, Callable[..., GridCall]]] = [
            (layer, site, _window_call) for layer, site in zip(layers, sites)
        ]
    else:
        pairs = [(module, site, _reduced_call) for module in reduced_key_attentions(model) for site in sites if site.module is module]
    cross = [site for site in sites if site.role == "cross"] if layers else []  # keys: the last stage's tokens
    token = _NOTES.set(_Notes(frozenset(site.module for site in [*(site for _, site, _ in pairs), *cross])))
    stack.callback(_reset, token)

    def note(site: AttentionSite, call: GridCall | None) -> None:
        notes = _NOTES.get()
        if notes is not None:
            calls = {module: noted for module, noted in notes.calls.items() if module is not site.module}
            _NOTES.set(_Notes(notes.sites, calls if call is None else {**calls, site.module: call}))

    def forget(site: AttentionSite) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if current_thread() == thread:
                note(site, None)

        return hook

    def noted(site: AttentionSite, call_of: Callable[..., GridCall], first: bool) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if current_thread() != thread:
                return
            stage = _stage(module, args, kwargs)
            if first:
                first_stage[:] = [stage]
            last_call[:] = [call_of(module, stage, _scale(first_stage[0] if first_stage else stage, stage))]
            note(site, last_call[0])

        return hook

    def keys_noted(site: AttentionSite) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if current_thread() == thread and last_call:
                note(site, StageKeysCall(last_call[0].stage, last_call[0].scale))

        return hook

    for index, (module, site, call_of) in enumerate(pairs):
        stack.callback(module.register_forward_pre_hook(forget(site), with_kwargs=True).remove)
        stack.callback(module.register_forward_hook(noted(site, call_of, index == 0), with_kwargs=True).remove)
    for site in cross:
        stack.callback(site.module.register_forward_pre_hook(forget(site), with_kwargs=True).remove)
        stack.callback(site.module.register_forward_hook(keys_noted(site), with_kwargs=True).remove)


def _reset(token: contextvars.Token) -> None:
    try:
        _NOTES.reset(token)
    except ValueError:  # the capture ended in another context than it began in
        _NOTES.set(None)


def _stage(module: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    dimensions = bound_argument(module.forward, "input_dimensions", args, kwargs)
    if dimensions is None:
        dimensions = (bound_argument(module.forward, "height", args, kwargs), bound_argument(module.forward, "width", args, kwargs))
    rows, columns = (int(size) for size in dimensions)
    return rows, columns


def _scale(grid: tuple[int, int], stage: tuple[int, int]) -> int:
    """First-stage patches per stage token along a side, or a one-line refusal where the
    grid does not halve evenly down to the stage."""
    scale = grid[0] // stage[0]
    if (grid[0], grid[1]) != (stage[0] * scale, stage[1] * scale):
        raise UnsupportedModelError(
            f"A patch grid of {grid[0]}×{grid[1]} does not halve evenly down to the "
            f"{stage[0]}×{stage[1]} stage: the merged tokens do not cover equal patches. "
            "Resize the images so that the patch grid's sides divide by 2 per stage."
        )
    return scale


def _window_call(layer: nn.Module, stage: tuple[int, int], scale: int) -> WindowCall:
    return WindowCall(stage, int(getattr(layer, "window_size")), int(getattr(layer, "shift_size")), scale)


def _reduced_call(attention: nn.Module, stage: tuple[int, int], scale: int) -> ReducedCall:
    if getattr(attention, "linear_attention", False):
        raise UnsupportedModelError(
            f"{type(attention).__name__} pools its keys to a fixed 7×7 grid (linear attention), "
            "whose cells do not cover equal tokens: it is not supported."
        )
    reduction = int(next(getattr(attention, name) for name in REDUCTIONS if isinstance(getattr(attention, name, None), int)))
    if stage[0] % reduction or stage[1] % reduction:
        raise UnsupportedModelError(
            f"A {stage[0]}×{stage[1]} stage does not divide into the {reduction}×{reduction} "
            "cells its keys are reduced from: some tokens are in no key. Resize the images so "
            "that every stage's sides divide by its reduction."
        )
    return ReducedCall(stage, reduction, scale)


def on_patch_grid(module: nn.Module, tensor: Tensor, gradient: bool) -> Tensor | None:
    """A grid attention's probabilities (or their gradients) as maps over the first
    stage's patches; None for any other module's."""
    notes = _NOTES.get()
    if notes is None or module not in notes.sites:
        return None
    call = notes.calls.get(module)
    if call is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} attends over a coarser grid than the image's patches "
            "(shifted windows or reduced keys), whose maps are read only after its call has "
            "run (interventions inside the attention are not supported)."
        )
    return call.gradients(tensor) if gradient else call.maps(tensor)
