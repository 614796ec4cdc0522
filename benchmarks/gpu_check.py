"""GPU check: CUDA scores equal CPU scores, bf16 works, and what each method costs there.

One command for a GPU machine (where captum is not installed, carry its wheel, and
transformers' if the machine's is older than this package needs):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site:. python3 benchmarks/gpu_check.py

Prints, for the benchmark BERT (6 layers, 384 wide, 12 heads) on 8 × 128 tokens:
the largest difference of each method relative to its score scale (the target is 1e-5
in fp32) between CUDA streaming, CUDA eager and CPU eager capture (and of attention
erasure, comprehensiveness and the permutation test, whose draws are hashed alike on
both devices), the bf16/fp32
difference of streaming on CUDA, and median CUDA time and peak memory of each run
against its baseline (``common.ALL_BASELINES``). Then the same
CPU/CUDA agreement for the other families, on the tiny models of the test suite
(GPT-2, Llama with grouped-query attention, T5, ViT, nn.MultiheadAttention), and of a
language model's answer (``attribute_span`` and ``attribute_continuation`` rows, both
capture modes, GPT-2 and Llama with left padding), and of the architectures reached
through the adapter's fallbacks (``architecture_agreement``). ``kernel_agreement`` and
``kernel_tiles`` check and time the Triton kernels (``gpu_run.sh kernels``). ``main`` and
the agreement checks take the two devices: on ``("cpu", "cpu")`` they run dry, as
``tests/test_benchmarks_smoke.py`` runs them, so that a script error shows before the
script runs on a card.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import time
from functools import partial

import torch

# The tests' conftest, which some of their model builders import, turns Triton's interpreter on
# for the CPU kernel tests; on a card the kernels must compile (a value set beforehand stays).
os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from common import (  # noqa: E402
    ALL_BASELINES,
    BATCH,
    FORWARD,
    FORWARD_BACKWARD,
    SDPA_FORWARD,
    SDPA_FORWARD_BACKWARD,
    SEQ_LEN,
    attention_runs,
    benchmark_batch,
    benchmark_model,
)

from captum_attention import METHODS as REGISTERED  # noqa: E402
from captum_attention._compat import UnsupportedModelError  # noqa: E402
from captum_attention.metrics import attention_erasure, attention_permutation, comprehensiveness, random_ranking  # noqa: E402

METHODS = {cls.__name__: (cls, {"target": 1}) for cls in REGISTERED.values()}


def scores(device: str, dtype: torch.dtype, capture: str = "auto") -> dict[str, torch.Tensor]:
    model = benchmark_model(device, dtype)
    ids, mask = benchmark_batch(device)
    return {
        name: cls(model, capture=capture).attribute(ids, additional_forward_args=(mask,), **options).float().cpu()
        for name, (cls, options) in METHODS.items()
    }


def cuda_cost(run, device: str = "cuda") -> tuple[float, int]:
    """Median milliseconds over 20 runs and peak allocated bytes of one run. On the CPU (a
    dry run of the device script under ``TRITON_INTERPRET=1``) one timed run and no peak."""
    if device != "cuda":
        start = time.perf_counter()
        run()
        return 1000 * (time.perf_counter() - start), 0
    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak


def main(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """The benchmark BERT's scores, metrics and costs on ``devices[1]`` against
    ``devices[0]`` (on ``("cpu", "cpu")`` a dry run of the device script); returns the worst
    difference of the fp32 scores relative to their scale."""
    reference, device = devices
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device: run this on the GPU machine.")
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"device: {name}, torch {torch.__version__}, batch {BATCH} x {SEQ_LEN}")
    cpu = scores(reference, torch.float32, "eager")
    gpu, gpu_eager = scores(device, torch.float32, "streaming"), scores(device, torch.float32, "eager")
    bf16 = scores(device, torch.bfloat16, "streaming")
    print("\n| method | streaming cuda vs eager cpu (fp32) | eager cuda vs eager cpu | streaming bf16 vs fp32 |")
    print("|---|---|---|---|")
    worst = 0.0
    for method in METHODS:
        scale = cpu[method].abs().max().item()
        fp32_error = (gpu[method] - cpu[method]).abs().max().item() / scale
        eager_error = (gpu_eager[method] - cpu[method]).abs().max().item() / scale
        bf16_error = (bf16[method] - gpu[method]).abs().max().item() / scale
        worst = max(worst, fp32_error, eager_error)
        print(f"| {method} | {fp32_error:.2e} | {eager_error:.2e} | {bf16_error:.2e} |")
    print(f"\nCPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")

    metric_gaps = {}
    for key, on in zip(("cpu", "cuda"), devices):
        model = benchmark_model(on)
        ids, mask = benchmark_batch(on)
        erased = random_ranking(ids.shape, seed=0).to(on) > 0.7
        forward = lambda i, m, model=model: model(i, attention_mask=m).logits  # noqa: E731
        metric_gaps[key] = (
            attention_erasure(model, ids, erased, (mask,)).js_divergence.cpu(),
            comprehensiveness(forward, ids, mask, random_ranking(ids.shape, seed=1).to(on)).cpu(),
            attention_permutation(model, ids, (mask,), n_permutations=3).median_tvd.cpu(),  # the same hashed draws
        )
    names = ("attention_erasure JS", "comprehensiveness", "attention_permutation median TVD")
    for metric, cpu_value, gpu_value in zip(names, metric_gaps["cpu"], metric_gaps["cuda"]):
        print(f"{metric}: max |cuda-cpu| = {(gpu_value - cpu_value).abs().max().item():.2e}")

    ids, mask = benchmark_batch(device)
    costs = {run_name: cuda_cost(run, device) for run_name, run in attention_runs(benchmark_model(device), ids, mask).items()}
    print("\n| run | median ms | x baseline time | x baseline peak memory |")
    print("|---|---|---|---|")
    for run_name in (SDPA_FORWARD, SDPA_FORWARD_BACKWARD, FORWARD, FORWARD_BACKWARD):
        print(f"| {run_name} | {costs[run_name][0]:.2f} | | |")
    for run_name, baseline in ALL_BASELINES.items():
        (ms, peak), (base_ms, base_peak) = costs[run_name], costs[baseline]
        print(f"| {run_name} | {ms:.2f} | {ms / base_ms:.2f} | {peak / base_peak if base_peak else float('nan'):.2f} |")
    return worst


def _refused_or(explain) -> object:
    """``explain()``'s scores, or "refused: " and the library's one-line refusal (a method
    that does not cover a family says so on every device)."""
    try:
        return explain()
    except UnsupportedModelError as refusal:
        return f"refused: {str(refusal).splitlines()[0][:80]}"


def family_agreement(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """Worst CPU/CUDA difference (relative to the score scale) over families and methods."""
    from lm_models import make_decoder, make_encoder_decoder, make_prompts, make_vision
    from plain_models import make_plain

    prompts, right_padded = make_prompts(side="left"), make_prompts(side="right")  # the MHA classifier reads position 0
    pair = (torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]]), torch.tensor([[4, 5, 6], [7, 8, 0]]))
    pair_masks = ((pair[0] != 0).long(), (pair[1] != 0).long())
    cases = {
        "gpt2": (lambda: make_decoder("gpt2"), prompts.input_ids, (prompts.attention_mask,)),
        "llama (GQA)": (lambda: make_decoder("llama"), prompts.input_ids, (prompts.attention_mask,)),
        "t5": (lambda: make_encoder_decoder("t5"), pair, pair_masks),
        "vit": (lambda: make_vision("vit"), torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), None),
        "nn.MultiheadAttention": (lambda: make_plain("mha"), right_padded.input_ids, (right_padded.attention_mask,)),
    }
    print("\n| family | method | max |cuda-cpu| / scale |")
    print("|---|---|---|")
    worst = 0.0
    for family, (build, inputs, args) in cases.items():
        results = {}
        for key, device in zip(("cpu", "cuda"), devices):
            model = build().to(device)
            moved = tuple(t.to(device) for t in inputs) if isinstance(inputs, tuple) else inputs.to(device)
            moved_args = None if args is None else tuple(t.to(device) for t in args)
            results[key] = {name: _refused_or(lambda: cls(model).attribute(moved, additional_forward_args=moved_args))
                            for name, (cls, _) in METHODS.items()}
        for name in METHODS:
            cpu_scores, gpu_scores = results["cpu"][name], results["cuda"][name]
            if isinstance(cpu_scores, str) or isinstance(gpu_scores, str):
                print(f"| {family} | {name} | {cpu_scores if isinstance(cpu_scores, str) else gpu_scores} |")
                continue
            pairs = zip(cpu_scores, gpu_scores) if isinstance(cpu_scores, tuple) else [(cpu_scores, gpu_scores)]
            error = max(
                (g.cpu() - c).abs().max().item() / max(c.abs().max().item(), 1e-30) for c, g in pairs
            )
            worst = max(worst, error)
            print(f"| {family} | {name} | {error:.2e} |")
    print(f"\nfamilies: CPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")
    return worst


def answer_agreement(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """Worst CPU/CUDA difference of answer explanations (span and token rows, both modes)."""
    from lm_models import make_decoder, make_prompts

    prompts = make_prompts(side="left")
    answer = torch.randint(3, 20, (3, 4), generator=torch.Generator().manual_seed(2))
    print("\n| decoder | method | capture | span | token rows |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for family in ("gpt2", "llama"):
        models = {key: make_decoder(family).to(device) for key, device in zip(("cpu", "cuda"), devices)}
        for name, cls in REGISTERED.items():
            for capture in ("streaming", "eager"):
                errors = []
                for call in ("attribute_span", "attribute_continuation"):
                    options = {"log_prob": True} if call == "attribute_continuation" else {}
                    scores = {
                        key: getattr(cls(model, capture=capture), call)(
                            prompts.input_ids.to(device), answer.to(device),
                            additional_forward_args=(prompts.attention_mask.to(device),), **options,
                        ).cpu()
                        for (key, model), device in zip(models.items(), devices)
                    }
                    scale = max(scores["cpu"].abs().max().item(), 1e-30)
                    errors.append((scores["cuda"] - scores["cpu"]).abs().max().item() / scale)
                worst = max(worst, *errors)
                print(f"| {family} | {name} | {capture} | {errors[0]:.2e} | {errors[1]:.2e} |")
    print(f"\nanswers: CPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")
    return worst


def context_mixing_agreement(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """Worst CPU/CUDA difference of the context-mixing methods registered outside the
    reports (both capture modes; the decoders' answers too), on the test suite's BERT,
    GPT-2 and Llama (grouped-query, left padding; DecompX there through one backward, on
    the others through the forward on the shares; its sensitivity through one backward on
    all three)."""
    from lm_models import one_stack_case

    from captum_attention import ALTI, ALTILogit, DecompX, LearnedAttention, NormAttention, ValueZeroing

    methods = {
        "NormAttention": (NormAttention, {}), "NormAttention(residual=True)": (NormAttention, {"residual": True}),
        "ALTI": (ALTI, {}), "ALTILogit": (ALTILogit, {}), "ValueZeroing": (ValueZeroing, {}),
        "LearnedAttention": (LearnedAttention, {}), "DecompX": (DecompX, {}),  # Llama's through one backward
        "DecompX(multiply_by_inputs=False)": (partial(DecompX, multiply_by_inputs=False), {}),  # one backward, biases offset
    }
    answer = torch.tensor([[5, 9], [7, 3], [11, 4]])
    print("\n| family | method | capture | sequence | answer span |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for family in ("bert", "gpt2", "llama"):
        _, ids, mask, _ = one_stack_case(family)
        models = [one_stack_case(family)[0].to(device) for device in devices]
        for name, (cls, options) in methods.items():
            if family == "bert" and cls is ALTILogit:
                continue
            for capture in ("streaming", "eager"):
                errors = []
                calls = [("attribute", ids)] + ([] if family == "bert" else [("attribute_span", ids)])
                for call, inputs in calls:
                    extra = (answer,) if call == "attribute_span" else ()
                    first, second = (
                        getattr(cls(built, capture=capture), call)(
                            inputs.to(device), *(t.to(device) for t in extra),
                            additional_forward_args=(mask.to(device),), **options,
                        ).float().cpu()
                        for built, device in zip(models, devices)
                    )
                    errors.append((second - first).abs().max().item() / max(first.abs().max().item(), 1e-30))
                worst = max(worst, *errors)
                shown = " | ".join(f"{e:.2e}" for e in errors) + (" | —" if len(errors) == 1 else "")
                print(f"| {family} | {name} | {capture} | {shown} |")
    print(f"\ncontext mixing: CPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")
    return worst


def seq2seq_answer_agreement(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """Worst CPU/CUDA difference of an encoder-decoder's answer (span and token rows, both
    sides, both capture modes) on the test suite's BART (its T5, peaked on purpose, differs
    between float32 and float64 on the CPU alone by up to 1.2e-3 of the scale on these
    spans: no measure of a device)."""
    from lm_models import make_encoder_decoder

    source = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    answer = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    print("\n| encoder-decoder | method | capture | span | token rows |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for family in ("bart",):
        models = [make_encoder_decoder(family).to(device) for device in devices]
        for name, cls in REGISTERED.items():
            for capture in ("streaming", "eager"):
                errors = []
                for call in ("attribute_span", "attribute_continuation"):
                    first, second = (
                        getattr(cls(model, capture=capture), call)(
                            source.to(device), answer.to(device), additional_forward_args=(mask.to(device),)
                        )
                        for model, device in zip(models, devices)
                    )
                    scale = max(side.abs().max().item() for side in first)
                    errors.append(max((b.cpu() - a.cpu()).abs().max().item() for a, b in zip(first, second)) / max(scale, 1e-30))
                worst = max(worst, *errors)
                print(f"| {family} | {name} | {capture} | {errors[0]:.2e} | {errors[1]:.2e} |")
    print(f"\nseq2seq answers: CPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")
    return worst


def architecture_agreement(devices: tuple[str, str] = ("cpu", "cuda")) -> float:
    """Worst CPU/CUDA difference over the families the architecture sweep (``tests/zoo.py``)
    reaches through its fallbacks: attention found through ``output_attentions`` (BLOOM,
    DeBERTa-v2, MPT), no sdpa (Gemma-2), encoder-decoder classifiers (BART)."""
    import zoo

    print("\n| architecture | method | capture | max |cuda-cpu| / scale |")
    print("|---|---|---|---|")
    worst = 0.0
    for model_type in ("bloom", "deberta-v2", "mpt", "gemma2", "bart"):
        architecture = next(a for a in zoo.architectures("sequence classification") if a.model_type == model_type)
        cases = {}
        for key, device in zip(("cpu", "cuda"), devices):
            case = zoo.make_case(zoo.build(architecture).to(device), architecture)
            moved = tuple(t.to(device) for t in case.inputs) if isinstance(case.inputs, tuple) else case.inputs.to(device)
            case.inputs, case.args = moved, None if case.args is None else tuple(t.to(device) for t in case.args)
            cases[key] = case
        for name in REGISTERED:
            cpu_scores, gpu_scores = (zoo.explain(cases[key], name) for key in ("cpu", "cuda"))
            pairs = zip(cpu_scores, gpu_scores) if isinstance(cpu_scores, tuple) else [(cpu_scores, gpu_scores)]
            error = max((g.cpu() - c).abs().max().item() / max(c.abs().max().item(), 1e-30) for c, g in pairs)
            worst = max(worst, error)
            print(f"| {model_type} | {name} | auto | {error:.2e} |")
    print(f"\narchitectures: CPU/CUDA agreement within 1e-5 of the score scale: {'PASS' if worst <= 1e-5 else 'FAIL'}")
    return worst


def kernel_agreement(device: str = "cuda") -> float:
    """The Triton kernels (``maps.fused``; on CUDA by default) against the eager block reductions
    on ``device``: Grad-SAM (both axes), Transformer Attribution, rollout and erasure on the
    benchmark BERT in fp32 and bf16, and the median time of each (the kernels' first
    measurement on a card); then the same scores on the test suite's tiny Gemma-2 (logit
    softcap) and gpt-oss (sinks) in fp32."""
    from captum_attention import AttentionRollout, GradSAM, TransformerAttribution
    from captum_attention.metrics import attention_erasure

    runs = {
        "GradSAM": lambda model, ids, mask: GradSAM(model, capture="streaming").attribute(ids, target=1, additional_forward_args=(mask,)),
        "GradSAM (key axis)": lambda model, ids, mask: GradSAM(model, capture="streaming").attribute(
            ids, target=1, additional_forward_args=(mask,), axis="key"),
        "TransformerAttribution": lambda model, ids, mask: TransformerAttribution(model, capture="streaming").attribute(
            ids, target=1, additional_forward_args=(mask,)),
        "AttentionRollout": lambda model, ids, mask: AttentionRollout(model, capture="streaming").attribute(
            ids, additional_forward_args=(mask,)),
        "attention_erasure": lambda model, ids, mask: attention_erasure(
            model, ids, mask.bool() & (ids % 10 == 0), (mask,), capture="streaming").erased,
    }
    print("\n| method | dtype | max |triton-eager| / scale | eager ms | triton ms | reduced by (triton on) |")
    print("|---|---|---|---|---|---|")
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for dtype in worst:
        model = benchmark_model(device, dtype)
        ids, mask = benchmark_batch(device)
        for name, run in runs.items():
            worst[dtype] = max(worst[dtype], _compare_kernels(name, dtype, lambda: run(model, ids, mask), device, timed=True))
    from lm_models import EXPLICIT_DECODERS, make_decoder, make_prompts

    for decoder in EXPLICIT_DECODERS:  # the logit softcap and the sinks, on tiny decoders with left padding
        model, prompts = make_decoder(decoder).to(device), make_prompts(side="left")
        ids, mask = prompts.input_ids.to(device), prompts.attention_mask.to(device)
        for name, run in runs.items():
            error = _compare_kernels(f"{name} ({decoder})", torch.float32, lambda: run(model, ids, mask), device, timed=False)
            worst[torch.float32] = max(worst[torch.float32], error)
    passed = worst[torch.float32] <= 1e-5 and worst[torch.bfloat16] <= 2e-2
    print(f"\nTriton kernels: fp32 within 1e-5, bf16 within 2e-2 of the eager reductions: {'PASS' if passed else 'FAIL'}")
    return worst[torch.float32]


class _Paths(logging.Handler):
    """The paths that reduced the streaming calls (``maps.streaming``'s debug lines)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.add(record.getMessage().split(" reduce ")[0])


def _compare_kernels(name: str, dtype: torch.dtype, run, device: str, timed: bool) -> float:
    """One row of :func:`kernel_agreement`: ``run`` with the Triton kernels off, then on;
    inf where it fails (the error's first line printed), so that the other rows still run."""
    from captum_attention.maps import streaming

    logger, paths = logging.getLogger(streaming.__name__), _Paths()
    level, default = logger.level, streaming.FUSED_KERNEL_DEVICES.get(device, False)
    logger.setLevel(logging.DEBUG)
    results = {}
    try:
        for on in (False, True):
            streaming.FUSED_KERNEL_DEVICES[device] = on
            if on:
                logger.addHandler(paths)
            scores = run().float().cpu()
            results[on] = (scores, cuda_cost(run, device)[0] if timed else float("nan"))
    except Exception as failure:  # noqa: BLE001 - a kernel that does not compile or launch on this card
        print(f"| {name} | {str(dtype).removeprefix('torch.')} | fails: {(str(failure).strip().splitlines() or [type(failure).__name__])[0][:120]} | | | |")
        print(str(failure)[-1500:], file=sys.stderr)
        return float("inf")
    finally:
        streaming.FUSED_KERNEL_DEVICES[device] = default
        logger.removeHandler(paths)
        logger.setLevel(level)
    (eager, eager_ms), (fused, fused_ms) = results[False], results[True]
    error = (fused - eager).abs().max().item() / max(eager.abs().max().item(), 1e-30)
    times = f"{eager_ms:.2f} | {fused_ms:.2f}" if timed else "— | —"
    print(f"| {name} | {str(dtype).removeprefix('torch.')} | {error:.2e} | {times} | "
          f"{', '.join(sorted(paths.seen)) or '—'} |", flush=True)
    return error


TILE_CHOICES = [(64, 64, 4, 2), (32, 32, 4, 1), (64, 128, 4, 2), (128, 64, 8, 3), (128, 32, 4, 3)]
"""``maps.fused.Tiles(rows, keys, warps, stages)`` that :func:`kernel_tiles` times, the
default first (each shape compiles three kernels, a few seconds on a card)."""


def kernel_tiles(device: str = "cuda", length: int = 16384) -> None:
    """The Triton kernels' launch shapes timed on one causal bf16 layer shaped like
    Llama-3.2-1B's (32 query heads over 8 key heads of 64), against that layer's own sdpa
    forward and forward+backward: which ``maps.fused.TILES`` to make the default. Each
    shape's results are checked against the first's."""
    import torch.nn.functional as F

    from captum_attention.maps import fused
    from captum_attention.maps.kernel import KernelCall

    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(torch.bfloat16)

    query, key, value = rand(1, 32, length, 64), rand(1, 8, length, 64), rand(1, 8, length, 64)
    grad_output = rand(1, length, 32, 64)
    call = KernelCall(query, key, value, 64**-0.5, None, True, groups=4)
    key_weights, row_weights = torch.ones(1, length, device=device), torch.rand(1, length, device=device)
    erase = call.erase_bias(torch.rand(1, length, device=device) < 0.1, None)
    kernels = {
        "row sums": lambda: fused.positive_row_sums(call, grad_output, key_weights),
        "column sums": lambda: fused.weighted_column_sums(call, grad_output, row_weights, key_weights),
        "erasure": lambda: fused.erased_attention(call, erase),
        "rollout's column sums": lambda: fused.column_sums(call, row_weights, key_weights),
    }
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]

    def rollout_by_sdpa_backward() -> torch.Tensor:  # dV = Aᵀ·dO with every column of dO the row weights
        value_leaf = value.detach().requires_grad_()
        out = F.scaled_dot_product_attention(query, key, value_leaf, is_causal=True, enable_gqa=True)
        weights = row_weights.to(out.dtype)[:, None, :, None].expand(out.shape)
        return torch.autograd.grad(out, value_leaf, weights)[0].float().sum(dim=1)[..., 0]

    def forward_backward() -> None:
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(grad_output.transpose(1, 2))

    forward_ms = cuda_cost(lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True), device)[0]
    print(f"\nOne Llama-1B-shaped layer, {length} tokens, bf16: sdpa forward {forward_ms:.2f} ms, "
          f"forward+backward {cuda_cost(forward_backward, device)[0]:.2f} ms")
    through_sdpa, through_kernel = rollout_by_sdpa_backward(), kernels["rollout's column sums"]().float()
    print(f"rollout's column step through sdpa's backward (dV = Aᵀ·dO): {cuda_cost(rollout_by_sdpa_backward, device)[0]:.2f} ms, "
          f"max rel. diff from the column sums kernel {float((through_sdpa - through_kernel).abs().max() / through_kernel.abs().max()):.1e}")
    print("\n| tiles (rows, keys, warps, stages) | " + " | ".join(f"{name} ms" for name in kernels) + " | max rel. diff |")
    print("|---|" + "---|" * (len(kernels) + 1))
    default, first = fused.TILES[device], None
    for choice in TILE_CHOICES:
        fused.TILES[device] = fused.Tiles(*choice)
        try:
            results = [run().float() for run in kernels.values()]
            first = first or results
            diff = max(float((r - f).abs().max() / f.abs().max().clamp(min=1e-30)) for r, f in zip(results, first))
            print(f"| {choice} | " + " | ".join(f"{cuda_cost(run, device)[0]:.2f}" for run in kernels.values()) + f" | {diff:.1e} |", flush=True)
        except Exception as error:  # noqa: BLE001 - a shape this card cannot launch (registers, shared memory)
            print(f"| {choice} | fails: {str(error).splitlines()[0][:80]} |", flush=True)
    fused.TILES[device] = default


def widened_heads(device: str = "cuda", length: int = 16384) -> None:
    """Whether sdpa's fast kernels take heads one dimension wider, as the key bias makes
    them (:func:`~captum_attention.capture.kernel.key_bias_applies`: query 1, key ``bias /
    scale``, the values padded with a zero), or padded to the next multiple of 8: one causal
    layer shaped like Llama-3.2-1B's (32 query heads over 8 key heads of 64), its forward
    and backward under each sdpa backend alone and under sdpa's own choice, in bf16 and
    fp32. A backend that refuses a shape says so in its cell."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa's choice": None, **{b.name.lower(): b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                                         SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)}}
    generator = torch.Generator(device=device).manual_seed(0)
    print(f"\nOne Llama-1B-shaped causal layer, {length} tokens: sdpa forward+backward ms by head dimension and backend")
    print("\n| dtype | head dim | " + " | ".join(backends) + " |")
    print("|---|---|" + "---|" * len(backends))
    for dtype in (torch.bfloat16, torch.float32):
        for width in (64, 65, 72):
            leaves = [torch.randn(1, heads, length, width, device=device, generator=generator).to(dtype).requires_grad_()
                      for heads in (32, 8, 8)]

            def forward_backward() -> None:
                F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).sum().backward()

            cells = []
            for backend in backends.values():
                try:
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        cells.append(f"{cuda_cost(forward_backward, device)[0]:.2f}")
                except RuntimeError:  # no kernel of this backend takes the shape (its warning says why)
                    cells.append("refused")
            print(f"| {str(dtype).removeprefix('torch.')} | {width} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
    family_agreement()
    answer_agreement()
    architecture_agreement()
