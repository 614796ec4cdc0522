"""GIT's answers: its text model reads the image's features as positions of its own before
the prompt's tokens (no token stands for them), its logits cover them too. Every call
returns ``(image feature scores, token scores)``, checked against GIT's own
``output_attentions`` and ``torch.autograd.grad`` over the whole sequence it attends to, and
AttnLRP against its rules written out (``lrp_reference.git_relevance``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_state, model_state
from lrp_reference import git_pixel_relevance, git_relevance
from methods import MAP_METHODS, METHODS, knockout_reference, reference_decisive
from test_alti import _alti_layers, _rollout, example_residual_norms
from test_flow import _expected_flows
from test_llm import span_reference
from torch import nn
from vlm_models import GIT_FEATURES, GIT_IMAGE_SIZE, GIT_PATCH, make_git

from captum_attention import (
    ALTI, ALTILogit, AttentionFlow, AttnLRP, DecompX, GradSAM, HeadWeights, KnockoutGradient, KnockoutLRP, LearnedAttention,
    NormAttention, RawAttention, ValueZeroing, image_scores,
)

from captum_attention.metrics import leave_one_out_agreement, top_k_log_prob_drop

ANSWER = torch.tensor([[5, 7], [8, 9]])
IMAGE_SIZE, PATCH, FEATURES = GIT_IMAGE_SIZE, GIT_PATCH, GIT_FEATURES


def _prompt():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 6), generator=generator)
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return SimpleNamespace(input_ids=ids, args=(torch.ones_like(ids), {"pixel_values": pixels}), pixels=pixels)


def _reference(model, prompt, answer=ANSWER):
    """GIT's own attention over the image's features and the tokens, and its gradient for
    S = Σ_b Σ_k log p(answer[b, k]), the answer read at its positions."""
    sequence = torch.cat([prompt.input_ids, answer], dim=1)
    out = model(input_ids=sequence, attention_mask=torch.ones_like(sequence), pixel_values=prompt.pixels, output_attentions=True)
    total, k = out.logits.shape[1], answer.shape[1]
    assert total == FEATURES + sequence.shape[1], "the logits cover the image's features"
    log_probs = out.logits[:, total - k - 1 : total - 1].log_softmax(dim=-1)
    grads = torch.autograd.grad(log_probs.gather(2, answer[..., None]).sum(), out.attentions)
    return SimpleNamespace(attentions=[a.detach() for a in out.attentions], grads=list(grads)), total


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", MAP_METHODS)
def test_gits_span_equals_the_reference_of_its_attention_over_features_and_tokens(method):
    """GIT was refused ("adds positions of its own to the tokens"); its image's features are
    now scored first, its tokens after them."""
    model, prompt = make_git(), _prompt()
    model(input_ids=prompt.input_ids, pixel_values=prompt.pixels)  # transformers installs its own output recorders on a first forward
    before = model_state(model)
    features, tokens = METHODS[method].cls(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert_same_state(before, model_state(model))
    reference, total = _reference(model, prompt)
    expected = span_reference(method, reference, torch.ones(2, total, dtype=torch.bool), range(total - 3, total - 1))
    assert expected[:, :FEATURES].abs().max() > 0, "the image's features are scored"
    scale = expected.abs().max().item()
    torch.testing.assert_close(features, expected[:, :FEATURES], rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(tokens, expected[:, FEATURES:], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.usefixtures("capture_mode")
def test_gits_rows_sum_to_its_span_and_attribute_reads_the_last_token():
    model, prompt = make_git(), _prompt()
    explainer = RawAttention(model)
    rows = explainer.attribute_continuation(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    span = explainer.attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert [tuple(side.shape) for side in rows] == [(2, 2, FEATURES), (2, 2, 8)]
    for side_rows, side in zip(rows, span):
        torch.testing.assert_close(side_rows.sum(dim=1), side)
    (features, tokens), maps = explainer.attribute(prompt.input_ids, additional_forward_args=prompt.args, return_maps=True)
    reference, total = _reference(model, SimpleNamespace(input_ids=prompt.input_ids[:, :-1], pixels=prompt.pixels), prompt.input_ids[:, -1:])
    expected = reference.attentions[-1].mean(dim=1)[:, -1]
    torch.testing.assert_close(torch.cat([features, tokens], dim=1), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(maps[:, -1].float(), reference.attentions[-1].mean(dim=1), rtol=1e-5, atol=1e-6)  # its whole sequence
    earlier = torch.cat(explainer.attribute(prompt.input_ids, additional_forward_args=prompt.args, query_index=2), dim=1)
    row = reference.attentions[-1].mean(dim=1)[:, FEATURES + 2]  # the prompt's third token's row, in GIT's positions
    torch.testing.assert_close(earlier, row, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("capture_mode")
def test_gits_attn_lrp_equals_the_rules_written_out():
    """AttnLRP's relevance of the image's features is taken at the visual projection's
    outputs, as a cross-attending model's states' is at the states."""
    model, prompt = make_git(), _prompt()
    before = model_state(model)
    features, tokens = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert_same_state(before, model_state(model))
    with torch.no_grad():
        projected = model.git.visual_projection(model.git.image_encoder(prompt.pixels).last_hidden_state)
    expected = git_relevance(model, torch.cat([prompt.input_ids, ANSWER], dim=1), projected, ANSWER)
    assert expected[0].abs().max() > 0
    for scores, wanted in zip((features, tokens), expected):
        torch.testing.assert_close(scores, wanted, rtol=1e-5, atol=1e-5 * wanted.abs().max().item())


def test_gits_features_land_on_the_image_grid_each_frame_its_own():
    """The image's class token then its patches, row by row; a video's frames one after
    another (``num_image_with_embedding``), each its own grid."""
    model, prompt = make_git(), _prompt()
    features, tokens = RawAttention(model).attribute(prompt.input_ids, additional_forward_args=prompt.args)
    grids = image_scores(model, prompt.input_ids, (features, tokens), {"pixel_values": prompt.pixels})
    side = IMAGE_SIZE // PATCH
    for example in range(2):
        assert len(grids[example]) == 1
        torch.testing.assert_close(grids[example][0], features[example, 1:].view(side, side))
    frames = make_git(frames=2)
    pixels = torch.randn(2, 2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2))
    features, _ = RawAttention(frames).attribute(prompt.input_ids, additional_forward_args=(prompt.args[0], {"pixel_values": pixels}))
    assert features.shape == (2, 2 * FEATURES)
    grids = image_scores(frames, prompt.input_ids, features, {"pixel_values": pixels})
    for frame, grid in enumerate(grids[1]):
        torch.testing.assert_close(grid, features[1, frame * FEATURES + 1 : (frame + 1) * FEATURES].view(side, side))


@pytest.mark.usefixtures("capture_mode")
def test_gits_knockout_estimates_equal_their_reference():
    model, prompt = make_git(), _prompt()
    reference, total = _reference(model, prompt)
    first_order = knockout_reference(reference.attentions, reference.grads, torch.ones(2, total, dtype=torch.bool), total - 2)
    scores = torch.cat(KnockoutGradient(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args), dim=1)
    torch.testing.assert_close(scores, first_order, rtol=1e-4, atol=1e-5 * first_order.abs().max().item())
    with torch.no_grad():
        projected = model.git.visual_projection(model.git.image_encoder(prompt.pixels).last_hidden_state)
    relevance = torch.cat(git_relevance(model, torch.cat([prompt.input_ids, ANSWER], dim=1), projected, ANSWER), dim=1)
    estimates = torch.cat(KnockoutLRP(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args), dim=1)
    expected = reference_decisive(first_order, relevance)
    torch.testing.assert_close(estimates, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())


class _WithImage(nn.Module):
    """GIT called with one image, as the context-mixing references call a model:
    ``model(ids, output_attentions=True, ...)``."""

    def __init__(self, model: nn.Module, pixels: torch.Tensor) -> None:
        super().__init__()
        self.model, self.git, self.config, self.pixels = model, model.git, model.config, pixels

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def forward(self, ids, **kwargs):
        return self.model(input_ids=ids, pixel_values=self.pixels, **kwargs)


@pytest.mark.usefixtures("capture_mode")
def test_gits_context_mixing_equals_the_authors_computations():
    """ALTI and the norms with the residual (Kobayashi et al., 2021) over the image's
    features and the tokens, as test_alti's references compute them for BERT's layers;
    the plain norms at the last layer; the learned head weights over every head's row."""
    model, prompt = make_git(), _prompt()
    ids, args = prompt.input_ids[:1], (prompt.args[0][:1], {"pixel_values": prompt.pixels[:1]})
    wrapped, row = _WithImage(model, prompt.pixels[:1]), FEATURES + ids.shape[1] - 1
    layers, out, _ = _alti_layers(wrapped, "git", ids)
    expected = _rollout(layers)[-1][row].float()
    torch.testing.assert_close(torch.cat(ALTI(model).attribute(ids, additional_forward_args=args), dim=1)[0], expected,
                               rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for layer in (0, -1):
        norms = example_residual_norms(wrapped, "git", ids, row, layer)
        scores = torch.cat(NormAttention(model).attribute(ids, additional_forward_args=args, layer=layer, residual=True), dim=1)[0]
        torch.testing.assert_close(scores, norms, rtol=1e-5, atol=1e-5 * norms.abs().max().item())
    theta = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    learned = torch.cat(LearnedAttention(model, weights=HeadWeights(theta)).attribute(ids, additional_forward_args=args), dim=1)[0]
    rows = torch.stack([attn[0, :, row] for attn in out.attentions]).double()  # (layers, heads, positions)
    expected = (theta.double()[..., None] * rows).sum(dim=(0, 1)).float()
    torch.testing.assert_close(learned, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_gits_decompx_shares_add_up_to_the_logit_and_its_flow_is_the_max_flow():
    model, prompt = make_git(), _prompt()
    target = torch.tensor([7, 11])
    shares = torch.cat(DecompX(model).attribute(prompt.input_ids, target=target, additional_forward_args=prompt.args), dim=1)
    with torch.no_grad():
        logits = model(input_ids=prompt.input_ids, pixel_values=prompt.pixels, output_attentions=True)
    torch.testing.assert_close(shares.sum(dim=1), logits.logits[:, -1].gather(1, target[:, None])[:, 0], rtol=1e-4, atol=1e-4)
    assert shares[:, :FEATURES].abs().max() > 0
    flows = torch.cat(AttentionFlow(model).attribute(prompt.input_ids, additional_forward_args=prompt.args), dim=1)
    total = FEATURES + prompt.input_ids.shape[1]
    for example in range(2):
        expected = _expected_flows(logits.attentions, example, torch.ones(total, dtype=torch.bool), total - 1)
        torch.testing.assert_close(flows[example].double(), expected, atol=1e-6, rtol=0)


def test_what_gits_layers_cannot_give_is_refused_in_one_line():
    model, prompt = make_git(), _prompt()
    assert_refused_in_one_line(model, lambda: ValueZeroing(model).attribute(prompt.input_ids, additional_forward_args=prompt.args),
                               "Value Zeroing zeroes values inside transformers' sdpa attention")
    assert_refused_in_one_line(model, lambda: ALTILogit(model).attribute(prompt.input_ids, additional_forward_args=prompt.args),
                               "post-norm layers of GitForCausalLM rescale: use ALTI")


@pytest.mark.parametrize("method", [RawAttention, GradSAM, AttnLRP])
def test_a_left_padded_batch_explains_each_example_as_alone(method):
    model, prompt = make_git(), _prompt()
    ids, mask = prompt.input_ids.clone(), torch.ones_like(prompt.input_ids)
    ids[0, :2], mask[0, :2] = 0, 0
    batch = method(model).attribute_span(ids, ANSWER, additional_forward_args=(mask, {"pixel_values": prompt.pixels}))
    for example, start in ((0, 2), (1, 0)):
        alone = method(model).attribute_span(ids[example : example + 1, start:], ANSWER[example : example + 1],
                                             additional_forward_args=(mask[example : example + 1, start:],
                                                                      {"pixel_values": prompt.pixels[example : example + 1]}))
        torch.testing.assert_close(batch[0][example], alone[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batch[1][example, start:], alone[1][0], rtol=1e-5, atol=1e-6)
        assert not batch[1][example, :start].any()


@pytest.mark.usefixtures("capture_mode")
def test_gits_attn_lrp_through_the_image_encoder_equals_the_rules_written_out():
    """``through_vision_tower=True``: the features pass their relevance on to the pixels
    (``(token scores, pixel relevance)``, as a vision-language model's tokens do), through
    GIT's image encoder and visual projection, against a grey reference image."""
    model, prompt = make_git(), _prompt()
    options = {"additional_forward_args": prompt.args, "through_vision_tower": True, "pixel_baselines": 0.5}
    tokens, pixels = AttnLRP(model).attribute_span(prompt.input_ids, ANSWER, **options)
    expected = git_pixel_relevance(model, torch.cat([prompt.input_ids, ANSWER], dim=1), prompt.pixels, ANSWER, 0.5)
    assert expected[1].abs().max() > 0
    for scores, wanted in zip((tokens, pixels), expected):
        torch.testing.assert_close(scores, wanted, rtol=1e-5, atol=1e-5 * wanted.abs().max().item())
    rows = AttnLRP(model).attribute_continuation(prompt.input_ids, ANSWER, log_prob=True, **options)
    assert rows[0].shape == (2, 2, 8) and rows[1].shape == (2, 2, 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(rows[1].sum(dim=1), pixels, rtol=1e-4, atol=1e-6)


def _log_prob(model, ids: torch.Tensor, answer: torch.Tensor, pixels: torch.Tensor) -> float:
    sequence = torch.cat([ids, answer], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequence, pixel_values=pixels).logits
    return logits[:, -answer.shape[1] - 1 : -1].log_softmax(dim=-1).gather(2, answer[..., None]).sum().item()


def test_the_context_metrics_remove_gits_words_and_never_its_image():
    """No token of GIT's prompt stands for its image (the metrics refused: "config names no
    image token"): every word is a segment, and the model runs each ablated prompt with
    the image, as by hand."""
    model, prompt = make_git(), _prompt()
    ids, answer, pixels = prompt.input_ids[:1], ANSWER[:1], prompt.pixels[:1]
    images, mask = {"pixel_values": pixels}, torch.ones_like(ids)
    _, tokens = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask, images))
    scores = tokens[:, : ids.shape[1]]
    drop = top_k_log_prob_drop(model, ids, mask, answer, scores, (1, 2), image_inputs=images)
    whole = _log_prob(model, ids, answer, pixels)
    order = (1 + scores[0, 1:].argsort(descending=True)).tolist()  # the first token (the BOS) is never removed
    for column, k in enumerate((1, 2)):
        kept = sorted(set(range(ids.shape[1])) - set(order[:k]))
        assert drop[0, column].item() == pytest.approx(whole - _log_prob(model, ids[:, kept], answer, pixels), abs=1e-5)
    removed_alone = torch.tensor([whole - _log_prob(model, ids[:, [j for j in range(ids.shape[1]) if j != i]], answer, pixels)
                                  for i in range(1, ids.shape[1])])
    agreement = leave_one_out_agreement(model, ids, mask, answer, scores, image_inputs=images)
    ranks = lambda values: values.argsort().argsort().double()  # noqa: E731
    expected = torch.corrcoef(torch.stack([ranks(scores[0, 1:]), ranks(removed_alone)]))[0, 1]
    assert agreement[0].item() == pytest.approx(expected.item(), abs=1e-5)


def test_captums_image_mask_input_scores_each_segment_by_gits_features():
    """Each quadrant of the 32 × 32 image is one of GIT's 2 × 2 patches: its score is that
    feature's, in seq_attr and in every token row."""
    import numpy as np
    from captum.attr import ImageMaskInput
    from PIL import Image

    from captum_attention import LLMAttentionAttribution
    from lm_models import make_word_tokenizer

    model = make_git()
    picture = Image.fromarray((np.random.default_rng(0).random((IMAGE_SIZE, IMAGE_SIZE, 3)) * 255).astype("uint8"))

    def processor_fn(image):
        pixels = torch.tensor(np.asarray(image), dtype=torch.float).permute(2, 0, 1)[None] / 255
        ids = torch.tensor([[1, 5, 9]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}

    quadrants = torch.zeros(IMAGE_SIZE, IMAGE_SIZE, dtype=torch.int32)
    half = IMAGE_SIZE // 2
    quadrants[:half, half:], quadrants[half:, :half], quadrants[half:, half:] = 1, 2, 3
    inp = ImageMaskInput(image=picture, processor_fn=processor_fn, mask=quadrants)
    answer = torch.tensor([10, 11])
    result = LLMAttentionAttribution(AttnLRP(model), make_word_tokenizer()).attribute(inp, target=answer)
    model_input = inp.to_model_input()
    args = (model_input["attention_mask"], {"pixel_values": model_input["pixel_values"]})
    features, _ = AttnLRP(model).attribute_span(model_input["input_ids"], answer[None], additional_forward_args=args)
    assert features.abs().max() > 0
    torch.testing.assert_close(result.seq_attr, features[0, 1:])
    rows, _ = AttnLRP(model).attribute_continuation(model_input["input_ids"], answer[None], additional_forward_args=args, log_prob=True)
    torch.testing.assert_close(result.token_attr, rows[0, :, 1:])


def test_gits_per_token_arguments_count_its_tokens_its_features_untouched(monkeypatch):
    """``presence`` weighs GIT's tokens, its features fully present; the attention shares
    are each word's largest share of another row's attention; erasing a token's key equals
    GIT run with that token masked; a decision flip never erases the features and counts
    its fraction over the tokens (each asked for one value per position GIT attends over,
    or failed)."""
    from captum_attention.metrics import attention_erasure, attention_shares, decision_flip_fraction

    model, prompt = make_git(), _prompt()
    ids, pixels = prompt.input_ids[:1], prompt.pixels[:1]
    mask, images, answer = torch.ones_like(ids), {"pixel_values": pixels}, ANSWER[:1]
    presence = torch.full((1, ids.shape[1] + answer.shape[1]), 0.3)
    weighed = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask, images), presence=presence)
    everywhere = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask, images),
                                               presence=torch.cat([torch.ones(1, FEATURES), presence], dim=1))
    plain = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask, images))
    for side, same, other in zip(weighed, everywhere, plain):
        torch.testing.assert_close(side, same)
        assert not torch.allclose(side, other)
    shares = attention_shares(model, ids, mask, answer, image_inputs=images)
    reference, total = _reference(model, SimpleNamespace(input_ids=ids, pixels=pixels), answer)
    tokens = FEATURES + torch.arange(1, ids.shape[1])  # the first token (the BOS) is never removed
    rows = torch.stack([attn[0] for attn in reference.attentions])  # (layers, heads, queries, keys)
    others = ~torch.eye(total, dtype=torch.bool)
    expected = torch.stack([rows[..., j].masked_fill(~others[:, j], 0).amax() for j in tokens.tolist()])
    torch.testing.assert_close(shares[0, 1:], expected, rtol=1e-5, atol=1e-6)
    erased = torch.zeros_like(ids, dtype=torch.bool)
    erased[0, 3] = True
    result = attention_erasure(model, ids, erased, (mask, images))
    masked = mask.masked_fill(erased, 0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=masked, pixel_values=pixels).logits[:, -1].softmax(-1)
    torch.testing.assert_close(result.erased, expected, rtol=1e-5, atol=1e-7)
    from captum_attention.metrics import erasure

    erasures = []
    original = erasure._KeyErasure.__init__
    monkeypatch.setattr(erasure._KeyErasure, "__init__", lambda self, erased, *rest: (erasures.append(erased), original(self, erased, *rest))[1])
    ranking = torch.arange(ids.shape[1], 0, -1)[None].float()
    flip = decision_flip_fraction(model, ids, ranking, (mask, images), model=model)
    assert erasures and all(e.shape[1] == FEATURES + ids.shape[1] and not e[:, :FEATURES].any() for e in erasures)
    assert max(int(e.sum(dim=1).max()) for e in erasures) == ids.shape[1], "every token, the features left"
    if bool(flip.flipped[0]):
        assert flip.fraction[0].item() == pytest.approx(flip.removed[0].item() / ids.shape[1])
    else:
        assert int(flip.removed[0]) == -1 and bool(flip.fraction[0].isnan())
