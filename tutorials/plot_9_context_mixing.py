"""
Is attention an explanation of a language model's answer?
=========================================================

"Attention is not explanation" (Jain & Wallace, 2019) and its replies asked whether the
attention weights say what a model uses. Since then the field has proposed methods that
count more than the weights: what attention moves, the norm of the value through the
output projection (Kobayashi et al., 2020); the residual and the layer norms (Kobayashi et
al., 2021; ALTI, Ferrando et al., 2022); each layer's addition to the answer's logit
(ALTI-Logit, Ferrando et al., 2023); how far a token's output moves when another token's
value is zeroed (Value Zeroing, Mohebbi et al., 2023); each token's share of the logit
carried through every module, feed-forward layers included (DecompX, Modarressi et al.,
2023). Here they are side by side with the
old ones (raw attention, rollout) and with relevance through the whole model (AttnLRP),
on an answer whose evidence is known: the needle task of the previous tutorial. The judge
is the model itself: remove segments of the prompt and watch the answer's log-probability
(the top segment's drop, and ContextCite's linear datamodeling score, LDS).
"""

# %%
# The task and the methods
# ------------------------
# A 2-layer Llama reads a context of filler words holding eight key-value pairs, then
# ``? k3``, and answers with the asked key's value. The asked pair is the needle. Each
# method explains the answer's log-probability over the prompt (``attribute_span``); its
# scores are summed per segment (each pair, each run of up to 32 filler words).
import time

import matplotlib.pyplot as plt
import torch

from captum_attention import (
    ALTI,
    ALTILogit,
    DecompX,
    AttentionRollout,
    AttnLRP,
    NormAttention,
    RawAttention,
    ValueZeroing,
)
from captum_attention.demo.needle import load_needle_model, needle_accuracy, needle_example
from captum_attention.metrics import linear_datamodeling_score, top_k_log_prob_drop

model = load_needle_model()
generator = torch.Generator().manual_seed(9)
examples = [needle_example(512, generator) for _ in range(10)]
examples = [e for e in examples if needle_accuracy(model, [e]) == 1.0][:8]
prompts = torch.stack([e.input_ids for e in examples])
answers = torch.tensor([[e.answer] for e in examples])
segments = torch.stack([e.segments for e in examples])
mask = torch.ones_like(prompts)
print(f"{len(examples)} contexts of 512 tokens, each answered correctly")

methods = {
    "raw attention (layer 0)": (RawAttention(model), {"layer": 0}),
    "raw attention (last layer)": (RawAttention(model), {}),
    "rollout": (AttentionRollout(model), {}),
    "norms (layer 0)": (NormAttention(model), {"layer": 0}),
    "norms + residual (layer 0)": (NormAttention(model), {"layer": 0, "residual": True}),
    "ALTI": (ALTI(model), {}),
    "ALTI-Logit": (ALTILogit(model), {}),
    "Value Zeroing": (ValueZeroing(model), {}),
    "DecompX": (DecompX(model), {}),
    "AttnLRP": (AttnLRP(model), {}),
}

# %%
# Three questions per method: does its top segment hold the needle (pointing), how much
# does the answer's log-probability drop without that segment, and how well do its segment
# scores, summed over the segments kept, predict the log-probability of 32 random half
# ablations (LDS, Spearman's ρ)?
results = {}
for name, (explainer, options) in methods.items():
    started = time.perf_counter()
    scores = explainer.attribute_span(prompts, answers, additional_forward_args=(mask,), **options)[:, :-1]
    seconds = (time.perf_counter() - started) / len(examples)
    per_segment = torch.zeros(len(examples), int(segments.max()) + 1).scatter_add_(
        1, segments.clamp(min=0), scores * (segments >= 0)
    )
    pointing = float((per_segment.argmax(dim=1) == torch.tensor([e.needle for e in examples])).float().mean())
    drop = float(top_k_log_prob_drop(model, prompts, mask, answers, scores, ks=(1,), segments=segments).mean())
    lds = float(linear_datamodeling_score(model, prompts, mask, answers, scores, segments).nanmean())
    results[name] = {"pointing": pointing, "drop": drop, "lds": lds, "seconds": seconds}
    print(f"{name:>28}: points at the needle {pointing:.0%}, top-1 drop {drop:.2f}, LDS {lds:.3f}, {seconds:.3f} s")

# %%
# The answer
# ----------
fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), sharey=True)
names = list(results)
for ax, (key, label) in zip(axes, (("pointing", "points at the needle"), ("drop", "top-1 log-prob drop"), ("lds", "LDS"))):
    ax.barh(names, [results[n][key] for n in names])
    ax.set_xlabel(label)
axes[0].invert_yaxis()
fig.tight_layout()

# %%
# The weights alone can be right about the lookup: the first layer's attention at the
# question points at the needle (the model's lookup happens there), while the last
# layer's does not.
assert results["raw attention (layer 0)"]["pointing"] > results["raw attention (last layer)"]["pointing"]

# %%
# Counting what the attention moves, its residual and its norm changes little at that
# layer: the norms rank the segments as the weights do.
assert abs(results["norms (layer 0)"]["lds"] - results["raw attention (layer 0)"]["lds"]) < 0.1

# %%
# Following the mixing through every layer (ALTI) finds the needle without being told
# which layer looks it up; following each layer's addition to the answer's own logit
# (ALTI-Logit) predicts the ablations better still.
assert results["ALTI"]["pointing"] >= results["raw attention (layer 0)"]["pointing"]
assert results["ALTI-Logit"]["lds"] > results["ALTI"]["lds"]

# %%
# Value Zeroing, which measures how far each token's output moves, misses the needle on
# this task: the distractor pairs move the outputs as much.
assert results["Value Zeroing"]["pointing"] < results["ALTI"]["pointing"]

# %%
# Carrying each token's share through the feed-forward layers and the head as well
# (DecompX) points at the needle as AttnLRP does, at one forward and one backward on
# this model, which has no bias (with biases, about one forward per token); it decomposes
# the answer's logit, not its log-probability, and predicts the ablations less well than
# AttnLRP.
assert results["DecompX"]["pointing"] >= results["ALTI"]["pointing"]
assert results["DecompX"]["lds"] < results["AttnLRP"]["lds"]

# %%
# Relevance through the whole model in one backward (AttnLRP) remains the most faithful to
# the ablations here, ahead of every attention-based method.
assert results["AttnLRP"]["lds"] == max(r["lds"] for r in results.values())

# %%
# So, is attention an explanation? The raw weights of the right layer point at the right
# token, but no single layer's weights are the model's reasons, and methods that count
# only the mixing rank the rest of the prompt worse than methods that follow the answer's
# logit. On the measures users choose by, ablation (ContextCite, leave-one-out) still
# predicts the ablations best when its many forwards are affordable: the benchmark of
# :doc:`../language_models` compares them at every length. Without any ablation, the
# first-order knockout effects with AttnLRP's relevance at its top token
# (:class:`~captum_attention.KnockoutLRP`, two passes) come within a standard error of
# leave-one-out there at 512 and 2,048 tokens: not attention weights, but what removing
# each token from every attention call would change.
