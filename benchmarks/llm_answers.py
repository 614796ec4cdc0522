"""Cost of explaining a language model's answer: the whole answer (``attribute_span``, Captum's
``seq_attr``) and each answer token (``attribute_continuation``, ``token_attr``), against the
model's own sdpa forward+backward of prompt + answer.

    python benchmarks/llm_answers.py [--lengths 4096 16384] [--answer 32]
        [--methods grad_sam rollout ...] [--token-rows-max 4096] [--model llama|llama-1b|llava]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--json out.json]

The model: a Llama of ``scaling.py`` as a causal LM, random weights: ``llama`` (4 layers,
hidden 256, 8 heads, 4 KV heads, vocabulary 1000) or ``llama-1b`` (shaped like Llama-3.2-1B);
or ``llava``, that Llama as the language model of a LLaVA whose CLIP tower (2 layers,
hidden 64) makes 1,024 image tokens of a 256 × 256 image, placed after the prompt's first
token (a prompt of 2,048 tokens is then 1k image tokens and 1k text tokens).
The baseline: one sdpa forward of prompt + answer (the image through the vision tower
included) and the gradient of the answer's summed log-probability to the embeddings the
language model reads. Time: the median of ``--repeats`` calls after a
warm-up; memory: the peak growth of one call (``scaling.measure_here``), each run in a fresh
subprocess on CPU, in this process on CUDA. Streaming capture throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MEASURING_ENV, device_description  # noqa: E402
from scaling import measure_here, model_config  # noqa: E402

from captum_attention import METHODS  # noqa: E402

BASELINE = "forward+backward (sdpa)"


def answer_model(options: argparse.Namespace, max_length: int) -> tf.LlamaForCausalLM:
    torch.manual_seed(0)
    with torch.device(options.device):
        model = tf.LlamaForCausalLM(model_config(options.model, max_length))
    return model.eval().to(dtype=getattr(torch, options.dtype))


IMAGE_TOKEN, IMAGE_SIDE, PATCH = 999, 256, 8


def vision_language_model(options: argparse.Namespace, max_length: int) -> tf.LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=IMAGE_SIDE, patch_size=PATCH)
    config = tf.LlavaConfig(vision_config=vision, text_config=model_config("llama", max_length), image_token_id=IMAGE_TOKEN)
    with torch.device(options.device):
        model = tf.LlavaForConditionalGeneration(config)
    return model.eval().to(dtype=getattr(torch, options.dtype))


def runs(options: argparse.Namespace, length: int) -> dict[str, Callable[[], object]]:
    """Zero-argument calls by name: the baseline, then ``<method> seq_attr`` and
    ``<method> token_attr`` for each registered method."""
    answer = options.answer
    llava = options.model == "llava"
    model = vision_language_model(options, length + answer) if llava else answer_model(options, length + answer)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 999, (1, length), generator=generator)
    images: dict[str, torch.Tensor] = {}
    if llava:
        prompt[0, 1 : 1 + (IMAGE_SIDE // PATCH) ** 2] = IMAGE_TOKEN
        images = {"pixel_values": torch.randn(1, 3, IMAGE_SIDE, IMAGE_SIDE, generator=generator).to(options.device, getattr(torch, options.dtype))}
    prompt = prompt.to(options.device)
    continuation = torch.randint(5, 999, (1, answer), generator=generator).to(options.device)
    mask = (torch.ones_like(prompt), images) if llava else (torch.ones_like(prompt),)
    reader = model.get_decoder() if llava else model.get_input_embeddings()

    def baseline() -> None:
        ids = torch.cat([prompt, continuation], dim=1)
        read: list[torch.Tensor] = []
        hook = (reader.register_forward_pre_hook(_leaf_inputs_embeds(read), with_kwargs=True) if llava
                else reader.register_forward_hook(lambda module, args, out: read.append(out.detach().requires_grad_()) or read[-1]))
        try:
            logits = model(input_ids=ids, **images).logits[0, length - 1 : -1].float().log_softmax(dim=-1)
        finally:
            hook.remove()
        torch.autograd.grad(logits.gather(1, continuation[0, :, None]).sum(), read[0])

    calls: dict[str, Callable[[], object]] = {BASELINE: baseline}
    for name, cls in METHODS.items():
        explainer = cls(model, capture="streaming")
        calls[f"{name} seq_attr"] = lambda e=explainer: e.attribute_span(prompt, continuation, additional_forward_args=mask)
        calls[f"{name} token_attr"] = lambda e=explainer: e.attribute_continuation(
            prompt, continuation, additional_forward_args=mask, log_prob=True
        )
    return calls


def _leaf_inputs_embeds(read: list[torch.Tensor]) -> Callable[..., object]:
    """A pre-hook that gives the module its ``inputs_embeds`` as a leaf, kept in ``read``."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        read.append(kwargs["inputs_embeds"].detach().requires_grad_())
        return args, {**kwargs, "inputs_embeds": read[-1]}
    return hook


def measure_cuda(run: Callable[[], object], options: argparse.Namespace) -> dict[str, float]:
    try:
        run()  # warm-up
        return measure_here(run, options.repeats, "cuda")
    except Exception as failure:  # noqa: BLE001 - out of memory, or a kernel this card cannot run: the rest go on
        torch.cuda.empty_cache()
        error = "out of memory" if isinstance(failure, torch.OutOfMemoryError) else str(failure).strip()[:200]
        return {"ms": float("nan"), "MiB": float("nan"), "error": error}


def measure(name: str, length: int, options: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--one", name, "--lengths", str(length), "--answer", str(options.answer),
               "--repeats", str(options.repeats), "--model", options.model, "--dtype", options.dtype]
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MEASURING_ENV})
    if out.returncode != 0:
        return {"ms": float("nan"), "MiB": float("nan"), "error": (out.stderr.strip().splitlines() or ["killed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| prompt | run | time | × baseline | peak MiB | × baseline |", "|---|---|---|---|---|---|"]
    for row in results:
        base = row["runs"][BASELINE]
        for name, values in row["runs"].items():
            lines.append(
                f"| {row['length']} | {name} | {values['ms'] / 1000:.2f} s | {values['ms'] / base['ms']:.2f} "
                f"| {values['MiB']:.0f} | {values['MiB'] / base['MiB']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--token-rows-max", type=int, default=4096, help="longest prompt whose token rows are measured")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", default="llama", choices=["llama", "llama-1b", "llava"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if options.one:
        run = runs(options, options.lengths[0])[options.one]
        run()  # warm-up
        print(json.dumps(measure_here(run, options.repeats, "cpu")))
        return
    device = device_description(options.device)
    results = []
    for length in options.lengths:
        names = [BASELINE] + [f"{m} seq_attr" for m in options.methods]
        if length <= options.token_rows_max:
            names += [f"{m} token_attr" for m in options.methods]
        calls = runs(options, length) if options.device == "cuda" else {}
        measured: dict[str, dict[str, float]] = {}
        results.append({"length": length, "answer": options.answer, "runs": measured})
        for name in names:
            measured[name] = measure_cuda(calls[name], options) if calls else measure(name, length, options)
            print(f"{length} {name}: {measured[name]}", flush=True)
            if options.json:  # after every run, so that an interrupted one keeps what it measured
                summary = {"device": device, "model": options.model, "dtype": options.dtype, "results": results}
                options.json.write_text(json.dumps(summary, indent=1))
    print()
    print(table(results))


if __name__ == "__main__":
    main()
