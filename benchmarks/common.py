"""The benchmark model and batch: a 6-layer, 384-wide, 12-head BERT classifier, 8 × 128 tokens."""

from __future__ import annotations

import copy
import os
import statistics
import threading
import time
from typing import Callable

import torch
import transformers as tf

from captum_attention import METHODS

BATCH, SEQ_LEN = 8, 128


def device_description(device: str = "cpu") -> str:
    """The machine a benchmark measured on, for its results: the card's name on CUDA; on the
    CPU its model name, the vector instructions torch's kernels use and the threads (ratios
    to the model's own passes differ from one CPU to another)."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    return f"CPU ({model}, {torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads"


def context_cite_weights(kept: torch.Tensor, outcomes: torch.Tensor, alpha: float = 0.01) -> torch.Tensor:
    """ContextCite's surrogate (Cohen-Wang et al., 2024; reimplemented from the paper): a
    Lasso of ``alpha`` on the standardised keep-masks ``kept`` ``(A, S)`` of ``A`` random
    ablations against their ``outcomes`` ``(A,)`` (the explained output's logit-probability);
    ``(S,)`` float32 weights, per unit of a mask."""
    from sklearn.linear_model import Lasso
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    scaler, lasso = StandardScaler(), Lasso(alpha=alpha, random_state=0)
    make_pipeline(scaler, lasso).fit(kept.float().numpy(), outcomes.double().numpy())
    return torch.tensor(lasso.coef_ / scaler.scale_.clip(min=1e-12), dtype=torch.float32)


def benchmark_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tf.PreTrainedModel:
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=2,
    )
    return tf.BertForSequenceClassification(config).eval().to(device=device, dtype=dtype)


def benchmark_batch(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with lengths spread over 64..128 (right padding)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (BATCH, SEQ_LEN), generator=generator)
    lengths = torch.linspace(64, SEQ_LEN, BATCH).long()
    mask = (torch.arange(SEQ_LEN)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_growth(run: Callable[[], object]) -> int:
    """Peak resident-set growth during one call of ``run`` (call it once before, warm).

    Meaningful in a process started with ``MALLOC_MMAP_THRESHOLD_`` low, so that freed
    tensors go back to the system and the resident set follows the live ones.
    """
    peak, done = [0], threading.Event()
    start = _rss_bytes()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    run()
    done.set()
    sampler.join()
    return max(peak[0], _rss_bytes()) - start


# Large blocks are mmap-ed and returned to the system when freed, so the resident set of a
# subprocess started with this environment follows the live tensors.
MEASURING_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


SDPA_FORWARD = "forward (sdpa)"
SDPA_FORWARD_BACKWARD = "forward+backward (sdpa)"
FORWARD = "forward with attentions"
FORWARD_BACKWARD = "forward+backward with attentions"
EAGER = " (eager)"
# Each registered method against the model's own pass it extends, a forward or (for the
# gradient methods) a forward+backward: streaming runs against the model's sdpa kernel,
# eager runs (name + EAGER) against the eager model that outputs its attentions.
BASELINE = {
    cls.__name__: SDPA_FORWARD_BACKWARD if cls.spec.uses_backward else SDPA_FORWARD for cls in METHODS.values()
}
EAGER_BASELINE = {
    name + EAGER: FORWARD_BACKWARD if base == SDPA_FORWARD_BACKWARD else FORWARD for name, base in BASELINE.items()
}
ALL_BASELINES = {**BASELINE, **EAGER_BASELINE}
RUN_NAMES = [SDPA_FORWARD, SDPA_FORWARD_BACKWARD, FORWARD, FORWARD_BACKWARD, *BASELINE, *EAGER_BASELINE]
TARGET = 1


def attention_runs(
    model: tf.PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, eager: bool = True, block_memory: int | None = None
) -> dict[str, Callable[[], object]]:
    """Zero-argument calls, by ``RUN_NAMES``: the model's own sdpa forward and forward+backward
    (to the input embeddings), each registered method streaming; with ``eager``, also the
    eager forward and forward+backward with attentions (on an eager copy) and each method
    with ``capture="eager"``."""
    args = dict(additional_forward_args=(mask,))
    memory = {} if block_memory is None else {"block_memory": block_memory}

    def forward_backward(on: tf.PreTrainedModel, **extra: object) -> None:
        embeds = on.get_input_embeddings()(ids).detach().requires_grad_()
        logits = on(inputs_embeds=embeds, attention_mask=mask, **extra).logits
        torch.autograd.grad(logits[:, TARGET].sum(), embeds)

    def forward(on: tf.PreTrainedModel, **extra: object) -> object:
        with torch.no_grad():
            return on(ids, attention_mask=mask, **extra).logits

    def method(cls: type, capture: str) -> Callable[[], object]:
        return lambda: cls(model, capture=capture, **memory).attribute(ids, target=TARGET, **args)

    runs: dict[str, Callable[[], object]] = {
        SDPA_FORWARD: lambda: forward(model),
        SDPA_FORWARD_BACKWARD: lambda: forward_backward(model),
        **{cls.__name__: method(cls, "streaming") for cls in METHODS.values()},
    }
    if eager:
        eager_model = copy.deepcopy(model)
        eager_model.set_attn_implementation("eager")
        runs[FORWARD] = lambda: forward(eager_model, output_attentions=True)
        runs[FORWARD_BACKWARD] = lambda: forward_backward(eager_model, output_attentions=True)
        runs.update({cls.__name__ + EAGER: method(cls, "eager") for cls in METHODS.values()})
    return runs


def median_seconds(
    runs: dict[str, Callable[[], object]], repeats: int | dict[str, int], sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median wall time of each run after a warm-up; rounds interleave the runs so that
    drift hits all alike. ``sync`` waits for the device (``torch.cuda.synchronize``)."""
    counts = repeats if isinstance(repeats, dict) else {name: repeats for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for round_index in range(max(counts.values())):
        for name, run in runs.items():
            if round_index < counts[name]:
                sync()
                start = time.perf_counter()
                run()
                sync()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
