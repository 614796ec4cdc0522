"""Token-removal faithfulness, agreement and plausibility against hand computations."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from conftest import make_batch, make_model
from removal_reference import comprehensiveness_alone
from scipy import stats
from torch import nn

from captum_attention.metrics import (
    ablated_probs,
    aopc,
    auprc,
    calibrated_attribution,
    comprehensiveness,
    context_averaged_attribution,
    datamodeling_score,
    greedy_deletion,
    iou_f1,
    kendall_tau,
    leave_one_out,
    perturbation_curve,
    spearman,
    sufficiency,
    pointing_game,
    token_f1,
)
from captum_attention.metrics.token_removal import shared_removals, with_padding_column

VOCAB, CLASSES = 12, 3


class BagOfTokens(nn.Module):
    """logits = Σ over real tokens of a per-token weight vector: a known function of the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.randn(VOCAB, CLASSES, generator=torch.Generator().manual_seed(0))
        self.weights[0] = 0.0  # token 0 (padding/baseline) contributes nothing

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.weights[ids] * mask[..., None]).sum(dim=1)


@pytest.fixture
def bag():
    model = BagOfTokens()
    ids = torch.tensor([[5, 3, 7, 1, 9, 2, 11, 4], [6, 8, 10, 2, 0, 0, 0, 0]])
    mask = (torch.arange(8)[None, :] < torch.tensor([[8], [4]])).long()
    target = model(ids, mask).argmax(1)
    contributions = model.weights[ids, target[:, None]] * mask  # the true per-token evidence
    return model, ids, mask, target, contributions


def _by_hand(model, ids, mask, target, removed_sets):
    """p(y|x) − p(y|x without the removed positions), one example at a time."""
    out = []
    for row, removed in removed_sets:
        kept = [i for i in range(int(mask[row].sum())) if i not in removed]
        logits = model.weights[ids[row, kept]].sum(0)
        full = model.weights[ids[row, : int(mask[row].sum())]].sum(0)
        out.append(full.softmax(-1)[target[row]] - logits.softmax(-1)[target[row]])
    return torch.stack(out)


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_comprehensiveness_and_sufficiency_by_hand(bag, removal):
    model, ids, mask, target, contributions = bag
    bins = (10, 25, 50, 100)
    comp = comprehensiveness(model, ids, mask, contributions, bins=bins, removal=removal, baseline_token_id=0)
    suff = sufficiency(model, ids, mask, contributions, bins=bins, removal=removal, baseline_token_id=0)
    expected_comp, expected_suff = [], []
    for row in range(2):
        n = int(mask[row].sum())
        order = contributions[row, :n].argsort(descending=True).tolist()
        for b in bins:
            top = set(order[: math.ceil(b / 100 * n)])
            expected_comp.append((row, top))
            expected_suff.append((row, set(range(n)) - top))
    torch.testing.assert_close(comp, _by_hand(model, ids, mask, target, expected_comp).view(2, -1))
    torch.testing.assert_close(suff, _by_hand(model, ids, mask, target, expected_suff).view(2, -1))
    torch.testing.assert_close(aopc(comp), comp.mean(-1))
    assert (comp[:, -1] > 0).all() and suff[:, -1].abs().max() < 1e-6  # all removed / all kept


def test_special_tokens_are_kept(bag):
    model, ids, mask, target, contributions = bag
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[:, 0] = True
    comp = comprehensiveness(model, ids, mask, contributions, bins=(100,), keep=keep)
    n = mask.sum(1)
    expected = _by_hand(model, ids, mask, target, [(r, set(range(1, int(n[r])))) for r in range(2)])
    torch.testing.assert_close(comp[:, 0], expected)


def test_deletion_on_a_transformer_equals_the_shortened_sentence():
    model = make_model("bert")
    batch = make_batch(model, lengths=(9, 6))
    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    scores = torch.arange(9.0).flip(0).expand(2, 9)  # remove the first tokens first
    comp = comprehensiveness(forward, batch.input_ids, batch.attention_mask, scores, target=1, bins=(34,))
    with torch.no_grad():
        for row, n in enumerate(batch.lengths):
            count = math.ceil(0.34 * n)
            ids = batch.input_ids[row : row + 1, :n]
            full = forward(ids, torch.ones_like(ids)).softmax(-1)[0, 1]
            short = forward(ids[:, count:], torch.ones_like(ids[:, count:])).softmax(-1)[0, 1]
            torch.testing.assert_close(comp[row, 0], full - short, atol=1e-6, rtol=1e-5)


def test_a_classifier_given_as_it_is_gets_the_mask_by_name():
    """GPT-2's classifier takes its cache second: the model itself as ``forward_func``
    gives what a function calling it by keyword gives."""
    import transformers as tf
    from constants import VOCAB

    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, num_labels=2)
    model = tf.GPT2ForSequenceClassification(config).eval()
    batch = make_batch(model, lengths=(9, 6))
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    scores = torch.arange(9.0).flip(0).expand(2, 9)
    expected = comprehensiveness(forward, batch.input_ids, batch.attention_mask, scores, target=1)
    torch.testing.assert_close(comprehensiveness(model, batch.input_ids, batch.attention_mask, scores, target=1), expected)


def _gpt2_classifier(pad_token_id: int) -> nn.Module:
    import transformers as tf
    from constants import VOCAB

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=pad_token_id, num_labels=2
    )
    return tf.GPT2ForSequenceClassification(config).eval()


def test_deleted_rows_are_padded_with_the_id_a_decoder_classifier_reads():
    """GPT-2's classifier reads the last token that is not its config.pad_token_id: the rows
    deletion shortens are padded with that id (the model's, the one the inputs are padded
    with, or ``pad_token_id``), so that each example is scored as it is alone; with a
    guessed id the model would misread, the deletions run in batches of one length, unpadded."""
    from captum_attention.metrics import METRICS, MetricContext

    model = _gpt2_classifier(pad_token_id=3)
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    ids = torch.randint(4, 40, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[0, :2] = True  # 7 removable tokens against 9: the rows keep 4 and 5 tokens, one row padded
    scores = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
    expected = comprehensiveness_alone(forward, ids, mask, scores, keep, 0.5, 1)
    by_model = comprehensiveness(model, ids, mask, scores, target=1, bins=(50,), keep=keep)
    torch.testing.assert_close(by_model[:, 0], expected, atol=1e-6, rtol=1e-5)
    given = comprehensiveness(forward, ids, mask, scores, target=1, bins=(50,), keep=keep, pad_token_id=3)
    torch.testing.assert_close(given[:, 0], expected, atol=1e-6, rtol=1e-5)
    registered = METRICS["comprehensiveness"].function(forward, ids, scores, (mask,), torch.ones(2).long(), MetricContext(model, keep))
    torch.testing.assert_close(registered, comprehensiveness(forward, ids, mask, scores, 1, keep=keep, pad_token_id=3).mean(dim=1))
    guessed = comprehensiveness(forward, ids, mask, scores, target=1, bins=(50,), keep=keep)  # pads with 0, which it reads
    torch.testing.assert_close(guessed[:, 0], expected, atol=1e-6, rtol=1e-5)  # each length in its own batch, unpadded
    padded_ids, padded_mask = ids.clone(), mask.clone()
    padded_ids[1, 7:], padded_mask[1, 7:] = 3, 0  # the inputs' own padding tells the id
    from_inputs = comprehensiveness(forward, padded_ids, padded_mask, scores, target=1, bins=(50,))
    no_keep = torch.zeros_like(keep)
    torch.testing.assert_close(from_inputs[:, 0], comprehensiveness_alone(forward, padded_ids, padded_mask, scores, no_keep, 0.5, 1))


def test_an_encoder_decoder_classifier_given_as_it_is_gets_its_mask_as_the_mask():
    """BART's classifier takes its mask second (its decoder's ids come from the input ids):
    the model itself as ``forward_func`` is scored as each example is alone, never with the
    mask where the decoder's ids go."""
    from constants import VOCAB

    model = make_model("bart")
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = 2  # the end of sequence it reads, kept
    mask = torch.ones_like(ids)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, -1] = True
    keep[0, :2] = True  # the rows keep 6 and 5 tokens: one padded
    scores = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))
    by_model = comprehensiveness(model, ids, mask, scores, target=1, bins=(50,), keep=keep)
    torch.testing.assert_close(by_model[:, 0], comprehensiveness_alone(forward, ids, mask, scores, keep, 0.5, 1), atol=1e-6, rtol=1e-5)


def test_a_forward_that_leaves_the_mask_out_deletes_as_each_example_alone(bag):
    """It reads the padding deletion would add: the example itself and its deletions run
    in batches of one length, unpadded."""
    model, ids, mask, target, _ = bag
    unmasked = lambda i, m: model(i, torch.ones_like(m))  # noqa: E731
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4))
    drops = comprehensiveness(unmasked, ids, mask, scores, target, bins=(50,), pad_token_id=5)[:, 0]
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(len(ids)):
        one = (ids[row : row + 1], mask[row : row + 1], scores[row : row + 1], keep[row : row + 1])
        expected = comprehensiveness_alone(unmasked, *one, 0.5, int(target[row]))
        torch.testing.assert_close(drops[row : row + 1], expected, atol=1e-6, rtol=1e-5)


def test_a_forward_that_reads_the_padding_faintly_deletes_as_each_example_alone(bag):
    """One column of padding after the first example moves its output by 3e-6, within the
    rounding allowed (1e-4), the padding its batch and deletions get by more: the check pads
    a shortened example to the batch's width, so each runs unpadded."""
    model, ids, mask, target, _ = bag
    model.weights[0] = torch.tensor([3e-4, -3e-4, 0.0])  # the padding id's faint weight
    unmasked = lambda i, m: model(i, torch.ones_like(m))  # noqa: E731
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4))
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for bins in [(50,), (10, 30, 60, 100)]:
        drops = comprehensiveness(unmasked, ids, mask, scores, target, bins=bins)
        for row in range(len(ids)):
            one = (ids[row : row + 1], mask[row : row + 1], scores[row : row + 1], keep[row : row + 1])
            expected = torch.stack([comprehensiveness_alone(unmasked, *one, k / 100, int(target[row])) for k in bins], dim=1)
            torch.testing.assert_close(drops[row : row + 1], expected, atol=1e-7, rtol=1e-6)


def test_a_single_examples_deletions_are_unpadded_where_the_padding_is_read(bag):
    """One example's deletions of several lengths share a batch: for a forward that leaves
    the mask out, each length runs alone."""
    model, ids, mask, target, _ = bag
    unmasked = lambda i, m: model(i, torch.ones_like(m))  # noqa: E731
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5))
    keep = torch.zeros_like(ids, dtype=torch.bool)
    bins = (10, 30, 60)
    drops = comprehensiveness(unmasked, ids[:1], mask[:1], scores[:1], target[:1], bins=bins, pad_token_id=5)
    expected = torch.stack([comprehensiveness_alone(unmasked, ids[:1], mask[:1], scores[:1], keep[:1], k / 100, int(target[0])) for k in bins], dim=1)
    torch.testing.assert_close(drops, expected, atol=1e-6, rtol=1e-5)


def test_the_half_contexts_of_a_decoder_classifier_are_padded_with_its_id():
    """Each example's half-context scores as alone, the contexts padded with the
    classifier's pad id; where the inputs hold no padding and no id is given, the guess
    0 is checked (a column of it moves GPT-2's scores) and refused."""
    from captum_attention import AttnLRP

    model = _gpt2_classifier(pad_token_id=3)
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    explainer = AttnLRP(forward, model=model)
    ids = torch.randint(4, 40, (3, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    prior = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))

    explain = lambda i, m: explainer.attribute(i, target=1, additional_forward_args=(m,))  # noqa: E731
    batched = context_averaged_attribution(explain, ids, mask, prior, pad_token_id=3)
    for row in range(3):
        alone = context_averaged_attribution(explain, ids[row : row + 1], mask[row : row + 1], prior[row : row + 1])
        torch.testing.assert_close(batched[row : row + 1], alone, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="token id 0 .* moves attribute_func's scores"):
        context_averaged_attribution(explain, ids, mask, prior)


def test_one_padded_example_whose_padding_is_read_scores_its_real_tokens_alone(bag):
    """A batch of one example given with its padding: where the model reads the padding,
    the example itself, as its deletions, is scored unpadded."""
    model, ids, mask, target, _ = bag
    model.weights[0] = torch.tensor([0.5, -0.5, 0.0])  # the padding id read by a forward without the mask
    unmasked = lambda i, m: model(i, torch.ones_like(m))  # noqa: E731
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(6))
    one = (ids[1:], mask[1:], scores[1:])
    drops = comprehensiveness(unmasked, *one, target[1:], bins=(50,))
    expected = comprehensiveness_alone(unmasked, *one, torch.zeros_like(ids[1:], dtype=torch.bool), 0.5, int(target[1]))
    torch.testing.assert_close(drops[:, 0], expected, atol=1e-6, rtol=1e-5)


def test_half_contexts_refuse_a_function_that_padding_moves_faintly(bag):
    """Padded inputs (a long and a short example) and a function that leaves the mask out,
    whose scores the padding moves faintly: within the 1e-3 of their scale allowed for one
    column, beyond it under the padding the first context's short row holds, which the
    check adds again: refused, where such contexts were scored padded, unchecked. The
    same function given the mask runs."""
    model = bag[0]
    model.weights[0] = torch.tensor([1e-3, 0.0, 0.0])  # the padding id's faint weight
    ids = torch.tensor([[5, 3, 7, 1, 9, 2, 11, 4, 6, 8, 10, 2, 3, 7, 9, 4], [6, 8] + [0] * 14])
    mask = (ids != 0).long()
    unmasked = lambda i, m: model(i, torch.ones_like(m)).softmax(-1)[:, :1] * m  # noqa: E731
    short = (ids[1:, :2], mask[1:, :2])
    one_column = unmasked(*with_padding_column(*short, 0))[:, :2] - unmasked(*short)
    assert 0 < float(one_column.abs().max()) < 1e-3 * float(unmasked(ids, mask).max())
    prior = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="token id 0 .* after a context's rows moves attribute_func's scores"):
        context_averaged_attribution(unmasked, ids, mask, prior)
    masked = lambda i, m: model(i, m).softmax(-1)[:, :1] * m  # noqa: E731
    assert context_averaged_attribution(masked, ids, mask, prior).isfinite().all()


def test_perturbation_curves_rank_a_faithful_attribution(bag):
    model, ids, mask, target, contributions = bag
    positive = perturbation_curve(model, ids, mask, contributions, most_relevant_first=True)
    negative = perturbation_curve(model, ids, mask, contributions, most_relevant_first=False)
    assert positive.target_prob.shape == (2, 10) and (positive.agreement[:, 0] == 1).all()
    assert (positive.auc_target_prob < negative.auc_target_prob).all()
    axis = positive.fractions
    manual = ((positive.target_prob[:, 1:] + positive.target_prob[:, :-1]) / 2 * (axis[1:] - axis[:-1])).sum(1)
    torch.testing.assert_close(positive.auc_target_prob, manual)


def test_leave_one_out_by_hand(bag):
    model, ids, mask, target, _ = bag
    importance = leave_one_out(model, ids, mask)
    for row in range(2):
        n = int(mask[row].sum())
        expected = _by_hand(model, ids, mask, target, [(row, {i}) for i in range(n)])
        torch.testing.assert_close(importance[row, :n], expected)
        assert (importance[row, n:] == 0).all()


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_ablated_probs_by_hand(bag, removal):
    model, ids, mask, target, _ = bag
    kept = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(3)) < 0.5
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[:, 0] = True  # never removed, whatever kept says
    probs = ablated_probs(model, ids, mask, kept, removal=removal, baseline_token_id=0, keep=keep)
    full = model(ids, mask).softmax(-1).gather(1, target[:, None])
    removed = [(row, {i for i in range(1, int(mask[row].sum())) if not kept[row, a, i]}) for row in range(2) for a in range(5)]
    torch.testing.assert_close(probs, full - _by_hand(model, ids, mask, target, removed).view(2, 5))
    with pytest.raises(ValueError, match="kept must be a bool tensor"):
        ablated_probs(model, ids, mask, kept[:, :, :4])


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_identical_removals_of_an_example_run_once_and_tie_exactly(bag, removal):
    """Two ablations that keep the same tokens of one example (frequent among a short
    text's random halves) are one row of one forward: their probabilities are the same
    number, as Spearman's ties need, whatever rows the batch's arithmetic puts them in."""
    model, ids, mask, target, _ = bag
    seen: list[int] = []

    def forward(ids, mask):
        seen.append(len(ids))
        return model(ids, mask)

    kept = torch.rand(2, 5, 8, generator=torch.Generator().manual_seed(3)) < 0.5
    kept[:, 3] = kept[:, 1]  # ablation 3 repeats ablation 1, in both examples
    kept[1, 4] = kept[0, 4]  # the same tokens kept of two examples are two rows
    probs = ablated_probs(forward, ids, mask, kept, removal=removal, baseline_token_id=0)
    removed = [(row, {i for i in range(int(mask[row].sum())) if not kept[row, a, i]}) for row in range(2) for a in range(5)]
    distinct = {(row, frozenset(tokens)) for row, tokens in removed}
    assert len(distinct) < 2 * 5 - 1 and seen[-1] == len(distinct)  # after the inputs as given (and a padding probe)
    assert bool((probs[:, 3] == probs[:, 1]).all())
    full = model(ids, mask).softmax(-1).gather(1, target[:, None])
    torch.testing.assert_close(probs, full - _by_hand(model, ids, mask, target, removed).view(2, 5))


def test_methods_scored_on_the_same_halves_share_their_forwards_and_keep_their_values(bag):
    """Within ``shared_removals``, the LDS of a second attribution reruns none of the
    seeded halves the first ran, and each value is the one computed alone."""
    model, ids, mask, _, _ = bag
    seen: list[int] = []

    def forward(ids, mask):
        seen.append(len(ids))
        return model(ids, mask)

    first, second = (torch.randn(ids.shape, generator=torch.Generator().manual_seed(seed)) for seed in (4, 5))
    alone = [datamodeling_score(forward, ids, mask, scores, per_example=True) for scores in (first, second)]
    forwards_alone = sum(seen)
    seen.clear()
    shared, counts = [], []
    with shared_removals():
        for scores in (first, second):
            seen.clear()
            shared.append(datamodeling_score(forward, ids, mask, scores, per_example=True))
            counts.append(sum(seen))
    assert counts[0] == forwards_alone / 2 and counts[1] == 2  # the padding probe's two rows alone
    for together, by_itself in zip(shared, alone):
        assert torch.equal(together, by_itself)


@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_datamodeling_score_by_hand(bag, removal, per_example):
    """The seeded half ablations drawn again (over the batch's padded shape, or with
    ``per_example`` each example's over its removable tokens from the CRC-32 of its
    tokens), each probability and each summed score by hand, and scipy's Spearman per
    example; with ``per_example`` the padded example alone scores the same."""
    model, ids, mask, target, _ = bag
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4))
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[:, 0] = True
    options = dict(num_ablations=6, seed=5, removal=removal, baseline_token_id=0)
    lds = datamodeling_score(model, ids, mask, scores, keep=keep, per_example=per_example, **options)
    drawn = torch.rand(2, 6, 8, generator=torch.Generator().manual_seed(5)) < 0.5
    full = model(ids, mask).softmax(-1).gather(1, target[:, None])
    for row in range(2):
        length = int(mask[row].sum())
        removable = range(1, length)
        if per_example:
            own_seed = zlib.crc32(ids[row, :length].numpy().astype("int64").tobytes(), 5)
            drawn[row] = False
            drawn[row, :, 1:length] = torch.rand(6, length - 1, generator=torch.Generator().manual_seed(own_seed)) < 0.5
        removed = [(row, {i for i in removable if not drawn[row, a, i]}) for a in range(6)]
        probs = full[row] - _by_hand(model, ids, mask, target, removed)
        predicted = [sum(float(scores[row, i]) for i in removable if drawn[row, a, i]) for a in range(6)]
        assert lds[row].item() == pytest.approx(stats.spearmanr(predicted, probs).statistic)
    if per_example:
        short = int(mask[1].sum())
        alone = datamodeling_score(model, ids[1:, :short], mask[1:, :short], scores[1:, :short], keep=keep[1:, :short],
                                   per_example=True, **options)
        assert alone[0].item() == pytest.approx(lds[1].item())


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_calibrated_attribution_by_hand(bag, removal):
    """The seeded half ablations drawn again, each logit-probability by hand, the surrogate
    solved as an augmented least-squares problem (rows sqrt(λ S²) for δ, sqrt(1e-9 λ S²)
    for b and α); the prior as it is where α is not positive (the first example's prior
    is its evidence reversed)."""
    model, ids, mask, target, contributions = bag
    prior = contributions * torch.tensor([[-1.0], [1.0]])
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[:, 0] = True
    scores = calibrated_attribution(model, ids, mask, prior, num_ablations=5, seed=2, ridge=0.3, removal=removal,
                                    baseline_token_id=0, keep=keep)
    full = model(ids, mask).softmax(-1).gather(1, target[:, None])
    scales = []
    for row in range(2):
        removable = list(range(1, int(mask[row].sum())))
        count = len(removable)
        own_seed = zlib.crc32(ids[row, : int(mask[row].sum())].numpy().astype("int64").tobytes(), 2)  # each example's alone
        drawn = torch.rand(5, count, generator=torch.Generator().manual_seed(own_seed)) < 0.5
        removed = [(row, {i for j, i in enumerate(removable) if not drawn[a, j]}) for a in range(5)]
        probs = (full[row] - _by_hand(model, ids, mask, target, removed)).double()
        y = probs.log() - (1 - probs).log()
        kept = drawn.double()
        p = prior[row, removable].double()
        design = torch.cat([torch.ones(5, 1, dtype=torch.float64), (kept @ p)[:, None], kept], dim=1)
        roots = torch.tensor([1e-9 * 0.3 * count**2] * 2 + [0.3 * count**2] * count, dtype=torch.float64).sqrt()
        solution = torch.linalg.lstsq(torch.cat([design, torch.diag(roots)]), torch.cat([y, torch.zeros(2 + count, dtype=torch.float64)])).solution
        scales.append(float(solution[1]))
        expected = solution[1] * p + solution[2:] if solution[1] > 0 else p
        torch.testing.assert_close(scores[row, removable], expected.float(), rtol=1e-4, atol=1e-5)
        assert bool((scores[row, [i for i in range(8) if i not in removable]] == 0).all())
    assert scales[0] < 0 < scales[1], scales  # both branches
    short = int(mask[1].sum())  # the second example alone, unpadded: the same draws, the same scores
    alone = calibrated_attribution(model, ids[1:, :short], mask[1:, :short], prior[1:, :short], target[1:], num_ablations=5, seed=2,
                                   ridge=0.3, removal=removal, baseline_token_id=0, keep=keep[1:, :short])
    torch.testing.assert_close(alone[0], scores[1, :short])
    with pytest.raises(ValueError, match="ridge positive"):
        calibrated_attribution(model, ids, mask, prior, ridge=0.0)
    with pytest.raises(ValueError, match="attributions of shape"):
        calibrated_attribution(model, ids, mask, prior[:, :4])


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_context_averaged_attribution_by_hand(bag, removal):
    """The seeded halves drawn again with their complements, each context's inputs built
    by hand and scored by a position-dependent attribution (the token's evidence times
    1 + its position / 10, so that a score mapped back to the wrong token shows), summed
    per token over the contexts that keep it; both sums and the prior as shares of their
    absolute totals. Each context is one call on the whole batch; deleted, the first is
    called once more with as much padding again (the check that padding leaves the scores
    of the real tokens alone)."""
    model, ids, mask, target, contributions = bag
    prior = contributions * torch.tensor([[0.5], [-2.0]]) + 0.1
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[:, 0] = True
    calls = []

    def positional(context_ids, context_mask):
        calls.append((context_ids.clone(), context_mask.clone()))
        evidence = model.weights[context_ids, target[:, None]] * context_mask
        return evidence * (1 + torch.arange(context_ids.shape[1]) / 10)

    scores = context_averaged_attribution(positional, ids, mask, prior, num_contexts=6, seed=2, removal=removal,
                                          baseline_token_id=0, keep=keep)
    if removal == "delete":
        (check_ids, check_mask), padding = calls.pop(1), int((calls[0][1] == 0).sum(dim=1).max())
        torch.testing.assert_close(check_ids, torch.cat([calls[0][0], torch.zeros(2, padding, dtype=ids.dtype)], dim=1))
        torch.testing.assert_close(check_mask, torch.cat([calls[0][1], torch.zeros(2, padding, dtype=mask.dtype)], dim=1))
    assert len(calls) == 6
    widths = [int(call[1].sum(dim=1).max()) if removal == "delete" else 8 for call in calls]  # deleted: no all-padding column
    assert [tuple(call[0].shape) for call in calls] == [(2, width) for width in widths]
    assert max(widths) < 8 or removal == "replace"
    for row in range(2):
        length = int(mask[row].sum())
        removable = list(range(1, length))
        own_seed = zlib.crc32(ids[row, :length].numpy().astype("int64").tobytes(), 2)
        drawn = torch.rand(3, len(removable), generator=torch.Generator().manual_seed(own_seed)) < 0.5
        summed = torch.zeros(8, dtype=torch.float64)
        for kept_of_removable in [*drawn, *~drawn]:
            kept = [0] + [i for i, k in zip(removable, kept_of_removable.tolist()) if k]
            position = {i: (place if removal == "delete" else i) for place, i in enumerate(kept)}
            for i in kept[1:]:
                summed[i] += float(model.weights[ids[row, i], target[row]]) * (1 + position[i] / 10)
        p = prior[row].double().clone()
        p[[i for i in range(8) if i not in removable]] = 0.0
        expected = summed / summed.abs().sum() + p / p.abs().sum()
        torch.testing.assert_close(scores[row], expected.float())
    short = int(mask[1].sum())  # the second example alone, unpadded: the same contexts, the same scores
    target = target[1:]  # what positional reads
    alone = context_averaged_attribution(positional, ids[1:, :short].clone(), mask[1:, :short].clone(), prior[1:, :short],
                                         num_contexts=6, seed=2, removal=removal, baseline_token_id=0, keep=keep[1:, :short])
    torch.testing.assert_close(alone[0], scores[1, :short])
    with pytest.raises(ValueError, match="num_contexts must be even"):
        context_averaged_attribution(positional, ids, mask, prior, num_contexts=3)
    with pytest.raises(ValueError, match="prior of shape"):
        context_averaged_attribution(positional, ids, mask, prior[:, :4])
    with pytest.raises(ValueError, match="attribute_func returned shape"):
        context_averaged_attribution(lambda i, m: positional(i, m)[:, :4], ids, mask, prior)
    with pytest.raises(ValueError, match="attribute_func returned shape .* for a context of shape"):  # the check's padding trimmed
        context_averaged_attribution(lambda i, m: positional(i, m)[:, : int(m.sum(dim=1).max())], ids, mask, prior)
    with pytest.raises(ValueError, match="attribute_func returned NaN or ±inf"):
        context_averaged_attribution(lambda i, m: positional(i, m) / 0.0, ids, mask, prior)
    with pytest.raises(ValueError, match="removal='replace' needs baseline_token_id"):
        context_averaged_attribution(positional, ids, mask, prior, removal="replace")


def test_datamodeling_score_is_one_for_the_true_additive_evidence(bag):
    """Two classes of a bag of tokens: the class's probability rises with the sum of the
    kept tokens' logit margins, so those margins predict every ablation's rank (1), and
    their opposite ranks them backwards (-1)."""
    model, ids, mask, _, _ = bag
    model.weights = model.weights[:, :2].contiguous()
    target = model(ids, mask).argmax(1)
    margins = (model.weights[ids, target[:, None]] - model.weights[ids, 1 - target[:, None]]) * mask
    margins[1, 5] = float("nan")  # padding: never removed, never summed
    lds = datamodeling_score(model, ids, mask, margins, target)
    assert lds.tolist() == pytest.approx([1.0, 1.0])
    assert datamodeling_score(model, ids, mask, -margins, target).tolist() == pytest.approx([-1.0, -1.0])
    with pytest.raises(ValueError, match="at least 3"):
        datamodeling_score(model, ids, mask, margins, num_ablations=2)
    with pytest.raises(ValueError, match="attributions of shape"):
        datamodeling_score(model, ids, mask, margins[:, :4])


class PairBag(BagOfTokens):
    """The bag, with 4 more on class 2 while tokens 5 and 3 are both present: a pair whose
    tokens count only together (removing either removes the bonus, then the other counts
    no more)."""

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        real = (mask != 0) & (ids != 0)
        both = ((ids == 5) & real).any(dim=1) & ((ids == 3) & real).any(dim=1)
        return (self.weights[ids] * real[..., None]).sum(dim=1) + 4.0 * both[:, None] * torch.tensor([0.0, 0.0, 1.0])


@pytest.mark.parametrize("removal", ["delete", "replace"])
def test_greedy_deletion_by_hand(bag, removal):
    """Each step removes the chosen tokens with each of the prior's remaining top
    candidates and keeps the one that lowers the target most; the rest follow the prior."""
    _, ids, mask, _, _ = bag
    model = PairBag()
    target = model(ids, mask).argmax(dim=1)
    prior = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4))
    prior[0, :2] += 1.0  # the pair among the first candidates: the second step must not take its other token
    keep = torch.zeros_like(mask, dtype=torch.bool)
    keep[0, 7] = keep[1, 3] = True
    rows_run = []

    def counted(batch_ids, batch_mask):
        rows_run.append(len(batch_ids))
        return model(batch_ids, batch_mask)

    def target_prob(row: int, removed: set[int]) -> float:
        kept = [i for i in range(int(mask[row].sum())) if i not in removed]
        return float(model(ids[row, kept][None], torch.ones(1, len(kept))).softmax(-1)[0, target[row]])

    ranking = greedy_deletion(counted, ids, mask, prior, candidates=(3, 3), removal=removal, baseline_token_id=0, keep=keep)
    for row in range(2):
        n = int(mask[row].sum())
        by_prior = sorted((i for i in range(n) if not keep[row, i]), key=lambda i: -float(prior[row, i]))
        chosen: list[int] = []
        for count in (3, 3):
            tried = [i for i in by_prior if i not in chosen][:count]
            chosen.append(min(tried, key=lambda i: target_prob(row, {*chosen, i})))
        order = ranking[row, :n].masked_fill(keep[row, :n], float("-inf")).argsort(descending=True)[: n - 1].tolist()
        assert order == chosen + [i for i in by_prior if i not in chosen]
        assert (ranking[row, n:] == 0).all()
    padding_check = 2 if removal == "delete" else 0  # the shortest example shortened, alone and padded on the right
    assert sum(rows_run) == 2 + padding_check + (3 + 3) + (3 + 2), "the whole input, then one forward per candidate left to try"
    with pytest.raises(ValueError, match="candidates must be"):
        greedy_deletion(model, ids, mask, prior, candidates=())
    with pytest.raises(ValueError, match="prior of shape"):
        greedy_deletion(model, ids, mask, prior[:, :4])


def test_removal_arguments_are_checked(bag):
    model, ids, mask, _, contributions = bag
    with pytest.raises(ValueError, match=r"bins are percentages in \(0, 100\]"):
        comprehensiveness(model, ids, mask, contributions, bins=(0, 10))
    with pytest.raises(ValueError, match="attributions of shape") as refused:
        comprehensiveness(model, ids, mask, contributions[:, :4])
    assert "embedding dimension" not in str(refused.value)
    per_dimension = contributions[..., None].expand(-1, -1, 16)  # as Captum's LayerIntegratedGradients gives them
    with pytest.raises(ValueError, match=r"\(2, 8, 16\), but the inputs are \(2, 8\).*per embedding dimension.*attributions\.sum\(-1\)"):
        comprehensiveness(model, ids, mask, per_dimension)
    with pytest.raises(ValueError, match="baseline_token_id"):
        sufficiency(model, ids, mask, contributions, removal="replace", baseline_token_id=None)


def test_agreement_against_scipy():
    generator = torch.Generator().manual_seed(0)
    first, second = torch.randn(3, 7, generator=generator), torch.randn(3, 7, generator=generator)
    include = torch.ones(3, 7, dtype=torch.bool)
    include[1, 5:] = False
    tau = kendall_tau(first, second, include)
    rho = spearman(first, second, include)
    assert tau[1] == pytest.approx(stats.kendalltau(first[1, :5], second[1, :5]).statistic)
    assert rho[0] == pytest.approx(stats.spearmanr(first[0], second[0]).statistic)
    assert kendall_tau(first, first).eq(1).all() and kendall_tau(first, -first).eq(-1).all()


def test_plausibility_by_hand():
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.2, 0.7]])
    rationale = torch.tensor([[True, False, True, True, False]])
    # top-3 = {0, 2, 4}; overlap {0, 2}: precision 2/3, recall 2/3
    assert token_f1(scores, rationale).item() == pytest.approx(2 / 3)
    # ranking 0, 2, 4, 3, 1: hits at ranks 1, 2, 4 -> AP = (1 + 1 + 3/4) / 3
    assert auprc(scores, rationale).item() == pytest.approx((1 + 1 + 0.75) / 3)
    # predicted spans [0,1) [2,3) [4,5); gold spans [0,1) [2,4): [0,1) matches, [2,3) has IOU 1/2 (not > 0.5)
    assert iou_f1(scores, rationale).item() == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    # the top token, 0, is in the rationale; two tied at the top, one in it: half a hit; no rationale: no game
    assert pointing_game(scores, rationale).item() == 1.0
    assert pointing_game(scores, ~rationale).item() == 0.0
    assert pointing_game(torch.tensor([[0.5, 0.9, 0.9]]), torch.tensor([[True, True, False]])).item() == 0.5
    assert pointing_game(scores, rationale, include=torch.tensor([[False, True, True, True, True]])).item() == 1.0  # 2 is next
    assert math.isnan(pointing_game(scores, torch.zeros_like(rationale)).item())


def test_a_text_pairs_token_types_follow_its_tokens_through_deletion(tmp_path):
    """``pair_token_types`` gives the tokenizer's token type ids of text pairs (padded on
    either side), and a forward that reads them so deletes a word of either text as
    tokenizing the shortened pair does."""
    from transformers import BertTokenizerFast

    from captum_attention.metrics import pair_token_types

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"a man sleeps person rests the dog".split()]))
    tokenizer = BertTokenizerFast(vocab=str(vocab))
    pairs = [("a man sleeps", "the person rests"), ("the dog", "a man")]
    for side in ("right", "left"):
        encoded = tokenizer(pairs, padding=True, padding_side=side, return_tensors="pt")
        types = pair_token_types(encoded["input_ids"], encoded["attention_mask"], tokenizer.sep_token_id)
        assert torch.equal(types, encoded["token_type_ids"] * encoded["attention_mask"])
    model = make_model("bert")
    encoded = tokenizer(pairs[:1], return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]

    def forward(i, m):
        return model(input_ids=i, attention_mask=m, token_type_ids=pair_token_types(i, m, tokenizer.sep_token_id)).logits

    special = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    for word, shortened in ((1, ("man sleeps", "the person rests")), (6, ("a man sleeps", "the rests"))):
        scores = torch.zeros(ids.shape).index_fill(1, torch.tensor([word]), 1.0)
        drop = comprehensiveness(forward, ids, mask, scores, target=1, bins=(10,), keep=special)
        with torch.no_grad():
            whole = model(**encoded).logits.softmax(-1)[0, 1]
            short = model(**tokenizer(*shortened, return_tensors="pt")).logits.softmax(-1)[0, 1]
        torch.testing.assert_close(drop[0, 0], whole - short, atol=1e-6, rtol=1e-5)


def test_one_logit_is_read_as_its_sigmoid():
    """A model with one logit (a binary classifier or reward model), or a forward with one
    score per example, is read as transformers' pipelines read it: its sigmoid, beside
    its complement where a metric compares distributions; a softmax over one logit would
    be 1 whatever the tokens, and every metric 0."""
    from transformers import BertConfig, BertForSequenceClassification

    from captum_attention.metrics import attention_erasure

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, num_labels=1,
        initializer_range=0.3,
    )).eval()
    batch = make_batch(model, lengths=(7, 5))
    ids, mask = batch.input_ids, batch.attention_mask
    scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    two_classes = lambda i, m: torch.cat([model(i, attention_mask=m).logits, torch.zeros(len(i), 1)], -1)  # noqa: E731
    expected = comprehensiveness(two_classes, ids, mask, scores, target=0)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(comprehensiveness(model, ids, mask, scores), expected)
    one_score = lambda i, m: model(i, attention_mask=m).logits[:, 0]  # noqa: E731
    torch.testing.assert_close(comprehensiveness(one_score, ids, mask, scores), expected)
    erased = attention_erasure(model, ids, scores > 0.5, (mask,))
    with torch.no_grad():
        own = model(ids, attention_mask=mask).logits.sigmoid()
    torch.testing.assert_close(erased.original, torch.cat([own, 1 - own], -1))



@pytest.mark.parametrize("problem", ["multi_label_classification", "regression"])
def test_a_model_whose_outputs_are_no_class_probabilities_is_refused_by_the_metrics(problem):
    """A multi-label model's labels each have their own sigmoid, a regression model's
    scores none: the metrics' softmax (or one logit's sigmoid) was read as their class
    probability without a word. They refuse it in one line; one label's logit, passed
    alone as the refusal says, is read as its sigmoid."""
    from transformers import BertConfig, BertForSequenceClassification

    from captum_attention.metrics import attention_erasure, decision_flip_fraction

    torch.manual_seed(0)
    labels = 3 if problem == "multi_label_classification" else 1
    model = BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, num_labels=labels,
        problem_type=problem, initializer_range=0.3,
    )).eval()
    batch = make_batch(model, lengths=(7, 5))
    ids, mask = batch.input_ids, batch.attention_mask
    scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    for metric in (lambda: comprehensiveness(model, ids, mask, scores, target=0),
                   lambda: sufficiency(model, ids, mask, scores, target=0),
                   lambda: attention_erasure(model, ids, scores > 0.5, (mask,)),
                   lambda: decision_flip_fraction(model, ids, scores, (mask,))):
        with pytest.raises(ValueError, match=rf"configured with problem_type '{problem}': a .*(sigmoid\)|no probabilities)\.$") as refused:
            metric()
        assert "\n" not in str(refused.value)
    label = lambda i, m: model(i, attention_mask=m).logits[:, 0]  # noqa: E731
    two_classes = lambda i, m: torch.stack([label(i, m), torch.zeros(len(i))], -1)  # noqa: E731
    torch.testing.assert_close(comprehensiveness(label, ids, mask, scores), comprehensiveness(two_classes, ids, mask, scores, target=0))


def test_a_forward_that_returns_probabilities_is_refused_by_the_metrics():
    """Captum's tutorials often end a forward in a softmax; the metrics put what the forward
    returns through a softmax, so probabilities were squeezed toward the uniform without a
    word. They are refused in one line; log-probabilities give the logits' results."""
    from captum_attention.metrics import attention_erasure

    model = make_model("bert")
    batch = make_batch(model, lengths=(7, 5))
    ids, mask = batch.input_ids, batch.attention_mask
    scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0))
    logits = lambda i, m: model(i, attention_mask=m).logits  # noqa: E731
    probabilities = lambda i, m: logits(i, m).softmax(-1)  # noqa: E731
    for metric in (lambda: comprehensiveness(probabilities, ids, mask, scores),
                   lambda: attention_erasure(probabilities, ids, scores > 0.5, (mask,), model=model)):
        with pytest.raises(ValueError, match=r"^forward_func returns probabilities \(every row is non-negative and sums to 1\)"):
            metric()
    log_probabilities = lambda i, m: logits(i, m).log_softmax(-1)  # noqa: E731
    torch.testing.assert_close(comprehensiveness(log_probabilities, ids, mask, scores), comprehensiveness(logits, ids, mask, scores))
