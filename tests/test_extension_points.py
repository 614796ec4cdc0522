"""The examples of docs/adding_a_method.rst and docs/adding_a_metric.rst, run from their
files outside the package: a method written against the public extension points alone
(both capture modes, against a direct re-computation from ``output_attentions``), and a
registered metric that ``evaluate`` scores like the built-in ones."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from conftest import make_batch, make_model, reference_attention
from test_evaluate import _data, checkpoint  # noqa: F401  (a fixture)

from captum_attention import METHODS, RawAttention
from captum_attention.attr import REGISTRY
from captum_attention.metrics import METRICS
from captum_attention.presentation import evaluate as ev
from captum_attention.presentation.cli import main

EXAMPLES = Path(__file__).parent.parent / "docs" / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def new_method():
    module = _load("max_head_attention")
    yield module.MaxHeadAttention
    REGISTRY.pop("max_head")
    METHODS.pop("max_head")


@pytest.fixture
def new_metric():
    module = _load("top_token_drop")
    yield module.top_token_drop
    METRICS.pop("top_token_drop")


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_method_from_outside_the_package_is_registered_and_exact(new_method, capture, family):
    assert METHODS["max_head"] is new_method and new_method.get_name() == "Max-Head Attention"
    model = make_model(family)
    batch = make_batch(model)
    explainer = new_method(model, capture=capture)
    scores = explainer.attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,), layer=0)
    assert explainer.last_capture.startswith(capture)
    ref = reference_attention(model, batch)
    for row, length in enumerate(batch.lengths):
        expected = ref.attentions[0][row, :, 0, :length].amax(dim=0)  # the [CLS] row
        torch.testing.assert_close(scores[row, :length], expected, atol=1e-5, rtol=1e-5)
        assert (scores[row, length:] == 0).all()


def test_a_registered_metric_is_scored_by_evaluate(new_metric, checkpoint, tmp_path):  # noqa: F811
    assert "top_token_drop" in ev.metric_names()
    data = _data(tmp_path, count=6)
    output = tmp_path / "out"
    args = ["evaluate", str(data), "--model", str(checkpoint), "--output", str(output), "--methods", "raw"]
    assert main([*args, "--metrics", "top_token_drop"]) == 0
    rows = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert "top_token_drop" in (output / "summary.md").read_text()
    model = tf.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    tokenizer = tf.BertTokenizerFast.from_pretrained(checkpoint)
    examples, _ = ev.read_dataset(data)
    assert [row["index"] for row in rows] == [e.index for e in examples]
    for example, row in zip(examples, rows):  # each example alone, by hand
        encoded = tokenizer([example.text], return_tensors="pt")
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        probs = model(input_ids=ids, attention_mask=mask).logits.softmax(-1)[0].detach()
        predicted = int(probs.argmax())
        scores = RawAttention(model).attribute(ids, additional_forward_args=(mask,))[0]
        scores[0] = scores[-1] = float("-inf")  # [CLS] and [SEP] are kept
        masked = mask.clone()
        masked[0, int(scores.argmax())] = 0
        after = model(input_ids=ids, attention_mask=masked).logits.softmax(-1)[0, predicted].item()
        assert row["top_token_drop"] == pytest.approx(probs[predicted].item() - after, abs=1e-5)
