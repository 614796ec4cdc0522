"""
Faithfulness of any attribution
===============================

Does an attribution rank the tokens the prediction rests on first? Remove them and watch
the model. These metrics take any ``(batch, tokens)`` scores: the four attention methods,
AttnLRP (as it is and with the words at a low presence), Captum's Integrated Gradients,
SHAP values, a random ranking. On the default
sentiment model and 32 held-out sentences:

- **comprehensiveness** (DeYoung et al., ERASER, ACL 2020): p(y|x) − p(y|x without the top
  k% tokens); high is faithful;
- **sufficiency**: p(y|x) − p(y|only the top k% tokens); low is faithful;
- **AOPC**: each averaged over k = 1, 5, 10, 20, 50%;
- **deletion curves** (Chefer et al.'s positive perturbation test): the probability of the
  predicted class as 10%, 20%, ... of the tokens are replaced by ``[PAD]`` most relevant
  first; the faster it falls, the better.
"""

# %%
# Nine attributions of the same predictions
# -----------------------------------------
import time

import matplotlib.pyplot as plt
import torch
from captum.attr import LayerIntegratedGradients

from captum_attention import METHODS, AttnLRP, load_default_model, special_tokens
from captum_attention.demo import generate
from captum_attention.metrics import (
    aopc,
    comprehensiveness,
    perturbation_curve,
    random_ranking,
    sufficiency,
)
from captum_attention.presentation.shap_text import shap_token_values

model, tokenizer = load_default_model(progress=False)
texts = [e.text for e in generate("heldout", 32, seed=5)]
batch = tokenizer(texts, padding=True, return_tensors="pt")
ids, mask = batch.input_ids, batch.attention_mask
special = special_tokens(ids, tokenizer)


def logits(input_ids, attention_mask):
    return model(input_ids, attention_mask=attention_mask).logits


with torch.no_grad():
    predicted = logits(ids, mask).argmax(-1)
args = dict(target=predicted, additional_forward_args=(mask,))

attributions, seconds = {}, {}
for name, cls in METHODS.items():
    start = time.perf_counter()
    attributions[cls.get_name()] = cls(model).attribute(ids, **args)
    seconds[cls.get_name()] = time.perf_counter() - start

start = time.perf_counter()
baseline = torch.where(special, ids, tokenizer.pad_token_id)
ig = LayerIntegratedGradients(logits, model.get_input_embeddings())  # the word embeddings, as the command line
attributions["Integrated Gradients"] = ig.attribute(
    ids, baselines=baseline, n_steps=32, **args
).sum(-1)
seconds["Integrated Gradients"] = time.perf_counter() - start

# %%
# AttnLRP can also explain the model with the words at a low presence in every attention
# call, the special tokens at 1 (its ``presence`` option): each word then counts nearly as
# it acts among few others, which is closer to what removing many of them at once asks
# than its part in the whole sentence.
start = time.perf_counter()
presence = torch.where(special | (mask == 0), 1.0, 0.05)
attributions["AttnLRP, presence 0.05"] = AttnLRP(model).attribute(ids, presence=presence, **args)
seconds["AttnLRP, presence 0.05"] = time.perf_counter() - start

# %%
# SHAP's Partition explainer masks the tokenizer's own tokens with a text masker;
# ``shap_token_values`` lines its values up with the model's tokens.
start = time.perf_counter()
attributions["SHAP (Partition)"] = shap_token_values(
    logits, tokenizer, texts, predicted, max_evals=200
)
seconds["SHAP (Partition)"] = time.perf_counter() - start
attributions["random"] = random_ranking(ids.shape, seed=0)
seconds["random"] = 0.0

# %%
# Comprehensiveness, sufficiency, AOPC
# ------------------------------------
# ``keep=special``: [CLS] and [SEP] are never removed. Removal deletes the tokens.
bins = [1, 5, 10, 20, 50]
results, aopcs = {}, {}
print(f"{'method':24} {'compr. AOPC':>11} {'suff. AOPC':>11} {'s / sentence':>12}")
for name, scores in attributions.items():
    common = dict(target=predicted, bins=bins, keep=special)
    comp = comprehensiveness(logits, ids, mask, scores, **common)
    suff = sufficiency(logits, ids, mask, scores, **common)
    results[name] = (comp.mean(0), suff.mean(0))
    aopcs[name] = (aopc(comp).mean().item(), aopc(suff).mean().item())
    comp_aopc, suff_aopc = aopcs[name]
    per_example = seconds[name] / len(ids)
    print(f"{name:24} {comp_aopc:11.3f} {suff_aopc:11.3f} {per_example:12.4f}")

fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
for name, (comp, suff) in results.items():
    style = "k--" if name == "random" else "-o"
    left.plot(bins, comp, style, label=name, markersize=3)
    right.plot(bins, suff, style, label=name, markersize=3)
left.set(
    xscale="log",
    xlabel="top k% of tokens removed",
    ylabel="comprehensiveness (higher is better)",
)
right.set(
    xscale="log", xlabel="top k% of tokens kept", ylabel="sufficiency (lower is better)"
)
left.legend(fontsize=7)
fig.tight_layout()

# %%
# Deletion curves
# ---------------
fig, ax = plt.subplots(figsize=(6, 4))
for name, scores in attributions.items():
    curve = perturbation_curve(
        logits, ids, mask, scores, target=predicted, keep=special
    )
    style = "k--" if name == "random" else "-"
    ax.plot(
        curve.fractions,
        curve.target_prob.mean(0),
        style,
        label=f"{name} (AUC {curve.auc_target_prob.mean():.2f})",
    )
ax.set(
    xlabel="fraction of tokens replaced by [PAD], most relevant first",
    ylabel="p(predicted class)",
)
ax.legend(fontsize=7)
fig.tight_layout()

# %%
# Every method beats the random ranking on both scores (checked below on every build).
# SHAP is the most comprehensive here and Grad-SAM the best of the attention methods, at
# a hundredth of SHAP's cost: the attention methods take one forward (rollout, raw
# attention) or one forward and backward (Grad-SAM, Transformer Attribution) per batch,
# as does AttnLRP, which propagates relevance through the whole model; Integrated
# Gradients takes 32 and SHAP 200 model evaluations per sentence. The words at a low
# presence make AttnLRP more comprehensive at the same cost (on the benchmark's
# sentences, and by LDS, the most faithful one-pass method: :doc:`/which_method`).
for name, (comp, suff) in aopcs.items():
    if name != "random":
        assert comp > aopcs["random"][0] and suff < aopcs["random"][1], name
plt.show()
