"""The shared table of methods: each registered method with its reference re-computation.

The references loop over examples, cut each example's real N×N block out of
``output_attentions`` and its ``autograd.grad`` gradients, and multiply full matrices: a
different code path from the library's batched, padding-masked, vector-propagated one.
``ref`` holds ``attentions`` and ``grads`` (per layer, ``(B, H, T, T)``); ``lengths`` the
real tokens per example (a block starting at 0); ``query`` the explained row.

A method registered in ``captum_attention.METHODS`` without an entry here fails
``test_every_registered_method_has_a_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from captum_attention import METHODS as REGISTERED


def _block(tensor: torch.Tensor, row: int, n: int) -> torch.Tensor:
    return tensor[row, :, :n, :n]


def _row(matrix: torch.Tensor, query) -> torch.Tensor:
    """Row ``query`` of ``matrix``, or the weighted sum of its rows for a weight vector."""
    return query.to(matrix.dtype) @ matrix if isinstance(query, torch.Tensor) else matrix[query]


def reference_grad_sam(ref, lengths):
    """Σ over layers, heads and keys, / (L·M·N), L·M the heads of all layers."""
    scores = torch.zeros(len(lengths), max(lengths))
    all_heads = sum(attn.shape[1] for attn in ref.attentions)
    for b, n in enumerate(lengths):
        total = torch.zeros(n)
        for attn, grad in zip(ref.attentions, ref.grads):
            total += (_block(attn, b, n) * _block(grad, b, n).clamp(min=0)).sum(dim=(0, 2))
        scores[b, :n] = total / (all_heads * n)
    return scores


def reference_grad_sam_key_axis(ref, lengths):
    """Σ over layers, heads and query rows i of A_ij·ReLU(G_ij), per key j, / (L·M·N)."""
    scores = torch.zeros(len(lengths), max(lengths))
    num_layers, num_heads = len(ref.attentions), ref.attentions[0].shape[1]
    for b, n in enumerate(lengths):
        total = torch.zeros(n)
        for attn, grad in zip(ref.attentions, ref.grads):
            total += (_block(attn, b, n) * _block(grad, b, n).clamp(min=0)).sum(dim=(0, 1))
        scores[b, :n] = total / (num_layers * num_heads * n)
    return scores


def knockout_reference(attentions, grads, real: torch.Tensor, last: int) -> torch.Tensor:
    """Per example, over its real tokens up to ``last``: Σ over layers, heads and query rows
    i of A_ij (G_ij − Σ_j' A_ij' G_ij'), in float64."""
    scores = torch.zeros(real.shape)
    for b in range(real.shape[0]):
        idx = (real[b] & (torch.arange(real.shape[1]) <= last)).nonzero().flatten()
        total = torch.zeros(len(idx), dtype=torch.float64)
        for attn, grad in zip(attentions, grads):
            a, g = attn[b][:, idx][:, :, idx].double(), grad[b][:, idx][:, :, idx].double()
            total += (a * (g - (a * g).sum(-1, keepdim=True))).sum(dim=(0, 1))
        scores[b, idx] = total.float()
    return scores


def reference_knockout(ref, lengths):
    """:func:`knockout_reference` over each example's first ``lengths[b]`` tokens."""
    real = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    return knockout_reference(ref.attentions, ref.grads, real, max(lengths) - 1)


def reference_decisive(first_order: torch.Tensor, relevance: torch.Tensor, count: int = 1) -> torch.Tensor:
    """Per row, the ``count`` tokens of largest |relevance| take it; the rest keep ``first_order``."""
    expected = first_order.clone()
    for row in range(len(relevance)):
        for token in relevance[row].abs().argsort(descending=True)[:count].tolist():
            expected[row, token] = relevance[row, token]
    return expected


def reference_chefer(ref, lengths, query=0, start_layer=0):
    scores = torch.zeros(len(lengths), max(lengths))
    for b, n in enumerate(lengths):
        relevance = torch.eye(n)
        for attn, grad in list(zip(ref.attentions, ref.grads))[start_layer:]:
            cam = (_block(grad, b, n) * _block(attn, b, n)).clamp(min=0).mean(dim=0)
            relevance = relevance + cam @ relevance
        scores[b, :n] = _row(relevance, query)
    return scores


def reference_rollout(ref, lengths, query=0, fusion="mean", start_layer=0):
    scores = torch.zeros(len(lengths), max(lengths))
    fuse = {"mean": lambda a: a.mean(0), "max": lambda a: a.max(0).values, "min": lambda a: a.min(0).values}
    for b, n in enumerate(lengths):
        rollout = torch.eye(n)
        for attn in ref.attentions[start_layer:]:
            a_hat = 0.5 * fuse[fusion](_block(attn, b, n)) + 0.5 * torch.eye(n)
            a_hat = a_hat / a_hat.sum(dim=-1, keepdim=True)
            rollout = a_hat @ rollout
        scores[b, :n] = _row(rollout, query)
    return scores


def reference_raw(ref, lengths, query=0, layer=-1):
    scores = torch.zeros(len(lengths), max(lengths))
    for b, n in enumerate(lengths):
        scores[b, :n] = _row(_block(ref.attentions[layer], b, n).mean(0), query)
    return scores


@dataclass(frozen=True)
class MethodCase:
    """One registered method: its class, its reference, and options for the invariance tests."""

    name: str
    # reference(ref, lengths, query=0) -> (B, T) from the attention maps; None for a method
    # that is not a function of them (AttnLRP: its own reference in test_attn_lrp.py)
    reference: Callable[..., torch.Tensor] | None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> type:
        return REGISTERED[self.name]


METHODS = {
    case.name: case
    for case in (
        MethodCase("grad_sam", lambda ref, lengths, query=0: reference_grad_sam(ref, lengths), dict(target=1)),
        MethodCase("transformer_attribution", reference_chefer, dict(target=1)),
        MethodCase("rollout", reference_rollout),
        MethodCase("raw", reference_raw, dict(layer=1)),
        MethodCase("attn_lrp", None, dict(target=1)),
    )
}

MAP_METHODS = {name: case for name, case in METHODS.items() if case.reference is not None}
"""The methods computed from the attention maps, which the map references check."""
