"""Identifiability of attention (Brunner et al., "On Identifiability in Transformers", ICLR 2020).

A head's output is ``A·T`` with ``T = V·H`` (its values through its slice of the output
projection). Rows of ``A`` that differ by a vector of the left null space of ``T`` give
the same output, and ``dim null(Tᵀ) = N − rank(T) ≥ N − d_v``: attention over more tokens
than the head has value dimensions is not identifiable from the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..capture import AttentionAdapter
from ..capture.inputs import format_inputs
from ..capture import RecordedValues, ValueRecorder, record_forward
from ..capture.runner import resolve_model
from ..capture.record import without_autocast
from ..maps import null_space_dims


@dataclass
class IdentifiabilityResult:
    """Per attention call (forward order): ``rank[l]`` and ``null_dim[l]``, ``(B, H)``
    long, rank(T) and dim null(Tᵀ) over each example's ``tokens[l]`` ``(B,)`` real keys;
    ``head_dim[l]`` the value dimension d_v; ``roles[l]`` the call's role;
    ``projected[l]`` whether the adapter knew the output projection (else T = V, the same
    rank when each head's slice of the projection has full row rank)."""

    tokens: list[Tensor]
    head_dim: list[int]
    rank: list[Tensor]
    null_dim: list[Tensor]
    roles: list[str]
    projected: list[bool]

    def non_identifiable(self) -> Tensor:
        """``(B,)`` fraction of the (layer, head) pairs whose attention is not identifiable
        (``null_dim > 0``)."""
        flags = torch.cat([(null > 0).float() for null in self.null_dim], dim=1)
        return flags.mean(dim=1)


@without_autocast("identifiability")
def identifiability(
    forward_func: Callable[..., Any],
    inputs: Tensor | tuple[Tensor, ...],
    additional_forward_args: Any = None,
    model: nn.Module | None = None,
    adapter: AttentionAdapter | None = None,
) -> IdentifiabilityResult:
    """rank(T) and dim null(Tᵀ) of every head at every attention call, per example.

    Brunner et al., ICLR 2020, §4. One eager forward that records the values each call's
    probabilities weight; ``T`` is built from them and the adapter's output projection
    (:func:`~captum_attention.maps.null_space_dims`), over each example's real keys (all
    the keys the last query row sees, for causal attention).

    Args:
        forward_func (Callable): the model's forward (a Hugging Face model, or a function
            of ``(inputs, *additional_forward_args)``).
        inputs (Tensor or tuple): token ids (or embeddings, pixels); a pair for
            encoder-decoders.
        additional_forward_args (Any, optional): further positional arguments, e.g.
            ``(attention_mask,)``. Default: None.
        model (nn.Module, optional): the module holding the attention. Default:
            ``forward_func``.
        adapter (AttentionAdapter, optional): how to find the attention. Default: the
            built-in adapter.

    Returns:
        :class:`IdentifiabilityResult`.

    Example::

        >>> report = identifiability(model, input_ids, (attention_mask,))
        >>> report.non_identifiable()  # fraction of heads per example
    """
    model = resolve_model(forward_func, model)
    _, tensors = format_inputs(inputs)
    with torch.no_grad():
        record = record_forward(forward_func, model, tensors, additional_forward_args, adapter, probes=[ValueRecorder()])
    recorded = record.result(RecordedValues)
    tokens, ranks, nulls = [], [], []
    for call, (values, projection) in enumerate(zip(recorded.values, recorded.projections)):
        real_keys = record.visible_keys(call)[0][:, -1]
        rank, null = null_space_dims(values, real_keys, projection)
        tokens.append(real_keys.sum(dim=-1))
        ranks.append(rank)
        nulls.append(null)
    return IdentifiabilityResult(
        tokens, [v.shape[-1] for v in recorded.values], ranks, nulls, list(record.roles),
        [p is not None for p in recorded.projections],
    )
