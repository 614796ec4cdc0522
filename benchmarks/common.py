"""The benchmark model and batch: a 6-layer, 384-wide, 12-head BERT classifier, 8 × 128 tokens."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch
import transformers as tf

BATCH, SEQ_LEN = 8, 128


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
