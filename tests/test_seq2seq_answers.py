"""An encoder-decoder's answer (T5, BART): ``attribute_span`` over the source and the
target prefix against the references of ``seq2seq_reference.py`` with the gradients of the
answer's summed log-probability (autograd on an eager twin); ``attribute_continuation``'s
rows against ``attribute`` at each prefix (itself checked against those references in
``test_encoder_decoder.py``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_same_state, assert_scores_close, model_state
from lm_models import ENCODER_DECODERS, make_encoder_decoder
from seq2seq_reference import SEQ2SEQ_REFERENCES, Seq2SeqReference

from captum_attention import METHODS as REGISTERED

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

SOURCE_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def _case(name: str):
    model = make_encoder_decoder(name)
    generator = torch.Generator().manual_seed(4)
    source = torch.randint(3, 64, SOURCE_MASK.shape, generator=generator)
    answer = torch.randint(3, 64, (2, 4), generator=generator)
    return model, source, answer


def _decoder_ids(model, answer: torch.Tensor) -> torch.Tensor:
    start = torch.full_like(answer[:, :1], model.generation_config.decoder_start_token_id)
    return torch.cat([start, answer[:, :-1]], dim=1)


def span_reference(
    model, source: torch.Tensor, answer: torch.Tensor, source_mask: torch.Tensor = SOURCE_MASK,
    images: dict[str, torch.Tensor] | None = None, forced: int = 0,
) -> Seq2SeqReference:
    """Maps and their gradients for the answer's summed log-probability, every decoder
    position predicting the next answer token but the first ``forced``, which generate
    forces; ``images``: a vision-language model's."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    decoder = _decoder_ids(model, answer)
    out = eager(input_ids=source, attention_mask=source_mask, decoder_input_ids=decoder,
                decoder_attention_mask=torch.ones_like(decoder), output_attentions=True, **(images or {}))
    objective = out.logits.float().log_softmax(dim=-1).gather(2, answer[..., None])[:, forced:].sum()
    groups = [out.encoder_attentions, out.decoder_attentions, out.cross_attentions]
    grads = iter(torch.autograd.grad(objective, [a for group in groups for a in group]))
    pairs = [[(a.detach(), next(grads)) for a in group] for group in groups]
    return Seq2SeqReference(*pairs, source_mask.sum(1).tolist(), [answer.shape[1]] * len(answer))


@pytest.fixture(params=ENCODER_DECODERS)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("method", [m for m, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_a_span_equals_the_reference_of_the_summed_log_probability(name, method, capture_mode):
    model, source, answer = _case(name)
    before = model_state(model)
    source_scores, target_scores = REGISTERED[method](model).attribute_span(source, answer, additional_forward_args=(SOURCE_MASK,))
    assert_same_state(before, model_state(model))
    assert source_scores.shape == source.shape and target_scores.shape == answer.shape
    ref = span_reference(model, source, answer)
    rel = 5e-5 if capture_mode == "streaming" and name == "t5" else 1e-5  # as test_encoder_decoder.py says why
    for b in range(2):
        expected_source, expected_target = SEQ2SEQ_REFERENCES[method](ref, b, span=True)
        s = len(expected_source)
        assert expected_source.abs().max() > 0
        assert_scores_close(source_scores[b, :s], expected_source, rel)
        assert_scores_close(target_scores[b], expected_target, rel)
        assert (source_scores[b, s:] == 0).all()


@pytest.mark.parametrize("method", list(REGISTERED))
def test_each_row_is_attribute_at_its_prefix(name, method, capture_mode):
    model, source, answer = _case(name)
    cls = REGISTERED[method]
    source_rows, target_rows = cls(model).attribute_continuation(source, answer, additional_forward_args=(SOURCE_MASK,))
    assert source_rows.shape == (2, 4, 6) and target_rows.shape == (2, 4, 4)
    decoder = _decoder_ids(model, answer)
    rel = 5e-5 if capture_mode == "streaming" and name == "t5" else 1e-5  # the prefix's sdpa run is another's
    for k in range(answer.shape[1]):
        prefix = decoder[:, : k + 1]
        target = {"target": answer[:, k]} if cls.spec.uses_target else {}
        expected_source, expected_target = cls(model).attribute(
            (source, prefix), additional_forward_args=(SOURCE_MASK, torch.ones_like(prefix)), **target
        )
        scale = max(expected_source.abs().max().item(), expected_target.abs().max().item())
        torch.testing.assert_close(source_rows[:, k], expected_source, rtol=rel, atol=rel * scale)
        torch.testing.assert_close(target_rows[:, k, : k + 1], expected_target, rtol=rel, atol=rel * scale)
        assert (target_rows[:, k, k + 1 :] == 0).all()


@pytest.mark.parametrize("method", ["rollout", "raw", "attn_lrp"])
def test_the_span_of_a_method_linear_in_its_rows_sums_the_log_probability_rows(name, method):
    model, source, answer = _case(name)
    explainer = REGISTERED[method](model)
    span = explainer.attribute_span(source, answer, additional_forward_args=(SOURCE_MASK,))
    rows = explainer.attribute_continuation(source, answer, additional_forward_args=(SOURCE_MASK,), log_prob=True)
    for side, side_rows in zip(span, rows):
        scale = side.abs().max().item()
        torch.testing.assert_close(side, side_rows.sum(dim=1), rtol=1e-5, atol=1e-5 * scale)


def test_wrong_arguments_get_one_clear_line(name):
    model, source, answer = _case(name)
    explainer = REGISTERED["grad_sam"](model)
    with pytest.raises(ValueError, match="the source's attention mask only"):
        explainer.attribute_span(source, answer, additional_forward_args=(SOURCE_MASK, SOURCE_MASK))
    with pytest.raises(ValueError, match="continuation must be token ids"):
        explainer.attribute_span(source, answer.float())
    no_start = copy.deepcopy(model)
    no_start.config.decoder_start_token_id = no_start.generation_config.decoder_start_token_id = None
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        REGISTERED["grad_sam"](no_start).attribute_span(source, answer, additional_forward_args=(SOURCE_MASK,))


@pytest.mark.parametrize("method", ["grad_sam", "attn_lrp"])
def test_captums_llm_interface_explains_an_encoder_decoders_generation(method):
    """``LLMAttentionAttribution`` on BART: the answer is what the decoder generates after
    its start token, to the last token the model chose (BART's forced end token, put in its
    place at the length limit, is not); ``seq_attr`` and ``token_attr`` are the source sides
    of the span and of the log-probability rows."""
    from captum.attr import TextTokenInput
    from lm_models import make_word_tokenizer

    from captum_attention import LLMAttentionAttribution

    model, tokenizer = make_encoder_decoder("bart"), make_word_tokenizer()
    before = model_state(model)
    explainer = REGISTERED[method](model)
    inp = TextTokenInput("the secret code is", tokenizer)
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, gen_args={"max_new_tokens": 3, "do_sample": False})
    assert_same_state(before, model_state(model))
    source = tokenizer("the secret code is", return_tensors="pt").input_ids
    generated = model.generate(source, attention_mask=torch.ones_like(source), max_new_tokens=3, do_sample=False)[:, 1:]
    assert generated[0, -1] == model.generation_config.forced_eos_token_id, "BART forces its end token at the limit"
    generated = model.generate(
        source, attention_mask=torch.ones_like(source), max_new_tokens=3, do_sample=False, forced_eos_token_id=None
    )[:, 1:]
    assert generated[0, -1] != model.generation_config.forced_eos_token_id, "the token the model chose there"
    assert result.output_tokens == [tokenizer.decode(t) for t in generated[0]]
    span = explainer.attribute_span(source, generated, additional_forward_args=(torch.ones_like(source),))[0]
    rows = explainer.attribute_continuation(source, generated, additional_forward_args=(torch.ones_like(source),), log_prob=True)[0]
    torch.testing.assert_close(result.seq_attr, span[0])
    torch.testing.assert_close(result.token_attr, rows[0])


FORCED = 7
"""The token generate forces first in the tests' answers (a translation's target language)."""


def _forcing(name: str):
    model, source, answer = _case(name)
    model.generation_config.forced_bos_token_id = FORCED
    generated = model.generate(source, attention_mask=SOURCE_MASK, max_new_tokens=4, do_sample=False)[:, 1:]
    assert (generated[:, 0] == FORCED).all()
    return model, source, generated


def test_the_token_generate_forces_first_is_read_not_explained(name, capture_mode):
    """generation_config.forced_bos_token_id (mBART-50's, NLLB's target language, BART-CNN's
    BOS): the model does not choose that token, and its log-probability, from a source that
    does not say which language, was the largest term of the answer's. Grad-SAM reads the
    gradient of the answer's log-probability at every row: the forced row's is 0."""
    model, source, answer, method = *_forcing(name), "grad_sam"
    source_scores, target_scores = REGISTERED[method](model).attribute_span(source, answer, additional_forward_args=(SOURCE_MASK,))
    ref = span_reference(model, source, answer, forced=1)
    rel = 5e-5 if capture_mode == "streaming" and name == "t5" else 1e-5
    for b in range(2):
        expected_source, expected_target = SEQ2SEQ_REFERENCES[method](ref, b, span=True)
        assert_scores_close(source_scores[b, : len(expected_source)], expected_source, rel)
        assert_scores_close(target_scores[b], expected_target, rel)
    whole = span_reference(model, source, answer)
    assert not torch.allclose(SEQ2SEQ_REFERENCES[method](whole, 0, span=True)[0], SEQ2SEQ_REFERENCES[method](ref, 0, span=True)[0])


def test_an_answer_without_the_forced_token_is_warned_about_and_one_of_it_alone_refused(name):
    from captum_attention.metrics import ablated_log_probs

    model, source, answer = _forcing(name)
    explainer = REGISTERED["grad_sam"](model)
    with pytest.warns(UserWarning, match=rf"continuation rows \[0, 1\] do not begin with the token {FORCED} that .* forces first"):
        explainer.attribute_span(source, answer[:, 1:], additional_forward_args=(SOURCE_MASK,))
    with pytest.raises(ValueError, match=rf"^continuation holds only the token {FORCED} that .*: give the answer's tokens after it\.$"):
        explainer.attribute_span(source, answer[:, :1], additional_forward_args=(SOURCE_MASK,))
    kept = torch.ones(2, 1, int(SOURCE_MASK.sum(1).max()), dtype=torch.bool)
    scored = ablated_log_probs(model, source, SOURCE_MASK, answer, kept)[:, 0]
    with torch.no_grad():
        logits = model(input_ids=source, attention_mask=SOURCE_MASK, decoder_input_ids=_decoder_ids(model, answer)).logits
    expected = logits.float().log_softmax(dim=-1).gather(2, answer[..., None])[:, 1:].sum(dim=(1, 2))
    torch.testing.assert_close(scored, expected)


def test_a_first_token_forced_by_gen_args_is_warned_about():
    """NLLB's model card forces the target language in generate's arguments, which the
    spans do not see."""
    from captum.attr import TextTokenInput
    from lm_models import make_word_tokenizer

    from captum_attention import LLMAttentionAttribution

    model, tokenizer = make_encoder_decoder("bart"), make_word_tokenizer()
    explainer = LLMAttentionAttribution(REGISTERED["raw"](model), tokenizer)
    inp = TextTokenInput("the secret code is", tokenizer)
    gen_args = {"max_new_tokens": 2, "do_sample": False, "forced_bos_token_id": FORCED}
    with pytest.warns(UserWarning, match=rf"gen_args force the answer's first token \({FORCED}\).*"
                      rf"model\.generation_config\.forced_bos_token_id = {FORCED} instead"):
        explainer.attribute(inp, gen_args=gen_args, per_token=False)
    model.generation_config.forced_bos_token_id = FORCED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explainer.attribute(inp, gen_args=gen_args, per_token=False)


def test_a_text_answer_is_read_after_the_forced_token():
    from captum.attr import TextTokenInput
    from lm_models import make_word_tokenizer

    from captum_attention import LLMAttentionAttribution

    model, tokenizer = make_encoder_decoder("bart"), make_word_tokenizer()
    model.generation_config.forced_bos_token_id = FORCED
    explainer = REGISTERED["attn_lrp"](model)
    inp = TextTokenInput("the secret code is", tokenizer)
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, target="the code")
    target = torch.tensor([[FORCED, *tokenizer("the code", add_special_tokens=False).input_ids]])
    assert result.output_tokens == [tokenizer.decode(t) for t in target[0]]
    source = tokenizer("the secret code is", return_tensors="pt").input_ids
    span = explainer.attribute_span(source, target, additional_forward_args=(torch.ones_like(source),))[0]
    torch.testing.assert_close(result.seq_attr, span[0])


@pytest.mark.parametrize(
    "model_type, reason",
    [
        ("led", "found no encoder attention"),  # Longformer's windows in the encoder
        ("pegasus_x", "returned its attention as a dict"),  # local and global weights apart
        ("encoder-decoder", "found no cross attention"),  # EncoderDecoderModel: BERT's cross-attention unnamed
        ("fsmt", "attended to later target tokens"),  # its decoder drops the causal mask while caching
    ],
)
def test_encoder_decoders_without_softmax_attention_over_their_tokens_are_refused_in_one_line(model_type, reason):
    import warnings

    import zoo
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ

    from captum_attention import UnsupportedModelError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = zoo.build(zoo.Architecture(model_type, SEQ2SEQ[model_type], "causal LM"))
    model.generation_config.decoder_start_token_id = 2
    source, answer = torch.randint(3, 50, (2, 8)), torch.randint(3, 50, (2, 3))
    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match=reason) as refused:
        REGISTERED["grad_sam"](model).attribute_span(source, answer)
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("method", [m for m, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_a_span_of_florence2_with_its_image_equals_the_reference(method):
    """Florence-2's image inputs go last, after the source's mask (they were refused): the
    span's source scores, the image's tokens among them, and its target scores equal the
    references of the summed log-probability with the image given; a row of the answer is
    ``attribute`` at its prefix with the image."""
    from test_encoder_decoder import _tiny_florence2

    model = _tiny_florence2()
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        features = model.model.get_image_features(**images)
    count = getattr(features, "pooler_output", features).shape[1]
    source, answer = torch.tensor([[1, *[98] * count, 5, 6, 7]]), torch.tensor([[9, 10, 11]])
    mask = torch.ones_like(source)
    source_scores, target_scores = REGISTERED[method](model).attribute_span(source, answer, additional_forward_args=(mask, images))
    expected_source, expected_target = SEQ2SEQ_REFERENCES[method](span_reference(model, source, answer, mask, images), 0, span=True)
    assert expected_source[1 : 1 + count].abs().max() > 0
    assert_scores_close(source_scores[0], expected_source)
    assert_scores_close(target_scores[0], expected_target)
    cls = REGISTERED[method]
    source_rows, _ = cls(model).attribute_continuation(source, answer, additional_forward_args=(mask, images))
    prefix = _decoder_ids(model, answer)[:, :2]
    target = {"target": answer[:, 1]} if cls.spec.uses_target else {}
    expected_row, _ = cls(model).attribute((source, prefix), additional_forward_args=(mask, torch.ones_like(prefix), images), **target)
    assert_scores_close(source_rows[:, 1], expected_row)


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("family", ["t5", "bart"])
def test_integrated_gradients_of_an_answer_integrate_the_sources_embeddings(family, forced):
    """An encoder-decoder's answer: the written-out Gauss-Legendre rule over the module that
    embeds its source (its encoder's own: transformers' T5 and BART never call the model's
    input embeddings, where Integrated Gradients had nothing to move), every source token
    at id 0 in the baseline, the decoder reading its start token and the answer (its first
    token read, not explained, where generate forces it)."""
    from lm_models import make_encoder_decoder
    from test_vlm_answers import gauss_legendre_scores

    from captum_attention.presentation.explain import answer_integrated_gradients

    model = make_encoder_decoder(family)
    source, answer, steps = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]]), 6
    model.generation_config.forced_bos_token_id = 9 if forced else None
    decoder = _decoder_ids(model, answer)
    embeddings = model.get_encoder().get_input_embeddings()
    actual, start = embeddings(source).detach(), embeddings(torch.zeros_like(source)).detach()

    def log_prob() -> torch.Tensor:
        logits = model(input_ids=source, decoder_input_ids=decoder).logits
        return logits.float().log_softmax(dim=-1).gather(2, answer[..., None])[:, int(forced):].sum()

    expected = gauss_legendre_scores(embeddings, actual, start, steps, log_prob)
    assert expected.abs().max() > 0
    # float32 rounding of the steps' forwards, batched there and one by one here, on scores of tens
    scale = float(expected.abs().max())
    torch.testing.assert_close(answer_integrated_gradients(model, source, answer, steps), expected, rtol=1e-4, atol=1e-4 * scale)

