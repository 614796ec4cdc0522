"""
Explaining a language model's answer
====================================

A tiny Llama reads a long context of filler words that holds eight key-value pairs
(``k3=v7``, one token each), then a question, ``? k3``, and answers with the value,
``v7``. The answer rests on one token of the context, the asked key's pair: the needle.
We explain the answer through Captum's LLM interface, compare the whole answer with its
tokens, find the needle in a long prompt, score the attributions with the context
metrics, and time Captum's own LLM attributions on the same prompt. The model has no
position encoding, so the lookup it learned on contexts of up to 2,048 tokens holds far
beyond them; its weights ship with the package.
"""

# %%
# The model and its task
# ----------------------
import time

import matplotlib.pyplot as plt
import torch
from captum.attr import (
    FeatureAblation,
    LayerIntegratedGradients,
    LLMAttribution,
    LLMGradientAttribution,
    TextTokenInput,
)

from captum_attention import METHODS, AttnLRP, GradSAM, KnockoutGradient, KnockoutLRP, LLMAttentionAttribution
from captum_attention.demo.needle import (
    WORDS,
    load_needle_model,
    needle_accuracy,
    needle_example,
    needle_tokenizer,
)
from captum_attention.metrics import leave_one_out_estimates, linear_datamodeling_score, top_k_log_prob_drop

model = load_needle_model()
tokenizer = needle_tokenizer()


def text(example):
    """The prompt as words (the tokenizer adds BOS back)."""
    return " ".join(WORDS[i] for i in example.input_ids[1:].tolist())


generator = torch.Generator().manual_seed(8)
for length in (64, 4096):
    examples = [needle_example(length, generator) for _ in range(16)]
    print(f"{length} tokens: the model answers {needle_accuracy(model, examples):.0%} of 16 contexts")

example = needle_example(16, generator)
print(text(example), "->", WORDS[example.answer])

# %%
# Captum's LLM interface
# ----------------------
# ``LLMAttentionAttribution`` wraps any of the methods with the call and the result of
# Captum's ``LLMAttribution``: a ``TextTokenInput``, a target (text or ids; None
# generates), and an ``LLMAttributionResult`` whose plots are Captum's. ``seq_attr``
# explains the answer's log-probability; each prompt token is a feature.
llm_attr = LLMAttentionAttribution(AttnLRP(model), tokenizer)
inp = TextTokenInput(text(example), tokenizer)
result = llm_attr.attribute(inp, target=WORDS[example.answer])
top = int(result.seq_attr[1:].argmax()) + 1  # BOS aside
print("AttnLRP's top prompt token:", result.input_tokens[top])
assert top == example.needle_position, "AttnLRP points at the needle"
fig, ax = result.plot_seq_attr()
fig.set_size_inches(10, 3.2)
plt.setp(ax.get_xticklabels(), rotation=-60)  # every prompt token's label on top, none over the next
fig.tight_layout()

# %%
# A longer answer, token by token: ``token_attr`` has one row per answer token, from one
# forward and one backward per token. Here the target goes on past the value (any text
# can be explained); only its first token rests on the needle.
result = llm_attr.attribute(inp, target=f"{WORDS[example.answer]} ? k0")
print(result.output_tokens, tuple(result.token_attr.shape))
fig, ax = result.plot_token_attr()
fig.set_size_inches(12, 3.8)
for value in ax.texts:  # Captum writes every cell's value to four decimals
    value.set_fontsize(7)
plt.setp(ax.get_xticklabels(), rotation=-60)
fig.tight_layout()

# %%
# The whole answer and its tokens
# -------------------------------
# ``seq_attr`` explains the sum of the answer tokens' log-probabilities in one pass.
# AttnLRP is linear in the output's gradient (rollout and raw attention in the explained
# rows), so its whole-answer scores are exactly the sum of its token rows; Grad-SAM's
# ReLU makes its whole answer a different question.
for method in (AttnLRP(model), GradSAM(model)):
    whole = LLMAttentionAttribution(method, tokenizer).attribute(inp, target=f"{WORDS[example.answer]} ? k0")
    gap = float((whole.seq_attr - whole.token_attr.sum(dim=0)).abs().max() / whole.seq_attr.abs().max())
    print(f"{type(method).__name__}: whole answer vs sum of token rows, largest relative gap {gap:.1e}")
    if isinstance(method, AttnLRP):
        assert gap < 1e-4

# %%
# The needle in a long prompt
# ---------------------------
# 4,096 tokens, streaming capture: no ``(heads, N, N)`` tensor is ever alive. Each method's
# top segment (a pair, or a run of up to 32 filler words) against the needle, on the
# contexts the model answers correctly.
long_examples = [needle_example(4096, generator) for _ in range(6)]
long_examples = [e for e in long_examples if needle_accuracy(model, [e]) == 1.0]
found, seconds = {}, {}
for name, cls in METHODS.items():
    explainer = cls(model)
    hits, started = 0, time.perf_counter()
    for e in long_examples:
        prompt = e.input_ids[None]
        span = explainer.attribute_span(prompt, torch.tensor([[e.answer]]), additional_forward_args=(torch.ones_like(prompt),))
        per_segment = torch.zeros(int(e.segments.max()) + 1).index_add_(0, e.segments.clamp(min=0), span[0, :-1] * (e.segments >= 0))
        hits += int(per_segment.argmax()) == e.needle
    found[name], seconds[name] = hits / len(long_examples), (time.perf_counter() - started) / len(long_examples)
    print(f"{cls.get_name():>24}: needle found in {found[name]:.0%}, {seconds[name]:.2f} s per answer")
assert found["attn_lrp"] == 1.0

# %%
# Which attribution does the answer rest on?
# ------------------------------------------
# The context metrics remove segments and watch the answer's log-probability: the drop
# when the top segment goes, and ContextCite's linear datamodeling score (Spearman's ρ
# between the attribution's prediction and the actual log-probability over 32 random
# half ablations). The last bars: each segment's leave-one-out effect estimated for two
# passes and three forwards, KnockoutGradient's first-order effects with the two segments
# AttnLRP ranks highest deleted exactly (``leave_one_out_estimates``), which on the
# benchmark of :doc:`/language_models` reaches Feature Ablation's LDS at a fraction of its
# forwards; and the same first-order effects with AttnLRP's relevance at its top token in
# place of any deletion (``KnockoutLRP``, two passes).
scored = [needle_example(512, generator) for _ in range(6)]
scored = [e for e in scored if needle_accuracy(model, [e]) == 1.0]
prompts = torch.stack([e.input_ids for e in scored])
answers = torch.tensor([[e.answer] for e in scored])
segments = torch.stack([e.segments for e in scored])
mask = torch.ones_like(prompts)
spans = {name: cls(model).attribute_span(prompts, answers, additional_forward_args=(mask,))[:, :-1] for name, cls in METHODS.items()}
first_order = KnockoutGradient(model).attribute_span(prompts, answers, additional_forward_args=(mask,))[:, :-1]
spans["estimates"] = leave_one_out_estimates(model, prompts, mask, answers, first_order, spans["attn_lrp"], segments)
spans["knockout_lrp"] = KnockoutLRP(model).attribute_span(prompts, answers, additional_forward_args=(mask,))[:, :-1]
drops, lds = {}, {}
for name, scores in spans.items():
    drops[name] = float(top_k_log_prob_drop(model, prompts, mask, answers, scores, ks=(1,), segments=segments).mean())
    lds[name] = float(linear_datamodeling_score(model, prompts, mask, answers, scores, segments).nanmean())
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3))
names = [METHODS[n].get_name() for n in METHODS] + ["leave-one-out estimates", KnockoutLRP.get_name()]
left.barh(names, list(drops.values()))
left.set_xlabel("log-probability drop, top segment removed")
right.barh(names, list(lds.values()))
right.set_xlabel("LDS")
fig.tight_layout()
assert drops["attn_lrp"] == max(drops[name] for name in METHODS)
print({name: round(value, 2) for name, value in lds.items()})

# %%
# Captum's own LLM attributions, same prompt
# ------------------------------------------
# ``LLMAttribution(FeatureAblation)`` runs one forward per prompt token and
# ``LLMGradientAttribution(LayerIntegratedGradients)`` 50 forwards and backwards per answer
# token; ours one forward and one backward for the whole answer (its time the best of five
# calls, a few hundredths of a second that one busy moment of the machine could double).
e = scored[0]
inp = TextTokenInput(text(e), tokenizer)
costs = {}
for label, wrapper, options, calls in (
    ("AttnLRP (ours)", LLMAttentionAttribution(AttnLRP(model), tokenizer), {"per_token": False}, 5),
    # without its generation cache: with it, Captum 0.9 on transformers 5.24 reads every answer
    # token's log-probability after the first wrong
    ("FeatureAblation", LLMAttribution(FeatureAblation(model), tokenizer), {"use_cached_outputs": False}, 1),
    ("LayerIntegratedGradients", LLMGradientAttribution(LayerIntegratedGradients(model, model.get_input_embeddings()), tokenizer), {"n_steps": 50}, 1),
):
    costs[label] = float("inf")
    for _ in range(calls):
        started = time.perf_counter()
        peer = wrapper.attribute(inp, target=WORDS[e.answer], **options)
        costs[label] = min(costs[label], time.perf_counter() - started)
    print(f"{label:>26}: {costs[label]:.2f} s, top token {peer.input_tokens[int(peer.seq_attr[1:].argmax()) + 1]}")
assert costs["AttnLRP (ours)"] * 10 < min(costs["FeatureAblation"], costs["LayerIntegratedGradients"])
