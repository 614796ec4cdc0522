"""Effective attention and identifiability (Brunner et al., ICLR 2020).

The defining property is tested against the model itself: every attention call's
probabilities replaced by their effective attention (through the capture's intervention)
must leave every attention module's output and the logits unchanged. The projection is
checked against T built independently from the model's weights and hidden states (numpy's
pseudo-inverse, per example, head and row), and the methods' effective variants against a
re-computation from ``output_attentions`` and ``autograd.grad``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import assert_same_state, assert_scores_close, make_batch, make_model, model_state, reference_attention
from lm_models import make_decoder, make_encoder_decoder, make_prompts, make_vision
from plain_models import make_plain

from captum_attention import GradSAM, RawAttention
from captum_attention.attr._base import with_effective_attention
from captum_attention.capture import AttentionCapture, ModuleAdapter, ProbsIntervention, ValueRecorder, default_adapter
from captum_attention.capture.inputs import output_logits
from captum_attention.capture.record import record_forward
from captum_attention.metrics import identifiability

LONG = (14, 11, 5)  # longer than the tiny models' 8 value dimensions: not identifiable


def _case(kind: str):
    """(model, inputs, extra, adapter) with padding, for each kind of attention."""
    if kind in ("bert", "distilbert"):
        model = make_model(kind)
        batch = make_batch(model, LONG)
        return model, (batch.input_ids,), (batch.attention_mask,), None
    if kind in ("gpt2", "llama"):
        prompts = make_prompts(LONG, side="left")
        return make_decoder(kind), (prompts.input_ids,), (prompts.attention_mask,), None
    if kind == "t5":
        source, target = make_prompts(LONG, side="right"), make_prompts((6, 4, 6), side="right", seed=2)
        return make_encoder_decoder("t5"), (source.input_ids, target.input_ids), (source.attention_mask, target.attention_mask), None
    if kind == "vit":
        return make_vision("vit"), (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)),), (), None
    model = make_plain(kind)
    batch = make_batch(model, LONG)
    adapter = None
    if kind == "textbook":
        adapter = ModuleAdapter(list(model.blocks), probs="softmax")
    return model, (batch.input_ids,), (batch.attention_mask,), adapter


def _outputs(model, inputs, extra, adapter, replacement=None):
    """The logits and every attention module's output, the probabilities of each call
    replaced by ``replacement[call]`` (heads sliced for modules with one softmax per head)."""
    adapter = adapter or default_adapter(model)
    seen = []

    def keep(module, args, output):
        seen.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    def replace(call, attn, first_head, scores):
        return replacement[call][:, first_head : first_head + attn.shape[1]].to(attn.dtype)

    hooks = [m.register_forward_hook(keep) for m in adapter.attention_modules(model)]
    try:
        with torch.no_grad(), AttentionCapture(model, adapter, probes=[ProbsIntervention(replace)] if replacement else []):
            output = adapter.keyword_forward(model)(*inputs, *extra)
    finally:
        for hook in hooks:
            hook.remove()
    return output_logits(output).detach(), seen


def _close(actual, expected, rel=1e-5):
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= rel * max(scale, 1e-12)


@pytest.mark.parametrize("kind", ["bert", "distilbert", "gpt2", "llama", "t5", "vit", "mha", "textbook"])
def test_effective_attention_leaves_every_output_unchanged(kind):
    model, inputs, extra, adapter = _case(kind)
    before = model_state(model)
    with torch.no_grad():
        record = record_forward(model, model, inputs, extra, adapter, probes=[ValueRecorder()])
    effective = with_effective_attention(record).attn_maps
    changed = max((e - a).abs().max().item() for e, a in zip(effective, record.attn_maps))
    assert changed > 1e-3, "the test needs attention that is not identifiable"
    logits, outputs = _outputs(model, inputs, extra, adapter)
    new_logits, new_outputs = _outputs(model, inputs, extra, adapter, effective)
    assert len(outputs) == len(new_outputs) == len(effective)
    for old, new in zip(outputs, new_outputs):
        _close(new, old)
    _close(new_logits, logits)
    assert_same_state(before, model_state(model))


def _bert_value_spaces(model, batch):
    """Per layer, (B, H, T, d) T = V·H from BERT's weights and hidden states, and the attention."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        out = ref(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True, output_attentions=True)
    spaces = []
    for layer, hidden in zip(ref.bert.encoder.layer, out.hidden_states):
        heads = ref.config.num_attention_heads
        values = layer.attention.self.value(hidden)
        batch_size, seq_len, width = values.shape
        values = values.view(batch_size, seq_len, heads, width // heads).transpose(1, 2)
        weight = layer.attention.output.dense.weight  # (out, heads * d_v)
        slices = weight.view(weight.shape[0], heads, width // heads).permute(1, 2, 0)  # (H, d_v, out)
        spaces.append((values.double() @ slices.double()).detach())
    return spaces, [a.detach() for a in out.attentions]


def _projected(rows: np.ndarray, space: np.ndarray) -> np.ndarray:
    """``rows`` projected onto the column space of ``space`` (numpy's pseudo-inverse)."""
    return rows @ (space @ np.linalg.pinv(space)).T


def test_effective_attention_is_the_projection_onto_the_value_space():
    model = make_model("bert")
    batch = make_batch(model, LONG)
    spaces, attentions = _bert_value_spaces(model, batch)
    with torch.no_grad():
        record = record_forward(model, model, (batch.input_ids,), (batch.attention_mask,), probes=[ValueRecorder()])
    effective = with_effective_attention(record).attn_maps
    for space, attn, eff in zip(spaces, attentions, effective):
        for b, n in enumerate(batch.lengths):
            for h in range(attn.shape[1]):
                t = space[b, h, :n].double().numpy()
                a = attn[b, h, :n, :n].double().numpy()
                expected = _projected(a, t)
                np.testing.assert_allclose(eff[b, h, :n, :n].double().numpy(), expected, atol=1e-5)
                removed = a - eff[b, h, :n, :n].double().numpy()
                # the removed part lies in the left null space of T: it changes no output
                assert np.abs(removed @ t).max() <= 1e-5 * np.abs(a @ t).max()
                if n > np.linalg.matrix_rank(t):  # more keys than T has dimensions: not identifiable
                    assert np.abs(removed).max() > 1e-3
                else:  # identifiable: nothing to remove
                    assert np.abs(removed).max() <= 1e-5
                assert (eff[b, h, :, n:] == 0).all(), "padding keys keep no weight"


def test_causal_rows_are_projected_over_the_keys_they_see():
    model = make_decoder("gpt2")
    prompts = make_prompts(LONG, side="left")
    with torch.no_grad():
        record = record_forward(model, model, (prompts.input_ids,), (prompts.attention_mask,), probes=[ValueRecorder()])
        ref = copy.deepcopy(model)
        ref.set_attn_implementation("eager")
        position_ids = (prompts.attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = ref(prompts.input_ids, attention_mask=prompts.attention_mask, position_ids=position_ids,
                  output_hidden_states=True, output_attentions=True)
    effective = with_effective_attention(record).attn_maps
    block, hidden, attn, eff = ref.transformer.h[1], out.hidden_states[1], out.attentions[1], effective[1]
    width, heads = hidden.shape[-1], ref.config.n_head
    values = block.attn.c_attn(block.ln_1(hidden)).split(width, dim=2)[2]
    values = values.view(*values.shape[:2], heads, width // heads).transpose(1, 2).detach()
    slices = block.attn.c_proj.weight.detach().view(heads, width // heads, width)  # Conv1D: (in, out)
    for b, real in enumerate(prompts.real):
        keys = real.nonzero().flatten().numpy()
        for h in range(heads):
            t = (values[b, h].double() @ slices[h].double()).numpy()
            for i in keys:
                seen = keys[keys <= i]
                expected = _projected(attn[b, h, i, seen].double().numpy()[None], t[seen])[0]
                np.testing.assert_allclose(eff[b, h, i, seen].double().numpy(), expected, atol=1e-5)
                assert (eff[b, h, i, keys[keys > i]] == 0).all()


def _bert_reference_effective(model, batch, target):
    """Effective attention from numpy's pseudo-inverse, with dS/dA from output_attentions."""
    spaces, _ = _bert_value_spaces(model, batch)
    ref = reference_attention(model, batch, target)
    effective = []
    for space, attn in zip(spaces, ref.attentions):
        eff = torch.zeros_like(attn, dtype=torch.float64)
        for b, n in enumerate(batch.lengths):
            for h in range(attn.shape[1]):
                eff[b, h, :n, :n] = torch.from_numpy(
                    _projected(attn[b, h, :n, :n].double().numpy(), space[b, h, :n].double().numpy())
                )
        effective.append(eff)
    return effective, ref.grads


def test_effective_raw_attention_and_grad_sam_match_a_direct_recomputation():
    model = make_model("bert")
    batch = make_batch(model, LONG)
    effective, grads = _bert_reference_effective(model, batch, target=1)
    lengths, layers, heads = batch.lengths, len(effective), effective[0].shape[1]
    raw = torch.zeros(len(lengths), max(lengths), dtype=torch.float64)
    grad_sam = torch.zeros_like(raw)
    for b, n in enumerate(lengths):
        raw[b, :n] = effective[1][b, :, 0, :n].mean(0)
        for eff, grad in zip(effective, grads):
            grad_sam[b, :n] += (eff[b, :, :n, :n] * grad[b, :, :n, :n].double().clamp(min=0)).sum(dim=(0, 2))
        grad_sam[b, :n] /= layers * heads * n
    extra = (batch.attention_mask,)
    before = model_state(model)
    assert_scores_close(RawAttention(model).attribute(batch.input_ids, additional_forward_args=extra, layer=1, effective=True), raw.float())
    actual = GradSAM(model).attribute(batch.input_ids, target=1, additional_forward_args=extra, effective=True)
    assert_scores_close(actual, grad_sam.float())
    assert not torch.allclose(actual, GradSAM(model).attribute(batch.input_ids, target=1, additional_forward_args=extra))
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("method", [RawAttention, GradSAM])
def test_effective_scores_are_padding_and_batch_invariant(method):
    model = make_model("bert")
    batch = make_batch(model, LONG)
    explainer = method(model)
    together = explainer.attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,), effective=True)
    for b, n in enumerate(batch.lengths):
        alone = explainer.attribute(batch.input_ids[b : b + 1, :n], target=1, effective=True)
        assert_scores_close(together[b : b + 1, :n], alone, rel=1e-4)
        assert (together[b, n:] == 0).all()


def test_effective_attention_needs_eager_capture():
    model = make_model("bert")
    batch = make_batch(model, LONG)
    with pytest.raises(ValueError, match="effective attention needs the values"):
        GradSAM(model, capture="streaming").attribute(batch.input_ids, target=1, effective=True)
    explainer = GradSAM(model)
    explainer.attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,), effective=True)
    assert explainer.last_capture.startswith("eager: effective attention")


def test_effective_continuation_matches_attribute_on_each_prefix():
    model = make_decoder("llama")
    prompts = make_prompts((6, 4), side="left")
    continuation = torch.tensor([[5, 7], [9, 11]])
    explainer = GradSAM(model)
    rows = explainer.attribute_continuation(prompts.input_ids, continuation, (prompts.attention_mask,), effective=True)
    for step in range(2):
        prefix = torch.cat([prompts.input_ids, continuation[:, :step]], dim=1)
        mask = torch.cat([prompts.attention_mask, torch.ones(2, step, dtype=torch.long)], dim=1)
        expected = explainer.attribute(prefix, target=continuation[:, step], additional_forward_args=(mask,), effective=True)
        assert_scores_close(rows[:, step, : prefix.shape[1]], expected, rel=1e-4)


def test_identifiability_counts_the_null_space():
    model = make_model("bert")
    batch = make_batch(model, LONG)
    report = identifiability(model, batch.input_ids, (batch.attention_mask,))
    lengths = torch.tensor(batch.lengths)
    assert report.head_dim == [8, 8, 8] and report.projected == [True] * 3
    for tokens, rank, null in zip(report.tokens, report.rank, report.null_dim):
        assert torch.equal(tokens, lengths)
        assert torch.equal(rank, lengths.clamp(max=8)[:, None].expand_as(rank))
        assert torch.equal(null, (lengths - 8).clamp(min=0)[:, None].expand_as(null))
    assert report.non_identifiable().tolist() == [1.0, 1.0, 0.0]


def test_identifiability_sees_a_rank_deficient_output_projection():
    """Head 0 of layer 1 writes through a rank-2 slice of the output projection: rank(T) is
    2 although its values have rank 8, as numpy's matrix_rank of T = V·H says."""
    model = make_model("bert")
    with torch.no_grad():
        dense = model.bert.encoder.layer[1].attention.output.dense.weight
        dense[:, 2:8] = 0.0
    batch = make_batch(model, LONG)
    spaces, _ = _bert_value_spaces(model, batch)
    report = identifiability(model, batch.input_ids, (batch.attention_mask,))
    for b, n in enumerate(batch.lengths):
        expected = np.linalg.matrix_rank(spaces[1][b, 0, :n].double().numpy())
        assert expected == 2
        assert report.rank[1][b, 0].item() == expected
        assert report.null_dim[1][b, 0].item() == n - 2


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mha", "vit"])
def test_every_family_names_its_output_projection(kind):
    model, inputs, extra, adapter = _case(kind)
    report = identifiability(model, inputs[0], extra, adapter=adapter)
    assert all(report.projected)
