"""Explain a causal language model's answer to one prompt with every method, through
Captum's LLM interface."""

from __future__ import annotations

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


def explain_answer(
    model: Any,
    tokenizer: Any,
    prompt: str,
    target: str | None = None,
    max_new_tokens: int = 20,
    methods: list[str] | None = None,
    per_token: bool = False,
    ig_steps: int = 50,
) -> AnswerExplanation:
    """Generate (greedy) or take the answer to ``prompt``, then explain it with each method
    (registry names; ``integrated_gradients`` runs Captum's
    ``LLMGradientAttribution(LayerIntegratedGradients)``). Default: the registered methods.
    """
    inp = TextTokenInput(prompt, tokenizer)
    gen_args = None if target is not None else {"max_new_tokens": max_new_tokens, "do_sample": False}
    answer_ids = _answer(model, tokenizer, inp, target, gen_args)
    prompt_ids = inp.to_model_input()[0]
    special_ids = set(tokenizer.all_special_ids)
    result = None
    explanation = AnswerExplanation(
        prompt_tokens=list(inp.values), special=[int(i) in special_ids for i in prompt_ids.tolist()],
        answer_tokens=[], answer=tokenizer.decode(answer_ids), generated=target is None,
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


def _answer(model: Any, tokenizer: Any, inp: TextTokenInput, target: str | None, gen_args: dict[str, Any] | None) -> torch.Tensor:
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
