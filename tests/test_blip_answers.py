"""A BLIP captioner's answers: its text decoder cross-attends to the vision tower's states
in every layer (the same module class for both attentions), explained as Mllama's are,
``(image-state scores, text scores)``, against references read from its own
``output_attentions`` and AttnLRP's rules written out, each example alone."""

from __future__ import annotations

import pytest
import torch
from lrp_reference import blip_relevance
from methods import MAP_METHODS, METHODS
from seq2seq_reference import cross_attending_reference
from vlm_models import ANSWER, blip_span_reference, check_cross_attending_span, make_blip, make_blip_prompt

from captum_attention import AttnLRP, GradSAM, image_scores


def _alone(prompt, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``b``'s real prompt tokens ``(1, t)`` and its image ``(1, 3, 32, 32)``."""
    return prompt.input_ids[b : b + 1, prompt.attention_mask[b].bool()], prompt.images["pixel_values"][b : b + 1]


def _expected(method: str, model, prompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, the cross-attending reference of the example alone: its 17 states,
    and its tokens placed right-aligned in the padded prompt and answer."""
    length = prompt.input_ids.shape[1] + ANSWER.shape[1]
    source, target = torch.zeros(len(ANSWER), 17), torch.zeros(len(ANSWER), length)
    for b in range(len(ANSWER)):
        ids, pixels = _alone(prompt, b)
        layers = blip_span_reference(model, ids, pixels, ANSWER[b : b + 1])
        t = ids.shape[1] + ANSWER.shape[1] - 1  # the queries: up to the last answer token's reader
        layers = [(role, a[:, :t, : t if role == "decoder" else None], g[:, :t, : t if role == "decoder" else None]) for role, a, g in layers]
        states, tokens = cross_attending_reference(method, layers, [t - 2, t - 1])
        source[b], target[b, length - t - 1 : length - 1] = states.float(), tokens.float()
    return source, target


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", MAP_METHODS)
def test_blips_span_equals_the_reference_of_its_self_and_cross_attention(method):
    """Two examples, one padded on the left: each equals its reference alone; the image's
    class token and patches are scored (Grad-SAM's follow queries: none)."""
    model, prompt = make_blip(), make_blip_prompt()
    check_cross_attending_span(method, model, prompt, _expected(method, model, prompt))


@pytest.mark.usefixtures("capture_mode")
def test_blips_attn_lrp_equals_the_rules_written_out():
    model, prompt = make_blip(), make_blip_prompt()
    source, target = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    for b in range(len(ANSWER)):
        ids, pixels = _alone(prompt, b)
        with torch.no_grad():
            states = model.vision_model(pixel_values=pixels).last_hidden_state
        tokens, features = blip_relevance(model, torch.cat([ids, ANSWER[b : b + 1]], dim=1), states, ANSWER[b : b + 1])
        assert features.abs().max() > 0
        expected = tokens[0].masked_fill(torch.arange(tokens.shape[1]) == tokens.shape[1] - 1, 0.0)
        scale = max(features.abs().max().item(), expected.abs().max().item())
        torch.testing.assert_close(target[b, target.shape[1] - len(expected) :], expected, rtol=1e-5, atol=1e-5 * scale)
        assert (target[b, : target.shape[1] - len(expected)] == 0).all(), "the padding scores 0"
        torch.testing.assert_close(source[b], features[0], rtol=1e-5, atol=1e-5 * scale)


def test_blips_image_states_land_on_its_patch_grid():
    """The class token outside the grid, the 4 × 4 patches row by row; the tokens' rows
    (``attribute_continuation``) placed the same way."""
    model, prompt = make_blip(), make_blip_prompt()
    explainer = METHODS["transformer_attribution"].cls(model)
    states, text = explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    grids = image_scores(model, prompt.input_ids, (states, text), prompt.images)
    assert [len(images) for images in grids] == [1, 1]
    for b, (grid,) in enumerate(grids):
        torch.testing.assert_close(grid, states[b, 1:].view(4, 4))
    rows = explainer.attribute_continuation(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    (row_grid,) = image_scores(model, prompt.input_ids, rows, prompt.images)[0]
    torch.testing.assert_close(row_grid, rows[0][0, :, 1:].view(-1, 4, 4))


def test_blip_needs_its_pixels():
    model, prompt = make_blip(), make_blip_prompt()
    with pytest.raises(ValueError, match="pass the processor's pixel_values"):
        image_scores(model, prompt.input_ids, (torch.zeros(2, 17), torch.zeros(2, 6)), {})
    scores = GradSAM(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert scores[0].shape == (2, 17)


@pytest.mark.parametrize("change", ["sep", "cls"])
def test_blip_refuses_the_processors_prompt_which_generate_never_reads(change):
    """The processor's ``[CLS] ... [SEP]`` (here 3 and 2): BLIP's ``generate`` reads
    ``[BOS] ...`` instead, so an answer explained after the processor's prompt would be
    explained after a prompt that never produced it."""
    model, prompt = make_blip(), make_blip_prompt()
    ids = prompt.input_ids[:1, :]
    ids = torch.cat([ids, torch.tensor([[2]])], dim=1) if change == "sep" else ids.masked_fill(ids == 1, 3)
    with pytest.raises(ValueError, match=r"BLIP's generate reads a prompt that starts with bos_token_id \(1\)") as refused:
        GradSAM(model).attribute_span(ids, ANSWER[:1], additional_forward_args=(torch.ones_like(ids), {"pixel_values": prompt.images["pixel_values"][:1]}))
    assert "\n" not in str(refused.value)


def test_blips_ablated_prompts_are_scored_as_each_alone_with_its_image():
    """A prompt of 3 tokens, as many as the image's channels: the pixels are the image's,
    never cut as a per-token input would be (they were, and the tower failed)."""
    from captum_attention.metrics import ablated_log_probs

    model, prompt = make_blip(), make_blip_prompt()
    ids, pixels = _alone(prompt, 1)
    assert ids.shape[1] == pixels.shape[1] == 3
    kept = torch.tensor([[[True, True, True], [True, False, True], [True, True, False]]])
    values = ablated_log_probs(model, ids, torch.ones_like(ids), ANSWER[1:], kept, image_inputs={"pixel_values": pixels})
    for a, tokens in enumerate(kept[0]):
        sequence = torch.cat([ids[:, tokens], ANSWER[1:]], dim=1)
        with torch.no_grad():
            logits = model(input_ids=sequence, pixel_values=pixels).logits
        expected = logits[:, -3:-1].log_softmax(dim=-1).gather(2, ANSWER[1:, :, None]).sum()
        assert abs(float(values[0, a]) - float(expected)) < 1e-5, a


def test_blips_question_answerer_is_refused_in_one_line_held_or_alone():
    """BLIP's question answerer reads the image through a question encoder that the answer
    decoder cross-attends to (a chain of stacks) and its forward returns no answer logits:
    every call is refused by name, the model alone or called through a forward of its parts
    (which returned scores that nothing checks)."""
    from transformers import BlipConfig, BlipForQuestionAnswering

    from captum_attention import RawAttention
    from captum_attention.capture import UnsupportedModelError

    config = make_blip().config
    model = BlipForQuestionAnswering(BlipConfig(text_config=config.text_config.to_dict(), vision_config=config.vision_config.to_dict())).eval()
    prompt = make_blip_prompt()
    ids, pixels = _alone(prompt, 0)
    mask = torch.ones_like(ids)

    def answer_logits(input_ids, attention_mask, pixel_values, decoder_input_ids):
        states = model.vision_model(pixel_values=pixel_values).last_hidden_state
        question = model.text_encoder(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=states)[0]
        return model.text_decoder(input_ids=decoder_input_ids, encoder_hidden_states=question, encoder_attention_mask=attention_mask).logits

    calls = [
        lambda: AttnLRP(model).attribute_span(ids, ANSWER[:1], additional_forward_args=(mask, {"pixel_values": pixels})),
        lambda: RawAttention(model).attribute(ids, target=8, additional_forward_args=(mask, {"pixel_values": pixels})),
        lambda: RawAttention(answer_logits, model=model).attribute(ids, target=8, additional_forward_args=(mask, pixels, ANSWER[:1])),
    ]
    for call in calls:
        with pytest.raises(UnsupportedModelError) as refused:
            call()
        assert "BlipForQuestionAnswering cannot be explained" in str(refused.value) and "\n" not in str(refused.value)


def test_blips_image_text_matcher_is_refused_in_one_line():
    """BLIP's retrieval model scores a text read by an encoder that cross-attends to the
    image: it was refused as an encoder-decoder without decoder attention (local or global
    windows, the message said)."""
    from transformers import BlipConfig, BlipForImageTextRetrieval

    from captum_attention import GradSAM
    from captum_attention.capture import UnsupportedModelError

    config = make_blip().config
    model = BlipForImageTextRetrieval(BlipConfig(text_config=config.text_config.to_dict(), vision_config=config.vision_config.to_dict())).eval()
    ids, pixels = _alone(make_blip_prompt(), 0)

    def matching(input_ids, attention_mask):
        return model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels).itm_score

    with pytest.raises(UnsupportedModelError, match=r"^BlipForImageTextRetrieval cannot be explained: its text encoder cross-attends"):
        GradSAM(matching, model=model).attribute(ids, target=1, additional_forward_args=(torch.ones_like(ids),))
