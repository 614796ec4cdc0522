"""Captum's LLM interface over the attention attributions: text in, ``LLMAttributionResult`` out."""

from __future__ import annotations

from typing import Any

import torch
from captum.attr import InterpretableInput, LLMAttributionResult, TextTemplateInput, TextTokenInput
from captum.attr._core.llm_attr import BaseLLMAttribution
from torch import Tensor

from .._compat import pretty_tokens
from ._base import AttentionAttributionBase

_OPEN, _CLOSE = "\ue000", "\ue001"
"""Private-use characters that mark one template value in the formatted prompt."""


class LLMAttentionAttribution(BaseLLMAttribution):
    r"""Explain what a causal language model generated, with any attention attribution,
    through Captum's LLM interface.

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
    costs a forward of its own.

    Args:
        attr_method (AttentionAttributionBase): an attention attribution built on the
            causal language model itself (``GradSAM(model)``, ``AttnLRP(model)``, ...).
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
    SUPPORTED_INPUTS = (TextTokenInput, TextTemplateInput)

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
        answer = self.target_tokens(inp, target, gen_args)
        prompt = self._format_model_input(inp.to_model_input())["input_ids"].to(self.device)
        args = (torch.ones_like(prompt),)
        prompt_len = prompt.shape[1]
        span = self.attr_method.attribute_span(prompt, answer[None], additional_forward_args=args, **kwargs)
        features = _FeatureMap(inp, self.tokenizer, prompt)
        token_attr = None
        if per_token:
            rows = self.attr_method.attribute_continuation(
                prompt, answer[None], additional_forward_args=args, log_prob=True, **kwargs
            )
            token_attr = features.scores(rows[0, :, :prompt_len])
        return LLMAttributionResult(
            seq_attr=features.scores(span[:, :prompt_len])[0],
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
        if not isinstance(inp, self.SUPPORTED_INPUTS):
            raise TypeError(
                f"LLMAttentionAttribution takes a TextTokenInput or a TextTemplateInput, got {type(inp).__name__}."
            )
        answer = self._get_target_tokens(inp, target, gen_args).flatten().to(self.device)
        if answer.numel() == 0:
            raise ValueError("The answer has no tokens: give a non-empty target, or generate at least one token.")
        return answer


class _FeatureMap:
    """How the prompt's tokens make up the input's features: ``(tokens, features)``
    weights, so that ``scores @ weights`` sums each feature's tokens (a template value
    grouped by ``mask`` spread back to each value, as Captum's ``format_attr`` does)."""

    def __init__(self, inp: InterpretableInput, tokenizer: Any, prompt: Tensor) -> None:
        self.inp = inp
        if isinstance(inp, TextTokenInput):
            kept = torch.ones(prompt.shape[1], dtype=torch.bool) if inp.itp_mask is None else inp.itp_mask[0].cpu().bool()
            feature = torch.full((prompt.shape[1],), -1, dtype=torch.long)
            feature[kept] = torch.arange(int(kept.sum()))
        else:
            feature = _template_features(inp, tokenizer, prompt)
        count = inp.n_itp_features
        self.weights = torch.zeros(prompt.shape[1], count)
        used = feature >= 0
        self.weights[used.nonzero().flatten(), feature[used]] = 1.0

    def scores(self, token_scores: Tensor) -> Tensor:
        """``(rows, features)`` from ``(rows, tokens)``."""
        summed = token_scores.detach().float().cpu() @ self.weights
        return self.inp.format_attr(summed) if isinstance(self.inp, TextTemplateInput) else summed


def _template_features(inp: TextTemplateInput, tokenizer: Any, prompt: Tensor) -> Tensor:
    """``(tokens,)`` the interpretable feature of each prompt token (-1: template text and
    special tokens), from the tokens' character offsets and each value's span in the text."""
    text = inp.to_model_input()
    spans = [_value_span(inp, index, text) for index in range(inp.n_features)]
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
    feature = torch.full((prompt.shape[1],), -1, dtype=torch.long)
    for token, (start, end) in enumerate(encoding["offset_mapping"]):
        overlaps = [min(end, stop) - max(start, begin) for begin, stop in spans]
        best = max(range(len(spans)), key=overlaps.__getitem__, default=None)
        if end > start and best is not None and overlaps[best] > 0:
            feature[token] = best if grouped is None else grouped[best]
    return feature


def _value_span(inp: TextTemplateInput, index: int, text: str) -> tuple[int, int]:
    """The characters of template value ``index`` in the formatted ``text``."""
    values = list(inp.values)
    values[index] = _OPEN + values[index] + _CLOSE
    marked = inp.format_fn(**dict(zip(inp.dict_keys, values))) if inp.dict_keys else inp.format_fn(*values)
    start, close = marked.find(_OPEN), marked.find(_CLOSE)
    if start < 0 or close < start or marked.replace(_OPEN, "").replace(_CLOSE, "") != text:
        raise ValueError(
            f"The template does not place value {index} ({inp.values[index]!r}) verbatim in the prompt, so its "
            "tokens cannot be found: use a template that inserts values as they are, or a TextTokenInput."
        )
    return start, close - len(_OPEN)
