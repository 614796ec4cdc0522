"""The context metrics on a vision-language model's answer: each ablated prompt scored with
the example's image inputs, its image's tokens never removed, against the model run on
each ablated prompt alone (its per-token image inputs cut to the kept tokens, extended
over the answer as ``generate`` extends them)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_state, model_state
from vlm_models import ANSWER, IMAGE, VLMPrompt, family_example, make_vlm, make_vlm_prompt, one_example, tower_rows

from captum_attention.metrics import ablated_log_probs, attention_shares, linear_datamodeling_score, top_k_log_prob_drop
from captum_attention.metrics.context import answer_log_probs, context_averaged_scores

FAMILIES = ("llava", "qwen2_vl", "gemma3", "idefics3", "mistral3", "llava_next", "mllama")


def alone_inputs(ids: torch.Tensor, images: dict[str, torch.Tensor], kept: torch.Tensor, answer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's inputs for the prompt's ``kept`` tokens and the answer after them: the
    per-token image inputs cut to those tokens, the answer's text (its cross-attention
    mask the last prompt token's, as Mllama's ``generate`` extends it)."""
    sequence = torch.cat([ids[:, kept], answer], dim=1)
    inputs = {"input_ids": sequence, "attention_mask": torch.ones_like(sequence)}
    for name, value in images.items():
        if value.dim() >= 2 and value.shape[1] == ids.shape[1]:
            value = value[:, kept]
            tail = value[:, -1:] if name == "cross_attention_mask" else torch.zeros_like(value[:, :1])
            value = torch.cat([value] + [tail] * answer.shape[1], dim=1)
        inputs[name] = value
    return inputs


def alone_log_prob(model: torch.nn.Module, ids: torch.Tensor, images: dict[str, torch.Tensor], kept: torch.Tensor) -> float:
    """log p(ANSWER[0] | the prompt's ``kept`` tokens), the model run on them alone."""
    answer = ANSWER[:1]
    with torch.no_grad():
        logits = model(**alone_inputs(ids, images, kept, answer)).logits
    log_probs = logits[:, -answer.shape[1] - 1 : -1].float().log_softmax(dim=-1)
    return float(log_probs.gather(2, answer[..., None]).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_ablated_prompts_are_scored_as_each_alone_with_the_image_kept(family):
    model, ids, images = family_example(family)
    whole = alone_log_prob(model, ids, images, torch.ones(ids.shape[1], dtype=torch.bool))  # transformers installs its own output recorders on a first forward
    before = model_state(model)
    n = ids.shape[1]
    generator = torch.Generator().manual_seed(0)
    kept = torch.rand(1, 6, n, generator=generator) > 0.5
    kept[0, 0] = True  # the whole prompt, beside deletions of other lengths: the batch is left-padded
    values = ablated_log_probs(model, ids, torch.ones_like(ids), ANSWER[:1], kept, image_inputs=images)
    assert_same_state(before, model_state(model))
    image = ids[0] == IMAGE
    for a in range(kept.shape[1]):
        tokens = kept[0, a] | image
        tokens[0] = True  # BOS, never removed
        assert abs(float(values[0, a]) - alone_log_prob(model, ids, images, tokens)) < 1e-4, (family, a)
    assert float(values[0, 0]) == pytest.approx(whole, abs=1e-4)
    assert len({round(float(v), 4) for v in values[0]}) > 2, "the deletions must move the answer"


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_top_k_log_prob_drop_removes_the_top_text_tokens_and_keeps_the_image(family):
    model, ids, images = family_example(family)
    scores = torch.arange(ids.shape[1], dtype=torch.float32)[None].flip(1)  # the image's tokens score highest
    drops = top_k_log_prob_drop(model, ids, torch.ones_like(ids), ANSWER[:1], scores, ks=(1, 2), image_inputs=images)
    whole = torch.ones(ids.shape[1], dtype=torch.bool)
    text = ((ids[0] != IMAGE) & (torch.arange(ids.shape[1]) > 0)).nonzero().flatten()
    for column, k in enumerate((1, 2)):
        kept = whole.clone()
        kept[text[:k]] = False  # the highest-scored text tokens come first
        expected = alone_log_prob(model, ids, images, whole) - alone_log_prob(model, ids, images, kept)
        assert abs(float(drops[0, column]) - expected) < 1e-4
    assert float(answer_log_probs(model, ids, torch.ones_like(ids), ANSWER[:1], images)[0]) == pytest.approx(
        alone_log_prob(model, ids, images, whole), abs=1e-4
    )


def test_image_inputs_of_one_example_refuse_a_batch_of_several():
    model, prompt = make_vlm("llava"), make_vlm_prompt("llava")
    with pytest.raises(ValueError, match="one example at a time"):
        linear_datamodeling_score(
            model, prompt.input_ids, prompt.attention_mask, ANSWER, torch.rand(prompt.input_ids.shape), image_inputs=prompt.images
        )


def test_a_function_without_the_image_token_needs_the_images_tokens_kept_by_segments():
    model, ids, images = family_example("llava")

    def forward(input_ids, attention_mask, image_inputs):
        return model(input_ids=input_ids, attention_mask=attention_mask, **image_inputs)

    with pytest.raises(ValueError, match="segment -1"):
        answer_log_probs(forward, ids, torch.ones_like(ids), ANSWER[:1], images)
    segments = torch.arange(ids.shape[1])[None].masked_fill((ids == IMAGE) | (torch.arange(ids.shape[1]) == 0), -1)
    kept = torch.ones(1, 1, ids.shape[1], dtype=torch.bool)
    kept[0, 0, -2] = False
    value = ablated_log_probs(forward, ids, torch.ones_like(ids), ANSWER[:1], kept, segments, image_inputs=images)
    expected = torch.ones(ids.shape[1], dtype=torch.bool)
    expected[-2] = False
    assert float(value[0, 0]) == pytest.approx(alone_log_prob(model, ids, images, expected), abs=1e-4)


@pytest.mark.parametrize("capture", ["eager", "streaming"])
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_attention_shares_of_a_padded_batch_are_each_examples_from_output_attentions(family, capture):
    """Each segment's largest share of another token's attention, the image's tokens keys
    of no segment, against an eager twin's ``output_attentions`` of each example alone."""
    model, prompt = make_vlm(family), make_vlm_prompt(family)
    images = dict(prompt.images)
    if family == "gemma3":
        images["token_type_ids"] = (prompt.input_ids == IMAGE).long()
    shares = attention_shares(model, prompt.input_ids, prompt.attention_mask, ANSWER, capture=capture, image_inputs=images)
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    width = prompt.input_ids.shape[1]
    for b in range(2):
        ids, own = one_example(VLMPrompt(prompt.input_ids, prompt.attention_mask, images), b)
        pad = width - ids.shape[1]
        with torch.no_grad():
            attentions = twin(**alone_inputs(ids, own, torch.ones(ids.shape[1], dtype=torch.bool), ANSWER[b : b + 1]), output_attentions=True).attentions
        columns = torch.arange(ids.shape[1])
        segments = torch.cat([columns.masked_fill((ids[0] == IMAGE) | (columns == 0), -1), torch.full((ANSWER.shape[1],), -1)])
        for s in range(ids.shape[1]):
            held = max(float(attn[0][:, segments != s][..., segments == s].sum(dim=-1).max()) for attn in attentions) if (segments == s).any() else 0.0
            assert abs(float(shares[b, pad + s]) - held) < 1e-5, (family, b, s)
        assert float(shares[b, : pad + 1].abs().max()) == 0.0  # padding and BOS: no segment


def test_context_averaged_scores_give_each_context_its_image_inputs():
    """Every context keeps the image's tokens and gets the image with its token types cut
    to the kept tokens; the scores follow the formula (each removable token kept in half
    the contexts: its context share is its summed score's)."""
    model, ids, images = family_example("qwen2_vl")
    calls = []

    def explain(context_ids, context_mask, context_images):
        calls.append((context_ids, context_images))
        return context_ids.float()  # a score that follows each token

    prior = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    scores = context_averaged_scores(model, explain, ids, torch.ones_like(ids), ANSWER[:1], prior, num_contexts=4, image_inputs=images)
    assert len(calls) == 4
    for context_ids, context_images in calls:
        assert int((context_ids == IMAGE).sum()) == int((ids == IMAGE).sum())
        assert torch.equal(context_images["mm_token_type_ids"], (context_ids == IMAGE).long())
        assert torch.equal(context_images["pixel_values"], images["pixel_values"])
    removable = (ids != IMAGE) & (torch.arange(ids.shape[1]) > 0)
    expected = ids.double() / ids[removable].sum() + prior.double() / prior[removable].abs().sum()
    torch.testing.assert_close(scores[removable], expected[removable].float())
    assert bool((scores[~removable] == 0).all())


def test_whether_a_batch_tells_its_rows_apart_is_decided_once_per_model_dtype_and_image_shapes(monkeypatch):
    from captum_attention.metrics import context

    model, ids, images = family_example("llava")
    checks = []
    second_row_moved = context._AnswerScorer._second_row_moved
    monkeypatch.setattr(context._AnswerScorer, "_second_row_moved", lambda self: checks.append(1) or second_row_moved(self))
    kept = torch.ones(1, 2, ids.shape[1], dtype=torch.bool)
    kept[0, 1, -2] = False
    for prompt in (ids, ids[:, :-1]):  # another prompt, the same image
        ablated_log_probs(model, prompt, torch.ones_like(prompt), ANSWER[:1], kept[..., : prompt.shape[1]], image_inputs=images)
    assert len(checks) == 1
    doubled = {name: value.double() if value.is_floating_point() else value for name, value in images.items()}
    ablated_log_probs(model.double(), ids, torch.ones_like(ids), ANSWER[:1], kept, image_inputs=doubled)
    assert len(checks) == 2, "another dtype: decided again"


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_the_ablated_prompts_take_the_images_encoded_once(family, monkeypatch):
    """The ablations of a prompt about an image take it through the vision tower once
    (transformers' ``mm_encoder_outputs``), not once per ablated prompt and per forward of
    the padding's check, with the values of the tower rerun per prompt; a model whose
    forward fails on its encoded images reruns it."""
    from captum_attention.metrics import context

    model, ids, images = family_example(family)
    kept = torch.rand(1, 6, ids.shape[1], generator=torch.Generator().manual_seed(0)) > 0.5

    def ablations() -> torch.Tensor:
        return ablated_log_probs(model, ids, torch.ones_like(ids), ANSWER[:1], kept, image_inputs=images)

    one_image = tower_rows(model, lambda: answer_log_probs(model, ids, torch.ones_like(ids), ANSWER[:1], images), monkeypatch)
    ablations()  # decides, once per model, that the encoded images score the prompt as the pixels do
    encoded_values = ablations()
    assert tower_rows(model, ablations, monkeypatch) == one_image, "the images encoded once"
    with monkeypatch.context() as patch:
        patch.setattr(context, "takes_encoded_images", lambda model, images: False)
        plain_rows = tower_rows(model, ablations, monkeypatch)
    monkeypatch.setattr(model, "_expand_multimodal_outputs", lambda *args, **kwargs: 1 / 0)
    context._BATCH_VERDICTS.pop(model, None)
    ablations()
    rerun_values = ablations()
    assert tower_rows(model, ablations, monkeypatch) == plain_rows > one_image, "the tower per ablated prompt"
    torch.testing.assert_close(encoded_values, rerun_values, rtol=1e-5, atol=1e-5)


def test_an_encoder_decoders_ablated_sources_are_scored_with_its_image():
    """Florence-2's image features take its image tokens' place in the encoder's source:
    each ablated source is scored with the image inputs, its image's tokens never removed,
    as the model scores that source alone (they were refused: an encoder-decoder's answer
    was scored from its source alone); top-k drop and the contexts follow."""
    from test_encoder_decoder import _tiny_florence2

    from captum_attention.capture.inputs import decoder_start_token

    model = _tiny_florence2()
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        count = model.model.get_image_features(**images).pooler_output.shape[1]
    image_token = model.config.image_token_id
    ids, answer = torch.tensor([[1, *[image_token] * count, 5, 6, 7, 8, 9]]), torch.tensor([[9, 10, 11]])
    decoder = torch.cat([torch.tensor([[decoder_start_token(model)]]), answer[:, :-1]], dim=1)

    def alone(tokens: torch.Tensor) -> float:
        with torch.no_grad():
            logits = model(input_ids=ids[:, tokens], decoder_input_ids=decoder, **images).logits
        return float(logits.float().log_softmax(dim=-1).gather(2, answer[..., None]).sum())

    before = model_state(model)
    kept = torch.rand(1, 6, ids.shape[1], generator=torch.Generator().manual_seed(0)) > 0.5
    kept[0, 0] = True
    values = ablated_log_probs(model, ids, torch.ones_like(ids), answer, kept, image_inputs=images)
    assert_same_state(before, model_state(model))
    image = ids[0] == image_token
    for a in range(kept.shape[1]):
        tokens = kept[0, a] | image
        tokens[0] = True  # BOS, never removed
        assert abs(float(values[0, a]) - alone(tokens)) < 1e-5, a
    assert len({round(float(v), 6) for v in values[0]}) > 2, "the deletions must move the answer"
    scores = torch.arange(ids.shape[1], dtype=torch.float32)[None].flip(1)  # the image's tokens score highest
    drop = top_k_log_prob_drop(model, ids, torch.ones_like(ids), answer, scores, ks=(2,), image_inputs=images)
    without_top_two = torch.ones(ids.shape[1], dtype=torch.bool)
    without_top_two[[1 + count, 2 + count]] = False
    whole = torch.ones(ids.shape[1], dtype=torch.bool)
    assert abs(float(drop[0, 0]) - (alone(whole) - alone(without_top_two))) < 1e-5
    calls = []

    def explain(context_ids, context_mask, context_images):
        calls.append((context_ids, context_images))
        return context_ids.float()

    context_averaged_scores(model, explain, ids, torch.ones_like(ids), answer, scores, num_contexts=2, image_inputs=images)
    assert [int((context_ids == image_token).sum()) for context_ids, _ in calls] == [count, count]
    assert all(torch.equal(context_images["pixel_values"], images["pixel_values"]) for _, context_images in calls)
