"""An image encoder before a text decoder (``VisionEncoderDecoderModel``: a ViT before a
GPT-2, a BERT or a TrOCR decoder that cross-attends to it): its answer is explained over
the image's patches, on their grid, and the decoder's tokens, against references read
from its own ``output_attentions`` and AttnLRP's rules written out."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_state, model_state
from grid_reference import window_encoder_decoder_maps
from lrp_reference import donut_relevance, vit_gpt2_relevance, vit_trocr_relevance
from seq2seq_reference import SEQ2SEQ_REFERENCES, Seq2SeqReference
from vlm_models import DECODERS, DONUT, make_captioner

from captum_attention import METHODS, AttnLRP

PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
ANSWER = torch.tensor([[8, 9, 10], [11, 12, 13]])


def _decoder_ids(answer: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ones_like(answer[:, :1]), answer[:, :-1]], dim=1)


def span_reference(model, pixels: torch.Tensor, answer: torch.Tensor) -> Seq2SeqReference:
    """The eager twin's maps and their gradients for the answer's summed log-probability."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    out = eager(pixel_values=pixels, decoder_input_ids=_decoder_ids(answer), output_attentions=True)
    objective = out.logits.log_softmax(dim=-1).gather(2, answer[..., None]).sum()
    groups = [out.encoder_attentions, out.decoder_attentions, out.cross_attentions]
    grads = iter(torch.autograd.grad(objective, [a for group in groups for a in group]))
    pairs = [[(a.detach(), next(grads)) for a in group] for group in groups]
    return Seq2SeqReference(*pairs, [17] * len(pixels), [answer.shape[1]] * len(pixels))


def donut_span_reference(model, pixels: torch.Tensor, answer: torch.Tensor) -> Seq2SeqReference:
    """Donut's maps and their gradients for the answer's summed log-probability, the
    windows' and the cross-attention's keys placed on the 8 × 8 first-stage patches by
    another road (``grid_reference``)."""
    def objective(logits: torch.Tensor) -> torch.Tensor:
        return logits.log_softmax(dim=-1).gather(2, answer[..., None]).sum()

    pairs = window_encoder_decoder_maps(model, {"pixel_values": pixels, "decoder_input_ids": _decoder_ids(answer)}, objective)
    return Seq2SeqReference(*pairs, [64] * len(pixels), [answer.shape[1]] * len(pixels))


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder", [*DECODERS, DONUT])
@pytest.mark.parametrize("method", [m for m, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_a_captions_span_equals_the_reference_with_the_patches_on_their_grid(decoder, method):
    """A ViT's 4 × 4 patches after its class token; Donut's 8 × 8 first-stage patches, its
    windows and the decoder's keys (the last stage's 4 × 4 tokens) placed there (its Swin
    declares no attention, its MBart does: it was refused, the capture taking every site
    for the encoder's)."""
    model, donut = make_captioner(decoder), decoder == DONUT
    before = model_state(model)
    patches, tokens = METHODS[method](model).attribute_span(PIXELS, ANSWER)
    assert_same_state(before, model_state(model))
    grid, first_patch = ((8, 8), 0) if donut else ((4, 4), 1)
    assert patches.shape == (2, *grid) and tokens.shape == ANSWER.shape
    ref = (donut_span_reference if donut else span_reference)(model, PIXELS, ANSWER)
    for b in range(2):
        expected_states, expected_tokens = (x.float() for x in SEQ2SEQ_REFERENCES[method](ref, b, span=True))
        if method != "grad_sam":
            assert expected_states.abs().max() > 0
        scale = max(expected_states.abs().max().item(), expected_tokens.abs().max().item())
        torch.testing.assert_close(patches[b], expected_states[first_patch:].view(grid), rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(tokens[b], expected_tokens, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder", ["gpt2", "trocr", DONUT])
@pytest.mark.parametrize("method", list(METHODS))
def test_each_row_is_attribute_at_its_prefix(decoder, method):
    model, cls = make_captioner(decoder), METHODS[method]
    patch_rows, token_rows = cls(model).attribute_continuation(PIXELS, ANSWER)
    grid = (8, 8) if decoder == DONUT else (4, 4)
    assert patch_rows.shape == (2, 3, *grid) and token_rows.shape == (2, 3, 3)
    decoder = _decoder_ids(ANSWER)
    for k in range(ANSWER.shape[1]):
        prefix = decoder[:, : k + 1]
        target = {"target": ANSWER[:, k]} if cls.spec.uses_target else {}
        patches, tokens = cls(model).attribute((PIXELS, prefix), additional_forward_args=(torch.ones_like(prefix),), **target)
        scale = max(patches.abs().max().item(), tokens.abs().max().item())
        torch.testing.assert_close(patch_rows[:, k], patches, rtol=1e-5, atol=1e-5 * scale)
        torch.testing.assert_close(token_rows[:, k, : k + 1], tokens, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("decoder, reference", [("gpt2", vit_gpt2_relevance), ("trocr", vit_trocr_relevance), (DONUT, donut_relevance)])
def test_attn_lrp_equals_the_rules_written_out_at_the_patch_embeddings(decoder, reference):
    model = make_captioner(decoder)
    patches, tokens = AttnLRP(model).attribute_span(PIXELS, ANSWER)
    expected_patches, expected_tokens = reference(model, PIXELS, _decoder_ids(ANSWER), ANSWER)
    assert expected_patches.abs().max() > 0
    scale = max(expected_patches.abs().max().item(), expected_tokens.abs().max().item())
    torch.testing.assert_close(patches.flatten(1), expected_patches, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(tokens, expected_tokens, rtol=1e-5, atol=1e-5 * scale)


def test_a_generated_caption_is_explained_after_the_decoders_start_token():
    """``generate`` returns the start token, then the caption: the caption is the answer."""
    model = make_captioner("gpt2")
    generated = model.generate(pixel_values=PIXELS, max_new_tokens=3, do_sample=False)
    assert (generated[:, 0] == 1).all()
    patches, tokens = METHODS["rollout"](model).attribute_span(PIXELS, generated[:, 1:])
    assert patches.shape == (2, 4, 4) and tokens.shape == (2, generated.shape[1] - 1)
    assert torch.isfinite(patches).all() and (patches > 0).all(), "rollout reaches every patch"


def test_what_it_cannot_take_is_refused_in_one_line():
    """A source mask (every patch is real); images as the target; a streaming capture of a
    decoder that writes its attention out by hand (TrOCR's: no attention function to
    stream through)."""
    model = make_captioner("gpt2")
    with pytest.raises(ValueError, match="takes no source mask") as refused:
        METHODS["grad_sam"](model).attribute_span(PIXELS, ANSWER, additional_forward_args=(torch.ones(2, 17),))
    assert "\n" not in str(refused.value)
    with pytest.raises(TypeError, match="an encoder-decoder's target is no image"):
        METHODS["grad_sam"](model).attribute((PIXELS, PIXELS))
    trocr = make_captioner("trocr")
    before = model_state(trocr)
    with pytest.raises(ValueError, match="capture='streaming' is not possible here: TrOCRAttention did not call") as refused:
        METHODS["grad_sam"](trocr, capture="streaming").attribute_span(PIXELS, ANSWER)
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(trocr))


def test_donut_streams_nothing_its_windows_need_their_probabilities():
    model = make_captioner(DONUT)
    before = model_state(model)
    with pytest.raises(ValueError, match="capture='streaming' is not possible here: its attention runs per shifted window") as refused:
        METHODS["rollout"](model, capture="streaming").attribute_span(PIXELS, ANSWER)
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(model))

