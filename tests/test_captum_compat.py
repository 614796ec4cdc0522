"""Our attributions inside Captum: NoiseTunnel, infidelity, sensitivity_max, visualisation, LIG."""

from __future__ import annotations

import pytest
import torch
from captum.attr import LayerIntegratedGradients, NoiseTunnel
from captum.attr import visualization as viz
from captum.metrics import infidelity, sensitivity_max
from conftest import make_batch, make_model

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution
from captum_attention.attr import REGISTRY
from captum_attention.metrics import comprehensiveness, token_replacement_perturbation, token_substitution_perturbation

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

NT_SAMPLES = 3
STDEV = 0.05


@pytest.fixture
def bert():
    model = make_model("bert")
    return model, make_batch(model)


def _forward_embeds(model):
    return lambda embeds, mask: model(inputs_embeds=embeds, attention_mask=mask).logits


@pytest.mark.parametrize("cls", [GradSAM, TransformerAttribution])
def test_noise_tunnel_smoothgrad_over_embeddings(bert, cls):
    model, batch = bert
    embeds = model.get_input_embeddings()(batch.input_ids).detach()
    explainer = cls(_forward_embeds(model), model=model)
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))

    torch.manual_seed(0)
    smoothed = NoiseTunnel(explainer).attribute(
        embeds, nt_type="smoothgrad", nt_samples=NT_SAMPLES, stdevs=STDEV, **args
    )
    torch.manual_seed(0)
    noise = torch.normal(0, torch.tensor(STDEV).repeat(len(embeds) * NT_SAMPLES, *embeds.shape[1:]))
    noisy = embeds.repeat_interleave(NT_SAMPLES, dim=0) + noise
    per_sample = explainer.attribute(
        noisy, target=1, additional_forward_args=(batch.attention_mask.repeat_interleave(NT_SAMPLES, 0),)
    )
    expected = per_sample.view(len(embeds), NT_SAMPLES, -1).mean(dim=1)
    assert smoothed.shape == batch.input_ids.shape
    torch.testing.assert_close(smoothed, expected)
    assert not torch.allclose(smoothed, explainer.attribute(embeds, **args)), "noise had no effect"
    assert (smoothed[batch.attention_mask == 0] == 0).all()


@pytest.mark.parametrize("name", [name for name in REGISTRY if name != "alti_logit"])  # ALTI-Logit: language models
def test_one_score_per_example_is_explained_as_its_class(bert, name):
    """A forward that returns one score per example (``(batch,)``, Captum's SQuAD tutorial's
    kind) is explained with ``target=None`` as the logits with that score's class as target;
    a target beyond it is refused in one line by a method that reads the target; the
    metrics read the score as one logit, its sigmoid (``test_one_logit_is_read_as_its_sigmoid``)."""
    model, batch = bert
    mask = batch.attention_mask
    cls = REGISTRY[name]
    expected = cls(model).attribute(batch.input_ids, target=2, additional_forward_args=(mask,))
    scores = cls(lambda ids, m: model(ids, attention_mask=m).logits[:, 2], model=model)
    torch.testing.assert_close(scores.attribute(batch.input_ids, additional_forward_args=(mask,)), expected, rtol=0, atol=0)
    if name == "grad_sam":
        with pytest.raises(ValueError, match="returns one score per example, so target must be 0 or None"):
            scores.attribute(batch.input_ids, target=1, additional_forward_args=(mask,))


def test_embeddings_and_token_ids_give_the_same_scores(bert):
    model, batch = bert
    embeds = model.get_input_embeddings()(batch.input_ids).detach()
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    by_ids = GradSAM(model).attribute(batch.input_ids, **args)
    by_embeds = GradSAM(_forward_embeds(model), model=model).attribute(embeds, **args)
    torch.testing.assert_close(by_ids, by_embeds)


def test_infidelity_with_token_replacement(bert):
    model, batch = bert
    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    scores = TransformerAttribution(model).attribute(
        batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,)
    )
    samples = 5
    value = infidelity(
        forward,
        token_replacement_perturbation(replacement_id=2, probability=0.3, protected_ids=[0], seed=7),
        batch.input_ids,
        scores,
        target=1,
        additional_forward_args=(batch.attention_mask,),
        n_perturb_samples=samples,
    )
    indicator, perturbed = token_replacement_perturbation(2, 0.3, [0], seed=7)(
        batch.input_ids.repeat_interleave(samples, 0)
    )
    mask = batch.attention_mask.repeat_interleave(samples, 0)
    with torch.no_grad():
        drop = forward(batch.input_ids, batch.attention_mask)[:, 1].repeat_interleave(samples) - forward(
            perturbed, mask
        )[:, 1]
    explained = (scores.repeat_interleave(samples, 0) * indicator).sum(dim=1)
    expected = ((explained - drop) ** 2).view(-1, samples).mean(dim=1)
    assert (perturbed[batch.input_ids.repeat_interleave(samples, 0) == 0] == 0).all(), "padding kept"
    assert indicator.sum() > 0
    torch.testing.assert_close(value, expected)


def test_an_examples_infidelity_does_not_depend_on_its_batch(bert):
    """Each example's perturbations are drawn from its own tokens and how many of its
    samples came before: alone and unpadded, in the padded batch, and with Captum's
    samples split over several calls (``max_examples_per_batch``), the same values."""
    model, batch = bert
    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    scores = TransformerAttribution(model).attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,))

    def value(ids, mask, explained, **options):
        perturb = token_replacement_perturbation(2, 0.3, protected_ids=[0], seed=7)
        return infidelity(forward, perturb, ids, explained, target=1, additional_forward_args=(mask,), n_perturb_samples=6, **options)

    together = value(batch.input_ids, batch.attention_mask, scores)
    torch.testing.assert_close(value(batch.input_ids, batch.attention_mask, scores, max_examples_per_batch=6), together)
    for row, length in enumerate(batch.lengths):
        alone = value(batch.input_ids[row : row + 1, :length], batch.attention_mask[row : row + 1, :length], scores[row : row + 1, :length])
        torch.testing.assert_close(alone, together[row : row + 1], atol=1e-6, rtol=1e-4)


def test_substitutions_are_drawn_per_example_from_the_allowed_ids():
    """The same example gets the same substitutions in any batch and under left padding;
    every substitute is an allowed id, and over many draws each allowed id turns up."""
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 0, 0], [1, 9, 8, 7, 6, 5, 4, 3]])
    perturb = token_substitution_perturbation(12, 1.0, protected_ids=[0, 1])
    swapped = perturb(ids)
    assert (swapped[ids <= 1] == ids[ids <= 1]).all() and (swapped[ids > 1] > 1).all()
    first = token_substitution_perturbation(12, 1.0, protected_ids=[0, 1], seed=0)(ids)
    reordered = token_substitution_perturbation(12, 1.0, protected_ids=[0, 1], seed=0)(ids.flip(0))
    assert torch.equal(first, reordered.flip(0))
    left_padded = torch.tensor([[0, 0, 1, 5, 6, 7, 8, 9]])
    moved = token_substitution_perturbation(12, 1.0, protected_ids=[0, 1], seed=0)(left_padded)
    assert torch.equal(moved[0, 2:], first[0, :6])
    many = token_substitution_perturbation(12, 1.0, protected_ids=[0, 1], seed=0)(ids[1:].repeat(100, 1))
    assert set(many[:, 1:].unique().tolist()) == set(range(2, 12))


def test_sensitivity_max_with_token_substitution(bert):
    model, batch = bert
    explainer = GradSAM(model)
    samples = 4
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    value = sensitivity_max(
        explainer.attribute,
        (batch.input_ids,),
        perturb_func=token_substitution_perturbation(64, 0.3, protected_ids=[0], seed=3),
        n_perturb_samples=samples,
        **args,
    )
    perturbed = token_substitution_perturbation(64, 0.3, protected_ids=[0], seed=3)(
        batch.input_ids.repeat_interleave(samples, 0)
    )
    original = explainer.attribute(batch.input_ids, **args)
    moved = explainer.attribute(
        perturbed, target=1, additional_forward_args=(batch.attention_mask.repeat_interleave(samples, 0),)
    )
    ratio = (moved - original.repeat_interleave(samples, 0)).norm(dim=1) / original.norm(
        dim=1
    ).repeat_interleave(samples)
    torch.testing.assert_close(value, ratio.view(-1, samples).max(dim=1).values)
    assert (value > 0).all()


def test_tuple_inputs_give_tuple_outputs(bert):
    model, batch = bert
    (scores,) = RawAttention(model).attribute((batch.input_ids,), additional_forward_args=(batch.attention_mask,))
    assert scores.shape == batch.input_ids.shape


def test_visualize_text_takes_our_scores(bert):
    pytest.importorskip("IPython")
    model, batch = bert
    scores = AttentionRollout(model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    n = batch.lengths[0]
    tokens = [f"tok{i}" for i in batch.input_ids[0, :n].tolist()]
    record = viz.VisualizationDataRecord(
        scores[0, :n] / scores[0, :n].abs().max(), 0.9, 1, 1, "1", scores[0, :n].sum(), tokens, None
    )
    html = viz.visualize_text([record])
    assert all(token in html.data for token in tokens)


def test_side_by_side_with_layer_integrated_gradients(bert):
    model, batch = bert
    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    lig = LayerIntegratedGradients(forward, model.get_input_embeddings())
    ig, delta = lig.attribute(batch.input_ids, n_steps=64, return_convergence_delta=True, **args)
    ours = GradSAM(forward, model=model).attribute(batch.input_ids, **args)
    assert ig.sum(dim=-1).shape == ours.shape == batch.input_ids.shape
    # the same forward serves both: ours equals the model's own call, IG completes to f(x) - f(0)
    torch.testing.assert_close(ours, GradSAM(model).attribute(batch.input_ids, **args))
    with torch.no_grad():
        gap = forward(batch.input_ids, batch.attention_mask)[:, 1] - forward(torch.zeros_like(batch.input_ids), batch.attention_mask)[:, 1]
    assert (delta.abs() < 0.05 * gap.abs().max()).all()
    torch.testing.assert_close(ig.sum(dim=(1, 2)), gap, atol=0.05 * float(gap.abs().max()), rtol=0)


def test_readable_names():
    assert [cls.get_name() for cls in (GradSAM, AttentionRollout, TransformerAttribution, RawAttention)] == [
        "Grad-SAM",
        "Attention Rollout",
        "Transformer Attribution",
        "Raw Attention",
    ]


def test_perturbation_arguments_are_checked():
    with pytest.raises(ValueError, match="probability"):
        token_replacement_perturbation(0, probability=0.0)
    with pytest.raises(TypeError, match="integer token ids"):
        token_replacement_perturbation(0)(torch.zeros(2, 3))


def _tagger() -> torch.nn.Module:
    """A token classifier of nine tags, so that a tuple read as one class per example would
    name tags in range."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, num_labels=9, initializer_range=0.3)
    return BertForTokenClassification(config).eval()


@pytest.mark.parametrize("name", [name for name in sorted(REGISTRY) if name != "alti_logit"])  # ALTI-Logit: pre-norm language models
def test_a_tuple_target_indexes_the_logits_at_each_position_as_in_captum(name):
    """Captum reads a tuple target as an index after the batch: ``(position, class)`` of a
    token classifier's logits, a list of such tuples one per example. Each method explains
    that position's class: the query, and the logit, that ``query_index`` and a class give.
    A tuple of two was read as one class per example (two examples, tags 3 and 1)."""
    model = _tagger()
    batch = make_batch(model, lengths=(9, 6))
    method, args = REGISTRY[name](model), (batch.attention_mask,)
    expected = method.attribute(batch.input_ids, target=1, additional_forward_args=args, query_index=3)
    for given in (dict(target=(3, 1)), dict(target=(3, 1), query_index=3)):
        torch.testing.assert_close(method.attribute(batch.input_ids, additional_forward_args=args, **given), expected, rtol=0, atol=0)
    each = method.attribute(batch.input_ids, target=[1, 7], additional_forward_args=args, query_index=torch.tensor([3, 5]))
    pairs = method.attribute(batch.input_ids, target=[(3, 1), (5, 7)], additional_forward_args=args)
    torch.testing.assert_close(pairs, each, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"target \(3, 1\) names positions \[3\] and query_index 2 others"):
        method.attribute(batch.input_ids, target=(3, 1), additional_forward_args=args, query_index=2)


def test_a_tuple_target_counts_positions_from_the_end_and_a_classifier_refuses_it(bert):
    """``(-1, token)`` is a left-padded language model's last position, its default query;
    a classifier's logits, one row per example, take no position."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    args = (prompts.attention_mask,)
    torch.testing.assert_close(GradSAM(model).attribute(prompts.input_ids, target=(-1, 5), additional_forward_args=args),
                               GradSAM(model).attribute(prompts.input_ids, target=5, additional_forward_args=args))
    classifier, batch = bert
    with pytest.raises(ValueError, match=r"indexes logits per position, as Captum reads a tuple, but forward_func returns \(3, 3\) logits"):
        GradSAM(classifier).attribute(batch.input_ids, target=(0, 1), additional_forward_args=(batch.attention_mask,))
    torch.testing.assert_close(GradSAM(classifier).attribute(batch.input_ids, target=(1,), additional_forward_args=(batch.attention_mask,)),
                               GradSAM(classifier).attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,)))
    scores = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"these \(3, 3\) logits take one index: pass a list for one class per example"):
        comprehensiveness(classifier, batch.input_ids, batch.attention_mask, scores, target=(0, 1, 2))


def test_targets_of_numpy_and_tensor_integers_are_read_as_ints(bert):
    """A list of numpy integers (``list(labels.numpy())``) or of one-element tensors, and a
    tuple of them, were refused as holding no ints."""
    import numpy as np

    model, batch = bert
    args = dict(additional_forward_args=(batch.attention_mask,))
    expected = GradSAM(model).attribute(batch.input_ids, target=[1, 0, 2], **args)
    for target in (list(np.array([1, 0, 2])), [torch.tensor(1), torch.tensor(0), torch.tensor(2)]):
        torch.testing.assert_close(GradSAM(model).attribute(batch.input_ids, target=target, **args), expected, rtol=0, atol=0)
    torch.testing.assert_close(GradSAM(model).attribute(batch.input_ids, target=(np.int64(1),), **args),
                               GradSAM(model).attribute(batch.input_ids, target=1, **args), rtol=0, atol=0)
    scores = torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(comprehensiveness(model, batch.input_ids, batch.attention_mask, scores, target=list(np.array([1, 0, 2]))),
                               comprehensiveness(model, batch.input_ids, batch.attention_mask, scores, target=[1, 0, 2]))
    tagger = _tagger()
    tags = make_batch(tagger, lengths=(9, 6))
    torch.testing.assert_close(
        GradSAM(tagger).attribute(tags.input_ids, target=(np.int64(3), np.int64(1)), additional_forward_args=(tags.attention_mask,)),
        GradSAM(tagger).attribute(tags.input_ids, target=(3, 1), additional_forward_args=(tags.attention_mask,)), rtol=0, atol=0)


def _scored_metrics(bert):
    """Each metric that takes scores, as a call on ``scores``: a classifier's batch, a
    language model's prompts and answer."""
    from lm_models import make_decoder, make_prompts

    from captum_attention import metrics

    model, batch = bert
    ids, mask = batch.input_ids, batch.attention_mask
    rationale = torch.zeros_like(ids, dtype=torch.bool).index_fill_(1, torch.tensor([1, 2]), True)
    decoder, prompts = make_decoder("llama"), make_prompts(side="left")
    answer = torch.tensor([[7, 8]] * 3)
    text_scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    prompt_scores = torch.rand(prompts.input_ids.shape, generator=torch.Generator().manual_seed(0))
    on_text = {
        "comprehensiveness": lambda s: metrics.comprehensiveness(model, ids, mask, s, target=1),
        "datamodeling_score": lambda s: metrics.datamodeling_score(model, ids, mask, s, target=1, num_ablations=4),
        "token_f1": lambda s: metrics.token_f1(s, rationale, mask, k=2),
        "kendall_tau": lambda s: metrics.kendall_tau(s, (text_scores.flip(1),), mask),
        "decision_flip_fraction": lambda s: metrics.decision_flip_fraction(model, ids, s, (mask,)).removed,
    }
    on_answers = {
        "linear_datamodeling_score": lambda s: metrics.linear_datamodeling_score(decoder, prompts.input_ids, prompts.attention_mask, answer, s),
        "top_k_log_prob_drop": lambda s: metrics.top_k_log_prob_drop(decoder, prompts.input_ids, prompts.attention_mask, answer, s, ks=(1,)),
    }
    return {name: (call, text_scores) for name, call in on_text.items()} | {name: (call, prompt_scores) for name, call in on_answers.items()}


def test_the_metrics_take_scores_as_captum_returns_them_for_a_tuple_of_inputs(bert):
    """``attribute((input_ids,), ...)`` returns ``(scores,)``, as Captum's methods do: the
    metrics read it as the scores (they failed with "'tuple' object has no attribute
    'shape'"), and refuse a pair (an encoder-decoder's) in one line."""
    for name, (call, scores) in _scored_metrics(bert).items():
        torch.testing.assert_close(call((scores,)), call(scores), rtol=0, atol=0, equal_nan=True, msg=name)
        with pytest.raises(ValueError, match=r"is a tuple of 2, as Captum returns scores for a tuple of inputs;") as refused:
            call((scores, scores))
        assert "\n" not in str(refused.value)
