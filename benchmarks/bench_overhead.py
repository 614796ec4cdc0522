"""pytest-benchmark harness for the per-method overhead (not part of the test suite).

    python -m pytest benchmarks/bench_overhead.py --benchmark-columns=median,iqr,rounds
    python -m pytest benchmarks/bench_overhead.py --benchmark-compare   # against a saved run

Benchmarks the model's own passes (sdpa forward and forward+backward; eager forward and
forward+backward with attentions) next to each method, streaming and eager, on the
6-layer BERT of ``common.py`` (8 × 128 tokens), so that ratios are read within one run. ``CAPTUM_ATTENTION_BENCH_SMOKE=1`` shrinks the
model and batch for a quick check (what CI runs, with ``--benchmark-disable``).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import ALL_BASELINES, RUN_NAMES  # noqa: E402

SMOKE = os.environ.get("CAPTUM_ATTENTION_BENCH_SMOKE") == "1"


@pytest.fixture(scope="module")
def setup() -> tuple[dict[str, Callable[[], object]], torch.Size]:
    import transformers as tf
    from common import attention_runs, benchmark_batch, benchmark_model

    torch.set_num_threads(min(2, torch.get_num_threads()))
    if SMOKE:
        torch.manual_seed(0)
        config = tf.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, num_labels=2)
        model = tf.BertForSequenceClassification(config).eval()
        ids = torch.randint(5, 100, (2, 16))
        mask = torch.ones_like(ids)
    else:
        model = benchmark_model()
        ids, mask = benchmark_batch()
    return attention_runs(model, ids, mask), ids.shape


@pytest.mark.parametrize("name", RUN_NAMES)
def test_overhead(benchmark, setup, name):  # type: ignore[no-untyped-def]
    runs, input_shape = setup
    benchmark.group = "captum-attention overhead"
    result = benchmark(runs[name])
    if name in ALL_BASELINES:
        assert result.shape == input_shape
