"""Encoder-decoder references: Chefer et al.'s co-attention rules, the joint-graph rollout,
Grad-SAM and raw attention, from the ``(attention, gradient)`` pairs of an eager model's
``encoder_attentions``, ``decoder_attentions`` and ``cross_attentions``. Full matrices, one
example at a time, in float64: a different code path from the library's. The explained
row is the last target token's; with ``span=True`` the sum of every target token's row
(an answer's span, the gradients then those of its summed objective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Seq2SeqReference:
    encoder: list[tuple[torch.Tensor, torch.Tensor]]  # (attention, gradient), per layer
    decoder: list[tuple[torch.Tensor, torch.Tensor]]
    cross: list[tuple[torch.Tensor, torch.Tensor]]
    source_lengths: list[int]  # real source tokens per example (a block starting at 0)
    target_lengths: list[int]  # target tokens up to the explained one


def blocks(layers, b: int, rows: int, cols: int):
    return [(a[b, :, :rows, :cols].double(), g[b, :, :rows, :cols].double()) for a, g in layers]


def cam(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return (grad * attn).clamp(min=0).mean(0)


def normalised(relevance: torch.Tensor) -> torch.Tensor:
    """Chefer et al.'s handle_residual, a zero row staying an identity row."""
    eye = torch.eye(len(relevance), dtype=torch.float64)
    residual = relevance - eye
    return torch.nan_to_num(residual / residual.sum(-1, keepdim=True), nan=0.0) + eye


def _row(matrix: torch.Tensor, span: bool) -> torch.Tensor:
    return matrix.sum(0) if span else matrix[-1]


def reference_chefer(ref: Seq2SeqReference, b: int, span: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s, t = ref.source_lengths[b], ref.target_lengths[b]
    r_ss = torch.eye(s, dtype=torch.float64)
    for a, g in blocks(ref.encoder, b, s, s):
        r_ss = r_ss + cam(a, g) @ r_ss
    r_qq, r_qs = torch.eye(t, dtype=torch.float64), torch.zeros(t, s, dtype=torch.float64)
    for (a, g), (ca, cg) in zip(blocks(ref.decoder, b, t, t), blocks(ref.cross, b, t, s)):
        self_cam = cam(a, g)
        r_qq, r_qs = r_qq + self_cam @ r_qq, r_qs + self_cam @ r_qs
        r_qs = r_qs + normalised(r_qq).T @ cam(ca, cg) @ normalised(r_ss)
    return _row(r_qs, span), _row(r_qq, span)


def reference_joint_rollout(ref: Seq2SeqReference, b: int, span: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s, t = ref.source_lengths[b], ref.target_lengths[b]

    def rollout_step(attn: torch.Tensor) -> torch.Tensor:
        step = 0.5 * attn.mean(0) + 0.5 * torch.eye(len(attn[0]), dtype=torch.float64)
        return step / step.sum(-1, keepdim=True)

    joint = torch.eye(s + t, dtype=torch.float64)
    for a, _ in blocks(ref.encoder, b, s, s):
        layer = torch.eye(s + t, dtype=torch.float64)
        layer[:s, :s] = rollout_step(a)
        joint = layer @ joint
    for (a, _), (ca, _) in zip(blocks(ref.decoder, b, t, t), blocks(ref.cross, b, t, s)):
        layer = torch.eye(s + t, dtype=torch.float64)
        layer[s:, s:] = rollout_step(a)
        joint = layer @ joint
        layer = torch.eye(s + t, dtype=torch.float64)
        layer[s:, :s], layer[s:, s:] = 0.5 * ca.mean(0), 0.5 * torch.eye(t, dtype=torch.float64)
        joint = layer @ joint
    return _row(joint[s:, :s], span), _row(joint[s:, s:], span)


def reference_grad_sam(ref: Seq2SeqReference, b: int, span: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row's own (no row is chosen): a span's is its summed objective's; the
    heads of each layer averaged (an encoder may have fewer than its decoder: Donut's)."""
    s, t = ref.source_lengths[b], ref.target_lengths[b]
    h = lambda a, g: (a * g.clamp(min=0)).sum(dim=(0, 2)) / a.shape[0]  # noqa: E731
    source = sum(h(a, g) for a, g in blocks(ref.encoder, b, s, s)) / (len(ref.encoder) * s)
    target_maps = blocks(ref.decoder, b, t, t) + blocks(ref.cross, b, t, s)
    target = sum(h(a, g) for a, g in target_maps) / (len(target_maps) * t)
    return source, target


def reference_raw(ref: Seq2SeqReference, b: int, span: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    s, t = ref.source_lengths[b], ref.target_lengths[b]
    (a, _), (ca, _) = blocks(ref.decoder, b, t, t)[-1], blocks(ref.cross, b, t, s)[-1]
    return _row(ca.mean(0), span), _row(a.mean(0), span)


SEQ2SEQ_REFERENCES: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]] | None] = {
    "transformer_attribution": reference_chefer,
    "rollout": reference_joint_rollout,
    "grad_sam": reference_grad_sam,
    "raw": reference_raw,
    "attn_lrp": None,  # not a function of the maps: test_attn_lrp.py
}
"""Per registered method (see ``methods.py``), its encoder-decoder reference: ``(source
scores, target scores)`` of example ``b`` (``span=True``: of every target row summed)."""


def cross_attending_reference(
    method: str, layers: list[tuple[str, torch.Tensor, torch.Tensor]], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source scores (s,), target scores (t,))`` of one example of a decoder without an
    encoder that cross-attends to s states (Mllama's image features), from its layers in
    forward order: ``("decoder", attention (H, t, t), gradient)`` or ``("cross",
    attention (H, t, s), gradient)``, cut to the real tokens up to the last query; the
    rows ``rows`` (of the t) summed. R^ss is the identity (no encoder layer mixes the
    states)."""
    t = layers[0][1].shape[-2]
    s = next(a for role, a, _ in layers if role == "cross").shape[-1]
    layers = [(role, a.double(), g.double()) for role, a, g in layers]
    eye_t = torch.eye(t, dtype=torch.float64)
    if method == "transformer_attribution":
        r_qq, r_qs = eye_t, torch.zeros(t, s, dtype=torch.float64)
        for role, a, g in layers:
            if role == "cross":
                r_qs = r_qs + normalised(r_qq).T @ cam(a, g)
            else:
                r_qq, r_qs = r_qq + cam(a, g) @ r_qq, r_qs + cam(a, g) @ r_qs
        return r_qs[rows].sum(0), r_qq[rows].sum(0)
    if method == "rollout":
        joint = torch.eye(s + t, dtype=torch.float64)
        for role, a, _ in layers:
            layer = torch.eye(s + t, dtype=torch.float64)
            if role == "cross":  # half on itself, half on the states, renormalised (padding tiles cut)
                layer[s:, :s], layer[s:, s:] = 0.5 * a.mean(0), 0.5 * eye_t
                layer[s:] = layer[s:] / layer[s:].sum(-1, keepdim=True)
            else:
                step = 0.5 * a.mean(0) + 0.5 * eye_t
                layer[s:, s:] = step / step.sum(-1, keepdim=True)
            joint = layer @ joint
        return joint[s:, :s][rows].sum(0), joint[s:, s:][rows].sum(0)
    if method == "grad_sam":  # every query row's own; the states are never queries
        heads = layers[0][1].shape[0]
        total = sum((a * g.clamp(min=0)).sum(dim=(0, 2)) for _, a, g in layers)
        return torch.zeros(s, dtype=torch.float64), total / (len(layers) * heads * t)
    if method == "raw":  # the last layer of each kind
        last = {role: a for role, a, _ in layers}
        return last["cross"].mean(0)[rows].sum(0), last["decoder"].mean(0)[rows].sum(0)
    raise KeyError(method)
