"""The context metrics of a vision-language model's answer: what the vision tower costs when
every ablated prompt reruns it, against the images encoded once.

    python benchmarks/vlm_context_metrics.py [--tower-layers 12] [--image-size 336]
        [--ablations 32] [--repeats 3] [--device cpu] [--json out.json]

A LLaVA of random weights in the proportions of the small open models (SmolVLM's and
LLaVA-Interleave's: a tower as wide as a ViT-B/14, 576 patches of a 336-pixel image, before
a 4-layer language model of width 512), one prompt of 16 words about one image and a
4-token answer. For each, the wall time (median of ``--repeats``) of
:func:`~captum_attention.metrics.linear_datamodeling_score` over ``--ablations`` random
ablations, of :func:`~captum_attention.metrics.top_k_log_prob_drop` (k = 1, 3, 5) and of
one forward of the whole prompt with its image, in one run:

- **encoded once**: the default; the images go through the tower once per metric call
  and every ablated prompt takes them encoded (transformers' ``mm_encoder_outputs``, as
  ``generate`` takes them), where one batch decides that this scores the prompt as the
  model does from its pixels;
- **tower per prompt**: the same calls with that reuse switched off (as before it), every
  ablated prompt given the pixels again.

The two give the same values (checked here within 1e-4). The JSON keeps the command, the
machine and every time. Not measured on a GPU yet: ``bash benchmarks/gpu_run.sh vlm``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

from captum_attention.metrics import linear_datamodeling_score, top_k_log_prob_drop
from captum_attention.metrics.context import _AnswerScorer


def build(tower_layers: int, image_size: int) -> tuple[Any, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The LLaVA, a prompt of one image's tokens and 16 words, its image inputs, an answer."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    patch = 14
    tower = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=tower_layers, num_attention_heads=12,
                             image_size=image_size, patch_size=patch)
    text = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=8, max_position_embeddings=2048)
    config = LlavaConfig(vision_config=tower, text_config=text, image_token_id=999, vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(config).eval()
    patches = (image_size // patch) ** 2
    words = torch.randint(3, 900, (16,))
    ids = torch.cat([torch.tensor([1]), torch.full((patches,), 999), words])[None]
    images = {"pixel_values": torch.randn(1, 3, image_size, image_size)}
    return model, ids, images, torch.randint(3, 900, (1, 4))


def timed(call: Callable[[], torch.Tensor], repeats: int) -> tuple[torch.Tensor, float]:
    times, result = [], torch.empty(0)
    for _ in range(repeats):
        start = time.perf_counter()
        result = call()
        if result.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tower-layers", type=int, default=12)
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--ablations", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    arguments = parser.parse_args(argv)
    model, ids, images, answer = build(arguments.tower_layers, arguments.image_size)
    model, ids, answer = model.to(arguments.device), ids.to(arguments.device), answer.to(arguments.device)
    images = {name: value.to(arguments.device) for name, value in images.items()}
    mask = torch.ones_like(ids)
    scores = torch.randn(ids.shape, device=ids.device)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "forward": lambda: model(input_ids=torch.cat([ids, answer], 1), **images).logits[0, -1],
        f"LDS ({arguments.ablations} ablations)": lambda: linear_datamodeling_score(
            model, ids, mask, answer, scores, num_ablations=arguments.ablations, image_inputs=images
        ),
        "top-k drop (k = 1, 3, 5)": lambda: top_k_log_prob_drop(model, ids, mask, answer, scores, image_inputs=images),
    }
    rows: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        for name, call in calls.items():
            encoded, encoded_s = timed(call, arguments.repeats)
            with mock.patch.object(_AnswerScorer, "encoded_images", property(lambda self: None)):
                per_prompt, per_prompt_s = timed(call, arguments.repeats)
            torch.testing.assert_close(encoded, per_prompt, rtol=1e-4, atol=1e-4)
            rows[name] = {"encoded_once_s": encoded_s, "tower_per_prompt_s": per_prompt_s}
    command = "python benchmarks/vlm_context_metrics.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    cpu = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"`{command.strip()}` ({torch.cuda.get_device_name() if arguments.device.startswith('cuda') else cpu})\n")
    print("| call | tower per prompt | encoded once | speed-up |\n|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['tower_per_prompt_s']:.2f} s | {row['encoded_once_s']:.2f} s | "
              f"{row['tower_per_prompt_s'] / row['encoded_once_s']:.1f}× |")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({"command": command.strip(), "machine": platform.platform(),
                                              "threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
