"""Adversarial attention (Jain & Wallace §4) and adversarial keys, on models whose answer is known.

- A BERT layer whose attention output is zeroed cannot influence the output: the search
  must get near the largest divergence those rows allow, with the output unmoved.
- A readout whose decision hinges on one attended token cannot move its attention within
  ε: the divergence stays small although the rows allow nearly 1 bit.
The attention and key shifts returned are replayed independently (through an intervention,
and through a hook on BERT's key projection) to check the claims made about them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, make_batch, make_model, model_state, reference_attention
from lm_models import make_decoder, make_encoder_decoder, make_prompts
from plain_models import make_plain
from torch import nn

from captum_attention.capture import AttentionCapture, ModuleAdapter, ProbsIntervention, default_adapter
from captum_attention.metrics import adversarial_attention, adversarial_keys

LENGTHS = (14, 11, 5)
STEPS = 60


def _silenced_layer_model(layer: int = 0) -> nn.Module:
    model = make_model("bert")
    with torch.no_grad():
        model.bert.encoder.layer[layer].attention.output.dense.weight.zero_()
        model.bert.encoder.layer[layer].attention.output.dense.bias.zero_()
    return model


class _HingeReadout(nn.Module):
    """One attention readout over the tokens: token 1 scores 5, the others 0; token 1's
    value votes for class 0, every other token's for class 1. Attention puts ~0.97 on token
    1, and the decision's probability moves with that weight."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        decisive = input_ids == 1
        scores = torch.where(decisive, 5.0, 0.0)[:, None, :]
        weights = F.softmax(scores, dim=-1)
        values = torch.where(decisive[..., None], torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0]))
        return (weights @ values)[:, 0]


class _Hinge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.readout = _HingeReadout()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.readout(input_ids)


def _hinge():
    model = _Hinge().eval()
    adapter = ModuleAdapter([model.readout], probs="softmax", pooling=[model.readout])
    ids = torch.tensor([[4, 5, 1, 6, 7, 8], [1, 9, 4, 4, 5, 6]])
    return model, ids, adapter


def test_attention_that_cannot_matter_moves_nearly_as_far_as_possible():
    model = _silenced_layer_model()
    batch = make_batch(model, LENGTHS)
    before = model_state(model)
    found = adversarial_attention(model, batch.input_ids, (batch.attention_mask,), layers=[0], steps=STEPS)
    assert found.within_epsilon.all()
    assert (found.tvd <= 1e-5).all()
    assert (found.js_divergence >= 0.95 * found.js_bound).all(), (found.js_divergence, found.js_bound)
    assert (found.js_bound > 0.9).all()
    assert_same_state(before, model_state(model))


def test_attention_a_decision_hinges_on_cannot_move_within_epsilon():
    model, ids, adapter = _hinge()
    found = adversarial_attention(model, ids, adapter=adapter, epsilon=0.01, steps=STEPS)
    assert found.within_epsilon.all()
    assert (found.tvd <= 0.01).all()
    assert (found.js_bound > 0.9).all()
    assert (found.js_divergence < 0.1).all(), found.js_divergence


def _output_probs(model, inputs, extra, adapter=None, call=None, maps=None):
    """The output distribution (a language model's at the last position), with the call's
    probabilities replaced by ``maps`` if given."""
    def replace(index, attn, first_head, scores):
        return maps[:, first_head : first_head + attn.shape[1]].to(attn.dtype) if index == call else attn

    adapter = adapter or default_adapter(model)
    with torch.no_grad(), AttentionCapture(model, adapter, probes=[ProbsIntervention(replace)] if maps is not None else []):
        logits = adapter.keyword_forward(model)(*inputs, *extra)
    logits = getattr(logits, "logits", logits)
    return (logits[:, -1] if logits.dim() == 3 else logits).float().softmax(-1)


@pytest.mark.parametrize("kind", ["bert", "hinge", "llama"])
def test_returned_attention_replays_within_epsilon(kind):
    if kind == "hinge":
        model, ids, adapter = _hinge()
        extra, layer = (), 0
    elif kind == "llama":  # a sensitive model: the start next to its attention finds allowed points
        model, adapter, layer = make_decoder("llama"), None, 1
        prompts = make_prompts((7, 5), side="left")
        ids, extra = prompts.input_ids, (prompts.attention_mask,)
    else:
        model, adapter, layer = make_model("bert"), None, 1
        batch = make_batch(model, LENGTHS)
        ids, extra = batch.input_ids, (batch.attention_mask,)
    found = adversarial_attention(model, ids, extra, layers=[layer], adapter=adapter, steps=STEPS)
    assert found.within_epsilon.all() and (found.js_divergence > 0).all()
    original = _output_probs(model, (ids,), extra, adapter)
    replayed = _output_probs(model, (ids,), extra, adapter, layer, found.attention[0])
    tvd = 0.5 * (replayed - original).abs().sum(-1)
    torch.testing.assert_close(tvd, found.tvd, atol=1e-5, rtol=0)
    assert (tvd <= 0.01 + 1e-6).all()


def test_rows_query_moves_only_the_explained_row():
    model = make_model("bert")
    batch = make_batch(model, LENGTHS)
    found = adversarial_attention(model, batch.input_ids, (batch.attention_mask,), layers=[-1], rows="query", steps=10)
    attentions = reference_attention(model, batch).attentions
    moved = (found.attention[0] - attentions[-1]).abs().amax(dim=(1, 3))  # (B, Q)
    assert (moved[:, 1:] <= 1e-6).all() and (moved[:, 0] > 1e-3).all()


def test_adversarial_attention_is_deterministic_and_examples_are_independent():
    model = make_model("bert")
    batch = make_batch(model, (9, 9))
    options = dict(layers=[0, 2], heads=[1, 3], steps=20, seed=3)
    first = adversarial_attention(model, batch.input_ids, (batch.attention_mask,), **options)
    again = adversarial_attention(model, batch.input_ids, (batch.attention_mask,), **options)
    assert torch.equal(first.js_divergence, again.js_divergence)
    other = batch.input_ids.clone()
    other[1, 1:8] = torch.arange(10, 17)
    changed = adversarial_attention(model, other, (batch.attention_mask,), **options)
    torch.testing.assert_close(changed.js_divergence[0], first.js_divergence[0], atol=1e-4, rtol=0)
    untouched = [h for h in range(4) if h not in (1, 3)]
    attentions = reference_attention(model, batch).attentions
    assert (found_diff := (first.attention[0][:, untouched] - attentions[0][:, untouched]).abs().max()) <= 1e-6, found_diff


@pytest.mark.parametrize("kind", ["decoder, a query row per example", "encoder-decoder pair"])
def test_each_example_of_a_batch_gets_what_it_gets_alone(kind):
    """The starts run side by side on copies of the batch: every copy must carry its own
    example's inputs, mask and explained row; and each example's start noise is drawn
    from its own tokens and the places of its real rows and keys, so its search is the
    same in a left-padded batch as alone."""
    if kind == "encoder-decoder pair":
        model = make_encoder_decoder("bart")
        source, target = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 11, 12, 2]]), torch.tensor([[2, 5, 6], [2, 7, 8]])
        inputs, extra, query_index = (source, target), None, None
        alone = [((source[b : b + 1], target[b : b + 1]), None, None) for b in range(2)]
    else:
        model = make_decoder("llama")
        prompts = make_prompts((7, 5, 6), side="left")
        inputs, extra, query_index = prompts.input_ids, (prompts.attention_mask,), torch.tensor([3, 5, 4])
        alone = [(prompts.input_ids[b : b + 1], (prompts.attention_mask[b : b + 1],), int(query_index[b])) for b in range(3)]
    options = dict(layers=[0, -1], steps=15, epsilon=0.2, rows="query" if query_index is not None else "all")
    together = adversarial_attention(model, inputs, extra, query_index=query_index, **options)
    for b, (one_inputs, one_extra, one_query) in enumerate(alone):
        single = adversarial_attention(model, one_inputs, one_extra, query_index=one_query, **options)
        assert single.js_divergence.item() > 1e-3, "the search should move the attention"
        torch.testing.assert_close(together.js_divergence[b : b + 1], single.js_divergence, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together.tvd[b : b + 1], single.tvd, atol=1e-5, rtol=1e-4)


def _bert_with_key_shift(model, ids, mask, layer, shift):
    """Logits with ``shift`` (B, H, K, D) added to the keys of one BERT layer, through a
    hook on its key projection (not the library's interception)."""
    key = model.bert.encoder.layer[layer].attention.self.key
    flat = shift.transpose(1, 2).reshape(shift.shape[0], shift.shape[2], -1)
    hook = key.register_forward_hook(lambda module, args, output: output + flat)
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits
    finally:
        hook.remove()


def test_key_shifts_keep_the_decision_when_replayed():
    model = make_model("bert")
    batch = make_batch(model, LENGTHS)
    before = model_state(model)
    moved = adversarial_keys(model, batch.input_ids, (batch.attention_mask,), layers=[1], steps=STEPS)
    assert moved.decision_kept.all()
    shift = moved.key_shifts[0]
    torch.testing.assert_close(shift.flatten(1).norm(dim=1), moved.distance, rtol=1e-4, atol=0)
    for b, n in enumerate(batch.lengths):
        assert (shift[b, :, n:] == 0).all(), "padding keys do not move"
    with torch.no_grad():
        decision = model(batch.input_ids, attention_mask=batch.attention_mask).logits.argmax(-1)
    replayed = _bert_with_key_shift(model, batch.input_ids, batch.attention_mask, 1, shift)
    assert torch.equal(replayed.argmax(-1), decision)
    assert (moved.relative_distance > 0.5).all()
    assert_same_state(before, model_state(model))


def test_keys_of_grouped_query_decoders_move_per_key_head():
    model = make_decoder("llama")
    prompts = make_prompts((7, 5), side="left")
    moved = adversarial_keys(model, prompts.input_ids, (prompts.attention_mask,), layers=[0], heads=[1], steps=10)
    shift = moved.key_shifts[0]
    assert shift.shape[1] == 2  # key heads, not query heads
    assert (shift[:, 0] == 0).all() and (shift[:, 1].abs().sum(dim=(1, 2)) > 0).all()
    assert (shift[~prompts.real.unsqueeze(1).expand(-1, 2, -1)] == 0).all()
    again = adversarial_keys(model, prompts.input_ids, (prompts.attention_mask,), layers=[0], heads=[1], steps=10)
    assert torch.equal(moved.distance, again.distance)
    for b in range(2):  # each example's start is drawn from its own tokens: the same search alone
        real = prompts.real[b]
        alone = adversarial_keys(
            model, prompts.input_ids[b : b + 1, real], (prompts.attention_mask[b : b + 1, real],), layers=[0], heads=[1], steps=10
        )
        torch.testing.assert_close(alone.distance, moved.distance[b : b + 1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(alone.key_shifts[0], moved.key_shifts[0][b : b + 1, :, real], atol=1e-5, rtol=1e-4)


def test_bad_options_get_clear_errors():
    model = make_model("bert")
    batch = make_batch(model, LENGTHS)
    args = (model, batch.input_ids, (batch.attention_mask,))
    with pytest.raises(ValueError, match="epsilon"):
        adversarial_attention(*args, epsilon=0.0)
    with pytest.raises(ValueError, match="steps"):
        adversarial_attention(*args, steps=0)
    with pytest.raises(ValueError, match="rows"):
        adversarial_attention(*args, rows="keys")
    with pytest.raises(ValueError, match="heads"):
        adversarial_attention(*args, heads=[7])
    with pytest.raises(ValueError, match="alpha"):
        adversarial_keys(*args, alpha=1.0)
    with pytest.raises(ValueError, match="key heads"):
        adversarial_keys(*args, heads=[4])
    plain = make_plain("mha")
    with pytest.raises(ValueError, match="streaming"):
        adversarial_keys(plain, batch.input_ids, (batch.attention_mask,))


def test_attention_with_sinks_is_refused_in_one_line_and_the_model_left_as_found():
    """gpt-oss's softmax holds a sink column after the keys, which shifting the keys'
    logits does not model: refused, with the model as it was."""
    from captum_attention import UnsupportedModelError

    model, prompts = make_decoder("gpt_oss"), make_prompts(side="left")
    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match="attention sinks") as refusal:
        adversarial_attention(model, prompts.input_ids, (prompts.attention_mask,), layers=[0], steps=2)
    assert "\n" not in str(refusal.value)
    assert_same_state(before, model_state(model))
