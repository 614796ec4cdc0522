"""Decoder-only language models (GPT-2; Llama and Qwen2 with grouped-query attention)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_state, assert_scores_close, counted_calls, model_state
from lm_models import DECODERS, lm_reference, make_decoder, make_encoder_decoder, make_learned_position_decoder, make_prompts
from methods import MAP_METHODS, METHODS, reference_grad_sam_key_axis

from captum_attention import GradSAM, UnsupportedModelError
from captum_attention.attr._registry import REGISTRY
from captum_attention.metrics import attention_erasure, decision_flip_fraction, random_ranking

pytestmark = pytest.mark.usefixtures("capture_mode")  # each test streaming and eager

@pytest.fixture(params=DECODERS)
def decoder(request: pytest.FixtureRequest) -> str:
    return request.param


def per_example(reference, ref, real: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The reference on each example's real tokens up to its query, placed back in the row."""
    scores = torch.zeros(real.shape)
    for b in range(real.shape[0]):
        idx = (real[b] & (torch.arange(real.shape[1]) <= queries[b])).nonzero().flatten()
        block = lambda t: t[b : b + 1][:, :, idx][:, :, :, idx]  # noqa: E731
        sub = SimpleNamespace(attentions=[block(a) for a in ref.attentions], grads=[block(g) for g in ref.grads])
        scores[b, idx] = reference(sub, [len(idx)], len(idx) - 1)[0]
    return scores


@pytest.mark.parametrize("method", MAP_METHODS)
@pytest.mark.parametrize("side", ["left", "right"])
def test_methods_match_reference_at_the_last_real_token(decoder, method, side):
    model = make_decoder(decoder)
    prompts = make_prompts(side=side)
    last = torch.arange(prompts.real.shape[1]).masked_fill(~prompts.real, -1).amax(dim=1)
    ref = lm_reference(model, prompts, last)
    cls, reference = METHODS[method].cls, METHODS[method].reference
    scores = cls(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    expected = per_example(reference, ref, prompts.real, last)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


@pytest.mark.parametrize("method", MAP_METHODS)
def test_any_position_and_token_and_no_score_on_future_tokens(decoder, method):
    model = make_decoder(decoder)
    prompts = make_prompts(lengths=(7, 7), side="right")
    queries, targets = torch.tensor([2, 4]), torch.tensor([5, 9])
    ref = lm_reference(model, prompts, queries, targets)
    cls, reference = METHODS[method].cls, METHODS[method].reference
    scores = cls(model).attribute(
        prompts.input_ids, target=targets, additional_forward_args=(prompts.attention_mask,), query_index=queries
    )
    future = torch.arange(7) > queries[:, None]
    assert (scores[future] == 0).all()
    assert_scores_close(scores, per_example(reference, ref, prompts.real, queries))


def assert_left_padded_batch_is_each_prompt_alone(model, method: str) -> None:
    prompts = make_prompts(side="left")
    explainer = METHODS[method].cls(model)
    together = explainer.attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    for b in range(3):
        real = prompts.real[b]
        alone = explainer.attribute(prompts.input_ids[b : b + 1, real])
        torch.testing.assert_close(together[b, real], alone[0], atol=1e-6, rtol=1e-4)
        assert (together[b, ~real] == 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_matches_each_prompt_alone(decoder, method):
    assert_left_padded_batch_is_each_prompt_alone(make_decoder(decoder), method)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_float64_left_padded_batch_matches_each_prompt_alone(name):
    """transformers' eager attention takes a float64 model's softmax in float32, where the
    padding mask overflows and the first rows of a left-padded prompt (padding alone) gave
    NaN, spread to its real tokens: NaN scores, or a refusal naming a norm or a re-run."""
    model = make_decoder("llama").double()
    prompts = make_prompts(side="left")
    explainer = REGISTRY[name](model)
    together = explainer.attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    for b in range(3):
        real = prompts.real[b]
        alone = explainer.attribute(prompts.input_ids[b : b + 1, real])
        torch.testing.assert_close(together[b, real], alone[0], atol=1e-6, rtol=1e-4)


def test_the_left_padding_check_of_a_float64_model_loaded_eager_confirms_it_once():
    """The check runs the model outside the capture, where transformers' eager softmax in
    float32 would make the padded prompt's logits NaN and confirm nothing (the check then
    run again at every call): it clamps as the capture does."""
    model = make_decoder("llama").double()
    model.set_attn_implementation("eager")
    assert_left_padded_batch_is_each_prompt_alone(model, "grad_sam")
    prompts = make_prompts(side="left")
    with counted_calls(model) as calls:
        GradSAM(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    assert len(calls) == 1


@pytest.mark.parametrize("method", METHODS)
def test_continuation_rows_equal_explaining_each_prefix(decoder, method):
    model = make_decoder(decoder)
    prompts = make_prompts(lengths=(5, 3), side="left")
    continuation = torch.tensor([[7, 8, 9], [10, 11, 12]])
    explainer = METHODS[method].cls(model)
    rows = explainer.attribute_continuation(
        prompts.input_ids, continuation, additional_forward_args=(prompts.attention_mask,)
    )
    assert rows.shape == (2, 3, 5 + 3)
    for step in range(3):
        ids = torch.cat([prompts.input_ids, continuation[:, :step]], dim=1)
        mask = torch.cat([prompts.attention_mask, torch.ones(2, step, dtype=torch.long)], dim=1)
        prefix = explainer.attribute(ids, target=continuation[:, step], additional_forward_args=(mask,))
        torch.testing.assert_close(rows[:, step, : ids.shape[1]], prefix, atol=1e-6, rtol=1e-4)
        assert (rows[:, step, ids.shape[1] :] == 0).all()


def test_rollout_continuation_rows_share_each_layers_recomputation(decoder, monkeypatch):
    """Rollout needs no backward: all of a continuation's rows go through each layer
    together, one recomputation of its blocks, not one per row."""
    from captum_attention.attr import attention_rollout

    steps = []
    original = attention_rollout.rollout_row_step
    monkeypatch.setattr(attention_rollout, "rollout_row_step", lambda call, row, *rest: steps.append(row.shape) or original(call, row, *rest))
    model = make_decoder(decoder)
    prompts = make_prompts(lengths=(5, 3), side="left")
    continuation = torch.tensor([[7, 8, 9], [10, 11, 12]])
    explainer = METHODS["rollout"].cls(model)
    explainer.attribute_continuation(prompts.input_ids, continuation, additional_forward_args=(prompts.attention_mask,))
    if explainer.last_capture.startswith("streaming"):
        assert steps and all(shape == (2, 3, 8) for shape in steps)  # (batch, rows, tokens) per layer
    else:  # an eager-loaded model: the maps are read once, no row steps
        assert not steps


def test_continuation_of_a_right_padded_prompt_is_refused():
    model = make_decoder("gpt2")
    prompts = make_prompts(side="right")
    with pytest.raises(ValueError, match="on the left"):
        GradSAM(model).attribute_continuation(
            prompts.input_ids, torch.tensor([[5], [6], [7]]), additional_forward_args=(prompts.attention_mask,)
        )


def test_grouped_query_attention_gives_one_map_per_query_head():
    model = make_decoder("llama")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prompts = make_prompts(side="left")
    _, maps = GradSAM(model).attribute(
        prompts.input_ids, additional_forward_args=(prompts.attention_mask,), return_maps=True
    )
    assert maps.shape == (3, 3, 7, 7)


@pytest.mark.parametrize("method", METHODS)
def test_model_left_as_found(decoder, method):
    model = make_decoder(decoder)
    before = model_state(model)
    prompts = make_prompts(side="left")
    METHODS[method].cls(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    assert_same_state(before, model_state(model))
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_erasing_every_other_key_leaves_the_query_token_alone(name):
    """Rotary models attending only to themselves compute what the lone token computes."""
    model = make_decoder(name)
    prompts = make_prompts(side="left")
    last = prompts.real.shape[1] - 1
    erased = torch.ones_like(prompts.real)
    erased[:, last] = False
    result = attention_erasure(model, prompts.input_ids, erased, (prompts.attention_mask,))
    with torch.no_grad():
        alone = model(prompts.input_ids[:, last:]).logits[:, -1].softmax(-1)
    torch.testing.assert_close(result.erased, alone, atol=1e-6, rtol=1e-5)
    assert (result.js_divergence > 0).all()


def test_decision_flip_fraction_on_a_decoder():
    model = make_decoder("gpt2")
    prompts = make_prompts(side="left")
    ranking = random_ranking(prompts.real.shape)
    result = decision_flip_fraction(model, prompts.input_ids, ranking, (prompts.attention_mask,))
    assert result.removed.shape == (3,)
    fractions = result.fraction[result.flipped]
    assert ((fractions > 0) & (fractions <= 1)).all()


def test_token_removal_metrics_ask_for_classifier_logits():
    from captum_attention.metrics import comprehensiveness

    model = make_decoder("gpt2")
    prompts = make_prompts(side="right")
    forward = lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    with pytest.raises(ValueError, match="logits of the explained position"):
        comprehensiveness(forward, prompts.input_ids, prompts.attention_mask, torch.rand(prompts.real.shape))


@pytest.mark.parametrize("side", ["left", "right"])
def test_grad_sam_key_axis_matches_reference_at_the_last_real_token(decoder, side):
    model = make_decoder(decoder)
    prompts = make_prompts(side=side)
    last = torch.arange(prompts.real.shape[1]).masked_fill(~prompts.real, -1).amax(dim=1)
    ref = lm_reference(model, prompts, last)
    scores = GradSAM(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,), axis="key")
    expected = per_example(lambda sub, lengths, query: reference_grad_sam_key_axis(sub, lengths), ref, prompts.real, last)
    assert expected.abs().max() > 0
    assert_scores_close(scores, expected)


def test_grad_sam_key_axis_is_refused_for_encoder_decoders():
    model = make_encoder_decoder("t5")
    ids = torch.randint(3, 20, (2, 5))
    with pytest.raises(ValueError, match="axis='key'"):
        GradSAM(model).attribute((ids, ids), axis="key")


@pytest.mark.parametrize("family", ["bart", "xlm"])
def test_a_left_padded_prompt_that_a_decoder_reads_at_other_positions_is_refused_in_one_line(family):
    """BART's decoder and XLM place a left-padded prompt's tokens after the padding, given
    position ids or not: their scores would be another prompt's, so they are refused."""
    model, prompts = make_learned_position_decoder(family), make_prompts(side="left")
    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match=r"reads a left-padded prompt otherwise than the prompt alone: .* counts positions from the first column.*\. Pad its prompts on the right"):
        GradSAM(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    assert_same_state(before, model_state(model))
    right = make_prompts(side="right")
    GradSAM(model).attribute(right.input_ids, additional_forward_args=(right.attention_mask,))


def test_a_hook_that_carries_the_padding_into_the_prompt_is_named_in_the_refusal():
    """A forward pre-hook of the user's that mixes each token with the one before it reads
    the left padding into the first real token: the refusal says which module carries it,
    whether the model was checked before the hook came (explained) or not, and the model is
    explained again once it is removed."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    GradSAM(model).attribute(prompts.input_ids, **args)
    handle = model.model.layers[1].register_forward_pre_hook(lambda module, args: (args[0] + torch.roll(args[0], 1, dims=1), *args[1:]))
    try:
        with pytest.raises(UnsupportedModelError, match="or the forward hook on model.layers.1 reads the padding"):
            GradSAM(model).attribute(prompts.input_ids, **args)
    finally:
        handle.remove()
    assert_left_padded_batch_is_each_prompt_alone(model, "grad_sam")


def test_a_model_that_reads_the_left_padding_is_probed_once():
    """The check's verdict is kept per model: a second left-padded call is refused without
    running the model, as a confirmed model runs it once."""
    model, prompts = make_learned_position_decoder("bart"), make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    for expected_calls in (3, 0):
        with counted_calls(model) as calls, pytest.raises(UnsupportedModelError, match="reads a left-padded prompt"):
            GradSAM(model).attribute(prompts.input_ids, **args)
        assert len(calls) == expected_calls

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_left_padding_check_allows_half_precisions_rounding_only(dtype):
    """Half-precision logits of a padded prompt and the prompt alone may differ by a few
    units of the last place (kernels picked by length): Llama is explained, BART's decoder
    (its positions off by the padding) still refused."""
    from captum_attention.capture.adapters.huggingface import _same_logits

    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    scale = logits.float().abs().max()
    assert _same_logits(logits + 3 * torch.finfo(dtype).eps * scale, logits)
    assert not _same_logits(logits + 0.05 * scale, logits)
    prompts = make_prompts(side="left")
    args = dict(additional_forward_args=(prompts.attention_mask,))
    assert GradSAM(make_decoder("llama").to(dtype)).attribute(prompts.input_ids, **args).isfinite().all()
    with pytest.raises(UnsupportedModelError, match="reads a left-padded prompt otherwise than the prompt alone"):
        GradSAM(make_learned_position_decoder("bart").to(dtype)).attribute(prompts.input_ids, **args)


@pytest.mark.parametrize("method", METHODS)
def test_roberta_as_a_causal_lm_explains_a_left_padded_batch_as_each_prompt_alone(method):
    """RoBERTa counts positions from the ids past the padding: given none, a left-padded
    prompt is read as alone, where position ids over the real tokens would move it."""
    assert_left_padded_batch_is_each_prompt_alone(make_learned_position_decoder("roberta"), method)


def test_logits_kept_at_fewer_positions_than_the_tokens_are_refused_in_one_line():
    """``logits_to_keep=1`` gives one position's logits as (batch, 1, vocab): the
    explained position was taken as an index into them (an IndexError). Returned as
    (batch, vocab), that position's logits are explained as the model's own."""
    model, prompts = make_decoder("llama"), make_prompts(side="left")

    def kept(input_ids, attention_mask):
        return model(input_ids, attention_mask=attention_mask, logits_to_keep=1).logits

    args = dict(target=5, additional_forward_args=(prompts.attention_mask,))
    tokens = prompts.input_ids.shape[1]
    with pytest.raises(ValueError, match=rf"^forward_func returned logits at 1 of the {tokens} positions .*\(as with logits_to_keep\)"):
        GradSAM(kept, model=model).attribute(prompts.input_ids, **args)
    last = GradSAM(lambda ids, mask: kept(ids, mask)[:, -1], model=model).attribute(prompts.input_ids, **args)
    assert_scores_close(last, GradSAM(model).attribute(prompts.input_ids, **args))


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_a_continuation_padded_after_its_end_is_refused_in_one_line(family):
    """``generate`` pads a batch's shorter answers after their end-of-sequence token (with
    the model's pad id, or its end id again): the padding was explained as answer tokens
    (a span's log-likelihood counted theirs). A row that ends at its last token, or that
    goes on with other tokens, is explained."""
    model = make_decoder(family) if family == "gpt2" else make_encoder_decoder(family)
    prompts = make_prompts(lengths=(5, 4))
    end, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    args = (prompts.attention_mask,)
    explain = GradSAM(model)
    for padded in ([[5, 6, 7, 8], [9, end, pad, pad]], [[5, 6, 7, 8], [9, end, end, end]]):
        for call in (explain.attribute_span, explain.attribute_continuation):
            with pytest.raises(ValueError, match=r"^continuation row 1 is padded after its end-of-sequence token \(position 1\), as "
                               r"generate pads .* \(continuation\[1:2, :2\]\)\.$"):
                call(prompts.input_ids, torch.tensor(padded), additional_forward_args=args)
    for whole in ([[5, 6, 7, end], [9, 10, 11, 12]], [[5, end, 7, 8], [9, 10, 11, end]]):
        explain.attribute_span(prompts.input_ids, torch.tensor(whole), additional_forward_args=args)


@pytest.mark.parametrize("family", ["llama", "bart"])
def test_a_continuation_that_begins_with_the_bos_token_is_warned_of(family):
    """A tokenizer that adds BOS (Llama's) gives ``tokenizer(answer).input_ids`` with it
    first: a decoder-only model's span explained the BOS as the answer's first token,
    with no word of it. An encoder-decoder's target may begin with one (BART's do)."""
    model = make_decoder(family) if family == "llama" else make_encoder_decoder(family)
    prompts = make_prompts(side="left" if family == "llama" else "right")
    bos, args = model.config.bos_token_id, (prompts.attention_mask,)
    with_bos = torch.tensor([[5, 6], [bos, 6], [bos, 7]])
    explain = GradSAM(model)
    for call in (explain.attribute_span, explain.attribute_continuation):
        if family == "bart":
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                call(prompts.input_ids, with_bos, additional_forward_args=args)
            continue
        with pytest.warns(UserWarning, match=r"^continuation rows \[1, 2\] begin with the model's BOS token \(1\), .*"
                          r"add_special_tokens=False: .* give continuation\[:, 1:\] if it is not the answer's\.$"):
            call(prompts.input_ids, with_bos, additional_forward_args=args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain.attribute_span(prompts.input_ids, torch.tensor([[5, bos]] * 3), additional_forward_args=args)  # not first


def test_an_answer_as_a_tokenizers_list_or_one_row_for_every_prompt():
    """``tokenizer(answer).input_ids`` is a list, and one answer often serves a batch of
    prompts: a list failed with "'list' object has no attribute 'dim'", one row for
    three prompts was refused. Both give the scores of the answer written out per row;
    text, and rows of different lengths, are refused in one line."""
    from captum_attention import AttnLRP
    from captum_attention.metrics import linear_datamodeling_score

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    args = (prompts.input_ids,)
    per_row = torch.tensor([[7, 8]] * 3)
    expected_span = AttnLRP(model).attribute_span(*args, per_row, additional_forward_args=(prompts.attention_mask,))
    expected_rows = GradSAM(model).attribute_continuation(*args, per_row, additional_forward_args=(prompts.attention_mask,))
    scores = torch.rand(prompts.input_ids.shape, generator=torch.Generator().manual_seed(0))
    expected_lds = linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, per_row, scores)
    for answer in ([7, 8], [[7, 8]] * 3, torch.tensor([7, 8]), torch.tensor([[7, 8]])):
        span = AttnLRP(model).attribute_span(*args, answer, additional_forward_args=(prompts.attention_mask,))
        rows = GradSAM(model).attribute_continuation(*args, answer, additional_forward_args=(prompts.attention_mask,))
        lds = linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, answer, scores)
        assert torch.equal(span, expected_span) and torch.equal(rows, expected_rows) and torch.equal(lds, expected_lds)
    with pytest.raises(TypeError, match=r"^continuation is text: give its token ids, e\.g\. tokenizer\(text"):
        AttnLRP(model).attribute_span(*args, "Paris", additional_forward_args=(prompts.attention_mask,))
    with pytest.raises(ValueError, match=r"^answer holds rows of different lengths .*: explain each answer in its own call"):
        linear_datamodeling_score(model, prompts.input_ids, prompts.attention_mask, [[7, 8], [7], [7, 8]], scores)

