"""Context-attribution metrics: top-k log-probability drop, LDS and leave-one-out agreement,
checked against direct re-computations and on a model whose answer is known."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from conftest import assert_same_state, model_state
from lm_models import EXPLICIT_DECODERS, make_decoder, make_encoder_decoder, make_learned_position_decoder, make_prompts
from scipy import stats

from captum_attention import AttnLRP, GradSAM, UnsupportedModelError
from captum_attention.metrics import (
    METRICS,
    MetricContext,
    ablated_log_probs,
    attention_shares,
    calibrated_scores,
    context_averaged_scores,
    leave_one_out_agreement,
    leave_one_out_estimates,
    linear_datamodeling_score,
    random_ablations,
    top_k_log_prob_drop,
)

ANSWER = torch.tensor([[7, 8], [9, 10], [11, 12]])
SEGMENTS = torch.tensor([[-1, -1, -1, 0, 0, 1, 2], [-1, -1, -1, 0, 1, 1, 2], [-1, -1, -1, -1, -1, 0, 1]])
"""Segments of ``make_prompts(side="left")``: the padding and the first real tokens in none."""


def _log_prob(model, prompt: torch.Tensor, answer: torch.Tensor) -> float:
    """log p(answer | prompt) for one unpadded prompt, from the model directly."""
    ids = torch.cat([prompt, answer])[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(dim=-1)
    return float(logits.gather(1, answer[:, None]).sum())


def _assert_deleted_by_hand(model, prompts, kept: torch.Tensor, values: torch.Tensor) -> None:
    """``values[b, a]`` is log p(answer) of example b's prompt without the segments
    ``kept[b, a]`` leaves out (:data:`SEGMENTS`), each computed alone and unpadded."""
    for b in range(kept.shape[0]):
        real = prompts.real[b].nonzero().flatten()
        prompt, seg = prompts.input_ids[b, real], SEGMENTS[b, real]
        for a in range(kept.shape[1]):
            expected = _log_prob(model, prompt[(seg < 0) | kept[b, a][seg.clamp(min=0)]], ANSWER[b])
            assert values[b, a].item() == pytest.approx(expected, abs=1e-4)


def _case(seed: int = 0):
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    scores = torch.randn(prompts.input_ids.shape, generator=torch.Generator().manual_seed(seed))
    return model, prompts, scores


def test_top_k_drop_equals_removing_the_tokens_by_hand():
    model, prompts, scores = _case()
    drops = top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores, ks=(1, 2))
    for b in range(3):
        real = prompts.real[b].nonzero().flatten()
        prompt = prompts.input_ids[b, real]
        ranked = scores[b, real][1:].argsort(descending=True) + 1  # the first real token is never removed
        full = _log_prob(model, prompt, ANSWER[b])
        for column, k in enumerate((1, 2)):
            kept = [i for i in range(len(prompt)) if i not in ranked[:k].tolist()]
            expected = full - _log_prob(model, prompt[kept], ANSWER[b])
            assert drops[b, column].item() == pytest.approx(expected, abs=1e-4)


def test_loo_agreement_and_lds_equal_direct_recomputations():
    model, prompts, scores = _case(1)
    segments = SEGMENTS
    loo = leave_one_out_agreement(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores, segments)
    lds = linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores, segments, num_ablations=8, seed=3)
    generator = torch.Generator().manual_seed(3)
    kept_draws = torch.rand(3, 8, 3, generator=generator) < 0.5
    for b in range(3):
        real = prompts.real[b].nonzero().flatten()
        prompt, seg = prompts.input_ids[b, real], segments[b, real]
        count = int(seg.max()) + 1
        totals = torch.tensor([float(scores[b, real][seg == s].sum()) for s in range(count)])
        full = _log_prob(model, prompt, ANSWER[b])
        effects = [full - _log_prob(model, prompt[seg != s], ANSWER[b]) for s in range(count)]
        assert loo[b].item() == pytest.approx(stats.spearmanr(totals, effects).statistic, abs=1e-6)
        kept = kept_draws[b, :, :count]
        actual = [_log_prob(model, prompt[(seg < 0) | kept[a][seg.clamp(min=0)]], ANSWER[b]) for a in range(8)]
        predicted = (kept.double() * totals.double()).sum(dim=1)
        expected = stats.spearmanr(predicted, actual).statistic
        assert lds[b].item() == pytest.approx(expected, abs=1e-6, nan_ok=True)


def test_ablated_log_probs_delete_the_unkept_segments_by_hand_and_serve_the_random_ablations():
    model, prompts, _ = _case()
    segments = SEGMENTS
    kept = torch.rand(3, 4, 3, generator=torch.Generator().manual_seed(5)) < 0.5
    kept[:, 0] = True  # the whole prompt
    values = ablated_log_probs(model, prompts.input_ids, prompts.attention_mask, ANSWER, kept, segments)
    assert values.shape == (3, 4)
    _assert_deleted_by_hand(model, prompts, kept, values)
    drawn, log_probs, _ = random_ablations(model, prompts.input_ids, prompts.attention_mask, ANSWER, segments, num_ablations=4)
    again = ablated_log_probs(model, prompts.input_ids, prompts.attention_mask, ANSWER, drawn, segments)
    torch.testing.assert_close(again, log_probs)
    with pytest.raises(ValueError, match="kept must be a bool tensor"):
        ablated_log_probs(model, prompts.input_ids, prompts.attention_mask, ANSWER, kept[:, :, :2], segments)


def test_calibrated_scores_are_the_penalised_least_squares_fit_written_out():
    """The surrogate's fit, recomputed from the ablated prompts by hand and solved as an
    augmented least-squares problem (rows sqrt(λ S²) for δ, sqrt(1e-9 λ S²) for b and α);
    the prior as it is where the fit's α is not positive."""
    model, prompts, prior = _case(4)
    prior[1] = -prior[1]  # the ablations then contradict this example's prior
    segments = SEGMENTS
    scales = []
    scores = calibrated_scores(model, prompts.input_ids, prompts.attention_mask, ANSWER, prior, segments,
                               num_ablations=5, seed=7, ridge=0.5)
    for b in range(3):
        real = prompts.real[b].nonzero().flatten()
        prompt, seg = prompts.input_ids[b, real], segments[b, real]
        count = int(seg.max()) + 1
        p = torch.tensor([float(prior[b, real][seg == s].sum()) for s in range(count)], dtype=torch.float64)
        own_seed = zlib.crc32(torch.stack([prompt, seg], dim=-1).numpy().astype("int64").tobytes(), 7)  # each example's alone
        kept = (torch.rand(5, count, generator=torch.Generator().manual_seed(own_seed)) < 0.5).double()
        y = torch.tensor([_log_prob(model, prompt[(seg < 0) | kept[a].bool()[seg.clamp(min=0)]], ANSWER[b]) for a in range(5)],
                         dtype=torch.float64)
        design = torch.cat([torch.ones(5, 1, dtype=torch.float64), (kept @ p)[:, None], kept], dim=1)
        roots = torch.tensor([1e-9 * 0.5 * count**2] * 2 + [0.5 * count**2] * count, dtype=torch.float64).sqrt()
        solution = torch.linalg.lstsq(torch.cat([design, torch.diag(roots)]), torch.cat([y, torch.zeros(2 + count, dtype=torch.float64)])).solution
        scales.append(float(solution[1]))
        expected = solution[1] * p + solution[2:] if solution[1] > 0 else p
        got = torch.stack([scores[b, real][seg == s].sum() for s in range(count)]).double()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        sizes = torch.stack([(seg == s).sum() for s in range(count)])
        torch.testing.assert_close(scores[b, real][seg >= 0], (expected / sizes)[seg[seg >= 0]].float(), rtol=1e-4, atol=1e-5)
        assert bool((scores[b, real][seg < 0] == 0).all())
    assert min(scales) < 0 < max(scales), scales  # both branches
    for b in range(3):  # the same scores alone as in the padded batch
        real = prompts.real[b].nonzero().flatten()
        alone = calibrated_scores(model, prompts.input_ids[b, real][None], torch.ones(1, len(real), dtype=torch.long), ANSWER[b : b + 1],
                                  prior[b, real][None], segments[b, real][None], num_ablations=5, seed=7, ridge=0.5)
        torch.testing.assert_close(alone[0], scores[b, real], rtol=1e-4, atol=1e-5)


def test_each_examples_own_draws_do_not_depend_on_the_left_padding():
    """The default segments are the tokens' columns, which the left padding shifts: an
    example's own ablations (LDS per example, the calibrated scores, the half contexts)
    are the same alone and unpadded as in the padded batch."""
    model, prompts, scores = _case(2)
    scores = scores.abs()  # a prior the ablations fit (not kept as it is) in the first and last examples
    args = (prompts.input_ids, prompts.attention_mask, ANSWER, scores)
    lds = linear_datamodeling_score(model, *args, num_ablations=8, per_example=True)
    calibrated = calibrated_scores(model, *args, num_ablations=4)
    halves = context_averaged_scores(model, lambda ids, mask: ids.float().sin() * mask, *args)
    for b in range(3):
        real = prompts.real[b]
        alone = (prompts.input_ids[b, real][None], torch.ones(1, int(real.sum()), dtype=torch.long), ANSWER[b : b + 1], scores[b, real][None])
        assert linear_datamodeling_score(model, *alone, num_ablations=8, per_example=True)[0].item() == pytest.approx(lds[b].item(), abs=1e-6)
        torch.testing.assert_close(calibrated_scores(model, *alone, num_ablations=4)[0], calibrated[b, real], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(context_averaged_scores(model, lambda ids, mask: ids.float().sin() * mask, *alone)[0], halves[b, real])


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_context_averaged_scores_by_hand(family):
    """The seeded halves of the segments drawn again with their complements, each
    context's prompt built by hand and scored by a position-dependent attribution (a
    token's weight times 1 + its place among the real tokens / 10, so that a score mapped
    back to the wrong token shows), summed per token over the contexts that keep it; the
    sums and the prior as shares of their absolute totals. Each context is one call on the
    whole batch, padded as the model reads it (an encoder's source on the right)."""
    model = make_decoder("llama") if family == "llama" else make_encoder_decoder("t5")
    prompts = make_prompts(side="left")
    weights = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    prior = torch.randn(prompts.input_ids.shape, generator=torch.Generator().manual_seed(9))
    calls = []

    def positional(ids, mask):
        calls.append(mask.clone())
        return weights[ids] * (1 + (mask.cumsum(dim=1) - 1) / 10) * mask

    scores = context_averaged_scores(model, positional, prompts.input_ids, prompts.attention_mask, ANSWER, prior, SEGMENTS,
                                     num_contexts=6, seed=2)
    assert len(calls) == 6
    padded_side = 0 if family == "t5" else -1
    assert all(bool(mask[:, padded_side].all()) for mask in calls)
    for b in range(3):
        real = prompts.real[b].nonzero().flatten()
        prompt, seg = prompts.input_ids[b, real], SEGMENTS[b, real]
        count = int(seg.max()) + 1
        own_seed = zlib.crc32(torch.stack([prompt, seg], dim=-1).numpy().astype("int64").tobytes(), 2)
        drawn = torch.rand(3, count, generator=torch.Generator().manual_seed(own_seed)) < 0.5
        summed = torch.zeros(len(real), dtype=torch.float64)
        for kept_segments in [*drawn, *~drawn]:
            kept = [i for i in range(len(real)) if seg[i] < 0 or kept_segments[seg[i]]]
            for place, i in enumerate(kept):
                if seg[i] >= 0:
                    summed[i] += float(weights[prompt[i]]) * (1 + place / 10)
        p = prior[b, real].double().masked_fill(seg < 0, 0.0)
        expected = summed / summed.abs().sum() + p / p.abs().sum()
        torch.testing.assert_close(scores[b, real], expected.float())
        assert bool((scores[b][~prompts.real[b]] == 0).all())
        alone = context_averaged_scores(model, positional, prompt[None], torch.ones(1, len(real), dtype=torch.long), ANSWER[b : b + 1],
                                        prior[b, real][None], seg[None], num_contexts=6, seed=2)
        torch.testing.assert_close(alone[0], scores[b, real])
    args = (model, positional, prompts.input_ids, prompts.attention_mask, ANSWER)
    with pytest.raises(ValueError, match="num_contexts must be even"):
        context_averaged_scores(*args, prior, SEGMENTS, num_contexts=5)
    with pytest.raises(ValueError, match="attributions of shape"):
        context_averaged_scores(*args, prior[:, :4], SEGMENTS)
    with pytest.raises(ValueError, match="attribute_func returned shape"):
        context_averaged_scores(model, lambda i, m: positional(i, m)[:, :1], *args[2:], prior, SEGMENTS)
    with pytest.raises(ValueError, match="attribute_func returned NaN"):
        context_averaged_scores(model, lambda i, m: positional(i, m) / 0.0, *args[2:], prior, SEGMENTS)


@pytest.mark.parametrize("by_share", [False, True])
def test_leave_one_out_estimates_delete_the_priors_top_segments_by_hand_and_keep_the_first_order_rest(by_share):
    model, prompts, first_order = _case(5)
    prior = torch.randn(prompts.input_ids.shape, generator=torch.Generator().manual_seed(6))
    segments = SEGMENTS
    shares = torch.rand(3, 3, generator=torch.Generator().manual_seed(7)) if by_share else None
    args = (model, prompts.input_ids, prompts.attention_mask, ANSWER, first_order, prior, segments)
    scores = leave_one_out_estimates(*args, exact=2, shares=shares)
    for b in range(3):
        real = prompts.real[b].nonzero().flatten()
        prompt, seg = prompts.input_ids[b, real], segments[b, real]
        count = int(seg.max()) + 1
        magnitude = torch.tensor([float(prior[b, real][seg == s].sum()) for s in range(count)]).abs()
        if by_share:  # the first order is least sure where a segment holds much of a row's attention
            magnitude = magnitude / (1 - shares[b, :count])
        chosen = magnitude.argsort(descending=True)[:2].tolist()
        full = _log_prob(model, prompt, ANSWER[b])
        for s in range(count):
            got = scores[b, real][seg == s]
            if s in chosen:  # deleted by hand, spread evenly
                effect = full - _log_prob(model, prompt[seg != s], ANSWER[b])
                torch.testing.assert_close(got, torch.full_like(got, effect / len(got)), rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(got, first_order[b, real][seg == s])
        assert bool((scores[b, real][seg < 0] == 0).all()) and bool((scores[b][~prompts.real[b]] == 0).all())
    torch.testing.assert_close(leave_one_out_estimates(*args, exact=0), first_order.masked_fill(segments < 0, 0.0))
    every = leave_one_out_estimates(*args, exact=3)
    assert leave_one_out_agreement(model, prompts.input_ids, prompts.attention_mask, ANSWER, every, segments).min() > 0.999
    with pytest.raises(ValueError, match="exact must be"):
        leave_one_out_estimates(*args, exact=-1)
    with pytest.raises(ValueError, match="give attention_shares"):
        leave_one_out_estimates(*args, shares=torch.zeros(3, 4))


def _shares_by_hand(model, prompt: torch.Tensor, answer: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Each segment's largest Σ_{j ∈ s} A_ij over the layers, heads and rows i outside s of
    one unpadded prompt and its answer, from output_attentions."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = reference(torch.cat([prompt, answer])[None], output_attentions=True).attentions
    seg = torch.cat([seg, torch.full_like(answer, -1)])
    shares = torch.zeros(int(seg.max()) + 1)
    for s in range(len(shares)):
        for attn in attentions:
            held = attn[0][:, seg != s][..., seg == s].sum(dim=-1)  # (heads, rows outside s)
            shares[s] = max(float(shares[s]), float(held.max()))
    return shares


@pytest.mark.parametrize("capture", ["eager", "streaming"])
@pytest.mark.parametrize("family", ["llama", "gpt2", *EXPLICIT_DECODERS])
def test_attention_shares_are_the_segments_largest_row_sums_of_output_attentions(family, capture):
    model, prompts = make_decoder(family), make_prompts(side="left")
    before = model_state(model)
    shares = attention_shares(model, prompts.input_ids, prompts.attention_mask, ANSWER, SEGMENTS, capture=capture)
    assert_same_state(before, model_state(model))
    assert shares.shape == (3, 3)
    for b in range(3):
        real = prompts.real[b]
        expected = _shares_by_hand(model, prompts.input_ids[b, real], ANSWER[b], SEGMENTS[b, real])
        torch.testing.assert_close(shares[b, : len(expected)], expected, rtol=0, atol=1e-5)
        assert bool((shares[b, len(expected) :] == 0).all())
    default = attention_shares(model, prompts.input_ids, prompts.attention_mask, ANSWER, capture=capture)
    positions = torch.arange(7)  # the first example has no padding: every token its own segment but the first
    expected = _shares_by_hand(model, prompts.input_ids[0], ANSWER[0], positions.masked_fill(positions == 0, -1))
    torch.testing.assert_close(default[0], expected, rtol=0, atol=1e-5)


def test_attention_shares_refuse_an_encoder_decoder_in_one_line():
    import transformers as tf

    config = tf.T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="decoder-only"):
        attention_shares(tf.T5ForConditionalGeneration(config).eval(), ids, torch.ones_like(ids), torch.tensor([[8]]))


def test_an_example_scores_the_same_alone_and_in_a_padded_batch():
    """The top-k drop, and the LDS with ``per_example`` (each example's ablations drawn
    from its own seed): the same alone as in the padded batch."""
    model, prompts, scores = _case(2)
    together = top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores)
    own = dict(num_ablations=8, per_example=True)
    lds = linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores, SEGMENTS, **own)
    for b in range(3):
        real = prompts.real[b]
        one = (prompts.input_ids[b : b + 1, real], prompts.attention_mask[b : b + 1, real], ANSWER[b : b + 1])
        alone = top_k_log_prob_drop(model, *one, scores[b : b + 1, real])
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-4, rtol=1e-4)
        lds_alone = linear_datamodeling_score(model, *one, scores[b : b + 1, real], SEGMENTS[b : b + 1, real], **own)
        assert lds_alone.item() == pytest.approx(lds[b].item(), abs=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_forward_without_position_ids_scores_each_example_as_alone(family):
    """Deleting segments pads the prompts on the left. Llama's rotary positions are
    relative: a forward_func that gives it no position ids reads the padding as alone.
    GPT-2's are absolute: the padding would shift them, so such a forward_func's deletions
    run in batches of one length, unpadded; the model itself gets position ids that skip
    the padding. Either way each example scores as alone."""
    model, prompts = make_decoder(family), make_prompts(side="left")
    scores = torch.randn(prompts.input_ids.shape, generator=torch.Generator().manual_seed(2))
    plain = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    by_model = top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, ANSWER, scores, ks=(2,))
    for b in range(3):
        real = prompts.real[b]
        alone = top_k_log_prob_drop(model, prompts.input_ids[b : b + 1, real], prompts.attention_mask[b : b + 1, real],
                                    ANSWER[b : b + 1], scores[b : b + 1, real], ks=(2,))
        torch.testing.assert_close(by_model[b : b + 1], alone, atol=1e-4, rtol=1e-4)
    by_plain = top_k_log_prob_drop(plain, prompts.input_ids, prompts.attention_mask, ANSWER, scores, ks=(2,))
    torch.testing.assert_close(by_plain, by_model, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["roberta", "whisper", "bart", "xlm"])
def test_a_decoder_with_learned_positions_deletes_segments_as_by_hand(family):
    """Deleting segments pads the prompts on the left. RoBERTa, as a causal LM, counts
    positions from the ids past the padding, Whisper's decoder reads the position ids
    given: padded batches score each shortened prompt as alone. BART's decoder and XLM
    count them from the first column, given position ids or not: their deletions run in
    batches of one length, unpadded."""
    model, prompts = make_learned_position_decoder(family), make_prompts(side="left")
    kept = torch.rand(3, 4, 3, generator=torch.Generator().manual_seed(5)) < 0.5
    _assert_deleted_by_hand(model, prompts, kept, ablated_log_probs(model, prompts.input_ids, prompts.attention_mask, ANSWER, kept, SEGMENTS))


def test_a_forward_that_reads_the_padding_faintly_deletes_segments_as_by_hand():
    """Each column of padding moves the last example's answer a little (less than the
    rounding allowed under one column, more under the padding its batch and deletions
    get) and the first example's not at all: the check pads the shortest example's
    shortened prompt to the batch's width, so the deletions run unpadded."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")

    def faint(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        return logits + 0.005 * (mask == 0).sum(dim=1)[:, None, None] * (torch.arange(logits.shape[-1]) == ANSWER[2, 0])

    kept = torch.rand(3, 4, 3, generator=torch.Generator().manual_seed(5)) < 0.5
    _assert_deleted_by_hand(model, prompts, kept, ablated_log_probs(faint, prompts.input_ids, prompts.attention_mask, ANSWER, kept, SEGMENTS))


def test_the_contexts_of_several_examples_are_refused_for_a_model_that_reads_the_padding():
    """The contexts are explained as batches: padded where the examples keep different
    lengths, which BART's decoder reads. One example's contexts need no padding."""
    model, prompts = make_learned_position_decoder("bart"), make_prompts(side="left")
    prior = torch.rand(prompts.input_ids.shape, generator=torch.Generator().manual_seed(3))
    explain = lambda ids, mask: GradSAM(model).attribute(ids, additional_forward_args=(mask,))  # noqa: E731
    args = (prompts.input_ids, prompts.attention_mask, ANSWER, prior, SEGMENTS)
    with pytest.raises(UnsupportedModelError, match="reads a left-padded prompt otherwise .* give one example at a time"):
        context_averaged_scores(model, explain, *args, num_contexts=2)
    real = prompts.real[1]
    one = (prompts.input_ids[1:2, real], prompts.attention_mask[1:2, real], ANSWER[1:2], prior[1:2, real], SEGMENTS[1:2, real])
    scores = context_averaged_scores(model, explain, *one, num_contexts=2)
    assert scores.isfinite().all() and scores.abs().sum() > 0


def test_registered_for_generation_and_out_of_the_classifier_evaluation():
    from captum_attention.presentation.evaluate import metric_names

    model, prompts, scores = _case(3)
    context = MetricContext(model, keep=torch.zeros_like(prompts.real))
    for name in ("top_k_log_prob_drop", "lds", "loo_agreement"):
        spec = METRICS[name]
        assert spec.task == "generation" and name not in metric_names()
        values = spec.function(model, prompts.input_ids, scores, (prompts.attention_mask,), ANSWER, context)
        assert values.shape == (3,)


def test_bad_arguments_are_one_clear_error():
    model, prompts, scores = _case()
    args = (model, prompts.input_ids, prompts.attention_mask, ANSWER)
    with pytest.raises(ValueError, match="NaN"):
        top_k_log_prob_drop(*args, scores.masked_fill(prompts.real, float("nan")))
    with pytest.raises(ValueError, match="ks are numbers"):
        top_k_log_prob_drop(*args, scores, ks=(0,))
    with pytest.raises(ValueError, match="never removed"):
        leave_one_out_agreement(*args, scores, segments=torch.zeros_like(prompts.input_ids))
    with pytest.raises(ValueError, match="answer must be token ids"):
        top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, ANSWER[:, :0], scores)
    with pytest.raises(ValueError, match="at least 3"):
        linear_datamodeling_score(*args, scores, num_ablations=2)


@pytest.fixture(scope="module")
def recall():
    """The trained key-value recall model (cached) and held-out questions: the prompt is
    the pairs, ';' and the first asked key; the answer its value; the decisive token the
    asked key's pair."""
    from captum_attention.demo.recall import HELDOUT_SEED, load_recall_model, recall_batch

    model = load_recall_model(progress=False)
    batch = recall_batch(24, seed=HELDOUT_SEED)
    cut = int(batch.answer_positions[0, 0]) + 1
    prompts, answers = batch.input_ids[:, :cut], batch.answers[:, :1]
    segments = torch.full(prompts.shape, -1)
    segments[:, :4] = torch.arange(4)  # the pairs are the removable segments; ';' and the key stay
    return model, prompts, answers, segments, batch.decisive[:, 0, :cut]


def test_on_a_model_whose_answer_is_known_the_decisive_pair_matters_most(recall):
    model, prompts, answers, segments, decisive = recall
    mask = torch.ones_like(prompts)
    oracle = decisive.float()
    drop = top_k_log_prob_drop(model, prompts, mask, answers, oracle, ks=(1,), segments=segments)[:, 0]
    reverse = top_k_log_prob_drop(model, prompts, mask, answers, -oracle, ks=(1,), segments=segments)[:, 0]
    assert (drop > reverse).float().mean() >= 0.9, "removing the decisive pair costs more than removing another"
    lds = linear_datamodeling_score(model, prompts, mask, answers, oracle, segments)
    assert lds.nanmean() > 0.5
    span = AttnLRP(model).attribute_span(prompts, answers, additional_forward_args=(mask,))[:, : prompts.shape[1]]
    found = span.masked_fill(segments < 0, float("-inf")).argmax(dim=1) == decisive.int().argmax(dim=1)
    assert found.float().mean() >= 0.95, "AttnLRP's answer attribution points at the decisive pair"
    method_drop = top_k_log_prob_drop(model, prompts, mask, answers, span, ks=(1,), segments=segments)[:, 0]
    torch.testing.assert_close(method_drop[found], drop[found])


def test_a_model_that_takes_its_cache_second_is_called_by_keyword():
    """Bloom's forward is ``(input_ids, cache, attention_mask, ...)``: the ablations give
    the mask by name (positionally it was taken for the cache)."""
    import transformers as tf
    from constants import VOCAB

    torch.manual_seed(0)
    model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)).eval()
    prompts = make_prompts(side="left")
    kept = torch.ones(3, 2, 3, dtype=torch.bool)
    kept[:, 1, 0] = False
    _assert_deleted_by_hand(model, prompts, kept, ablated_log_probs(model, prompts.input_ids, prompts.attention_mask, ANSWER, kept, SEGMENTS))


def test_a_shared_scope_runs_each_set_of_ablations_once_with_the_values_of_each_call_alone(monkeypatch):
    """``shared_ablations`` (``evaluate``'s, per answer): three methods' LDS, leave-one-out
    agreement and the answer's log-probability run the whole prompt, LDS's ablations and
    the deletions once, not per method, and give what each call gives alone."""
    from captum_attention.metrics.context import answer_log_probs, shared_ablations

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    ids, mask = prompts.input_ids, prompts.attention_mask
    scores = [torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    rows = []
    forward = type(model).forward

    def counted(self, *args, **kwargs):
        rows.append(len(kwargs["input_ids"] if "input_ids" in kwargs else args[0]))
        return forward(self, *args, **kwargs)

    def metrics() -> list[torch.Tensor]:
        values = [answer_log_probs(model, ids, mask, ANSWER)]
        for attributions in scores:
            values.append(linear_datamodeling_score(model, ids, mask, ANSWER, attributions, SEGMENTS, per_example=True))
            values.append(leave_one_out_agreement(model, ids, mask, ANSWER, attributions, SEGMENTS))
        return values

    answer_log_probs(model, ids, mask, ANSWER)  # the model's verdicts on padding, kept per model
    monkeypatch.setattr(type(model), "forward", counted)
    alone, alone_rows = metrics(), sum(rows)
    rows.clear()
    with shared_ablations():
        shared = metrics()
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))
    assert sum(rows) < alone_rows / 2, (sum(rows), alone_rows)
    rows.clear()
    metrics()
    assert sum(rows) == alone_rows, "outside the scope, each call runs its own"


def test_an_answers_span_scores_given_whole_are_told_to_be_cut_to_the_prompt():
    """``attribute_span`` scores prompt and answer: given whole to a context metric, the
    refusal said only "one score per prompt token"."""
    from captum_attention import RawAttention

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    answer = torch.tensor([[7, 8]] * 3)
    span = RawAttention(model).attribute_span(prompts.input_ids, answer, additional_forward_args=(prompts.attention_mask,))
    width = prompts.input_ids.shape[1]
    with pytest.raises(ValueError, match=rf"an answer's span scores cover the prompt and the answer: give the prompt's, "
                                         rf"attributions\[:, :{width}\]\)\.$"):
        top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, answer, span, segments=SEGMENTS)
    top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, answer, span[:, :width], segments=SEGMENTS)


def test_answers_that_begin_with_the_bos_token_are_warned_of():
    """``tokenizer(answer).input_ids`` with a BOS-adding tokenizer: the context metrics scored
    the BOS's log-probability as the answer's first token."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    with_bos = torch.tensor([[model.config.bos_token_id, 8]] * 3)
    scores = torch.rand(prompts.input_ids.shape, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"^answer rows \[0, 1, 2\] begin with the model's BOS token"):
        top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, with_bos, scores, segments=SEGMENTS)


def test_answers_padded_after_their_ends_are_refused_in_one_line():
    """A batch of generated answers padded after their end-of-sequence tokens: the context
    metrics scored the padding's log-probabilities as the answer's."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    end = model.generation_config.eos_token_id
    padded = torch.tensor([[7, 8, 9], [9, end, end], [11, 12, end]])
    scores = torch.rand(prompts.input_ids.shape, generator=torch.Generator().manual_seed(0))
    for metric in (lambda: top_k_log_prob_drop(model, prompts.input_ids, prompts.attention_mask, padded, scores, segments=SEGMENTS),
                   lambda: linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, padded, scores, segments=SEGMENTS)):
        with pytest.raises(ValueError, match=r"^answer row 1 is padded after its end-of-sequence token \(position 1\)"
                           r".* \(answer\[1:2, :2\]\)\.$"):
            metric()
