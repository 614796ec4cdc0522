"""Plain PyTorch attention: nn.MultiheadAttention, and a user's textbook module or one calling
F.scaled_dot_product_attention via ModuleAdapter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from conftest import assert_same_state, assert_scores_close, make_batch, model_state
from plain_models import PatchClassifier, make_plain
from methods import MAP_METHODS as METHODS

from captum_attention import AttnLRP, GradSAM, KnockoutLRP, TransformerAttribution, UnsupportedModelError
from captum_attention.capture import AttentionNotFoundError, ModuleAdapter, MultiheadAttentionAdapter
from captum_attention.metrics import attention_erasure, attention_permutation

KINDS = ("mha", "mha_seq_first", "textbook", "sdpa")
TARGET = 1
def adapter_for(model):
    if not isinstance(model.blocks[0], nn.MultiheadAttention):  # name the module: probabilities from its softmaxes
        return ModuleAdapter(list(model.blocks), probs="softmax", mask_module=model)
    return None  # nn.MultiheadAttention is found on its own


def reference(model, batch):
    logits, pieces = model.reference(batch.input_ids, batch.attention_mask)
    flat = [p for block in pieces for p in block]
    grads = iter(torch.autograd.grad(logits[:, TARGET].sum(), flat))
    as_heads = lambda t: t if t.dim() == 4 else t[:, None]  # noqa: E731
    attentions = [torch.cat([as_heads(p) for p in block], dim=1).detach() for block in pieces]
    grad_maps = [torch.cat([as_heads(next(grads)) for _ in block], dim=1) for block in pieces]
    return logits, SimpleNamespace(attentions=attentions, grads=grad_maps)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def test_reference_computes_the_model(kind):
    model = make_plain(kind)
    batch = make_batch(model)
    logits, _ = reference(model, batch)
    torch.testing.assert_close(logits, model(batch.input_ids, batch.attention_mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", list(METHODS))
def test_methods_match_reference(kind, method):
    model = make_plain(kind)
    batch = make_batch(model)
    _, ref = reference(model, batch)
    scores = METHODS[method].cls(model, adapter=adapter_for(model)).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    expected = METHODS[method].reference(ref, batch.lengths)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_answers_its_caller_as_asked(need_weights):
    model = make_plain("mha")
    batch = make_batch(model)
    model.need_weights = need_weights
    seen = []
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(out[1]))
    try:
        GradSAM(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    finally:
        handle.remove()
    assert len(seen) == 1
    if need_weights:
        assert seen[0].shape == (3, 9, 9)  # head-averaged, as nn.MultiheadAttention's default
    else:
        assert seen[0] is None


def test_model_left_as_found(kind):
    model = make_plain(kind)
    before = model_state(model)
    batch = make_batch(model)
    TransformerAttribution(model, adapter=adapter_for(model)).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    assert_same_state(before, model_state(model))


def test_erasing_all_keys_but_the_first_matches_the_first_token_alone(kind):
    model = make_plain(kind)
    batch = make_batch(model)
    erased = torch.ones_like(batch.attention_mask, dtype=torch.bool)
    erased[:, 0] = False
    result = attention_erasure(
        model, batch.input_ids, erased, (batch.attention_mask,), adapter=adapter_for(model)
    )
    with torch.no_grad():
        alone = model(batch.input_ids[:, :1], batch.attention_mask[:, :1]).softmax(-1)
    torch.testing.assert_close(result.erased, alone, atol=1e-6, rtol=1e-5)
    assert (result.js_divergence > 0).all()


def test_permutation_runs_on_plain_attention(kind):
    model = make_plain(kind)
    batch = make_batch(model)
    result = attention_permutation(
        model, batch.input_ids, (batch.attention_mask,), n_permutations=3, adapter=adapter_for(model)
    )
    assert (result.median_tvd > 0).all()


def test_a_model_without_known_attention_names_the_protocol():
    model = make_plain("textbook")
    batch = make_batch(model)
    with pytest.raises(AttentionNotFoundError, match="ModuleAdapter.*AttentionAdapter protocol"):
        GradSAM(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))


def test_naming_a_module_without_a_softmax_is_a_clear_error():
    model = make_plain("textbook")
    batch = make_batch(model)
    adapter = ModuleAdapter([model.classifier], probs="softmax")
    with pytest.raises(RuntimeError, match="computed no softmax"):
        GradSAM(model, adapter=adapter).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))


def test_erasing_chosen_heads_of_a_module_with_one_softmax_per_head():
    """heads= counts the heads of a layer across the per-head softmaxes of a textbook module."""
    model = make_plain("textbook")
    batch = make_batch(model)
    erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    erased[:, 0] = True
    adapter = adapter_for(model)
    block = model.blocks[0]
    seen = []
    hook = block.heads[2].register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        changed = attention_erasure(model, batch.input_ids, erased, (batch.attention_mask,), layers=0, heads=[2], adapter=adapter)
    finally:
        hook.remove()
    assert (changed.js_divergence > 0).all()
    # Head 2's output with key 0 erased, recomputed by hand from its own weights.
    x = model.embed(batch.input_ids) + model.position[: batch.input_ids.shape[1]]
    head = block.heads[2]
    scores = head.query(x) @ head.key(x).transpose(-2, -1) / head.key.out_features**0.5
    weights = scores.masked_fill((batch.attention_mask[:, None, :] == 0) | erased[:, None, :], float("-inf")).softmax(-1)
    torch.testing.assert_close(seen[-1], weights @ head.value(x), atol=1e-5, rtol=1e-5)


def test_a_failing_call_leaves_multihead_attention_as_found():
    model = make_plain("mha")
    batch = make_batch(model)
    before = model_state(model)

    def failing(ids, mask):
        model(ids, mask)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        GradSAM(failing, model=model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert_same_state(before, model_state(model))
    assert model(batch.input_ids, batch.attention_mask).shape == (3, 3)  # still callable as before


@pytest.mark.parametrize("cls", [AttnLRP, KnockoutLRP])
def test_the_relevance_methods_refuse_plain_attention_in_one_line_and_leave_it_as_found(kind, cls):
    model = make_plain(kind)
    batch = make_batch(model)
    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match="AttnLRP's rules cover transformers' attention") as refused:
        cls(model, adapter=adapter_for(model)).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(model))


class PatchGridAdapter(MultiheadAttentionAdapter):
    """All a hand-written ViT needs: the built-in nn.MultiheadAttention adapter plus its patch grid."""

    def patch_grid(self, model, images):
        return images.shape[-2] // PatchClassifier.PATCH, images.shape[-1] // PatchClassifier.PATCH


@pytest.mark.parametrize("method", list(METHODS))
def test_hand_written_vit_gets_patch_grid_scores_through_an_adapter_alone(method):
    torch.manual_seed(0)
    model = PatchClassifier().eval()
    pixels = torch.randn(2, 3, 12, 16, generator=torch.Generator().manual_seed(3))  # a 3×4 patch grid
    tokens = 1 + 3 * 4
    logits, pieces = model.reference(pixels, torch.ones(2, tokens, dtype=torch.long))
    attentions = [block[0] for block in pieces]
    grads = torch.autograd.grad(logits[:, TARGET].sum(), attentions)
    ref = SimpleNamespace(attentions=[a.detach() for a in attentions], grads=list(grads))
    before = model_state(model)
    scores = METHODS[method].cls(model, adapter=PatchGridAdapter()).attribute(pixels, target=TARGET)
    assert_same_state(before, model_state(model))
    expected = METHODS[method].reference(ref, [tokens, tokens])[:, 1:].reshape(2, 3, 4)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


def test_an_image_model_without_a_patch_grid_gets_a_clear_error():
    torch.manual_seed(0)
    model = PatchClassifier().eval()
    with pytest.raises(ValueError, match="patch grid.*adapter"):
        GradSAM(model).attribute(torch.randn(1, 3, 12, 16), target=TARGET)


@pytest.mark.parametrize(
    "options",
    [
        {"attn_mask": "bool"}, {"attn_mask": "float"}, {"is_causal": True}, {"enable_gqa": True, "scale": 0.3},
        {"attn_mask": "rows"},  # a query row whose keys are all masked
    ],
    ids=["bool-mask", "float-mask", "causal", "gqa-scale", "masked-row"],
)
def test_the_explicit_sdpa_equals_the_fused_kernel_in_values_and_gradients(options):
    """What the capture runs in place of F.scaled_dot_product_attention, its probabilities
    handed to the capture: the kernel's output and gradients, a fully masked row's zeros too."""
    import torch.nn.functional as F

    from captum_attention.capture.kernel import SdpaArguments
    from captum_attention.capture.recorder import _explicit_sdpa

    generator = torch.Generator().manual_seed(0)
    key_heads = 2 if options.get("enable_gqa") else 4
    query = torch.randn(2, 4, 5, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, key_heads, 6, 8, generator=generator, requires_grad=True) for _ in range(2))
    masks = {
        "bool": torch.rand(2, 1, 5, 6, generator=generator) > 0.3,
        "float": torch.randn(2, 4, 5, 6, generator=generator),
        "rows": torch.ones(2, 1, 5, 6, dtype=torch.bool).index_fill(2, torch.tensor([3]), False),
    }
    kwargs = {**options, "attn_mask": masks[options["attn_mask"]]} if "attn_mask" in options else dict(options)
    recorded = []
    arguments = SdpaArguments(query, key, value, **kwargs)
    explicit = _explicit_sdpa(lambda probs, scores: recorded.append(probs) or probs, torch.matmul, arguments)
    fused = F.scaled_dot_product_attention(query, key, value, **kwargs)
    torch.testing.assert_close(explicit, fused, atol=1e-6, rtol=1e-5)
    weights = torch.randn(fused.shape, generator=generator)
    explicit_grads = torch.autograd.grad((explicit * weights).sum(), (query, key, value))
    fused_grads = torch.autograd.grad((fused * weights).sum(), (query, key, value))
    for ours, theirs in zip(explicit_grads, fused_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert recorded[0].shape == (2, 4, 5, 6) and torch.isfinite(recorded[0]).all()


def test_a_module_calling_sdpa_with_dropout_is_refused_in_one_line():
    model = make_plain("sdpa")
    batch = make_batch(model)
    model.blocks[1].dropout = 0.1
    with pytest.raises(UnsupportedModelError, match=r"dropout_p=0\.1: its output is random; call model\.eval\(\)"):
        GradSAM(model, adapter=adapter_for(model)).attribute(
            batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,)
        )


@pytest.mark.parametrize("causal", [False, True], ids=["bool-mask", "causal-float-mask"])
def test_modules_calling_sdpa_stream_and_equal_the_eager_capture(causal):
    """The named modules' F.scaled_dot_product_attention runs as the module asked under a
    streaming capture (``auto`` picks it): every map method, the knockout slope, erasure
    and decision flips equal the eager capture's; a module with an explicit softmax is
    refused streaming in one line and runs eager under ``auto``."""
    from captum_attention import KnockoutGradient, RawAttention
    from captum_attention.metrics import decision_flip_fraction, random_ranking

    model = make_plain("sdpa")
    for block in model.blocks:
        block.causal = causal
    batch = make_batch(model)
    args = (batch.attention_mask,)
    adapter = adapter_for(model)
    for cls in [*(spec.cls for spec in METHODS.values()), KnockoutGradient]:
        eager = cls(model, adapter=adapter, capture="eager").attribute(
            batch.input_ids, target=TARGET, additional_forward_args=args
        )
        streamed = cls(model, adapter=adapter)
        scores = streamed.attribute(batch.input_ids, target=TARGET, additional_forward_args=args)
        assert streamed.last_capture == "streaming", (cls, streamed.last_capture)
        assert_scores_close(scores, eager)
    erased = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0)) < 0.3
    modes = ("eager", "streaming")
    runs = {c: attention_erasure(model, batch.input_ids, erased, args, adapter=adapter, capture=c) for c in modes}
    torch.testing.assert_close(runs["streaming"].erased, runs["eager"].erased, atol=1e-6, rtol=1e-5)
    ranking = random_ranking(batch.input_ids.shape)
    flips = {c: decision_flip_fraction(model, batch.input_ids, ranking, args, adapter=adapter, capture=c) for c in modes}
    assert torch.equal(flips["streaming"].removed, flips["eager"].removed)
    textbook = make_plain("textbook")
    with pytest.raises(ValueError, match="did not call transformers' sdpa attention function nor F.scaled_dot_product_attention"):
        streamed = RawAttention(textbook, adapter=adapter_for(textbook), capture="streaming")
        streamed.attribute(batch.input_ids, additional_forward_args=args)
    explainer = RawAttention(textbook, adapter=adapter_for(textbook))
    explainer.attribute(batch.input_ids, additional_forward_args=args)
    assert explainer.last_capture.startswith("eager: "), explainer.last_capture
