"""Captum's LLM interface over the attention attributions: text in, ``LLMAttributionResult`` out."""

from __future__ import annotations

import re
import string
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from captum.attr import ImageMaskInput, InterpretableInput, LLMAttributionResult, TextTemplateInput, TextTokenInput
from captum.attr._core.llm_attr import DEFAULT_GEN_ARGS, BaseLLMAttribution
from torch import Tensor

from .._compat import pretty_tokens
from ..capture.adapters.images import cross_attended_real, image_read_apart, image_token_layout
from ..capture.inputs import CHOSEN_END, forced_first_token, with_forced_token
from ..capture.record import warn_user
from ..capture.runner import resolve_adapter
from ._base import AttentionAttributionBase
from ._images import grid_follows_image

_OPEN, _CLOSE = "\ue000", "\ue001"
"""Private-use characters that mark one template value in the formatted prompt."""


class LLMAttentionAttribution(BaseLLMAttribution):
    r"""Explain what a causal language model or an encoder-decoder generated, with any
    attention attribution, through Captum's LLM interface.

    The same call and result as Captum's ``LLMAttribution`` and
    ``LLMGradientAttribution``: ``attribute(inp, target=None, gen_args=None)`` takes a
    ``TextTokenInput`` (each prompt token a feature) or a ``TextTemplateInput`` (each
    template value a feature: the sum of its tokens' scores) and returns an
    ``LLMAttributionResult`` whose ``plot_seq_attr()`` and ``plot_token_attr()`` work as
    Captum's.

    - ``seq_attr`` explains the answer's log-likelihood
      :math:`S = \sum_k \log p(t_k \mid \text{prompt}, t_{<k})` in one forward (and one
      backward for the gradient methods), through
      :meth:`~captum_attention.attr.AttentionAttributionBase.attribute_span`.
    - ``token_attr`` row k explains :math:`\log p(t_k \mid \text{prompt}, t_{<k})`, from
      the same single forward and one backward per token on its graph (none for rollout
      and raw attention), through
      :meth:`~captum_attention.attr.AttentionAttributionBase.attribute_continuation`.

    Unlike Captum's gradient wrapper, the model receives the attention mask, and no token
    costs a forward of its own. For an encoder-decoder (T5, BART, ...) the prompt is the
    source, the answer is what the decoder generates after its start token, and the
    scores are the source tokens' (Captum's own LLM classes are decoder-only).

    A vision-language model takes Captum's ``ImageMaskInput`` (its ``processor_fn`` makes
    the model's inputs from the image): the features are the image's segments, and each
    segment's score is the sum over the image's tokens of the token's score times the
    share of its patch's pixels in the segment (the tokens placed on their grid by
    :func:`~captum_attention.image_scores`; the grid taken to cover the whole image, as
    processors that resize without cropping make it, which is checked: a grid whose
    shape does not follow the image's is refused), so that the result compares with
    Captum's ``LLMAttribution(FeatureAblation(...))`` on the same input and its
    ``plot_image_heatmap()`` draws it.

    Args:
        attr_method (AttentionAttributionBase): an attention attribution built on the
            language model itself (``GradSAM(model)``, ``AttnLRP(model)``, ...).
        tokenizer: the model's tokenizer (a fast one, for ``TextTemplateInput``, which
            maps tokens to values by their character offsets).

    Example::

        >>> from captum.attr import TextTokenInput
        >>> llm_attr = LLMAttentionAttribution(AttnLRP(model), tokenizer)
        >>> result = llm_attr.attribute(TextTokenInput(prompt, tokenizer), gen_args={"max_new_tokens": 8})
        >>> result.seq_attr      # (prompt tokens,): the whole answer
        >>> result.token_attr    # (answer tokens, prompt tokens)
        >>> result.plot_token_attr()
    """

    SUPPORTED_METHODS = (AttentionAttributionBase,)
    SUPPORTED_INPUTS = (TextTokenInput, TextTemplateInput, ImageMaskInput)

    def __init__(self, attr_method: AttentionAttributionBase, tokenizer: Any) -> None:
        if not isinstance(attr_method, AttentionAttributionBase):
            raise TypeError(
                f"LLMAttentionAttribution wraps an attention attribution (GradSAM(model), AttnLRP(model), "
                f"...), got {type(attr_method).__name__}; for Captum's own methods use captum.attr.LLMAttribution."
            )
        super().__init__(attr_method, tokenizer)
        self.attr_method = attr_method
        self.model = attr_method.model  # the language model, also where forward_func wraps it
        self.device = next(self.model.parameters()).device

    def attribute(  # type: ignore[override]
        self,
        inp: InterpretableInput,
        target: str | Tensor | None = None,
        gen_args: dict[str, Any] | None = None,
        per_token: bool = True,
        **kwargs: Any,
    ) -> LLMAttributionResult:
        """Attribute the answer to the prompt's features.

        Args:
            inp (TextTokenInput or TextTemplateInput): the prompt.
            target (str or Tensor, optional): the answer, as text (tokenized without
                special tokens) or token ids; None generates it with ``gen_args``
                (Captum's defaults: 25 new tokens, greedy). Default: None.
            gen_args (dict, optional): ``model.generate`` arguments when ``target`` is
                None. Default: None.
            per_token (bool, optional): also compute ``token_attr`` (one backward per
                answer token for the gradient methods). Default: True.
            **kwargs: the attribution's own ``attribute`` options (``head_fusion``,
                ``axis``, ...).

        Returns:
            ``LLMAttributionResult`` with ``seq_attr`` ``(features,)``, ``token_attr``
            ``(answer tokens, features)`` (None with ``per_token=False``), the features'
            ``input_tokens`` and the answer's ``output_tokens``.
        """
        self.attr_method._check_options(kwargs, "attribute")
        if kwargs.get("through_vision_tower"):
            raise ValueError(
                "through_vision_tower gives relevance per pixel, which an LLMAttributionResult has no place for: "
                "call AttnLRP(model).attribute_span(input_ids, answer, additional_forward_args=(mask, image_inputs), "
                "through_vision_tower=True)."
            )
        prompt, mask, image_inputs = self._prompt(inp)
        answer = self._answer(inp, target, gen_args)
        features = _FeatureMap(inp, self.tokenizer, prompt, self.model, image_inputs)
        args = (mask, image_inputs) if image_inputs else (mask,)
        span = prompt_side(self.attr_method.attribute_span(prompt, answer[None], additional_forward_args=args, **kwargs))
        token_attr = None
        if per_token:
            rows = prompt_side(self.attr_method.attribute_continuation(
                prompt, answer[None], additional_forward_args=args, log_prob=True, **kwargs
            ))
            token_attr = features.scores(rows[0])
        return LLMAttributionResult(
            seq_attr=features.scores(span)[0],
            token_attr=token_attr,
            input_tokens=list(inp.values),
            output_tokens=pretty_tokens(answer.cpu(), self.tokenizer),
            inp=inp,
        )

    def target_tokens(
        self, inp: InterpretableInput, target: str | Tensor | None = None, gen_args: dict[str, Any] | None = None
    ) -> Tensor:
        """The answer's ``(tokens,)`` ids as :meth:`attribute` explains it: ``target``
        tokenized without special tokens, or generated with ``gen_args`` (Captum's own
        target handling); a clear error for an empty one."""
        self._prompt(inp)
        return self._answer(inp, target, gen_args)

    def _prompt(self, inp: InterpretableInput) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """The prompt's ``(1, tokens)`` ids, its attention mask and a vision-language
        model's image inputs by name (empty for text), or a clear error for an input, a
        model or a prompt this class does not explain (before anything is generated)."""
        if not isinstance(inp, self.SUPPORTED_INPUTS):
            raise TypeError(
                "LLMAttentionAttribution takes a TextTokenInput, a TextTemplateInput or an ImageMaskInput, got "
                f"{type(inp).__name__}."
            )
        model_input = {
            name: value.to(self.device) if isinstance(value, Tensor) else value
            for name, value in self._format_model_input(inp.to_model_input()).items()
        }
        prompt = model_input.pop("input_ids")
        if prompt.shape[1] == 0:
            raise ValueError("The prompt has no tokens: give a non-empty prompt (or a tokenizer that adds a BOS token).")
        if prompt.shape[0] != 1:
            raise ValueError(f"The input makes {prompt.shape[0]} prompts; LLMAttentionAttribution explains one.")
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is not None and prompt.shape[1] > 1 and prompt[0, :2].tolist() == [bos, bos]:
            warn_user(
                "The prompt begins with two BOS tokens: its text begins with the BOS token's (a chat template's) and the "
                "tokenizer adds another. Give the text without it, e.g. TextTokenInput(text.removeprefix(tokenizer.bos_token), "
                "tokenizer), to explain what the model reads from its template."
            )
        mask = model_input.pop("attention_mask", None)
        return prompt, torch.ones_like(prompt) if mask is None else mask, model_input

    def _answer(self, inp: InterpretableInput, target: str | Tensor | None, gen_args: dict[str, Any] | None) -> Tensor:
        """The answer's ids (see :meth:`target_tokens`), once the prompt is checked."""
        if target is not None:
            answer = self._get_target_tokens(inp, target, gen_args).flatten().to(self.device)
            answer = with_forced_token(self.model, answer) if isinstance(target, str) else answer
        else:
            chosen = {**CHOSEN_END, **(gen_args or DEFAULT_GEN_ARGS)}  # the tokens the model chose, to the last
            if self._encoder_decoder:
                _warn_if_forced_by_gen_args(self.model, chosen)
                answer = self._generated_target(inp, chosen)
            else:
                answer = self._get_target_tokens(inp, None, chosen).flatten().to(self.device)
        if answer.numel() == 0:
            raise ValueError("The answer has no tokens: give a non-empty target, or generate at least one token.")
        return answer

    @property
    def _encoder_decoder(self) -> bool:
        return resolve_adapter(self.model, self.attr_method.adapter).is_encoder_decoder(self.model)

    def _generated_target(self, inp: InterpretableInput, gen_args: dict[str, Any]) -> Tensor:
        """An encoder-decoder's ``gen_args`` answer: what its decoder generated after its
        start token (Captum's generation reads a decoder's past the prompt)."""
        model_inp = self._format_model_input(inp.to_model_input())
        generated = self.model.generate(**model_inp, **gen_args)  # type: ignore[operator]
        return generated[0, 1:].to(self.device)


def _warn_if_forced_by_gen_args(model: Any, gen_args: dict[str, Any]) -> None:
    """A warning where ``gen_args`` force an encoder-decoder's first answer token (NLLB's
    target language, as its model card passes it) other than its generation config does:
    the spans read the config's (:func:`~captum_attention.capture.inputs.forced_first_token`),
    and would explain that token as the model's choice."""
    forced = gen_args.get("forced_bos_token_id")
    if forced is not None and forced != forced_first_token(model):
        warn_user(
            f"gen_args force the answer's first token ({forced}), which the model does not choose, and which is then "
            "explained as its first: set model.generation_config.forced_bos_token_id = "
            f"{forced} instead, and it is read, not explained."
        )


class _FeatureMap:
    """How the prompt's tokens make up the input's features: ``(tokens, features)``
    weights, so that ``scores @ weights`` sums each feature's tokens (a template value
    grouped by ``mask`` spread back to each value, as Captum's ``format_attr`` does; an
    image segment's share of each image token)."""

    def __init__(self, inp: InterpretableInput, tokenizer: Any, prompt: Tensor, model: Any, image_inputs: dict[str, Any]) -> None:
        self.inp = inp
        if isinstance(inp, TextTokenInput):
            kept = torch.ones(prompt.shape[1], dtype=torch.bool) if inp.itp_mask is None else inp.itp_mask[0].cpu().bool()
            self.weights = torch.zeros(prompt.shape[1], inp.n_itp_features, dtype=torch.float32)
            self.weights[kept.nonzero().flatten(), torch.arange(int(kept.sum()))] = 1.0
        elif isinstance(inp, ImageMaskInput):
            self.weights = _segment_weights(inp, model, prompt, image_inputs)
        else:
            self.weights = _template_weights(inp, tokenizer, prompt)

    def scores(self, token_scores: Tensor) -> Tensor:
        """``(rows, features)`` from ``(rows, tokens)`` (the prompt's first, the answer's
        after them unread)."""
        summed = token_scores[..., : len(self.weights)].detach().float().cpu() @ self.weights
        return self.inp.format_attr(summed) if isinstance(self.inp, TextTemplateInput) else summed


def _segment_weights(inp: ImageMaskInput, model: Any, prompt: Tensor, image_inputs: dict[str, Any]) -> Tensor:
    """``(tokens, segments)``: each image token's patch, the cell of its grid laid over
    the whole image, shared among the segments by the fraction of its pixels each holds;
    for a model that reads its image apart from its tokens ``(image states, segments)``
    (Mllama's tiles' patches in their place, BLIP's states, GIT's features)."""
    (images,) = image_token_layout(model, prompt.cpu(), image_inputs)
    read = cross_attended_real(model.config, image_inputs).shape[1] if image_read_apart(model) else prompt.shape[1]
    grid = images[0].grid if len(images) == 1 else None
    if grid is None:
        raise ValueError(
            f"An ImageMaskInput's image must reach the language model as one grid of tokens; {type(model).__name__}'s "
            f"prompt holds {len(images)} image(s){' of unknown layout' if len(images) == 1 else ''}."
        )
    image = images[0]
    rows, columns = grid
    width, height = inp.image.size
    if not grid_follows_image(grid, inp.image.size):
        raise ValueError(
            f"The image tokens' {rows}×{columns} grid does not follow the {height}×{width} image's shape: its processor "
            "crops or pads it, and the grid's cells cannot be placed on the image's segments."
        )
    masks = torch.stack([mask.float() for mask in inp.get_mask_list()])[:, None]
    shares = F.adaptive_avg_pool2d(masks, (rows, columns)).reshape(len(masks), rows * columns)
    weights = torch.zeros(read, len(masks), dtype=torch.float32)  # over the prompt's tokens, or the image states read apart
    weights[image.grid_positions.cpu()] = shares.t()
    return weights


def prompt_side(scores: Tensor | tuple[Tensor, Tensor]) -> Tensor:
    """A decoder's scores, or an encoder-decoder's source scores (its prompt); the scores
    of the image a model reads apart from its tokens (Mllama's states, GIT's features),
    where its prompt's image is read."""
    return scores[0] if isinstance(scores, tuple) else scores


def _template_weights(inp: TextTemplateInput, tokenizer: Any, prompt: Tensor) -> Tensor:
    """``(tokens, interpretable features)``: each prompt token's share of each template
    value, from the tokens' character offsets and every place each value takes in the
    text. A token inside one value belongs to it wholly (1); a token that two values share
    (adjacent values that tokenize together) is split between them by the characters each
    holds, with a warning; template text and special tokens belong to none."""
    text = inp.to_model_input()
    spans = _value_spans(inp, text)
    try:
        encoding = tokenizer(text, return_offsets_mapping=True)
    except NotImplementedError as error:  # slow tokenizers have no offsets
        raise TypeError(
            "A TextTemplateInput needs a fast tokenizer (character offsets map tokens to values); "
            "use a PreTrainedTokenizerFast, or a TextTokenInput."
        ) from error
    if list(encoding["input_ids"]) != prompt[0].tolist():
        raise ValueError("The tokenizer's offsets do not describe the prompt's tokens; use a TextTokenInput.")
    grouped = getattr(inp, "formatted_mask", None)
    weights = torch.zeros(prompt.shape[1], inp.n_itp_features, dtype=torch.float32)
    for token, (start, end) in enumerate(encoding["offset_mapping"]):
        for (begin, stop), value in spans:
            overlap = min(end, stop) - max(start, begin)
            if overlap > 0:
                weights[token, value if grouped is None else grouped[value]] += overlap
    shared = (weights > 0).sum(dim=1) > 1
    if bool(shared.any()):
        token = int(shared.nonzero()[0])
        sharing = [repr(inp.values[v]) for v in range(inp.n_features) if weights[token, v if grouped is None else grouped[v]] > 0]
        warnings.warn(
            f"Template values {', '.join(sharing)} share the token {text[slice(*encoding['offset_mapping'][token])]!r}: "
            "its score is split between them by the characters each holds. Put a space between "
            "the values to score them apart.",
            stacklevel=4,
        )
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=1)


def _value_spans(inp: TextTemplateInput, text: str) -> list[tuple[tuple[int, int], int]]:
    """``((start, end), value index)`` for every place a template value takes in the
    formatted ``text``: a value the template places twice has two."""
    template = inp.template
    if isinstance(template, str):
        return _fields(template, inp, text)
    return _marked(inp, text)


def _fields(template: str, inp: TextTemplateInput, text: str) -> list[tuple[tuple[int, int], int]]:
    """The spans of a format string's replacement fields, each formatted as ``str.format``
    formats it (conversions and format specs included)."""
    formatter = string.Formatter()
    values = list(inp.values)
    named = dict(zip(inp.dict_keys, values))
    spans, position, auto = [], 0, 0
    for literal, field, spec, conversion in formatter.parse(template):
        position += len(literal)
        if field is None:
            continue
        if field == "" or field[0] in ".[":
            field, auto = f"{auto}{field}", auto + 1
        obj, key = formatter.get_field(field, values, named)
        piece = formatter.format_field(formatter.convert_field(obj, conversion), formatter.format(spec or "", *values, **named))
        index = inp.dict_keys.index(key) if isinstance(key, str) else key
        spans.append(((position, position + len(piece)), index))
        position += len(piece)
    return spans


def _marked(inp: TextTemplateInput, text: str) -> list[tuple[tuple[int, int], int]]:
    """The spans of each value where a template function places it, found by marking
    one value at a time with private-use characters."""
    spans = []
    for index in range(inp.n_features):
        values: list[Any] = list(inp.values)
        values[index] = f"{_OPEN}{values[index]}{_CLOSE}"
        marked = inp.format_fn(**dict(zip(inp.dict_keys, values))) if inp.dict_keys else inp.format_fn(*values)
        matches = list(re.finditer(f"{_OPEN}(.*?){_CLOSE}", marked, flags=re.DOTALL))
        verbatim = all(match.group(1) == str(inp.values[index]) for match in matches)
        if marked.replace(_OPEN, "").replace(_CLOSE, "") != text or len(matches) != marked.count(_OPEN) or not verbatim:
            raise ValueError(
                f"The template function changes value {index} ({inp.values[index]!r}) as it places it (it is "
                "not inserted as a string as it is), so its tokens cannot be found: format the values "
                "unchanged (a format string such as '{} is {}' may pad and convert them), or use a TextTokenInput."
            )
        removed = 0
        for match in matches:
            start = match.start() - removed
            spans.append(((start, start + len(match.group(1))), index))
            removed += 2
    return spans
