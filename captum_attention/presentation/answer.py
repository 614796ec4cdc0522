"""Explain a causal language model's answer to one prompt with every method, through
Captum's LLM interface."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from captum.attr import LayerIntegratedGradients, LLMGradientAttribution, TextTokenInput

from ..attr import METHODS, LLMAttentionAttribution
from .explain import INTEGRATED_GRADIENTS, MethodInfo


@dataclass
class AnswerExplanation:
    """What the report of one answer shows.

    Attributes:
        prompt_tokens: the prompt's tokens (the features).
        special: per prompt token, whether it is a special token (left out of the scale).
        answer_tokens: the answer's tokens, as Captum shows them.
        answer: the answer's text.
        generated: whether the model generated the answer (else it was given).
        seq_attr: method -> score of each prompt token for the whole answer.
        token_attr: method -> one row of prompt-token scores per answer token (empty
            without ``per_token``).
        seconds: method -> wall time.
        methods: method -> how to read its scores.
        skipped: the prompt tokens left out of the features (``skip``), in order.
        warnings: what the reader should know about the answer (a generation cut at its
            token limit).
    """

    prompt_tokens: list[str]
    special: list[bool]
    answer_tokens: list[str]
    answer: str
    generated: bool
    seq_attr: dict[str, list[float]] = field(default_factory=dict)
    token_attr: dict[str, list[list[float]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def explain_answer(
    model: Any,
    tokenizer: Any,
    prompt: str,
    target: str | None = None,
    max_new_tokens: int = 20,
    methods: list[str] | None = None,
    per_token: bool = False,
    ig_steps: int = 50,
    skip: str | None = None,
) -> AnswerExplanation:
    """Generate (greedy) or take the answer to ``prompt``, then explain it with each method
    (registry names; ``integrated_gradients`` runs Captum's
    ``LLMGradientAttribution(LayerIntegratedGradients)``). Default: the registered methods.
    ``skip``: a regular expression; the prompt tokens it matches in full are left out of
    the features, as Captum's ``skip_tokens`` leaves them out.
    """
    tokens = TextTokenInput(prompt, tokenizer).values
    skipped = [t for t in tokens if skip is not None and re.fullmatch(skip, t)]
    inp = TextTokenInput(prompt, tokenizer, skip_tokens=sorted(set(skipped)) or None)
    gen_args = None if target is not None else {"max_new_tokens": max_new_tokens, "do_sample": False}
    answer_ids = target_ids(model, tokenizer, inp, target, gen_args)
    special_ids = set(tokenizer.all_special_ids)
    result = None
    explanation = AnswerExplanation(
        prompt_tokens=list(inp.values), special=[int(i) in special_ids for i in inp.itp_tensor[0].tolist()],
        answer_tokens=[], answer=tokenizer.decode(answer_ids), generated=target is None, skipped=skipped,
        warnings=_cut_warning(tokenizer, answer_ids, max_new_tokens) if target is None else [],
    )
    for name in methods or list(METHODS):
        wrapper, info = _wrapper(model, tokenizer, name)
        start = time.perf_counter()
        if name == INTEGRATED_GRADIENTS:
            result = wrapper.attribute(inp, target=answer_ids, n_steps=ig_steps)
        else:
            result = wrapper.attribute(inp, target=answer_ids, per_token=per_token)
        display = _display(name)
        explanation.seconds[display] = time.perf_counter() - start
        explanation.methods[display] = info
        explanation.seq_attr[display] = result.seq_attr.float().tolist()
        if per_token and result.token_attr is not None:
            explanation.token_attr[display] = result.token_attr.float().tolist()
    if result is not None:
        explanation.answer_tokens = list(result.output_tokens)
    return explanation


def _cut_warning(tokenizer: Any, answer_ids: torch.Tensor, max_new_tokens: int) -> list[str]:
    """A warning where generation stopped at ``max_new_tokens`` with no end token: the
    answer may run on past what the model meant to say, and the explanation covers it all."""
    if len(answer_ids) < max_new_tokens or tokenizer.eos_token_id in answer_ids.tolist():
        return []
    return [
        f"the answer stopped at --max-new-tokens ({max_new_tokens}) without an end token: it may go on past the "
        "model's real answer, and the whole-answer scores explain all of it; give --target, or a smaller --max-new-tokens"
    ]


def target_ids(model: Any, tokenizer: Any, inp: TextTokenInput, target: str | None, gen_args: dict[str, Any] | None) -> torch.Tensor:
    """The answer's token ids: ``target`` tokenized without special tokens, or the greedy
    generation (Captum's own target handling)."""
    return LLMAttentionAttribution(METHODS["raw"](model), tokenizer).target_tokens(inp, target, gen_args)


def _display(name: str) -> str:
    return "Integrated Gradients" if name == INTEGRATED_GRADIENTS else METHODS[name].get_name()


def _wrapper(model: Any, tokenizer: Any, name: str) -> tuple[Any, MethodInfo]:
    """The LLM attribution of method ``name`` and how to read it (every score explains the
    answer's log-probability, so each uses the target)."""
    if name == INTEGRATED_GRADIENTS:
        layer = LayerIntegratedGradients(model, model.get_input_embeddings())
        return LLMGradientAttribution(layer, tokenizer), MethodInfo(uses_target=True, signed=True)
    cls = METHODS[name]
    return LLMAttentionAttribution(cls(model), tokenizer), MethodInfo(uses_target=cls.spec.uses_target, signed=cls.spec.signed)
