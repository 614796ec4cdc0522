"""Vision-language models' answers: the language model's attention explained over the
prompt's tokens and each image's tokens, and those placed on the image's patch grid.

References come from an eager twin's ``output_attentions`` (the language model's only) and
``torch.autograd.grad`` of the answer's summed log-probabilities; the grid layouts from
the model's own computation (a patch changed, the one image token that changes)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_state, model_state
from lrp_reference import llama_relevance, llava_pixel_relevance, mllama_relevance
from seq2seq_reference import cross_attending_reference
from test_llm import span_reference
from torch import nn
from types import SimpleNamespace
from vlm_models import (
    ANSWER, FAMILIES, GRIDS, IMAGE, VLMPrompt, check_cross_attending_span, family_example, make_mllama, make_mllama_prompt, make_vlm, make_vlm_prompt, mllama_span_reference, mllama_states_real,
    mllama_with_answer, tower_rows, vlm_span_reference, with_answer,
)
from methods import MAP_METHODS, METHODS, reference_grad_sam

from captum_attention import (
    ALTI, AttnLRP, GradSAM, NormAttention, RawAttention, TransformerAttribution, ValueZeroing, image_scores, pixel_scores,
)
from captum_attention.capture import UnsupportedModelError


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", MAP_METHODS)
def test_span_equals_the_reference_of_the_language_models_attention(family, method):
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    _language_model_inputs(model, prompt)  # transformers installs its own output recorders on a first forward
    before = model_state(model)
    scores = METHODS[method].cls(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert_same_state(before, model_state(model))
    sequence = with_answer(prompt)
    prompt_len = prompt.input_ids.shape[1]
    expected = span_reference(method, vlm_span_reference(model, family, prompt), sequence.attention_mask.bool(), range(prompt_len - 1, prompt_len + 1))
    images = sequence.input_ids == IMAGE
    assert expected[images].abs().max() > 0, "the image tokens are scored"
    scale = expected.abs().max().item()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_token_rows_are_the_span_split_by_answer_token(family):
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    explainer = RawAttention(model)
    rows = explainer.attribute_continuation(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    span = explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    torch.testing.assert_close(rows.sum(dim=1), span)
    grids = image_scores(model, prompt.input_ids, rows, prompt.images)
    assert [tuple(grid.shape) for grid in grids[1]] == [(2, *GRIDS[family][1])]


@pytest.mark.usefixtures("capture_mode")
def test_attn_lrp_reads_relevance_where_the_language_model_reads_the_image():
    """AttnLRP of LLaVA equals AttnLRP of its Llama on the merged embeddings (text
    embeddings, the projected image features at the image tokens)."""
    model, prompt = make_vlm("llava"), make_vlm_prompt("llava")
    scores = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    sequence = with_answer(prompt)
    merged = _language_model_inputs(model, sequence)
    positions = (sequence.attention_mask.cumsum(-1) - 1).clamp(min=0)
    language_model = SimpleNamespace(model=model.model.language_model, config=model.config.text_config, lm_head=model.lm_head)
    expected = llama_relevance(language_model, sequence.input_ids, sequence.attention_mask, None, span=ANSWER, embeddings=merged, positions=positions).relevance
    expected = expected * sequence.attention_mask
    expected[:, -1] = 0.0
    assert expected[sequence.input_ids == IMAGE].abs().max() > 0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("family", ["llava", "llava_full"])
def test_attn_lrp_through_the_vision_tower_equals_the_rules_written_out(family):
    """AttnLRP carried through LLaVA's projector and CLIP tower to the pixels equals the
    rules written out from the weights (tokens and pixels); the image tokens score 0."""
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    _language_model_inputs(model, prompt)  # transformers installs its own output recorders on a first forward
    before = model_state(model)
    tokens, pixels = AttnLRP(model).attribute_span(
        prompt.input_ids, ANSWER, additional_forward_args=prompt.args, through_vision_tower=True, pixel_baselines=0.25
    )
    assert_same_state(before, model_state(model))
    sequence = with_answer(prompt)
    expected_tokens, expected_pixels = llava_pixel_relevance(
        model, sequence.input_ids, sequence.attention_mask, prompt.images["pixel_values"], ANSWER, 0.25
    )
    expected_tokens = expected_tokens * sequence.attention_mask
    expected_tokens[:, -1] = 0.0
    assert pixels.shape == prompt.images["pixel_values"].shape and expected_pixels.abs().max() > 0
    assert tokens[sequence.input_ids == IMAGE].abs().max() == 0
    torch.testing.assert_close(pixels, expected_pixels, rtol=1e-5, atol=1e-5 * expected_pixels.abs().max().item())
    torch.testing.assert_close(tokens, expected_tokens, rtol=1e-5, atol=1e-5 * expected_tokens.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_attn_lrp_through_the_vision_tower_streams_exactly_for_every_family(family):
    """Every family's tower (CLIP, SigLIP, Pixtral, Qwen2-VL's, Idefics3's tiles, LLaVA-NeXT's
    any-resolution tiles) takes the rules through its own kernel as through eager products."""
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    (streamed_tokens, streamed), (eager_tokens, eager) = (
        AttnLRP(model, capture=capture).attribute_span(
            prompt.input_ids, ANSWER, additional_forward_args=prompt.args, through_vision_tower=True
        )
        for capture in ("streaming", "eager")
    )
    assert eager.shape == prompt.images["pixel_values"].shape and eager.abs().max() > 0
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    torch.testing.assert_close(streamed_tokens, eager_tokens, rtol=1e-5, atol=1e-5 * eager_tokens.abs().max().item())


def test_pixel_scores_unfold_qwen2_vl_patches_as_its_processor_flattens_them():
    """A bright patch at (row 1, column 3) of a 4 × 6 patch grid: the flattened row its
    processor puts it in lands at that cell."""
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 84, do_normalize=False, do_rescale=False)
    image = np.zeros((56, 84, 3), dtype=np.float32)
    image[14:28, 42:56] = 1.0
    images = processor(images=[image, image[:28, :56]], return_tensors="pt", do_resize=False)
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, patch_size=14))
    first, second = pixel_scores(SimpleNamespace(config=config), images["pixel_values"], images)
    assert first.shape == (4, 6) and second.shape == (2, 4)
    assert first.nonzero().tolist() == [[1, 3]] and second.nonzero().tolist() == [[1, 3]]


@pytest.mark.parametrize("family", ["llava", "mistral3", "idefics3", "llava_next", "qwen2_vl"])
def test_pixel_scores_sum_each_patch_of_every_image(family):
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    _, pixels = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args, through_vision_tower=True)
    grids = pixel_scores(model, pixels, prompt.images)
    assert sum(float(grid.sum()) for grid in grids) == pytest.approx(float(pixels.sum()), rel=1e-4, abs=1e-7)
    if family in ("llava", "mistral3"):  # one image per example, its own patch grid (Pixtral's second cut to 32 × 16 pixels)
        assert [tuple(g.shape) for g in grids] == [(4, 4), (4, 4) if family == "llava" else (4, 2)]
        patch = pixels[0, :, 8:16, 16:24].sum()
        torch.testing.assert_close(grids[0][1, 2], patch)
    if family == "llava_next":  # per example the resized image, then its tiles
        assert len(grids) == pixels.shape[0] * pixels.shape[1]
    with pytest.raises(UnsupportedModelError, match="without a grid"):
        pixel_scores(model, pixels.flatten()[:10], {})


def test_attn_lrp_through_the_vision_tower_gives_rows_and_attribute_and_refuses_without_pixels():
    model, prompt = make_vlm("llava"), make_vlm_prompt("llava")
    explainer = AttnLRP(model)
    options = dict(additional_forward_args=prompt.args, through_vision_tower=True)
    span_tokens, span_pixels = explainer.attribute_span(prompt.input_ids, ANSWER, **options)
    row_tokens, row_pixels = explainer.attribute_continuation(prompt.input_ids, ANSWER, log_prob=True, **options)
    assert row_pixels.shape == (2, ANSWER.shape[1], *prompt.images["pixel_values"].shape[1:])
    torch.testing.assert_close(row_pixels.sum(dim=1), span_pixels, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(row_tokens.sum(dim=1), span_tokens, rtol=1e-4, atol=1e-6)
    sequence = with_answer(prompt)
    last = explainer.attribute(sequence.input_ids, target=ANSWER[:, -1], additional_forward_args=sequence.args, through_vision_tower=True)
    assert isinstance(last, tuple) and last[1].shape == prompt.images["pixel_values"].shape
    with pytest.raises(ValueError, match="pixel_values"):
        explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=(prompt.attention_mask,), through_vision_tower=True)
    with pytest.raises(TypeError, match="pixel_baselines"):
        explainer.attribute_span(prompt.input_ids, ANSWER, through_vision_tower=True, pixel_baselines="grey")
    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    with pytest.raises(ValueError, match="through_vision_tower gives relevance per pixel"):
        LLMAttentionAttribution(explainer, make_word_tokenizer()).attribute(_image_mask_input(), target=torch.tensor([10]), through_vision_tower=True)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "idefics3", "mistral3"])
@pytest.mark.parametrize("method", [NormAttention, ALTI, ValueZeroing, TransformerAttribution])
def test_streaming_equals_eager_for_every_kind_of_method(family, method):
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    streamed, eager = (
        method(model, capture=capture).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
        for capture in ("streaming", "eager")
    )
    assert eager[with_answer(prompt).input_ids == IMAGE].abs().max() > 0
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llava_next"])  # its own test below
def test_each_image_token_lands_on_its_patches_place_in_the_grid(family):
    """With the vision tower's attention outputs zeroed, an image token's features depend on
    its own patches only: changing one patch changes one token, which the grid places
    where the patch lies (for the merging families, the merged patch's place)."""
    model = _not_mixing_patches(make_vlm(family))
    prompt = make_vlm_prompt(family)
    for example, (rows, columns) in enumerate(GRIDS[family]):
        for row, column in [(0, 0), (rows - 1, columns - 1), (rows - 1, 0)]:
            changed = _changed_tokens(model, family, prompt, example, row, column)
            grid = image_scores(model, prompt.input_ids, changed, prompt.images)[example][0]
            expected = torch.zeros(rows, columns)
            expected[row, column] = 1.0
            torch.testing.assert_close(grid, expected)


def test_llava_nexts_tiles_land_on_one_grid_unpadded_without_its_newlines():
    """LLaVA-NeXT's second grid is the image's tiles' patches: a 32 × 64 image is two tiles
    side by side (4 × 8 cells), a 64 × 32 one two tiles one above the other (8 × 4), each
    row followed by a newline feature. Changing one 8 × 8 block of the image (at the
    tiles' own resolution) changes the one cell of that block."""
    from vlm_models import llava_next_pictures, llava_next_processor

    model = _not_mixing_patches(make_vlm("llava_next"))
    prompt = make_vlm_prompt("llava_next")
    pictures = llava_next_pictures()
    for example, (rows, columns) in enumerate([(4, 8), (8, 4)]):
        for row, column in [(0, 0), (rows - 1, columns - 1), (rows - 1, 0), (0, columns - 1)]:
            changed_pictures = [p.copy() for p in pictures]
            block = changed_pictures[example][row * 8 : row * 8 + 8, column * 8 : column * 8 + 8]
            block[...] = 1.0 - block
            changed = dict(llava_next_processor()(images=changed_pictures, return_tensors="pt", do_rescale=False))
            before = _language_model_inputs(model, prompt)
            after = _language_model_inputs(model, SimpleNamespace(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images=changed))
            moved = ((after - before).abs().sum(-1) > 1e-6).float()
            base, tiles = image_scores(model, prompt.input_ids, moved, prompt.images)[example]
            expected = torch.zeros(rows, columns)
            expected[row, column] = 1.0
            torch.testing.assert_close(tiles, expected)
            assert base.shape == (4, 4) and moved[example].sum() > 1, "the resized whole image changes too"


def test_a_prompt_with_too_few_image_tokens_is_refused_in_one_line():
    model, prompt = make_vlm("llava"), make_vlm_prompt("llava")
    short = prompt.input_ids.clone()
    short[0, short[0].tolist().index(IMAGE)] = 5
    with pytest.raises(ValueError, match=r"Example 0 holds 15 image tokens, but its 1 image\(s\) need 16") as refused:
        image_scores(model, short, torch.ones(short.shape), prompt.images)
    assert "\n" not in str(refused.value)


def test_an_unknown_layout_gives_the_image_tokens_in_order_with_a_warning(monkeypatch):
    from captum_attention.capture.adapters import images

    model, prompt = make_vlm("llava"), make_vlm_prompt("llava")
    monkeypatch.delitem(images._LAYOUTS, "llava")
    scores = torch.arange(prompt.input_ids.numel(), dtype=torch.float).view(prompt.input_ids.shape)
    with pytest.warns(UserWarning, match="layout of llava's image tokens is not known"):
        placed = image_scores(model, prompt.input_ids, scores, prompt.images)
    torch.testing.assert_close(placed[1][0], scores[1][prompt.input_ids[1] == IMAGE])


def _with_token_types(family: str, prompt) -> tuple:
    """The prompt with the token types its processor gives (PaliGemma: 0 over the whole
    prompt, its prefix; Gemma 3: 1 at the image tokens), and the answer's as ``generate``
    gives them (PaliGemma: 1, its causal suffix; Gemma 3: text, 0)."""
    types = torch.zeros_like(prompt.input_ids) if family == "paligemma" else (prompt.input_ids == IMAGE).long()
    answer_types = torch.full_like(ANSWER, 1 if family == "paligemma" else 0)
    with_types = SimpleNamespace(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images={**prompt.images, "token_type_ids": types})
    return with_types, {**prompt.images, "token_type_ids": torch.cat([types, answer_types], dim=1)}


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
@pytest.mark.parametrize("method", MAP_METHODS)
def test_a_prefix_seen_both_ways_is_explained_exactly(family, method):
    """Given token types, PaliGemma's prompt and Gemma 3's images see each other both ways
    (a prefix language model); the answer after them is causal, and its span equals the
    reference of the eager twin called with the token types generate would pass."""
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    typed, answered_images = _with_token_types(family, prompt)
    before = model_state(model)
    scores = METHODS[method].cls(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=(prompt.attention_mask, typed.images))
    assert_same_state(before, model_state(model))
    reference_prompt = SimpleNamespace(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images=answered_images)
    reference = vlm_span_reference(model, family, reference_prompt)
    sequence_mask = torch.cat([prompt.attention_mask, torch.ones_like(ANSWER)], dim=1).bool()
    pairs = sequence_mask[:, :, None] & sequence_mask[:, None, :]
    assert (reference.attentions[0][:, 0].triu(1) * pairs).abs().max() > 0, "the image tokens see later ones"
    prompt_len = prompt.input_ids.shape[1]
    expected = span_reference(method, reference, sequence_mask, range(prompt_len - 1, prompt_len + 1))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
def test_an_answer_longer_than_the_text_after_the_image_keeps_its_text_token_types():
    """Generate extends Gemma 3's token types one token at a time, each the last repeated
    (text); extended by the answer's length at once, transformers' generic update would
    repeat the last five, reaching back into the image (three answer tokens would see each
    other both ways)."""
    model, prompt = make_vlm("gemma3"), make_vlm_prompt("gemma3")
    answer = torch.tensor([[20, 21, 22, 23, 24], [25, 26, 27, 28, 29]])
    typed, _ = _with_token_types("gemma3", prompt)
    scores = RawAttention(model).attribute_span(prompt.input_ids, answer, additional_forward_args=(prompt.attention_mask, typed.images))
    answered = {**typed.images, "token_type_ids": torch.cat([typed.images["token_type_ids"], torch.zeros_like(answer)], dim=1)}
    reference = vlm_span_reference(model, "gemma3", SimpleNamespace(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images=answered), answer)
    sequence_mask = torch.cat([prompt.attention_mask, torch.ones_like(answer)], dim=1).bool()
    prompt_len = prompt.input_ids.shape[1]
    expected = span_reference("raw", reference, sequence_mask, range(prompt_len - 1, prompt_len + 4))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
def test_a_prefix_seen_both_ways_gives_rows_that_sum_to_the_span_and_refuses_what_needs_each_rows_keys():
    model, prompt = make_vlm("paligemma"), make_vlm_prompt("paligemma")
    typed, _ = _with_token_types("paligemma", prompt)
    explainer = RawAttention(model)
    arguments = (prompt.attention_mask, typed.images)
    rows = explainer.attribute_continuation(prompt.input_ids, ANSWER, additional_forward_args=arguments)
    torch.testing.assert_close(rows.sum(dim=1), explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=arguments))
    with pytest.raises(UnsupportedModelError, match="see each other both ways") as refused:
        explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=arguments, effective=True)
    assert "\n" not in str(refused.value)


@pytest.mark.usefixtures("capture_mode")
def test_a_generating_model_whose_whole_prompt_is_its_prefix_explains_its_last_token():
    """PaliGemma's prompt alone, all of it a prefix that sees itself both ways, is still a
    generating model's: its logits predict the next token at the last position, which the
    methods explain by default (an encoder's default would be its first token)."""
    model, prompt = make_vlm("paligemma"), make_vlm_prompt("paligemma")
    typed, _ = _with_token_types("paligemma", prompt)
    arguments = (prompt.attention_mask, typed.images)
    explainer = TransformerAttribution(model)
    by_default = explainer.attribute(prompt.input_ids, target=5, additional_forward_args=arguments)
    last = torch.full((prompt.input_ids.shape[0],), prompt.input_ids.shape[1] - 1)
    torch.testing.assert_close(by_default, explainer.attribute(prompt.input_ids, target=5, additional_forward_args=arguments, query_index=last))
    first = (prompt.attention_mask.cumsum(1) == 1).long().argmax(dim=1)
    assert not torch.allclose(by_default, explainer.attribute(prompt.input_ids, target=5, additional_forward_args=arguments, query_index=first))


@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_token_types_that_put_the_answer_in_the_prefix_are_refused_in_one_line(capture, monkeypatch):
    """A model whose generate extended PaliGemma's token types by repeating the last (the
    generic update) would put the answer in the prefix, and let the prompt see it."""
    from transformers import GenerationMixin

    model, prompt = make_vlm("paligemma"), make_vlm_prompt("paligemma")
    typed, _ = _with_token_types("paligemma", prompt)
    monkeypatch.setattr(type(model), "_update_model_kwargs_for_generation", GenerationMixin._update_model_kwargs_for_generation)
    with pytest.raises(ValueError, match="which the prompt never sees: in this forward it does") as refused:
        GradSAM(model, capture=capture).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=(prompt.attention_mask, typed.images))
    assert "\n" not in str(refused.value)


def _mllama_expected(method: str, model: nn.Module, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, the cross-attending reference over its real text (up to the last
    query) and the states of its real tiles."""
    ref = mllama_span_reference(model, prompt)
    sequence = mllama_with_answer(prompt)
    states_real, length = mllama_states_real(prompt), sequence.input_ids.shape[1]
    text_real = sequence.attention_mask.bool() & (torch.arange(length) <= length - 2)
    source, target = torch.zeros(states_real.shape), torch.zeros(text_real.shape)
    for b in range(len(text_real)):
        t, s = text_real[b].nonzero().flatten(), states_real[b].nonzero().flatten()
        layers = []
        for attention, grad in zip(ref.attentions, ref.grads):
            keys = t if attention.shape[-1] == length else s
            layers.append(("decoder" if attention.shape[-1] == length else "cross", attention[b][:, t][:, :, keys], grad[b][:, t][:, :, keys]))
        rows = [int((t == p).nonzero()) for p in (length - 3, length - 2)]
        source[b, s], target[b, t] = (x.float() for x in cross_attending_reference(method, layers, rows))
    return source, target


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", MAP_METHODS)
def test_mllamas_span_equals_the_reference_of_its_self_and_cross_attention(method):
    """Left padding, two images of different tiles in one example, a padding tile and a
    missing image in the other."""
    model, prompt = make_mllama(), make_mllama_prompt()
    source = check_cross_attending_span(method, model, prompt, _mllama_expected(method, model, prompt))
    assert (source[~mllama_states_real(prompt)] == 0).all(), "padding tiles and the missing image score 0"


@pytest.mark.usefixtures("capture_mode")
def test_mllamas_attn_lrp_equals_the_rules_written_out():
    model, prompt = make_mllama(), make_mllama_prompt()
    source, target = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    sequence = mllama_with_answer(prompt)
    images = {k: v for k, v in prompt.images.items() if k != "cross_attention_mask"}
    with torch.no_grad():
        vision = model.model.vision_model(**images).last_hidden_state
        states = model.model.multi_modal_projector(vision).reshape(len(vision), -1, model.config.text_config.hidden_size)
    tokens, features = mllama_relevance(model, sequence.input_ids, sequence.attention_mask, states, sequence.images["cross_attention_mask"], ANSWER)
    real = mllama_states_real(prompt)
    assert features[real].abs().max() > 0
    expected_target = (tokens * sequence.attention_mask).masked_fill(torch.arange(tokens.shape[1]) == tokens.shape[1] - 1, 0.0)
    torch.testing.assert_close(target, expected_target, rtol=1e-5, atol=1e-5 * expected_target.abs().max().item())
    torch.testing.assert_close(source, features * real, rtol=1e-5, atol=1e-5 * features.abs().max().item())


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", [*MAP_METHODS, "attn_lrp"])
def test_mllamas_token_rows_sum_to_its_span_and_its_images_land_on_their_tiles(method):
    model, prompt = make_mllama(), make_mllama_prompt()
    explainer = METHODS[method].cls(model)
    rows = explainer.attribute_continuation(prompt.input_ids, ANSWER, additional_forward_args=prompt.args, log_prob=True)
    span = explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    if method in ("raw", "rollout"):  # the gradient methods' span is of the summed objective, not of rows
        for side_rows, side in zip(rows, span):
            torch.testing.assert_close(side_rows.sum(dim=1), side, rtol=1e-5, atol=1e-6)
    grids = image_scores(model, prompt.input_ids, span, prompt.images)
    assert [[tuple(grid.shape) for grid in example] for example in grids] == [[(2, 4)], [(4, 4), (2, 2)]]
    # the 2 × 2 image's second tile (top right): states 5·1 + 1.. of its first image, cell (0..1, 2..3)
    torch.testing.assert_close(grids[1][0][:2, 2:].flatten(), span[0][1, 6:10])


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", MAP_METHODS)
def test_mllama_given_text_only_is_explained_as_its_self_attention_stack(method):
    """Without an image its cross-attention layers do not run: a decoder of its self-attention."""
    model, prompt = make_mllama(), make_mllama_prompt()
    scores = METHODS[method].cls(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=(prompt.attention_mask,))
    text = VLMPrompt(prompt.input_ids, prompt.attention_mask, {})
    prompt_len = prompt.input_ids.shape[1]
    real = torch.cat([prompt.attention_mask, torch.ones_like(ANSWER)], dim=1).bool()
    expected = span_reference(method, vlm_span_reference(model, "mllama", text), real, range(prompt_len - 1, prompt_len + 1))
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("shape, changed, cell", [((16, 32), (8, 16), (1, 2)), ((32, 32), (16, 8), (2, 1))])
def test_mllamas_image_states_land_where_its_processor_cut_the_tiles(shape, changed, cell):
    """Mllama's own image processor tiles a picture; one 8 × 8 patch of it changed, the
    tower's attention kept from mixing patches, changes one state, which image_scores puts
    at that patch's cell of the image's grid (a 16 × 32 picture: 1 × 2 tiles; 32 × 32: 2 × 2)."""
    import transformers as tf

    model = _not_mixing_patches(make_mllama())
    processor = tf.MllamaImageProcessor(size={"height": 16, "width": 16}, max_image_tiles=4, do_rescale=False)
    picture = np.random.default_rng(0).random((*shape, 3)).astype("float32")
    edited = picture.copy()
    edited[changed[0] : changed[0] + 8, changed[1] : changed[1] + 8] = 1.0 - edited[changed[0] : changed[0] + 8, changed[1] : changed[1] + 8]
    states = []
    for image in (picture, edited):
        inputs = {k: v for k, v in processor(images=[[image]], return_tensors="pt").items() if k != "num_tiles"}
        with torch.no_grad():
            vision = model.model.vision_model(**inputs).last_hidden_state
            states.append(model.model.multi_modal_projector(vision).reshape(1, -1, model.config.text_config.hidden_size))
    moved = (states[1] - states[0]).norm(dim=-1)
    one_hot = torch.zeros_like(moved).scatter(1, moved.argmax(dim=1, keepdim=True), 1.0)
    (grid,) = image_scores(model, torch.tensor([[1, IMAGE]]), (one_hot, torch.zeros(1, 2)), inputs)[0]
    assert divmod(int(grid.argmax()), grid.shape[1]) == cell and grid.sum() == 1


def test_mllama_refuses_what_it_cannot_explain_in_one_line():
    model, prompt = make_mllama(), make_mllama_prompt()
    with pytest.raises(ValueError, match="through_vision_tower") as refused:
        AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args, through_vision_tower=True)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="axis='key'") as refused:
        GradSAM(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args, axis="key")
    with pytest.raises(ValueError, match="one self-attention stack") as refused:
        ALTI(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)


def _language_model_inputs(model: nn.Module, prompt) -> torch.Tensor:
    """The embeddings the language model reads (a pre-hook on it during a plain forward)."""
    seen = []
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw["inputs_embeds"].detach()), with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, **prompt.images)
    finally:
        hook.remove()
    return seen[0]


def _not_mixing_patches(model: nn.Module) -> nn.Module:
    vision = next(getattr(model.model, name) for name in ("vision_tower", "visual", "vision_model") if hasattr(model.model, name))
    with torch.no_grad():
        for module in vision.modules():
            projection = next((getattr(module, n) for n in ("out_proj", "o_proj", "proj") if hasattr(module, n)), None)
            if type(module).__name__.endswith("Attention") and isinstance(projection, nn.Linear):
                for parameter in projection.parameters():
                    parameter.zero_()
    return model


def _changed_tokens(model: nn.Module, family: str, prompt, example: int, row: int, column: int) -> torch.Tensor:
    """``(B, T)``: 1 where the language model's input changes when the image patch that
    lands at (row, column) of the example's grid changes."""
    if family == "qwen2_vl":
        return _changed_qwen_tokens(model, prompt, example, row, column)
    scale = {"gemma3": 2, "idefics3": 2, "mistral3": 2}.get(family, 1)  # patches per grid cell along a side
    changed = {key: value.clone() for key, value in prompt.images.items()}
    patch = 8 * scale
    changed["pixel_values"][example, ..., row * patch : row * patch + 8, column * patch : column * patch + 8] += 1.0
    before = _language_model_inputs(model, prompt)
    after = _language_model_inputs(model, SimpleNamespace(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images=changed))
    return ((after - before).abs().sum(-1) > 1e-6).float()


def _changed_qwen_tokens(model: nn.Module, prompt, example: int, row: int, column: int) -> torch.Tensor:
    """Qwen2-VL's patches come flattened in its processor's order: both images are made by
    the processor, and one 4×4-pixel patch of the merged cell changed."""
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor(patch_size=4, temporal_patch_size=2, merge_size=2, do_resize=False)
    generator = np.random.default_rng(0)
    images = [generator.random((16, 16, 3)), generator.random((16, 24, 3))]
    made = processor(images=images, return_tensors="pt")
    assert made["image_grid_thw"].tolist() == prompt.images["image_grid_thw"].tolist()
    images[example][row * 8 : row * 8 + 4, column * 8 : column * 8 + 4] += 0.5
    remade = processor(images=images, return_tensors="pt")
    inputs = lambda pixels: SimpleNamespace(  # noqa: E731
        input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, images={**prompt.images, "pixel_values": pixels}
    )
    before, after = (_language_model_inputs(model, inputs(m["pixel_values"])) for m in (made, remade))
    return ((after - before).abs().sum(-1) > 1e-6).float()


def _image_mask_input(size=(64, 64), token_types=False, **segments):
    """A PIL image and a LLaVA processor function (the image resized to 32 × 32, its 16
    tokens after BOS, then "cat sat"; with ``token_types``, PaliGemma's too: 0, its prefix),
    segmented in four quadrants unless told."""
    from captum.attr import ImageMaskInput
    from PIL import Image

    width, height = size
    pixels = (np.random.default_rng(0).random((height, width, 3)) * 255).astype("uint8")
    image = Image.fromarray(pixels)

    def processor_fn(picture):
        resized = torch.tensor(np.asarray(picture.resize((32, 32))), dtype=torch.float).permute(2, 0, 1)[None] / 255
        ids = torch.tensor([[1] + [IMAGE] * 16 + [5, 9]])
        types = {"token_type_ids": torch.zeros_like(ids)} if token_types else {}
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": resized, **types}

    if not segments:
        quadrants = torch.zeros(height, width, dtype=torch.int32)
        quadrants[: height // 2, width // 2 :], quadrants[height // 2 :, : width // 2], quadrants[height // 2 :, width // 2 :] = 1, 2, 3
        segments = {"mask": quadrants}
    return ImageMaskInput(image=image, processor_fn=processor_fn, **segments)


@pytest.mark.parametrize("method", [GradSAM, AttnLRP])
def test_captums_image_mask_input_scores_each_segment_by_its_image_tokens(method):
    """Each quadrant of the image is a 2 × 2 block of LLaVA's 4 × 4 patch grid: its score is
    the block's sum, in seq_attr and in every token row; Captum's plot draws it."""
    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model, inp = make_vlm("llava"), _image_mask_input()
    answer = torch.tensor([10, 11])
    result = LLMAttentionAttribution(method(model), make_word_tokenizer()).attribute(inp, target=answer)
    model_input = inp.to_model_input()
    images = {"pixel_values": model_input["pixel_values"]}
    args = (model_input["attention_mask"], images)
    explainer = method(model)
    span = explainer.attribute_span(model_input["input_ids"], answer[None], additional_forward_args=args)
    rows = explainer.attribute_continuation(model_input["input_ids"], answer[None], additional_forward_args=args, log_prob=True)
    for got, scores in ((result.seq_attr, span), (result.token_attr, rows)):
        (grid,) = image_scores(model, model_input["input_ids"], scores, images)[0]
        blocks = grid.reshape(*grid.shape[:-2], 2, 2, 2, 2).sum(dim=(-3, -1)).flatten(-2)
        torch.testing.assert_close(got, blocks)
    assert result.input_tokens == [f"image_feature_{i}" for i in range(4)]
    figure, _ = result.plot_image_heatmap()
    assert figure is not None


@pytest.mark.parametrize("method", [TransformerAttribution, AttnLRP])
def test_captums_image_mask_input_scores_mllamas_segments_by_its_image_states(method):
    """A 16 × 32 image cut in two 16-pixel tiles side by side (Mllama's 1 × 2 aspect ratio):
    its states' grid is 2 × 4 patches, each quadrant a 1 × 2 block of it."""
    from captum.attr import ImageMaskInput
    from PIL import Image

    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model = make_mllama()
    picture = Image.fromarray((np.random.default_rng(0).random((16, 32, 3)) * 255).astype("uint8"))

    def processor_fn(image):
        pixels = torch.tensor(np.asarray(image), dtype=torch.float).permute(2, 0, 1) / 255
        tiles = torch.zeros(1, 1, 4, 3, 16, 16)
        tiles[0, 0, 0], tiles[0, 0, 1] = pixels[:, :, :16], pixels[:, :, 16:]
        ids = torch.tensor([[1, IMAGE, 5, 9]])
        cross = torch.zeros(1, 4, 1, 4, dtype=torch.long)
        cross[:, 1:, :, :2] = 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": tiles, "aspect_ratio_ids": torch.tensor([[2]]),
                "aspect_ratio_mask": torch.tensor([[[1, 1, 0, 0]]]), "cross_attention_mask": cross}

    quadrants = torch.zeros(16, 32, dtype=torch.int32)
    quadrants[:8, 16:], quadrants[8:, :16], quadrants[8:, 16:] = 1, 2, 3
    inp = ImageMaskInput(image=picture, processor_fn=processor_fn, mask=quadrants)
    answer = torch.tensor([10, 11])
    result = LLMAttentionAttribution(method(model), make_word_tokenizer()).attribute(inp, target=answer)
    model_input = inp.to_model_input()
    images = {k: v for k, v in model_input.items() if k not in ("input_ids", "attention_mask")}
    states, _ = method(model).attribute_span(model_input["input_ids"], answer[None], additional_forward_args=(model_input["attention_mask"], images))
    (grid,) = image_scores(model, model_input["input_ids"], states, images)[0]
    assert grid.shape == (2, 4) and grid.abs().max() > 0
    torch.testing.assert_close(result.seq_attr, grid.reshape(2, 1, 2, 2).sum(dim=(1, 3)).flatten())
    assert result.token_attr.shape == (2, 4)


def test_captums_interface_explains_a_prefix_language_models_answer():
    """PaliGemma's processor output with its token types (the prompt a bidirectional prefix)
    through LLMAttentionAttribution: the segments are the span's image grid in blocks."""
    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model, inp = make_vlm("paligemma"), _image_mask_input(token_types=True)
    answer = torch.tensor([10, 11])
    result = LLMAttentionAttribution(TransformerAttribution(model), make_word_tokenizer()).attribute(inp, target=answer)
    model_input = inp.to_model_input()
    images = {key: model_input[key] for key in ("pixel_values", "token_type_ids")}
    span = TransformerAttribution(model).attribute_span(model_input["input_ids"], answer[None], additional_forward_args=(model_input["attention_mask"], images))
    (grid,) = image_scores(model, model_input["input_ids"], span, images)[0]
    assert grid.abs().max() > 0
    torch.testing.assert_close(result.seq_attr, grid.reshape(2, 2, 2, 2).sum(dim=(1, 3)).flatten())


def test_segments_that_overlap_share_each_patch_by_their_pixels():
    """A mask list of the image's left column of patches and its top-left quarter: a patch
    of both counts wholly in each (Captum's mask_list allows overlapping features)."""
    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    left = torch.zeros(64, 64, dtype=torch.bool)
    left[:, :16] = True
    quarter = torch.zeros(64, 64, dtype=torch.bool)
    quarter[:8, :8] = True  # a quarter of the top-left patch
    model, inp = make_vlm("llava"), _image_mask_input(mask_list=[left, quarter])
    result = LLMAttentionAttribution(RawAttention(model), make_word_tokenizer()).attribute(inp, target=torch.tensor([10]))
    model_input = inp.to_model_input()
    images = {"pixel_values": model_input["pixel_values"]}
    span = RawAttention(model).attribute_span(model_input["input_ids"], torch.tensor([[10]]), additional_forward_args=(model_input["attention_mask"], images))
    (grid,) = image_scores(model, model_input["input_ids"], span, images)[0]
    torch.testing.assert_close(result.seq_attr, torch.stack([grid[:, 0].sum(), grid[0, 0] / 4]))


def test_an_image_the_grid_does_not_follow_is_refused_in_one_line():
    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model, inp = make_vlm("llava"), _image_mask_input(size=(64, 32))
    with pytest.raises(ValueError, match=r"4×4 grid does not follow the 32×64 image's shape") as refused:
        LLMAttentionAttribution(GradSAM(model), make_word_tokenizer()).attribute(inp, target=torch.tensor([10]))
    assert "\n" not in str(refused.value)


def test_the_segments_compare_with_captums_feature_ablation_on_the_generated_answer():
    from captum.attr import FeatureAblation, LLMAttribution

    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model, inp, tokenizer = make_vlm("llava"), _image_mask_input(), make_word_tokenizer()
    ours = LLMAttentionAttribution(TransformerAttribution(model), tokenizer)
    answer = ours.target_tokens(inp, gen_args={"max_new_tokens": 2})
    result = ours.attribute(inp, gen_args={"max_new_tokens": 2})
    ablation = LLMAttribution(FeatureAblation(model), tokenizer).attribute(inp, target=answer)
    assert result.output_tokens == ablation.output_tokens and len(answer) == 2
    assert result.seq_attr.shape == ablation.seq_attr.shape == (4,)
    assert result.token_attr.shape == ablation.token_attr.shape == (2, 4)


def _row_images(prompt: VLMPrompt, row: int, real: torch.Tensor) -> dict[str, torch.Tensor]:
    """Example ``row``'s own image inputs (Qwen2-VL's: its image's rows of flattened
    patches and its grid), its token types on its real tokens."""
    images = {}
    for name, value in prompt.images.items():
        if name == "mm_token_type_ids":
            images[name] = value[row : row + 1, real]
        elif name == "pixel_values" and "image_grid_thw" in prompt.images:
            patches = prompt.images["image_grid_thw"].prod(dim=1).tolist()
            images[name] = value[sum(patches[:row]) : sum(patches[: row + 1])]
        else:
            images[name] = value[row : row + 1]
    return images


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "paligemma"])  # its whole prompt is a prefix: tested above
def test_a_left_padded_batch_explains_each_example_as_alone(family):
    """Each example's prompt and image, unpadded and alone, give its row of the padded batch."""
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    explainer = GradSAM(model)
    together = explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    for row in range(2):
        real = prompt.attention_mask[row] != 0
        alone = explainer.attribute_span(
            prompt.input_ids[row : row + 1, real], ANSWER[row : row + 1],
            additional_forward_args=(prompt.attention_mask[row : row + 1, real], _row_images(prompt, row, real)),
        )
        kept = torch.cat([real, torch.ones(ANSWER.shape[1], dtype=torch.bool)])
        assert alone.abs().max() > 0
        torch.testing.assert_close(together[row : row + 1, kept], alone, rtol=1e-5, atol=1e-6 * alone.abs().max().item())


def test_a_left_padded_batch_the_model_reads_otherwise_than_each_alone_is_refused_in_one_line():
    """PaliGemma without its token types reads a left-padded prompt otherwise than the
    prompt alone (its next-token logits move by about 1e-3 of their scale): the batch is
    refused, as a language model's would be; with them (as its processor gives them) it is
    explained. The verdict is kept per set of image inputs."""
    model, prompt = make_vlm("paligemma"), make_vlm_prompt("paligemma")
    untyped = {name: value for name, value in prompt.images.items() if name != "token_type_ids"}
    with pytest.raises(UnsupportedModelError, match=r"reads a left-padded prompt otherwise than the prompt alone.*\. Pad its prompts on the right"):
        GradSAM(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=(prompt.attention_mask, untyped))
    GradSAM(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)


def gauss_legendre_scores(
    embeddings: nn.Module, actual: torch.Tensor, start: torch.Tensor, steps: int, log_prob: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """Captum's Gauss-Legendre rule written out: at each step the output of ``embeddings``
    moved from ``start`` to ``actual``, the answer's ``log_prob()`` of the model run so
    differentiated there by autograd; the integral times ``actual - start``, summed over the
    embedding."""
    from captum.attr._utils.approximation_methods import approximation_parameters

    step_sizes, alphas = approximation_parameters("gausslegendre")
    integral = torch.zeros_like(actual)
    for alpha, weight in zip(alphas(steps), step_sizes(steps)):
        moved = (start + alpha * (actual - start)).requires_grad_(True)
        handle = embeddings.register_forward_hook(lambda module, args, output: moved)
        try:
            value = log_prob()
        finally:
            handle.remove()
        integral += weight * torch.autograd.grad(value, moved)[0]
    return (integral * (actual - start)).sum(dim=-1)


@pytest.mark.parametrize("family", ["llava", "paligemma", "gemma3", "qwen2_vl", "idefics3", "mistral3"])
def test_integrated_gradients_of_an_answer_hold_the_image(family):
    """``answer_integrated_gradients`` with the image inputs: Captum's Gauss-Legendre rule
    written out, each step the input embeddings' output moved from the baseline (the
    prompt's text tokens at id 0, its image tokens kept) to the prompt's own, and the
    answer's log-probability differentiated there by autograd, with the image inputs
    extended over the answer as each family's ``generate`` types it (PaliGemma's suffix
    1, the others' text 0); the image's tokens score 0."""
    from captum_attention.presentation.explain import answer_integrated_gradients

    model, ids, images = family_example(family)
    answer, steps = ANSWER[:1], 6
    sequence = torch.cat([ids, answer], dim=1)
    baseline = sequence.clone()
    baseline[:, : ids.shape[1]] = ids.masked_fill(ids != IMAGE, 0)
    embeddings = model.get_input_embeddings()
    actual, start = embeddings(sequence).detach(), embeddings(baseline).detach()
    typed = torch.ones_like(answer) if family == "paligemma" else torch.zeros_like(answer)
    extended = {name: torch.cat([value, typed], dim=1) if name.endswith("token_type_ids") else value for name, value in images.items()}

    def log_prob() -> torch.Tensor:
        logits = model(input_ids=sequence, **extended).logits[:, ids.shape[1] - 1 : -1]
        return logits.float().log_softmax(dim=-1).gather(2, answer[..., None]).sum()

    expected = gauss_legendre_scores(embeddings, actual, start, steps, log_prob)[:, : ids.shape[1]]
    scores = answer_integrated_gradients(model, ids, answer, steps, images)
    assert expected.abs().max() > 0 and bool((scores[ids == IMAGE] == 0).all())
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)


def test_integrated_gradients_of_an_encoder_decoders_answer_hold_its_image():
    """Florence-2's answer: the same rule written out over its source's token embeddings,
    its decoder reading its start token and the answer (the source and the answer were
    read as one decoder's sequence); the image's tokens score 0."""
    from test_encoder_decoder import _tiny_florence2

    from captum_attention.capture.inputs import decoder_start_token
    from captum_attention.presentation.explain import answer_integrated_gradients

    model = _tiny_florence2()
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    image = model.config.image_token_id
    ids, answer, steps = torch.tensor([[1, *[image] * 5, 5, 6, 7]]), torch.tensor([[9, 10, 11]]), 6
    decoder = torch.cat([torch.tensor([[decoder_start_token(model)]]), answer[:, :-1]], dim=1)
    embeddings = model.get_input_embeddings()
    actual, start = embeddings(ids).detach(), embeddings(ids.masked_fill(ids != image, 0)).detach()

    def log_prob() -> torch.Tensor:
        logits = model(input_ids=ids, decoder_input_ids=decoder, **images).logits
        return logits.float().log_softmax(dim=-1).gather(2, answer[..., None]).sum()

    expected = gauss_legendre_scores(embeddings, actual, start, steps, log_prob)
    scores = answer_integrated_gradients(model, ids, answer, steps, images)
    assert expected.abs().max() > 0 and bool((scores[ids == image] == 0).all())
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)


def test_integrated_gradients_where_the_prompt_is_not_embedded_once_are_refused_in_one_line():
    """A T5 whose source and answer go through one embedding module (as it was tied before
    transformers 5): moving it would move the answer's embeddings too (Captum's assertion,
    or a silently wrong integral, before)."""
    from lm_models import make_encoder_decoder

    from captum_attention.presentation.explain import answer_integrated_gradients

    model = make_encoder_decoder("t5")
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared
    with pytest.raises(ValueError, match="calls the module that embeds its prompt .* 2 times") as refused:
        answer_integrated_gradients(model, torch.tensor([[5, 6, 7]]), torch.tensor([[8]]), 4)
    assert "\n" not in str(refused.value)


def test_integrated_gradients_of_an_answer_encode_the_image_once(monkeypatch):
    """LLaVA's steps take its image encoded once by the vision tower (and once more from the
    pixels, which shows the encoded image gives the answer the same log-probability), not
    at each of the steps and the baseline's forward: the same scores as the tower rerun."""
    from captum_attention.presentation import explain

    model, ids, images = family_example("llava")
    scores = {}
    rows = tower_rows(model, lambda: scores.update(once=explain.answer_integrated_gradients(model, ids, ANSWER[:1], 6, images)), monkeypatch)
    assert rows == 2
    monkeypatch.setattr(explain, "encoded_images", lambda model, images: None)
    torch.testing.assert_close(scores["once"], explain.answer_integrated_gradients(model, ids, ANSWER[:1], 6, images), rtol=1e-4, atol=1e-6)


def test_a_model_that_adds_positions_of_unknown_place_is_refused_in_one_line(capture_mode, monkeypatch):
    """A text model that attends over more positions than its tokens, in a family not known
    to put them before the tokens (GIT's known place taken away here), is refused naming
    them; the tokens alone are explained."""
    from captum_attention.capture.adapters import images
    from vlm_models import make_git

    monkeypatch.setattr(images, "IMAGE_FEATURES_FIRST", {})
    model = make_git()
    ids = torch.randint(3, 99, (1, 6))
    args = (torch.ones_like(ids), {"pixel_values": torch.randn(1, 3, 32, 32)})
    for explain in (lambda: AttnLRP(model).attribute(ids, additional_forward_args=args),
                    lambda: AttnLRP(model).attribute_span(ids, torch.tensor([[5, 7]]), additional_forward_args=args)):
        assert_refused_in_one_line(model, explain, r"GitSelfAttention \(attention call 0\) attends over 1[13] positions for the [68] "
                                                   "input tokens: it also attends over positions no input token stands for")
    assert AttnLRP(model).attribute(ids, additional_forward_args=args[:1]).abs().sum() > 0


def _tiny_vq_model(family: str) -> nn.Module:
    """The architecture sweep's Chameleon or Emu3: a tiny VQ-VAE (8 codes, 32-pixel images
    halved three times: 4 × 4 codes; Emu3's rows each ended by its end-of-line token), its
    codes named in the vocabulary as its checkpoints name them, the image token 98."""
    import zoo

    return zoo.build(next(a for a in zoo.architectures("image-text-to-text") if a.model_type == family))


@pytest.mark.parametrize("family", ["chameleon", "emu3"])
def test_image_codes_of_a_vq_vae_are_read_by_the_language_model_and_land_on_their_grid(family, capture_mode):
    """Chameleon and Emu3 turn an image into codes of their vocabulary with a VQ-VAE, whose
    own attention (over the image's latent grid) is not read (it was taken for the language
    model's: every method failed). Grad-SAM equals its formula on the eager twin's maps and
    gradients, the image's tokens scored; each code lands on its place in the VQ-VAE's
    latent grid (Emu3's end-of-line tokens left out)."""
    model = _tiny_vq_model(family)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    images = {"pixel_values": pixels} if family == "chameleon" else {"pixel_values": pixels, "image_sizes": torch.tensor([[32, 32]])}
    per_row = 4 if family == "chameleon" else 5
    ids = torch.tensor([[1, *[98] * 4 * per_row, 5, 6, 7]])
    mask = torch.ones_like(ids)
    before = model_state(model)
    scores = GradSAM(model).attribute(ids, target=7, additional_forward_args=(mask, images))
    assert_same_state(before, model_state(model))
    twin = _tiny_vq_model(family)
    twin.set_attn_implementation("eager")
    out = twin(input_ids=ids, attention_mask=mask, **images, output_attentions=True)
    assert all(maps.shape[-1] == ids.shape[1] for maps in out.attentions)
    grads = torch.autograd.grad(out.logits[0, -1, 7], out.attentions)
    expected = reference_grad_sam(SimpleNamespace(attentions=out.attentions, grads=grads), [ids.shape[1]])
    assert scores[ids == 98].abs().max() > 0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    with torch.no_grad():
        encoded = model.model.vqmodel.encode(**images, return_dict=True)
    latent = encoded.quantized_last_hidden_state.shape[-2:] if family == "chameleon" else encoded.image_tokens[0].shape
    numbered = torch.zeros(ids.shape)
    numbered[ids == 98] = torch.arange(1.0, 4 * per_row + 1)
    grid = image_scores(model, ids, numbered, images)[0][0]
    torch.testing.assert_close(grid, torch.arange(1.0, 4 * per_row + 1).view(4, per_row)[:, :4].reshape(latent))


@pytest.mark.parametrize("family", ["blip", "git"])
def test_a_prompts_span_of_a_model_that_reads_its_image_apart_is_its_tokens(family):
    """``prompt_span``, which ``evaluate``'s metrics and the leave-one-out estimates rank a
    vision-language model's prompt by, gives the prompt tokens' scores of a model that
    reads its image apart (BLIP's states, GIT's features: the first of its pairs); it gave
    the image's scores, cut to the prompt's length."""
    from vlm_models import make_blip, make_git

    from captum_attention.presentation.explain import prompt_span

    model = make_blip() if family == "blip" else make_git()
    ids, answer = torch.tensor([[1, 5, 6, 7, 9]]), torch.tensor([[8, 10]])
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    image, tokens = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(torch.ones_like(ids), images))
    span = prompt_span(AttnLRP(model), ids, answer, images)
    torch.testing.assert_close(span, tokens[:, : ids.shape[1]].detach())
    assert not torch.allclose(span, image[:, : ids.shape[1]].detach(), atol=1e-3)


@pytest.mark.parametrize("family", ["blip", "git"])
def test_a_left_padded_batch_of_a_model_that_reads_its_image_apart_explains_each_example_as_alone(family):
    """BLIP (its prompt starting with bos_token_id, as its generate reads it) and GIT (its
    image features before the tokens): each example's prompt and image, unpadded and
    alone, give its row of the padded batch, on the image's side and the tokens'."""
    from vlm_models import make_blip, make_git

    model = make_blip() if family == "blip" else make_git()
    first = 1 if family == "blip" else 3
    ids = torch.tensor([[0, 0, first, 6, 7], [first, 4, 5, 6, 7]])
    mask, answer = (ids != 0).long(), torch.tensor([[8, 9], [9, 8]])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    explainer = AttnLRP(model)
    image, tokens = explainer.attribute_span(ids, answer, additional_forward_args=(mask, {"pixel_values": pixels}))
    for row in range(2):
        real = mask[row] != 0
        image_alone, tokens_alone = explainer.attribute_span(
            ids[row : row + 1, real], answer[row : row + 1],
            additional_forward_args=(mask[row : row + 1, real], {"pixel_values": pixels[row : row + 1]}),
        )
        kept = torch.cat([real, torch.ones(answer.shape[1], dtype=torch.bool)])
        assert image_alone.abs().max() > 0 and tokens_alone.abs().max() > 0
        torch.testing.assert_close(image[row : row + 1], image_alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(tokens[row : row + 1, kept], tokens_alone, rtol=1e-5, atol=1e-6)
