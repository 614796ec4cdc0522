"""Where an attention layer's output joins the residual stream, read from the model's own
modules: what ALTI and the norm-based attention with the residual decompose.

The forward records the states each module of a layer returns
(:class:`~captum_attention.capture.probes.LayerBlocks` ``(states=...)``). The sum of the
layer's input and its attention output (that output's bias included) is the input of one
of the layer's norms; the layer is *pre-norm* when that sum is the residual stream itself
(the layer's output is the sum plus one of its modules' outputs: Llama, GPT-2) and
*post-norm* when the norm's output is (the next norm takes it plus one of the modules'
outputs: BERT). Where no norm takes that sum, a norm may take the attention output alone
before the residual (Gemma-2 and 3, OLMo-2): the layer is then pre-norm with that norm on
the attention's side of the sum, if the layer's output is the sum plus one of its
modules' outputs. Or the layer adds its attention output and its feed-forward's to its
input at once (GPT-J, GPT-NeoX, Phi, Falcon, Cohere: attention beside the feed-forward):
the residual stream the attention alone leaves, the input plus the attention output, is
then the sum, as in a pre-norm layer before its feed-forward. A pre-norm layer may
multiply its output by one number (Gemma-4's ``layer_scalar``): the number is kept
(:attr:`AttentionResidual.scale`). Any other wiring (a residual scaled inside the layer,
a second branch after the feed-forward) is refused in one line rather than decomposed
wrongly.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._compat import UnsupportedModelError
from ..maps import LinearNorm, dense_weight, half_precision
from .adapters import AttentionAdapter
from .probes import BlockCall, ModuleStates, Probe, is_norm_module, layer_blocks

_SAME_SCALE = 1e-6
"""How far from one a fitted output scale may be and be one (single precision's rounding)."""

_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
_COMMON_EPS = (1e-5, 1e-6, 1e-12, 0.0)
"""Tried in turn for a norm that writes its epsilon in its code (OLMo's 1e-5), not in an
attribute: the check against the norm's outputs decides."""


@dataclass
class AttentionResidual:
    """One layer's attention block as a sum over tokens.

    Attributes:
        inputs: ``(B, N, D)`` the layer's input :math:`x` (the residual it adds).
        outputs: ``(B, N, D)`` the residual stream after the attention :math:`y`: the
            sum of the input and the attention output (pre-norm), or that sum through the
            norm (post-norm).
        norm: the post-norm as a :class:`~captum_attention.maps.LinearNorm`, or None.
        attention_norm: the norm on the attention output before the residual (Gemma-2),
            as a :class:`~captum_attention.maps.LinearNorm`, or None.
        scale: the number the layer multiplies its output by (Gemma-4's
            ``layer_scalar``; 1 for most): what the attention adds to the residual
            stream reaches the next layer times it.
    """

    inputs: Tensor
    outputs: Tensor
    norm: LinearNorm | None
    attention_norm: LinearNorm | None = None
    scale: float = 1.0

    @property
    def mixing_norm(self) -> LinearNorm | None:
        """The norm every token's attention vector passes through: the post-norm or the
        norm on the attention output (a layer has at most one of them), or None."""
        return self.norm if self.norm is not None else self.attention_norm


def check_one_stream(call: BlockCall) -> None:
    """A one-line refusal for a layer whose hidden states hold several streams per token
    (hyper-connections, Gemma-3n's AltUp), where a decomposition follows one residual vector
    per token."""
    inputs = call.hidden_input
    if inputs.dim() != 3:
        raise UnsupportedModelError(
            f"{type(call.block).__name__} carries hidden states of shape {tuple(inputs.shape)}, several streams per token "
            "(hyper-connections), where the decomposition follows one residual vector per token: the attention block "
            "cannot be written as a sum over tokens."
        )


def attention_residual(call: BlockCall, attention_sums: Tensor, real: Tensor) -> AttentionResidual:
    """Find where the attention output joins the residual in ``call``'s layer.

    Args:
        call: the layer's recorded call, with its modules' states
            (:class:`~captum_attention.capture.probes.LayerBlocks` ``(states=...)``).
        attention_sums: ``(B, N, D)`` :math:`\\sum_j \\sum_m \\alpha^m_{ij} f^m(x_j)`, the
            attention output without its bias, as the method computed it.
        real: ``(B, N)`` bool, the tokens whose rows are compared.
    """
    inputs = call.hidden_input
    name = type(call.block).__name__
    check_one_stream(call)
    if call.states is None:
        raise RuntimeError(f"{name}'s module states were not recorded: capture with LayerBlocks(states=...).")
    seen = call.states
    width = inputs.shape[-1]
    joined = next((s for s in seen if _is_norm(s.module, width) and _joins(s.inputs, inputs, attention_sums, real)), None)
    if joined is None:
        return _sum_without_its_norm(call, attention_sums, real)
    assert joined.inputs is not None
    scale = _output_scale(joined.inputs, [s for s in seen if s is not joined], call.output, real)
    if scale is not None:
        return AttentionResidual(inputs, joined.inputs.detach(), None, scale=scale)
    outputs = [s.output for s in seen]
    if any(s.module is not joined.module and s.inputs is not None and equal_to_rounding(joined.output + added, s.inputs, real)
           for s in seen if _is_norm(s.module, width) for added in outputs):
        return AttentionResidual(inputs, joined.output.detach(), linear_norm(joined.module, joined.inputs, joined.output))
    raise UnsupportedModelError(
        f"{name} adds its attention output to its input before {type(joined.module).__name__}, but neither that sum "
        "(pre-norm) nor the norm's output (post-norm) is what the layer carries on."
    )


def _sum_without_its_norm(call: BlockCall, attention_sums: Tensor, real: Tensor) -> AttentionResidual:
    """``call``'s layer where no norm takes its input plus its attention output: a norm
    takes the attention output alone and the layer carries on its input plus that norm's
    output (Gemma-2's ``post_attention_layernorm``, OLMo-2's), or the layer's output is its
    input plus the attention output plus another module's (GPT-J's feed-forward beside
    the attention); a refusal in one line where neither holds."""
    inputs, seen, name = call.hidden_input, call.states or [], type(call.block).__name__
    zero = torch.zeros_like(inputs)
    for state in seen:
        normed = _is_norm(state.module, inputs.shape[-1]) and _joins(state.inputs, zero, attention_sums, real)
        if not normed and not _joins(state.output, zero, attention_sums, real):
            continue
        summed = inputs + state.output
        scale = _output_scale(summed, [other for other in seen if other is not state], call.output, real)
        if scale is not None:
            norm = linear_norm(state.module, state.inputs, state.output) if normed and state.inputs is not None else None
            return AttentionResidual(inputs, summed.detach(), None, norm, scale)
    raise UnsupportedModelError(
        f"No norm in {name} takes the sum of its input and its attention output, nor the attention output before "
        "a residual the layer carries on, nor does the layer add its attention output beside another module's: "
        "the attention block cannot be written as a sum over tokens (a scaled residual)."
    )


@dataclass
class FinalStates:
    """What a language model's head read, and the norms outside its layers that ran: the
    final norm and the unembedding (:meth:`unembedding`) as ALTI-Logit needs them.

    Attributes:
        head: the output embeddings (None where the model has none).
        head_inputs: ``(B, N, D)`` what the head took, or None.
        last_output: ``(B, N, D)`` the last layer's output, or None.
        norms: ``(module, input, output)`` of each norm outside the layers.
    """

    head: nn.Module | None
    head_inputs: Tensor | None
    last_output: Tensor | None
    norms: list[tuple[nn.Module, Tensor, Tensor]]

    def unembedding(self, real: Tensor) -> tuple[Tensor, Tensor | None, LinearNorm | None]:
        """The head's weight ``(V, D)``, its bias, and the final norm between the last
        layer and the head as a :class:`LinearNorm` (None where the head reads the last
        layer's output itself), checked on the ``real`` tokens; a refusal in one line
        where the head does not read the last layer through a norm."""
        weight = dense_weight(getattr(self.head, "weight", None))
        if self.head_inputs is None or self.last_output is None or not isinstance(weight, Tensor):
            raise UnsupportedModelError(
                "ALTI-Logit explains a language model's next-token logit: the model needs output embeddings "
                "(get_output_embeddings()) that its forward calls."
            )
        bias = getattr(self.head, "bias", None)
        bias = bias.detach() if isinstance(bias, Tensor) else None
        if equal_to_rounding(self.head_inputs, self.last_output, real):
            return weight.detach(), bias, None
        for module, inputs, outputs in self.norms:
            if equal_to_rounding(outputs, self.head_inputs, real) and equal_to_rounding(inputs, self.last_output, real):
                return weight.detach(), bias, linear_norm(module, inputs, outputs)
        raise UnsupportedModelError(
            f"{type(self.head).__name__} reads neither the last layer's output nor a norm of it: ALTI-Logit cannot "
            "carry the layers' additions to the logits."
        )


    def check_logits(self, logits: Tensor, positions: Tensor, tokens: Tensor) -> None:
        """Refuse in one line where the model's ``logits`` ``(B, N, V)`` at ``positions``
        ``(B, K)`` for ``tokens`` ``(B, K)`` are not the head's own (a logit cap or scale)."""
        head_weight = dense_weight(getattr(self.head, "weight", None))
        assert self.head_inputs is not None and isinstance(head_weight, Tensor)
        batch = torch.arange(len(positions), device=positions.device)[:, None]
        read = self.head_inputs[batch, positions.to(self.head_inputs.device)].float()
        weight = head_weight.detach().float()[tokens.to(read.device)]
        predicted = (read * weight).sum(dim=-1)
        bias = getattr(self.head, "bias", None)
        if isinstance(bias, Tensor):
            predicted = predicted + bias.detach().float()[tokens.to(read.device)]
        actual = logits[batch.to(logits.device), positions.to(logits.device), tokens.to(logits.device)]
        if not equal_to_rounding(predicted, actual.to(predicted.device), None):
            raise UnsupportedModelError(
                f"The model's logits are not its {type(self.head).__name__}'s products with the final states "
                "(a logit cap or scale, or a forward_func that runs the model under torch.autocast): ALTI-Logit's shares "
                "would not add up to them."
            )


class FinalReadout(Probe):
    """Records :class:`FinalStates`: the input of the model's output embeddings, the last
    layer's output and the norms outside the layers (both capture modes)."""

    def __init__(self) -> None:
        self._states = FinalStates(None, None, None, [])

    def enter(self, model: nn.Module, adapter: AttentionAdapter, stack: ExitStack) -> None:
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        states = self._states = FinalStates(head, None, None, [])
        blocks = layer_blocks(model, adapter)
        inside = {id(module) for block in blocks if block is not None for module in block.modules()}

        def keep_head_input(module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], Tensor):
                states.head_inputs = args[0].detach()

        def keep_norm(module: nn.Module, args: tuple, output: Any) -> None:
            if args and isinstance(args[0], Tensor) and isinstance(output, Tensor):
                states.norms.append((module, args[0].detach(), output.detach()))

        def keep_last(module: nn.Module, args: tuple, output: Any) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, Tensor):
                states.last_output = hidden.detach()

        if isinstance(head, nn.Module):
            stack.callback(head.register_forward_pre_hook(keep_head_input).remove)
        for module in model.modules():
            if id(module) not in inside and module is not head and "norm" in type(module).__name__.lower():
                stack.callback(module.register_forward_hook(keep_norm).remove)
        last = next((block for block in reversed(blocks) if block is not None), None)
        if last is not None:
            stack.callback(last.register_forward_hook(keep_last).remove)

    def result(self) -> FinalStates:
        return self._states


def linear_norm(module: nn.Module, inputs: Tensor, outputs: Tensor) -> LinearNorm:
    """``module`` (a LayerNorm or an RMSNorm) as the linear map it was on ``inputs``
    ``(B, N, D)``, checked against the ``outputs`` it gave (its epsilon its attribute's,
    else the first of :data:`_COMMON_EPS` they confirm); a norm of another form is refused
    in one line."""
    states = inputs.detach().float()
    named = next((float(getattr(module, name)) for name in _EPS_NAMES if isinstance(getattr(module, name, None), float)), None)
    epsilons = _COMMON_EPS if named is None else (named,)
    weight = getattr(module, "weight", None)
    if weight is None:
        weights = [torch.ones(states.shape[-1], device=states.device, dtype=torch.float32)]
    else:
        weights = [weight.detach().float(), 1.0 + weight.detach().float()]
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float()
    for centred in (True, False):
        spread = states.var(dim=-1, unbiased=False) if centred else states.pow(2).mean(dim=-1)
        for eps in epsilons:
            for gamma in weights:
                norm = LinearNorm(gamma, (spread + eps).rsqrt(), centred, bias)
                if equal_to_rounding(norm(states), outputs, None):  # within what the outputs' precision allows
                    return norm
    raise UnsupportedModelError(
        f"{type(module).__name__} is neither a LayerNorm nor an RMSNorm of its weight: its output cannot be written "
        "as a linear map of its input at its statistics."
    )


def _output_scale(summed: Tensor, others: list[ModuleStates], output: Tensor, real: Tensor) -> float | None:
    """The number :math:`s` with ``output`` :math:`= s\\,(` ``summed`` :math:`+` one of
    ``others``' outputs :math:`)` on the ``real`` rows: 1 for most layers, Gemma-4's
    ``layer_scalar``, fitted by least squares (so that in half precision a number near
    one is not taken for one); None where there is none."""
    rows = real.to(output.device)
    for other in others:
        if other.output.shape != summed.shape:
            continue
        states = summed + other.output
        carried, wanted = states[rows].double().flatten(), output[rows].double().flatten()
        scale = float(carried @ wanted / (carried @ carried).clamp(min=torch.finfo(torch.float64).tiny))
        if equal_to_rounding(scale * states, output, real):
            return 1.0 if abs(scale - 1.0) <= _SAME_SCALE else scale
    return None


def _is_norm(module: nn.Module, width: int) -> bool:
    weight = getattr(module, "weight", None)
    shaped = weight is None or (isinstance(weight, Tensor) and tuple(weight.shape) == (width,))
    return is_norm_module(module) and shaped


def _joins(states: Tensor | None, inputs: Tensor, attention_sums: Tensor, real: Tensor) -> bool:
    """Whether ``states`` is the input plus the attention sums plus one bias shared by
    every real token."""
    if states is None or states.shape != inputs.shape:
        return False
    rows = real.to(states.device)
    bias = (states.float() - inputs.float() - attention_sums.float())[rows]
    if not len(bias):
        return False
    spread = (bias - bias[:1]).abs().amax()
    return bool((spread <= _tolerance(states) * states.float()[rows].abs().amax()).item())


def equal_to_rounding(actual: Tensor, expected: Tensor, real: Tensor | None, half: float = 1e-2) -> bool:
    """Equal to rounding, on the ``real`` rows (all with None): within 1e-4 of the scale
    in single or double precision, ``half`` of it where either is half precision."""
    if actual.shape != expected.shape:
        return False
    if real is not None:
        actual, expected = actual[real.to(actual.device)], expected[real.to(expected.device)]
    if not len(actual):
        return False
    reference = expected.float().abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
    return bool(((actual.float() - expected.float()).abs().amax() <= _tolerance(actual, expected, half=half) * reference).item())


def _tolerance(*tensors: Tensor, half: float = 1e-2) -> float:
    """What rounding allows, relative to the scale: 1e-4 in single or double precision,
    ``half`` in half precision."""
    return half if any(half_precision(t.dtype) for t in tensors) else 1e-4
