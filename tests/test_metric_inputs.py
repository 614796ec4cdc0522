"""Metrics given unrankable scores, ties, negative or missing heads and malformed arguments:
a tie-aware result or one clear error, never a silently wrong number."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, make_model

from captum_attention import METHODS
from captum_attention.metrics import (
    attention_erasure,
    attention_permutation,
    auprc,
    comprehensiveness,
    decision_flip_fraction,
    iou_f1,
    token_f1,
)

HEADS = 4  # the tiny BERT's heads per layer


@pytest.fixture
def setup():
    model = make_model("bert")
    return model, make_batch(model)


def _forward(model):
    return lambda ids, mask: model(ids, attention_mask=mask).logits


def test_a_nan_score_is_refused_by_every_ranking_metric(setup):
    model, batch = setup
    scores = torch.rand(batch.input_ids.shape)
    scores[1, 2] = float("nan")
    rationale = torch.zeros_like(scores, dtype=torch.bool)
    rationale[:, 1] = True
    for metric in (token_f1, iou_f1, auprc):
        with pytest.raises(ValueError, match=r"NaN in examples \[1\]"):
            metric(scores, rationale)
    with pytest.raises(ValueError, match="NaN"):
        decision_flip_fraction(model, batch.input_ids, scores, (batch.attention_mask,))
    with pytest.raises(ValueError, match="NaN"):
        comprehensiveness(_forward(model), batch.input_ids, batch.attention_mask, scores)


def test_a_nan_outside_the_included_tokens_is_ignored():
    scores = torch.tensor([[0.9, 0.1, float("nan")]])
    rationale = torch.tensor([[True, False, False]])
    include = torch.tensor([[True, True, False]])
    assert auprc(scores, rationale, include).item() == 1.0


@pytest.mark.parametrize("position", [0, 5])
def test_ties_never_decide_by_position(position):
    zeros = torch.zeros(1, 6)
    rationale = torch.zeros(1, 6, dtype=torch.bool)
    rationale[0, position] = True
    # one of six tied tokens selected: expected overlap 1/6, F1 = 2·(1/6)/(1 + 1)
    assert token_f1(zeros, rationale).item() == pytest.approx(1 / 6)
    # one threshold holding every token: precision 1/6 at recall 1
    assert auprc(zeros, rationale).item() == pytest.approx(1 / 6)
    # all tied tokens selected: one span covering the rationale's, IoU 1/6
    assert iou_f1(zeros, rationale).item() == 0.0


def test_auprc_takes_tied_scores_as_one_step():
    scores = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    rationale = torch.tensor([[True, False, True, False]])
    # thresholds 1 (precision 1/2, recall 1/2) and 0 (precision 2/4, recall 1)
    assert auprc(scores, rationale).item() == pytest.approx(0.5 * 0.5 + 0.5 * 0.5)


def test_rows_without_an_included_token_are_refused():
    scores, rationale = torch.rand(2, 4), torch.ones(2, 4, dtype=torch.bool)
    include = torch.ones(2, 4, dtype=torch.bool)
    include[0] = False
    for metric in (token_f1, iou_f1, auprc):
        with pytest.raises(ValueError, match=r"Examples \[0\] have no token"):
            metric(scores, rationale, include)
    with pytest.raises(ValueError, match="include has shape"):
        token_f1(scores, rationale, include[:, :3])


def test_negative_heads_count_from_the_end(setup):
    model, batch = setup
    erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    erased[:, 1] = True
    args = (model, batch.input_ids, erased, (batch.attention_mask,))
    last = attention_erasure(*args, heads=[HEADS - 1])
    assert bool((last.js_divergence > 0).all())
    torch.testing.assert_close(attention_erasure(*args, heads=[-1]).js_divergence, last.js_divergence)
    permuted = attention_permutation(model, batch.input_ids, (batch.attention_mask,), heads=[-1], n_permutations=3)
    torch.testing.assert_close(
        permuted.median_tvd,
        attention_permutation(model, batch.input_ids, (batch.attention_mask,), heads=[HEADS - 1], n_permutations=3).median_tvd,
    )


@pytest.mark.parametrize("heads", [[HEADS], [-HEADS - 1], [1.0], []])
def test_heads_that_do_not_exist_are_refused(setup, heads):
    model, batch = setup
    erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    with pytest.raises(ValueError, match="heads .* do not exist"):
        attention_erasure(model, batch.input_ids, erased, (batch.attention_mask,), heads=heads)
    with pytest.raises(ValueError, match="heads .* do not exist"):
        attention_permutation(model, batch.input_ids, (batch.attention_mask,), heads=heads, n_permutations=1)


def test_layer_indices_must_be_ints(setup):
    model, batch = setup
    with pytest.raises(TypeError, match="layer must be an int"):
        METHODS["raw"](model).attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,), layer=1.5)
    erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
    with pytest.raises(TypeError, match="layers must be an int"):
        attention_erasure(model, batch.input_ids, erased, (batch.attention_mask,), layers=1.5)


def test_malformed_metric_arguments_get_one_clear_error(setup):
    model, batch = setup
    ranking = torch.rand(batch.input_ids.shape)
    args = (model, batch.input_ids, ranking, (batch.attention_mask,))
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        decision_flip_fraction(*args, max_batch_size=0)
    with pytest.raises(ValueError, match="keep has shape"):
        decision_flip_fraction(*args, keep=torch.zeros(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="query_index .* outside"):
        decision_flip_fraction(*args, query_index=99)
    removal = (_forward(model), batch.input_ids, batch.attention_mask, ranking)
    with pytest.raises(ValueError, match="max_batch_size must be at least 1"):
        comprehensiveness(*removal, max_batch_size=0)
    with pytest.raises(ValueError, match="keep has shape"):
        comprehensiveness(*removal, keep=torch.zeros(3, 2, dtype=torch.bool))


def test_decision_flips_never_split_tied_keys(setup):
    model, batch = setup
    ranking = (torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(34)) * 3).floor()
    result = decision_flip_fraction(model, batch.input_ids, ranking, (batch.attention_mask,))
    assert bool(result.flipped.any())
    for b in torch.nonzero(result.flipped).flatten().tolist():
        real_scores = ranking[b, : batch.lengths[b]].sort(descending=True).values
        removed = int(result.removed[b])
        assert real_scores[removed - 1] != real_scores[removed], "the erased keys split a tie"


def test_token_removal_removes_tied_tokens_together(setup):
    model, batch = setup
    forward = _forward(model)
    tied = torch.ones(batch.input_ids.shape)  # every token tied: any bin removes them all
    scores = comprehensiveness(forward, batch.input_ids, batch.attention_mask, tied, target=0, bins=(1, 50, 100))
    torch.testing.assert_close(scores[:, 0], scores[:, 2])
    torch.testing.assert_close(scores[:, 1], scores[:, 2])


def test_a_tokenizers_lists_are_refused_naming_them(setup):
    """``tokenizer(texts).input_ids`` without ``return_tensors='pt'`` is a list: the metrics
    failed with "'list' object has no attribute 'shape'"."""
    from lm_models import make_decoder, make_prompts

    from captum_attention.metrics import linear_datamodeling_score

    model, batch = setup
    with pytest.raises(TypeError, match=r"^input_ids \(list\) must be tensors \(batch, seq_len\): .*return_tensors='pt'"):
        comprehensiveness(model, batch.input_ids.tolist(), batch.attention_mask, torch.rand(batch.input_ids.shape), target=1)
    decoder, prompts = make_decoder("llama"), make_prompts(side="left")
    with pytest.raises(TypeError, match=r"^input_ids \(list\), attention_mask \(list\) must be tensors"):
        linear_datamodeling_score(
            decoder, prompts.input_ids.tolist(), prompts.attention_mask.tolist(), [7, 8], torch.rand(prompts.input_ids.shape)
        )


def test_scores_given_in_the_masks_place_are_named(setup):
    """Scores and the mask have one shape: given swapped, the model read the scores as a
    mask and the metric ranked the mask's ones, with no error."""
    from lm_models import make_decoder, make_prompts

    from captum_attention.metrics import datamodeling_score, top_k_log_prob_drop

    model, batch = setup
    scores = torch.randn(batch.input_ids.shape)
    swapped = r"^attention_mask holds values other than 0 and 1 \(e\.g\. .*\): .*are attention_mask and attributions swapped\?"
    for metric in (comprehensiveness, datamodeling_score):
        with pytest.raises(ValueError, match=swapped):
            metric(model, batch.input_ids, scores, batch.attention_mask, target=1)
        metric(model, batch.input_ids, batch.attention_mask.float(), scores, target=1)  # a float mask of 0 and 1 reads alike
    decoder, prompts = make_decoder("llama"), make_prompts(side="left")
    with pytest.raises(ValueError, match=swapped):
        top_k_log_prob_drop(decoder, prompts.input_ids, torch.randn(prompts.input_ids.shape), torch.tensor([[7]]), prompts.attention_mask)
