"""One capture-mode decision for attributions and metrics alike.

A call asks for ``capture="auto"``, ``"streaming"`` or ``"eager"``.
:class:`CaptureRunner` decides, records why (``last``, what ``last_capture`` shows) and
falls back: ``auto`` streams wherever that is exact and otherwise runs eager, also when
streaming turns out impossible only inside the forward
(:class:`~captum_attention.capture.StreamingUnsupported`) or only in the scores
(:meth:`CaptureRunner.retried_eager`); ``streaming`` raises instead of falling back;
``eager`` never streams.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence, TypeVar

from torch import Tensor, nn

from .._compat import StreamingUnsupported, UnsupportedModelError
from .adapters import AttentionAdapter, default_adapter
from .adapters.huggingface import check_called_with_ids
from .probes import Probe

logger = logging.getLogger("captum_attention")

CaptureMode = Literal["auto", "streaming", "eager"]
CAPTURE_MODES: tuple[str, ...] = ("auto", "streaming", "eager")

Result = TypeVar("Result")


def check_capture_mode(mode: str) -> None:
    """A clear error unless ``mode`` is one of :data:`CAPTURE_MODES`."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {mode!r}.")


def resolve_model(forward_func: Callable[..., Any], model: nn.Module | None, who: str = "This call") -> nn.Module:
    """``model``, or ``forward_func`` when it is the module; a clear error otherwise (a
    transformers pipeline, or a sentence-transformers model, whose forward takes a dict of
    features, as ``forward_func`` alone, say what to pass)."""
    if model is None:
        if not isinstance(forward_func, nn.Module):
            wrapped = getattr(forward_func, "model", None)
            raise TypeError(
                f"{who} needs the nn.Module that holds the attention layers: pass model=... "
                "(forward_func is not a module" + (
                    f"; {type(forward_func).__name__} holds one: pass forward_func.model, with its tokenizer's ids as inputs"
                    if isinstance(wrapped, nn.Module) else ""
                ) + ")."
            )
        check_called_with_ids(forward_func)
        model = forward_func
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}.")
    return model


def resolve_adapter(model: nn.Module, adapter: AttentionAdapter | None) -> AttentionAdapter:
    """``adapter``, or the built-in one for ``model``."""
    return adapter if adapter is not None else default_adapter(model)


def check_inputs(adapter: AttentionAdapter, model: nn.Module, tensors: tuple[Tensor, ...], returned: str = "") -> None:
    """A one-line error where an encoder-decoder gets one input (its second positional
    input is the decoder's ids, a classifier's too, not the mask), and where images are
    explained through a model whose explained attention is its tokens' (a dual encoder's
    text tower beside its image tower, CLIP's; flattened patches are caught in the forward,
    :func:`~captum_attention.capture.record.record_forward`)."""
    if adapter.is_encoder_decoder(model) and len(tensors) != 2:
        raise TypeError(
            f"{type(model).__name__} is an encoder-decoder: pass inputs=(input_ids, decoder_input_ids){returned} "
            "(a classifier's decoder_input_ids: its input_ids shifted right, as it makes them itself)."
        )
    tower = adapter.image_tower_apart(model) if tensors[0].dim() == 4 else None
    if tower is not None:
        raise image_tower_refusal(model, tower)


def image_tower_refusal(model: nn.Module, tower: str) -> UnsupportedModelError:
    """The one-line refusal of pixels explained through ``model``, which reads token ids and
    its images through ``tower`` apart (:meth:`AttentionAdapter.image_tower_apart`)."""
    return UnsupportedModelError(
        f"{type(model).__name__} reads token ids, and images through its {tower}, whose attention is not the one "
        f"explained here (its tokens' is): to explain the pixels, pass the tower as the model, model=<model>.{tower}, "
        "with the same forward_func."
    )


def stream_refusal(adapter: AttentionAdapter, probes: Sequence[Probe] = ()) -> str | None:
    """Why no call with ``probes`` can stream through ``adapter``, or None."""
    refused = next((probe for probe in probes if "streaming" not in probe.modes), None)
    if refused is not None:
        return refused.eager_reason
    if not getattr(adapter, "streams", False):
        return f"{type(adapter).__name__} does not run attention through transformers' sdpa function"
    return None


@dataclass
class CaptureRunner:
    """Runs one forward in the capture mode a call asked for (see the module docstring).

    Attributes:
        mode: ``"auto"``, ``"streaming"`` or ``"eager"``.
        owner: named in the debug log.
        last: after each call, ``"streaming"`` or ``"eager: <why>"``.
        eager_reason: while set (by :meth:`retried_eager`), why every call runs eager.
    """

    mode: CaptureMode = "auto"
    owner: str = ""
    last: str = ""
    eager_reason: str | None = None

    def __post_init__(self) -> None:
        check_capture_mode(self.mode)

    def run(self, forward: Callable[[bool], Result], eager_reason: str | None = None) -> Result:
        """``forward(streaming)``, streaming unless the mode or ``eager_reason`` (why this
        call needs explicit probabilities) says otherwise."""
        if self.mode == "eager":
            self._note("eager: capture='eager'")
            return forward(False)
        eager_reason = eager_reason or self.eager_reason
        if eager_reason is not None:
            self._refuse_streaming(eager_reason)
            self._note(f"eager: {eager_reason}")
            return forward(False)
        try:
            result = forward(True)
        except StreamingUnsupported as error:
            self._refuse_streaming(str(error), error)
            self._note(f"eager: {error}")
            return forward(False)
        self._note("streaming")
        return result

    def retried_eager(self, call: Callable[[], Result], failure: type[Exception], why: str) -> Result:
        """``call()``; where it raises ``failure`` after its forward streamed under ``auto``,
        ``call()`` once more with every forward eager (``why`` noted in ``last``)."""
        try:
            return call()
        except failure:
            if self.mode != "auto" or self.last != "streaming":
                raise
        # retried outside the handler, so that the failed call's graph is freed first
        self.eager_reason = why
        try:
            return call()
        finally:
            self.eager_reason = None

    def _refuse_streaming(self, reason: str, error: Exception | None = None) -> None:
        if self.mode == "streaming":
            raise ValueError(f"capture='streaming' is not possible here: {reason}. Use capture='auto' or 'eager'.") from error

    def _note(self, how: str) -> None:
        self.last = how
        logger.debug("%s: %s", self.owner or "capture", how)
