"""What holds against hostile use: custom attention kernels, non-finite weights and scores,
the user's own registrations, positional masks on every classifier family, and arguments
out of range: a correct result, NaN where nothing can be computed, or one clear error."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import FAMILIES, make_batch, make_model
from constants import NUM_LABELS, VOCAB
from transformers import AttentionInterface

from captum_attention import METHODS, GradSAM, RawAttention
from captum_attention._compat import attention_function
from captum_attention.metrics import (
    attention_erasure,
    comprehensiveness,
    iou_f1,
    kendall_tau,
    leave_one_out,
    perturbation_curve,
    random_ranking,
    spearman,
    token_f1,
)

TARGET = 1


def _llama_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, num_labels=NUM_LABELS,
    )
    return tf.LlamaForSequenceClassification(config).eval()


def _gpt2_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, num_labels=NUM_LABELS,
    )
    return tf.GPT2ForSequenceClassification(config).eval()


def _uniform_attention(module, query, key, value, attention_mask, **kwargs):
    """A registered attention function that is no softmax attention: every key weighs alike."""
    output = value.mean(dim=2, keepdim=True).expand(-1, -1, query.shape[2], -1)
    repeat = query.shape[1] // value.shape[1]
    return output.repeat_interleave(repeat, dim=1).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("capture", ["auto", "eager", "streaming"])
def test_a_custom_attention_function_is_refused_not_explained_as_sdpa(capture):
    AttentionInterface.register("uniform_test", _uniform_attention)
    model = _llama_classifier()
    model.set_attn_implementation("uniform_test")
    batch = make_batch(model)
    with pytest.raises(ValueError, match="'uniform_test', whose semantics the capture cannot reproduce"):
        GradSAM(model, capture=capture).attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
    with pytest.raises(ValueError, match="uniform_test"):
        attention_erasure(model, batch.input_ids, batch.attention_mask.bool(), (batch.attention_mask,), capture=capture)
    assert model.config._attn_implementation == "uniform_test"


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_nan_weight_gives_nan_scores_not_finite_ones(name, capture):
    model = make_model("bert")
    batch = make_batch(model)
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.self.query.weight[0, 0] = float("nan")
    assert bool(model(batch.input_ids, attention_mask=batch.attention_mask).logits.isnan().all())
    scores = METHODS[name](model, capture=capture).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    real = batch.attention_mask == 1
    assert bool(scores[real].isnan().all()), "no finite score for a model whose output is NaN"
    assert bool((scores[~real] == 0).all())


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_attributions_are_refused_by_the_token_removal_metrics(value):
    model = make_model("bert")
    batch = make_batch(model)
    scores = torch.rand(batch.input_ids.shape)
    scores[0, 1] = value
    for metric in (comprehensiveness, perturbation_curve):
        with pytest.raises(ValueError, match="±inf in examples \\[0\\]"):
            metric(model, batch.input_ids, batch.attention_mask, scores, TARGET)


def test_agreement_with_nan_is_refused():
    first, second = torch.rand(2, 5), torch.rand(2, 5)
    first[1, 2] = float("nan")
    for agreement in (kendall_tau, spearman):
        with pytest.raises(ValueError, match="first holds NaN in examples \\[1\\]"):
            agreement(first, second)
        include = torch.ones(2, 5, dtype=torch.bool)
        include[1, 2] = False
        assert bool(agreement(first, second, include).isfinite().all()), "a NaN left out is no NaN"


def test_a_users_own_sdpa_registration_during_a_capture_is_kept():
    model = _llama_classifier()
    batch = make_batch(model)
    original = attention_function("sdpa")

    def users_sdpa(*args, **kwargs):
        return original(*args, **kwargs)

    def forward(ids, mask):
        AttentionInterface.register("sdpa", users_sdpa)
        return model(input_ids=ids, attention_mask=mask).logits

    try:
        RawAttention(forward, model=model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
        assert attention_function("sdpa") is users_sdpa
    finally:
        AttentionInterface.register("sdpa", original)


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2", "llama"])
def test_every_classifier_family_takes_the_mask_positionally(family):
    model = {"gpt2": _gpt2_classifier, "llama": _llama_classifier}.get(family, lambda: make_model(family))()
    batch = make_batch(model)
    positional = GradSAM(model).attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))

    def by_name(ids, mask):
        return model(input_ids=ids, attention_mask=mask).logits

    named = GradSAM(by_name, model=model).attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
    torch.testing.assert_close(positional, named)


def test_arguments_out_of_range_are_one_clear_error():
    model = make_model("bert")
    batch = make_batch(model)
    with pytest.raises(ValueError, match="keep covers every real token"):
        leave_one_out(model, batch.input_ids, batch.attention_mask, TARGET, keep=torch.ones_like(batch.input_ids).bool())
    with pytest.raises(ValueError, match="shape must be sizes"):
        random_ranking((-1, 3))
    scores, rationale = torch.rand(2, 5), torch.rand(2, 5) > 0.5
    for metric in (token_f1, iou_f1):
        with pytest.raises(ValueError, match="k must be a positive number"):
            metric(scores, rationale, k=-1)
