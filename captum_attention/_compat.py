"""Every reliance on private internals of torch, transformers and Captum, in one place.

Each item says what it depends on and the versions it was checked against (torch 2.13,
transformers 5.24, captum 0.9). When one of these libraries moves an internal, this is the
only file to change. Imported by every layer; imports none of them.
"""

from __future__ import annotations

import gc
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

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


def in_place_count(tensor: Tensor) -> int | None:
    """How many times ``tensor`` was changed in place: autograd's version counter
    (``Tensor._version``, checked on torch 2.13); None for a tensor made under
    ``torch.inference_mode()``, which keeps none."""
    return None if tensor.is_inference() else int(tensor._version)


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
    "implementation_owner",
    "model_configs",
    "pretty_tokens",
    "runnable_implementation",
    "declared_outputs",
    "error_line",
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


@dataclass(frozen=True)
class RecorderSpec:
    """One entry of a transformers ``_can_record_outputs`` declaration, normalised: which
    modules (by class, or by class name, optionally under a layer name) produce an output,
    and at which index of their output tuple."""

    target_class: type | None
    index: int
    layer_name: str | None
    class_name: str | None

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module called ``name`` inside the declaring model is one of these."""
        by_class = self.target_class is not None and isinstance(module, self.target_class)
        by_name = self.class_name is not None and name.endswith(self.class_name)
        if not (by_class or by_name):
            return False
        if self.layer_name is None:
            return True
        return "." + self.layer_name.strip(".") + "." in "." + name + "."


def recorder_specs(model_class: type, kinds: Sequence[str]) -> list[tuple[str, RecorderSpec]]:
    """``(kind, spec)`` for each entry of ``model_class._can_record_outputs`` under ``kinds``
    (e.g. "attentions", "cross_attentions"): an ``OutputRecorder``, a class name or a
    class, as transformers 5.24 declares them."""
    recorder = output_recorder_class()
    declared = declared_outputs(model_class)
    specs: list[tuple[str, RecorderSpec]] = []
    for kind in kinds:
        entries = declared.get(kind, [])
        for entry in entries if isinstance(entries, list) else [entries]:
            if recorder is not None and isinstance(entry, recorder):
                spec = RecorderSpec(entry.target_class, entry.index, entry.layer_name, entry.class_name)
            elif isinstance(entry, str):
                spec = RecorderSpec(None, 1, None, entry)
            else:
                spec = RecorderSpec(entry, 1, None, None)
            specs.append((kind, spec))
    return specs


def attn_implementation(model: nn.Module) -> str | None:
    """The attention implementation a transformers model runs (``config._attn_implementation``:
    "eager", "sdpa", "flash_attention_2", ...), or None for other modules. Checked on 5.24."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def uncompiled(model: nn.Module) -> nn.Module:
    """The model a ``torch.compile``-d one wraps (``OptimizedModule._orig_mod``), whose
    forward it runs and whose class and weights are the model's; any other module itself."""
    wrapped = getattr(model, "_orig_mod", None)
    return wrapped if isinstance(wrapped, nn.Module) else model


def transformers_models(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers models in ``model``: the model itself where it is one,
    else those a wrapper holds (a compiled model's, a PEFT model's, the backbone of the
    user's own module)."""
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{outer}." if outer else "") for outer, _ in found)
        if not inside and isinstance(module, PreTrainedModel):
            found.append((name, module))
    return [module for _, module in found]


def called_transformers_model(forward_func: Callable[..., Any]) -> Any:
    """The transformers model whose arguments ``forward_func`` takes by name: the model
    itself, or the one a PEFT model wraps (``get_base_model()``; a PEFT model's forward
    passes every keyword argument on to it); None for other functions."""
    from transformers import PreTrainedModel

    if isinstance(forward_func, PreTrainedModel):
        return forward_func
    base = getattr(forward_func, "get_base_model", None) if isinstance(forward_func, nn.Module) else None
    model = base() if callable(base) else None
    return model if isinstance(model, PreTrainedModel) else None


def runnable_implementation(model: nn.Module, wanted: str) -> str | None:
    """The implementation the transformers model ``model`` would run if switched to
    ``wanted`` at run time (transformers' own check, which may fall back from sdpa to eager
    and raises where the model supports neither), or None for a model that chooses its
    attention classes at construction and cannot be switched (private
    ``_can_set_attn_implementation`` and ``_check_and_adjust_attn_implementation``; checked
    on 5.24)."""
    can_switch = getattr(type(model), "_can_set_attn_implementation", None)
    if can_switch is None or not can_switch():
        return None
    check = cast(Callable[..., str], getattr(model, "_check_and_adjust_attn_implementation"))
    return check(wanted, is_init_check=False)


def model_configs(model: nn.Module) -> list[Any]:
    """Every configuration object a transformers model's modules read: the configs of
    the model and its sub-models and, at any depth, their ``sub_configs``."""
    found: dict[int, Any] = {}
    pending: list[Any] = [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if hasattr(config, "_attn_implementation") and id(config) not in found:
            found[id(config)] = config
            pending.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))
    return list(found.values())


def implementation_owner(config_class: type) -> type:
    """The class whose ``_attn_implementation`` property a config of ``config_class``
    reads (transformers' ``PreTrainedConfig``, or a family that overrides it)."""
    return next(cls for cls in config_class.__mro__ if "_attn_implementation" in vars(cls))


def pretty_tokens(ids: Tensor, tokenizer: Any) -> list[str]:
    """Token ids as readable strings, as Captum's LLM results show them (its private
    ``_convert_ids_to_pretty_tokens``, checked on 0.9; else the tokenizer's tokens)."""
    try:
        from captum.attr._core.llm_attr import _convert_ids_to_pretty_tokens
    except ImportError:
        return list(tokenizer.convert_ids_to_tokens(ids.tolist()))
    with warnings.catch_warnings():  # where re-encoding the decoded ids does not give them back (a SentencePiece text
        warnings.simplefilter("ignore")  # cut mid-word), Captum warns per token and decodes each id alone, as shown
        return list(_convert_ids_to_pretty_tokens(ids, tokenizer))


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


def forward_hooks(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Each of ``model``'s modules that carries forward hooks or forward pre-hooks
    (``Module._forward_hooks`` and ``_forward_pre_hooks``, checked on torch 2.13), by name,
    with the hooks' handle ids (unique in the process): outside a capture, the user's own.
    transformers' output recorders (:data:`OUTPUT_RECORDERS`) are left out."""
    found = []
    for name, module in model.named_modules():
        hooks = [*module._forward_pre_hooks.items(), *module._forward_hooks.items()]
        ids = tuple(handle for handle, hook in hooks if getattr(hook, "__module__", None) != OUTPUT_RECORDERS)
        if ids:
            found.append((name or type(model).__name__, ids))
    return found


OUTPUT_RECORDERS = "transformers.utils.output_capturing"
"""The module of the forward hooks transformers installs on a model's modules to collect
``output_attentions``/``output_hidden_states`` (checked on 5.25): they return nothing and
record only while transformers collects, so they change no output."""


def hooked_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules that carry the user's forward hooks (:func:`forward_hooks`)."""
    return [name for name, _ in forward_hooks(model)]


SOFTMAXES = (F.softmax, torch.softmax, Tensor.softmax)
"""torch's softmax functions, as a torch-function mode sees them."""


def attention_softmax(func: Callable[..., Tensor], args: tuple, kwargs: dict) -> Tensor:
    """``func(*args, **kwargs)``, one of :data:`SOFTMAXES` inside an attention call, with
    scores below the lower precision a softmax is asked for (``dtype=``) clamped to that
    precision's least value first. transformers' eager attention (checked on 5.24) takes
    the softmax of float64 scores in float32, where its padding mask of
    ``finfo(float64).min`` overflows to -inf: a row of padding alone (a left-padded causal
    model's first rows) gives NaN, which reaches the real tokens through the next layer's
    zero weights, where the model run with sdpa stays finite. Clamped, every row with a
    score above that least value is bit for bit the same, and such a row is uniform, as in
    float32."""
    dtype = kwargs.get("dtype")
    scores = args[0] if args else kwargs.get("input")
    if not (isinstance(dtype, torch.dtype) and isinstance(scores, Tensor) and scores.dtype.is_floating_point):
        return func(*args, **kwargs)
    if torch.finfo(dtype).bits >= torch.finfo(scores.dtype).bits:
        return func(*args, **kwargs)
    clamped = scores.clamp_min(torch.finfo(dtype).min)
    return func(clamped, *args[1:], **kwargs) if args else func(**{**kwargs, "input": clamped})


class StreamingUnsupported(RuntimeError):
    """The call cannot be explained without materialising the attention (see the message)."""


class UnsupportedModelError(ValueError):
    """A model the library cannot explain exactly (no softmax attention maps, attention it
    cannot read or reproduce); the message says why in one line."""


class NonFiniteScores(UnsupportedModelError):
    """Scores not finite at an example's real tokens while its explained output is: the
    model's gradient is not finite there (a padded row's under its attention kernel can
    spread), which eager attention may not meet."""


def check_one_tensor(scores: Any, name: str) -> None:
    """A one-line ``TypeError`` where ``scores`` (called ``name``) are not one tensor (a
    list; an encoder-decoder's ``(source, target)`` pair, or a method's ``(tokens,
    pixels)``), which the presentation helpers take one at a time."""
    if isinstance(scores, tuple):
        raise TypeError(
            f"{name} is a tuple of {len(scores)} (an encoder-decoder's source and target scores, or tokens and pixels): "
            "show each tensor alone, e.g. its first, the source's."
        )
    if not isinstance(scores, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(scores).__name__}.")


def error_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its class's name where it has none): what a
    one-line refusal quotes of a failure."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@dataclass(frozen=True)
class SdpaCall:
    """The arguments of one call of transformers' ``sdpa`` attention function, as the
    kernel uses them: the key and value heads each serving ``groups`` query heads, the
    scale, the mask, whether the kernel adds its own causal mask, T5's position bias; and
    what only the families' own attention functions model, Gemma-2's logit ``softcap``
    and gpt-oss's per-head attention ``sinks``."""

    query: Tensor
    key: Tensor
    value: Tensor
    scale: float
    mask: Tensor | None
    causal: bool
    position_bias: Tensor | None
    groups: int
    softcap: float | None = None
    sinks: Tensor | None = None


def sdpa_call(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> SdpaCall:
    """What transformers' ``sdpa_attention_forward`` (checked on 5.24) does with its
    arguments, mirrored: each grouped-query key/value head serves ``groups`` consecutive
    query heads (as its ``repeat_kv``, without the copy); the kernel's causal mask only
    for more than one query, no explicit mask and a causal module (keys cropped to the
    queries, as it does); T5's position bias added. Also what sdpa cannot compute but the
    eager functions of Gemma-2 and gpt-oss do: ``softcap`` (``c·tanh(S / c)`` before the
    mask) and ``s_aux``, one sink logit per head that joins each row's softmax and weights
    no value. Anything the recomputation cannot reproduce (per-token ``sinks``) raises
    :class:`StreamingUnsupported`."""
    if dropout:
        raise StreamingUnsupported("attention dropout is active (call model.eval())")
    if kwargs.get("sinks") is not None:
        raise StreamingUnsupported("the attention call passes per-token sinks, which the recomputation does not model")
    sinks = kwargs.get("s_aux")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.numel() != query.shape[1]):
        raise StreamingUnsupported("the attention call passes sinks that are not one logit per head")
    groups = query.shape[1] // key.shape[1]
    if groups * key.shape[1] != query.shape[1] or value.shape[1] != key.shape[1]:
        raise StreamingUnsupported(f"{query.shape[1]} query heads over {key.shape[1]} key heads")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > query.shape[2]:
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
        position_bias = None if position_bias is None else position_bias[..., : query.shape[2]]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    return SdpaCall(
        query, key, value, float(scale), attention_mask, causal, position_bias, groups,
        None if softcap is None else float(softcap), None if sinks is None else sinks.reshape(1, -1, 1, 1),
    )
