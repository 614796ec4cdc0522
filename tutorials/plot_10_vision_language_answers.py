"""
Where in the image did a vision-language model look?
====================================================

A vision-language model (LLaVA, Qwen2-VL, PaliGemma, ...) puts its image's features in
place of the prompt's image tokens and answers with its language model. The attention
methods explain that answer over every token the language model read, the image's among
them, and :func:`~captum_attention.image_scores` places the image tokens' scores on the
image's patch grid. Here on a model whose decisive region is known: a tiny LLaVA trained
to say what colour the square is, in noisy grey images holding one red, green or blue
square. The judge is the model itself: grey the patches a method ranks first and watch
the answer's log-probability fall; and pointing, whether the top patch lies on the square.
"""

# %%
# The model and the question
# --------------------------
# The model (a CLIP tower of 4×4 patches, 64 image tokens, and a 2-layer Llama) trains on
# first use in about ten seconds and is cached with its processor. ``attribute_span``
# explains the answer's log-probability; the image inputs go last in
# ``additional_forward_args``, as a dict.
import matplotlib.pyplot as plt
import torch

from captum_attention import AttentionRollout, AttnLRP, RawAttention, TransformerAttribution, image_scores, pixel_scores
from captum_attention.demo.colour_vlm import HELDOUT_SEED, WORDS, colour_images, load_colour_vlm, prompt_ids

model = load_colour_vlm()
images, answers, squares = colour_images(48, HELDOUT_SEED + 1)
ids = prompt_ids(len(images))
inputs = (torch.ones_like(ids), {"pixel_values": images})
with torch.no_grad():
    said = model(input_ids=ids, pixel_values=images).logits[:, -1].argmax(-1)
print(f"answered {float((said == answers).float().mean()):.0%} of {len(images)} held-out images right")
assert bool((said == answers).all())


def answer_log_prob(pixels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=prompt_ids(len(pixels)), pixel_values=pixels).logits[:, -1].float()
    return logits.log_softmax(dim=-1).gather(1, answers[:, None])


# %%
# The language model's view
# -------------------------
# Each method's scores over the 64 image tokens, on the 8×8 grid.
methods = {
    "raw attention": RawAttention(model),
    "rollout": AttentionRollout(model),
    "Transformer Attribution": TransformerAttribution(model),
    "AttnLRP": AttnLRP(model),
}
grids = {}
for name, explainer in methods.items():
    span = explainer.attribute_span(ids, answers[:, None], additional_forward_args=inputs)
    grids[name] = torch.stack([example[0] for example in image_scores(model, ids, span)])

# %%
# Through the vision tower
# ------------------------
# The vision tower's attention mixes the patches before the language model reads them, so
# an image token's score is its features' share, not its own patch's. A method that reads
# a query row carries it further: the image tokens' scores weigh the tower's query rows
# (``query_index`` as row weights; token i is the tower's i + 1, after CLIP's class token)
# for the same method over the tower's own attention.
tower = model.model.vision_tower
for name in ("raw attention", "rollout"):
    weights = torch.cat([torch.zeros(len(images), 1), grids[name].flatten(1)], dim=1)
    carried = type(methods[name])(answer_log_prob, model=tower)
    grids[f"{name} → vision tower"] = carried.attribute(images, target=0, query_index=weights / weights.sum(1, keepdim=True))

# %%
# AttnLRP goes all the way in its one backward: ``through_vision_tower=True`` propagates
# its relevance through the projector and the tower to the pixels, against a reference
# image (here grey, the colour the judge below greys patches with).
# :func:`~captum_attention.pixel_scores` sums it per 4×4 patch of the tower.
_, pixels = methods["AttnLRP"].attribute_span(
    ids, answers[:, None], additional_forward_args=inputs, through_vision_tower=True, pixel_baselines=0.5
)
grids["AttnLRP → pixels"] = torch.stack(pixel_scores(model, pixels))


# %%
# The judge: pointing and the top-4 drop
# --------------------------------------
def greyed(pixels: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    covered = torch.zeros(len(pixels), 64, dtype=torch.bool).scatter_(1, cells, True).view(-1, 8, 8)
    return pixels.masked_fill(covered.repeat_interleave(4, 1).repeat_interleave(4, 2)[:, None], 0.5)


results = {}
with torch.no_grad():
    for name, grid in grids.items():
        flat = grid.flatten(1)
        pointing = float(squares.flatten(1).gather(1, flat.argmax(1, keepdim=True)).float().mean())
        drop = float((answer_log_prob(images) - answer_log_prob(greyed(images, flat.topk(4, dim=1).indices))).mean())
        results[name] = (pointing, drop)
        print(f"{name:>30}: pointing {pointing:.2f}, top-4 drop {drop:.2f}")

# %%
# Carried through the vision tower, raw attention and rollout point at the square far
# more often and their top patches matter far more to the answer than the language model's
# view alone gives; AttnLRP carried to the pixels points at it every time.
# ``benchmarks/vlm_pointing.py`` has the full table on 200 images, Captum's Feature
# Ablation and Integrated Gradients beside them.
for name in ("raw attention", "rollout"):
    assert results[f"{name} → vision tower"][0] > results[name][0]
    assert results[f"{name} → vision tower"][1] > results[name][1]
assert results["AttnLRP → pixels"][0] >= 0.95

# %%
# One image, each method's grid over it
# -------------------------------------
example = 0
figure, axes = plt.subplots(1, 1 + len(grids), figsize=(2.2 * (1 + len(grids)), 2.6))
axes[0].imshow(images[example].permute(1, 2, 0).numpy())
axes[0].set_title(f"answer: {WORDS[int(answers[example])]}", fontsize=8)
for axis, (name, grid) in zip(axes[1:], grids.items()):
    signed = bool((grid[example] < 0).any())
    peak = float(grid[example].abs().max())
    axis.imshow(grid[example].numpy(), cmap="RdYlGn" if signed else "Greens", vmin=-peak if signed else 0, vmax=peak)
    axis.set_title(name.replace(" → ", "\n→ "), fontsize=7)
for axis in axes:
    axis.set_axis_off()
figure.tight_layout()
