"""The answer path's input handling: options, template values, token ids, the row the
logits read. Each case here was silently wrong or gave an unclear error before."""

from __future__ import annotations

import difflib
import string
import threading
import warnings

import pytest
import torch
import transformers as tf
from captum.attr import TextTemplateInput, TextTokenInput
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lm_models import WORDS, make_decoder, make_word_tokenizer

from captum_attention import (
    AttentionRollout,
    AttnLRP,
    GradSAM,
    LLMAttentionAttribution,
    RawAttention,
    TransformerAttribution,
)
from captum_attention.attr import REGISTRY

PROMPT = torch.tensor([[1, 3, 36, 35, 26]])
ANSWER = torch.tensor([[51, 62]])


@pytest.fixture(scope="module")
def llama():
    return make_decoder("llama")


@pytest.fixture(scope="module")
def tokenizer():
    return make_word_tokenizer()


# One option check for every method and path -------------------------------------------


def _calls(explainer, tokenizer):
    """Each path a user passes options through, as ``call(**options)``."""
    return {
        "attribute": lambda **o: explainer.attribute(PROMPT, target=51, **o),
        "attribute_span": lambda **o: explainer.attribute_span(PROMPT, ANSWER, **o),
        "attribute_continuation": lambda **o: explainer.attribute_continuation(PROMPT, ANSWER, **o),
        "LLMAttentionAttribution": lambda **o: LLMAttentionAttribution(explainer, tokenizer).attribute(
            TextTokenInput("the secret code is", tokenizer), target="seven", **o
        ),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(sorted(REGISTRY)),
    path=st.sampled_from(["attribute", "attribute_span", "attribute_continuation", "LLMAttentionAttribution"]),
    name=st.text(alphabet=string.ascii_lowercase + "_", min_size=1, max_size=12),
)
def test_an_option_a_method_does_not_take_is_refused_on_every_path(llama, tokenizer, method, path, name):
    cls = REGISTRY[method]
    if name in cls.spec.options or (path != "attribute" and method == "attention_flow"):
        return
    with pytest.raises(TypeError, match=f"unexpected option {name!r}|unexpected keyword argument '{name}'"):
        _calls(cls(llama), tokenizer)[path](**{name: 1})


@pytest.mark.parametrize("path", ["attribute", "attribute_span", "attribute_continuation", "LLMAttentionAttribution"])
@pytest.mark.parametrize(
    "method, option, value, error",
    [
        (GradSAM, "axis", "keys", ValueError),
        (GradSAM, "effective", "yes", TypeError),
        (AttentionRollout, "head_fusion", "avg", ValueError),
        (AttentionRollout, "discard_ratio", 1.5, ValueError),
        (RawAttention, "layer", 1.0, TypeError),
        (TransformerAttribution, "start_layer", "0", TypeError),
    ],
)
def test_a_value_an_option_does_not_take_is_refused_on_every_path(llama, tokenizer, path, method, option, value, error):
    with pytest.raises(error, match=f"^{option} must be "):
        _calls(method(llama), tokenizer)[path](**{option: value})


@pytest.mark.parametrize("path", ["attribute_span", "attribute_continuation", "LLMAttentionAttribution"])
def test_attn_lrp_takes_only_its_vision_tower_options_on_the_span_paths(llama, tokenizer, path):
    for option in ("effective", "no_such_option"):
        with pytest.raises(TypeError, match=f"unexpected option {option!r}; its options are: through_vision_tower, pixel_baselines."):
            _calls(AttnLRP(llama), tokenizer)[path](**{option: True})


def test_the_streaming_reductions_check_their_own_arguments(llama):
    from captum_attention.maps.kernel import block_shape
    from captum_attention.maps.streaming import grad_sam_row_sums, rollout_row_step

    explainer = GradSAM(llama, capture="streaming")
    record = explainer._explained(explainer._recorded((PROMPT,), None, None, False, False, {}), 51)
    call = record.kernel_calls[0]
    real = record.target_real
    from captum_attention.capture import OutputGrads

    grads = record.result(OutputGrads).grads[0]
    with pytest.raises(ValueError, match="axis must be one of"):
        grad_sam_row_sums(call, grads, real, real, block_shape(call), "keys")
    with pytest.raises(ValueError, match="head_fusion must be one of"):
        rollout_row_step(call, torch.zeros(real.shape), real, "avg", block_shape(call))


# Template values -----------------------------------------------------------------------


def _captum_features(inp: TextTemplateInput, tokenizer) -> torch.Tensor:
    """``(tokens, values)`` 0/1: the tokens whose characters Captum's ablation of each value
    changes (the value replaced by a string of its own length that no template or value
    holds, and that ``repr`` keeps as it is), from a character diff of the two prompts:
    independent of how the library finds spans."""
    text = inp.to_model_input()
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    features = torch.zeros(len(offsets), inp.n_features)
    for value in range(inp.n_features):
        marked = TextTemplateInput(inp.template, inp.values, baselines=["§" * len(str(v)) for v in inp.values])
        keep = torch.ones(1, inp.n_features)
        keep[0, value] = 0
        changed = set()
        other = marked.to_model_input(keep)
        for op, i1, i2, _, _ in difflib.SequenceMatcher(None, text, other, autojunk=False).get_opcodes():
            if op != "equal":
                changed.update(range(i1, i2))
        for token, (start, end) in enumerate(offsets):
            if changed & set(range(start, end)):
                features[token, value] = 1.0
    return features


AUTO_FIELDS = st.sampled_from(["{}", "{!s}", "{:>6}", "{:<7}", "{!r}", "{:^9}"])
NUMBERED_FIELDS = st.sampled_from(["{0}", "{1}", "{2}", "{0:>6}", "{1!r}", "{2:<8}"])
LITERALS = st.sampled_from(["", "the", "is", "what", ". the", "? now"])


@st.composite
def templates(draw):
    """A format string (automatic numbering, or manual numbering that may place a value
    twice and leave one out, conversions and format specs), its values (words or ints,
    each distinct) and the template's literal text between spaced fields."""
    numbered = draw(st.booleans())
    fields = draw(st.lists(NUMBERED_FIELDS if numbered else AUTO_FIELDS, min_size=1, max_size=5))
    template = " ".join(f"{draw(LITERALS)} {field}" for field in fields)
    count = max(int(f[1]) for f in fields) + 1 if numbered else len(fields)
    # words the template's own text never holds: a character diff could align a value with
    # the same word in the template instead
    words = [w for w in WORDS[3:] if w not in ("the", "is", "what", "now", ".", "?")]
    pool = st.one_of(st.sampled_from(words), st.integers(0, 99))
    values = draw(st.lists(pool, min_size=count, max_size=count, unique_by=str))
    return template, values


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=templates())
def test_template_values_are_the_tokens_captums_ablation_changes(tokenizer, case):
    from captum_attention.attr.llm import _template_weights

    template, values = case
    inp = TextTemplateInput(template, values)
    prompt = tokenizer(inp.to_model_input(), return_tensors="pt").input_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every field is spaced: no value shares a token
        weights = _template_weights(inp, tokenizer, prompt)
    torch.testing.assert_close(weights, _captum_features(inp, tokenizer))


def test_a_value_placed_twice_scores_both_places(llama, tokenizer):
    explainer = GradSAM(llama)
    inp = TextTemplateInput("{0} is {1} . what is {0} ?", ["the code", "seven"])
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, target="seven")
    prompt = tokenizer(inp.to_model_input(), return_tensors="pt").input_ids
    # <s> the code is seven . what is the code ?
    tokens = explainer.attribute_span(prompt, torch.tensor([[51]]), additional_forward_args=(torch.ones_like(prompt),))[0]
    torch.testing.assert_close(result.seq_attr, torch.stack([tokens[[1, 2, 8, 9]].sum(), tokens[4]]))
    assert tokens[8:10].abs().sum() > 0  # the second place counts


def test_values_that_share_a_token_warn_and_split_it_by_characters(llama, tokenizer):
    explainer = RawAttention(llama)
    inp = TextTemplateInput("the {}{} is seven", ["co", "de"])  # "code": one token, two values
    with pytest.warns(UserWarning, match="share the token 'code'"):
        result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, target="seven")
    prompt = tokenizer(inp.to_model_input(), return_tensors="pt").input_ids
    tokens = explainer.attribute_span(prompt, torch.tensor([[51]]), additional_forward_args=(torch.ones_like(prompt),))[0]
    assert tokens[2] > 0
    torch.testing.assert_close(result.seq_attr, torch.stack([tokens[2] / 2, tokens[2] / 2]))
    lopsided = TextTemplateInput("the {}{} is seven", ["c", "ode"])
    with pytest.warns(UserWarning, match="share the token"):
        split = LLMAttentionAttribution(explainer, tokenizer).attribute(lopsided, target="seven").seq_attr
    torch.testing.assert_close(split, torch.stack([tokens[2] / 4, tokens[2] * 3 / 4]))


def test_int_values_and_format_specs_are_placed_as_str_format_places_them(llama, tokenizer):
    explainer = GradSAM(llama)
    inp = TextTemplateInput("the {:>8} is {}", ["code", 7])
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(inp, target="seven")
    prompt = tokenizer(inp.to_model_input(), return_tensors="pt").input_ids
    tokens = explainer.attribute_span(prompt, torch.tensor([[51]]), additional_forward_args=(torch.ones_like(prompt),))[0]
    # <s> the code is 7(unknown)
    torch.testing.assert_close(result.seq_attr, torch.stack([tokens[2], tokens[4]]))


# Answers and prompts -------------------------------------------------------------------


def test_answer_ids_outside_the_vocabulary_name_the_vocabulary(llama, tokenizer):
    with pytest.raises(ValueError, match=r"Token ids \[500\] lie outside the vocabulary of LlamaForCausalLM \(64 ids"):
        LLMAttentionAttribution(GradSAM(llama), tokenizer).attribute(TextTokenInput("the code", tokenizer), target=torch.tensor([500]))
    with pytest.raises(ValueError, match=r"Token ids \[-1\] lie outside"):
        GradSAM(llama).attribute_span(PROMPT, torch.tensor([[-1]]))


def test_an_empty_prompt_is_refused_before_generating(llama):
    bare = make_word_tokenizer()
    bare._tokenizer.post_processor = None  # no BOS: an empty prompt has no tokens at all
    with pytest.raises(ValueError, match="The prompt has no tokens"):
        LLMAttentionAttribution(GradSAM(llama), bare).attribute(TextTokenInput("", bare), gen_args={"max_new_tokens": 2})


def test_attn_lrp_under_inference_mode_says_why(llama):
    with torch.inference_mode(), pytest.raises(RuntimeError, match="torch.inference_mode\\(\\) switches off"):
        AttnLRP(llama).attribute(PROMPT, target=51)


def test_another_threads_switch_of_the_implementation_does_not_reach_a_running_capture():
    model = make_decoder("llama")
    model.set_attn_implementation("eager")
    expected = GradSAM(model, capture="eager").attribute(PROMPT, target=51)
    switched = threading.Event()

    def switch(module, args, kwargs):  # another thread switches while the capture runs
        if not switched.is_set():
            thread = threading.Thread(target=model.set_attn_implementation, args=("sdpa",))
            thread.start()
            thread.join()
            switched.set()

    handle = model.model.layers[0].register_forward_pre_hook(switch, with_kwargs=True)
    try:
        scores = GradSAM(model, capture="eager").attribute(PROMPT, target=51)
    finally:
        handle.remove()
    assert switched.is_set() and model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(scores, expected)


# The row the logits read ---------------------------------------------------------------


def _decoder_classifier(pad_token_id: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=pad_token_id, num_labels=3,
    )
    return tf.LlamaForSequenceClassification(config).eval()


ROW_METHODS = [AttentionRollout, RawAttention, TransformerAttribution]


@pytest.mark.parametrize("capture", ["streaming", "eager"])
@pytest.mark.parametrize("method", ROW_METHODS)
def test_a_default_row_the_logits_do_not_read_is_refused(method, capture):
    model = _decoder_classifier(pad_token_id=2)
    ids, mask = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    logits = model(ids, attention_mask=mask).logits
    # the model reads the last id that is not its pad id: position 3, a padding position
    reading_padding = model.model(ids, attention_mask=mask).last_hidden_state[1, 3]
    torch.testing.assert_close(logits[1], model.score(reading_padding))
    with pytest.raises(ValueError, match=r"example 1 read position 3, not position 1.*config.pad_token_id is 2"):
        method(model, capture=capture).attribute(ids, target=0, additional_forward_args=(mask,))


@pytest.mark.parametrize("method", ROW_METHODS)
def test_padding_with_the_models_pad_id_explains_the_row_it_reads(method):
    model = _decoder_classifier(pad_token_id=2)
    ids, mask = torch.tensor([[5, 6, 7, 8], [5, 6, 2, 2]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    scores = method(model).attribute(ids, target=0, additional_forward_args=(mask,))
    alone = method(model).attribute(ids[1:, :2], target=0)
    torch.testing.assert_close(scores[1, :2], alone[0])


def test_a_real_row_the_logits_read_is_named_as_the_query_index():
    model = _decoder_classifier()
    ids = torch.tensor([[5, 6, 7, 8]])
    forward = lambda ids: model.score(model.model(ids).last_hidden_state[:, 1])  # noqa: E731  (reads the second token)
    with pytest.raises(ValueError, match="read position 1, not position 3.*pass query_index=1"):
        RawAttention(forward, model=model).attribute(ids)
    # a causal row sees only its prefix: the second token's row is the two-token prompt's last
    torch.testing.assert_close(
        RawAttention(forward, model=model).attribute(ids, query_index=1)[:, :2], RawAttention(model).attribute(ids[:, :2])
    )


@pytest.mark.usefixtures("capture_mode")
@pytest.mark.parametrize("method", ["rollout", "transformer_attribution", "raw"])
def test_query_rows_weighed_give_the_weighted_sum_of_the_rows(method):
    """query_index as a float (batch, seq_len) tensor: the row-reading methods give the
    weighted sum of their scores for each row (as a span does)."""
    from conftest import make_batch, make_model

    from captum_attention import METHODS

    model = make_model("bert")
    batch = make_batch(model)
    explainer = METHODS[method](model)
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    weights = torch.zeros(batch.input_ids.shape)
    weights[:, :3] = torch.rand(len(weights), 3, generator=torch.Generator().manual_seed(0))  # rows every example holds
    rows = [explainer.attribute(batch.input_ids, query_index=row, **args) for row in range(3)]
    weighed = explainer.attribute(batch.input_ids, query_index=weights, **args)
    expected = sum(weights[:, row, None] * rows[row] for row in range(3))
    torch.testing.assert_close(weighed, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


@pytest.mark.parametrize("weights, error", [
    (lambda mask: torch.ones(mask.shape[0], mask.shape[1] + 1), r"shaped \(batch, seq_len\) = \(3, 9\), got \(3, 10\)"),
    (lambda mask: -mask.float(), "finite and non-negative"),
    (lambda mask: torch.ones(mask.shape), "weight on padding"),
    (lambda mask: torch.zeros(mask.shape).index_fill(1, torch.tensor([0]), 1.0).index_fill(0, torch.tensor([1]), 0.0), "gives an example no weight"),
])
def test_query_row_weights_out_of_place_are_one_clear_error(weights, error):
    from conftest import make_batch, make_model

    from captum_attention import AttentionRollout

    model = make_model("bert")
    batch = make_batch(model)
    with pytest.raises(ValueError, match=error) as refused:
        AttentionRollout(model).attribute(batch.input_ids, query_index=weights(batch.attention_mask), additional_forward_args=(batch.attention_mask,))
    assert "\n" not in str(refused.value)
