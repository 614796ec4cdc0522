"""Every reliance on private internals of torch, transformers and Captum, in one place.

Each item says what it depends on and the versions it was checked against (torch 2.13,
transformers 5.24, captum 0.9). When one of these libraries moves an internal, this is the
only file to change. Imported by every layer; imports none of them.
"""

from __future__ import annotations

import gc
import types
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Captum's private argument helpers (captum._utils.common, checked on captum 0.9): they
# give our attribute() exactly Captum's conventions for inputs, extra arguments, output
# tuples and the forward call. TargetType is Captum's alias for `target`.
from captum._utils.common import (
    _format_additional_forward_args as format_additional_forward_args,
    _format_output as format_output,
    _format_tensor_into_tuples as format_tensor_into_tuples,
    _run_forward as run_forward,
)
from captum._utils.typing import TargetType

# torch's stack of torch-function modes (torch.overrides, checked on torch 2.13): a capture
# checks that its mode is still on it before popping it (see recorder._SoftmaxInterception).
from torch.overrides import _get_current_function_mode_stack as function_mode_stack
from torch.overrides import _pop_mode_temporarily


def restore_popped_mode(mode: Any) -> None:
    """Put ``mode`` back on torch's mode stack where an interrupt stranded it popped.

    torch dispatches a Python-level function to a mode inside ``with
    _pop_mode_temporarily():``, a generator that pops the mode and pushes it back in its
    ``finally``. An interrupt landing after the pop but before the ``with`` took hold
    leaves that generator suspended, the mode off the stack, until the generator is
    garbage-collected, which then pushes the mode back long after its owner is gone.
    Closing such generators now runs their ``finally`` while the owner can still pop it.
    Checked on torch 2.13 (``torch.overrides._pop_mode_temporarily``).
    """
    code = _pop_mode_temporarily.__wrapped__.__code__  # type: ignore[attr-defined]
    for candidate in gc.get_objects():
        if (
            type(candidate) is types.GeneratorType
            and candidate.gi_code is code
            and candidate.gi_frame is not None
            and candidate.gi_frame.f_locals.get("old") is mode
        ):
            candidate.close()

__all__ = [
    "TargetType",
    "attention_function",
    "attn_implementation",
    "declared_outputs",
    "format_additional_forward_args",
    "format_output",
    "format_tensor_into_tuples",
    "function_mode_stack",
    "restore_popped_mode",
    "mha_forward_with_softmax",
    "output_recorder_class",
    "register_attention_function",
    "run_forward",
]


def output_recorder_class() -> Any:
    """transformers' ``OutputRecorder`` (an entry of ``_can_record_outputs``).

    It lives in ``transformers.utils.output_capturing`` on 5.24 and lived in
    ``transformers.utils.generic`` on 4.5x; None where neither has it.
    """
    try:
        from transformers.utils import output_capturing
    except ImportError:
        from transformers.utils import generic as output_capturing  # type: ignore[no-redef]
    return getattr(output_capturing, "OutputRecorder", None)


def declared_outputs(model_class: type) -> dict[str, Any]:
    """A transformers model class's ``_can_record_outputs``: which modules produce its
    ``attentions`` / ``cross_attentions`` (the private declaration behind
    ``output_attentions=True``, checked on 5.24); empty where absent."""
    return getattr(model_class, "_can_record_outputs", None) or {}


def attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation a transformers model runs (``config._attn_implementation``:
    "eager", "sdpa", "flash_attention_2", ...), or None for other modules. Checked on 5.24."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def attention_function(name: str) -> Callable[..., Any]:
    """The attention function transformers' models dispatch to under ``name`` ("sdpa", ...):
    the class-wide entry of ``AttentionInterface`` (its private ``_global_mapping``, read so
    that a wrapper can be removed exactly; checked on 5.24)."""
    from transformers import AttentionInterface

    return cast(Callable[..., Any], AttentionInterface._global_mapping[name])


def register_attention_function(name: str, function: Callable[..., Any]) -> None:
    """Make ``function`` what every model dispatching through ``AttentionInterface`` calls
    under ``name`` (the public ``AttentionInterface.register``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


class _TorchWith(types.ModuleType):
    """The ``torch`` module as one function's globals see it, with some attributes replaced."""

    def __init__(self, **replaced: Any) -> None:
        super().__init__("torch")
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def mha_forward_with_softmax(softmax: Callable[..., Tensor], bmm: Callable[..., Tensor] = torch.bmm) -> Callable[..., Any]:
    """A private copy of ``F.multi_head_attention_forward`` whose softmax is ``softmax``
    (and whose ``torch.bmm``, which weights the values, is ``bmm``).

    ``nn.MultiheadAttention`` dispatches ``F.multi_head_attention_forward`` as a whole to
    torch-function modes, which hides the softmax inside it. The copy runs the same code
    object with ``softmax``, ``torch.bmm`` and ``has_torch_function`` (always False: the call
    has already been dispatched) replaced in its globals; nothing global is patched.
    Depends on the function calling ``softmax``, ``torch.bmm`` and ``has_torch_function``
    by name (torch 2.13).
    """
    function = F.multi_head_attention_forward
    code = function.__code__
    if "softmax" not in code.co_names or "has_torch_function" not in code.co_names:
        raise RuntimeError(
            f"This PyTorch's {function.__name__} no longer calls softmax by name; attention "
            "in nn.MultiheadAttention cannot be intercepted. Please report this."
        )

    def has_torch_function(*args: Any) -> bool:
        return False

    namespace = {
        **function.__globals__, "softmax": softmax, "has_torch_function": has_torch_function, "torch": _TorchWith(bmm=bmm),
    }
    copy = types.FunctionType(code, namespace, function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
