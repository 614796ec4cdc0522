"""Time and peak memory of each method, streaming and eager, against length and batch size.

    python benchmarks/scaling.py [--model llama|bert|llama-1b|llama-deep|gemma2|gpt-oss] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--lengths 1024 2048 4096 8192 16384]
        [--batches 1 4 16] [--batch-length 512] [--eager-max 4096] [--repeats 1]
        [--reduction default|eager|compiled|triton] [--json out.json]
    python benchmarks/scaling.py --tables out.json [more.json ...]

Models (random weights, sequence classifiers, so the explained logit is one class):
``llama``: 4 layers, hidden 256, 8 heads, 4 KV heads; ``bert``: 6 layers, hidden 384, 12
heads; ``llama-1b``: shaped like Llama-3.2-1B (16 layers, hidden 2048, 32 heads, 8 KV heads,
vocabulary cut to 32k); ``llama-deep``: the ``llama``'s width with 32 layers, where a
method's work per layer shows at short inputs; ``gemma2``: the ``llama`` shape with
Gemma-2's logit softcap and sliding window, which transformers runs only eagerly, so that
its "sdpa" runs are the model's own eager attention; ``gpt-oss``: the ``llama`` shape with
gpt-oss's attention sinks, alternating 128-token windows and a mixture of 4 experts (2 per
token), also run eagerly by transformers. For each (batch, length): the model's own sdpa forward and
forward+backward to the input embeddings, each method streaming (``capture="streaming"``)
and ``attention_erasure`` streaming (10% of the keys erased: two forwards); up to
``--eager-max`` tokens also the eager forward and forward+backward with attentions and each
method with ``capture="eager"`` (beyond it the attention maps alone outgrow this machine).

Memory: the peak growth of one call above the loaded model and inputs: on CUDA
``max_memory_allocated``; on CPU the peak resident set, each run in a fresh subprocess
whose allocator returns freed blocks to the system for that call. Time: the median of
``--repeats`` further calls (the allocator back to its usual thresholds on CPU). Ratios: streaming raw/rollout/erasure against the sdpa forward (memory also against
the sdpa forward plus the recorded queries and keys), Grad-SAM/Transformer Attribution
against the sdpa forward+backward; eager runs against the same sdpa baselines, so the two
modes compare directly.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    BASELINE,
    EAGER,
    FORWARD,
    FORWARD_BACKWARD,
    MEASURING_ENV,
    SDPA_FORWARD,
    SDPA_FORWARD_BACKWARD,
    attention_runs,
    device_description,
    peak_rss_growth,
)

from captum_attention import ALTI, DecompX, KnockoutGradient, KnockoutLRP, LearnedAttention, NormAttention, ValueZeroing  # noqa: E402
from captum_attention.maps import context_mixing, streaming  # noqa: E402
from captum_attention.metrics import attention_erasure, attention_shares  # noqa: E402

ERASURE = "attention_erasure"
NORM = NormAttention.__name__  # registered, not in METHODS: measured here all the same
ZEROING = ValueZeroing.__name__  # one re-run of each layer per token: measured only where --runs names it
LEARNED = LearnedAttention.__name__  # uniform weights (a fit's cost is its own): measured where --runs names it
CONTRIBUTIONS = ALTI.__name__  # O(H·N²·D) per layer: measured where --runs names it
NORM_RESIDUAL = "NormAttention(residual=True)"  # one re-run of the chosen layer: measured where --runs names it
KNOCKOUT = KnockoutGradient.__name__  # one forward and backward, as Grad-SAM: measured where --runs names it
JOINED = KnockoutLRP.__name__  # KnockoutGradient's and AttnLRP's passes: measured where --runs names it
DECOMPOSITION = DecompX.__name__  # one forward of N + 1 rows per example: measured where --runs names it
SENSITIVITY = "DecompX(multiply_by_inputs=False)"  # one forward and backward on any model: measured where --runs names it
SHARES = attention_shares.__name__  # one forward, each token its own segment: measured where --runs names it
ON_REQUEST = [ZEROING, LEARNED, CONTRIBUTIONS, NORM_RESIDUAL, KNOCKOUT, JOINED, DECOMPOSITION, SENSITIVITY, SHARES]
STREAMED = [*BASELINE, NORM, ERASURE]


MODELS = ["llama", "bert", "llama-1b", "llama-deep", "gemma2", "gpt-oss"]


def model_config(name: str, max_length: int) -> tf.PretrainedConfig:
    positions = max(max_length, 512)
    if name == "bert":
        return tf.BertConfig(
            vocab_size=1000, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
            intermediate_size=1536, max_position_embeddings=positions, num_labels=2,
        )
    shape = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
    if name == "gemma2":  # the Llama's shape with Gemma-2's logit softcap (50) and sliding window (4096)
        return tf.Gemma2Config(
            vocab_size=1000, max_position_embeddings=positions, num_labels=2, pad_token_id=0, head_dim=32, **shape
        )
    if name == "gpt-oss":  # the Llama's shape with gpt-oss's sinks, windows and experts
        return tf.GptOssConfig(
            vocab_size=1000, max_position_embeddings=positions, num_labels=2, pad_token_id=0, head_dim=32,
            num_local_experts=4, num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **shape,
        )
    if name == "llama-deep":  # the llama's width, 32 layers: where what a method does per layer shows at short inputs
        shape = {**shape, "num_hidden_layers": 32}
    if name == "llama-1b":
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8)
    return tf.LlamaConfig(
        vocab_size=32000 if name == "llama-1b" else 1000, max_position_embeddings=positions, num_labels=2,
        pad_token_id=0, **shape,
    )


def scaling_model(name: str, max_length: int, device: str, dtype: torch.dtype) -> tf.PreTrainedModel:
    """The model, initialised on ``device`` (a 1B model initialises in seconds on a GPU)."""
    torch.manual_seed(0)
    config = model_config(name, max_length)
    classifier = {
        "bert": tf.BertForSequenceClassification, "gemma2": tf.Gemma2ForSequenceClassification,
        "gpt-oss": tf.GptOssForSequenceClassification,
    }.get(name, tf.LlamaForSequenceClassification)
    with torch.device(device):
        return classifier(config).eval().to(dtype=dtype)


def recorded_query_key_bytes(config: tf.PretrainedConfig, dtype: torch.dtype, batch: int, length: int) -> int:
    """What a streaming forward keeps beyond the model's own: every layer's queries and keys."""
    head_dim = config.hidden_size // config.num_attention_heads
    heads = config.num_attention_heads + getattr(config, "num_key_value_heads", config.num_attention_heads)
    return config.num_hidden_layers * batch * length * heads * head_dim * dtype.itemsize


def workloads(options: argparse.Namespace, batch: int, length: int) -> dict[str, Callable[[], object]]:
    device, dtype = options.device, getattr(torch, options.dtype)
    model = scaling_model(options.model, max(options.lengths + [options.batch_length]), device, dtype)
    ids = torch.randint(5, 1000, (batch, length), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    runs = attention_runs(model, ids, mask, eager=length <= options.eager_max, block_memory=options.block_memory)
    erased = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)).to(device) < 0.1
    runs[ERASURE] = lambda: attention_erasure(model, ids, erased, (mask,), capture="streaming")
    runs[NORM] = lambda: NormAttention(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    runs[ZEROING] = lambda: ValueZeroing(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    runs[LEARNED] = lambda: LearnedAttention(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    runs[CONTRIBUTIONS] = lambda: ALTI(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    runs[NORM_RESIDUAL] = lambda: NormAttention(model, capture="streaming").attribute(
        ids, additional_forward_args=(mask,), residual=True
    )
    runs[KNOCKOUT] = lambda: KnockoutGradient(model, capture="streaming").attribute(ids, target=0, additional_forward_args=(mask,))
    runs[JOINED] = lambda: KnockoutLRP(model, capture="streaming").attribute(ids, target=0, additional_forward_args=(mask,))
    runs[DECOMPOSITION] = lambda: DecompX(model, capture="streaming").attribute(ids, target=0, additional_forward_args=(mask,))
    runs[SENSITIVITY] = lambda: DecompX(model, capture="streaming", multiply_by_inputs=False).attribute(
        ids, target=0, additional_forward_args=(mask,)
    )
    runs[SHARES] = lambda: attention_shares(model, ids[:, :-1], mask[:, :-1], ids[:, -1:], capture="streaming")
    return runs


def measure_here(run: Callable[[], object], repeats: int, device: str) -> dict[str, float]:
    """The peak memory growth of one call, then the median ms over ``repeats`` calls (the
    first call is the warm-up). On CPU the allocator returns freed blocks to the system
    (``MEASURING_ENV``) for the memory call, and keeps them as usual for the timed ones."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        sync()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = peak_rss_growth(run)
        usual_allocator()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return {"ms": 1000 * statistics.median(times), "MiB": peak / 2**20}


def usual_allocator() -> None:
    """glibc's thresholds back near their defaults after a ``MEASURING_ENV`` start, so that
    timed calls reuse freed blocks instead of paging fresh ones in."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 128 * 2**20)  # M_TRIM_THRESHOLD


def measure_in_subprocess(options: argparse.Namespace, name: str, batch: int, length: int) -> dict[str, float]:
    command = [
        sys.executable, __file__, "--one", name, "--model", options.model, "--dtype", options.dtype,
        "--batches", str(batch), "--lengths", str(length), "--repeats", str(options.repeats),
        "--eager-max", str(options.eager_max), "--batch-length", str(length), "--reduction", options.reduction,
    ] + (["--block-memory", str(options.block_memory)] if options.block_memory else [])
    out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MEASURING_ENV})
    if out.returncode != 0:  # e.g. killed for memory
        return {"ms": float("nan"), "MiB": float("nan"), "error": (out.stderr.strip().splitlines() or ["killed"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(options: argparse.Namespace, batch: int, length: int) -> dict[str, dict[str, float]]:
    names = [SDPA_FORWARD, SDPA_FORWARD_BACKWARD, *STREAMED]
    if length <= options.eager_max:
        names += [FORWARD, FORWARD_BACKWARD, *(name + EAGER for name in BASELINE)]
    if options.runs:
        names = [name for name in names if name in options.runs] + [name for name in ON_REQUEST if name in options.runs]
    if options.device == "cuda" or options.here:
        runs = workloads(options, batch, length)
        rows = {}
        for name in names:
            try:
                rows[name] = measure_here(runs[name], options.repeats, options.device)
            except Exception as failure:  # noqa: BLE001 - out of memory, or a kernel this card cannot run: the rest go on
                error = "out of memory" if isinstance(failure, torch.OutOfMemoryError) else (str(failure).strip().splitlines() or [type(failure).__name__])[0]
                rows[name] = {"ms": float("nan"), "MiB": float("nan"), "error": error[:200]}
                if options.device == "cuda":
                    torch.cuda.empty_cache()
    else:
        rows = {name: measure_in_subprocess(options, name, batch, length) for name in names}
    config = model_config(options.model, length)
    query_keys = recorded_query_key_bytes(config, getattr(torch, options.dtype), batch, length)
    rows["recorded Q/K"] = {"ms": 0.0, "MiB": query_keys / 2**20}
    return rows


def _ratio(rows: dict, name: str, base: str, plus: float = 0.0) -> str:
    run = rows.get(name)
    if run is None:
        return "—"
    if "error" in run:
        return f"fails ({run['error'][:30]})"
    return f"{run['ms'] / rows[base]['ms']:.2f}× / {run['MiB'] / (rows[base]['MiB'] + plus):.2f}×"


def table(results: list[dict]) -> str:
    """Markdown: the sdpa baselines, then each run as time ratio / memory ratio."""
    eager_names = [FORWARD_BACKWARD] + [name + EAGER for name in BASELINE]
    header = ["batch", "length", "sdpa fwd ms", "sdpa fwd+bwd ms", "sdpa fwd MiB", "sdpa fwd+bwd MiB", "Q/K MiB"]
    header += STREAMED + eager_names
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        rows = result["runs"]
        forward, backward, query_keys = rows[SDPA_FORWARD], rows[SDPA_FORWARD_BACKWARD], rows["recorded Q/K"]["MiB"]
        cells = [str(result["batch"]), str(result["length"]), f"{forward['ms']:.0f}", f"{backward['ms']:.0f}",
                 f"{forward['MiB']:.0f}", f"{backward['MiB']:.0f}", f"{query_keys:.0f}"]
        for name in STREAMED:
            base = BASELINE.get(name, SDPA_FORWARD)
            cells.append(_ratio(rows, name, base, query_keys if base == SDPA_FORWARD else 0.0))
        for name in eager_names:
            base = SDPA_FORWARD_BACKWARD if name == FORWARD_BACKWARD else BASELINE[name.removesuffix(EAGER)]
            cells.append(_ratio(rows, name, base))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", choices=MODELS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--batch-length", type=int, default=512, help="length at which batch sizes vary")
    parser.add_argument("--eager-max", type=int, default=4096, help="longest input the eager runs get")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--block-memory", type=int, help="bytes per block of recomputed rows (default: the library's)")
    parser.add_argument("--runs", nargs="+", help="measure only these runs (names as printed)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--here", action="store_true", help="measure in this process (CPU memory less exact)")
    parser.add_argument(
        "--reduction", default="default", choices=list(REDUCTIONS),
        help="how the streaming methods reduce each block of rows on --device: the library's default, the eager "
        "or compiled block reductions, or the Triton kernels (maps.fused; CUDA, or the CPU under TRITON_INTERPRET=1)",
    )
    parser.add_argument("--tables", type=Path, nargs="+", help="print the tables of these --json files, measure nothing")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


REDUCTIONS = {"default": None, "eager": (False, False), "compiled": (True, False), "triton": (False, True)}
"""``--reduction``: (compiled, Triton kernels) on the measured device; None leaves the
library's defaults (:data:`~captum_attention.maps.streaming.FUSED_DEVICES`,
:data:`~captum_attention.maps.streaming.FUSED_KERNEL_DEVICES`)."""


def use_reduction(name: str, device: str) -> None:
    """Sets the block reduction of ``device`` (:data:`REDUCTIONS`); compiled ones compile
    at once, in the untimed first call, and not after seconds of eager reductions."""
    if REDUCTIONS[name] is None:
        return
    streaming.FUSED_DEVICES[device], streaming.FUSED_KERNEL_DEVICES[device] = REDUCTIONS[name]
    if name == "compiled":
        streaming.COMPILE_AFTER_SECONDS = 0.0


def main(argv: list[str] | None = None) -> list[dict]:
    options = parse(argv)
    if options.tables:
        for path in options.tables:
            saved = json.loads(path.read_text())
            if not all({SDPA_FORWARD, SDPA_FORWARD_BACKWARD} <= set(result["runs"]) for result in saved["results"]):
                print(f"{path.name}: no sdpa baselines to take ratios against, skipped\n")
                continue
            print(f"{path.name}: {saved['model']} ({saved['dtype']}) on {saved['device']}, "
                  f"{saved.get('reduction', 'default')} block reduction\n\n{table(saved['results'])}\n")
        return []
    use_reduction(options.reduction, options.device)
    if options.device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if options.one:  # one run in this (fresh) process: warm up short (compiling the block reductions), then measure
        least, streaming.FUSED_MIN_PAIRS = streaming.FUSED_MIN_PAIRS, 0
        least_alti, context_mixing.ALTI_COMPILE_MIN_PAIRS = context_mixing.ALTI_COMPILE_MIN_PAIRS, 0
        after, streaming.COMPILE_AFTER_SECONDS = streaming.COMPILE_AFTER_SECONDS, 0.0
        workloads(options, 1, 64)[options.one]()
        streaming.FUSED_MIN_PAIRS, streaming.COMPILE_AFTER_SECONDS = least, after
        context_mixing.ALTI_COMPILE_MIN_PAIRS = least_alti
        run = workloads(options, options.batches[0], options.lengths[0])[options.one]
        print(json.dumps(measure_here(run, options.repeats, options.device)))
        return []
    device_name = device_description(options.device)
    print(f"scaling: {options.model} ({options.dtype}) on {device_name}, torch {torch.__version__}, "
          f"{options.reduction} block reduction\n", flush=True)
    settings = [(1, length) for length in options.lengths]
    settings += [(batch, options.batch_length) for batch in options.batches if batch != 1]
    settings.sort(key=lambda setting: setting[0] * setting[1])  # the cheapest first: a run cut short keeps the most rows
    results = []
    for batch, length in settings:
        started = time.perf_counter()
        runs = measure(options, batch, length)
        results.append({"batch": batch, "length": length, "runs": runs})
        print(f"batch {batch} length {length} ({time.perf_counter() - started:.0f} s): "
              + ", ".join(f"{n} {r['ms']:.0f} ms {r['MiB']:.0f} MiB" for n, r in runs.items()), flush=True)
        if options.json:  # after every row, so that an interrupted run keeps what it measured
            options.json.write_text(json.dumps({
                "device": device_name, "model": options.model, "dtype": options.dtype, "reduction": options.reduction,
                "results": results,
            }, indent=1))
    if {SDPA_FORWARD, SDPA_FORWARD_BACKWARD} <= set(options.runs or [SDPA_FORWARD, SDPA_FORWARD_BACKWARD]):  # the ratios' bases
        print()
        print(table(results))
    return results


if __name__ == "__main__":
    main()
