"""An image captioner's caption with a known decisive region: does each method point at the
square whose colour the caption names, and which one do the patch metrics trust?

    python benchmarks/caption_pointing.py [--examples 100] [--ig-steps 32] [--train-size 3000]
                                         [--confidence 0.9] [--json out.json]

The model: a ViT (32 × 32 images in 4 × 4 patches, an 8 × 8 grid; 2 layers, hidden 64)
before a GPT-2 decoder (2 layers, hidden 64, cross-attending to the ViT), a
``VisionEncoderDecoderModel`` as ViT-GPT-2 captioners are, trained here (seeded, about 10 s
on two CPU cores) to caption the coloured-squares images of
:mod:`captum_attention.demo.colour_vlm` as "<colour> square". Among the held-out images
whose colour word it writes with p ≥ 0.9, per method, each explaining the whole caption's
log-probability over the 8 × 8 patches (``attribute_span``):

- pointing: how often the highest-scored patch lies on the square;
- the context metrics of ``captum-attention evaluate`` on a captioner
  (:mod:`captum_attention.metrics.patches`, a removed patch's pixels the grey image's):
  top-4 drop (the square covers 4 to 9 of the 64 patches), LDS over 32 random halves, and
  Spearman's ρ with each patch's leave-one-out drop;
- time per example (the whole batch at once where the method allows).

Beside ours: Captum's ``IntegratedGradients`` on the pixels against the grey image
(``--ig-steps`` steps), summed per patch, as ``explain`` and ``evaluate`` run it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from captum_attention import METHODS
from captum_attention.demo.colour_vlm import ANSWERS, HELDOUT_SEED, WORDS, colour_images
from captum_attention.demo.shapes import IMAGE, PATCH, ShapeTraining, train_on_images
from captum_attention.metrics import patch_datamodeling_score, patch_leave_one_out_agreement, top_k_patch_log_prob_drop
from captum_attention.metrics.context import shared_ablations
from captum_attention.metrics.patches import caption_log_probs
from captum_attention.presentation.answer import caption_integrated_gradients

GREY = 0.5
TOP = 4
INTEGRATED_GRADIENTS = "Captum IntegratedGradients (pixels)"


def new_captioner(seed: int = 0) -> Any:
    from transformers import GPT2Config, ViTConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel

    torch.manual_seed(seed)
    encoder = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE,
                        patch_size=PATCH)
    decoder = GPT2Config(vocab_size=len(WORDS), n_embd=64, n_layer=2, n_head=4, n_positions=8, add_cross_attention=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id = WORDS.index("<s>"), 0
    return VisionEncoderDecoderModel(config)


def captions(answers: torch.Tensor) -> torch.Tensor:
    """``(B, 2)``: each image's caption, its colour's word then "square"."""
    return torch.stack([answers, torch.full_like(answers, WORDS.index("square"))], dim=1)


def train_captioner(training: ShapeTraining) -> tuple[Any, float]:
    images, answers, _ = colour_images(training.train_size, seed=training.seed + 1)

    def loss(model: Any, batch: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
        decoder = torch.cat([torch.full_like(caption[:, :1], WORDS.index("<s>")), caption[:, :-1]], dim=1)
        logits = model(pixel_values=batch, decoder_input_ids=decoder).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), caption.flatten())

    return train_on_images(new_captioner(training.seed), images, captions(answers), loss, training)


def ours(model: Any, name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    explainer = METHODS[name](model)
    return lambda images, caption: explainer.attribute_span(images, caption)[0].detach()


def integrated_gradients(model: Any, steps: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def grids(images: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
        grey = torch.full_like(images[:1], GREY)
        return torch.cat([caption_integrated_gradients(model, image[None], words[None], grey, steps) for image, words in zip(images, caption)])

    return grids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--ig-steps", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=ShapeTraining.train_size, help="training images")
    parser.add_argument("--confidence", type=float, default=0.9, help="the colour word's least probability for an example to count")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    model, seconds = train_captioner(ShapeTraining(train_size=args.train_size))
    images, answers, squares = colour_images(args.examples, seed=HELDOUT_SEED)
    caption = captions(answers)
    with torch.no_grad():
        decoder = torch.cat([torch.full_like(caption[:, :1], WORDS.index("<s>")), caption[:, :-1]], dim=1)
        colour_prob = model(pixel_values=images, decoder_input_ids=decoder).logits[:, 0].softmax(-1)
    accuracy = float((colour_prob[:, list(ANSWERS)].argmax(-1) == torch.tensor([ANSWERS.index(int(a)) for a in answers])).float().mean())
    confident = colour_prob.gather(1, answers[:, None])[:, 0] >= args.confidence
    images, caption, squares = images[confident], caption[confident], squares[confident]
    grey = torch.full_like(images[:1], GREY)
    print(f"trained in {seconds:.1f} s; colour accuracy {accuracy:.3f} on {args.examples} held-out images; "
          f"{len(images)} captioned with p >= {args.confidence}")
    if not len(images):
        raise SystemExit(f"no held-out image is captioned with p >= {args.confidence}: train on more images (--train-size)")

    methods = {name: ours(model, name) for name in ("grad_sam", "rollout", "transformer_attribution", "raw", "attn_lrp")}
    methods[INTEGRATED_GRADIENTS] = integrated_gradients(model, args.ig_steps)
    rows = []
    with shared_ablations():  # every method's metrics grey each set of patches once
        log_probs = caption_log_probs(model, images, caption)
        for name, grids in methods.items():
            start = time.perf_counter()
            scores = grids(images, caption)
            per_example = (time.perf_counter() - start) / len(images)
            top = scores.flatten(1).argmax(dim=1)
            rows.append({
                "method": name,
                "pointing": squares.flatten(1)[torch.arange(len(top)), top].float().mean().item(),
                "top-4 drop": top_k_patch_log_prob_drop(model, images, caption, scores, grey, ks=(TOP,))[:, 0].mean().item(),
                "LDS": patch_datamodeling_score(model, images, caption, scores, grey, per_example=True).nanmean().item(),
                "LOO agreement": patch_leave_one_out_agreement(model, images, caption, scores, grey).nanmean().item(),
                "ms per example": 1000 * per_example,
            })
    header = ["method", "pointing", "top-4 drop", "LDS", "LOO agreement", "ms per example"]
    print(f"\ncaption log-probability: mean {log_probs.mean().item():.3f}\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join([row["method"]] + [f"{row[key]:.3f}" if key != "ms per example" else f"{row[key]:.1f}" for key in header[1:]]) + " |")
    if args.json:
        args.json.write_text(json.dumps({"accuracy": accuracy, "examples": len(images), "train_seconds": seconds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
