"""DecompX as a Captum attribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from captum.attr import Attribution
from torch import Tensor

from .._compat import TargetType, UnsupportedModelError
from ..capture import LogProbTarget, Probe
from ..capture.adapters.images import encoded_images
from ..capture.decomposition import (
    ExplainedRun, FirstLayerInput, LinearisationPoints, Points, ShareGradients, model_modules, one_example_images, share_outputs,
    without_biases,
)
from ..capture.inputs import QueryIndex
from ..capture.record import ForwardRecord, check_gradients_possible, record_forward
from ..capture.runner import resolve_adapter
from ..maps import half_precision
from ._base import AttentionAttributionBase, Scores, attribute_method
from ._decomposed import LogitReads, attention_rows, logit_reads
from ._registry import MethodSpec


@dataclass
class ModelCall:
    """The explained forward's inputs and further arguments, for the forward on the shares."""

    inputs: tuple[Tensor, ...]
    additional_forward_args: Any


@dataclass
class GradientShares:
    """``(B, N)``: each token's share of the read logits (or its sensitivity,
    ``multiply_by_inputs=False``), from the backward of a forward under
    :class:`~captum_attention.capture.decomposition.ShareGradients`, checked to add up to
    them."""

    scores: Tensor


class DecompX(AttentionAttributionBase, Attribution):
    r"""DecompX: each input token's share of the explained logit, carried through every layer.

    Modarressi, Fayyaz, Aghazadeh, Yaghoobzadeh & Pilehvar, "DecompX: Explaining
    Transformers Decisions by Propagating Token Decomposition", ACL 2023
    (https://arxiv.org/abs/2306.02873). Every hidden state is kept as a sum of one vector
    per input token, :math:`x_i = \sum_k x_{i,k}` (in the first layer, :math:`x_{i,k} =
    \delta_{ik} x_i`), and each module is applied to the shares as the linear map it is
    at the forward's own point: attention at its probabilities, each norm at its token's
    statistics, each activation at its zero-origin slope :math:`\mathrm{act}(z)/z`
    (``GeLU_ZO``; the pooler's ``tanh`` the same way), each bias shared among the tokens
    by the absolute dot products of their shares with it (``absdot``). The classifier
    head (pooler included) or the final norm and unembedding follow the last layer, so
    that token k's score is its share of the explained logit,

    .. math::

        r_k = z_{i,k}[w], \qquad \sum_k r_k = z_i[w] .

    The scores are signed, in logit units, and add up to the logit (checked: what bends the
    states without being linearised, an activation written out of other functions or a
    mixture of experts' routing, is refused in one line). A gated feed-forward (Llama's
    :math:`\mathrm{act}(W_g x) \odot W_u x`) holds the activation at its value and shares
    :math:`W_u x`, as the attention holds its probabilities and shares the values; the
    authors' code covers BERT and RoBERTa, and the rest is this generalisation. An
    answer's span sums its tokens' logits (not their log-probabilities, whose normaliser is
    no sum over tokens).

    Cost: one forward of :math:`N + 1` rows per example (a zero input, which carries the
    value bias, and one row per token's share), through the model's own modules with the
    attention held at the explained forward's probabilities: about :math:`N` forwards of
    compute, and :math:`N^2 D_{ff}` numbers at the widest point per example. It suits
    short inputs (a classifier's sentence, a prompt of a few hundred tokens). A model
    without any bias (Llama, Mistral, Gemma) has no bias to share, so the forward on the
    shares is linear in the first layer's input and each token's share is the gradient of
    that linear map times its state: the explained forward runs with that map as its
    backward, and one backward gives every share, at any length (about a
    forward+backward in time and memory). The probabilities are held inside
    transformers' sdpa function under a streaming capture, and where the attention's
    softmax computes them under an eager one. Registered (``"decompx"``), not
    in the reports.

    With ``multiply_by_inputs=False`` (Captum's local attribution) token k scores how much
    the logit moves per unit of its state through the same linear map, the L1 norm of
    :math:`J_k = \partial z_i[w] / \partial x_k` summed as Captum's ``Saliency`` sums a
    gradient: :math:`r_k = \lVert J_k \rVert_1`, unsigned. The map is linear in the first
    layer's input and the biases together (each bias added, not shared), so one forward
    and one backward give it on any model, biases or not, checked as above: the shares
    :math:`J_k^\top x_k` and the biases' part :math:`(\partial z / \partial b)^\top b`
    must add up to the logit.

    Args:
        $constructor_args
        multiply_by_inputs (bool, optional): each token's share of the logit
            (:math:`J_k^\top x_k`, its bias shares included); False: the sensitivity
            :math:`\lVert J_k \rVert_1`. Default: True.

    Example::

        >>> scores = DecompX(model).attribute(input_ids, target=1, additional_forward_args=(mask,))
        >>> scores.shape  # (batch, seq_len): each token's share of class 1's logit
        >>> local = DecompX(model, multiply_by_inputs=False).attribute(input_ids, target=1,
        ...                                                        additional_forward_args=(mask,))
    """

    spec = MethodSpec(
        "decompx", "DecompX", encoder_decoder=False, signed=True, reads_target=True, reads_query_row=False, in_reports=False
    )

    def __init__(self, forward_func: Any, *args: Any, multiply_by_inputs: bool = True, **kwargs: Any) -> None:
        super().__init__(forward_func, *args, **kwargs)
        self._multiply_by_inputs = multiply_by_inputs

    @property
    def multiplies_by_inputs(self) -> bool:
        return self._multiply_by_inputs

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: Literal[False] = False,
    ) -> Scores:
        r"""Each token's share of the target logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            $query_index
            return_maps (bool, optional): the method carries shares, not per-layer maps;
                True is an error. Default: False.

        $returns
        """
        self._refuse_maps(return_maps, "carries each token's share of the logit")
        return self._explain(inputs, target, additional_forward_args, query_index, False)

    def _probes(self, effective: bool, **options: Any) -> list[Probe]:
        modules = model_modules(self.model, resolve_adapter(self.model, self.adapter))  # one walk of the tree per call
        # under inference_mode, where no backward runs, a model without biases takes the forward on the shares too
        backward = not self._multiply_by_inputs or (without_biases(modules) and not torch.is_inference_mode_enabled())
        if backward:
            check_gradients_possible()
        return [*super()._probes(effective, **options), ShareGradients(modules) if backward else LinearisationPoints(modules)]

    def _forward(self, inputs: tuple[Tensor, ...], additional_forward_args: Any, *args: Any) -> ForwardRecord:
        if self.model.training:
            raise ValueError("DecompX may re-run the model, which dropout would change: call model.eval().")
        record = super()._forward(inputs, additional_forward_args, *args)
        return record.with_result(ModelCall(inputs, additional_forward_args))

    def _explained(self, record: ForwardRecord, target: TargetType | LogProbTarget, retain_graph: bool = False) -> ForwardRecord:
        record = super()._explained(record, target, retain_graph).with_result(logit_reads(record, target))
        first = record.results.get(FirstLayerInput)
        if first is None:
            return record
        with torch.enable_grad():  # callers such as NoiseTunnel run under no_grad
            read_logits = _read_logits(record)
        gradient = first.gradient(self.model, read_logits, record.num_calls, record.target_real.shape[1], retain_graph)
        if not self._multiply_by_inputs:
            if gradient is None:
                raise UnsupportedModelError(
                    f"DecompX(multiply_by_inputs=False) reads a backward, but {type(self.model).__name__}'s explained logit "
                    "does not reach its first layer's input through one (part of its forward runs without gradients)."
                )
            _check_sum(gradient.parts(), read_logits.detach(), record.logits.dtype)
            return record.with_result(GradientShares(gradient.sensitivity()))
        if gradient is None or not _adds_up(gradient.parts(), read_logits.detach(), record.logits.dtype):
            return record  # the forward on the shares decides, or refuses
        return record.with_result(GradientShares(gradient.shares()))

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        found = record.results.get(GradientShares)
        if found is not None:
            return found.scores.to(record.target_real.device), []
        call, reads = record.result(ModelCall), record.result(LogitReads)
        run = ExplainedRun(self.model, resolve_adapter(self.model, self.adapter), self.forward_func, call.inputs,
                           call.additional_forward_args, self._points(record), record.streaming)
        logits = _read_logits(record).detach()
        tokens = record.target_real.shape[1]
        probs = [attention_rows(record, index, slice(0, tokens)) for index in range(record.num_calls)]
        shares = _read_shares(run, probs, reads, logits, record.logits.dtype)
        _check_sum(shares, logits, record.logits.dtype)
        return shares[:, 1:].to(record.target_real.device), []

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        return self._scores(record)[0]

    def _points(self, record: ForwardRecord) -> Points:
        """The points the explained forward recorded; after a forward under
        :class:`~captum_attention.capture.decomposition.ShareGradients` whose shares did
        not add up, recorded in one more forward."""
        if Points in record.results:
            return record.result(Points)
        call = record.result(ModelCall)
        return record_forward(
            self.forward_func, self.model, call.inputs, call.additional_forward_args, self.adapter,
            probes=[LinearisationPoints()], streaming=record.streaming,
        ).result(Points)


def _read_shares(run: ExplainedRun, probs: list[Tensor], reads: LogitReads, logits: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, 1 + N)``: the read logits of the forward on the shares (:func:`share_outputs`).
    One example's images go through the vision tower once, its copies taking them encoded,
    where its shares then add up to its ``logits``; else, or where that forward fails, every
    copy carries the images' inputs (and reruns the tower)."""
    images = one_example_images(run)
    encoded = None if images is None else encoded_images(run.model, images)
    if encoded is not None:
        try:
            shares = _read(share_outputs(run, probs, encoded), reads)
        except Exception:  # noqa: BLE001 - the forward takes them otherwise (BLIP-2's requires the pixels)
            shares = None
        if shares is not None and _adds_up(shares, logits, dtype):
            return shares
    return _read(share_outputs(run, probs), reads)


def _read(logits: Tensor, reads: LogitReads) -> Tensor:
    """``(B, S)``: the read logits of ``(B, S, C)`` classifier or ``(B, S, T, V)`` language
    model logits, summed over an answer's tokens."""
    tokens = reads.tokens.to(logits.device)
    if logits.dim() == 3:
        return logits.gather(2, tokens[:, None, :].expand(-1, logits.shape[1], -1)).sum(dim=-1)
    batch = torch.arange(logits.shape[0], device=logits.device)[:, None, None]
    rows = torch.arange(logits.shape[1], device=logits.device)[None, :, None]
    return logits[batch, rows, reads.positions.to(logits.device)[:, None, :], tokens[:, None, :]].sum(dim=-1)


def _read_logits(record: ForwardRecord) -> Tensor:
    """``(B,)`` float32: the explained forward's logits that its :class:`LogitReads` name,
    summed over an answer's tokens, in the autograd graph where the forward built one."""
    return _read(record.logits[:, None], record.result(LogitReads))[:, 0].float()


def _adds_up(parts: Tensor, logits: Tensor, dtype: torch.dtype) -> bool:
    """Whether each example's parts ``(B, K)`` (the tokens' shares, and the biases') add
    up to its logit ``(B,)`` within what rounding allows in the model's ``dtype``: 1e-3 of
    the logit (at least of 1) and 1e-5 of the parts' absolute sum, whose rounding the sum
    carries; in half precision 5e-2 of the larger of the two, as a bfloat16 forward alone
    moves a logit by a few percent of that scale."""
    logit_scale, parts_scale = logits.abs().clamp(min=1.0), parts.abs().sum(dim=1)
    if half_precision(dtype):
        allowed = 5e-2 * torch.maximum(logit_scale, parts_scale)
    else:
        allowed = 1e-3 * logit_scale + 1e-5 * parts_scale
    return bool(((parts.sum(dim=1) - logits).abs() <= allowed).all())


def _check_sum(parts: Tensor, logits: Tensor, dtype: torch.dtype) -> None:
    """Refuse in one line where the parts do not add up to the logits (:func:`_adds_up`;
    in half precision the refusal says to explain the model in float32)."""
    half = half_precision(dtype)
    gap = (parts.sum(dim=1) - logits).abs().amax()
    if not _adds_up(parts, logits, dtype):
        if half:
            raise UnsupportedModelError(
                f"DecompX's shares add up to logits {gap.item():.3g} away from the model's in {dtype}, beyond its rounding: "
                "explain the model in float32 (model.float())."
            )
        raise UnsupportedModelError(
            f"DecompX's shares add up to logits {gap.item():.3g} away from the model's: some module bends the states "
            "without being linearised (an activation written out of other functions, a mixture of experts' routing)."
        )
