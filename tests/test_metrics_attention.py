"""Attention erasure, decision flips, rankings and permutation, against derived values."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same_state, make_batch, make_model, model_state, reference_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from captum_attention import RawAttention
from captum_attention.maps import hashed_draws, permute_rows
from captum_attention.metrics import (
    attention_erasure,
    attention_permutation,
    attention_ranking,
    decision_flip_fraction,
    gradient_attention_ranking,
    gradient_ranking,
    permutation_accuracy,
    random_ranking,
)

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager


def _args(batch):
    return (batch.attention_mask,)


def test_erasing_nothing_changes_nothing():
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    result = attention_erasure(model, batch.input_ids, torch.zeros_like(batch.input_ids, dtype=torch.bool), _args(batch))
    assert result.js_divergence.abs().max() < 1e-9
    assert not result.flipped.any()
    assert_same_state(before, model_state(model))


def test_erasing_every_key_but_the_query_leaves_the_query_token_alone(family):
    # With attention one-hot on itself at every layer, [CLS] never mixes with other
    # tokens, so the output is the model's output on the one-token sequence [CLS].
    model = make_model(family)
    batch = make_batch(model)
    erased = torch.ones_like(batch.input_ids, dtype=torch.bool)
    erased[:, 0] = False
    result = attention_erasure(model, batch.input_ids, erased, _args(batch))
    with torch.no_grad():
        alone = model(batch.input_ids[:, :1], attention_mask=batch.attention_mask[:, :1]).logits.softmax(-1)
    torch.testing.assert_close(result.erased, alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(result.original, model(batch.input_ids, attention_mask=batch.attention_mask).logits.softmax(-1), atol=1e-5, rtol=1e-4)
    m = 0.5 * (result.original + alone)
    kl = lambda p, q: (p * (p / q).log2()).sum(-1)  # noqa: E731
    torch.testing.assert_close(result.js_divergence, 0.5 * kl(result.original, m) + 0.5 * kl(alone, m), atol=1e-6, rtol=1e-4)


def test_erasure_only_at_the_chosen_layers_and_heads():
    model = make_model("bert")
    batch = make_batch(model)
    erased = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    erased[:, 1:3] = True
    all_heads = attention_erasure(model, batch.input_ids, erased, _args(batch), layers=[0, 1, 2])
    by_default = attention_erasure(model, batch.input_ids, erased, _args(batch), heads=[0, 1, 2, 3])
    torch.testing.assert_close(all_heads.erased, by_default.erased)
    last_only = attention_erasure(model, batch.input_ids, erased, _args(batch), layers=-1)
    assert not torch.allclose(last_only.erased, all_heads.erased)
    with pytest.raises(ValueError, match=r"layers \[3\] do not exist: the model has 3 attention layers"):
        attention_erasure(model, batch.input_ids, erased, _args(batch), layers=3)
    with pytest.raises(ValueError, match="erased_keys has shape"):
        attention_erasure(model, batch.input_ids, erased[:, :4], _args(batch))


def test_erasure_is_padding_invariant():
    model = make_model("roberta")
    batch = make_batch(model, lengths=(9, 5))
    erased = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    erased[:, 2] = True
    together = attention_erasure(model, batch.input_ids, erased, _args(batch))
    alone = attention_erasure(model, batch.input_ids[1:, :5], erased[1:, :5], (batch.attention_mask[1:, :5],))
    torch.testing.assert_close(together.js_divergence[1:], alone.js_divergence, atol=1e-6, rtol=1e-4)


def _flip_by_loop(model, batch, ranking, keep):
    """Reference: one attention_erasure call per prefix, stopping at the first flip."""
    removed = []
    for row in range(len(ranking)):
        n = int(batch.attention_mask[row].sum())
        ids, mask = batch.input_ids[row : row + 1, :n], batch.attention_mask[row : row + 1, :n]
        order = [int(i) for i in ranking[row, :n].argsort(descending=True, stable=True) if not keep[row, i]]
        found = -1
        for k in range(1, min(len(order), n - 1) + 1):
            erased = torch.zeros(1, n, dtype=torch.bool)
            erased[0, order[:k]] = True
            if attention_erasure(model, ids, erased, (mask,)).flipped.item():
                found = k
                break
        removed.append(found)
    return torch.tensor(removed)


@pytest.mark.parametrize("max_batch_size", [64, 3])
def test_decision_flip_fraction_matches_a_step_by_step_loop(max_batch_size):
    model = make_model("bert", seed=3)
    batch = make_batch(model, lengths=(9, 7, 8, 6, 9, 5), seed=4)
    ranking = random_ranking(batch.input_ids.shape, seed=1)
    keep = torch.zeros_like(batch.input_ids, dtype=torch.bool)
    keep[:, 0] = True
    result = decision_flip_fraction(model, batch.input_ids, ranking, _args(batch), keep=keep, max_batch_size=max_batch_size)
    expected = _flip_by_loop(model, batch, ranking, keep)
    assert torch.equal(result.removed, expected)
    assert result.flipped.any() and not result.flipped.all(), "the test needs both outcomes"
    lengths = batch.attention_mask.sum(1)
    assert torch.equal(result.flipped, expected > 0)
    torch.testing.assert_close(result.fraction[result.flipped], (expected / lengths)[expected > 0])
    assert result.fraction[~result.flipped].isnan().all()
    assert result.attention_mass_removed[~result.flipped].isnan().all()
    assert (result.attention_mass_removed[result.flipped] > 0).all()


def _decoder_case():
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("gpt2", seed=2), make_prompts(lengths=(7, 6, 5, 7), side="left", seed=5)
    real = prompts.real

    def alone(row: int):
        kept = real[row]
        return prompts.input_ids[row : row + 1, kept], (prompts.attention_mask[row : row + 1, kept],), kept

    return model, prompts.input_ids, (prompts.attention_mask,), real, alone


def _encoder_decoder_case():
    from lm_models import make_encoder_decoder
    from test_encoder_decoder import SOURCE_MASK, TARGET_MASK, make_pair

    model, pair = make_encoder_decoder("bart", seed=1), make_pair(seed=4)
    real = SOURCE_MASK.bool()

    def alone(row: int):
        source, target = SOURCE_MASK[row].bool(), TARGET_MASK[row].bool()
        inputs = (pair.source[row : row + 1, source], pair.target[row : row + 1, target])
        return inputs, (SOURCE_MASK[row : row + 1, source], TARGET_MASK[row : row + 1, target]), source

    return model, (pair.source, pair.target), pair.args, real, alone


def _vision_case():
    from lm_models import make_vision

    model = make_vision("vit", seed=1)
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    real = torch.ones(3, 17, dtype=torch.bool)
    return model, pixels, None, real, lambda row: (pixels[row : row + 1], None, real[row])


@pytest.mark.parametrize("case", [_decoder_case, _encoder_decoder_case, _vision_case], ids=["decoder", "encoder-decoder", "vit"])
def test_decision_flips_of_every_family_match_a_step_by_step_loop(case):
    """As the BERT test above: the batched prefixes against one ``attention_erasure`` call
    per prefix on each example alone (a decoder's left padding, an encoder-decoder's source
    keys, a ViT's class and patch tokens)."""
    model, inputs, args, real, alone = case()
    ranking = random_ranking(real.shape, seed=3)
    result = decision_flip_fraction(model, inputs, ranking, args, max_batch_size=4)
    expected = []
    for row in range(len(real)):
        one_inputs, one_args, kept = alone(row)
        order = ranking[row, kept].argsort(descending=True, stable=True).tolist()
        n, found = len(order), -1
        for k in range(1, n):
            erased = torch.zeros(1, n, dtype=torch.bool)
            erased[0, order[:k]] = True
            if attention_erasure(model, one_inputs, erased, one_args).flipped.item():
                found = k
                break
        expected.append(found)
    assert result.removed.tolist() == expected
    assert result.flipped.any(), "the test needs a flip"


def test_rankings_against_the_reference():
    model = make_model("electra")
    batch = make_batch(model)
    ref = reference_attention(model, batch, target=1)
    attention = attention_ranking(model, batch.input_ids, _args(batch))
    torch.testing.assert_close(attention, RawAttention(model).attribute(batch.input_ids, additional_forward_args=_args(batch)))
    grad = gradient_ranking(model, batch.input_ids, target=1, additional_forward_args=_args(batch))
    grad_attn = gradient_attention_ranking(model, batch.input_ids, target=1, additional_forward_args=_args(batch), layer=0)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(grad, ref.grads[-1].mean(1)[:, 0] * real)
    torch.testing.assert_close(grad_attn, (ref.grads[0] * ref.attentions[0]).mean(1)[:, 0] * real)
    assert torch.equal(random_ranking((2, 5), seed=3), random_ranking((2, 5), seed=3))


def test_permutation_of_uniform_attention_changes_nothing():
    model = make_model("bert")
    uniform = copy.deepcopy(model)
    for layer in uniform.bert.encoder.layer:
        layer.attention.self.query.weight.data.zero_()
        layer.attention.self.query.bias.data.zero_()
    batch = make_batch(model)
    flat = attention_permutation(uniform, batch.input_ids, _args(batch), n_permutations=3)
    assert flat.median_tvd.max() < 1e-6 and flat.flip_rate.max() == 0
    moved = attention_permutation(model, batch.input_ids, _args(batch), n_permutations=3)
    assert moved.median_tvd.min() > 1e-4
    again = attention_permutation(model, batch.input_ids, _args(batch), n_permutations=3)
    torch.testing.assert_close(moved.median_tvd, again.median_tvd)  # seeded


def test_permutation_accuracy_over_a_data_set():
    model = make_model("distilbert")
    batches = []
    for seed in range(2):
        batch = make_batch(model, seed=seed)
        labels = torch.tensor([0, 1, 2])
        batches.append((batch.input_ids, batch.attention_mask, labels))
    accuracy = permutation_accuracy(model, batches, progress=False)
    assert set(accuracy) == {"original", "layer 0", "layer 1", "layer 2", "all layers"}
    with torch.no_grad():
        hits = sum(
            (model(ids, attention_mask=mask).logits.argmax(1) == labels).sum().item() for ids, mask, labels in batches
        )
    assert accuracy["original"] == hits / 6


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 5), st.integers(0, 2**16))
def test_permute_rows_keeps_each_rows_values(seq_len, pad, seed):
    generator = torch.Generator().manual_seed(seed)
    real = torch.arange(seq_len)[None, :] >= min(pad, seq_len - 1)  # left padding
    attn = torch.rand(1, 2, seq_len, seq_len, generator=generator) * real[:, None, None, :]
    draws = hashed_draws(seed, torch.arange(2)[:, None, None], torch.arange(seq_len)[:, None], torch.arange(seq_len))
    permuted = permute_rows(attn, real, draws[None])
    torch.testing.assert_close(permuted.sort(-1).values, attn.sort(-1).values)
    assert (permuted[..., ~real[0]] == 0).all()


def test_permute_rows_moves_each_seen_weight_to_the_place_of_its_draw():
    """Row by row: the seen keys' weights, ranked by their draws, fill the seen places in
    order; padding keeps its place."""
    attn = torch.tensor([[[[0.0, 0.1, 0.2, 0.7]]]])
    seen = torch.tensor([[False, True, True, True]])
    draws = torch.tensor([[[[0, 30, 10, 20]]]])  # seen keys by draw: 2, 3, 1
    assert torch.equal(permute_rows(attn, seen, draws), attn[..., [0, 2, 3, 1]])


def test_hashed_draws_give_every_permutation_alike():
    """Over 24,000 rows of 4 keys, each of the 24 orders turns up about 1,000 times (a
    chi-square of 23 degrees of freedom stays under 60 but for one case in 10^5), and the
    draws are the same from a second call and differ in every coordinate."""
    rows = torch.arange(24_000)[:, None]
    draws = hashed_draws(7, 3, rows, torch.arange(4))
    orders = draws.argsort(dim=-1)
    codes = (orders * torch.tensor([64, 16, 4, 1])).sum(-1)
    counts = torch.bincount(codes, minlength=256)[torch.unique(codes)]
    assert len(counts) == 24
    chi_square = ((counts - 1000.0) ** 2 / 1000.0).sum()
    assert chi_square < 60, chi_square
    assert torch.equal(draws, hashed_draws(7, 3, rows, torch.arange(4)))
    for other in (hashed_draws(8, 3, rows, torch.arange(4)), hashed_draws(7, 4, rows, torch.arange(4)), hashed_draws(7, 3, rows + 1, torch.arange(4))):
        assert (other != draws).float().mean() > 0.99
    assert draws.min() >= 0 and draws.max() < 2**32


def _uniform(model):
    """A copy of ``model`` whose queries are all zero: every attention row is uniform over
    the keys it sees (its real keys, and under a causal mask those up to it)."""
    uniform = copy.deepcopy(model)
    for name, module in uniform.named_modules():
        if name.rsplit(".", 1)[-1] in ("q_proj", "query") and isinstance(module, torch.nn.Linear):
            module.weight.data.zero_()
            if module.bias is not None:
                module.bias.data.zero_()
        if name.endswith("c_attn"):  # GPT-2's Conv1D, (in, 3 · hidden): the queries first
            hidden = module.weight.shape[1] // 3
            module.weight.data[:, :hidden] = 0
            module.bias.data[:hidden] = 0
    return uniform


@pytest.mark.parametrize("case", [_decoder_case, _encoder_decoder_case, _vision_case], ids=["decoder", "encoder-decoder", "vit"])
def test_permutation_stays_within_the_keys_each_row_sees(case):
    """Uniform rows (zero queries) are unchanged by any shuffle among the keys a row sees,
    so the output does not move: a shuffle that reached padding, a causal row's later keys
    or another sequence's keys would move it. The model itself moves."""
    model, inputs, args, _, _ = case()
    flat = attention_permutation(_uniform(model), inputs, args, n_permutations=3)
    assert flat.median_tvd.max() < 1e-6 and flat.flip_rate.max() == 0
    assert attention_permutation(model, inputs, args, n_permutations=3).median_tvd.min() > 1e-5


@pytest.mark.parametrize("case", [_decoder_case, _encoder_decoder_case, _vision_case], ids=["decoder", "encoder-decoder", "vit"])
def test_an_examples_permutations_do_not_depend_on_its_batch(case):
    """Each example explained alone, without padding, gets the permutations it gets in
    the padded batch (a decoder's left padding, an encoder-decoder's two sequences), so
    the same median TVD; a batch in the other order gives each example its own again."""
    model, inputs, args, real, alone = case()
    options = dict(layers=[0, -1], n_permutations=3, seed=5)
    batched = attention_permutation(model, inputs, args, **options)
    for row in range(len(real)):
        one_inputs, one_args, _ = alone(row)
        single = attention_permutation(model, one_inputs, one_args, **options)
        torch.testing.assert_close(single.median_tvd, batched.median_tvd[row : row + 1], atol=1e-6, rtol=1e-4)
    order = torch.arange(len(real)).flip(0)
    flipped = tuple(t[order] for t in inputs) if isinstance(inputs, tuple) else inputs[order]
    flipped_args = None if args is None else tuple(t[order] for t in args)
    reordered = attention_permutation(model, flipped, flipped_args, **options)
    torch.testing.assert_close(reordered.median_tvd, batched.median_tvd[order], atol=1e-6, rtol=1e-4)
