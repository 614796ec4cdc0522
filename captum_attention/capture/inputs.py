"""Captum-style arguments checked and resolved: inputs, targets, query positions, logits.

Each function either returns the argument in the one form the library works with or raises
one clear error that names the problem and the fix.
"""

from __future__ import annotations

import operator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .._compat import TargetType, UnsupportedModelError, format_tensor_into_tuples

QueryIndex = int | Sequence[int] | Tensor | None


@dataclass(frozen=True)
class LogProbTarget:
    r"""A language model's target: the summed log-probability of ``tokens`` at
    ``positions``, :math:`S = \sum_b \sum_k \log \mathrm{softmax}(z_{b, p_{bk}})_{t_{bk}}`
    (the objective Captum's LLM attributions explain, and a continuation's log-likelihood).

    Attributes:
        positions: ``(B, K)`` long, the positions whose next-token distributions are read
            (a continuation's token k is predicted at prompt length - 1 + k).
        tokens: ``(B, K)`` long, the token ids whose log-probabilities are summed.
    """

    positions: Tensor
    tokens: Tensor

    def score(self, logits: Tensor) -> Tensor:
        """S from ``(B, T, V)`` logits (in the autograd graph), read at the positions only."""
        if logits.dim() != 3:
            raise ValueError(
                f"A log-probability target reads a language model's (batch, seq_len, vocab) "
                f"logits; the model returned shape {tuple(logits.shape)}."
            )
        batch = torch.arange(logits.shape[0], device=logits.device)[:, None]
        read = logits[batch, self.positions.to(logits.device)].float().log_softmax(dim=-1)
        return read.gather(2, self.tokens.to(logits.device)[..., None]).sum()

    def query_weights(self, num_tokens: int) -> Tensor:
        """``(B, T)`` float: 1 at each position read (the span's query rows)."""
        weights = torch.zeros(self.positions.shape[0], num_tokens, device=self.positions.device, dtype=torch.float32)
        return weights.scatter_(1, self.positions, 1.0)


def format_inputs(inputs: Tensor | tuple[Tensor, ...]) -> tuple[bool, tuple[Tensor, ...]]:
    """Validate Captum-style ``inputs``: one tensor of token ids, embeddings or images, or
    a pair ``(source, target)`` of them for encoder-decoders."""
    is_tuple = isinstance(inputs, tuple)
    formatted = format_tensor_into_tuples(inputs) if is_tuple or isinstance(inputs, Tensor) else None
    if formatted is None or len(formatted) not in (1, 2) or not all(isinstance(t, Tensor) for t in formatted):
        raise TypeError(
            "inputs must be one tensor (or a 1-tuple): token ids (batch, seq_len), embeddings "
            "(batch, seq_len, hidden) or images (batch, channels, height, width); or, for "
            f"encoder-decoders, a pair (source, target); got {type(inputs).__name__}"
            + (f" of length {len(inputs)}" if isinstance(inputs, tuple) else "")
            + ". Pass further model inputs through additional_forward_args" + _input_hint(inputs) + "."
        )
    for index, tensor in enumerate(formatted):
        _check_input(tensor, image_ok=index == 0)
    return is_tuple, tuple(formatted)


def _input_hint(inputs: Any) -> str:
    """What to pass instead of a tokenizer's whole output or a NumPy array."""
    if isinstance(inputs, Mapping):
        return " (a tokenizer's output: pass its input_ids as inputs and (its attention_mask,) as additional_forward_args)"
    if hasattr(inputs, "__array__"):
        return " (an array: tokenize with return_tensors='pt', or pass torch.as_tensor(inputs))"
    return ""


def take_rows(value: Any, rows: Tensor, batch: int, min_dim: int = 1) -> Any:
    """``value`` with every tensor of ``batch`` rows (and at least ``min_dim`` dimensions)
    taken at ``rows`` (repeats allowed); tuples, lists and dicts entry by entry; anything
    else as it is. ``min_dim=2`` leaves 1-D tensors alone (a layer's ``cache_position``,
    whose length may equal the batch)."""
    if isinstance(value, Tensor):
        return value.index_select(0, rows.to(value.device)) if value.dim() >= min_dim and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(take_rows(item, rows, batch, min_dim) for item in value)
    if isinstance(value, dict):
        return {name: take_rows(item, rows, batch, min_dim) for name, item in value.items()}
    return value


def _check_input(tensor: Tensor, image_ok: bool) -> None:
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise ValueError("inputs is an empty batch: pass at least one example.")
    if tensor.is_floating_point() and tensor.dim() == 2:
        raise TypeError(
            f"inputs are floating-point with shape {tuple(tensor.shape)}: token ids must be "
            "integers (torch.long). To attribute embeddings (e.g. under NoiseTunnel), pass "
            "them as (batch, seq_len, hidden) and forward them through inputs_embeds. An audio "
            "model's waveform (input_values) is not supported: no token stands for its frames."
        )
    if tensor.dtype == torch.bool or (not tensor.is_floating_point() and tensor.dim() != 2):
        raise TypeError(
            f"inputs with dtype {tensor.dtype} and shape {tuple(tensor.shape)} are neither "
            "token ids (integer, (batch, seq_len)) nor embeddings (float, (batch, seq_len, hidden))"
            + (": one text's ids need their batch dimension, inputs.unsqueeze(0)." if tensor.dim() == 1 else ".")
        )
    if tensor.is_floating_point() and tensor.dim() not in ((3, 4) if image_ok else (3,)):
        images = "or images (batch, channels, height, width)" if image_ok else "(an encoder-decoder's target is no image)"
        raise TypeError(f"float inputs must be embeddings (batch, seq_len, hidden) {images}, got shape {tuple(tensor.shape)}.")
    if tensor.dim() in (2, 3) and tensor.shape[1] == 0:
        raise ValueError("inputs have no tokens (seq_len is 0).")


def decoder_start_token(model: Any) -> int:
    """An encoder-decoder's ``decoder_start_token_id`` (its generation config's, else its
    config's): the token its decoder reads first; a clear error where it names none."""
    starts = [getattr(getattr(model, where, None), "decoder_start_token_id", None) for where in ("generation_config", "config")]
    start = next((token for token in starts if token is not None), None)
    if start is None:
        raise ValueError(
            f"{type(model).__name__} names no decoder_start_token_id (in its generation_config or config), the token "
            "its decoder starts from: set model.generation_config.decoder_start_token_id."
        )
    return int(start)


def classifier_decoder_ids(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """The decoder's ids an encoder-decoder's sequence classifier (BART's, T5's, mBART's)
    makes of its ``input_ids`` ``(B, S)`` itself, read at its decoder's call in one forward
    without gradients: BART's and T5's the text shifted right after the decoder's start
    token, mBART's with its last token moved to the front. Pass ``(input_ids,
    classifier_decoder_ids(model, input_ids, attention_mask))`` to the methods;
    :func:`~captum_attention.maps.encoder_decoder.text_scores` joins the two scores they
    return into one per token of the text."""
    from .guard import ModelChanges

    seen: list[Any] = []

    def read(module: Any, args: tuple, kwargs: dict) -> None:
        seen.append(kwargs.get("input_ids", args[0] if args else None))

    def install(stack: ExitStack) -> None:
        stack.callback(model.get_decoder().register_forward_pre_hook(read, with_kwargs=True).remove)

    with torch.no_grad(), ModelChanges(model, install):
        model(input_ids=input_ids, attention_mask=attention_mask)
    if len(seen) != 1 or not isinstance(seen[0], Tensor) or seen[0].shape[0] != input_ids.shape[0]:
        raise UnsupportedModelError(
            f"{type(model).__name__}'s decoder was not called once with token ids in its forward: pass "
            "(input_ids, decoder_input_ids) to the methods yourself."
        )
    return seen[0]


def forced_first_token(model: Any) -> int | None:
    """The token an encoder-decoder's ``generate`` puts first in every answer, whatever its
    logits (``generation_config.forced_bos_token_id``: a translation model's target
    language, BART-CNN's BOS), else None (a decoder-only model's ``generate`` never forces
    it: the prompt is longer than one token)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    forced = getattr(getattr(model, "generation_config", None), "forced_bos_token_id", None)
    return None if forced is None else int(forced)


def forced_tokens(model: Any, answer: Tensor) -> int:
    """How many of the ``answer`` ``(B, n)`` tokens ``generate`` forced rather than the
    model chose: 1 where every row begins with :func:`forced_first_token`, else 0. An
    answer's log-probability leaves them out, as the decoder's start token: they are
    read, not explained."""
    forced = forced_first_token(model)
    return int(forced is not None and answer.shape[1] > 0 and bool((answer[:, 0] == forced).all()))


CHOSEN_END: dict[str, Any] = {"forced_eos_token_id": None}
"""``generate``'s argument that ends an answer cut at its length limit with the token the
model chose there, not with the end token that BART's, Marian's or Pegasus's
``forced_eos_token_id`` forces in its place (whose log-probability, where the model meant
to go on, would be summed into the answer's)."""


def with_forced_token(model: Any, answer: Tensor) -> Tensor:
    """A text answer's ``(n,)`` ids, tokenized without special tokens, as ``generate``
    gives an encoder-decoder's: after the token it forces first
    (:func:`forced_first_token`), where it forces one."""
    forced = forced_first_token(model)
    if forced is None or (len(answer) and int(answer[0]) == forced):
        return answer
    return torch.cat([answer.new_tensor([forced]), answer])


def output_logits(output: Any, batch: int | None = None) -> Tensor:
    """The logits in ``output``: ``(batch, num_classes)``, or ``(batch, seq_len, vocab)``
    for a language model. Given the ``batch`` size, one score per example (``(batch,)``,
    as Captum's methods take it with ``target=None``) too, as one class: ``(batch, 1)``."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if batch is not None and isinstance(logits, Tensor) and logits.dim() == 1 and logits.shape[0] == batch:
        return logits.unsqueeze(1)
    if not isinstance(logits, Tensor) or logits.dim() not in (2, 3):
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        scores = "" if batch is None else f", or one score per example ({batch},)"
        span = (
            " (a question answerer's: e.g. lambda ids, mask: model(ids, attention_mask=mask).start_logits, explained with "
            "target and query_index the position)" if getattr(output, "start_logits", None) is not None else ""
        )
        raise ValueError(
            f"forward_func must return logits of shape (batch, num_classes), or "
            f"(batch, seq_len, vocab) for language models{scores}, got {shape}. Wrap the model so "
            f"that it returns the logits to explain{span}."
        )
    return logits


def class_probabilities(logits: Tensor) -> Tensor:
    """``(B, C)`` float32 class probabilities of ``(B, C)`` logits: their softmax; for one
    logit per example (a binary classifier or a reward model with one output, whose softmax
    is always 1) its sigmoid, as transformers' pipelines read one logit, beside its
    complement, ``[σ(z), 1 − σ(z)]``: the logit's own class first, at index 0, its target.
    Probabilities given for logits (rows of non-negative numbers that sum to 1, a
    ``forward_func`` that ends in a softmax) are refused in one line."""
    logits = logits.float()
    if logits.shape[-1] > 1 and bool((logits >= 0).all()) and bool(((logits.sum(dim=-1) - 1).abs() <= 1e-3).all()):
        raise ValueError(
            "forward_func returns probabilities (every row is non-negative and sums to 1), which would go through a "
            "softmax again: return the logits (or log-probabilities)."
        )
    if logits.shape[-1] == 1:
        own = logits.sigmoid()
        return torch.cat([own, 1 - own], dim=-1)
    return logits.softmax(dim=-1)


def resolve_targets(logits: Tensor, target: TargetType) -> Tensor:
    """Captum's ``target`` as a ``(B,)`` long tensor of class indices; None = predicted class."""
    batch, num_classes = logits.shape
    if target is None:
        return logits.argmax(dim=1)
    if isinstance(target, tuple) and len(target) != 1:
        raise ValueError(
            f"target {target!r}: a tuple indexes each example's logits after the batch, as in Captum, and these "
            f"{tuple(logits.shape)} logits take one index: pass a list for one class per example."
        )
    if isinstance(target, tuple):
        target = target[0]
    if isinstance(target, list) and any(not _is_index(t) for t in target):
        raise TypeError(f"target must hold ints (class indices), got {target!r}.")
    if isinstance(target, list):
        target = [operator.index(t) for t in target]
    targets = _one_per_example(target, batch, logits.device, "target", "class indices")
    bad = ((targets < 0) | (targets >= num_classes)).nonzero().flatten().tolist()
    if bad and num_classes == 1:
        raise ValueError(
            f"target {targets[bad[0]].item()} is out of range: forward_func returns one score per example, "
            "so target must be 0 or None."
        )
    if bad:
        raise ValueError(
            f"target {targets[bad[0]].item()} is out of range: the model gives {num_classes} logits per example (its "
            f"classes, or a language model's vocabulary), so target must be in [0, {num_classes - 1}]."
        )
    return targets


def index_target(target: TargetType, query_index: QueryIndex, seq_len: int) -> tuple[TargetType, QueryIndex, bool]:
    """Captum's ``target`` as an index into each example's logits after its batch index: a
    tuple ``(position, class)`` for all examples, or a list of such tuples, one per example,
    as ``(classes, positions, True)``, the positions taken from the end where negative;
    ``(class,)`` as the class; any other target as it is, beside ``query_index`` (False).
    A one-line error where ``query_index`` names other positions."""
    if isinstance(target, tuple) and len(target) == 1 and _is_index(target[0]):
        return operator.index(target[0]), query_index, False
    per_example = isinstance(target, list) and bool(target) and all(isinstance(t, tuple) for t in target)
    if not isinstance(target, tuple) and not per_example:
        return target, query_index, False
    pairs = [target] if isinstance(target, tuple) else target
    if any(len(pair) != 2 or not all(_is_index(i) for i in pair) for pair in pairs):
        raise TypeError(
            f"target {target!r}: a tuple indexes each example's logits after the batch, as in Captum: (position, class) "
            "of logits per position (batch, seq_len, classes), or (class,); pass a list of ints for one class per example."
        )
    indices = [(operator.index(position), operator.index(label)) for position, label in pairs]
    positions = [position + seq_len if -seq_len <= position < 0 else position for position, _ in indices]
    classes = [label for _, label in indices]
    if query_index is not None and not _same_positions(query_index, positions):
        raise ValueError(
            f"target {target!r} names positions {positions} and query_index {query_index!r} others: give the explained "
            "position once, in the target's tuple or as query_index beside a class target."
        )
    if isinstance(target, tuple):
        return classes[0], positions[0], True
    return classes, positions, True


def _is_index(value: Any) -> bool:
    """Whether ``value`` is an integer: Python's, numpy's, or a one-element integer tensor."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _same_positions(query_index: QueryIndex, positions: list[int]) -> bool:
    """Whether integer ``query_index`` names ``positions`` (one for all examples or one each)."""
    given = torch.as_tensor(query_index)
    if given.is_floating_point():
        return False
    try:
        given, named = torch.broadcast_tensors(given, torch.as_tensor(positions))
    except RuntimeError:
        return False
    return bool((given == named).all())


def end_tokens(model: Any) -> list[int]:
    """The ids at which ``model``'s ``generate`` stops (its generation config's
    ``eos_token_id``, else its config's: one id or several, Llama-3's end of turn too)."""
    config = getattr(model, "generation_config", None) or getattr(model, "config", None)
    end_ids = getattr(config, "eos_token_id", None)
    return [int(token) for token in (end_ids if isinstance(end_ids, list) else [end_ids]) if token is not None]


def check_no_padding_after_end(model: Any, continuation: Tensor, name: str = "continuation") -> None:
    """A one-line error where a row of ``continuation`` (called ``name``) is padded after its
    end-of-sequence token, as ``generate`` pads a batch's shorter answers (with the model's
    pad or end id, read from its generation config): the padding would be explained, or
    scored, as answer tokens."""
    config = getattr(model, "generation_config", None) or getattr(model, "config", None)
    ends, pad_id = end_tokens(model), getattr(config, "pad_token_id", None)
    if not ends or continuation.shape[1] < 2:
        return
    fills = torch.tensor(ends + ([pad_id] if pad_id is not None else []), device=continuation.device)
    positions = torch.arange(continuation.shape[1], device=continuation.device)
    first_end = positions.masked_fill(~torch.isin(continuation, fills[: len(ends)]), continuation.shape[1]).amin(dim=1)
    filled_after = (torch.isin(continuation, fills) | (positions[None] <= first_end[:, None])).all(dim=1)
    padded = (first_end < continuation.shape[1] - 1) & filled_after
    if bool(padded.any()):
        row = int(padded.nonzero()[0])
        end = int(first_end[row])
        raise ValueError(
            f"{name} row {row} is padded after its end-of-sequence token (position {end}), as generate pads a "
            "batch's shorter answers: the padding would be read as answer tokens; give each answer alone, up to its end "
            f"({name}[{row}:{row + 1}, :{end + 1}])."
        )


def outside_vocabulary(model: Any, ids: Tensor, rows: int) -> str | None:
    """One line naming the token ids of ``ids`` outside ``model``'s vocabulary of ``rows``
    (negative, or past its last row), with the fix; None where every id lies inside."""
    outside = sorted(set(ids[(ids < 0) | (ids >= rows)].tolist()))
    if not outside:
        return None
    labels = " and no -100 (a label's ignore index, no token)" if -100 in outside else ""
    return (
        f"Token ids {outside[:5]} lie outside the vocabulary of {type(model).__name__} ({rows} ids, 0 to {rows - 1}): "
        f"give ids from the model's own tokenizer{labels}."
    )


def rows_beginning_with_bos(model: Any, continuation: Tensor) -> list[int]:
    """The rows of a decoder-only model's ``continuation`` that begin with its BOS token,
    as a tokenizer that adds one gives an answer's text. A BOS that is also the end or pad
    token (GPT-2's) counts for none, nor does an encoder-decoder's (BART's targets begin
    with one)."""
    config = getattr(model, "config", None)
    bos = getattr(config, "bos_token_id", None)
    if not isinstance(bos, int) or getattr(config, "is_encoder_decoder", False) or continuation.shape[-1] == 0:
        return []
    others = [getattr(config, "eos_token_id", None), getattr(config, "pad_token_id", None)]
    if any(bos == token or (isinstance(token, list) and bos in token) for token in others):
        return []
    return (continuation[:, 0] == bos).nonzero().flatten().tolist()


def query_positions(query_index: QueryIndex, real: Tensor, causal: bool = False) -> Tensor:
    """``query_index`` as a ``(B,)`` long tensor of real positions, or a clear error.

    None: the last real token when the attention is causal (decoders, where the
    explained logit is read), else the first real token ([CLS], a ViT's class token).
    """
    batch, seq_len = real.shape
    if query_index is None:
        positions = torch.arange(seq_len, device=real.device).expand(batch, -1)
        if causal:
            return positions.masked_fill(~real, -1).amax(dim=1)
        return positions.masked_fill(~real, seq_len).amin(dim=1)
    queries = _one_per_example(query_index, batch, real.device, "query_index", "positions")
    if ((queries < 0) | (queries >= seq_len)).any():
        raise ValueError(f"query_index {query_index} is outside the sequence [0, {seq_len - 1}].")
    padded = (~real[torch.arange(batch, device=real.device), queries]).nonzero().flatten().tolist()
    if padded:
        raise ValueError(
            f"query_index points at a padding token in examples {padded}: choose a real token "
            "(by default the first real token, or the last one for decoders)."
        )
    return queries.long()


def query_row_weights(weights: Tensor, real: Tensor) -> Tensor:
    """``weights`` ``(B, T)`` of the explained query rows (the methods that read a row read
    their weighted sum), or a one-line error: another shape, a negative or non-finite
    weight, weight on padding, or none on an example."""
    if tuple(weights.shape) != tuple(real.shape):
        raise ValueError(
            f"query_index as row weights must be shaped (batch, seq_len) = {tuple(real.shape)}, got {tuple(weights.shape)}."
        )
    weights = weights.to(real.device)
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        raise ValueError("query_index as row weights must be finite and non-negative.")
    if bool((weights[~real] != 0).any()):
        raise ValueError("query_index as row weights puts weight on padding: give weight to real tokens only.")
    if not bool((weights > 0).any(dim=1).all()):
        raise ValueError("query_index as row weights gives an example no weight: give every example a row.")
    return weights.float()


def outside_inference_mode(value: Any) -> Any:
    """A tensor made under ``torch.inference_mode`` (ids that ``generate`` returned
    there) as a copy that autograd may save for a backward; anything else as it is."""
    return value.clone() if isinstance(value, Tensor) and value.is_inference() and not torch.is_inference_mode_enabled() else value


def answer_ids(answer: Any, batch: int, name: str) -> Tensor:
    """``answer`` as a tensor of ``batch`` rows: a list of ints (a tokenizer's
    ``input_ids``) as a tensor, and one answer (1-D, or one row) as every prompt's, as one
    int target serves every example; text, rows of different lengths and anything but a
    tensor or a list refused in one line (the caller checks the ids' shape and type)."""
    if isinstance(answer, str) or (isinstance(answer, list) and any(isinstance(a, str) for a in answer)):
        raise TypeError(
            f"{name} is text: give its token ids, e.g. tokenizer(text, add_special_tokens=False, "
            "return_tensors='pt').input_ids."
        )
    if isinstance(answer, list):
        try:
            answer = torch.tensor(answer)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{name} holds rows of different lengths ({error}): explain each answer in its own call, or give one "
                "tensor of token ids (batch, new_tokens)."
            ) from None
    if not isinstance(answer, Tensor):
        raise TypeError(f"{name} must be token ids, a tensor (batch, new_tokens) or a list of ints, got {type(answer).__name__}.")
    if answer.dim() == 1:
        answer = answer[None]
    if answer.dim() == 2 and answer.shape[0] == 1 and batch > 1:
        answer = answer.expand(batch, -1)
    return answer


def _one_per_example(value: Any, batch: int, device: torch.device, name: str, what: str) -> Tensor:
    """``value`` (an int, ints or a tensor of them) as a ``(B,)`` long tensor, or a clear error."""
    if isinstance(value, str) or (isinstance(value, list) and any(isinstance(v, str) for v in value)):
        raise TypeError(
            f"{name} {value!r} is text, and {name} takes {what} (integers): a label's index is "
            "model.config.label2id[label], a token's id tokenizer.convert_tokens_to_ids(token); a text answer is "
            "explained by attribute_span(input_ids, answer_ids) or LLMAttentionAttribution."
        )
    values = outside_inference_mode(torch.as_tensor(value, device=device))
    if values.is_floating_point() or values.dtype == torch.bool:
        raise TypeError(f"{name} must be {what} (integers), got dtype {values.dtype}.")
    if values.dim() == 0:
        values = values.expand(batch)
    if values.shape != (batch,):
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}: give one int for all examples or one per example ({batch})."
        )
    return values.long()
