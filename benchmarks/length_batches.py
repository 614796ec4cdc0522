"""The cost of exact deletions for a model that reads the padding: batches of one length,
unpadded, against padded batches, on the same model and the same deletions.

    python benchmarks/length_batches.py [--repeats 3] [--device cuda]

Where one column of padding moves a model's output (a ``forward_func`` that leaves the
attention mask or the position ids out, a decoder with learned positions, a classifier
that finds its last token by a pad id it misreads), the deletion metrics run each batch on
deletions of one length, unpadded. This script runs the same metrics twice on the same
model: through a ``forward_func`` that passes the mask (padded batches) and through one
that does not (the model then reads the padding, and the deletions are batched by
length). Both give the same numbers (checked); the table gives the time of each and the
number of forwards.

- Classifier: the benchmark BERT (6 layers, 384 wide) on 8 sentences of 64 to 128 tokens:
  comprehensiveness (5 bins), LDS over 32 random halves, leave-one-out.
- Answers: a 4-layer GPT-2 (256 wide) on 8 prompts of 384 to 512 tokens in 16 segments,
  4 answer tokens: LDS over 64 random ablations, the top-k log-probability drop.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
import transformers as tf
from common import benchmark_batch, benchmark_model, device_description

from captum_attention.metrics import (
    comprehensiveness,
    datamodeling_score,
    leave_one_out,
    linear_datamodeling_score,
    top_k_log_prob_drop,
)


class Counted:
    """``forward(ids, mask)`` through ``logits_of``, counting the calls."""

    def __init__(self, logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.logits_of, self.calls = logits_of, 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.logits_of(ids, mask)


Metrics = dict[str, Callable[[Counted], torch.Tensor]]


def classifier_metrics(smoke: bool, device: str) -> tuple[Metrics, dict[str, Counted]]:
    model = benchmark_model(device)
    ids, mask = benchmark_batch(device)
    if smoke:  # two examples of 6 and 12 tokens
        ids, mask = ids[:2, :12], (torch.arange(12, device=device)[None, :] < torch.tensor([[6], [12]], device=device)).long()
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2)).to(device)
    metrics = {
        "comprehensiveness": lambda f: comprehensiveness(f, ids, mask, scores, target=0),
        "LDS (32 halves)": lambda f: datamodeling_score(f, ids, mask, scores, target=0),
        "leave-one-out": lambda f: leave_one_out(f, ids, mask, target=0),
    }
    forwards = {
        "padded": Counted(lambda i, m: model(input_ids=i, attention_mask=m).logits),
        "by length": Counted(lambda i, m: model(input_ids=i).logits),
    }
    return metrics, forwards


def answer_metrics(smoke: bool, device: str) -> tuple[Metrics, dict[str, Counted]]:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=5000, n_embd=256, n_layer=4, n_head=4, n_positions=1024, bos_token_id=1, eos_token_id=2)
    model = tf.GPT2LMHeadModel(config).eval().to(device)
    generator = torch.Generator().manual_seed(3)
    width, count = (32, 2) if smoke else (512, 8)
    lengths = torch.linspace(width * 3 // 4, width, count).long()
    positions = torch.arange(width)
    mask = (positions[None, :] >= width - lengths[:, None]).long()  # left padding
    ids = torch.randint(10, 5000, mask.shape, generator=generator).masked_fill(mask == 0, 0)
    start = width - lengths[:, None]
    segments = ((positions[None, :] - start) * 16 // lengths[:, None]).masked_fill(mask == 0, -1)
    segments[positions[None, :].expand_as(mask) == start] = -1  # the first token stays
    answer = torch.randint(10, 5000, (count, 4), generator=generator)
    scores = torch.randn(ids.shape, generator=generator)
    ids, mask, segments, answer, scores = (t.to(device) for t in (ids, mask, segments, answer, scores))
    metrics = {
        "LDS (64 ablations)": lambda f: linear_datamodeling_score(f, ids, mask, answer, scores, segments, num_ablations=64),
        "top-k drop": lambda f: top_k_log_prob_drop(f, ids, mask, answer, scores, segments=segments),
    }

    def with_positions(i: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return model(input_ids=i, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0)).logits

    forwards = {
        "padded": Counted(with_positions),
        "by length": Counted(lambda i, m: model(input_ids=i, attention_mask=m).logits),  # positions read the padding
    }
    return metrics, forwards


def measure(metric: Callable[[Counted], Any], forward: Counted, repeats: int, device: str) -> tuple[float, int, torch.Tensor]:
    seconds = []
    for _ in range(repeats):
        forward.calls = 0
        begin = time.perf_counter()
        with torch.no_grad():
            value = metric(forward)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - begin)
    return sorted(seconds)[len(seconds) // 2], forward.calls, value


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few short examples, once (a check that it runs)")
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args(argv)
    repeats = 1 if options.smoke else options.repeats
    print(f"# {device_description(options.device)}")
    print(f"{'task':<11} {'metric':<20} {'padded':>14} {'by length':>18} {'time ratio':>10}")
    rows = []
    for task, build in (("classifier", classifier_metrics), ("answers", answer_metrics)):
        metrics, forwards = build(options.smoke, options.device)
        for name, metric in metrics.items():
            (padded_s, padded_calls, padded), (length_s, length_calls, by_length) = (
                measure(metric, forward, repeats, options.device) for forward in forwards.values()
            )
            torch.testing.assert_close(by_length, padded, atol=2e-4, rtol=1e-3)
            rows.append(dict(task=task, metric=name, padded_forwards=padded_calls, length_forwards=length_calls,
                             time_ratio=length_s / padded_s))
            print(
                f"{task:<11} {name:<20} {padded_s:7.2f} s {padded_calls:3d} fw {length_s:8.2f} s {length_calls:4d} fw "
                f"{length_s / padded_s:9.1f}x"
            )
    return rows


if __name__ == "__main__":
    main()
