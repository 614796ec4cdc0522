"""Vision Transformers (ViT; DeiT with its distillation token; DINOv2): patch-grid scores,
and the rows a classifier reads explained by default."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import matplotlib
import pytest
import torch
import transformers as tf
from captum.attr import visualization
from conftest import assert_same_state, assert_scores_close, model_state
from lm_models import VISION, make_vision
from methods import MAP_METHODS as METHODS

from captum_attention import AttnLRP, GradSAM, RawAttention, TransformerAttribution, UnsupportedModelError, upsample_to_image
from captum_attention.attr import REGISTRY
from captum_attention.metrics import attention_erasure, decision_flip_fraction, random_ranking

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

matplotlib.use("Agg")
TARGET = 2
GRID = 4
@pytest.fixture(params=VISION)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def images(seed: int = 5) -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def reference(model, pixels: torch.Tensor) -> SimpleNamespace:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    out = ref(pixel_values=pixels, output_attentions=True)
    grads = torch.autograd.grad(out.logits[:, TARGET].sum(), out.attentions)
    return SimpleNamespace(attentions=[a.detach() for a in out.attentions], grads=list(grads))


def prefix_tokens(name: str) -> int:
    return {"vit": 1, "deit": 2}[name]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("query", [0, 1])
def test_patch_grid_matches_reference(name, method, query):
    """query 0 is [CLS]; for DeiT, 1 is the distillation token (for ViT, the first patch)."""
    model = make_vision(name)
    pixels = images()
    ref = reference(model, pixels)
    tokens = prefix_tokens(name) + GRID * GRID
    scores = METHODS[method].cls(model).attribute(pixels, target=TARGET, query_index=query)
    assert scores.shape == (2, GRID, GRID)
    expected = METHODS[method].reference(ref, [tokens, tokens], query)[:, prefix_tokens(name):]
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected.reshape(2, GRID, GRID))


def test_prefix_token_scores_are_in_the_maps(name):
    model = make_vision(name)
    pixels = images()
    scores, maps = RawAttention(model).attribute(pixels, return_maps=True)
    row = maps[:, -1, : prefix_tokens(name)].mean(dim=1)  # the last layer's rows the logits read: [CLS] (and DeiT's distillation token)
    assert row.shape == (2, prefix_tokens(name) + GRID * GRID)
    torch.testing.assert_close(scores, row[:, prefix_tokens(name):].reshape(2, GRID, GRID))


def test_upsampled_scores_cover_each_patch_and_feed_visualize_image_attr():
    model = make_vision("deit")
    pixels = images()
    grid = GradSAM(model).attribute(pixels, target=TARGET)
    nearest = upsample_to_image(grid, pixels, mode="nearest")
    assert nearest.shape == (2, 16, 16, 1)
    blocks = nearest[..., 0].reshape(2, GRID, 4, GRID, 4)
    torch.testing.assert_close(blocks, grid[:, :, None, :, None].expand_as(blocks))
    smooth = upsample_to_image(grid, pixels)
    figure, _ = visualization.visualize_image_attr(
        smooth[0].detach().numpy(), pixels[0].permute(1, 2, 0).numpy(), method="blended_heat_map",
        sign="positive", use_pyplot=False,
    )
    assert figure is not None
    with pytest.raises(ValueError, match=r"^images have shape \(2, 16, 16, 3\), channel-last: .*images\.permute\(0, 3, 1, 2\)\.$"):
        upsample_to_image(grid, pixels.permute(0, 2, 3, 1))  # was upsampled to (16, 3)
    with pytest.raises(ValueError, match=r"^grid_scores have shape \(2, 16\), not \(batch, rows, columns\)"):
        upsample_to_image(grid.flatten(1), pixels)


def test_batch_members_match_alone(name):
    model = make_vision(name)
    pixels = images()
    explainer = TransformerAttribution(model)
    together = explainer.attribute(pixels, target=TARGET)
    alone = explainer.attribute(pixels[1:], target=TARGET)
    torch.testing.assert_close(together[1:], alone, atol=1e-6, rtol=1e-4)


def test_model_left_as_found(name):
    model = make_vision(name)
    before = model_state(model)
    GradSAM(model).attribute(images(), target=TARGET)
    assert_same_state(before, model_state(model))


def test_metrics_on_patch_tokens(name):
    model = make_vision(name)
    pixels = images()
    tokens = prefix_tokens(name) + GRID * GRID
    nothing = torch.zeros(2, tokens, dtype=torch.bool)
    unchanged = attention_erasure(model, pixels, nothing)
    torch.testing.assert_close(unchanged.erased, unchanged.original)
    with torch.no_grad():
        torch.testing.assert_close(unchanged.original, model(pixels).logits.softmax(-1))
    patches = torch.ones(2, tokens, dtype=torch.bool)
    patches[:, : prefix_tokens(name)] = False
    assert (attention_erasure(model, pixels, patches).js_divergence > 0).all()
    flips = decision_flip_fraction(model, pixels, random_ranking((2, tokens)))
    assert flips.removed.shape == (2,)
    with pytest.raises(ValueError, match="per\\s+class/distillation/patch token"):
        attention_erasure(model, pixels, torch.zeros(2, 3, dtype=torch.bool))


def _dinov2(registers: int):
    common = dict(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, mlp_ratio=2, initializer_range=0.3, num_labels=3,
    )
    torch.manual_seed(0)
    if registers:
        return tf.Dinov2WithRegistersForImageClassification(tf.Dinov2WithRegistersConfig(**common, num_register_tokens=registers)).eval()
    return tf.Dinov2ForImageClassification(tf.Dinov2Config(**common)).eval()


def _rows_read(tokens: int, model) -> torch.Tensor:
    """The rows the logits read, from each model's forward: DeiT's two heads averaged, one
    on each of its first two tokens; DINOv2's head on its class token beside its patches'
    mean (the tokens after the class and register tokens), taken as halves."""
    weights = torch.zeros(2, tokens)
    if isinstance(model, tf.DeiTForImageClassificationWithTeacher):
        weights[:, :2] = 0.5
    else:
        patches = 1 + getattr(model.config, "num_register_tokens", 0)
        weights[:, 0], weights[:, patches:] = 0.5, 0.5 / (tokens - patches)
    return weights


ROW_METHODS = sorted(n for n, m in REGISTRY.items() if m.spec.reads_query_row and n not in ("alti_logit", "attention_flow"))


@pytest.mark.parametrize("method", ROW_METHODS)
@pytest.mark.parametrize("case", ["deit", "dinov2", "dinov2 with registers"])
def test_a_classifier_that_reads_several_rows_is_explained_at_them(case, method):
    """By default, at the rows its logits read, weighted as it reads them, not at the
    class token alone (half of what DeiT's logits read)."""
    model = make_vision("deit") if case == "deit" else _dinov2(2 if "registers" in case else 0)
    pixels = images()
    explainer = REGISTRY[method](model)
    prefix = 2 if case == "deit" else 1 + getattr(model.config, "num_register_tokens", 0)
    tokens = prefix + GRID * GRID
    scores = explainer.attribute(pixels, target=TARGET)
    weighted = explainer.attribute(pixels, target=TARGET, query_index=_rows_read(tokens, model))
    assert_scores_close(scores, weighted)
    assert not torch.allclose(scores, explainer.attribute(pixels, target=TARGET, query_index=0))


@pytest.mark.parametrize("method", ROW_METHODS)
def test_an_image_output_pooled_over_the_patches_is_not_explained_at_the_class_token(method):
    """A ``forward_func`` that reads the mean of a ViT's patch states: the methods that
    read one row refuse its class token, and explain the mean given its row weights."""
    model = make_vision("vit")
    pixels = images()

    def patch_mean(pixel_values):
        states = model.vit(pixel_values).last_hidden_state
        return model.classifier(states[:, 1:].mean(dim=1))

    explainer = REGISTRY[method](patch_mean, model=model)
    with pytest.raises(ValueError, match=r"example 0 read positions 1-16, not position 0 alone"):
        explainer.attribute(pixels, target=TARGET)
    rows = torch.zeros(2, 1 + GRID * GRID)
    rows[:, 1:] = 1 / GRID**2
    scores = explainer.attribute(pixels, target=TARGET, query_index=rows)
    by_rows = sum(rows[0, q] * explainer.attribute(pixels, target=TARGET, query_index=q) for q in range(1, 1 + GRID * GRID))
    assert_scores_close(scores, by_rows)


TINY_TOWER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
"""A dual encoder's or SigLIP2's tiny text or image tower."""
TINY_TEXT = dict(TINY_TOWER, vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SIGLIP2_VISION = dict(TINY_TOWER, patch_size=8, num_patches=16)
"""4 × 4 position embeddings, patches of 8 × 8 pixels."""


def _siglip2() -> tuple[torch.nn.Module, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny SigLIP2 classifier and two images as its processor gives them at their native
    sizes: 4 × 4 and 2 × 4 patches of 8 × 8 pixels, flattened, the second padded to 16."""
    torch.manual_seed(0)
    model = tf.Siglip2ForImageClassification(tf.Siglip2Config(vision_config=SIGLIP2_VISION, text_config=TINY_TEXT, num_labels=3)).eval()
    patches = torch.rand(2, 16, 3 * 8 * 8, generator=torch.Generator().manual_seed(1))
    real = torch.ones(2, 16, dtype=torch.long)
    real[1, 8:] = 0
    return model, patches, (real, torch.tensor([[4, 4], [2, 4]]))


@pytest.mark.parametrize("method", sorted(n for n in REGISTRY if n != "alti_logit"))
def test_siglip2s_padded_patches_at_native_sizes_score_as_each_image_alone(method):
    """SigLIP2's classifier marks its real patches in ``pixel_attention_mask``, not in an
    ``attention_mask``: a padded image's scores were off its own alone (by half their scale
    for Grad-SAM), the padding scored by the rollouts; and it reads the mean of the real
    patches, which the row methods now know without ``query_index``."""
    model, patches, (real, shapes) = _siglip2()
    explainer = REGISTRY[method](model)
    target = {"target": TARGET} if explainer.spec.uses_target else {}
    together = explainer.attribute(patches, additional_forward_args=(real, shapes), **target)
    for row, length in enumerate((16, 8)):
        alone = explainer.attribute(patches[row : row + 1, :length], additional_forward_args=(real[row : row + 1, :length], shapes[row : row + 1]), **target)
        assert alone.abs().max() > 0
        assert_scores_close(together[row : row + 1, :length], alone)
    assert (together[1, 8:] == 0).all()


def test_attn_lrp_on_siglip2s_patches_equals_the_rules_written_out():
    """Its flattened patches, 3-D floats, were taken for embeddings given in place of ids,
    where the relevance was read: 0 everywhere, since the patch embedding's outputs hold it."""
    from lrp_reference import siglip2_relevance

    model, patches, (real, shapes) = _siglip2()
    target = torch.tensor([TARGET, TARGET])
    expected = siglip2_relevance(model, patches, real, shapes, target).relevance * real
    assert expected.abs().max() > 0
    assert_scores_close(AttnLRP(model).attribute(patches, target=TARGET, additional_forward_args=(real, shapes)), expected)


@pytest.mark.parametrize("method", ["grad_sam", "rollout", "attn_lrp"])
def test_clips_pixels_explained_through_the_whole_dual_encoder_are_refused_in_one_line(method):
    """CLIP's whole model reads token ids, and its image through its vision tower, whose
    attention is not what the methods read there (its text tower's is): with a text of at
    least as many tokens as the image has patches, the text's last scores were returned
    as the image's grid. The refusal names the tower, and passed as the model it gives the
    image's grid."""
    torch.manual_seed(0)
    vision = dict(TINY_TOWER, image_size=16, patch_size=4)
    clip = tf.CLIPModel(tf.CLIPConfig(text_config=TINY_TEXT, vision_config=vision, projection_dim=16)).eval()
    ids = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(2))
    ids[:, -1] = 2

    def image_text_similarity(pixel_values):
        return clip(input_ids=ids, pixel_values=pixel_values).logits_per_image

    target = {} if method == "rollout" else {"target": 0}
    with pytest.raises(UnsupportedModelError, match=r"^CLIPModel reads token ids, and images through its vision_model, .*model=<model>\.vision_model, "):
        REGISTRY[method](image_text_similarity, model=clip).attribute(images(), **target)
    grid = REGISTRY[method](image_text_similarity, model=clip.vision_model).attribute(images(), **target)
    assert grid.shape == (2, GRID, GRID) and grid.abs().max() > 0


def test_siglip2s_flattened_patches_explained_through_the_whole_dual_encoder_are_refused_in_one_line():
    """SigLIP2's whole model given its flattened patches (3-D floats, no image's shape to
    tell them by): with a text as long as the image has patches, Grad-SAM returned the
    text tower's scores for them. The capture sees them go into the vision tower."""
    torch.manual_seed(0)
    model = tf.Siglip2Model(tf.Siglip2Config(text_config=TINY_TEXT, vision_config=SIGLIP2_VISION)).eval()
    ids = torch.randint(3, 99, (2, 16), generator=torch.Generator().manual_seed(2))
    _, patches, (real, shapes) = _siglip2()

    def image_text_similarity(pixel_values, pixel_attention_mask, spatial_shapes):
        return model(input_ids=ids, pixel_values=pixel_values, pixel_attention_mask=pixel_attention_mask,
                     spatial_shapes=spatial_shapes).logits_per_image

    state = model_state(model)
    for method in ("grad_sam", "attn_lrp"):
        with pytest.raises(UnsupportedModelError, match=r"^Siglip2Model reads token ids, and images through its vision_model, "):
            REGISTRY[method](image_text_similarity, model=model).attribute(patches, target=0, additional_forward_args=(real, shapes))
        scores = REGISTRY[method](image_text_similarity, model=model.vision_model).attribute(
            patches, target=0, additional_forward_args=(real, shapes)
        )
        assert scores.shape == (2, 16) and (scores[1, 8:] == 0).all() and scores.abs().max() > 0
    assert_same_state(state, model_state(model))
