"""Scores scaled for display: special tokens left out, each example on its own scale.

Rollout and Transformer Attribution put most of their mass on ``[CLS]`` itself (its own
row of the identity), so a colour scale set by it leaves every word blank. These helpers
give ``captum.attr.visualization.visualize_text`` and ``visualize_image_attr`` (or a
matplotlib heat map) scores where the words are what is compared.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .._compat import check_one_tensor, pretty_tokens


def special_tokens(input_ids: Tensor, tokenizer: Any) -> Tensor:
    """``input_ids``-shaped bool tensor, True at the tokenizer's special tokens
    (``[CLS]``, ``[SEP]``, padding, ...); ``input_ids`` a tensor, or a tokenizer's list."""
    input_ids = torch.as_tensor(input_ids)
    special_ids = torch.tensor(sorted(tokenizer.all_special_ids), device=input_ids.device)
    return torch.isin(input_ids, special_ids)


def readable_tokens(ids: Tensor, tokenizer: Any) -> list[str]:
    """Token ids as words, as the reports show them and Captum's LLM results show an
    answer's tokens: without the space marks of byte-level and SentencePiece tokens
    (GPT-2's and RoBERTa's ``Ġthe``, XLM-R's ``▁the``: ``the``), a WordPiece continuation
    with its ``##`` (BERT's ``##ing``), a token that shows as nothing (a lone space mark)
    as it is, an id the tokenizer has no token for (a row of an embedding table padded past
    the vocabulary) as ``<id N>``.

    Args:
        ids (Tensor): ``(seq_len,)`` token ids of one text (or a batch of one, or a
            tokenizer's list).
        tokenizer: its Hugging Face tokenizer.

    Returns:
        One string per id.

    Example::

        >>> tokens = readable_tokens(input_ids[0], tokenizer)
        >>> token_heatmap({"AttnLRP": scores[0]}, tokens)
    """
    ids = torch.as_tensor(ids)
    ids = _one_row(ids)
    if ids.dim() != 1:
        raise ValueError(f"ids have shape {tuple(ids.shape)}, not (seq_len,): give one text's ids, e.g. input_ids[0].")
    raw = tokenizer.convert_ids_to_tokens(ids.tolist())
    shown = pretty_tokens(ids, tokenizer)
    return [
        f"<id {token_id}>" if token is None else token if token.startswith("##") or not text.strip() else text
        for token_id, token, text in zip(ids.tolist(), raw, shown)
    ]


def scores_for_display(scores: Tensor, special: Tensor | None = None, signed: bool = False) -> Tensor:
    """Each example's scores divided by its largest magnitude over the non-special tokens.

    Args:
        scores (Tensor): ``(B, ...)`` attribution scores, one row per example (tokens, or
            a patch grid).
        special (Tensor, optional): bool, the shape of ``scores``: entries to leave out
            (set to 0 and kept out of the scale), e.g. from :func:`special_tokens`.
            Default: None (nothing left out).
        signed (bool, optional): keep the signs, giving values in ``[-1, 1]`` (for methods
            whose negative scores mean something, as Integrated Gradients); else
            magnitudes in ``[0, 1]``. Default: False.

    Returns:
        Tensor of the shape of ``scores``; an example whose scores are all 0 stays 0. NaN
        or ±inf among the shown entries are refused in one line.

    Example::

        >>> scores = TransformerAttribution(model).attribute(ids, target=1)
        >>> shown = scores_for_display(scores, special_tokens(ids, tokenizer))
        >>> visualize_text([VisualizationDataRecord(shown[0], ...)])
    """
    check_one_tensor(scores, "scores")
    if special is not None and special.shape != scores.shape:
        raise ValueError(
            f"special has shape {tuple(special.shape)} but scores have {tuple(scores.shape)}: "
            "pass one flag per score (special_tokens(input_ids, tokenizer) for token scores)."
        )
    shown = scores.detach().float()
    if special is not None:
        shown = shown.masked_fill(special.to(shown.device), 0.0)
    not_finite = (~torch.isfinite(shown)).flatten(1).any(dim=1).nonzero().flatten().tolist()
    if not_finite:
        raise ValueError(
            f"scores hold NaN or ±inf in examples {not_finite} (among the entries shown): no scale shows them; "
            "replace them first (torch.nan_to_num) or leave those examples out."
        )
    if not signed:
        shown = shown.abs()
    scale = shown.abs().flatten(1).amax(dim=1).clamp(min=torch.finfo(shown.dtype).tiny)
    return shown / scale.view(-1, *([1] * (shown.dim() - 1)))


def token_heatmap(scores: Mapping[str, Tensor], tokens: Sequence[str], ax: Any = None, title: str | None = None) -> Any:
    """A matplotlib heat map of several methods' scores of one text: one row per method.

    Args:
        scores (mapping): method name -> ``(tokens,)`` scores of one example (or a batch of
            one, ``(1, tokens)``), e.g. rows of :func:`scores_for_display`: values in
            ``[0, 1]``, or ``[-1, 1]`` where some are negative; others are refused, as
            the colour scale would clip them.
        tokens (sequence of str): the token labels of the columns.
        ax (matplotlib Axes, optional): where to draw. Default: a new figure's.
        title (str, optional): the axes' title. Default: None.

    Returns:
        The matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    grid = torch.stack([_heatmap_row(name, values, len(tokens)) for name, values in scores.items()]).numpy()
    if ax is None:
        _, ax = plt.subplots(figsize=(max(8.0, 0.6 * len(tokens)), 0.45 * len(scores) + 1.8))
    signed = bool((grid < 0).any())
    image = ax.imshow(grid, cmap="RdBu_r" if signed else "Greens", vmin=-1 if signed else 0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(tokens)), list(tokens), rotation=60, ha="right")
    ax.set_yticks(range(len(scores)), list(scores))
    ax.figure.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    if title:
        ax.set_title(title, fontsize=10)
    ax.figure.tight_layout()
    return ax


def _one_row(values: Tensor) -> Tensor:
    """A batch of one (``(1, T)``) as its row; anything else as it is."""
    return values[0] if values.dim() == 2 and values.shape[0] == 1 else values


def _heatmap_row(name: str, values: Tensor, tokens: int) -> Tensor:
    """``name``'s scores as one row of :func:`token_heatmap` (float32 on the CPU: a tensor
    warns in NumPy 2), or a one-line error: not one finite score per token in ``[-1, 1]``."""
    check_one_tensor(values, f"scores[{name!r}]")
    row = values.detach().float().cpu()
    row = _one_row(row)
    if tuple(row.shape) != (tokens,):
        raise ValueError(f"scores[{name!r}] has shape {tuple(values.shape)}, not one score per token ({tokens},).")
    if not bool(torch.isfinite(row).all()) or float(row.abs().max()) > 1:
        raise ValueError(
            f"scores[{name!r}] hold values outside [-1, 1] (or not finite), which the colour scale would clip: pass "
            "rows of scores_for_display(scores)."
        )
    return row


def outside_span(offsets: Tensor, text: str, span: tuple[int, int]) -> Tensor:
    """``(N,)`` bool: the tokens (their character ``offsets`` ``(N, 2)`` in ``text``) whose
    first character other than a space lies outside the characters ``span`` of ``text``:
    a chat template's own tokens around the user's message."""
    starts = torch.tensor([first_visible(text, start, end) for start, end in offsets.tolist()], dtype=torch.long)
    return (starts < span[0]) | (starts >= span[1])


def first_visible(text: str, start: int, end: int) -> int:
    """The position of ``text[start:end]``'s first character other than a space (``start``
    where it has none)."""
    stripped = text[start:end].lstrip()
    return end - len(stripped) if stripped else start
