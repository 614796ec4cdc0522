"""A vision-language model's answer with a known decisive region: does each method point at
the square whose colour the model names?

    python benchmarks/vlm_pointing.py [--examples 100] [--methods grad_sam rollout ...]
        [--ig-steps 1 4 32] [--json out.json]

The model: the coloured-squares LLaVA of :mod:`captum_attention.demo.colour_vlm` (trained on
first use and cached, about 10 s), asked ``what colour is the square ?`` about held-out
images. Among the examples it answers with p ≥ 0.9, per method:

- pointing: how often the image token the method scores highest lies on the square;
- top-4 drop: the answer's log-probability lost when the 4 highest-scored patches are
  greyed (the square covers 4 to 9 of the 64);
- LDS: Spearman's ρ, over 32 random halves of the patches greyed (each example's own),
  between the kept patches' summed scores and the answer's log-probability
  (:func:`~captum_attention.metrics.patch_datamodeling_score`, the prompt as
  ``prompt_ids``); the mean over the examples where both sides vary;
- time per example.

Our methods explain the answer's log-probability in one forward (and one backward) for the
whole batch, their image tokens placed on the 8 × 8 grid by ``image_scores``. Those that read
a query row also run "→ vision tower": their image-token scores weigh the vision tower's
query rows for the same method over the tower's own attention (``query_index`` as row
weights; a second pass), which carries the language model's credit from the tokens to the
patches the tower mixed into them. AttnLRP carries its relevance through the projector and
the tower to the pixels in the same backward (``through_vision_tower=True``), summed per
patch, against a grey reference image (the same as Integrated Gradients' baseline) and
against 0 (black: this processor does not normalise). Beside them:
Captum's ``LLMAttribution(FeatureAblation)`` over an ``ImageMaskInput`` of the 64 patches
(a forward per patch, one example at a time), and Captum's ``LayerIntegratedGradients`` on
the vision tower's patch embedding (the answer's log-probability), summed over its
channels per patch, one row for each number of ``--ig-steps`` (Gauss-Legendre, Captum's
default: with one step, the gradient at the image halfway to grey times the difference,
one forward and one backward).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from captum.attr import FeatureAblation, ImageMaskInput, LayerIntegratedGradients, LLMAttribution

from captum_attention import METHODS, image_scores, pixel_scores
from captum_attention.metrics import patch_datamodeling_score
from captum_attention.demo.colour_vlm import GRID, HELDOUT_SEED, colour_images, colour_processor, load_colour_vlm, prompt_ids
from captum_attention.demo.shapes import PATCH

FEATURE_ABLATION = "Captum FeatureAblation (64 patches)"
TOP = 4
HALVES = 32


def answer_log_prob(model: torch.nn.Module, images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=prompt_ids(len(images)), pixel_values=images).logits[:, -1].float()
    return logits.log_softmax(dim=-1).gather(1, answers[:, None])[:, 0]


def ours(model: torch.nn.Module, name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    explainer = METHODS[name](model)

    def grids(images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids(len(images))
        span = explainer.attribute_span(ids, answers[:, None], additional_forward_args=(torch.ones_like(ids), {"pixel_values": images}))
        return torch.stack([example[0] for example in image_scores(model, ids, span)])

    return grids


def through_vision_tower(model: torch.nn.Module, name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The method's image-token scores from the language model, carried into the vision
    tower by the same method over the tower's attention: they weigh the tower's query
    rows (image token i is the tower's token i + 1, after CLIP's class token)."""
    language_model = ours(model, name)

    def grids(images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        image_tokens = language_model(images, answers).flatten(1).clamp(min=0)
        weights = torch.cat([torch.zeros(len(images), 1), image_tokens], dim=1)
        explainer = METHODS[name](lambda pixels: answer_log_prob(model, pixels, answers)[:, None], model=model.model.vision_tower)
        return explainer.attribute(images, target=0, query_index=weights / weights.sum(dim=1, keepdim=True))

    return grids


def attn_lrp_pixels(model: torch.nn.Module, reference: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """AttnLRP through the vision tower: the pixels' relevance against ``reference``, summed
    over the channels and the pixels of each patch."""
    explainer = METHODS["attn_lrp"](model)

    def grids(images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        ids = prompt_ids(len(images))
        _, pixels = explainer.attribute_span(
            ids, answers[:, None], additional_forward_args=(torch.ones_like(ids), {"pixel_values": images}),
            through_vision_tower=True, pixel_baselines=reference,
        )
        return torch.stack(pixel_scores(model, pixels))

    return grids


def feature_ablation(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from PIL import Image

    processor = colour_processor()
    attribution = LLMAttribution(FeatureAblation(model), processor.tokenizer)
    patches = torch.arange(GRID * GRID).view(GRID, GRID).repeat_interleave(PATCH, 0).repeat_interleave(PATCH, 1)

    def grids(images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        out = []
        for image, answer in zip(images, answers):
            picture = Image.fromarray((image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
            inp = ImageMaskInput(
                image=picture, mask=patches, baseline=(128, 128, 128),
                processor_fn=lambda p: dict(processor(text="<image> what colour is the square ?", images=p, return_tensors="pt")),
            )
            out.append(attribution.attribute(inp, target=answer[None]).seq_attr.view(GRID, GRID))
        return torch.stack(out)

    return grids


def integrated_gradients_name(steps: int) -> str:
    return f"Captum LayerIntegratedGradients (patch embedding, {steps} step{'s' if steps > 1 else ''})"


def integrated_gradients(model: torch.nn.Module, steps: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    layer = model.model.vision_tower.embeddings.patch_embedding
    attribution = LayerIntegratedGradients(lambda images, answers: answer_log_prob(model, images, answers), layer)

    def grids(images: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
        baseline = torch.full_like(images, 0.5)
        scores = attribution.attribute(images, baselines=baseline, additional_forward_args=(answers,), n_steps=steps)
        return scores.sum(dim=1)

    return grids


def greyed(images: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """``images`` with the patches at the flat grid ``cells`` ``(B, k)`` set to grey."""
    covered = torch.zeros(len(images), GRID * GRID, dtype=torch.bool)
    covered.scatter_(1, cells, True)
    pixels = covered.view(-1, GRID, GRID).repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2)
    return images.masked_fill(pixels[:, None], 0.5)


def score(model: torch.nn.Module, grids: torch.Tensor, images: torch.Tensor, answers: torch.Tensor, squares: torch.Tensor) -> dict[str, float]:
    flat = grids.flatten(1).float()
    pointing = squares.flatten(1).gather(1, flat.argmax(dim=1, keepdim=True)).float().mean()
    with torch.no_grad():
        drop = answer_log_prob(model, images, answers) - answer_log_prob(model, greyed(images, flat.topk(TOP, dim=1).indices), answers)
    lds = patch_datamodeling_score(model, images, answers[:, None], grids.float(), torch.full_like(images[:1], 0.5), HALVES,
                                   per_example=True, prompt_ids=prompt_ids(1))
    return {"pointing": float(pointing), f"top-{TOP} drop": float(drop.mean()), "LDS": float(lds.nanmean()),
            "LDS examples": int((~lds.isnan()).sum())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--ig-steps", type=int, nargs="+", default=[1, 4, 32], help="Integrated Gradients' steps, a row each")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_colour_vlm()
    images, answers, squares = colour_images(options.examples, HELDOUT_SEED + 1)
    with torch.no_grad():
        confident = answer_log_prob(model, images, answers).exp() >= 0.9
    images, answers, squares = images[confident], answers[confident], squares[confident]
    runs = {METHODS[name].get_name(): ours(model, name) for name in options.methods}
    for name in options.methods:
        if METHODS[name].spec.reads_query_row and not METHODS[name].spec.signed:
            runs[f"{METHODS[name].get_name()} → vision tower"] = through_vision_tower(model, name)
    if "attn_lrp" in options.methods:
        runs["AttnLRP → pixels (grey reference)"] = attn_lrp_pixels(model, 0.5)
        runs["AttnLRP → pixels (reference 0)"] = attn_lrp_pixels(model, 0.0)
    runs[FEATURE_ABLATION] = feature_ablation(model)
    for steps in options.ig_steps:
        runs[integrated_gradients_name(steps)] = integrated_gradients(model, steps)
    results = {"examples": len(images), "of": options.examples, "methods": {}}
    for name, run in runs.items():
        start = time.perf_counter()
        grids = run(images, answers).detach()
        seconds = time.perf_counter() - start
        results["methods"][name] = {**score(model, grids, images, answers, squares), "ms per example": 1000 * seconds / len(images)}
        print(name, results["methods"][name], flush=True)
        if options.json:
            options.json.write_text(json.dumps(results, indent=1))
    print(f"\n{len(images)} of {options.examples} examples answered with p >= 0.9\n")
    print(f"| method | pointing | top-{TOP} drop | LDS | ms per example |\n|---|---|---|---|---|")
    for name, values in results["methods"].items():
        print(f"| {name} | {values['pointing']:.2f} | {values[f'top-{TOP} drop']:.2f} | {values['LDS']:.2f} | {values['ms per example']:.1f} |")


if __name__ == "__main__":
    main()
