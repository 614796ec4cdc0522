"""Encoder-decoders (T5, BART): source and target scores, Chefer et al.'s cross-attention rules.

References loop over examples on each one's real tokens, from output_attentions and
autograd.grad; rollout is checked against explicit products of the joint (source + target)
token graph's matrices.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from conftest import assert_same_state, assert_scores_close, model_state
from lm_models import ENCODER_DECODERS, make_encoder_decoder
from seq2seq_reference import SEQ2SEQ_REFERENCES, Seq2SeqReference

from captum_attention import METHODS as REGISTERED
from captum_attention import AttentionRollout, GradSAM, TransformerAttribution
from captum_attention.capture.inputs import classifier_decoder_ids
from captum_attention.maps.encoder_decoder import text_scores

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

SOURCE_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
TARGET_MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


@pytest.fixture(params=ENCODER_DECODERS)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


@dataclass
class Seq2Seq:
    source: torch.Tensor
    target: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, torch.Tensor]:
        return SOURCE_MASK, TARGET_MASK


def make_pair(seed: int = 3) -> Seq2Seq:
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, 64, SOURCE_MASK.shape, generator=generator)
    target = torch.randint(3, 64, TARGET_MASK.shape, generator=generator)
    return Seq2Seq(source, target)


def reference(
    model, pair: Seq2Seq, target: torch.Tensor | None = None, masks: tuple[torch.Tensor, torch.Tensor] = (SOURCE_MASK, TARGET_MASK),
    images: dict[str, torch.Tensor] | None = None,
) -> Seq2SeqReference:
    """From the eager twin's maps and gradients; ``images``: a vision-language model's."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    source_mask, target_mask = masks
    out = ref(
        input_ids=pair.source, attention_mask=source_mask, decoder_input_ids=pair.target,
        decoder_attention_mask=target_mask, output_attentions=True, **(images or {}),
    )
    queries = target_mask.sum(1) - 1
    return read_reference(out, out.logits[torch.arange(len(queries)), queries], target, source_mask, queries)


def read_reference(out, logits: torch.Tensor, target: torch.Tensor | None, source_mask: torch.Tensor,
                   queries: torch.Tensor) -> Seq2SeqReference:
    """The maps of ``out`` (the eager twin's output) and their gradients of ``logits``
    ``(B, classes)`` at ``target`` (default: the top class), read at the decoder rows
    ``queries``."""
    targets = logits.argmax(-1) if target is None else target
    groups = [out.encoder_attentions, out.decoder_attentions, out.cross_attentions]
    flat = [a for group in groups for a in group]
    grads = iter(torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), flat))
    pairs = [[(a.detach(), next(grads)) for a in group] for group in groups]
    return Seq2SeqReference(*pairs, source_mask.sum(1).tolist(), (queries + 1).tolist())


def test_every_registered_method_has_an_encoder_decoder_reference():
    assert set(SEQ2SEQ_REFERENCES) == set(REGISTERED)


@pytest.mark.parametrize("method", [name for name, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_source_and_target_scores_match_reference(name, method, capture_mode):
    model = make_encoder_decoder(name)
    pair = make_pair()
    cls = REGISTERED[method]
    target = torch.tensor([5, 9]) if cls.spec.uses_target else None
    ref = reference(model, pair, target)
    explainer = cls(model)
    source, target_scores = explainer.attribute(
        (pair.source, pair.target), target=target, additional_forward_args=pair.args
    )
    assert source.shape == pair.source.shape and target_scores.shape == pair.target.shape
    streams = capture_mode == "streaming" and cls.spec.streams
    assert explainer.last_capture.startswith("streaming" if streams else "eager")
    # Streaming explains the model's sdpa forward, the reference its eager one. Through the
    # two, T5's peaked test model (initializer_factor=3) already gives logits 3e-5 apart
    # (test_t5_sdpa_and_eager_differ), which its peaked attention turns into up to 3e-5 of
    # the scores' scale; BART and every other family meet 1e-5.
    rel = 5e-5 if streams and name == "t5" else 1e-5
    for b in range(2):
        expected_source, expected_target = SEQ2SEQ_REFERENCES[method](ref, b)
        s, t = len(expected_source), len(expected_target)
        assert expected_source.abs().max() > 0
        assert_scores_close(source[b, :s], expected_source, rel)
        assert_scores_close(target_scores[b, :t], expected_target, rel)
        assert (source[b, s:] == 0).all() and (target_scores[b, t:] == 0).all()


def classifier_case(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny sequence classifier of ``name``'s stacks and two texts padded on the right,
    each ending in its end-of-sequence token (the classifier's read position)."""
    model = make_encoder_decoder(name, classifier=True)
    lengths = torch.tensor([[6], [4]])
    mask = (torch.arange(6) < lengths).long()
    ids = torch.randint(3, 64, mask.shape, generator=torch.Generator().manual_seed(5))
    ids[torch.arange(2), lengths[:, 0] - 1] = model.config.eos_token_id
    return model, ids.masked_fill(mask == 0, model.config.pad_token_id), mask


@pytest.mark.parametrize("method", [name for name, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_an_encoder_decoder_classifier_is_explained_at_the_row_it_reads(name, method):
    """BART's and T5's classifiers read the decoder at the text's last end-of-sequence
    token; in a batch padded on the right that is not the decoder's last row, and the
    decoder takes no padding mask. By default every method explains the row read, equal to
    its reference there, the decoder's later rows at 0; the text's joined scores keep the
    source's and target's sum."""
    model, ids, mask = classifier_case(name)
    decoder_ids = classifier_decoder_ids(model, ids, mask)
    start = torch.full((2, 1), model.config.decoder_start_token_id)
    assert torch.equal(decoder_ids, torch.cat([start, ids[:, :-1]], dim=1))  # the text shifted right
    cls = REGISTERED[method]
    target = torch.tensor([1, 2]) if cls.spec.uses_target else None
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")
    out = ref_model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)
    ref = read_reference(out, out.logits, target, mask, mask.sum(1) - 1)
    source, target_scores = cls(model).attribute((ids, decoder_ids), target=target, additional_forward_args=(mask,))
    rel = 5e-5 if name == "t5" else 1e-5  # T5's peaked model: sdpa and eager apart (test_t5_sdpa_and_eager_differ)
    for b in range(2):
        expected_source, expected_target = SEQ2SEQ_REFERENCES[method](ref, b)
        s, t = len(expected_source), len(expected_target)
        assert_scores_close(source[b, :s], expected_source, rel)
        assert_scores_close(target_scores[b, :t], expected_target, rel)
        assert (source[b, s:] == 0).all() and (target_scores[b, t:] == 0).all()
    joined = text_scores(source, target_scores, mask)
    torch.testing.assert_close(joined.sum(1), source.sum(1) + target_scores.sum(1))
    torch.testing.assert_close(joined[1, :3], source[1, :3] + target_scores[1, 1:4])


def test_t5_sdpa_and_eager_differ():
    model = make_encoder_decoder("t5")
    pair = make_pair()
    kwargs = dict(input_ids=pair.source, decoder_input_ids=pair.target, attention_mask=SOURCE_MASK,
                  decoder_attention_mask=TARGET_MASK)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    gap = (model(**kwargs).logits - eager(**kwargs).logits).abs().max() / eager(**kwargs).logits.abs().max()
    assert 1e-7 < gap < 5e-6  # relative to the logits' scale; amplified in the peaked attention


def test_rollout_scores_of_source_and_target_sum_to_one(name):
    model = make_encoder_decoder(name)
    pair = make_pair()
    source, target = AttentionRollout(model).attribute((pair.source, pair.target), additional_forward_args=pair.args)
    torch.testing.assert_close(source.sum(1) + target.sum(1), torch.ones(2))


@pytest.mark.parametrize("method", list(SEQ2SEQ_REFERENCES))
def test_padded_pair_matches_each_example_alone(name, method):
    model = make_encoder_decoder(name)
    pair = make_pair()
    explainer = REGISTERED[method](model)
    source, target = explainer.attribute((pair.source, pair.target), additional_forward_args=pair.args)
    s, t = int(SOURCE_MASK[1].sum()), int(TARGET_MASK[1].sum())
    alone_source, alone_target = explainer.attribute((pair.source[1:, :s], pair.target[1:, :t]))
    torch.testing.assert_close(source[1:, :s], alone_source, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(target[1:, :t], alone_target, atol=1e-6, rtol=1e-4)


def test_model_left_as_found_and_single_input_refused(name):
    model = make_encoder_decoder(name)
    before = model_state(model)
    pair = make_pair()
    TransformerAttribution(model).attribute((pair.source, pair.target), additional_forward_args=pair.args)
    with pytest.raises(TypeError, match="decoder_input_ids"):
        GradSAM(model).attribute(
            pair.source,
            additional_forward_args=(SOURCE_MASK, pair.target),
        )
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("method", sorted(REGISTERED))
def test_a_target_passed_as_labels_is_refused_in_one_line(name, method):
    """``labels`` are shifted right by the model before its decoder reads them: the target
    scores, which stand for the second input's tokens, were each one token off."""
    from conftest import assert_refused_in_one_line

    model, pair = make_encoder_decoder(name), make_pair()
    as_labels = lambda source, target, mask: model(input_ids=source, attention_mask=mask, labels=target).logits  # noqa: E731
    explain = REGISTERED[method](as_labels, model=model)
    assert_refused_in_one_line(
        model, lambda: explain.attribute((pair.source, pair.target), target=5, additional_forward_args=(SOURCE_MASK,)),
        r"decoder read other token ids than the second input \(2, 5\), for which the target scores stand .* pass the ids the "
        "decoder reads, decoder_input_ids",
    )


def test_erasing_every_source_key_but_the_first_is_the_first_source_token_alone(name):
    """Erasure acts on the source keys of encoder self-attention and cross-attention."""
    from captum_attention.metrics import attention_erasure

    model = make_encoder_decoder(name)
    pair = make_pair()
    erased = torch.ones_like(SOURCE_MASK, dtype=torch.bool)
    erased[:, 0] = False
    result = attention_erasure(model, (pair.source, pair.target), erased, pair.args)
    queries = TARGET_MASK.sum(1) - 1
    with torch.no_grad():
        alone = model(
            input_ids=pair.source[:, :1], decoder_input_ids=pair.target, decoder_attention_mask=TARGET_MASK
        ).logits[torch.arange(2), queries].softmax(-1)
    torch.testing.assert_close(result.erased, alone, atol=1e-6, rtol=1e-5)
    assert (result.js_divergence > 0).all()


def test_decision_flip_and_permutation_on_source_tokens(name):
    from captum_attention.metrics import attention_permutation, decision_flip_fraction

    model = make_encoder_decoder(name)
    pair = make_pair()
    source, _ = TransformerAttribution(model).attribute((pair.source, pair.target), additional_forward_args=pair.args)
    flips = decision_flip_fraction(model, (pair.source, pair.target), source, pair.args)
    assert flips.removed.shape == (2,)
    assert ((flips.fraction[flips.flipped] > 0) & (flips.fraction[flips.flipped] <= 1)).all()
    permuted = attention_permutation(model, (pair.source, pair.target), pair.args, n_permutations=3)
    assert (permuted.median_tvd > 0).all()


def _tiny_florence2() -> torch.nn.Module:
    """The architecture sweep's Florence-2: a DaViT vision tower (two stages, windows of 2)
    whose features take the place of the image's tokens (98) in a BART encoder's input."""
    import zoo

    return zoo.build(next(a for a in zoo.architectures("image-text-to-text") if a.model_type == "florence2"))


@pytest.mark.parametrize("method", [name for name, reference in SEQ2SEQ_REFERENCES.items() if reference is not None])
def test_florence2s_image_tokens_in_its_encoders_input_are_explained(method):
    """Florence-2 puts its image's features in its encoder's input at its image tokens. Its
    vision tower's windowed attention is not read (every method was refused, naming the
    tower's windows or its convolutions): the source scores, the image's tokens among
    them, and the target scores equal the references from the eager twin's maps."""
    model = _tiny_florence2()
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        features = model.model.get_image_features(**images)
    count = getattr(features, "pooler_output", features).shape[1]
    pair = Seq2Seq(torch.tensor([[1, *[98] * count, 5, 6, 7]]), torch.tensor([[1, 9, 10]]))
    masks = (torch.ones_like(pair.source), torch.ones_like(pair.target))
    cls = REGISTERED[method]
    target = torch.tensor([5]) if cls.spec.uses_target else None
    before = model_state(model)
    source, target_scores = cls(model).attribute((pair.source, pair.target), target=target, additional_forward_args=(*masks, images))
    assert_same_state(before, model_state(model))
    expected_source, expected_target = SEQ2SEQ_REFERENCES[method](reference(model, pair, target, masks, images), 0)
    assert expected_source[1 : 1 + count].abs().max() > 0
    assert_scores_close(source[0], expected_source)
    assert_scores_close(target_scores[0], expected_target)


def test_florence2s_image_tokens_land_on_its_vision_towers_grid():
    """Florence-2's image tokens: the mean of its features first, then its vision tower's
    last stage row by row; ``image_scores`` places them on that stage's grid (the mean
    left out), for an image that is not square too."""
    from captum_attention import image_scores

    model = _tiny_florence2()
    for height, width in ((32, 32), (32, 64)):
        images = {"pixel_values": torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(0))}
        with torch.no_grad():
            grid = model.model.vision_tower(images["pixel_values"]).last_hidden_state.shape[-2:]
        count = 1 + grid.numel()
        source = torch.tensor([[1, *[98] * count, 5, 6, 7]])
        numbered = torch.zeros(source.shape)
        numbered[source == 98] = torch.arange(float(count))
        (placed,) = image_scores(model, source, numbered, images)[0]
        torch.testing.assert_close(placed, torch.arange(1.0, count).view(*grid))
