"""Inputs that once gave a plausible-looking wrong result now give the right one, a warning
or a clear error: half precision, non-finite inputs, a forward that runs the model twice,
a model whose forward is called directly (sentence-transformers'), an output pooled over
the tokens, padding without a mask, modules left in training mode, a bidirectional model's
logits at every position."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import (
    assert_same_state, assert_scores_close, make_batch, make_model, model_state, reference_attention, with_random_biases,
)
from constants import NUM_LABELS, VOCAB
from methods import reference_grad_sam
from torch import nn

from captum_attention import METHODS, UnsupportedModelError
from captum_attention.attr import REGISTRY
from captum_attention.maps import grad_sam_head_mean, relevance_head_mean

TARGET = 1


def _attribute(model, name, batch, capture="auto", **options):
    return METHODS[name](model, capture=capture).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,), **options
    )


@pytest.mark.parametrize("reduction", [grad_sam_head_mean, relevance_head_mean])
def test_head_reductions_of_half_precision_run_in_float32(reduction):
    attn = torch.full((1, 2, 3, 3), 1e-3, dtype=torch.float16)
    grad = torch.full((1, 2, 3, 3), 1e-5, dtype=torch.float16)
    assert not bool((attn * grad).any()), "the product underflows in float16"
    reduced = reduction(attn, grad)
    assert reduced.dtype == torch.float32
    torch.testing.assert_close(reduced, reduction(attn.float(), grad.float()))


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_half_precision_models_get_the_float32_scores(name, capture):
    """Logits scaled down as a confident model's gradients are: products of weights and
    gradients then underflow in float16, so every reduction must run in float32."""
    full, half = make_model("bert"), make_model("bert").half()
    batch = make_batch(full)

    def explain(model):
        scaled = lambda ids, mask: model(ids, attention_mask=mask).logits * 1e-3  # noqa: E731
        return METHODS[name](scaled, model=model, capture=capture).attribute(
            batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
        )

    expected, scores = explain(full), explain(half)
    assert bool((scores[0, : batch.lengths[0]] != 0).all()), "every real token gets a score"
    torch.testing.assert_close(scores.float(), expected, rtol=0, atol=1e-2 * float(expected.abs().max()))


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_padding_scores_stay_zero_when_a_real_token_is_not_finite(name, capture):
    model = make_model("bert")
    batch = make_batch(model)
    embeddings = model.get_input_embeddings()(batch.input_ids).detach()
    embeddings[0, 2] = float("nan")
    scores = METHODS[name](model, capture=capture).attribute(
        embeddings, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    padding = batch.attention_mask == 0
    assert bool(padding.any())
    assert bool((scores[padding] == 0).all())


class _TwoPasses(nn.Module):
    def __init__(self, model, direct=False):
        super().__init__()
        self.model, self.direct = model, direct

    def forward(self, input_ids, attention_mask):
        run = self.model.forward if self.direct else self.model
        first = run(input_ids, attention_mask=attention_mask).logits
        return (first + run(input_ids, attention_mask=attention_mask).logits) / 2


@pytest.mark.parametrize("direct", [False, True], ids=["called", "forward called directly"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_forward_that_runs_the_model_twice_is_refused(name, direct):
    """Also where the forward is called directly, past the model's hooks, as
    sentence-transformers calls it (a similarity of two encoded sentences): the passes'
    layers were chained as one model's."""
    model = make_model("bert")
    batch = make_batch(model)
    with pytest.raises(ValueError, match="ran BertForSequenceClassification 2 times"):
        METHODS[name](_TwoPasses(model, direct), model=model).attribute(
            batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
        )


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_mask_of_a_forward_called_directly_is_read(name, capture):
    """sentence-transformers calls its model's ``forward`` directly, past every hook: the
    padding mask it passes was not seen, and the padding explained as text."""
    model = make_model("bert")
    batch = make_batch(model)
    encoder = model.bert
    direct = lambda ids, mask: model.classifier(encoder.forward(ids, attention_mask=mask).pooler_output)  # noqa: E731
    before = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = METHODS[name](direct, model=encoder, capture=capture).attribute(
            batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
        )
    assert_same_state(before, model_state(model))
    assert_scores_close(scores, _attribute(model, name, batch, capture=capture))
    assert bool((scores[batch.attention_mask == 0] == 0).all())


@pytest.mark.parametrize("name", ["grad_sam", "raw"])
def test_a_family_whose_attention_is_returned_is_explained_through_a_direct_forward(name):
    """DeBERTa's attention is read from what it returns with ``output_attentions=True``,
    which the capture asks of its forward: asked through a hook alone, a direct call (a
    cross-encoder's under sentence-transformers) returned no probabilities."""
    from captum_attention.capture.adapters.huggingface import returned_attention

    model = make_model("deberta")
    batch = make_batch(model)
    assert returned_attention(model).sites
    direct = lambda ids, mask: model.forward(ids, attention_mask=mask).logits  # noqa: E731
    scores = METHODS[name](direct, model=model).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )
    assert_scores_close(scores, _attribute(model, name, batch))


def _mean_pooled(model):
    """The classifier's head on the mean of the tokens' outputs (a sentence embedding's
    pooling), not on [CLS]'s."""

    def forward(ids, mask):
        states = model.bert(ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(states.dtype)
        return model.classifier((states * weights).sum(dim=1) / weights.sum(dim=1))

    return forward


@pytest.mark.parametrize("capture", ["auto", "eager"])
@pytest.mark.parametrize("name", sorted(n for n, m in REGISTRY.items() if m.spec.reads_query_row and n != "alti_logit"))
def test_an_output_pooled_over_the_tokens_is_not_explained_at_its_first_row(name, capture):
    """The methods that read one row explained [CLS]'s row alone of a mean over every
    token's; they ask for the mean's row weights, and explain the mean given them."""
    model = with_random_biases(make_model("bert"))
    batch = make_batch(model)
    explainer = REGISTRY[name](_mean_pooled(model), model=model.bert, capture=capture)
    args = dict(target=TARGET, additional_forward_args=(batch.attention_mask,))
    with pytest.raises(ValueError, match=r"example 0 read positions 0-8, not position 0 alone.*attention_mask / attention_mask"):
        explainer.attribute(batch.input_ids, **args)
    if name == "attention_flow":
        return  # a max flow is not linear in the rows: its sink fed by them is tested in test_flow
    mean_rows = batch.attention_mask / batch.attention_mask.sum(dim=1, keepdim=True)
    last = torch.tensor(batch.lengths) - 1
    at_rows = torch.stack([  # (query, batch, tokens); a query past an example's end weighs 0 there
        explainer.attribute(batch.input_ids, query_index=last.clamp(max=query), **args)
        for query in range(batch.input_ids.shape[1])
    ])
    expected = (mean_rows.t()[..., None] * at_rows).sum(dim=0)
    assert_scores_close(explainer.attribute(batch.input_ids, query_index=mean_rows, **args), expected)


@pytest.mark.parametrize("name", ["rollout", "raw"])
def test_per_position_scores_are_told_to_pass_the_target_as_query_index(name):
    """A question-answering model's start logits (one per token, each read from its own
    row) read every row together: the fix is the target's position, not a mean; the model
    itself returns two sets of them, and the refusal shows how to pick one."""
    from transformers import BertForQuestionAnswering

    config = make_model("bert").config
    config.num_labels = 2  # start and end
    torch.manual_seed(0)
    model = BertForQuestionAnswering(config).eval()
    batch = make_batch(model)
    start_logits = lambda ids, mask: model(ids, attention_mask=mask).start_logits  # noqa: E731
    explainer = METHODS[name](start_logits, model=model)
    args = dict(target=3, additional_forward_args=(batch.attention_mask,))
    with pytest.raises(ValueError, match=r"read positions 0-8, .*one score per position.*pass query_index=target"):
        explainer.attribute(batch.input_ids, **args)
    with pytest.raises(ValueError, match=r"got QuestionAnsweringModelOutput\. .*\(a question answerer's: e\.g\. .*\.start_logits, "):
        METHODS[name](model).attribute(batch.input_ids, **args)
    as_tokens = METHODS[name](lambda ids, mask: model(ids, attention_mask=mask).start_logits[:, :, None], model=model)
    expected = as_tokens.attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,), query_index=3)
    assert_scores_close(explainer.attribute(batch.input_ids, query_index=3, **args), expected)


@pytest.mark.parametrize("name", ["alti", "norm_attention"])
def test_a_refusal_of_parts_that_do_not_add_up_names_the_users_hook(name):
    """A hook that ablates a head (its share of the attention output set to 0): the parts
    read from the weights no longer add up, and the refusal says which module's hook."""
    model = make_model("bert")
    batch = make_batch(model)

    def without_head_1(module, args, output):
        context = output[0].clone()
        context[..., 8:16] = 0
        return (context, *output[1:])

    handle = model.bert.encoder.layer[2].attention.self.register_forward_hook(without_head_1)
    try:
        with pytest.raises(UnsupportedModelError, match=r"\(bert\.encoder\.layer\.2\.attention\.self carries a forward hook: .* remove it"):
            REGISTRY[name](model).attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
        assert list(model.bert.encoder.layer[2].attention.self._forward_hooks.values()) == [without_head_1]
    finally:
        handle.remove()
    REGISTRY[name](model).attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))


def test_a_forward_the_model_already_holds_is_kept():
    """accelerate's offloading hooks replace a module's ``forward`` on the instance."""
    model = make_model("bert")
    batch = make_batch(model)
    calls = []

    @functools.wraps(model.forward)
    def own_forward(*args, **kwargs):
        calls.append(len(args) + len(kwargs))
        return type(model).forward(model, *args, **kwargs)

    model.forward = own_forward
    scores = _attribute(model, "grad_sam", batch)
    assert vars(model)["forward"] is own_forward and calls
    del model.forward
    assert_scores_close(scores, _attribute(model, "grad_sam", batch))


def test_padded_ids_without_a_mask_get_a_warning():
    model = make_model("bert")
    batch = make_batch(model)
    explainer = METHODS["rollout"](model)
    with pytest.warns(UserWarning, match="padding token id 0"):
        explainer.attribute(batch.input_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explainer.attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
        explainer.attribute(batch.input_ids[2:, : batch.lengths[2]])  # one unpadded row


def test_a_data_parallel_wrapper_of_an_eval_model_is_not_in_training_mode():
    model = make_model("bert")
    batch = make_batch(model)
    wrapped = nn.DataParallel(model)
    assert wrapped.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        METHODS["grad_sam"](wrapped, model=wrapped).attribute(
            batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
        )


def test_a_submodule_left_in_training_mode_gets_a_warning():
    model = make_model("bert")
    model.bert.encoder.layer[1].train()
    batch = make_batch(model)
    with pytest.warns(UserWarning, match=r"training mode \(bert\.encoder\.layer\.1"):
        _attribute(model, "raw", batch)


def test_layers_that_compute_the_same_in_training_mode_get_no_warning():
    """A head made after ``model.eval()``, or the linear layers a quantizer swaps into a
    model in eval mode, are in training mode without dropout: nothing to warn of. A dropout
    beside them still is."""
    model = make_model("bert")
    model.classifier = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, NUM_LABELS))
    batch = make_batch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attribute(model, "raw", batch)
    model.classifier.insert(0, nn.Dropout(0.1))
    with pytest.warns(UserWarning, match=r"training mode \(classifier\.0\)"):
        _attribute(model, "raw", batch)


def _per_position_model(head: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, num_labels=NUM_LABELS, initializer_range=0.3)
    return (BertForMaskedLM if head == "masked_lm" else BertForTokenClassification)(config).eval()


@pytest.mark.parametrize("head", ["masked_lm", "token_classifier"])
@pytest.mark.parametrize("capture", ["eager", "streaming"])
def test_a_bidirectional_model_with_logits_at_every_position_explains_the_position_asked_for(head, capture):
    model = _per_position_model(head)
    batch = make_batch(model)
    explainer = METHODS["grad_sam"](model, capture=capture)
    with pytest.raises(ValueError, match="logits at every position .* pass query_index"):
        explainer.attribute(batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,))
    queries = torch.tensor([5, 2, 3])  # a [MASK] or tagged token of each example
    scores = explainer.attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,), query_index=queries
    )
    expected = reference_grad_sam(reference_attention(model, batch, TARGET, queries), batch.lengths)
    assert_scores_close(scores, expected)


def test_attention_erasure_metrics_read_the_decision_at_the_position_asked_for():
    from captum_attention.metrics import attention_erasure, decision_flip_fraction

    model = _per_position_model("masked_lm")
    batch = make_batch(model)
    args, query, ranking = (batch.attention_mask,), 2, torch.rand(batch.input_ids.shape, generator=torch.Generator().manual_seed(0))
    result = decision_flip_fraction(model, batch.input_ids, ranking, args, query_index=query)
    at_query = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits[:, query]  # noqa: E731
    expected = decision_flip_fraction(at_query, batch.input_ids, ranking, args, model=model, query_index=query)
    assert result.flipped.any()
    torch.testing.assert_close(result.removed, expected.removed)
    torch.testing.assert_close(result.attention_mass_removed, expected.attention_mass_removed, equal_nan=True)
    erased = ranking > 0.5
    erasure = attention_erasure(model, batch.input_ids, erased, args, query_index=query)
    torch.testing.assert_close(erasure.erased, attention_erasure(at_query, batch.input_ids, erased, args, model=model).erased)
    assert (erasure.js_divergence > 0).all()


def test_transformers_output_recorders_are_not_called_the_users_hooks():
    """transformers installs inert forward hooks on a model's modules the first time it is
    asked for ``output_hidden_states`` or ``output_attentions``: a refusal must not blame
    them, nor the left-padding verdict count them; a hook of the user's still counts."""
    from vlm_models import ANSWER, make_vlm, make_vlm_prompt

    from captum_attention._compat import forward_hooks

    model, prompt = make_vlm("qwen2_vl"), make_vlm_prompt("qwen2_vl")
    with torch.no_grad():
        model(input_ids=prompt.input_ids, attention_mask=prompt.attention_mask, **prompt.images, output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules()), "transformers' recorders are installed"
    assert forward_hooks(model) == []
    with pytest.raises(UnsupportedModelError) as refused:
        REGISTRY["decompx"](model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert "holds no row per example" in str(refused.value) and "forward hook" not in str(refused.value)
    handle = model.model.visual.register_forward_hook(lambda module, args, output: None)
    try:
        assert [name for name, _ in forward_hooks(model)] == ["model.visual"]
    finally:
        handle.remove()
