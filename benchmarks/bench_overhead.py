"""pytest-benchmark harness for the per-method overhead (not part of the test suite).

    python -m pytest benchmarks/bench_overhead.py --benchmark-columns=median,iqr,rounds
    python -m pytest benchmarks/bench_overhead.py --benchmark-compare   # against a saved run

Benchmarks the model's own passes (forward with attentions, forward+backward with
attentions) next to each method on the 6-layer BERT of ``common.py`` (8 × 128 tokens),
so that ratios are read within one run. ``CAPTUM_ATTENTION_BENCH_SMOKE=1`` shrinks the
model and batch for a quick check (what CI runs, with ``--benchmark-disable``).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution  # noqa: E402

SMOKE = os.environ.get("CAPTUM_ATTENTION_BENCH_SMOKE") == "1"
TARGET = 1


@pytest.fixture(scope="module")
def setup() -> tuple:
    import transformers as tf
    from common import benchmark_batch, benchmark_model

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
    eager = type(model)(model.config).eval()
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    return model, eager, ids, mask


RUNS: dict[str, Callable[[tuple], object]] = {
    "forward with attentions": lambda s: _forward(s),
    "forward+backward with attentions": lambda s: _forward_backward(s),
    "RawAttention": lambda s: RawAttention(s[0]).attribute(s[2], additional_forward_args=(s[3],)),
    "AttentionRollout": lambda s: AttentionRollout(s[0]).attribute(s[2], additional_forward_args=(s[3],)),
    "GradSAM": lambda s: GradSAM(s[0]).attribute(s[2], target=TARGET, additional_forward_args=(s[3],)),
    "TransformerAttribution": lambda s: TransformerAttribution(s[0]).attribute(
        s[2], target=TARGET, additional_forward_args=(s[3],)
    ),
}


def _forward(setup: tuple) -> object:
    _, eager, ids, mask = setup
    with torch.no_grad():
        return eager(ids, attention_mask=mask, output_attentions=True).logits


def _forward_backward(setup: tuple) -> None:
    _, eager, ids, mask = setup
    out = eager(ids, attention_mask=mask, output_attentions=True)
    out.logits[:, TARGET].sum().backward()
    eager.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(RUNS))
def test_overhead(benchmark, setup, name):  # type: ignore[no-untyped-def]
    benchmark.group = "captum-attention overhead"
    result = benchmark(RUNS[name], setup)
    if name in ("RawAttention", "AttentionRollout", "GradSAM", "TransformerAttribution"):
        assert result.shape == setup[2].shape
