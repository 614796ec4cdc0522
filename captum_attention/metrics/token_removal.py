"""Faithfulness by removing tokens: ERASER's comprehensiveness, sufficiency and AOPC
(DeYoung et al., ACL 2020), Chefer et al.'s positive/negative perturbation curves, the
linear datamodeling score over random half removals, and leave-one-out importance.

Tokens are removed either by deletion (the remaining tokens close up, the sequence gets
shorter) or by replacement with a baseline token id (e.g. [MASK] or [PAD]); tokens in
``keep`` (special tokens, say) are never removed. These metrics call
``forward_func(input_ids, attention_mask)`` directly (a Hugging Face model given both by
name), since removing tokens changes the mask; every perturbed sequence of a
call is evaluated batched.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from .._compat import TargetType
from ..capture.adapters import HuggingFaceAdapter
from ..capture.inputs import class_probabilities, output_logits, resolve_targets
from ..capture.record import input_errors_named
from ._checks import check_class_probabilities, check_mask, check_per_token, check_rankable, check_tensors, takes_captum_scores, with_ties
from .agreement import spearman
from .image_patches import GreyedPatches
from .surrogate import CALIBRATION_RIDGE, calibrated_surrogate

DEFAULT_BINS = (1, 5, 10, 20, 50)
DEFAULT_STEPS = (10, 20, 30, 40, 50, 60, 70, 80, 90)


@dataclass
class CurveResult:
    """A perturbation curve: at each removed fraction (0 first), the target's probability
    and whether the prediction is unchanged, per example, with the areas under both."""

    fractions: Tensor  # (S + 1,)
    target_prob: Tensor  # (B, S + 1)
    agreement: Tensor  # (B, S + 1)
    auc_target_prob: Tensor  # (B,)
    auc_agreement: Tensor  # (B,)


_SHARED_REMOVALS: list[dict[tuple, Tensor]] = []
"""The scopes of :func:`shared_removals`: each maps a removal's key to its logits."""


@contextmanager
def shared_removals() -> Iterator[None]:
    """Within it, the token-removal metrics' calls with the same ``forward_func`` (the same
    object), inputs, removal settings and set of removals share their logits: one batch's
    or example's LDS halves (drawn from its own seed) and its whole inputs run once for
    every method and metric scored on them (``evaluate``'s), with the values each call
    would compute alone. The model must not change inside it."""
    _SHARED_REMOVALS.append({})
    try:
        yield
    finally:
        _SHARED_REMOVALS.pop()


def content_key(tensor: Tensor) -> tuple:
    """A tensor's shape, dtype and values, as a key."""
    return tuple(tensor.shape), str(tensor.dtype), tensor.detach().cpu().numpy().tobytes()


class _Remover:
    """Removes token sets from a batch and returns the target's probabilities, batched."""

    def __init__(
        self,
        forward_func: Callable[..., Any],
        input_ids: Tensor,
        attention_mask: Tensor,
        target: TargetType,
        removal: str,
        baseline_token_id: int | None,
        keep: Tensor | None,
        max_batch_size: int,
        pad_token_id: int | None,
    ) -> None:
        _check_removal(removal, baseline_token_id)
        check_tensors(input_ids=input_ids, attention_mask=attention_mask)
        check_mask(attention_mask)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
                f"{tuple(input_ids.shape)}: they must match."
            )
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool or input_ids.dim() != 2:
            raise TypeError("input_ids must be integer token ids of shape (batch, seq_len).")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} hold no token: give at least one example and token.")
        empty_rows = (attention_mask == 0).all(dim=1).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(f"Examples {empty_rows} are all padding (attention_mask has no 1): drop them from the batch.")
        if keep is not None and tuple(keep.shape) != tuple(input_ids.shape):
            raise ValueError(f"keep has shape {tuple(keep.shape)} but input_ids {tuple(input_ids.shape)}: they must match.")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}.")
        check_class_probabilities(forward_func)
        self.model, self.forward_func = forward_func, HuggingFaceAdapter().named_forward(forward_func)
        self.removal, self.baseline = removal, baseline_token_id
        self.ids, self.mask = input_ids, attention_mask
        self.real = attention_mask != 0
        self.removable = _removable(attention_mask, keep)
        self.max_batch_size = max_batch_size
        self.pad = padding_id(forward_func, input_ids, attention_mask, pad_token_id)
        logits = self._whole_logits()  # first: a clear error for logits of another shape
        self.padding_read = removal == "delete" and self._padding_moves()
        if self.padding_read and bool((attention_mask == 0).any()):  # each example unpadded, as its deletions are
            logits = self._rows_logits(torch.arange(len(input_ids), device=input_ids.device), torch.zeros_like(self.real))
        probs = class_probabilities(logits)
        self.targets = resolve_targets(logits, target)
        self.original = self.target_probs(probs, self.targets)
        self.decision = probs.argmax(dim=-1)

    def _logits(self, ids: Tensor, mask: Tensor) -> Tensor:
        with torch.no_grad(), input_errors_named(self.model, ids):
            logits = output_logits(self.forward_func(ids, mask), len(ids))
        if logits.dim() != 2:
            raise ValueError(
                f"Token-removal metrics need logits (batch, classes), got {tuple(logits.shape)}: "
                "for a language model, wrap it to return the logits of the explained position "
                "(removing tokens moves the positions)."
            )
        return logits

    def _padding_moves(self) -> bool:
        """Whether padding on the right moves a shortened example's output (:func:`padding_probe`):
        deleting tokens pads the shortened rows there (a decoder classifier that finds its
        last token by a pad id other than the one filled in; a model that reads its last
        position, XLNet's; a forward that leaves the attention mask out). The deletions
        then run in batches of one length, unpadded."""
        _, shortened, columns = padding_probe(self.ids, self.real, self.removable, "right")
        moved, tolerance = padding_shift(self.forward_func, shortened, self.mask.new_ones(shortened.shape), self.pad, "right", columns)
        return moved > tolerance

    def _rows_logits(self, rows: Tensor, remove: Tensor) -> Tensor:
        """``(R, C)`` logits of examples ``rows`` without their ``remove`` tokens, in
        batches of ``max_batch_size``; where the padding is read, of one length each."""
        order = torch.arange(len(rows), device=rows.device)
        lengths = None
        if self.padding_read:  # only ever set for deletion
            kept = (self.real[rows] & ~remove).sum(dim=1)
            order = kept.argsort(stable=True)
            lengths = kept[order]
        logits: Tensor | None = None
        for chunk in length_batches(order, lengths, self.max_batch_size):
            chunk_logits = self._logits(*self._perturb(rows[chunk], remove[chunk]))
            logits = chunk_logits.new_empty(len(rows), chunk_logits.shape[1]) if logits is None else logits
            logits[chunk.to(logits.device)] = chunk_logits
        assert logits is not None  # rows is never empty
        return logits

    @staticmethod
    def target_probs(probs: Tensor, targets: Tensor) -> Tensor:
        return probs.gather(1, targets[:, None]).squeeze(1)

    def _perturb(self, rows: Tensor, remove: Tensor) -> tuple[Tensor, Tensor]:
        ids, mask, _ = removed(self.ids[rows], self.mask[rows], remove, self.removal, self.baseline, self.pad)
        return ids, mask

    def evaluate(self, rows: Tensor, remove: Tensor) -> tuple[Tensor, Tensor]:
        """Target probability and unchanged decision after removing ``remove`` from
        ``rows``. Identical removals from one example run once, so that they tie exactly
        (two random halves of a short text are often the same)."""
        key = torch.cat([rows[:, None].to(remove.device), remove.long()], dim=1)
        unique, inverse = key.unique(dim=0, return_inverse=True)
        probs = class_probabilities(self._shared_logits(unique[:, 0].to(rows.device), unique[:, 1:].bool()))
        probs = probs[inverse.to(probs.device)]
        targets, decision = self.targets[rows].to(probs.device), self.decision[rows].to(probs.device)
        return self.target_probs(probs, targets), probs.argmax(dim=-1) == decision

    def _whole_logits(self) -> Tensor:
        """The inputs' own logits; within :func:`shared_removals`, those another call
        computed of the same inputs."""
        if not _SHARED_REMOVALS:
            return self._logits(self.ids, self.mask)
        key = ("whole", id(self.model), content_key(self.ids), content_key(self.mask))
        shared = _SHARED_REMOVALS[-1]
        if key not in shared:
            shared[key] = self._logits(self.ids, self.mask)
        return shared[key]

    def _shared_logits(self, rows: Tensor, remove: Tensor) -> Tensor:
        """:meth:`_rows_logits`; where another call in the same :func:`shared_removals`
        asked for the same removals of the same inputs, the logits it computed, which
        these are: the same rows run in the same batches."""
        if not _SHARED_REMOVALS:
            return self._rows_logits(rows, remove)
        key = (id(self.model), self.removal, self.baseline, self.pad, *(content_key(t) for t in (self.ids, self.mask, rows, remove)))
        shared = _SHARED_REMOVALS[-1]
        if key not in shared:
            shared[key] = self._rows_logits(rows, remove)
        return shared[key]

    def check_scores(self, attributions: Tensor) -> None:
        """A clear error for attributions that are not one finite score per token."""
        check_per_token(attributions, self.ids)
        check_rankable(attributions, self.removable, finite=True)

    def kept_probs(self, kept: Tensor) -> Tensor:
        """``(B, A)``: the target's probability under each of ``kept`` ``(B, A, T)``
        ablations, every removable token it does not keep removed."""
        examples, ablations = kept.shape[:2]
        remove = self.removable[:, None] & ~kept.to(self.removable.device)
        rows = torch.arange(examples, device=remove.device).repeat_interleave(ablations)
        after, _ = self.evaluate(rows, remove.flatten(0, 1))
        return after.view(examples, ablations)

    def top_tokens(self, attributions: Tensor, fractions: Sequence[float], most_relevant: bool = True) -> tuple[Tensor, Tensor]:
        """Rows and masks of the top ``fraction`` of each example's removable tokens.

        The count is ⌈fraction·N⌉ of the N removable tokens (at least 1 for a positive
        fraction), ordered by attribution, highest first (lowest first if not
        ``most_relevant``); tokens tied with the last one counted are removed with it, so
        a tie is never split by position. Returns ``rows (B·F,)`` and masks ``(B·F, T)``,
        example-major.
        """
        self.check_scores(attributions)
        signed = attributions.float() if most_relevant else -attributions.float()
        order = signed.masked_fill(~self.removable, float("-inf")).argsort(dim=1, descending=True, stable=True)
        positions = torch.arange(self.ids.shape[1], device=order.device).expand_as(order)
        ranks = torch.empty_like(order).scatter_(1, order, positions)
        share = torch.tensor(fractions, dtype=torch.float64, device=order.device)
        counts = (share[None, :] * self.removable.sum(dim=1, keepdim=True)).ceil().long()  # (B, F)
        counts = with_ties(signed.masked_fill(~self.removable, float("-inf")), counts)
        remove = ranks[:, None, :] < counts[:, :, None]  # (B, F, T)
        rows = torch.arange(len(order), device=order.device).repeat_interleave(len(fractions))
        return rows, remove.flatten(0, 1)


def length_batches(order: Tensor, lengths: Tensor | None, size: int) -> Iterator[Tensor]:
    """``order`` in runs of at most ``size``; with ``lengths`` (of ``order``'s entries,
    sorted), each run of one length: a batch that needs no padding."""
    start = 0
    while start < len(order):
        stop = min(start + size, len(order))
        if lengths is not None:
            stop = min(stop, int(torch.searchsorted(lengths, lengths[start], right=True)))
        yield order[start:stop]
        start = stop


def _check_removal(removal: str, baseline_token_id: int | None) -> None:
    if removal not in ("delete", "replace"):
        raise ValueError(f"removal must be 'delete' or 'replace', got {removal!r}.")
    if removal == "replace" and baseline_token_id is None:
        raise ValueError("removal='replace' needs baseline_token_id (e.g. the [MASK] or [PAD] id).")


def _removable(attention_mask: Tensor, keep: Tensor | None) -> Tensor:
    """The real tokens outside ``keep``: those the metrics may remove."""
    real = attention_mask != 0
    return real & ~(keep.bool() if keep is not None else torch.zeros_like(real))


def removed(
    input_ids: Tensor, attention_mask: Tensor, remove: Tensor, removal: str, baseline_token_id: int | None, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs with the ``remove`` tokens removed, and ``(B, T')`` where each position's
    token came from: deleted (the kept tokens first, in order, then ``pad_token_id``; no
    column that pads every row, so ``T' <= T``) or replaced by ``baseline_token_id`` in place."""
    if removal == "replace":
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return input_ids.masked_fill(remove, int(baseline_token_id)), attention_mask, positions  # type: ignore[arg-type]
    kept = (attention_mask != 0) & ~remove
    positions = (~kept).int().argsort(dim=1, stable=True)
    lengths = kept.sum(dim=1, keepdim=True)
    width = max(int(lengths.max()), 1)
    positions = positions[:, :width]
    new_mask = (torch.arange(width, device=input_ids.device) < lengths).to(attention_mask.dtype)
    return input_ids.gather(1, positions).masked_fill(new_mask == 0, pad_token_id), new_mask, positions


def padding_id(forward_func: Any, input_ids: Tensor, attention_mask: Tensor, pad_token_id: int | None) -> int:
    """The id that pads the rows tokens were deleted from: ``pad_token_id`` where given,
    else the ``config.pad_token_id`` of ``forward_func`` (the model, or a method of it), else
    the one id the inputs are padded with, else 0."""
    if pad_token_id is not None:
        return int(pad_token_id)
    model = forward_func if isinstance(forward_func, torch.nn.Module) else getattr(forward_func, "__self__", None)
    configured = configured_pad_id(model)
    if configured is not None:
        return configured
    padding = input_ids[attention_mask == 0].unique()
    return int(padding[0]) if len(padding) == 1 else 0


def padding_shift(
    forward_func: Callable[..., Any], ids: Tensor, mask: Tensor, pad_id: int, side: str, columns: int = 1
) -> tuple[float, float]:
    """How far ``columns`` columns of ``pad_id`` padding (mask 0) on ``side`` move the class
    probabilities ``forward_func`` gives the unpadded ``(1, N)`` ``ids``, and the rounding
    its logits' precision allows."""
    with torch.no_grad():
        alone = output_logits(forward_func(ids, mask), len(ids))
        padded = output_logits(forward_func(*with_padding_column(ids, mask, pad_id, side, columns)), len(ids))
    moved = float((class_probabilities(alone) - class_probabilities(padded)).abs().max())
    return moved, max(1e-4, 8 * torch.finfo(alone.dtype).eps)


def padding_probe(ids: Tensor, real: Tensor, removable: Tensor, side: str) -> tuple[int, Tensor, int]:
    """A row on which to test whether a model reads the padding that deletions add on
    ``side``: the shortest example (its index), its real tokens less the half of its
    ``removable`` ones towards ``side`` (``(1, N')``, in order), and the columns of padding
    that fill them to the batch's width (at least one). A model that reads padding only
    faintly (a random one; a forward that leaves the mask out) moves its output by more
    under the padding a deletion gets than under one column."""
    row = int(real.sum(dim=1).argmin())
    positions = removable[row].nonzero().flatten()
    deleted = positions[len(positions) - len(positions) // 2 :] if side == "right" else positions[: len(positions) // 2]
    kept = real[row].clone()
    kept[deleted] = False
    return row, ids[row, kept][None], max(ids.shape[1] - int(kept.sum()), 1)


def with_padding_column(ids: Tensor, mask: Tensor, pad_id: int, side: str = "right", columns: int = 1) -> tuple[Tensor, Tensor]:
    """The inputs with ``columns`` columns of ``pad_id`` padding (mask 0) on ``side``."""
    column, zeros = ids.new_full((len(ids), columns), pad_id), mask.new_zeros((len(mask), columns))
    if side == "left":
        return torch.cat([column, ids], dim=1), torch.cat([zeros, mask], dim=1)
    return torch.cat([ids, column], dim=1), torch.cat([mask, zeros], dim=1)


def pair_token_types(input_ids: Tensor, attention_mask: Tensor, separator: int) -> Tensor:
    """Token type ids of text pairs as BERT's tokenizers give them, read from the ids: 0 up
    to a row's first ``separator`` token, 1 after it, 0 at padding. A ``forward_func`` that
    computes them so follows the tokens wherever a metric removes some (keep the
    separators), where fixed token type ids would be read at the wrong positions.

    Args:
        input_ids (Tensor): ``(batch, seq_len)`` token ids.
        attention_mask (Tensor): ``(batch, seq_len)``, 1 for real tokens.
        separator (int): the separator token's id (``tokenizer.sep_token_id``).

    Returns:
        ``(batch, seq_len)`` long tensor.

    Example::

        >>> def forward(ids, mask):
        ...     types = pair_token_types(ids, mask, tokenizer.sep_token_id)
        ...     return model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        >>> comprehensiveness(forward, ids, mask, scores, keep=special)
    """
    is_separator = (input_ids == separator).long()
    after_first = is_separator.cumsum(dim=1) - is_separator > 0
    return (after_first & (attention_mask != 0)).long()


def configured_pad_id(model: Any) -> int | None:
    """``model.config.pad_token_id`` where it is an id (not negative), else None."""
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad_id if isinstance(pad_id, int) and not isinstance(pad_id, bool) and pad_id >= 0 else None


def _check_bins(bins: Sequence[float]) -> list[float]:
    bad = [b for b in bins if not 0 < b <= 100]
    if bad or not bins:
        raise ValueError(f"bins are percentages in (0, 100]; got {list(bins)}.")
    return [b / 100 for b in bins]


def _drop_per_bin(remover: _Remover, attributions: Tensor, bins: Sequence[float], remove_top: bool) -> Tensor:
    """p(y|x) − p(y|x'), x' without the top tokens of each bin (or with only them)."""
    rows, top = remover.top_tokens(attributions, _check_bins(bins))
    after, _ = remover.evaluate(rows, top if remove_top else remover.removable[rows] & ~top)
    return (remover.original[rows] - after).view(len(attributions), -1)


@takes_captum_scores("attributions")
def comprehensiveness(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    attributions: Tensor,
    target: TargetType = None,
    bins: Sequence[float] = DEFAULT_BINS,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    r"""ERASER comprehensiveness: p(y|x) − p(y|x \ r_k) for the top-k% tokens r_k.

    Args:
        forward_func (Callable): ``forward_func(input_ids, attention_mask)`` returns logits.
        input_ids (Tensor): ``(batch, seq_len)`` token ids.
        attention_mask (Tensor): ``(batch, seq_len)``, 1 for real tokens.
        attributions (Tensor): ``(batch, seq_len)`` token scores, higher = more important;
            tokens tied at a bin's cut are removed together (never split by position),
            NaN is refused.
        target (int, list, Tensor or None, optional): class y; None = predicted class.
        bins (sequence of float, optional): k in percent, each in (0, 100].
            Default: (1, 5, 10, 20, 50).
        removal (str, optional): "delete" or "replace". Default: "delete".
        baseline_token_id (int, optional): replacement id for removal="replace".
        keep (Tensor, optional): ``(batch, seq_len)`` bool, tokens never removed.
        max_batch_size (int, optional): sequences per forward. Default: 256.
        pad_token_id (int, optional): the id that pads the rows tokens were deleted from
            (they close up on the left). Default: None: the ``config.pad_token_id`` of
            ``forward_func`` where it is the model (or one of its methods), else the id
            the inputs are padded with, else 0. Where padding with it moves the output of
            the batch's shortest example, shortened as a deletion shortens it (a decoder
            classifier finds its last token by its pad id; a forward without the mask),
            each example and its deletions run in batches of one length, unpadded.

    Returns:
        ``(batch, len(bins))`` tensor.
    """
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    return _drop_per_bin(remover, attributions, bins, remove_top=True)


@takes_captum_scores("attributions")
def sufficiency(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    attributions: Tensor,
    target: TargetType = None,
    bins: Sequence[float] = DEFAULT_BINS,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    """ERASER sufficiency: p(y|x) − p(y|r_k), keeping only the top-k% tokens (and ``keep``).

    Arguments as for :func:`comprehensiveness`. Returns ``(batch, len(bins))``.
    """
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    return _drop_per_bin(remover, attributions, bins, remove_top=False)


def aopc(scores_per_bin: Tensor) -> Tensor:
    """Area over the perturbation curve: the mean over bins of comprehensiveness or
    sufficiency scores ``(batch, bins)`` (DeYoung et al.'s AOPC), ``(batch,)``."""
    return scores_per_bin.mean(dim=-1)


@takes_captum_scores("attributions")
def perturbation_curve(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    attributions: Tensor,
    target: TargetType = None,
    steps: Sequence[float] = DEFAULT_STEPS,
    most_relevant_first: bool = True,
    removal: str = "replace",
    baseline_token_id: int | None = 0,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> CurveResult:
    """Chefer et al.'s positive (most relevant first) or negative perturbation test.

    Removes 10%, 20%, ... 90% of the removable tokens in attribution order and records
    the target's probability and whether the prediction is unchanged; the areas under
    both curves (trapezoids over the removed fraction, 0 included) summarise them. A
    faithful attribution gives a low area for the positive test and a high one for the
    negative test.

    Args:
        forward_func (Callable): ``forward_func(input_ids, attention_mask)`` returns logits.
        input_ids, attention_mask, attributions, target, keep, max_batch_size, pad_token_id:
            as for :func:`comprehensiveness`.
        steps (sequence of float, optional): percentages removed. Default: 10..90.
        most_relevant_first (bool, optional): positive (True) or negative test.
        removal (str, optional): "replace" (default, with ``baseline_token_id``, 0 by
            default: BERT's [PAD]) or "delete".
        baseline_token_id (int, optional): replacement id. Default: 0.

    Returns:
        CurveResult.
    """
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    fractions = _check_bins(steps)
    rows, remove = remover.top_tokens(attributions, fractions, most_relevant_first)
    after, agree = remover.evaluate(rows, remove)
    batch = len(input_ids)
    target_prob = torch.cat([remover.original[:, None], after.view(batch, -1)], dim=1)
    agreement = torch.cat([torch.ones(batch, 1, device=agree.device, dtype=torch.float32), agree.view(batch, -1).float()], dim=1)
    axis = torch.tensor([0.0, *fractions], device=target_prob.device, dtype=torch.float32)
    return CurveResult(
        fractions=axis,
        target_prob=target_prob,
        agreement=agreement,
        auc_target_prob=torch.trapezoid(target_prob, axis, dim=1),
        auc_agreement=torch.trapezoid(agreement, axis, dim=1),
    )


def leave_one_out(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    target: TargetType = None,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    """Leave-one-out importance p(y|x) − p(y|x \\ {i}) of each removable token, batched;
    0 for padding and ``keep`` tokens. A ranking source for agreement and erasure.

    The arguments are :func:`comprehensiveness`'s, without ``attributions`` and ``bins``.

    Returns:
        ``(batch, seq_len)`` tensor.
    """
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    if not bool(remover.removable.any()):
        raise ValueError("keep covers every real token: there is no token to leave out.")
    rows, positions = remover.removable.nonzero(as_tuple=True)
    remove = torch.nn.functional.one_hot(positions, input_ids.shape[1]).bool()
    after, _ = remover.evaluate(rows, remove)
    importance = torch.zeros(input_ids.shape, dtype=after.dtype, device=after.device)
    importance[rows, positions] = remover.original[rows] - after
    return importance


@takes_captum_scores("prior")
def greedy_deletion(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    prior: Tensor,
    target: TargetType = None,
    candidates: Sequence[int] = (5, 3),
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    """A ranking whose top tokens are the ones that, removed together, lower the target's
    probability most, found greedily among those a one-pass attribution ``prior`` ranks
    highest: ``sum(candidates)`` removals per example, where SHAP takes hundreds.

    Step s removes the tokens chosen so far and, in turn, each of the ``candidates[s]``
    remaining tokens ``prior`` ranks highest (one forward each), and chooses the one that
    leaves the target's probability lowest; the other tokens follow in ``prior``'s order.
    Comprehensiveness (:func:`comprehensiveness`) removes a ranking's top tokens
    together, and a one-pass ranking misses what counts only with another token (a
    negation's pair); the chosen tokens are what removing finds, not necessarily what a
    reader would mark, so the ranking's plausibility is the prior's below them only.

    The other arguments are :func:`comprehensiveness`'s.

    Args:
        prior (Tensor): ``(batch, seq_len)`` scores, higher first (an attribution).
        candidates (sequence of int, optional): how many of the prior's remaining tokens
            each step tries. Default: ``(5, 3)``, 8 removals.

    Returns:
        ``(batch, seq_len)`` float32 scores: the chosen tokens above every other, the
        first chosen highest; the prior's scores elsewhere, 0 at padding.

    Example::

        >>> prior = GradSAM(model).attribute(input_ids, additional_forward_args=(mask,), axis="key")
        >>> ranking = greedy_deletion(model, input_ids, mask, prior, keep=special_tokens)
        >>> comprehensiveness(model, input_ids, mask, ranking, keep=special_tokens)
    """
    if not candidates or any(int(count) < 1 for count in candidates):
        raise ValueError(f"candidates must be one or more positive counts of tokens to try per step, got {tuple(candidates)}.")
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    check_per_token(prior, input_ids, name="prior")
    check_rankable(prior, remover.removable, "prior")
    scores = prior.detach().float().to(remover.removable.device).masked_fill(~remover.real, 0.0)
    ranked_by_prior = scores.masked_fill(~remover.removable, float("-inf"))
    above = ranked_by_prior.amax(dim=1) + 1.0
    gap = above.abs().clamp(min=1.0)  # so that each step's score stays distinct in float32, whatever the prior's scale
    chosen = torch.zeros_like(remover.removable)
    examples = torch.arange(len(input_ids), device=chosen.device)
    for step, count in enumerate(candidates):
        available = remover.removable & ~chosen
        tried = ranked_by_prior.masked_fill(~available, float("-inf")).argsort(dim=1, descending=True)[:, : int(count)]
        valid = available.gather(1, tried)
        rows, slots = valid.nonzero(as_tuple=True)
        if not len(rows):
            break
        remove = chosen[rows].clone()
        remove[torch.arange(len(rows), device=rows.device), tried[rows, slots]] = True
        after, _ = remover.evaluate(rows, remove)
        left = torch.full(tried.shape, float("inf"), device=after.device, dtype=torch.float32)
        left[rows, slots] = after.float()
        picked = tried.gather(1, left.argmin(dim=1, keepdim=True))[:, 0]
        some = valid.any(dim=1)
        chosen[examples[some], picked[some]] = True
        scores[examples[some], picked[some]] = above[some] + gap[some] * (len(candidates) - step)
    return scores


def ablated_probs(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    kept: Tensor,
    target: TargetType = None,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    """The target class's probability under ablations of your choosing, each token removed
    as the ERASER metrics remove it: for a surrogate of your own (ContextCite's with tokens
    as its sources, SHAP's) over the same removals.

    The other arguments are :func:`comprehensiveness`'s.

    Args:
        kept (Tensor): ``(batch, ablations, seq_len)`` bool, the tokens each ablation keeps;
            padding and ``keep`` tokens stay whatever it says.

    Returns:
        ``(batch, ablations)`` probabilities of the class ``target`` names (default: the
        predicted one on the whole input).

    Example::

        >>> kept = torch.rand(len(input_ids), 64, input_ids.shape[1]) < 0.5
        >>> probs = ablated_probs(model, input_ids, attention_mask, kept)  # (batch, 64)
    """
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    if kept.dim() != 3 or tuple(kept.shape[::2]) != tuple(input_ids.shape) or kept.dtype != torch.bool:
        raise ValueError(
            f"kept must be a bool tensor (batch={input_ids.shape[0]}, ablations, seq_len={input_ids.shape[1]}), "
            f"got {kept.dtype} of shape {tuple(kept.shape)}."
        )
    return remover.kept_probs(kept)


def random_halves(present: Tensor, num_ablations: int, seed: int, own_seeds: Tensor | None = None) -> Tensor:
    """``(B, A, N)`` bool: ContextCite's ablations, ``num_ablations`` per example, each
    keeping each of the ``present`` ``(B, N)`` features with probability 1/2 (drawn on the
    CPU from ``seed``, so that every device draws the same). With ``own_seeds`` (``(B,)``,
    :func:`example_seeds`, in place of ``seed``), each example's are drawn alone, from its
    own seed, over its present features in order: the same in any batch and under any
    padding, as an attribution fitted on them must be."""
    if own_seeds is None:
        shape = (present.shape[0], num_ablations, present.shape[1])
        kept = torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) < 0.5
        return kept.to(present.device) & present[:, None]
    kept = torch.zeros(present.shape[0], num_ablations, present.shape[1], dtype=torch.bool)
    for row, (features, own) in enumerate(zip(present.cpu(), own_seeds.tolist())):
        draws = torch.rand(num_ablations, int(features.sum()), generator=torch.Generator().manual_seed(own), dtype=torch.float32)
        kept[row][:, features] = draws < 0.5
    return kept.to(present.device)


def example_seeds(input_ids: Tensor, real: Tensor | None, seed: int | Tensor) -> Tensor:
    """``(B,)`` one seed per example, the CRC-32 of its ``real`` tokens (ids, or the rows of
    embeddings or pixels; every position where ``real`` is None) started from ``seed`` (or
    from each example's own, ``(B,)``, to chain several inputs): the same whatever batch or
    padding the example comes in, and different examples' ablations drawn apart (one seed
    for all would give every example the same pattern of removals, and an average over
    examples the luck of one draw)."""
    starts = seed.tolist() if isinstance(seed, Tensor) else [seed] * len(input_ids)
    rows = list(input_ids) if real is None else [ids[mask] for ids, mask in zip(input_ids, real.bool())]
    return torch.tensor([zlib.crc32(_as_bytes(row), start) for row, start in zip(rows, starts)])


def own_seeds(forward_func: Any, input_ids: Tensor, real: Tensor, seed: int) -> Tensor:
    """``(B,)`` :func:`example_seeds` of the inputs' real tokens; where the ids stand for an
    image's patches (``forward_func`` a
    :class:`~captum_attention.metrics.image_patches.GreyedPatches`), of each image's
    pixels, which do not depend on the image's place in the batch as its ids do."""
    if isinstance(forward_func, GreyedPatches):
        return example_seeds(forward_func.pixels(input_ids).flatten(1), None, seed)
    return example_seeds(input_ids, real, seed)


def _as_bytes(values: Tensor) -> bytes:
    """The values' bytes, integers as int64 and floats as float32 (bfloat16 has no NumPy type)."""
    values = values.detach().float() if values.is_floating_point() else values.long()
    return values.cpu().contiguous().numpy().tobytes()


@takes_captum_scores("prior")
def calibrated_attribution(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    prior: Tensor,
    target: TargetType = None,
    num_ablations: int = 8,
    seed: int = 1,
    ridge: float = CALIBRATION_RIDGE,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    pad_token_id: int | None = None,
) -> Tensor:
    r"""A classifier's prediction explained by an attribution calibrated on a few
    ablations: :func:`~captum_attention.metrics.surrogate.calibrated_surrogate`
    (ContextCite's linear surrogate with the prior's token scores in place of its
    sparsity) fitted to the target class's logit-probability :math:`\log p - \log(1 - p)`
    under ``num_ablations`` random ablations that keep each removable token with
    probability 1/2 (:func:`random_halves`, each example's drawn alone from ``seed`` and its
    tokens, :func:`example_seeds`, so that its scores do not depend on the batch or the
    padding; keep the seed apart from the one an LDS is measured with), the other tokens
    removed as the ERASER metrics remove them.
    Each token scores :math:`\alpha p_i + \delta_i`; the prior's where the ablations
    reverse it. For a language model's answer:
    :func:`~captum_attention.metrics.calibrated_scores`.

    The other arguments are :func:`comprehensiveness`'s.

    Args:
        prior (Tensor): ``(batch, seq_len)`` token scores of a one-pass attribution of the
            same prediction (AttnLRP at a presence, for instance).
        num_ablations (int, optional): the ablations fitted on, one forward each. Default: 8.
        seed (int, optional): their seed. Default: 1.
        ridge (float, optional): the surrogate's :math:`\lambda`. Default:
            :data:`~captum_attention.metrics.surrogate.CALIBRATION_RIDGE`.

    Returns:
        ``(batch, seq_len)`` float32 scores; 0 at padding and at the ``keep`` tokens.

    Example::

        >>> presence = torch.where(special_tokens, 1.0, 0.05)  # the words at 0.05 in every attention call
        >>> prior = AttnLRP(model).attribute(input_ids, additional_forward_args=(mask,), presence=presence)
        >>> scores = calibrated_attribution(model, input_ids, mask, prior, keep=special_tokens)
        >>> datamodeling_score(model, input_ids, mask, scores, keep=special_tokens).nanmean()
    """
    if num_ablations < 1 or ridge <= 0:
        raise ValueError(f"num_ablations must be at least 1 and ridge positive, got {num_ablations} and {ridge}.")
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    remover.check_scores(prior)
    kept = random_halves(remover.removable, num_ablations, seed, own_seeds(forward_func, input_ids, remover.real, seed))
    probs = remover.kept_probs(kept).double().clamp(1e-12, 1 - 1e-12)
    outcomes = probs.log() - (-probs).log1p()
    scores = torch.zeros(prior.shape, dtype=torch.float64, device=kept.device)
    for b, removable in enumerate(remover.removable):
        scores[b, removable] = calibrated_surrogate(
            kept[b][:, removable].double(), outcomes[b].to(kept.device), prior[b, removable].detach().double().to(kept.device), ridge
        )
    return scores.float()


@takes_captum_scores("prior")
def context_averaged_attribution(
    attribute_func: Callable[[Tensor, Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    prior: Tensor,
    num_contexts: int = 8,
    seed: int = 1,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    pad_token_id: int | None = None,
) -> Tensor:
    r"""A classifier's prediction explained in random half contexts: an attribution of
    each input with about half of its removable tokens removed, averaged per token over the
    contexts that keep it, plus a one-pass prior.

    The contexts come in complementary pairs: :math:`A/2` random halves
    (:func:`random_halves`, each example's drawn alone from ``seed`` and its tokens,
    :func:`example_seeds`) and the halves they leave out, so that every removable token is
    kept in exactly :math:`A/2` of them; the other tokens are removed as the ERASER metrics
    remove them. With :math:`r_i^{(a)}` token i's score in context a, the result is

    .. math::

        s_i = \frac{R_i}{\sum_j |R_j|} + \frac{p_i}{\sum_j |p_j|},
        \qquad R_i = \sum_{a \text{ keeps } i} r_i^{(a)},

    over the removable tokens (:math:`R_i / (A/2)` is token i's mean score in the contexts
    that keep it): its share in the contexts the LDS samples, where it acts beside some of
    the others, and in the prior (AttnLRP at a low presence, where it acts nearly alone).

    The other arguments are :func:`comprehensiveness`'s.

    Args:
        attribute_func (Callable): ``(input_ids, attention_mask) -> (batch, seq_len)``
            scores of one attribution for the same examples in the same order (pass the
            explained class as a fixed ``target``: the prediction may change without
            half the tokens). Called once per context, on the whole batch; it must pass
            the mask on to the model: the shortened rows of several examples' contexts
            are padded, so there the first context is scored once more with as much
            padding again, and a function that padding moves is refused in one line.
        prior (Tensor): ``(batch, seq_len)`` token scores of a one-pass attribution of the
            same prediction.
        num_contexts (int, optional): :math:`A`, even. Default: 8.
        seed (int, optional): the contexts' seed (keep it apart from the one an LDS is
            measured with). Default: 1.
        pad_token_id (int, optional): the id that pads the contexts' rows. Default: None:
            the id the inputs are padded with; where they hold no padding, 0 (the check
            of ``attribute_func`` refuses a decoder classifier that finds its last token
            by another pad id).

    Returns:
        ``(batch, seq_len)`` float32 scores; 0 at padding and at the ``keep`` tokens.

    Example::

        >>> lrp = AttnLRP(model)
        >>> explain = lambda ids, mask: lrp.attribute(ids, target=target, additional_forward_args=(mask,))
        >>> presence = torch.where(special_tokens, 1.0, 0.05)
        >>> prior = lrp.attribute(input_ids, target=target, additional_forward_args=(mask,), presence=presence)
        >>> scores = context_averaged_attribution(explain, input_ids, mask, prior, keep=special_tokens)
    """
    if num_contexts < 2 or num_contexts % 2:
        raise ValueError(f"num_contexts must be even and at least 2 (complementary pairs), got {num_contexts}.")
    _check_removal(removal, baseline_token_id)
    removable = _removable(attention_mask, keep)
    check_per_token(prior, input_ids, name="prior")
    check_rankable(prior, removable, name="prior", finite=True)
    halves = random_halves(removable, num_contexts // 2, seed, example_seeds(input_ids, attention_mask != 0, seed))
    pad_id = padding_id(attribute_func, input_ids, attention_mask, pad_token_id)
    padded = removal == "delete" and len(input_ids) > 1  # one example's contexts hold no padding
    summed = torch.zeros(input_ids.shape, dtype=torch.float64, device=input_ids.device)
    for index, kept in enumerate(complemented(halves, removable).unbind(dim=1)):
        ids, mask, positions = removed(input_ids, attention_mask, removable & ~kept, removal, baseline_token_id, pad_id)
        explain = _padding_checked(attribute_func, pad_id) if padded and index == 0 else attribute_func
        summed += scores_in_context(explain, ids, mask, positions, kept)
    return prior_and_context_shares(summed, prior, removable)


def _padding_checked(attribute_func: Callable[[Tensor, Tensor], Tensor], pad_id: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``attribute_func``, refusing in one line where as many columns of ``pad_id`` padding
    (mask 0) more as a context's rows hold at most (at least one) move the scores of their
    tokens: the contexts' own padding then moves them too (a function that leaves the mask
    out, a pad id the model does not pad with). Costs one call more."""

    def explain(ids: Tensor, mask: Tensor) -> Tensor:
        scores = attribute_func(ids, mask)
        if tuple(scores.shape) != tuple(ids.shape):
            return scores  # scores_in_context names the shape
        more_ids, more_mask = with_padding_column(ids, mask, pad_id, "right", max(int((mask == 0).sum(dim=1).max()), 1))
        padded = attribute_func(more_ids, more_mask)
        if tuple(padded.shape) != tuple(more_ids.shape):
            raise ValueError(
                f"attribute_func returned shape {tuple(padded.shape)} for a context of shape {tuple(more_ids.shape)}: one score per token."
            )
        real = mask != 0
        shift = (scores.detach().double() - padded.detach().double()[:, : ids.shape[1]]).masked_fill(~real, 0.0).abs().max()
        scale = scores.detach().double().masked_fill(~real, 0.0).abs().max()
        if float(shift) > 1e-3 * float(scale):
            raise ValueError(
                f"Padding with token id {pad_id} (attention mask 0) after a context's rows moves attribute_func's scores of "
                f"their tokens by up to {float(shift):.2g}, and the contexts pad their shortened rows so: pass the attention "
                "mask on to the model in attribute_func, pass pad_token_id=<the id the model pads with> (a decoder "
                "classifier finds its last token by config.pad_token_id), explain one example at a time, or use "
                "removal='replace'."
            )
        return scores

    return explain


def complemented(halves: Tensor, present: Tensor) -> Tensor:
    """``(B, 2H, F)``: the ``(B, H, F)`` halves of the ``present`` features, then the halves
    they leave out, so that each present feature is kept in exactly H of them."""
    return torch.cat([halves, present[:, None] & ~halves], dim=1)


def scores_in_context(
    attribute_func: Callable[[Tensor, Tensor], Tensor], ids: Tensor, mask: Tensor, positions: Tensor, kept: Tensor
) -> Tensor:
    """``attribute_func(ids, mask)``'s scores of one context of an input, ``(B, N)``
    float64 in the input's own positions: ``positions[b, t]``, the input position of the
    context's token ``t`` (at most N of them); 0 wherever ``kept`` is False."""
    scores = attribute_func(ids, mask).detach()
    if tuple(scores.shape) != tuple(ids.shape):
        raise ValueError(
            f"attribute_func returned shape {tuple(scores.shape)} for a context of shape {tuple(ids.shape)}: one score per token."
        )
    in_place = torch.zeros(kept.shape, dtype=torch.float64, device=kept.device)
    in_place.scatter_(1, positions.to(kept.device), scores.double().to(kept.device))
    in_place = in_place.masked_fill(~kept, 0.0)
    if not bool(in_place.isfinite().all()):  # only the kept tokens' scores count: padding's may be anything
        raise ValueError("attribute_func returned NaN or ±inf for a context's tokens: give finite scores (torch.nan_to_num).")
    return in_place


def prior_and_context_shares(summed: Tensor, prior: Tensor, removable: Tensor) -> Tensor:
    """``R_i / sum|R| + p_i / sum|p|`` over the ``removable`` tokens (0 elsewhere), float32."""

    def shares(scores: Tensor) -> Tensor:
        scores = scores.masked_fill(~removable, 0.0)
        return scores / scores.abs().sum(dim=1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)

    return (shares(summed) + shares(prior.detach().double().to(summed.device))).float()


@takes_captum_scores("attributions")
def datamodeling_score(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    attributions: Tensor,
    target: TargetType = None,
    num_ablations: int = 32,
    seed: int = 0,
    removal: str = "delete",
    baseline_token_id: int | None = None,
    keep: Tensor | None = None,
    max_batch_size: int = 256,
    per_example: bool = False,
    pad_token_id: int | None = None,
) -> Tensor:
    r"""LDS of a classifier's explanation (Park et al., ICML 2023; ContextCite's measure,
    Cohen-Wang et al., NeurIPS 2024): Spearman's ρ, over ``num_ablations`` random
    ablations that keep each removable token with probability 1/2 (seeded), between the
    kept tokens' summed scores :math:`\sum_{i \text{ kept}} a_i` and the target class's
    probability with the other tokens removed as the ERASER metrics remove them.

    Where comprehensiveness removes a ranking's top tokens, LDS asks whether the scores
    add up: whether they predict the effect of removing any half of the tokens, pairs
    that matter together included. ρ ranks, so the probability, its log or its logit (what
    ContextCite's surrogate fits) give the same score. For a language model's answer:
    :func:`~captum_attention.metrics.linear_datamodeling_score`.

    The other arguments are :func:`comprehensiveness`'s.

    Args:
        attributions (Tensor): ``(batch, seq_len)`` token scores, signed or not; NaN and
            ±inf are refused.
        num_ablations (int, optional): random ablations per example, one forward each.
            Default: 32.
        seed (int, optional): seed of the ablations, the same for every attribution of an
            example, so that LDS compares them on the same ablations (keep it apart from
            the seed of any ablations a surrogate is fitted on). Default: 0.
        per_example (bool, optional): draw each example's ablations alone, from ``seed``
            and its tokens (:func:`example_seeds`), so that its score is the same in any
            batch and under any padding, as the registered ``datamodeling`` metric (and
            ``captum-attention evaluate``) draws them. Default: False: drawn over the
            batch's padded shape, as the benchmarks' figures were.

    Returns:
        ``(batch,)``: ρ in [-1, 1]; NaN where either side is constant (an example with
        one removable token, or scores that give every ablation the same sum).

    Example::

        >>> scores = AttnLRP(model).attribute(input_ids, additional_forward_args=(mask,))
        >>> datamodeling_score(model, input_ids, mask, scores, keep=special_tokens).nanmean()
    """
    if num_ablations < 3:
        raise ValueError(f"num_ablations must be at least 3 (a rank correlation), got {num_ablations}.")
    remover = _Remover(
        forward_func, input_ids, attention_mask, target, removal, baseline_token_id, keep, max_batch_size, pad_token_id
    )
    remover.check_scores(attributions)
    seeds = own_seeds(forward_func, input_ids, remover.real, seed) if per_example else None
    kept = random_halves(remover.removable, num_ablations, seed, seeds)
    scores = attributions.detach().double().to(kept.device).masked_fill(~remover.removable, 0.0)
    predicted = (kept.double() * scores[:, None]).sum(dim=-1)
    return spearman(predicted.cpu(), remover.kept_probs(kept).cpu())
