"""Padding, batch and model-state invariances."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, make_batch, make_model, model_state
from methods import METHODS as TABLE

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

METHODS = {
    **{name: (case.cls, case.options) for name, case in TABLE.items()},
    "rollout_discard": (AttentionRollout, dict(head_fusion="max", discard_ratio=0.5)),
}


@pytest.fixture(params=list(METHODS))
def method(request):
    return METHODS[request.param]


def test_sample_alone_equals_sample_in_padded_batch(family, method):
    cls, options = method
    model = make_model(family)
    batch = make_batch(model, lengths=(11, 7, 4, 9))
    explainer = cls(model)
    together = explainer.attribute(
        batch.input_ids, additional_forward_args=(batch.attention_mask,), **options
    )
    # Signed relevance (AttnLRP) sums products over the hidden size that cancel, so its
    # float32 roundoff between the padded and the unpadded shapes (other BLAS kernels) is
    # larger than the maps methods': measured up to 1.2e-6 on a DistilBERT token of 0.38. The
    # maps methods' own differ by up to 5e-6 of a score on some CPUs (ELECTRA, eager Transformer
    # Attribution: 1.4e-6 on 0.27), hence the relative part.
    tolerance = 1e-5 if cls.spec.signed else 1e-6
    for row, length in enumerate(batch.lengths):
        ids = batch.input_ids[row : row + 1, :length]
        alone = explainer.attribute(ids, additional_forward_args=(torch.ones_like(ids),), **options)
        torch.testing.assert_close(together[row : row + 1, :length], alone, atol=tolerance, rtol=2e-5)
        assert (together[row, length:] == 0).all(), "padding must score exactly 0"


def test_no_mask_means_all_tokens_real(method):
    cls, options = method
    model = make_model("bert")
    ids = make_batch(model, lengths=(8, 8)).input_ids
    explainer = cls(model)
    without = explainer.attribute(ids, **options)
    with_ones = explainer.attribute(ids, additional_forward_args=(torch.ones_like(ids),), **options)
    torch.testing.assert_close(without, with_ones)


def test_model_state_untouched_after_success(family, method):
    cls, options = method
    model = make_model(family)
    batch = make_batch(model)
    for param in list(model.parameters())[::3]:
        param.grad = torch.randn_like(param)
    list(model.parameters())[1].requires_grad_(False)
    before = model_state(model)
    cls(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,), **options)
    assert_same_state(before, model_state(model))


def test_frozen_model_still_gets_gradients():
    model = make_model("bert")
    batch = make_batch(model)
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    expected = GradSAM(model).attribute(batch.input_ids, **args)
    model.requires_grad_(False)
    before = model_state(model)
    frozen = GradSAM(model).attribute(batch.input_ids, **args)
    torch.testing.assert_close(frozen, expected)
    assert_same_state(before, model_state(model))


def test_eager_model_stays_eager_and_matches_sdpa():
    sdpa = make_model("bert")
    eager = make_model("bert")
    eager.set_attn_implementation("eager")
    batch = make_batch(sdpa)
    args = dict(target=0, additional_forward_args=(batch.attention_mask,))
    torch.testing.assert_close(
        TransformerAttribution(sdpa).attribute(batch.input_ids, **args),
        TransformerAttribution(eager).attribute(batch.input_ids, **args),
    )
    assert sdpa.config._attn_implementation == "sdpa"
    assert eager.config._attn_implementation == "eager"


def test_training_mode_warns_and_is_kept():
    model = make_model("bert").train()
    batch = make_batch(model)
    with pytest.warns(UserWarning, match="training mode"):
        RawAttention(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    assert model.training


def test_bf16_model_scores_close_to_fp32():
    model = make_model("bert")
    batch = make_batch(model)
    args = dict(additional_forward_args=(batch.attention_mask,))
    for cls, options in (METHODS["rollout"], METHODS["transformer_attribution"], METHODS["grad_sam"]):
        fp32 = cls(model).attribute(batch.input_ids, **options, **args)
        bf16 = cls(make_model("bert").to(torch.bfloat16)).attribute(batch.input_ids, **options, **args)
        assert bf16.dtype == torch.float32
        scale = fp32.abs().max()
        assert (bf16 - fp32).abs().max() <= 0.1 * scale, cls.get_name()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(family, method):
    cls, options = method
    model = make_model(family)
    batch = make_batch(model)
    cpu = cls(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,), **options)
    model.cuda()
    gpu = cls(model).attribute(
        batch.input_ids.cuda(), additional_forward_args=(batch.attention_mask.cuda(),), **options
    )
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-5 * cpu.abs().max().item())
