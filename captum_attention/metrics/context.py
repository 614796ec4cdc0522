r"""Context attribution: does an attribution over a prompt say which parts a language
model's answer rests on? Each metric ablates parts of the prompt (segments: tokens,
sentences, documents) and watches the answer's log-probability
:math:`\log p(a \mid x) = \sum_k \log p(a_k \mid x, a_{<k})`.

- :func:`top_k_log_prob_drop`: remove the k highest-scored segments; how far does
  :math:`\log p(a \mid x)` fall?
- :func:`linear_datamodeling_score` (LDS, Cohen-Wang et al., "ContextCite: Attributing
  Model Generation to Context", NeurIPS 2024): over random ablations that keep each
  segment with probability 1/2, Spearman's ρ between the attribution's prediction
  :math:`\sum_{s \text{ kept}} \tau_s` and the actual :math:`\log p(a \mid x_{\text{kept}})`
  (ContextCite scores the logit of the probability; ρ only ranks, so the two agree).
- :func:`leave_one_out_agreement`: Spearman's ρ between the segments' scores and the
  drop in :math:`\log p(a \mid x)` when each segment alone is removed.

Segments are removed by deletion: the kept tokens close up (prompts stay padded on the
left) and the answer follows them; for an encoder-decoder (a model whose config says
``is_encoder_decoder``) the prompt is the source, its kept tokens padded on the right, and
the decoder reads its start token and the answer. Any attribution works: ours, Captum's,
a user's tensor; a segment's score is the sum of its tokens'. Every ablated sequence of a
call is evaluated batched; a Hugging Face model gets position ids that follow the padding,
so an example scores the same alone and in a padded batch. Where padding moves a
shortened prompt's answer (a model or forward that reads the padding), the batches hold
deletions of one length, unpadded. A vision-language model's answer is scored one example
at a time, with its ``image_inputs``: its image's tokens never removed, the image inputs
given with every ablated prompt.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from contextlib import contextmanager
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from .._compat import UnsupportedModelError
from ..capture import AttentionAdapter
from ..capture.adapters import HuggingFaceAdapter
from ..capture.adapters.huggingface import verdict_conditions
from ..capture.adapters.images import (
    ENCODED_IMAGES, TOWER_INPUTS, encoded_copies, encoded_images, image_marker_ids, image_outside_prompt, image_token_id,
    marked_image_positions, takes_encoded_images,
)
from ..capture.adapters.protocol import extended_per_token, per_token
from ..capture.inputs import answer_ids, check_no_padding_after_end, decoder_start_token, output_logits
from ..capture.record import (
    chosen_answer_start, ids_outside_vocabulary, input_errors_named, warn_if_answer_begins_with_bos, without_autocast,
)
from ..maps.kernel import block_shape
from ..maps.knockout import segment_shares
from ..maps.streaming import segment_share_max
from ._checks import check_mask, check_per_token, check_rankable, check_tensors, takes_captum_scores
from ._forward import CaptureMode, run_model
from .agreement import spearman
from .surrogate import CALIBRATION_RIDGE, calibrated_surrogate
from .token_removal import (
    complemented, content_key, example_seeds, length_batches, padding_probe, prior_and_context_shares, random_halves, scores_in_context,
    with_padding_column,
)

PAIRS_PER_FORWARD = 2**26
"""The most (sequences × length²) one padded forward of ablated prompts holds."""

DEFAULT_KS = (1, 3, 5)
"""The segment counts :func:`top_k_log_prob_drop` removes by default."""


class AblationScorer(ABC):
    """An answer's log-probability after removing sets of an example's features (a
    prompt's segments, an image's patches), batched; each distinct set runs once, and in a
    :func:`shared_ablations` scope once for every call on the same inputs. A subclass says
    how a set is removed (:meth:`_distinct_log_probs`), what identifies its inputs and its
    sets, and how features are scored and seeded."""

    present: Tensor  # (B, S) bool: the features each example has
    rows: Tensor  # (B,) the examples' indices

    @cached_property
    def original(self) -> Tensor:
        """``(B,)`` log p(answer | every feature)."""
        return self.log_probs(self.rows, torch.zeros_like(self.present))

    @abstractmethod
    def segment_scores(self, attributions: Tensor) -> Tensor:
        """``(B, S)`` each feature's score (-inf where absent), checked."""

    @abstractmethod
    def own_seeds(self, seed: int) -> Tensor:
        """``(B,)`` each example's seed from ``seed`` and its own inputs
        (:func:`~captum_attention.metrics.token_removal.example_seeds`)."""

    def kept_log_probs(self, kept: Tensor) -> Tensor:
        """``(B, A)`` log p(answer | only the features ``kept[b, a]``), for ``kept``
        ``(B, A, S)`` bool."""
        if kept.dim() != 3 or tuple(kept.shape[::2]) != tuple(self.present.shape) or kept.dtype != torch.bool:
            raise ValueError(
                f"kept must be a bool tensor (batch={self.present.shape[0]}, ablations, segments={self.present.shape[1]}), "
                f"got {kept.dtype} of shape {tuple(kept.shape)}."
            )
        examples, ablations = kept.shape[:2]
        removed = self.present[:, None] & ~kept.to(self.present.device)
        return self.log_probs(self.rows.repeat_interleave(ablations), removed.flatten(0, 1)).view(examples, ablations)

    def log_probs(self, rows: Tensor, removed: Tensor) -> Tensor:
        """``(R,)`` log p(answer | example ``rows[r]`` without features ``removed[r]``); each
        distinct ablation runs once (a repeated one gets the very same value), and a set
        run before in a :func:`shared_ablations` scope not again."""
        distinct, index = torch.unique(torch.cat([rows[:, None], removed.long()], dim=1), dim=0, return_inverse=True)
        return self._stored_log_probs(distinct[:, 0], distinct[:, 1:].bool())[index]

    @cached_property
    def _shared(self) -> dict[Any, Any] | None:
        """What the active :func:`shared_ablations` scope holds for these inputs
        (:meth:`_identity`), or None outside one."""
        if not _SHARED_SCOPES:
            return None
        return _SHARED_SCOPES[-1].setdefault(self._identity(), {})

    def _stored_log_probs(self, rows: Tensor, removed: Tensor) -> Tensor:
        """:meth:`_distinct_log_probs`, taken from the active :func:`shared_ablations` scope
        where it ran these very ablations before in batches of as many, known by
        :meth:`_ablation_key`. Whole sets only: a set run in other batches would differ in
        the last bits of its padded rows, and a metric's ranks (LDS's) with them."""
        if self._shared is None:
            return self._distinct_log_probs(rows, removed)
        key = (self._per_forward(len(rows)), content_key(rows), content_key(self._ablation_key(rows, removed)))
        if key not in self._shared:
            self._shared[key] = self._distinct_log_probs(rows, removed)
        return self._shared[key]

    @abstractmethod
    def _identity(self) -> tuple:
        """What makes two scorers' ablations the same: the model and the inputs."""

    def _ablation_key(self, rows: Tensor, removed: Tensor) -> Tensor:
        """What tells two ablations' inputs apart (by default the removed features)."""
        return removed

    @abstractmethod
    def _per_forward(self, rows: int) -> int:
        """How many of ``rows`` ablations one forward holds."""

    @abstractmethod
    def _distinct_log_probs(self, rows: Tensor, removed: Tensor) -> Tensor:
        """``(R,)`` :meth:`log_probs` of distinct ablations, run batched."""


class _AnswerScorer(AblationScorer):
    """The answer's log-probability after deleting token sets from the prompts, batched."""

    def __init__(
        self,
        forward_func: Callable[..., Any],
        input_ids: Tensor,
        attention_mask: Tensor,
        answer: Tensor,
        segments: Tensor | None,
        max_batch_size: int,
        image_inputs: Mapping[str, Tensor] | None = None,
    ) -> None:
        answer = _checked_answer(input_ids, attention_mask, answer, segments)
        outside = ids_outside_vocabulary(forward_func, answer)  # an encoder-decoder's last answer token is never fed
        if outside:
            raise ValueError(outside)
        check_no_padding_after_end(forward_func, answer, "answer")
        warn_if_answer_begins_with_bos(forward_func, answer, "answer")
        self.forced = chosen_answer_start(forward_func, answer, "answer")
        self.image_inputs = _one_example_images(image_inputs, input_ids)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}.")
        self.forward_func, self.max_batch_size = forward_func, max_batch_size
        self.ids, self.real, self.answer = input_ids, attention_mask != 0, answer.to(input_ids.device)
        self.segments = _prompt_segments(self.real, segments)
        if self.image_inputs:
            self.segments = self.segments.masked_fill(kept_image_tokens(forward_func, input_ids, segments, self.image_inputs), -1)
        anchorless = (~((self.segments < 0) & self.real).any(dim=1)).nonzero().flatten().tolist()
        if anchorless:
            raise ValueError(
                f"Examples {anchorless} have no prompt token that is never removed, so an ablation could leave "
                "nothing to predict the answer from: give the BOS (or the question) segment -1."
            )
        self.count = int(self.segments.max()) + 1
        present = torch.zeros(len(input_ids), max(self.count, 1), dtype=torch.int, device=input_ids.device)
        self.present = present.scatter_reduce_(1, self.segments.clamp(min=0), (self.segments >= 0).int(), "amax").bool()
        empty = (~self.present.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"Examples {empty} have no segment to remove (all padding or all kept): leave them out.")
        self.rows = torch.arange(len(input_ids), device=input_ids.device)
        encoder_decoder = bool(getattr(getattr(forward_func, "config", None), "is_encoder_decoder", False))
        self.decoder_start = decoder_start_token(forward_func) if encoder_decoder else None  # None: a decoder-only model
        self.padding_side = "left" if self.decoder_start is None else "right"

    def segment_scores(self, attributions: Tensor) -> Tensor:
        """``(B, S)`` the sum of each segment's token scores (-inf where absent)."""
        check_per_token(attributions, self.ids, inputs="prompts")
        check_rankable(attributions.float(), self.segments >= 0, finite=True)
        summed = torch.zeros(self.present.shape, dtype=torch.float64, device=attributions.device)
        summed.scatter_add_(1, self.segments.clamp(min=0), attributions.double().masked_fill(self.segments < 0, 0.0))
        return summed.masked_fill(~self.present, float("-inf"))

    def own_seeds(self, seed: int) -> Tensor:
        """``(B,)`` each example's seed, from ``seed``, its real prompt tokens and their
        segments numbered 0, 1, ... in order among its own (the default segments are the
        tokens' columns, which the left padding shifts)."""
        numbered = (self.present.long().cumsum(dim=1) - 1).gather(1, self.segments.clamp(min=0))
        numbered = numbered.masked_fill(self.segments < 0, -1)
        return example_seeds(torch.stack([self.ids, numbered], dim=-1), self.real[..., None].expand(-1, -1, 2), seed)

    def _identity(self) -> tuple:
        """The prompts, answers, model and image inputs (whatever their segments)."""
        return (
            id(self.forward_func), *(content_key(t) for t in (self.ids, self.real, self.answer)),
            tuple(sorted((name, id(value)) for name, value in (self.image_inputs or {}).items())),
        )

    def _ablation_key(self, rows: Tensor, removed: Tensor) -> Tensor:
        """The tokens an ablation keeps (so a call with other segments shares it too)."""
        return self._kept_tokens(rows, removed)

    def _distinct_log_probs(self, rows: Tensor, removed: Tensor) -> Tensor:
        """Padded batches hold at most ``PAIRS_PER_FORWARD`` query-key pairs (a padding mask
        makes the attention kernel materialise them): long prompts go one at a time,
        without padding. For a model that reads the padding (:attr:`padding_read`), each
        batch holds prompts of one length, unpadded."""
        per_forward = self._per_forward(len(rows))
        if per_forward > 1 and len(rows) > 1 and self.image_inputs and self.rows_read_together:
            per_forward = 1  # each ablation alone: the model's batches tell its rows apart
        encoded = len(rows) > 1 and self.encoded_images_reused
        lengths = self._kept_tokens(rows, removed).sum(dim=1)
        by_length = per_forward > 1 and bool((lengths != lengths[0]).any()) and self.padding_read is not None
        order = lengths.argsort(stable=True) if by_length else torch.arange(len(rows), device=rows.device)
        values = torch.empty(len(rows), device=rows.device, dtype=torch.float32)
        for chunk in length_batches(order, lengths[order] if by_length else None, per_forward):
            prompts, mask, positions = self._kept(rows[chunk], removed[chunk])
            values[chunk] = self._answer_log_probs(prompts, mask, positions, self.answer[rows[chunk]], encoded).to(values.device)
        return values

    def _per_forward(self, rows: int) -> int:
        """How many of ``rows`` prompts one padded forward holds: at most ``max_batch_size``
        and ``PAIRS_PER_FORWARD`` query-key pairs."""
        width = self.ids.shape[1] + self.answer.shape[1]
        return max(1, min(rows, self.max_batch_size, PAIRS_PER_FORWARD // width**2))

    def _answer_log_probs(self, prompts: Tensor, mask: Tensor, positions: Tensor, answer: Tensor, encoded: bool = False) -> Tensor:
        """``(R,)`` log p(answer | prompt) of the ``prompts`` as padded by ``mask``
        (``encoded``: the images given encoded, :attr:`encoded_images`)."""
        with torch.no_grad():
            logits = self._answer_logits(prompts, mask, positions, answer, encoded)
        return summed_log_probs(logits, answer, self.forced)

    def _answer_logits(self, prompts: Tensor, mask: Tensor, positions: Tensor, answer: Tensor, encoded: bool = False) -> Tensor:
        """``(R, answer tokens, vocab)``: the logits that predict each answer token, the
        prompts' columns holding the prompt tokens at ``positions`` (``encoded``: the
        images given encoded, :attr:`encoded_images`)."""
        new = answer.shape[1]
        if self.decoder_start is not None:
            start = torch.full_like(answer[:, :1], self.decoder_start)
            decoder = torch.cat([start, answer[:, :-1]], dim=1)
            images = next(iter(self._image_args(positions, mask, 0, encoded)), {})  # the source's
            with input_errors_named(self.forward_func, prompts):
                logits = output_logits(self.forward_func(input_ids=prompts, attention_mask=mask, decoder_input_ids=decoder, **images))
        else:
            sequences, sequence_mask = torch.cat([prompts, answer], dim=1), torch.cat([mask, torch.ones_like(answer)], dim=1)
            with input_errors_named(self.forward_func, sequences):
                logits = output_logits(
                    _by_name(self.forward_func)(sequences, sequence_mask, *self._image_args(positions, mask, new, encoded))
                )
        if logits.dim() != 3:
            raise ValueError(
                f"Context metrics read a language model's (batch, seq_len, vocab) logits; got shape {tuple(logits.shape)}."
            )
        return logits[:, :new] if self.decoder_start is not None else logits[:, -new - 1 : -1]

    def _image_args(self, positions: Tensor, mask: Tensor, new: int, encoded: bool = False) -> tuple[dict[str, Any], ...]:
        """The arguments after the ids and mask: the example's image inputs (none without
        them) for prompts whose columns hold its prompt tokens at
        ``positions`` (padding where ``mask`` is 0), then ``new`` answer tokens: per-token
        ones (``(1, prompt_len, ...)``: token types, Mllama's cross-attention mask) follow
        the kept tokens, 0 at padding, and extend over the answer as the attributions'
        (the adapter's ``generated_inputs``: as the model's ``generate`` extends them); the
        others are repeated for every prompt, the tower's own replaced by
        :attr:`encoded_images` where ``encoded``."""
        if not self.image_inputs:
            return ()
        rows, width = positions.shape
        images: dict[str, Any] = {}
        if encoded:
            assert self.encoded_images is not None  # encoded only where there are (encoded_images_reused)
            images[ENCODED_IMAGES] = encoded_copies(self._model, self.ids, self.encoded_images, rows)
        token_inputs = {}
        for name, value in self.image_inputs.items():
            if encoded and name in TOWER_INPUTS:
                continue
            if not per_token(value, self.ids.shape[1], name):
                images[name] = torch.cat([value] * rows)
                continue
            axes = (1,) * (value.dim() - 2)
            index = positions.view(rows, width, *axes).expand(rows, width, *value.shape[2:]).to(value.device)
            padding = mask.view(rows, width, *axes).to(value.device) == 0
            token_inputs[name] = value.expand(rows, *value.shape[1:]).gather(1, index).masked_fill(padding, 0)
        model = self._model
        grown = HuggingFaceAdapter().generated_inputs(model, token_inputs, width, new) if model is not None else extended_per_token(token_inputs, width, new, {})
        return ({**images, **grown},)

    @cached_property
    def padding_read(self) -> str | None:
        """How padding on the prompts' padding side moves a shortened prompt's answer
        log-probability (:func:`~captum_attention.metrics.token_removal.padding_probe`), or
        None where it does not. Deleting segments pads the shortened prompts there: a
        Hugging Face decoder that reads a left-padded prompt otherwise than alone (learned
        positions counted from the first column: BART's, XLM's); a forward that gives a
        model with absolute positions no position ids that skip the left padding, or leaves
        the attention mask out."""
        removable = self.segments >= 0
        row, prompt, columns = padding_probe(self.ids, self.real, removable, self.padding_side)
        grid = torch.arange(self.ids.shape[1], device=self.ids.device).expand_as(self.ids)
        positions = padding_probe(grid, self.real, removable, self.padding_side)[1]
        mask = torch.ones_like(prompt)
        padded_prompt, padded_mask = with_padding_column(prompt, mask, 0, self.padding_side, columns)
        padded_positions = with_padding_column(positions, mask, 0, self.padding_side, columns)[0]
        answer = self.answer[row : row + 1]
        left_padding_read = getattr(_by_name(self.forward_func), "left_padding_read", None)
        if self.decoder_start is None and left_padding_read is not None:  # a Hugging Face model's own check
            sequence, sequence_mask = torch.cat([padded_prompt, answer], dim=1), torch.cat([padded_mask, torch.ones_like(answer)], dim=1)
            reason = left_padding_read(sequence, sequence_mask, *self._image_args(padded_positions, padded_mask, answer.shape[1]))
            if reason is not None:
                return reason
        with torch.no_grad():
            alone_logits = self._answer_logits(prompt, mask, positions, answer, self.encoded_images_reused)
            padded_logits = self._answer_logits(padded_prompt, padded_mask, padded_positions, answer, self.encoded_images_reused)
        moved = log_prob_moved(
            summed_log_probs(alone_logits, answer, self.forced)[0], summed_log_probs(padded_logits, answer, self.forced)[0],
            alone_logits.dtype,
        )
        if moved is not None:
            return (
                f"Padding (attention mask 0) on the {self.padding_side} of example {row}'s shortened prompt moves its "
                f"answer's log-probability by {moved:.2g}."
            )
        return None

    @cached_property
    def rows_read_together(self) -> bool:
        """Whether a batch moves a row's answer log-probability: the second of two copies of
        the first example's whole prompt, its image inputs repeated as the ablations'
        batches repeat them, against the first (a vision-language model that places a
        batch's images or positions otherwise than each example's alone, HunYuan-VL's), or
        the model fails on that batch (MiniCPM-V, which packs a batch's images into one
        row). Where it does, the ablations run one at a time. Decided once per model, its
        dtype, the user's forward hooks and its image inputs' names and shapes (the
        per-token ones' aside: they follow the prompt's length)."""
        model = self._model
        if model is None:
            return self._second_row_moved()
        verdicts = _BATCH_VERDICTS.setdefault(model, {})
        key = self._verdict_key()
        if key not in verdicts:
            verdicts[key] = self._second_row_moved()
        return verdicts[key]

    def _verdict_key(self) -> tuple:
        """What a verdict on the model's batches holds for: its dtype and the user's hooks
        (:func:`~captum_attention.capture.adapters.huggingface.verdict_conditions`), the image
        inputs' names and shapes (the per-token ones' aside: they follow the prompt's length)."""
        width = self.ids.shape[1]
        shapes = tuple(sorted((name, () if per_token(value, width, name) else tuple(value.shape)) for name, value in (self.image_inputs or {}).items()))
        return verdict_conditions(self._model), shapes

    @cached_property
    def encoded_images(self) -> dict[str, Any] | None:
        """The example's images through the model's vision tower once
        (:func:`~captum_attention.capture.adapters.images.encoded_images`), or None where the
        model takes no encoded images (Mllama, Idefics, Kosmos-2; a function around the
        model) or encoding them fails: every ablated prompt about the same image then
        reruns the tower on it."""
        shared = self._shared
        if shared is not None and "encoded images" in shared:
            return shared["encoded images"]
        encoded = encoded_images(self._model, self.image_inputs or {})
        if shared is not None:
            shared["encoded images"] = encoded
        return encoded

    @property
    def _model(self) -> Any:
        """``forward_func`` where it is a module (a transformers model), else None."""
        return self.forward_func if isinstance(self.forward_func, nn.Module) else None

    @cached_property
    def encoded_images_reused(self) -> bool:
        """Whether the ablations take :attr:`encoded_images` instead of rerunning the tower
        per prompt: where the model scores the whole prompt so as it scores it from its
        image inputs (within the logits' precision), two copies of it where its batches
        read their rows apart (:attr:`rows_read_together`), else one. Decided once per
        model, as :attr:`rows_read_together`; a model that fails on its encoded images
        (BLIP-2's forward requires the pixels) or scores them otherwise reruns the tower."""
        if not takes_encoded_images(self._model, self.image_inputs):
            return False
        key = ("encoded", *self._verdict_key())
        verdicts = _BATCH_VERDICTS.setdefault(self._model, {})
        if key not in verdicts:
            verdicts[key] = self._encoded_images_match()
        return verdicts[key] and self.encoded_images is not None

    def _encoded_images_match(self) -> bool:
        if self.encoded_images is None:
            return False
        copies = 1 if self.rows_read_together else 2
        prompts, mask, positions, answer = (value[:copies] for value in self._two_copies)
        try:
            with torch.no_grad():
                reference = self._two_copies_logits if copies == 2 else self._answer_logits(prompts, mask, positions, answer)
                encoded = self._answer_logits(prompts, mask, positions, answer, encoded=True)
        except Exception:  # noqa: BLE001 - the forward refuses encoded images: its tower reruns
            return False
        assert reference is not None  # two copies ran, or rows_read_together
        pairs = zip(summed_log_probs(reference, answer, self.forced), summed_log_probs(encoded, answer, self.forced))
        return all(log_prob_moved(first, second, reference.dtype) is None for first, second in pairs)

    @cached_property
    def _two_copies(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The first example's whole prompt twice, as the ablations' batches give it: the
        ids, mask and positions (:meth:`_kept`) and the answers."""
        rows = self.rows.new_zeros(2)
        return (*self._kept(rows, torch.zeros_like(self.present[rows])), self.answer[rows])

    @cached_property
    def _two_copies_logits(self) -> Tensor | None:
        """The answer's logits after :attr:`_two_copies`, the image inputs repeated, or None
        where the model fails on that batch."""
        try:
            with torch.no_grad():
                return self._answer_logits(*self._two_copies)
        except (RuntimeError, ValueError):  # the model lays a batch's images out otherwise (MiniCPM-V's; Molmo2 asks for their crops)
            return None

    def _second_row_moved(self) -> bool:
        logits = self._two_copies_logits
        if logits is None:  # each alone runs
            return True
        first, second = summed_log_probs(logits, self._two_copies[3], self.forced)
        return log_prob_moved(first, second, logits.dtype) is not None

    def _kept_tokens(self, rows: Tensor, removed: Tensor) -> Tensor:
        """``(R, N)`` bool: the real prompt tokens of examples ``rows`` that the removed
        segments leave."""
        segments = self.segments[rows]
        gone = removed.gather(1, segments.clamp(min=0)) & (segments >= 0)
        return self.real[rows] & ~gone

    def _kept(self, rows: Tensor, removed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(ids, mask, positions)`` of the prompts without the removed segments' tokens,
        padded on :attr:`padding_side` (a decoder's prompts on the left, an encoder's source on
        the right), without the columns that are padding in every row; ``positions``: the
        prompt position each column's token came from. Padding is refused in one line for a
        model that reads it (:attr:`padding_read`)."""
        kept = self._kept_tokens(rows, removed)
        rank = kept.int() if self.padding_side == "left" else (~kept).int()
        order = rank.argsort(dim=1, stable=True)  # padding on its side, kept tokens in order
        ids = self.ids[rows].gather(1, order).masked_fill(~kept.gather(1, order), 0)
        mask = kept.gather(1, order).long()
        width = int((mask != 0).any(dim=0).sum())
        columns = slice(-width, None) if self.padding_side == "left" else slice(0, width)
        ids, mask, order = ids[:, columns], mask[:, columns], order[:, columns]
        if bool((mask == 0).any()) and self.padding_read is not None:
            raise UnsupportedModelError(
                f"{self.padding_read} The contexts of several examples are padded there: give one example at a time "
                "(its contexts need no padding)."
            )
        return ids, mask, order

    def contexts(self, kept: Tensor) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """For each ``(B, S)`` bool of ``kept`` ``(B, A, S)``: the prompts with only those
        segments (and the tokens never removed), padded as the model reads them, and the
        prompt position of each column's token (:meth:`_kept`)."""
        for segments in kept.unbind(dim=1):
            yield self._kept(self.rows, self.present & ~segments.to(self.present.device))


_SHARED_SCOPES: list[dict[Any, Any]] = []
"""The active :func:`shared_ablations` scopes, innermost last."""


@contextmanager
def shared_ablations() -> Iterator[None]:
    """Within it, the context metrics' calls on the same prompts, answers, model, batch size
    and image inputs (one example's, scored for several methods: ``evaluate``'s) share
    their sets of ablations' answer log-probabilities and the images' encoding: the whole
    prompt, LDS's seeded ablations and the leave-one-out deletions run once, whichever
    metric or method asks for them, with the values each call would compute alone. The
    model and the image inputs must not change inside it (the image inputs are known by
    identity)."""
    _SHARED_SCOPES.append({})
    try:
        yield
    finally:
        _SHARED_SCOPES.pop()


_BATCH_VERDICTS: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]]" = weakref.WeakKeyDictionary()
"""Per model, :attr:`_AnswerScorer.rows_read_together`'s verdicts."""


def log_prob_moved(reference: Tensor, other: Tensor, dtype: torch.dtype) -> float | None:
    """How far ``other`` is from the log-probability ``reference``, where farther than the
    logits' ``dtype`` explains; else None."""
    moved = abs(float(other) - float(reference))
    return moved if moved > max(1e-4, 8 * torch.finfo(dtype).eps) * max(1.0, abs(float(reference))) else None


def summed_log_probs(logits: Tensor, answer: Tensor, forced: int = 0) -> Tensor:
    """``(R,)`` the answer tokens' log-probabilities under ``logits`` ``(R, answer tokens,
    vocab)``, summed, but for the first ``forced`` tokens, which ``generate`` forced
    (:func:`~captum_attention.capture.inputs.forced_tokens`)."""
    return logits[:, forced:].float().log_softmax(dim=-1).gather(2, answer[:, forced:, None]).sum(dim=(1, 2))


def _prompt_segments(real: Tensor, segments: Tensor | None) -> Tensor:
    """``(B, N)`` long segment of each prompt token, -1 at padding; by default each real
    token its own, but the first (never removed)."""
    if segments is None:
        first = real.int().argmax(dim=1, keepdim=True)
        positions = torch.arange(real.shape[1], device=real.device).expand_as(real)
        segments = positions.masked_fill(positions == first, -1)
    return segments.to(real.device).masked_fill(~real, -1).long()


def _by_name(forward_func: Callable[..., Any]) -> Callable[..., Any]:
    """``forward_func`` called as ``(ids, mask)``: a Hugging Face model (or a PEFT model, as
    the model it wraps) by name (Bloom's and MPT's second parameter is the cache), a
    left-padded prompt with position ids over its real tokens, as ``generate`` gives them
    (:meth:`~captum_attention.capture.adapters.HuggingFaceAdapter.keyword_forward`); any
    other function as it is."""
    return HuggingFaceAdapter().keyword_forward(forward_func)


def _image_dict(image_inputs: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
    """``image_inputs`` as a dict, checked: tensors."""
    if image_inputs is None:
        return None
    if not isinstance(image_inputs, Mapping) or not all(isinstance(value, Tensor) for value in image_inputs.values()):
        raise TypeError("image_inputs must be a dict of tensors: the processor's output besides input_ids and attention_mask.")
    return dict(image_inputs)


def _with_args(attribute_func: Callable[..., Tensor], extra: tuple[Any, ...]) -> Callable[[Tensor, Tensor], Tensor]:
    """``attribute_func`` called on one context with the ``extra`` arguments (its image
    inputs, or none) after the ids and mask."""
    return lambda ids, mask: attribute_func(ids, mask, *extra)


def _one_example_images(image_inputs: Mapping[str, Tensor] | None, input_ids: Tensor) -> dict[str, Tensor] | None:
    """``image_inputs`` as a dict (:func:`_image_dict`), for a batch of one prompt."""
    image_inputs = _image_dict(image_inputs)
    if image_inputs is not None and len(input_ids) != 1:
        raise ValueError(
            f"image_inputs are one example's, but the prompts are a batch of {len(input_ids)}: score a vision-language "
            "model's answers one example at a time, each with its own image inputs."
        )
    return image_inputs


def kept_image_tokens(forward_func: Callable[..., Any], input_ids: Tensor, segments: Tensor | None, images: Mapping[str, Tensor]) -> Tensor:
    """``(B, N)`` bool: the tokens of the prompt's images, never removed: its image tokens
    (the model's config names their id; the model reads as many as its image inputs give
    features) and the markers around or inside them that the config names
    (:func:`~captum_attention.capture.adapters.images.image_marker_ids`: a family may fail
    without them, or place the image otherwise), or the positions an image input marks
    (:func:`~captum_attention.capture.adapters.images.marked_image_positions`: Kosmos-2's).
    Where neither names them, the given ``segments`` are trusted to keep them (-1); without
    them, a one-line error. A model that reads its image without an image token in its
    prompt (BLIP's, GIT's) keeps none."""
    config = getattr(forward_func, "config", None)
    marked = marked_image_positions(images, input_ids.shape)
    if image_token_id(config) is None:
        if marked is None and segments is None and not image_outside_prompt(forward_func):
            raise ValueError(
                "forward_func's config names no image token (image_token_id), so the context metrics cannot keep the "
                "image's tokens: give them segment -1 in segments."
            )
        return marked if marked is not None else torch.zeros_like(input_ids, dtype=torch.bool)
    tokens = torch.isin(input_ids, torch.tensor(image_marker_ids(config), device=input_ids.device))
    return tokens if marked is None else tokens | marked


def _checked_answer(input_ids: Tensor, attention_mask: Tensor, answer: Any, segments: Tensor | None) -> Tensor:
    """``answer`` as ``(batch, answer_len)`` token ids
    (:func:`~captum_attention.capture.inputs.answer_ids`), or a clear error for it, the
    prompts, their mask or their segments."""
    check_tensors(input_ids=input_ids, attention_mask=attention_mask)
    check_mask(attention_mask)
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.dtype == torch.bool or input_ids.numel() == 0:
        raise TypeError("input_ids must be a non-empty batch of prompt token ids (batch, prompt_len), padded on the left.")
    answer = answer_ids(answer, input_ids.shape[0], "answer")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}.")
    if answer.dim() != 2 or answer.shape[0] != input_ids.shape[0] or answer.shape[1] == 0 or answer.is_floating_point():
        raise ValueError(
            f"answer must be token ids (batch={input_ids.shape[0]}, answer_len >= 1), got shape {tuple(answer.shape)}."
        )
    if segments is not None and tuple(segments.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"segments has shape {tuple(segments.shape)} but input_ids {tuple(input_ids.shape)}: give each prompt "
            "token its segment index (-1: never removed)."
        )
    return answer


@takes_captum_scores("attributions")
def top_k_log_prob_drop(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    attributions: Tensor,
    ks: Sequence[int] = DEFAULT_KS,
    segments: Tensor | None = None,
    max_batch_size: int = 64,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Top-k log-probability drop: :math:`\log p(a \mid x) - \log p(a \mid x \setminus
    \text{top}_k)`, the top k segments by attribution removed (ties broken by position).

    Args:
        forward_func (Callable): the language model, or ``forward_func(input_ids,
            attention_mask)`` returning ``(batch, seq_len, vocab)`` logits.
        input_ids (Tensor): ``(batch, prompt_len)`` prompt token ids, padded on the left.
        attention_mask (Tensor): ``(batch, prompt_len)``, 1 for real tokens.
        answer (Tensor): ``(batch, answer_len)`` the answer's token ids.
        attributions (Tensor): ``(batch, prompt_len)`` token scores, higher = more
            important (a segment scores the sum of its tokens); NaN and ±inf refused.
        ks (sequence of int, optional): numbers of segments removed. Default: (1, 3, 5).
        segments (Tensor, optional): ``(batch, prompt_len)`` long, each token's segment
            (0, 1, ...; -1: never removed, e.g. BOS or the question; each example needs
            one such token to predict the answer from). Default: each token its own
            segment, the first real token (BOS) never removed.
        max_batch_size (int, optional): sequences per forward. Default: 64.
        image_inputs (dict, optional): a vision-language model's image inputs for the one
            prompt given (the processor's output besides ``input_ids`` and
            ``attention_mask``): given with every ablated prompt (to a function
            ``forward_func``, as a third argument), per-token ones (``(1, prompt_len,
            ...)``) following the kept tokens; the image's tokens (the config's
            ``image_token_id``, and the markers it names around them: Qwen2-VL's vision
            start and end, Gemma 3's begin and end of image) are never removed; where the
            model's batches tell their rows apart (HunYuan-VL's), the ablations run one
            at a time. Default: None.

    Returns:
        ``(batch, len(ks))``: the drop per k (k capped at the example's segment count).

    Example::

        >>> span = AttnLRP(model).attribute_span(prompt_ids, answer_ids, additional_forward_args=(mask,))
        >>> top_k_log_prob_drop(model, prompt_ids, mask, answer_ids, span[:, :prompt_ids.shape[1]])
    """
    check_ks(ks)
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    return top_k_drops(scorer, attributions, ks)


def check_ks(ks: Sequence[int]) -> None:
    """A clear error for ``ks`` that are not counts of features."""
    if not ks or any(not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks are numbers of segments, each at least 1; got {list(ks)}.")


def top_k_drops(scorer: AblationScorer, attributions: Tensor, ks: Sequence[int]) -> Tensor:
    """``(B, len(ks))``: :func:`top_k_log_prob_drop` over ``scorer``'s features."""
    order = scorer.segment_scores(attributions).argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    removed = torch.stack([(ranks < k) & scorer.present for k in ks], dim=1)  # (B, K, S)
    rows = scorer.rows.repeat_interleave(len(ks))
    after = scorer.log_probs(rows, removed.flatten(0, 1)).view(len(scorer.rows), len(ks))
    return scorer.original[:, None] - after


@takes_captum_scores("attributions")
def linear_datamodeling_score(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    attributions: Tensor,
    segments: Tensor | None = None,
    num_ablations: int = 32,
    seed: int = 0,
    max_batch_size: int = 64,
    per_example: bool = False,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""LDS (ContextCite): Spearman's ρ, over ``num_ablations`` random ablations that keep
    each segment with probability 1/2 (seeded), between :math:`\sum_{s \text{ kept}}
    \tau_s` and the actual :math:`\log p(a \mid x_{\text{kept}})`.

    The other arguments are :func:`top_k_log_prob_drop`'s.

    Args:
        num_ablations (int, optional): random ablations per example. Default: 32.
        seed (int, optional): seed of the ablations (the same for every attribution of
            an example, so that LDS compares them on the same ablations). Default: 0.
        per_example (bool, optional): draw each example's ablations alone, from ``seed``
            and its prompt's tokens and segments
            (:func:`~captum_attention.metrics.token_removal.example_seeds`), so that its
            score is the same in any batch and under any padding, as the registered
            ``lds`` metric draws them. Default: False: drawn over the batch's padded
            shape, as the benchmarks' figures were.

    Returns:
        ``(batch,)``: ρ in [-1, 1]; NaN where either side is constant.
    """
    check_ablation_count(num_ablations)
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    return datamodeling_scores(scorer, attributions, num_ablations, seed, per_example)


def check_ablation_count(num_ablations: int) -> None:
    """A clear error for too few ablations to rank."""
    if num_ablations < 3:
        raise ValueError(f"num_ablations must be at least 3 (a rank correlation), got {num_ablations}.")


def datamodeling_scores(scorer: AblationScorer, attributions: Tensor, num_ablations: int, seed: int, per_example: bool) -> Tensor:
    """``(B,)``: :func:`linear_datamodeling_score` over ``scorer``'s features."""
    scores = scorer.segment_scores(attributions).masked_fill(~scorer.present, 0.0)
    kept, actual = _random_ablations(scorer, num_ablations, seed, per_example)
    predicted = (kept.double() * scores[:, None]).sum(dim=-1)
    return spearman(predicted.float().cpu(), actual.cpu())


def random_ablations(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    segments: Tensor | None = None,
    num_ablations: int = 32,
    seed: int = 0,
    max_batch_size: int = 64,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""ContextCite's ablations: ``num_ablations`` per example that keep each segment with
    probability 1/2 (seeded, as :func:`linear_datamodeling_score` draws them), and the
    answer's :math:`\log p(a \mid x_{\text{kept}})` under each.

    The arguments are :func:`linear_datamodeling_score`'s.

    Returns:
        ``(kept, log_probs, segments)``: ``(B, A, S)`` bool kept segments (False for a
        segment an example does not have), ``(B, A)`` log-probabilities, and the ``(B, N)``
        segment of each prompt token (-1 for the tokens never removed and padding).
    """
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    kept, log_probs = _random_ablations(scorer, num_ablations, seed)
    return kept, log_probs, scorer.segments


@takes_captum_scores("prior")
def calibrated_scores(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    prior: Tensor,
    segments: Tensor | None = None,
    num_ablations: int = 8,
    seed: int = 1,
    ridge: float = CALIBRATION_RIDGE,
    max_batch_size: int = 64,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""A language model's answer explained by an attribution calibrated on a few
    ablations: :func:`~captum_attention.metrics.surrogate.calibrated_surrogate` (ContextCite's
    linear surrogate with the prior's segment scores in place of its sparsity) fitted to
    the answer's log-probability under ``num_ablations`` random ablations
    (:func:`random_ablations`, each example's drawn alone from ``seed``, its tokens and
    their segments, so that its scores do not depend on the batch; keep the seed apart
    from the one an LDS is measured with). The score of segment :math:`s` is
    :math:`\alpha p_s + \delta_s`, spread evenly over its tokens; the prior's where the
    ablations reverse it. For a classifier's prediction:
    :func:`~captum_attention.metrics.calibrated_attribution`.

    The other arguments are :func:`linear_datamodeling_score`'s.

    Args:
        prior (Tensor): ``(B, N)`` token scores of a one-pass attribution of the same
            answer, summed per segment.
        num_ablations (int, optional): the ablations fitted on, one forward each. Default: 8.
        seed (int, optional): their seed. Default: 1.
        ridge (float, optional): the surrogate's :math:`\lambda`. Default:
            :data:`~captum_attention.metrics.surrogate.CALIBRATION_RIDGE`.

    Returns:
        ``(B, N)`` float32 token scores; 0 at the tokens never removed and at padding.
    """
    if num_ablations < 1 or ridge <= 0:
        raise ValueError(f"num_ablations must be at least 1 and ridge positive, got {num_ablations} and {ridge}.")
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    prior_segments = scorer.segment_scores(prior)
    kept, actual = _random_ablations(scorer, num_ablations, seed, alone=True)
    calibrated = torch.zeros_like(prior_segments)
    for b, present in enumerate(scorer.present):
        calibrated[b, present] = calibrated_surrogate(kept[b][:, present].double(), actual[b].double(), prior_segments[b, present], ridge)
    removable = scorer.segments >= 0
    sizes = torch.zeros_like(calibrated).scatter_add_(1, scorer.segments.clamp(min=0), removable.double())
    per_token = (calibrated / sizes.clamp(min=1)).gather(1, scorer.segments.clamp(min=0))
    return per_token.masked_fill(~removable, 0.0).float()


@takes_captum_scores("prior")
def context_averaged_scores(
    forward_func: Callable[..., Any],
    attribute_func: Callable[[Tensor, Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    prior: Tensor,
    segments: Tensor | None = None,
    num_contexts: int = 8,
    seed: int = 1,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""A language model's answer explained in random half contexts: an attribution of the
    answer with about half of the prompt's segments deleted, summed per token over the
    contexts that keep it, plus a one-pass prior. The counterpart of
    :func:`~captum_attention.metrics.context_averaged_attribution` for a classifier, whose
    formula it shares: :math:`s_i = R_i / \sum_j |R_j| + p_i / \sum_j |p_j|` over the
    removable tokens, :math:`R_i` token i's scores summed over the :math:`A/2` contexts that
    keep it.

    The contexts come in complementary pairs: :math:`A/2` random halves of the segments
    (:func:`random_ablations`' draws, each example's alone from ``seed``, its tokens and
    their segments, as :func:`calibrated_scores` draws them) and the halves they leave out.
    Each context is deleted as the context metrics delete segments: the kept tokens close
    up, padded on the left (an encoder-decoder's source on the right), the columns every
    row pads dropped.

    The other arguments are :func:`linear_datamodeling_score`'s; ``forward_func`` (the
    model) runs no forward here: its config says whether the prompt is an encoder's source.

    Args:
        attribute_func (Callable): ``(input_ids, attention_mask) -> (batch, context_len)``
            prompt-token scores of the same answer (its span, ``answer``) for a batch of
            deleted prompts, the examples in the same order. Called ``num_contexts``
            times, once per context, on the whole batch.
        prior (Tensor): ``(B, N)`` prompt-token scores of a one-pass attribution of the
            same answer.
        num_contexts (int, optional): :math:`A`, even. Default: 8.
        seed (int, optional): the contexts' seed (keep it apart from the one an LDS is
            measured with). Default: 1.
        image_inputs (dict, optional): a vision-language model's image inputs for the one
            prompt given, as :func:`top_k_log_prob_drop`'s; ``attribute_func`` then takes
            them third, ``(input_ids, attention_mask, image_inputs)``, its per-token ones
            following each context's kept tokens. Default: None.

    Returns:
        ``(B, N)`` float32 token scores; 0 at the tokens never removed and at padding.

    Example::

        >>> lrp = AttnLRP(model)
        >>> def explain(ids, mask):
        ...     return lrp.attribute_span(ids, answer_ids, additional_forward_args=(mask,))[:, : ids.shape[1]]
        >>> prior = explain(prompt_ids, mask)
        >>> scores = context_averaged_scores(model, explain, prompt_ids, mask, answer_ids, prior, segments)
        >>> linear_datamodeling_score(model, prompt_ids, mask, answer_ids, scores, segments)
    """
    if num_contexts < 2 or num_contexts % 2:
        raise ValueError(f"num_contexts must be even and at least 2 (complementary pairs), got {num_contexts}.")
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, 1, image_inputs)
    removable = scorer.segments >= 0
    scorer.segment_scores(prior)  # checks the prior's shape and values
    halves = random_halves(scorer.present, num_contexts // 2, seed, scorer.own_seeds(seed))
    kept_segments = complemented(halves, scorer.present)
    summed = torch.zeros(input_ids.shape, dtype=torch.float64, device=input_ids.device)
    for context, (ids, mask, positions) in zip(kept_segments.unbind(dim=1), scorer.contexts(kept_segments)):
        kept = context.to(removable.device).gather(1, scorer.segments.clamp(min=0)) & removable
        explain = _with_args(attribute_func, scorer._image_args(positions, mask, 0))
        summed += scores_in_context(explain, ids, mask, positions, kept)
    return prior_and_context_shares(summed, prior, removable)


@takes_captum_scores("first_order", "prior")
def leave_one_out_estimates(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    first_order: Tensor,
    prior: Tensor,
    segments: Tensor | None = None,
    exact: int = 2,
    max_batch_size: int = 64,
    shares: Tensor | None = None,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Each segment's leave-one-out effect :math:`\log p(a \mid x) - \log p(a \mid x
    \setminus s)`, exact for the ``exact`` segments ``prior`` ranks highest and first-order
    for the rest: Feature Ablation's scores for ``exact`` forwards instead of one per
    segment.

    The first-order effects (``first_order``: :class:`~captum_attention.KnockoutGradient`'s
    span scores, one forward and backward) rank the many small effects as deleting does,
    but flatten the large ones, where the attention on a segment or the answer's
    probability saturates; a one-pass attribution that finds those (``prior``: AttnLRP's
    span scores, ranked by magnitude) names which segments to delete exactly.

    With ``shares`` (:func:`attention_shares`: each segment's largest share :math:`a_s`
    of one other token's attention), the exact deletions go instead to the segments of
    largest :math:`|p_s| / (1 - a_s)`: a deletion moves a row in which the segment holds
    :math:`a_s` of the attention :math:`1 / (1 - a_s)` times as far as its first-order
    effect says (:mod:`~captum_attention.maps.knockout`), so these are the estimates the
    first order is least sure of, whose effect may be large.

    The other arguments are :func:`linear_datamodeling_score`'s; ``first_order`` and
    ``prior`` are ``(B, N)`` token scores of the same answer, ``shares`` ``(B, S)``.

    Returns:
        ``(B, N)`` float32 token scores: the first-order ones, and each exactly deleted
        segment's effect spread evenly over its tokens; 0 at the tokens never removed and
        at padding.
    """
    if exact < 0:
        raise ValueError(f"exact must be a number of segments, 0 or more, got {exact}.")
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    if tuple(first_order.shape) != tuple(input_ids.shape):
        raise ValueError(f"first_order has shape {tuple(first_order.shape)} but the prompts are {tuple(input_ids.shape)}.")
    ranked = scorer.segment_scores(prior).abs()
    if shares is not None:
        if tuple(shares.shape) != tuple(scorer.present.shape):
            raise ValueError(
                f"shares has shape {tuple(shares.shape)}, not (batch, segments) = {tuple(scorer.present.shape)}: "
                "give attention_shares() of the same prompts and segments."
            )
        ranked = ranked / (1.0 - shares.to(ranked)).clamp(min=1e-6)
    ranked = ranked.masked_fill(~scorer.present, -1.0)
    chosen = ranked.argsort(dim=1, descending=True)[:, :exact]
    rows = torch.arange(len(input_ids), device=chosen.device)[:, None].expand_as(chosen)
    picked = scorer.present.gather(1, chosen)
    rows, chosen = rows[picked], chosen[picked]
    removed = torch.zeros(len(rows), scorer.present.shape[1], dtype=torch.bool, device=chosen.device)
    removed[torch.arange(len(rows)), chosen] = True
    effects = scorer.original[rows] - scorer.log_probs(rows, removed) if len(rows) else scorer.original[:0]
    removable = scorer.segments >= 0
    scores = first_order.detach().float().masked_fill(~removable, 0.0)
    sizes = torch.zeros(scorer.present.shape, device=removable.device, dtype=torch.float32)
    sizes = sizes.scatter_add_(1, scorer.segments.clamp(min=0), removable.float())
    for row, segment, effect in zip(rows.tolist(), chosen.tolist(), effects.float().tolist()):
        tokens = scorer.segments[row] == segment
        scores[row, tokens] = effect / float(sizes[row, segment])
    return scores


@without_autocast("attention_shares")
def attention_shares(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    segments: Tensor | None = None,
    adapter: AttentionAdapter | None = None,
    capture: CaptureMode = "auto",
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Each segment's largest share of one other token's attention: :math:`a_s = \max`
    over every attention call, head and query row :math:`i` outside :math:`s` (the prompt's
    and the answer's) of :math:`\sum_{j \in s} A_{ij}`, in one forward of the prompt and
    its answer. Where :math:`a_s` nears 1, deleting :math:`s` moves that row far more than
    its first-order effect says (:func:`leave_one_out_estimates`, ``shares``).

    The other arguments are :func:`linear_datamodeling_score`'s.

    Args:
        model (nn.Module): a decoder-only language model, called as the ablations call it
            (a Hugging Face model with ``position_ids`` that skip the left padding).
        adapter (AttentionAdapter, optional): how to find the model's attention.
            Default: the built-in one.
        capture (str, optional): ``"streaming"`` recomputes the probabilities one block
            of rows at a time from what the attention kernel received, at the kernel's
            memory; ``"eager"`` reads the ``(B, H, N, N)`` maps; ``"auto"`` streams where
            the model allows. Default: ``"auto"``.
        image_inputs (dict, optional): a vision-language model's image inputs for the
            prompts (a batch of them here), as :func:`top_k_log_prob_drop`'s: the image's
            tokens are keys of no segment. Default: None.

    Returns:
        ``(B, S)`` float32 shares in [0, 1], 0 for a segment an example does not have.

    Example::

        >>> shares = attention_shares(model, prompt_ids, mask, answer_ids, segments)  # (1, S)
    """
    answer = _checked_answer(input_ids, attention_mask, answer, segments)
    if bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)):
        raise ValueError("attention_shares reads a decoder-only model's self-attention; this model is an encoder-decoder.")
    images = _image_dict(image_inputs)
    prompt_segments = _prompt_segments(attention_mask != 0, segments)
    if images:
        prompt_segments = prompt_segments.masked_fill(kept_image_tokens(model, input_ids, segments, images), -1)
    count = max(int(prompt_segments.max()) + 1, 1)
    answer = answer.to(input_ids.device)
    ids, mask = torch.cat([input_ids, answer], dim=1), torch.cat([attention_mask, torch.ones_like(answer)], dim=1)
    key_segments = torch.cat([prompt_segments, torch.full_like(answer, -1)], dim=1)
    extra = (mask,) if not images else (mask, HuggingFaceAdapter().generated_inputs(model, images, input_ids.shape[1], answer.shape[1]))
    with torch.no_grad():
        record = run_model(_by_name(model), model, ids, extra, adapter=adapter, capture=capture, compares_probabilities=False)
    if any(role != "self" for role in record.roles):
        raise ValueError(f"attention_shares reads self-attention only; this model's calls are {sorted(set(record.roles))}.")
    real, key_segments = record.over_positions(mask != 0, True), record.over_positions(key_segments, -1)  # GIT's features: no segment
    shares = torch.zeros(len(ids), count, device=ids.device, dtype=torch.float32)
    for index in range(record.num_calls):
        if record.streaming:
            call = record.kernel_calls[index]
            call_shares = segment_share_max(call, key_segments, real, count, block_shape(call))
        else:
            call_shares = segment_shares(record.attn_maps[index], key_segments, key_segments, real, count)
        torch.maximum(shares, call_shares, out=shares)
    return shares


def ablated_log_probs(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    kept: Tensor,
    segments: Tensor | None = None,
    max_batch_size: int = 64,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""The answer's :math:`\log p(a \mid x_{\text{kept}})` under ablations of your choosing:
    what the context metrics measure, for a surrogate of your own (SHAP's, ContextCite's)
    over the same deletions.

    The other arguments are :func:`top_k_log_prob_drop`'s.

    Args:
        kept (Tensor): ``(batch, ablations, segments)`` bool, the segments each ablation
            keeps (every other segment deleted); ``segments`` counts the largest example's
            (a segment an example does not have is ignored).

    Returns:
        ``(batch, ablations)`` log-probabilities; a repeated ablation runs once.

    Example::

        >>> kept = torch.tensor([[[True, False, True], [False, True, True]]])
        >>> ablated_log_probs(model, prompt_ids, mask, answer_ids, kept, segments)  # (1, 2)
    """
    return _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs).kept_log_probs(kept)


def answer_log_probs(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""``(B,)`` :math:`\log p(a \mid x)` of each answer after its whole prompt (a decoder's,
    or an encoder-decoder's source), as the context metrics read it (``image_inputs`` as
    :func:`top_k_log_prob_drop`'s)."""
    return _AnswerScorer(forward_func, input_ids, attention_mask, answer, None, len(input_ids), image_inputs).original


def _random_ablations(scorer: AblationScorer, num_ablations: int, seed: int, alone: bool = False) -> tuple[Tensor, Tensor]:
    """The ablations of :func:`random_halves`; ``alone``: each example's from its own seed
    (:meth:`AblationScorer.own_seeds`)."""
    kept = random_halves(scorer.present, num_ablations, seed, scorer.own_seeds(seed) if alone else None)
    return kept, scorer.kept_log_probs(kept)


@takes_captum_scores("attributions")
def leave_one_out_agreement(
    forward_func: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    answer: Tensor,
    attributions: Tensor,
    segments: Tensor | None = None,
    max_batch_size: int = 64,
    image_inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    r"""Spearman's ρ between the segments' scores and their leave-one-out effects
    :math:`\log p(a \mid x) - \log p(a \mid x \setminus s)`.

    The arguments are :func:`top_k_log_prob_drop`'s, without ``ks``.

    Returns:
        ``(batch,)``: ρ in [-1, 1]; NaN with fewer than two segments or a constant side.
    """
    scorer = _AnswerScorer(forward_func, input_ids, attention_mask, answer, segments, max_batch_size, image_inputs)
    return leave_one_out_agreements(scorer, attributions)


def leave_one_out_agreements(scorer: AblationScorer, attributions: Tensor) -> Tensor:
    """``(B,)``: :func:`leave_one_out_agreement` over ``scorer``'s features."""
    scores = scorer.segment_scores(attributions)
    count = scorer.present.shape[1]
    rows, segment = scorer.present.nonzero(as_tuple=True)
    removed = torch.zeros(len(rows), count, dtype=torch.bool, device=scorer.present.device)
    removed[torch.arange(len(rows)), segment] = True
    effects = torch.zeros(scorer.present.shape, dtype=torch.float32)
    effects[rows.cpu(), segment.cpu()] = (scorer.original[rows] - scorer.log_probs(rows, removed)).float().cpu()
    return spearman(scores.float().cpu(), effects, scorer.present.cpu())
