"""What Attention Flow costs against Attention Rollout, by input length.

    python benchmarks/flow_cost.py [--lengths 16 32 64] [--repeats 3] [--smoke]

On the default model (MiniLM, 6 layers, 12 heads), one sentence of each length (a
generated sentence repeated, then cut), batch 1: the median wall time of
``AttentionFlow`` and of ``AttentionRollout`` (same capture, same Â matrices) over
``repeats`` runs after a warm-up, and their ratio. Flow solves one exact max-flow per
token over a graph of L·T² edges, so its time grows much faster than rollout's.
``--smoke`` runs a tiny randomly initialised BERT instead (for the test suite).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch import Tensor

from captum_attention import AttentionFlow, AttentionRollout, load_default_model


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[int, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    arguments = parser.parse_args(argv)
    model, encode = _smoke_model() if arguments.smoke else _default_model()
    results = {}
    print(f"{'tokens':>6}  {'flow s':>8}  {'rollout s':>9}  ratio")
    for length in arguments.lengths:
        ids, mask = encode(length)
        timed = {
            cls: _median_seconds(lambda cls=cls: cls(model).attribute(ids, additional_forward_args=(mask,)), arguments.repeats)
            for cls in (AttentionFlow, AttentionRollout)
        }
        results[length] = (timed[AttentionFlow], timed[AttentionRollout])
        print(f"{length:>6}  {timed[AttentionFlow]:>8.3f}  {timed[AttentionRollout]:>9.4f}  {timed[AttentionFlow] / timed[AttentionRollout]:.0f}x")
    return results


def _default_model() -> tuple[Any, Callable[[int], tuple[Tensor, Tensor]]]:
    model, tokenizer = load_default_model(progress=False)
    words = "the acting was wonderful but the plot was painfully dull and slow".split()

    def encode(length: int) -> tuple[Tensor, Tensor]:
        text = " ".join(words * (length // len(words) + 1))
        encoded = tokenizer([text], truncation=True, max_length=length, return_tensors="pt")
        return encoded["input_ids"], encoded["attention_mask"]

    return model, encode


def _smoke_model() -> tuple[Any, Callable[[int], tuple[Tensor, Tensor]]]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    model = BertForSequenceClassification(config).eval()
    return model, lambda length: (torch.randint(3, 64, (1, length)), torch.ones(1, length, dtype=torch.long))


if __name__ == "__main__":
    main()
