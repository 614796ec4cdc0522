"""
Explain a sentiment classifier
==============================

Every attention method of this package next to Captum's Integrated Gradients and
SmoothGrad, on the default sentiment model: MiniLM (a 6-layer, 12-head BERT) fine-tuned on
a generated corpus of movie-review clauses. The first run fine-tunes it (about a minute on
two CPU cores) and caches it; later runs load it.

Every method is a Captum attribution: the same ``attribute(inputs, target=...,
additional_forward_args=...)`` call as ``LayerIntegratedGradients``, one score per token.
"""

# %%
# The model and three sentences
# -----------------------------
import contextlib
import io

import matplotlib.pyplot as plt
import torch
from captum.attr import LayerIntegratedGradients, NoiseTunnel, Saliency
from captum.attr import visualization

from captum_attention import (
    METHODS,
    AttentionCapture,
    load_default_model,
    scores_for_display,
    special_tokens,
    token_heatmap,
)

model, tokenizer = load_default_model(progress=False)
sentences = [
    "honestly , the acting was really wonderful",
    "the script felt clumsy and the ending was not clever",
    "the soundtrack is great but the story is painfully boring",
]
batch = tokenizer(sentences, padding=True, return_tensors="pt")
ids, mask = batch.input_ids, batch.attention_mask
with torch.no_grad():
    probabilities = model(ids, attention_mask=mask).logits.softmax(-1)
predicted = probabilities.argmax(-1)
labels = [model.config.id2label[int(p)] for p in predicted]
for sentence, label in zip(sentences, labels):
    print(f"{label:>8}  {sentence}")

# %%
# Every method's explanation of the predicted class
# -------------------------------------------------
# The attention methods (the registry, ``METHODS``) take the model itself. Integrated
# Gradients attributes to the word embeddings, ``model.get_input_embeddings()`` (summed over
# their dimensions), as the command line does: the position and segment embeddings are
# the same for every sentence and not part of what it says; SmoothGrad is Captum's ``NoiseTunnel``
# around ``Saliency`` on the input embeddings (gradient norms averaged over 64 noisy copies,
# seeded: with 16, one draw in about thirty puts "but" first in the third sentence).
args = dict(target=predicted, additional_forward_args=(mask,))
explanations = {
    cls.get_name(): cls(model).attribute(ids, **args)
    for cls in METHODS.values()
}


def logits(input_ids, attention_mask):
    return model(input_ids, attention_mask=attention_mask).logits


baseline = torch.where(special_tokens(ids, tokenizer), ids, tokenizer.pad_token_id)
ig = LayerIntegratedGradients(logits, model.get_input_embeddings())
explanations["Integrated Gradients"] = ig.attribute(
    ids, baselines=baseline, n_steps=32, **args
).sum(-1)


def logits_from_embeddings(embeddings, attention_mask):
    return model(inputs_embeds=embeddings, attention_mask=attention_mask).logits


embeddings = model.get_input_embeddings()(ids).detach()
smooth = NoiseTunnel(Saliency(logits_from_embeddings))
torch.manual_seed(0)
saliency = smooth.attribute(
    embeddings, nt_type="smoothgrad", nt_samples=64, stdevs=0.05, **args
)
explanations["SmoothGrad"] = saliency.norm(dim=-1).detach()

# %%
# Captum's text visualisation
# ---------------------------
# ``scores_for_display`` leaves out the special tokens (rollout and Transformer
# Attribution give most of their mass to ``[CLS]`` itself, which would blank every word)
# and puts each sentence on its own scale; Integrated Gradients keeps its sign.
special = special_tokens(ids, tokenizer)
records = []
for name, scores in explanations.items():
    shown = scores_for_display(scores, special, signed=name == "Integrated Gradients")
    for row in range(len(sentences)):
        length = int(mask[row].sum())
        tokens = tokenizer.convert_ids_to_tokens(ids[row, :length])
        records.append(
            visualization.VisualizationDataRecord(
                shown[row, :length],
                float(probabilities[row].max()),
                labels[row],
                labels[row],
                name,
                float(scores[row].sum()),
                tokens,
                0.0,
            )
        )
with contextlib.redirect_stdout(
    io.StringIO()
):  # outside a notebook it also prints a placeholder
    html = visualization.visualize_text(records)
html

# %%
# A token heat map
# ----------------
# The same scores for the third sentence, one method per row, drawn by ``token_heatmap``.
# The label rule of the corpus: with "but", the second clause decides.
row = 2
length = int(mask[row].sum())
tokens = tokenizer.convert_ids_to_tokens(ids[row, :length])
rows = {
    name: scores_for_display(s, special)[row, :length]
    for name, s in explanations.items()
}
token_heatmap(rows, tokens, title=f"{sentences[row]!r} → {labels[row]}")
words = ~special[row, :length]
for name, shown_row in rows.items():
    print(
        f"{name:24} top word: {tokens[int(shown_row.masked_fill(~words, -1).argmax())]}"
    )

# %%
# Every head of every layer
# -------------------------
# ``AttentionCapture`` records the attention probabilities of each layer as the model
# computed them, ``(batch, heads, queries, keys)``. The classic exercise: one heat map per
# layer and head for one sentence. Early layers attend to neighbours (the diagonals) and to
# ``[SEP]``; some later heads gather on the sentiment words.
with AttentionCapture(model) as capture, torch.no_grad():
    model(ids[row : row + 1, :length], attention_mask=mask[row : row + 1, :length])
layers, heads = len(capture.attn_probs), capture.attn_probs[0].shape[1]
fig, axes = plt.subplots(layers, heads, figsize=(heads * 1.1, layers * 1.15))
for layer, attn_probs in enumerate(capture.attn_probs):
    for head in range(heads):
        ax = axes[layer, head]
        ax.imshow(attn_probs[0, head].numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        if layer == 0:
            ax.set_title(f"head {head}", fontsize=7)
        if head == 0:
            ax.set_ylabel(f"layer {layer}", fontsize=7)
fig.suptitle("attention probabilities (rows: queries, columns: keys)")
fig.tight_layout()

# %%
# The claims above, checked on every build of these pages: the model reads the three
# sentences as the corpus's rule says, and every method's top word of the third sentence is
# one of its sentiment words.
assert [model.config.id2label[int(p)] for p in predicted] == [
    "positive",
    "negative",
    "negative",
]
assert all(
    tokens[int(r.masked_fill(~words, -1).argmax())] in ("great", "boring", "painfully")
    for r in rows.values()
)
plt.show()
