"""Bad input: a clear error that names the problem and the fix, and the model untouched."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import transformers as tf
from conftest import assert_refused_in_one_line, assert_same_state, make_batch, make_model, model_state

from captum_attention import (
    AttentionRollout, AttnLRP, DecompX, GradSAM, KnockoutGradient, LearnedAttention, ModuleAdapter, NormAttention, RawAttention,
    TransformerAttribution, UnsupportedModelError,
)
from captum_attention.attr import REGISTRY


@pytest.fixture
def setup():
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    yield model, batch
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("method", [AttnLRP, DecompX, KnockoutGradient, LearnedAttention, NormAttention])
def test_methods_without_maps_refuse_return_maps_in_one_line(setup, method):
    model, batch = setup
    with pytest.raises(ValueError, match=rf"^{method.__name__} [^\n]* has no maps: leave return_maps=False\.$"):
        method(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,), return_maps=True)


def test_target_out_of_range(setup):
    model, batch = setup
    for target in (3, -1, [0, 1, 5]):
        with pytest.raises(ValueError, match=r"out of range.*3 logits per example \(its classes"):
            GradSAM(model).attribute(batch.input_ids, target=target, additional_forward_args=(batch.attention_mask,))


def test_target_of_wrong_length_or_type(setup):
    model, batch = setup
    with pytest.raises(ValueError, match="one per example"):
        GradSAM(model).attribute(batch.input_ids, target=[0, 1], additional_forward_args=(batch.attention_mask,))
    with pytest.raises(TypeError, match="class indices"):
        GradSAM(model).attribute(batch.input_ids, target=torch.tensor([0.0, 1.0, 1.0]))


def test_a_target_given_as_text_is_refused_with_the_ids_to_give(setup):
    """A label's name or an answer's text (as Captum's LLMAttribution takes it) failed
    with torch's "new(): invalid data type 'str'"."""
    from lm_models import make_decoder, make_prompts

    model, batch = setup
    decoder, prompts = make_decoder("llama"), make_prompts(side="left")
    calls = {
        "positive": lambda: GradSAM(model).attribute(batch.input_ids, target="positive", additional_forward_args=(batch.attention_mask,)),
        "Paris": lambda: AttnLRP(decoder).attribute(prompts.input_ids, target="Paris", additional_forward_args=(prompts.attention_mask,)),
    }
    for text, call in calls.items():
        with pytest.raises(TypeError, match=rf"^target '{text}' is text, .* model\.config\.label2id\[label\], .* attribute_span"):
            call()


def test_inputs_and_mask_of_different_shapes(setup):
    model, batch = setup
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 8\) but the inputs are \(3, 9\)"):
        TransformerAttribution(model).attribute(
            batch.input_ids, target=0, additional_forward_args=(batch.attention_mask[:, :8],)
        )


def test_empty_batch(setup):
    model, batch = setup
    with pytest.raises(ValueError, match="empty batch"):
        RawAttention(model).attribute(batch.input_ids[:0], additional_forward_args=(batch.attention_mask[:0],))


def test_a_row_that_is_all_padding(setup):
    model, batch = setup
    mask = batch.attention_mask.clone()
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Examples \[1\] are all padding"):
        GradSAM(model).attribute(batch.input_ids, target=0, additional_forward_args=(mask,))


def test_float_token_ids(setup):
    model, batch = setup
    with pytest.raises(TypeError, match="token ids must be integers"):
        AttentionRollout(model).attribute(batch.input_ids.float(), additional_forward_args=(batch.attention_mask,))


def test_an_audio_models_waveform_is_refused_in_one_line():
    """A wav2vec 2.0 classifier's waveform (2-D floats) is no token ids nor embeddings."""
    config = tf.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=37, conv_dim=(16,), conv_stride=(5,),
        conv_kernel=(10,), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=2,
    )
    model = tf.Wav2Vec2ForSequenceClassification(config).eval()
    with pytest.raises(TypeError, match=r"\(2, 400\): token ids must be integers .* waveform \(input_values\) is not supported"):
        GradSAM(model).attribute(torch.randn(2, 400), target=0)


def test_a_speech_recognisers_audio_features_are_refused_in_one_line():
    """Whisper's log-mel features, given as the source of an encoder-decoder's pair, were
    passed on as embeddings: its encoder failed with an AttributeError."""
    config = tf.WhisperConfig(
        vocab_size=99, num_mel_bins=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        d_model=32, encoder_ffn_dim=37, decoder_ffn_dim=37, max_source_positions=10, max_target_positions=20, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
    )
    model = tf.WhisperForConditionalGeneration(config).eval()
    features, decoder = torch.randn(1, 8, 20), torch.tensor([[3, 5, 6]])
    refusal = r"^WhisperForConditionalGeneration reads audio \(input_features\): audio models are not supported, .*\.$"
    with pytest.raises(UnsupportedModelError, match=refusal):
        GradSAM(model).attribute((features, decoder), target=9)
    with pytest.raises(UnsupportedModelError, match=refusal):
        AttnLRP(model).attribute_span(features, torch.tensor([[5, 6]]))


def test_bool_or_3d_integer_inputs(setup):
    model, batch = setup
    with pytest.raises(TypeError, match="neither token ids"):
        RawAttention(model).attribute(batch.input_ids.bool())
    with pytest.raises(TypeError, match="neither token ids"):
        RawAttention(model).attribute(batch.input_ids[..., None])


def test_several_input_tensors(setup):
    model, batch = setup
    with pytest.raises(TypeError, match="one tensor"):
        RawAttention(model).attribute((batch.input_ids, batch.attention_mask))


def test_a_tokenizers_whole_output_or_an_array_as_inputs_says_what_to_pass(setup):
    model, batch = setup
    with pytest.raises(TypeError, match=r"got BatchEncoding.*pass its input_ids as inputs and \(its attention_mask,\)"):
        RawAttention(model).attribute(tf.BatchEncoding({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}))
    with pytest.raises(TypeError, match=r"got ndarray.*return_tensors='pt', or pass torch.as_tensor"):
        RawAttention(model).attribute(batch.input_ids.numpy())


def test_query_on_padding_or_outside(setup):
    model, batch = setup
    args = dict(additional_forward_args=(batch.attention_mask,))
    with pytest.raises(ValueError, match=r"padding token in examples \[1, 2\]"):
        AttentionRollout(model).attribute(batch.input_ids, query_index=7, **args)
    with pytest.raises(ValueError, match="outside the sequence"):
        AttentionRollout(model).attribute(batch.input_ids, query_index=9, **args)


def test_layer_options_out_of_range(setup):
    model, batch = setup
    with pytest.raises(ValueError, match=r"layer=3 is out of range: the model has 3 attention layers"):
        RawAttention(model).attribute(batch.input_ids, layer=3)
    with pytest.raises(ValueError, match="start_layer=-4 is out of range"):
        TransformerAttribution(model).attribute(batch.input_ids, target=0, start_layer=-4)


def test_rollout_options(setup):
    model, batch = setup
    with pytest.raises(ValueError, match="head_fusion"):
        AttentionRollout(model).attribute(batch.input_ids, head_fusion="median")
    with pytest.raises(ValueError, match="discard_ratio"):
        AttentionRollout(model).attribute(batch.input_ids, discard_ratio=1.0)


def test_an_encoder_decoder_given_one_input_is_told_to_pass_the_pair():
    """Captum's second positional input of an encoder-decoder is the decoder's ids: one
    input, its mask among the extra arguments, is refused in one line by the methods and by
    the metrics that run the model, not read with the mask as the decoder's ids."""
    from captum_attention.metrics import attention_erasure

    model = make_model("bart")
    ids = torch.randint(3, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    ids[:, -1] = 2
    mask = torch.ones_like(ids)
    pair = r"is an encoder-decoder: pass inputs=\(input_ids, decoder_input_ids\)"
    with pytest.raises(TypeError, match=pair):
        GradSAM(model).attribute(ids, target=1, additional_forward_args=(mask,))
    with pytest.raises(TypeError, match=pair):
        attention_erasure(model, ids, torch.zeros_like(ids, dtype=torch.bool), (mask,))


def test_forward_func_not_returning_logits(setup):
    model, batch = setup
    explainer = GradSAM(lambda ids: model(ids).logits.sum(), model=model)
    with pytest.raises(ValueError, match=r"logits of shape \(batch, num_classes\).* or one score per example \(3,\), got \(\)"):
        explainer.attribute(batch.input_ids, target=0)


def test_function_without_model():
    with pytest.raises(TypeError, match="model="):
        GradSAM(lambda ids: ids)


def test_adapter_returning_a_copy_of_the_probabilities(setup):
    model, batch = setup
    attention = [m for m in model.modules() if type(m).__name__ == "BertSelfAttention"]
    adapter = ModuleAdapter(attention, probs=lambda output: output[1].clone())
    model.set_attn_implementation("eager")
    try:
        with pytest.raises(UnsupportedModelError, match="returns a copy of the tensor that weights the values"):
            GradSAM(model, adapter=adapter).attribute(batch.input_ids, target=0)
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("method", [GradSAM, TransformerAttribution])
def test_gradient_methods_under_inference_mode(setup, method):
    model, batch = setup
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside inference_mode"):
        method(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    with torch.no_grad():  # gradients are enabled for the explanation itself
        method(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_under_inference_mode_a_forward_method_explains_and_a_gradient_method_says_why(name, capture_mode):
    """On a Llama without biases (DecompX's shares then read by a backward elsewhere): each
    method that needs one forward gives under ``torch.inference_mode()`` the scores it gives
    outside it (ALTI stopped at a tensor's version counter, DecompX at a tensor saved for
    backward); each that needs a backward refuses in one line."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    method = REGISTRY[name](model)
    if name == "attention_flow" and capture_mode == "streaming":
        pytest.skip("eager capture only: checked in the eager run")
    options = {"residual": True} if name == "norm_attention" else {}  # the layers' states read, as ALTI reads them
    explain = lambda: method.attribute(prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,), **options)  # noqa: E731
    if method.spec.needs != "forward":
        with torch.inference_mode(), pytest.raises(RuntimeError, match="switches off: call it outside inference_mode") as refused:
            explain()
        assert "\n" not in str(refused.value)
        return
    expected = explain()
    with torch.inference_mode():
        torch.testing.assert_close(explain(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_under_no_grad_every_method_explains_a_language_models_token(name):
    """NoiseTunnel and evaluation loops call the methods under ``torch.no_grad()``: the
    gradient methods read a language model's logits at the query row there, and that row,
    taken without gradients, was cut from the graph ("element 0 of tensors does not
    require grad"); a classifier's logits, read whole, were not."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    explain = lambda: REGISTRY[name](model).attribute(prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,))  # noqa: E731
    expected = explain()
    with torch.no_grad():
        torch.testing.assert_close(explain(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_inputs_made_under_inference_mode_are_explained_as_any_others(name):
    """Ids that ``generate`` returned under ``torch.inference_mode()``, and embeddings,
    targets and masks made there, cannot be saved for a backward: the gradient methods
    failed with torch's "Inference tensors cannot be saved for backward"."""
    from lm_models import make_decoder, make_prompts

    from captum_attention.metrics import gradient_ranking

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    forward_embeddings = lambda embeddings, mask: model(inputs_embeds=embeddings, attention_mask=mask).logits  # noqa: E731
    method, on_embeddings = REGISTRY[name](model), REGISTRY[name](forward_embeddings, model=model)
    ids, mask, targets, answer = prompts.input_ids, prompts.attention_mask, torch.tensor([5, 6, 7]), torch.tensor([[7, 8]] * 3)
    embeddings = model.get_input_embeddings()(ids).detach()

    def explained(ids, mask, targets, answer, embeddings):
        return (
            method.attribute(ids, target=targets, additional_forward_args=(mask,)),
            method.attribute_continuation(ids, answer, additional_forward_args=(mask,)),
            on_embeddings.attribute(embeddings, target=targets, additional_forward_args=(mask,)),
            gradient_ranking(model, ids, targets, (mask,)),
        )

    expected = explained(ids, mask, targets, answer, embeddings)
    with torch.inference_mode():
        made_there = tuple(t.clone() for t in (ids, mask, targets, answer, embeddings))
    torch.testing.assert_close(explained(*made_there), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_under_autocast_every_method_explains_the_model_in_its_own_precision(name):
    """Under ``torch.autocast`` each layer rounds to bfloat16 while the weights stay
    float32: raw attention returned bfloat16 scores, Value Zeroing's re-runs and
    ALTI-Logit's sum check refused the model in misleading words, and streaming and eager
    capture parted by about 1%. The call turns autocast off, says so, and gives the
    float32 scores; autocast is on again after it, also after a refused call."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    method = REGISTRY[name](model)
    explain = lambda **kwargs: method.attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,), **kwargs)  # noqa: E731
    expected = explain(target=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"torch\.autocast is on for cpu: .* turns it off for the call"):
            scores = explain(target=5)
        with pytest.raises(ValueError, match="query_index 100 is outside"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explain(target=5, query_index=100)
        assert torch.is_autocast_enabled("cpu")
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_with_a_float64_default_dtype_every_method_gives_the_float32_scores(name, family):
    """The library built its float32 buffers with torch's default dtype: with
    ``torch.set_default_dtype(torch.float64)`` Value Zeroing, KnockoutLRP and streamed
    Transformer Attribution failed on a float32 model with torch's dtype errors, and four
    methods returned float64 scores."""
    from lm_models import make_decoder, make_encoder_decoder, make_prompts

    if family == "t5":
        model = make_encoder_decoder("t5")
        source = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
        inputs, extra, target = (source, torch.tensor([[0, 7, 9], [0, 8, 4]])), None, 7
    else:
        model, prompts = make_decoder("llama"), make_prompts(side="left")
        inputs, extra, target = prompts.input_ids, (prompts.attention_mask,), 5
    method = REGISTRY[name]
    for capture in ("streaming", "eager"):
        explained = method(model, capture=capture)
        explain = lambda: explained.attribute(inputs, target=target, additional_forward_args=extra)  # noqa: E731
        try:
            expected = explain()
        except (UnsupportedModelError, ValueError):  # not this family's method, or not this capture's
            continue
        torch.testing.assert_close(_under_default_float64(explain), expected, rtol=0, atol=0)


def _under_default_float64(call):
    """``call()`` with ``torch.set_default_dtype(torch.float64)``, as a notebook may set it."""
    torch.set_default_dtype(torch.float64)
    try:
        return call()
    finally:
        torch.set_default_dtype(torch.float32)


def _metric_calls():
    """Each metric that reads the attention, as a call on a BERT classifier's batch, or on
    a Llama's prompts and answers."""
    from captum_attention import metrics

    def classifier(call):
        model = make_model("bert")
        batch = make_batch(model)
        return lambda: call(model, batch.input_ids, (batch.attention_mask,))

    def decoder(call):
        from lm_models import make_decoder, make_prompts

        model, prompts = make_decoder("llama"), make_prompts(side="left")
        answer = torch.tensor([[7, 8]] * 3)
        return lambda: call(model, prompts.input_ids, prompts.attention_mask, answer)

    def fit(model, ids, mask, answer):
        examples = [(ids[0], answer[0], torch.tensor([-1, 0, 0, 1, 1, 2, 2]))]
        return metrics.fit_head_weights(model, examples, num_ablations=4, progress=False).weights

    erased = lambda ids: torch.zeros_like(ids, dtype=torch.bool).index_fill_(1, torch.tensor([1]), True)  # noqa: E731
    return {
        "attention_erasure": classifier(lambda m, ids, args: metrics.attention_erasure(m, ids, erased(ids), args).__dict__),
        "decision_flip_fraction": classifier(
            lambda m, ids, args: metrics.decision_flip_fraction(m, ids, metrics.random_ranking(ids.shape), args).__dict__
        ),
        "attention_permutation": classifier(lambda m, ids, args: metrics.attention_permutation(m, ids, args, n_permutations=2).__dict__),
        "adversarial_attention": classifier(lambda m, ids, args: metrics.adversarial_attention(m, ids, args, layers=[0], steps=3).__dict__),
        "adversarial_keys": classifier(lambda m, ids, args: metrics.adversarial_keys(m, ids, args, layers=[0], steps=3).__dict__),
        "identifiability": classifier(lambda m, ids, args: metrics.identifiability(m, ids, args).__dict__),
        "attention_ranking": classifier(lambda m, ids, args: metrics.attention_ranking(m, ids, args)),
        "gradient_ranking": classifier(lambda m, ids, args: metrics.gradient_ranking(m, ids, 1, args)),
        "gradient_attention_ranking": classifier(lambda m, ids, args: metrics.gradient_attention_ranking(m, ids, 1, args)),
        "attention_shares": decoder(metrics.attention_shares),
        "fit_head_weights": decoder(fit),
    }


@pytest.mark.parametrize("name", sorted(_metric_calls()))
def test_under_autocast_the_metrics_that_read_the_attention_run_the_model_in_its_own_precision(name):
    """Under autocast these metrics part by autocast's rounding between capture modes, and
    identifiability read ranks from bfloat16 values (5 of 9 lower): they turn it off, say
    so, and give the float32 results."""
    call = _metric_calls()[name]
    expected = call()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match=rf"torch\.autocast is on for cpu: {name} "):
        result = call()
    _assert_same_result(result, expected)


@pytest.mark.parametrize("name", sorted(_metric_calls()))
def test_with_a_float64_default_dtype_the_metrics_give_the_float32_results(name):
    call = _metric_calls()[name]
    expected = call()
    _assert_same_result(_under_default_float64(call), expected)


def _assert_same_result(result, expected):
    """A metric's result equal to ``expected``, its fields' tensors (NaN where never
    flipped) and the calls' role names apart."""
    if isinstance(expected, dict):
        expected, result = ({key: value for key, value in fields.items() if key != "roles"} for fields in (expected, result))
    torch.testing.assert_close(result, expected, rtol=0, atol=0, equal_nan=True)


def test_with_a_float64_default_dtype_the_random_draws_are_the_same():
    """torch.rand draws other numbers in float64 from the same seed: ContextCite's
    ablations and the random ranking would change with the default dtype."""
    from captum_attention.metrics import random_ranking
    from captum_attention.metrics.token_removal import random_halves

    present = torch.ones(2, 9, dtype=torch.bool)
    def draws():
        return random_halves(present, 8, seed=3), random_halves(present, 8, 0, torch.tensor([5, 6])), random_ranking((2, 9), seed=3)

    torch.testing.assert_close(_under_default_float64(draws), draws(), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["value_zeroing", "alti_logit"])
def test_a_forward_func_under_autocast_is_named_where_its_rounding_breaks_a_check(name):
    """A ``forward_func`` that enters autocast itself runs as it is: Value Zeroing's
    float32 re-runs and ALTI-Logit's float32 sum check then part from its bfloat16
    products, and the refusal names autocast among the causes."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(5, 50, (2, 7))

    def under_autocast(input_ids, attention_mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=input_ids, attention_mask=attention_mask).logits

    method = REGISTRY[name](under_autocast, model=model)
    explain = lambda: method.attribute(ids, target=7, additional_forward_args=(torch.ones_like(ids),))  # noqa: E731
    with pytest.warns(UserWarning, match="forward_func runs LlamaForCausalLM under torch.autocast"):
        assert_refused_in_one_line(model, explain, "forward_func (runs it|that runs the model) under torch.autocast")


@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_a_forward_func_that_enters_autocast_itself_is_named_in_a_warning(capture):
    """Autocast entered inside ``forward_func`` is the user's to keep: the call runs it, and
    warns that the scores carry its rounding (the two capture modes part by it)."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")

    def under_autocast(input_ids, attention_mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=input_ids, attention_mask=attention_mask).logits

    explain = lambda forward: GradSAM(forward, model=model, capture=capture).attribute(  # noqa: E731
        prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
    )
    with pytest.warns(UserWarning, match=r"forward_func runs LlamaForCausalLM under torch\.autocast \(cpu\): .*rounding"):
        explain(under_autocast)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explain(lambda input_ids, attention_mask: model(input_ids=input_ids, attention_mask=attention_mask).logits)


def test_additional_forward_args_as_a_dict(setup):
    model, batch = setup
    with pytest.raises(TypeError, match="positional arguments .* got a dict"):
        GradSAM(model).attribute(batch.input_ids, target=0, additional_forward_args={"attention_mask": batch.attention_mask})


def test_a_continuation_without_tokens():
    from lm_models import make_decoder, make_prompts

    model = make_decoder("gpt2")
    prompts = make_prompts()
    with pytest.raises(ValueError, match="continuation has no tokens"):
        GradSAM(model).attribute_continuation(
            prompts.input_ids, prompts.input_ids[:, :0], additional_forward_args=(prompts.attention_mask,)
        )
    with pytest.raises(ValueError, match="continuation has no tokens"):  # an empty list is a float tensor to torch
        GradSAM(model).attribute_span(prompts.input_ids, [], additional_forward_args=(prompts.attention_mask,))
    with pytest.raises(ValueError, match=r"continuation must be token ids .* dtype torch\.bool"):  # torch.isin failed on it
        GradSAM(model).attribute_span(prompts.input_ids, torch.ones(3, 2, dtype=torch.bool), additional_forward_args=(prompts.attention_mask,))


def test_a_compiled_model_gets_the_scores_of_the_model(setup):
    """Exact in both capture modes (an eager capture runs the model's own code: the
    compiled graph would not use the probabilities its hooks put in the graph), and
    without Dynamo's warning that it cannot trace the hooks' thread check. Dynamo's
    graphs, not the backend's code, are what a capture meets: ``aot_eager`` compiles
    them in seconds instead of inductor's half a minute."""
    model, batch = setup
    compiled = torch.compile(model, backend="aot_eager")
    args = dict(target=0, additional_forward_args=(batch.attention_mask,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in (GradSAM, AttentionRollout):  # gradients through the eager maps; maps alone
            torch.testing.assert_close(
                method(compiled, capture="eager").attribute(batch.input_ids, **args), method(model, capture="eager").attribute(batch.input_ids, **args)
            )
        assert torch._dynamo.eval_frame._stance.stance == "default", "the compiled model runs compiled again"
        scores = TransformerAttribution(compiled).attribute(batch.input_ids, **args)
    torch.testing.assert_close(scores, TransformerAttribution(model).attribute(batch.input_ids, **args))
    assert not [str(w.message)[:300] for w in caught if "does not know how to trace" in str(w.message)]


def test_a_model_attending_over_another_sequence_too_names_both_attentions():
    """A text encoder and an image encoder in one model attend over different positions:
    the refusal names both and what to pass."""
    from lm_models import make_vision

    text, vision = make_model("bert"), make_vision("vit")
    for part in (text, vision):
        part.set_attn_implementation("eager")

    class TextAndImage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text, self.vision = text, vision

        def forward(self, input_ids, attention_mask):
            pixels = torch.zeros(len(input_ids), 3, 16, 16)
            return self.text(input_ids, attention_mask=attention_mask).logits[:, :3] + self.vision(pixels).logits

    model = TextAndImage().eval()
    batch = make_batch(text)
    with pytest.raises(UnsupportedModelError, match=r"ViTAttention \(attention call 3\) attends over 17 positions, "
                       r"while BertSelfAttention \(call 0\) attends over the 9 input tokens") as refused:
        GradSAM(model, model=model, capture="eager").attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert "\n" not in str(refused.value) and "ModuleAdapter" in str(refused.value)

def test_a_model_quantized_by_torch_is_refused_by_the_methods_that_need_its_gradients_or_linear_maps(setup):
    """``quantize_dynamic``'s linear layers carry no gradient and quantize each input
    apart: AttnLRP returned 0 for every token and DecompX shares that do not add up to
    its logits. The methods that read only its attention and outputs explain it as they
    explain any model: raw attention's scores are its own attention's."""
    model, batch = setup
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    args = dict(target=0, additional_forward_args=(batch.attention_mask,))
    for name, method in REGISTRY.items():
        if _reads_linear_maps(method):
            assert_refused_in_one_line(
                quantized, lambda: method(quantized).attribute(batch.input_ids, **args),
                rf"^{re.escape(method.get_name())} runs a backward .* quantize their inputs "
                r"\(bert\.encoder\.layer\.0\.attention\.self\.query: torch\.ao\.nn\.quantized\.dynamic\.modules\.linear\.Linear\)",
            )
    quantized.set_attn_implementation("eager")
    attentions = quantized(batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True).attentions
    expected = attentions[-1].mean(dim=1)[:, 0] * batch.attention_mask
    quantized.set_attn_implementation("sdpa")
    torch.testing.assert_close(RawAttention(quantized).attribute(batch.input_ids, **args), expected)


def _reads_linear_maps(method) -> bool:
    """Whether ``method`` runs a backward through the layers or reads them as linear maps."""
    return method.spec.needs != "forward" or method.spec.reads_target or method.spec.reads_weights


@pytest.mark.parametrize("quantizer", ["torchao", "optimum-quanto"])
def test_layers_that_quantize_their_inputs_as_tensor_subclasses_are_refused_as_torchs_are(quantizer):
    """torchao's dynamic activation quantization and optimum-quanto's activation types
    quantize each layer's input, as torch's quantized modules do: the gradient methods
    failed with "element 0 of tensors does not require grad" or were told that the model
    runs its attention under torch.no_grad, ALTI that no norm takes the attention's sum.
    They are refused in one line naming the layer; the methods that read only the
    attention and the outputs explain the model as it computes."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    if quantizer == "torchao":
        torchao = pytest.importorskip("torchao.quantization")
        torchao.quantize_(model, torchao.Int8DynamicActivationInt8WeightConfig())
        layer = r"torch\.nn\.modules\.linear\.Linear, its weight a Int8Tensor"
    else:
        quanto = pytest.importorskip("optimum.quanto")
        quanto.quantize(model, weights=quanto.qint8, activations=quanto.qint8)
        quanto.freeze(model)
        layer = r"optimum\.quanto\.nn\.qlinear\.QLinear, its weight a WeightQBytesTensor"
    args = dict(target=5, additional_forward_args=(prompts.attention_mask,))
    for name, method in REGISTRY.items():
        explain = lambda: method(model).attribute(prompts.input_ids, **args)  # noqa: E731
        if _reads_linear_maps(method):
            assert_refused_in_one_line(
                model, explain, rf"^{re.escape(method.get_name())} runs a backward .* quantize their inputs "
                rf"\(model\.layers\.0\.self_attn\.q_proj: {layer}\)",
            )
        else:
            assert torch.isfinite(explain()).all()


def _dequantized_twin(model, quantized):
    """``model`` with each weight that ``quantized`` holds as a tensor subclass replaced
    by its dequantized matrix: the float model that the quantized one computes."""
    twin, quantized_modules = copy.deepcopy(model), dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            weight = getattr(quantized_modules.get(name), "weight", None)
            if isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, torch.nn.Parameter):
                module.weight.copy_(weight.dequantize())
    return twin


@pytest.mark.parametrize("quantizer", ["torchao", "optimum-quanto"])
def test_weights_quantized_as_tensor_subclasses_are_explained_as_their_dequantized_model(quantizer):
    """torchao's and optimum-quanto's weight-only quantization keep ``nn.Linear`` layers
    that multiply by a dequantized weight: every method explains such a Llama as its float
    twin with those weights. ALTI, ALTI-Logit and the norms read the output projection and
    the unembedding as matrices, which torchao's weights are not: they failed with its
    "Int8Tensor dispatch: attempting to run unimplemented operator"."""
    from lm_models import make_decoder, make_prompts

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    quantized = copy.deepcopy(model)
    if quantizer == "torchao":
        torchao = pytest.importorskip("torchao.quantization")  # Linux wheels only
        torchao.quantize_(quantized, torchao.Int8WeightOnlyConfig())
    else:
        quanto = pytest.importorskip("optimum.quanto")
        quanto.quantize(quantized, weights=quanto.qint8)
        quanto.freeze(quantized)
    twin = _dequantized_twin(model, quantized)
    assert type(quantized.model.layers[0].self_attn.o_proj.weight) not in (torch.Tensor, torch.nn.Parameter)
    args = dict(target=5, additional_forward_args=(prompts.attention_mask,))
    for name, method in REGISTRY.items():
        before = model_state(quantized)
        scores = method(quantized).attribute(prompts.input_ids, **args)
        assert_same_state(before, model_state(quantized))
        expected = method(twin).attribute(prompts.input_ids, **args)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(), msg=name)


def test_a_decoder_given_a_generation_cache_is_refused_in_one_line():
    """Tokens read beside a cache of earlier ones attend over positions that no input
    stands for: the refusal says to pass the whole sequence."""
    from lm_models import make_decoder

    model = make_decoder("gpt2")
    prefix, ids = torch.randint(3, 50, (1, 5)), torch.randint(3, 50, (1, 4))
    with torch.no_grad():
        cache = model(prefix, use_cache=True).cache
    forward = lambda tokens: model(tokens, cache=copy.deepcopy(cache)).logits[:, -1]  # noqa: E731
    for method in (GradSAM, AttnLRP, RawAttention):
        assert_refused_in_one_line(model, lambda: method(forward, model=model).attribute(ids, target=3),
                                   r"attends over 9 positions for the 4 input tokens: .* generation cache passed to it "
                                   r"\(cache, past_key_values: pass the whole sequence instead")


def test_a_torchscript_model_is_named_in_the_refusal():
    """A traced model runs no Python forward: its attention can be neither found nor captured."""
    from captum_attention.capture import AttentionNotFoundError

    model = make_model("bert")
    batch = make_batch(model)
    traced = torch.jit.trace(model, (batch.input_ids, batch.attention_mask), strict=False)
    with pytest.raises(AttentionNotFoundError, match=r"^TopLevelTracedModule is a TorchScript module, .*: explain the model it was"):
        GradSAM(traced).attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,))
    forward = lambda ids, mask: traced(ids, mask)["logits"]  # noqa: E731
    with pytest.raises(RuntimeError, match="ran no attention module of `model`: .* not a TorchScript or exported copy of it"):
        GradSAM(forward, model=model).attribute(batch.input_ids, target=1, additional_forward_args=(batch.attention_mask,))


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_more_tokens_than_the_models_positions_is_named_in_one_line(family, capture):
    """BERT fails with "expanded size", GPT-2 with "index out of range": the error says why."""
    from lm_models import make_decoder

    model = make_model("bert") if family == "bert" else make_decoder("gpt2")
    limit = model.config.max_position_embeddings
    ids = torch.randint(5, 30, (2, limit + 3))
    before = model_state(model)
    with pytest.raises(ValueError, match=rf"hold {limit + 3} tokens and .* has positions for {limit} \(config\.max_position_"
                       rf"embeddings\).*truncation=True, max_length={limit}") as refused:
        GradSAM(model, capture=capture).attribute(ids, target=0, additional_forward_args=(torch.ones_like(ids),))
    assert "\n" not in str(refused.value) and isinstance(refused.value.__cause__, (RuntimeError, IndexError))
    assert_same_state(before, model_state(model))
    GradSAM(model, capture=capture).attribute(ids[:, :limit], target=0, additional_forward_args=(torch.ones_like(ids[:, :limit]),))


@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_a_position_table_that_reserves_rows_before_its_first_position_takes_that_many_fewer_tokens(capture):
    """RoBERTa's kind counts positions from its padding id + 1: 64 rows take 62 tokens. 63
    failed with torch's unnamed "index out of range", and the reports' length limit (a
    tokenizer saved without ``model_max_length``) said 64."""
    from types import SimpleNamespace

    from captum_attention.presentation.explain import length_limit

    torch.manual_seed(0)
    model = tf.RobertaForSequenceClassification(tf.RobertaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=64, pad_token_id=1,
    )).eval()
    ids = torch.randint(5, 30, (1, 63))
    with pytest.raises(ValueError, match=r"hold 63 tokens and RobertaForSequenceClassification has positions for 62 "
                       r"\(config\.max_position_embeddings less the 2 rows before its first position\).*max_length=62"):
        GradSAM(model, capture=capture).attribute(ids, target=0, additional_forward_args=(torch.ones_like(ids),))
    GradSAM(model, capture=capture).attribute(ids[:, :62], target=0, additional_forward_args=(torch.ones_like(ids[:, :62]),))
    assert length_limit(model, SimpleNamespace(model_max_length=int(1e30))) == 62
    assert length_limit(make_model("bert"), SimpleNamespace(model_max_length=int(1e30))) == make_model("bert").config.max_position_embeddings


def test_a_quantised_position_table_and_an_alibi_bias_of_fixed_length_bound_the_tokens():
    """I-BERT's position table is its own quantised embedding (no ``nn.Embedding``), with
    RoBERTa's padding row: 64 rows take 62 tokens. MPT's ALiBi bias is built for
    ``max_seq_len`` positions and has no table. Past either, the forward failed with
    torch's unnamed error, and the reports' length limit (a tokenizer saved without
    ``model_max_length``) was 64 for I-BERT, 512 for MPT."""
    from types import SimpleNamespace

    from captum_attention.presentation.explain import length_limit

    torch.manual_seed(0)
    ibert = tf.IBertForSequenceClassification(tf.IBertConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32,
        max_position_embeddings=64, pad_token_id=1,
    )).eval()
    mpt = tf.MptForSequenceClassification(tf.MptConfig(
        vocab_size=40, d_model=32, n_layers=1, n_heads=4, max_seq_len=48, pad_token_id=0,
    )).eval()
    untold = SimpleNamespace(model_max_length=int(1e30))
    for model, limit, source in ((ibert, 62, "max_position_embeddings less the 2 rows before its first position"),
                                 (mpt, 48, "max_seq_len")):
        assert length_limit(model, untold) == limit
        ids = torch.randint(5, 30, (1, limit + 1))
        with pytest.raises(ValueError, match=rf"hold {limit + 1} tokens and {type(model).__name__} has positions for {limit} "
                           rf"\(config\.{source}\).*max_length={limit}"):
            GradSAM(model).attribute(ids, target=0, additional_forward_args=(torch.ones_like(ids),))
        GradSAM(model).attribute(ids[:, :limit], target=0, additional_forward_args=(torch.ones_like(ids[:, :limit]),))


@pytest.mark.parametrize("outside", [1000, -100])
@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_token_ids_outside_the_vocabulary_are_named_in_one_line(outside, capture):
    """Another tokenizer's ids, or -100 labels as padding: torch said "index out of range in self"."""
    model = make_model("bert")
    batch = make_batch(model)
    ids = batch.input_ids.clone()
    ids[0, -1] = outside
    rows = model.get_input_embeddings().num_embeddings
    before = model_state(model)
    with pytest.raises(ValueError, match=rf"Token ids \[{outside}\] lie outside the vocabulary of "
                       rf"BertForSequenceClassification \({rows} ids, 0 to {rows - 1}\): give ids from the model's own "
                       rf"tokenizer{' and no -100' if outside == -100 else '.$'}") as refused:
        GradSAM(model, capture=capture).attribute(ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert "\n" not in str(refused.value) and isinstance(refused.value.__cause__, IndexError)
    assert_same_state(before, model_state(model))


def test_the_metrics_own_forwards_name_ids_outside_the_vocabulary_and_too_many_tokens():
    """The token-removal and context metrics run the model themselves, past the capture."""
    from lm_models import make_decoder

    from captum_attention.metrics import comprehensiveness, top_k_log_prob_drop

    classifier = make_model("bert")
    batch = make_batch(classifier)
    ids = batch.input_ids.clone()
    ids[0, -1] = -100
    with pytest.raises(ValueError, match=r"Token ids \[-100\] lie outside .* and no -100 \(a label's ignore index"):
        comprehensiveness(classifier, ids, batch.attention_mask, torch.rand(ids.shape), target=0)
    model = make_decoder("gpt2")
    limit = model.config.max_position_embeddings
    prompt, answer = torch.randint(5, 30, (1, limit - 1)), torch.randint(5, 30, (1, 3))
    with pytest.raises(ValueError, match=rf"hold \d+ tokens and GPT2LMHeadModel has positions for {limit} "):
        top_k_log_prob_drop(model, prompt, torch.ones_like(prompt), answer, torch.rand(prompt.shape), ks=(1,))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_decoders_answer_labels_with_minus_100_are_named(family):
    """Hugging Face's labels mark ignored positions -100; the last answer token is never
    fed to the decoder, so only its logit's index failed, as a bare RuntimeError."""
    from lm_models import make_encoder_decoder

    from captum_attention.metrics import top_k_log_prob_drop

    model = make_encoder_decoder(family)
    prompt = torch.randint(5, 30, (2, 6))
    labels = torch.randint(5, 30, (2, 3))
    labels[1, -1] = -100
    refused = r"^Token ids \[-100\] lie outside the vocabulary of .* and no -100 \(a label's ignore index, no token\)\.$"
    with pytest.raises(ValueError, match=refused):
        AttnLRP(model).attribute_span(prompt, labels, additional_forward_args=(torch.ones_like(prompt),))
    with pytest.raises(ValueError, match=refused):
        top_k_log_prob_drop(model, prompt, torch.ones_like(prompt), labels, torch.rand(prompt.shape), ks=(1,))


@pytest.mark.parametrize("capture", ["streaming", "eager"])
def test_a_mask_given_as_a_list_is_named(setup, capture):
    """``additional_forward_args=[mask]`` (Captum passes a list whole, as one argument) or
    a tokenizer's lists: the capture read the mask's shape off a list."""
    model, batch = setup
    for extra in ([batch.attention_mask], (batch.attention_mask.tolist(),)):
        with pytest.raises(TypeError, match=r"^attention_mask is a list, not a tensor \(batch, seq_len\): give a tensor .*"
                           r"additional_forward_args as a tuple"):
            GradSAM(model, capture=capture).attribute(batch.input_ids, target=0, additional_forward_args=extra)


def test_one_texts_ids_without_their_batch_dimension_are_told_to_get_it(setup):
    model, batch = setup
    with pytest.raises(TypeError, match=r"shape \(\d+,\) .*: one text's ids need their batch dimension, inputs\.unsqueeze\(0\)\.$"):
        GradSAM(model).attribute(batch.input_ids[0], target=0)


def test_a_failure_past_the_limit_of_a_model_without_learned_positions_is_its_own():
    """Llama's rotary positions have no table: its max_position_embeddings bounds nothing,
    and a forward that fails past it fails for its own reason."""
    from lm_models import make_decoder

    model = make_decoder("llama")
    ids = torch.randint(5, 30, (1, model.config.max_position_embeddings + 3))

    def failing(input_ids, attention_mask):
        model(input_ids, attention_mask=attention_mask)
        raise RuntimeError("the forward's own failure")

    with pytest.raises(RuntimeError, match="^the forward's own failure$"):
        GradSAM(failing, model=model).attribute(ids, target=0, additional_forward_args=(torch.ones_like(ids),))
