"""Streaming capture: equal to eager capture, leaves nothing behind, says when it cannot stream.

The exactness and invariance tests of every family run in both modes (the ``capture_mode``
fixture); these tests compare the two modes directly where eager alone has no reference:
erasure through the kernel, block sizes, the wrapper's lifetime, threads and fallbacks.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import assert_same_state, counted, make_batch, make_model, model_state
from lm_models import EXPLICIT_DECODERS, make_decoder, make_encoder_decoder, make_prompts, make_vision
from methods import METHODS
from plain_models import make_plain
from test_encoder_decoder import make_pair

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution
from captum_attention._compat import attention_function
from captum_attention.attr import REGISTRY
from captum_attention.maps import kernel
from captum_attention.maps import streaming
from captum_attention.metrics import attention_erasure, decision_flip_fraction, random_ranking


def _case(name: str):
    """``(model, inputs, additional_forward_args, real (B, tokens))`` for one family."""
    if name in ("bert", "distilbert"):
        model = make_model(name)
        batch = make_batch(model)
        return model, batch.input_ids, (batch.attention_mask,), batch.attention_mask.bool()
    if name in ("gpt2", "llama", "qwen2", *EXPLICIT_DECODERS):
        prompts = make_prompts(side="left")
        return make_decoder(name), prompts.input_ids, (prompts.attention_mask,), prompts.real
    if name in ("t5", "bart"):
        pair = make_pair()
        return make_encoder_decoder(name), (pair.source, pair.target), pair.args, pair.args[0].bool()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    return make_vision(name), pixels, None, torch.ones(2, 17 if name == "vit" else 18, dtype=torch.bool)


FAMILIES = ("bert", "distilbert", "gpt2", "llama", "qwen2", "t5", "bart", "vit", "deit")


def _rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    scale = expected.abs().max().clamp(min=1e-30).item()
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers, heads", [(None, None), ([0, -1], [1, 2])])
def test_erasure_through_the_kernel_equals_eager_erasure(family, layers, heads):
    model, inputs, args, real = _case(family)
    erased = real & (torch.rand(real.shape, generator=torch.Generator().manual_seed(0)) < 0.4)
    erased[:, 0] = False
    options = dict(layers=layers, heads=heads)
    streamed = attention_erasure(model, inputs, erased, args, capture="streaming", **options)
    eager = attention_erasure(model, inputs, erased, args, capture="eager", **options)
    _rel_close(streamed.original, eager.original)
    _rel_close(streamed.erased, eager.erased)
    assert (streamed.erased - streamed.original).abs().max() > 1e-4, "the erasure should move the output"


@pytest.mark.parametrize("family", ("bert", "llama", "t5", "vit"))
def test_decision_flip_through_the_kernel_equals_eager(family):
    model, inputs, args, real = _case(family)
    ranking = random_ranking(real.shape, seed=2)
    streamed = decision_flip_fraction(model, inputs, ranking, args, capture="streaming", max_batch_size=5)
    eager = decision_flip_fraction(model, inputs, ranking, args, capture="eager", max_batch_size=5)
    torch.testing.assert_close(streamed.removed, eager.removed)
    torch.testing.assert_close(streamed.attention_mass_removed, eager.attention_mass_removed, equal_nan=True)


@pytest.mark.parametrize("name", list(METHODS))
def test_one_row_per_block_gives_the_same_scores(name):
    model, ids, args, _ = _case("llama")
    cls, options = METHODS[name].cls, METHODS[name].options
    whole = cls(model, capture="streaming").attribute(ids, additional_forward_args=args, **options)
    by_rows = cls(model, capture="streaming", block_memory=1).attribute(ids, additional_forward_args=args, **options)
    _rel_close(by_rows, whole)


@pytest.mark.parametrize("family", ("bert", "t5"))
def test_blocks_of_every_head_give_the_same_scores_as_blocks_of_one_head(family, monkeypatch):
    """Bidirectional calls: a GPU's blocks (every head) against a CPU's (one head)."""
    model, inputs, args, real = _case(family)
    erased = real & (torch.rand(real.shape, generator=torch.Generator().manual_seed(0)) < 0.4)
    erased[:, 0] = False

    def everything():
        scores = [
            METHODS[name].cls(model, capture="streaming", block_memory=2**14).attribute(
                inputs, additional_forward_args=args, **METHODS[name].options
            )
            for name in METHODS
        ]
        return scores + [attention_erasure(model, inputs, erased, args, capture="streaming").erased]

    one_head = everything()
    monkeypatch.setitem(kernel.ONE_HEAD_PER_BLOCK, "cpu", False)
    for every_head, expected in zip(everything(), one_head):
        for actual, wanted in zip(*(x if isinstance(x, tuple) else (x,) for x in (every_head, expected))):
            _rel_close(actual, wanted)


@pytest.fixture
def compiled_blocks(monkeypatch):
    """Every call reduces its blocks with the compiled functions, as calls of 2k+ tokens do."""
    monkeypatch.setattr(streaming, "FUSED_MIN_PAIRS", 0)
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(streaming, "_COMPILED", {})
    return streaming._COMPILED


def _gradient_scores(model, inputs, args, target=1):
    """Grad-SAM (both axes; the key axis only for one stack) and Transformer Attribution, streamed."""
    axes = ("query",) if isinstance(inputs, tuple) else ("query", "key")
    return [
        *(GradSAM(model, capture="streaming").attribute(inputs, target=target, additional_forward_args=args, axis=axis) for axis in axes),
        TransformerAttribution(model, capture="streaming").attribute(inputs, target=target, additional_forward_args=args),
    ]


def _flat(scores):
    return [part for score in scores for part in (score if isinstance(score, tuple) else (score,))]


@pytest.mark.parametrize("family", ("bert", "llama", "t5", "vit"))
def test_compiled_block_reductions_equal_eager_ones(family, monkeypatch, compiled_blocks, caplog):
    model, inputs, args, _ = _case(family)
    with caplog.at_level("DEBUG", logger=streaming.__name__):
        compiled = _gradient_scores(model, inputs, args)
    assert compiled_blocks and all(fn is not None for fn in compiled_blocks.values()), "the compiled path should run"
    assert "compiled block reductions reduce a call" in caplog.text
    monkeypatch.setitem(streaming.FUSED_DEVICES, "cpu", False)
    for actual, expected in zip(_flat(compiled), _flat(_gradient_scores(model, inputs, args))):
        _rel_close(actual, expected)


def test_a_failing_compiler_falls_back_to_eager(monkeypatch, compiled_blocks, failing_compiler, caplog):
    model, ids, args, _ = _case("bert")
    monkeypatch.setitem(streaming.FUSED_DEVICES, "cpu", False)
    expected = _gradient_scores(model, ids, args)
    monkeypatch.setitem(streaming.FUSED_DEVICES, "cpu", True)
    with caplog.at_level("DEBUG", logger=streaming.__name__):
        for actual, wanted in zip(_flat(_gradient_scores(model, ids, args)), _flat(expected)):
            _rel_close(actual, wanted)
    assert compiled_blocks and all(fn is None for fn in compiled_blocks.values()), "a failure is remembered"
    assert failing_compiler in caplog.text


@pytest.mark.parametrize("cls", [GradSAM, AttentionRollout])
def test_the_kernel_wrapper_lives_only_during_the_call(cls):
    model, ids, args, _ = _case("bert")
    original = attention_function("sdpa")
    before = model_state(model)
    cls(model, capture="streaming").attribute(ids, target=1, additional_forward_args=args)
    assert attention_function("sdpa") is original
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_call_leaves_the_kernel_and_the_model_as_found(error):
    model, ids, args, _ = _case("llama")
    original = attention_function("sdpa")
    before = model_state(model)
    layer = model.model.layers[1].self_attn

    def interrupt(module, inputs, output):
        raise error("interrupted")

    handle = layer.register_forward_hook(interrupt)
    try:
        with pytest.raises(error):
            GradSAM(model, capture="streaming").attribute(ids, additional_forward_args=args)
    finally:
        handle.remove()
    assert attention_function("sdpa") is original
    assert_same_state(before, model_state(model))


def test_other_threads_run_the_kernel_untouched_during_a_capture():
    model, ids, args, _ = _case("bert")
    other = make_model("bert", seed=1)
    expected = other(ids, attention_mask=args[0]).logits
    started, release, seen = threading.Event(), threading.Event(), []
    layer = model.bert.encoder.layer[0].attention.self

    def pause(module, inputs):
        started.set()
        release.wait(timeout=30)

    def run_other() -> None:
        started.wait(timeout=30)
        seen.append(other(ids, attention_mask=args[0]).logits)
        release.set()

    handle = layer.register_forward_pre_hook(pause)
    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        scores = GradSAM(model, capture="streaming").attribute(ids, target=1, additional_forward_args=args)
    finally:
        handle.remove()
        release.set()
        thread.join()
    torch.testing.assert_close(seen[0], expected)
    eager = GradSAM(model, capture="eager").attribute(ids, target=1, additional_forward_args=args)
    _rel_close(scores, eager)


@pytest.mark.parametrize(("loaded", "capture"), [("eager", "streaming"), ("sdpa", "eager")])
def test_another_thread_runs_the_model_as_loaded_while_a_capture_switches_it(loaded, capture):
    """A capture runs the model with another attention implementation (sdpa to stream, eager
    to read the maps); a plain forward of the same model in another thread meanwhile runs
    the implementation the model was loaded with, logits and gradients bit-equal."""
    model = make_decoder("llama")
    model.set_attn_implementation(loaded)
    prompts = make_prompts(side="left")
    ids, mask = prompts.input_ids, prompts.attention_mask
    alone = copy.deepcopy(model)

    def forward_and_grad(m):
        logits = m(input_ids=ids, attention_mask=mask).logits
        weight = m.model.layers[0].self_attn.q_proj.weight
        (grad,) = torch.autograd.grad(logits[:, -1].sum(), weight)
        return logits.detach(), grad

    expected = forward_and_grad(alone)
    started, release, seen = threading.Event(), threading.Event(), []
    capturing = threading.get_ident()

    def pause(module, inputs):
        if threading.get_ident() == capturing:
            started.set()
            release.wait(timeout=30)

    handle = model.model.layers[0].self_attn.register_forward_pre_hook(pause)

    def run_other() -> None:
        started.wait(timeout=30)
        seen.append(forward_and_grad(model))
        release.set()

    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        GradSAM(model, capture=capture).attribute(ids, target=5, additional_forward_args=(mask,))
    finally:
        handle.remove()
        release.set()
        thread.join()
    assert model.config._attn_implementation == loaded
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)


def test_auto_says_why_it_falls_back_to_eager():
    model, ids, args, _ = _case("bert")
    explainer = AttentionRollout(model)
    explainer.attribute(ids, additional_forward_args=args, discard_ratio=0.5)
    assert explainer.last_capture == "eager: discard_ratio ranks every entry of each fused map"
    explainer.attribute(ids, additional_forward_args=args, return_maps=True)
    assert explainer.last_capture == "eager: return_maps=True needs the full maps"
    explainer.attribute(ids, additional_forward_args=args)
    assert explainer.last_capture == "streaming"
    seq2seq, pair, pair_args, _ = _case("t5")
    explainer = TransformerAttribution(seq2seq)
    explainer.attribute(pair, additional_forward_args=pair_args)
    assert explainer.last_capture == "streaming"
    plain = make_plain("mha")
    batch = make_batch(plain)
    explainer = RawAttention(plain)
    explainer.attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    assert "MultiheadAttentionAdapter does not run attention" in explainer.last_capture


def test_asking_for_streaming_where_it_is_impossible_is_a_clear_error():
    model, ids, args, _ = _case("bert")
    with pytest.raises(ValueError, match="capture='streaming' is not possible here: return_maps=True"):
        RawAttention(model, capture="streaming").attribute(ids, additional_forward_args=args, return_maps=True)
    plain = make_plain("mha")
    batch = make_batch(plain)
    with pytest.raises(ValueError, match="capture='streaming'"):
        attention_erasure(plain, batch.input_ids, batch.attention_mask.bool(), (batch.attention_mask,), capture="streaming")
    with pytest.raises(ValueError, match="capture must be one of"):
        GradSAM(model, capture="fast")


def test_an_eager_loaded_model_streams_through_sdpa_and_is_switched_back():
    model, ids, args, _ = _case("llama")
    model.set_attn_implementation("eager")
    before = model_state(model)
    explainer = TransformerAttribution(model)
    streamed = explainer.attribute(ids, additional_forward_args=args)
    assert explainer.last_capture == "streaming"
    assert_same_state(before, model_state(model))
    eager = TransformerAttribution(model, capture="eager").attribute(ids, additional_forward_args=args)
    _rel_close(streamed, eager)


def test_a_method_without_a_streaming_reduction_runs_eager():
    class Unstreamed(RawAttention):
        spec = dataclasses.replace(RawAttention.spec, name="", streams=False)

    model, ids, args, _ = _case("bert")
    explainer = Unstreamed(model)
    scores = explainer.attribute(ids, additional_forward_args=args)
    assert explainer.last_capture == "eager: Unstreamed has no streaming reduction"
    _rel_close(scores, RawAttention(model, capture="eager").attribute(ids, additional_forward_args=args))


_PERMUTATION_BLOCKS = {
    "every example at once": lambda call: None,
    "one example at a time": lambda call: 16 * call.num_heads * call.num_queries * call.num_keys,
    "one head at a time": lambda call: 16 * call.num_queries * call.num_keys,
    "two rows at a time": lambda call: 32 * call.num_keys,
}


@pytest.mark.parametrize("blocks", list(_PERMUTATION_BLOCKS))
@pytest.mark.parametrize("family", ("bert", "llama", "bart", "vit"))
def test_permutation_through_blocks_of_rows_equals_eager_permutation(family, blocks, monkeypatch):
    """In every size of block (the budget the rows are computed in), the streamed
    permutations are eager capture's: each entry's draw is hashed from where it is."""
    from captum_attention.maps import kernel
    from captum_attention.metrics import attention_permutation, permutation

    budget = _PERMUTATION_BLOCKS[blocks]
    monkeypatch.setattr(
        permutation, "transformed_output", lambda call, transform: kernel.transformed_output(call, transform, budget(call))
    )
    model, inputs, args, _ = _case(family)
    options = dict(layers=[0, -1], heads=[0, 3], n_permutations=3, seed=4)
    streamed = attention_permutation(model, inputs, args, capture="streaming", **options)
    eager = attention_permutation(model, inputs, args, capture="eager", **options)
    _rel_close(streamed.median_tvd, eager.median_tvd, rel=1e-4)
    _rel_close(streamed.median_js_divergence, eager.median_js_divergence, rel=1e-4)
    assert streamed.median_tvd.max() > 1e-4, "the permutation should move the output"
    torch.testing.assert_close(streamed.flip_rate, eager.flip_rate)


@pytest.mark.parametrize("family", ("bert", "llama", "vit"))
@pytest.mark.parametrize("kind", ("attention_ranking", "gradient_ranking", "gradient_attention_ranking"))
def test_rankings_from_one_recomputed_row_equal_eager(family, kind):
    from captum_attention import metrics

    model, inputs, args, _ = _case(family)
    ranking = getattr(metrics, kind)
    streamed = ranking(model, inputs, additional_forward_args=args, layer=1, capture="streaming")
    eager = ranking(model, inputs, additional_forward_args=args, layer=1, capture="eager")
    assert eager.abs().max() > 0
    _rel_close(streamed, eager)


@pytest.mark.parametrize("name", list(METHODS))
def test_bfloat16_models_stream_within_their_precision(name):
    model, ids, args, _ = _case("llama")
    model = model.to(torch.bfloat16)
    cls, options = METHODS[name].cls, METHODS[name].options
    streamed = cls(model, capture="streaming").attribute(ids, additional_forward_args=args, **options)
    eager = cls(model, capture="eager").attribute(ids, additional_forward_args=args, **options)
    assert streamed.dtype == torch.float32 and torch.isfinite(streamed).all()
    _rel_close(streamed, eager.float(), rel=5e-2)


def test_rollout_at_3k_tokens_equals_a_float64_reference_in_both_modes():
    """Rollout's query row sums over thousands of keys per layer: it accumulates in float64
    (in float32 both modes drifted 5e-5 to 1e-4 from the reference at 3k tokens)."""
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=4096, num_labels=3, initializer_range=0.3,
    )
    model = tf.BertForSequenceClassification(config).eval()
    length = 3072
    ids = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = reference(ids, attention_mask=mask, output_attentions=True).attentions
    row = torch.zeros(length, dtype=torch.float64)
    row[0] = 1.0
    for attn in reversed(attentions):
        fused = 0.5 * attn[0].mean(0) + 0.5 * torch.eye(length, dtype=torch.float64)
        row = row @ (fused / fused.sum(-1, keepdim=True))
    for capture in ("streaming", "eager"):
        scores = AttentionRollout(model, capture=capture).attribute(ids, additional_forward_args=(mask,))
        _rel_close(scores[0].double(), row)


def test_a_process_reduces_eagerly_until_that_has_cost_as_much_as_compiling(monkeypatch):
    """The first calls of a process do not stall on compiling: blocks run eagerly until
    COMPILE_AFTER_SECONDS of eager reductions have passed, then compiled, same scores."""
    model, ids, args, _ = _case("bert")
    monkeypatch.setattr(streaming, "FUSED_MIN_PAIRS", 0)
    monkeypatch.setattr(streaming, "_COMPILED", {})
    monkeypatch.setattr(streaming, "_EAGER_SECONDS", {})
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", 3600.0)
    eager = _gradient_scores(model, ids, args)
    assert not streaming._COMPILED and streaming._EAGER_SECONDS["cpu"] > 0
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", streaming._EAGER_SECONDS["cpu"])  # as if the budget were spent
    compiled = _gradient_scores(model, ids, args)
    assert streaming._COMPILED and all(fn is not None for fn in streaming._COMPILED.values())
    for actual, expected in zip(_flat(compiled), _flat(eager)):
        _rel_close(actual, expected)


ROWS_BACKWARD_CASES = {
    "causal, grouped heads": dict(causal=True),
    "one head per key head": dict(causal=True, kv_heads=4),
    "padding as a bool mask": dict(mask="bool"),
    "padding as an additive mask": dict(mask="float"),
}


@pytest.mark.parametrize("case", ROWS_BACKWARD_CASES, ids=list(ROWS_BACKWARD_CASES))
def test_the_backward_of_the_rows_with_gradient_equals_the_kernels(case):
    """KernelCall.rows_backward: the gradients of query, key and value from an output
    gradient that is zero outside a few rows equal sdpa's own backward."""
    options = ROWS_BACKWARD_CASES[case]
    batch, heads, kv_heads, tokens, dim = 2, 4, options.get("kv_heads", 2), 23, 8
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(batch, h, tokens, dim, generator=generator, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    mask = None
    if "mask" in options:
        real = torch.arange(tokens)[None] >= torch.tensor([0, 6])[:, None]  # left padding
        mask = (real[:, None, None, :] & torch.ones(tokens, tokens, dtype=torch.bool).tril()).expand(batch, 1, tokens, tokens)
        mask = mask if options["mask"] == "bool" else torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    causal = options.get("causal", False)
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal, enable_gqa=True)
    rows = slice(17, 21)
    grad_output = torch.zeros_like(output)
    grad_output[:, :, rows] = torch.randn(grad_output[:, :, rows].shape, generator=generator)
    expected = torch.autograd.grad(output, (query, key, value), grad_output)
    call = kernel.KernelCall(query.detach(), key.detach(), value.detach(), dim**-0.5, mask, causal, groups=heads // kv_heads)
    actual = call.rows_backward(grad_output.transpose(1, 2), rows)
    for got, want in zip(actual, expected):
        _rel_close(got, want)


@pytest.mark.parametrize("case", ROWS_BACKWARD_CASES, ids=list(ROWS_BACKWARD_CASES))
@pytest.mark.parametrize("heads", [None, [1, 2]])
@pytest.mark.parametrize("shape", [(4, 5), (2, 23)], ids=["blocks of 5 rows", "one block of rows"])
def test_the_erased_output_equals_attention_renormalised_without_the_erased_keys(case, heads, shape):
    """The erased output, block by block (a causal block sees only the keys up to its last
    row): each chosen head's attention to the erased keys zeroed and its rows renormalised;
    a row left without keys gives 0."""
    options = ROWS_BACKWARD_CASES[case]
    batch, num_heads, kv_heads, tokens, dim = 2, 4, options.get("kv_heads", 2), 23, 8
    generator = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(batch, h, tokens, dim, generator=generator) for h in (num_heads, kv_heads, kv_heads))
    allowed = torch.ones(batch, 1, tokens, tokens, dtype=torch.bool)
    mask = None
    if "mask" in options:
        real = torch.arange(tokens)[None] >= torch.tensor([0, 6])[:, None]  # left padding
        allowed = real[:, None, None, :] & torch.ones(tokens, tokens, dtype=torch.bool).tril()
        mask = allowed if options["mask"] == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    causal = options.get("causal", False)
    if causal:
        allowed = allowed & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    erased = torch.rand(batch, tokens, generator=generator) < 0.3
    erased[0, 0] = True  # under the causal mask, row 0 of example 0 keeps no key
    chosen = torch.zeros(num_heads, dtype=torch.bool)
    chosen[heads if heads is not None else slice(None)] = True
    repeat = num_heads // kv_heads
    logits = query @ key.repeat_interleave(repeat, dim=1).transpose(-1, -2) * dim**-0.5
    if options.get("mask") == "float":  # added, as the kernel adds it: a padding row stays uniform
        logits, allowed = logits + mask, torch.ones_like(allowed)
    kept = allowed & ~(erased[:, None, None, :] & chosen[None, :, None, None])
    probs = logits.masked_fill(~kept, -torch.inf).softmax(dim=-1).nan_to_num(0.0)
    expected = (probs @ value.repeat_interleave(repeat, dim=1)).transpose(1, 2)
    call = kernel.KernelCall(query, key, value, dim**-0.5, mask, causal, groups=repeat)
    actual = streaming.erased_output(call, erased, heads, shape)
    _rel_close(actual, expected)
    if causal:
        assert actual[0, 0, chosen].abs().max() == 0
        assert heads is None or actual[0, 0, ~chosen].abs().max() > 0


def test_a_kernel_call_differentiated_on_few_rows_takes_their_backward_alone(monkeypatch):
    """Through the wrapped attention function (keys longer than the causal queries, which
    transformers crops): the rows' backward where the output's gradient lives on few rows,
    the kernel's own elsewhere; the same gradients either way."""
    from captum_attention.capture import kernel as capture_kernel

    generator = torch.Generator().manual_seed(4)
    query = torch.randn(1, 4, 12, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, 15, 8, generator=generator, requires_grad=True) for _ in range(2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    used = []
    monkeypatch.setattr(kernel.KernelCall, "rows_backward", counted(kernel.KernelCall.rows_backward, used))
    monkeypatch.setattr(capture_kernel, "ROWS_BACKWARD_SHARE", 0.25)

    def gradients(grad_output, rows_backward):
        recorder = lambda module, call, run_kernel: run_kernel(rows_backward=rows_backward)  # noqa: E731
        with capture_kernel.KernelInterception(recorder):
            output = attention_function("sdpa")(module, query, key, value, None, scaling=8**-0.5)[0]
        return torch.autograd.grad(output, (query, key, value), grad_output)

    few, many = torch.zeros(1, 12, 4, 8), torch.randn(1, 12, 4, 8, generator=generator)
    few[:, -1] = torch.randn(1, 4, 8, generator=generator)
    for grad_output, taken in ((few, 1), (many, 0)):
        used.clear()
        actual = gradients(grad_output, rows_backward=True)
        assert len(used) == taken
        for got, want in zip(actual, gradients(grad_output, rows_backward=False)):
            _rel_close(got, want)


@pytest.mark.parametrize("rows_backward", [False, True])
@pytest.mark.parametrize("scaling", ["keyword", "positional", "default"])
@pytest.mark.parametrize("masked", [False, True])
def test_a_key_bias_rides_on_the_kernel_and_its_gradient_sums_the_logits_gradient(masked, scaling, rows_backward, monkeypatch):
    """Through the wrapped attention function (grouped heads; causal keys longer than the
    queries, which transformers crops, or left padding in a float mask), a zero bias on
    the keys' logits leaves the output as it is, whichever way the model gives the scale,
    and its gradient is Σ over the rows and each key head's query heads of dS/dlogits,
    computed here from the explicit probabilities."""
    from captum_attention.capture import kernel as capture_kernel

    monkeypatch.setattr(capture_kernel, "ROWS_BACKWARD_SHARE", 1.0)
    generator = torch.Generator().manual_seed(5)
    queries, keys, dim = 12, 12 if masked else 15, 8
    query, key, value, allowed, mask, module = _grouped_causal_call(generator, queries, keys, 4 if masked else None)
    args, kwargs = {"keyword": ((), {"scaling": dim**-0.5}), "positional": ((0.0, dim**-0.5), {}), "default": ((), {})}[scaling]
    bias = torch.zeros(2, 2, queries, requires_grad=True)

    def attend(key_bias):
        recorder = lambda module, call, run_kernel: run_kernel(rows_backward=rows_backward, key_bias=key_bias)  # noqa: E731
        with capture_kernel.KernelInterception(recorder):
            return attention_function("sdpa")(module, query, key, value, mask, *args, **kwargs)[0]

    grad_output = torch.randn(2, queries, 4, dim, generator=generator)
    grad_output[1, :4] = 0.0  # the padding rows: no gradient reaches them in a model
    output = attend(bias)
    _rel_close(output, attend(None))
    (actual,) = torch.autograd.grad(output, bias, grad_output)
    logits = query @ key[:, :, :queries].repeat_interleave(2, dim=1).transpose(-1, -2) * dim**-0.5
    probs = (logits + mask if masked else logits.masked_fill(~allowed, -torch.inf)).softmax(dim=-1)  # as the kernel adds it
    expected = _summed_logit_grads(probs, grad_output, value[:, :, :queries])
    assert expected.abs().max() > 0
    _rel_close(actual, expected.detach())


def _grouped_causal_call(generator, queries, keys, padded=None):
    """Two examples' query ``(2, 4, queries, 8)``, key and value ``(2, 2, keys, 8)`` (each
    key head serving two query heads), the causal pattern ``allowed`` over the queries'
    keys, and with ``padded`` a float mask that also hides the second example's first
    ``padded`` keys (else None); a causal module of grouped heads."""
    query = torch.randn(2, 4, queries, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(2, 2, keys, 8, generator=generator, requires_grad=True) for _ in range(2))
    allowed = torch.ones(queries, queries, dtype=torch.bool).tril()[None, None]
    mask = None
    if padded is not None:
        allowed = allowed & (torch.arange(keys)[None] >= torch.tensor([0, padded])[:, None])[:, None, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    return query, key, value, allowed, mask, module


def _summed_logit_grads(probs, grad_output, value):
    """Σ over the rows, and over the two query heads of each key head, of dS/dlogits from
    the explicit probabilities ``(2, 4, Q, K)``: ``(2, 2, K)``."""
    grad_probs = grad_output.transpose(1, 2) @ value.repeat_interleave(2, dim=1).transpose(-1, -2)
    grad_logits = probs * (grad_probs - (probs * grad_probs).sum(dim=-1, keepdim=True))
    return grad_logits.sum(dim=2).reshape(2, 2, 2, -1).sum(dim=2)


@pytest.mark.parametrize("masked", [False, True])
def test_a_key_bias_rides_on_an_explicit_call_with_sinks_and_never_on_a_softcap(masked):
    """gpt-oss's sinks (one logit per head in every row's softmax), which the explicit
    computation runs: the bias leaves the output as it is and its gradient is Σ over the
    rows and each key head's query heads of dS/dlogits, from the explicit probabilities
    with the sink's column. A softcap would cap the bias too: no bias there."""
    from captum_attention.capture import kernel as capture_kernel

    generator = torch.Generator().manual_seed(6)
    queries, dim = 10, 8
    query, key, value, allowed, mask, module = _grouped_causal_call(generator, queries, queries, 3 if masked else None)
    sinks = torch.randn(4, generator=generator)
    bias = torch.zeros(2, 2, queries, requires_grad=True)
    applies = []

    def attend(key_bias, **options):
        def recorder(module, call, run_kernel):
            applies.append(capture_kernel.key_bias_applies(call))
            return run_kernel(key_bias=key_bias)

        with capture_kernel.KernelInterception(recorder):
            return attention_function("sdpa")(module, query, key, value, mask, scaling=dim**-0.5, **options)[0]

    grad_output = torch.randn(2, queries, 4, dim, generator=generator)
    grad_output[1, :3] = 0.0  # the padding rows: no gradient reaches them in a model
    output = attend(bias, s_aux=sinks)
    _rel_close(output, attend(None, s_aux=sinks))
    (actual,) = torch.autograd.grad(output, bias, grad_output)
    logits = query @ key.repeat_interleave(2, dim=1).transpose(-1, -2) * dim**-0.5
    logits = logits + mask if masked else logits.masked_fill(~allowed, -torch.inf)
    with_sink = torch.cat([logits, sinks[None, :, None, None].expand(2, 4, queries, 1)], dim=-1)
    expected = _summed_logit_grads(with_sink.softmax(dim=-1)[..., :-1], grad_output, value)
    assert expected.abs().max() > 0 and applies == [True, True]
    _rel_close(actual, expected.detach())
    applies.clear()
    attend(None, softcap=30.0)
    assert applies == [False]


@pytest.mark.parametrize("cls", [GradSAM, TransformerAttribution])
def test_an_output_whose_gradient_vanishes_at_the_top_is_explained_as_eager_capture_explains_it(cls):
    """BART's padding token has a zero embedding, tied to the output layer: its logit's
    gradient is zero on every row of the top layer. The backward must still reach the
    layers below (zeros, not an error), as the kernel's own backward does."""
    model, inputs, args, _ = _case("bart")
    pad = model.config.pad_token_id
    assert bool((model.get_output_embeddings().weight[pad] == 0).all())
    streamed = cls(model, capture="streaming").attribute(inputs, target=pad, additional_forward_args=args)
    eager = cls(model, capture="eager").attribute(inputs, target=pad, additional_forward_args=args)
    for actual, expected in zip(streamed, eager):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("decoder", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["grad_sam", "transformer_attribution", "attn_lrp", "knockout_lrp"])
def test_answers_explained_through_the_rows_backward_equal_eager_capture(decoder, method, monkeypatch):
    """A language model's answer, per token and as a span, streamed with the top layer's
    backward taken from the answer's rows alone (under AttnLRP's rules too), equals eager
    capture (grouped heads and left padding for Llama)."""
    from captum_attention.capture import kernel as capture_kernel

    model, prompts = make_decoder(decoder), make_prompts(side="left")
    continuation, args = torch.tensor([[7, 8], [10, 11], [13, 14]]), (prompts.attention_mask,)
    cls = REGISTRY[method]
    expected = [
        cls(model, capture="eager").attribute_continuation(prompts.input_ids, continuation, args, log_prob=True),
        cls(model, capture="eager").attribute_span(prompts.input_ids, continuation, args),
    ]
    used = []
    monkeypatch.setattr(capture_kernel, "ROWS_BACKWARD_SHARE", 1.0)
    monkeypatch.setattr(kernel.KernelCall, "rows_backward", counted(kernel.KernelCall.rows_backward, used))
    explainer, before = cls(model, capture="streaming"), model_state(model)
    actual = [
        explainer.attribute_continuation(prompts.input_ids, continuation, args, log_prob=True),
        explainer.attribute_span(prompts.input_ids, continuation, args),
    ]
    assert used
    assert_same_state(before, model_state(model))
    for got, want in zip(actual, expected):
        _rel_close(got, want)


@pytest.mark.parametrize("method", ["grad_sam", "transformer_attribution"])
def test_a_classifier_explained_through_the_rows_backward_equals_eager_capture(method, monkeypatch):
    """BERT's top layer is read at [CLS] only: its backward from that row alone, the same
    scores as eager capture (padding on the right)."""
    from captum_attention.capture import kernel as capture_kernel

    model, ids, args, _ = _case("bert")
    expected = METHODS[method].cls(model, capture="eager").attribute(ids, target=1, additional_forward_args=args)
    used = []
    monkeypatch.setattr(capture_kernel, "ROWS_BACKWARD_SHARE", 1.0)
    monkeypatch.setattr(kernel.KernelCall, "rows_backward", counted(kernel.KernelCall.rows_backward, used))
    actual = METHODS[method].cls(model, capture="streaming").attribute(ids, target=1, additional_forward_args=args)
    assert used
    _rel_close(actual, expected)


def _explicit_reference(call, erased=None):
    """The eager attention of Gemma-2 and gpt-oss written out on full maps: softcap before
    the mask, a sink column joining the softmax and dropped after it, erased keys -inf."""
    query, key, value = (t.detach().requires_grad_() for t in (call.query, call.key, call.value))
    repeat = lambda t: t.repeat_interleave(call.groups, dim=1)  # noqa: E731
    logits = query @ repeat(key).transpose(-1, -2) * call.scale
    if call.softcap is not None:
        logits = torch.tanh(logits / call.softcap) * call.softcap
    if call.mask is not None:
        bias = call.mask.float() if call.mask.dtype != torch.bool else torch.zeros(call.mask.shape).masked_fill(~call.mask, -torch.inf)
        logits = logits + bias
    if call.causal:
        logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), -torch.inf)
    if erased is not None:
        logits = logits.masked_fill(erased[:, None, None, :], -torch.inf)
    if call.sinks is not None:
        sinks = call.sinks.expand(logits.shape[0], -1, logits.shape[2], 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = logits.softmax(dim=-1).nan_to_num(0.0)
    return (query, key, value), probs, (probs @ repeat(value)).transpose(1, 2)


EXPLICIT_CALLS = {
    "softcap": dict(softcap=0.6),
    "sinks": dict(sinks=True),
    "softcap and sinks, causal": dict(softcap=0.6, sinks=True, causal=True),
    "sinks, additive padding": dict(sinks=True, mask="additive"),
    "softcap, boolean padding": dict(softcap=0.6, mask="bool"),
}


@pytest.mark.parametrize("case", EXPLICIT_CALLS, ids=list(EXPLICIT_CALLS))
def test_softcap_and_sinks_give_the_eager_attention_its_output_and_gradients(case):
    """A call sdpa cannot compute, block by block: its probabilities, output, erased output
    and the gradients of its query, key and value equal the eager formula's (grouped heads,
    blocks of 5 rows, a row left with no key)."""
    options = EXPLICIT_CALLS[case]
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    mask = None
    if "mask" in options:
        keep = torch.ones(2, 1, 11, 11, dtype=torch.bool)
        keep[1, ..., :3] = False  # left padding: example 1's first rows see no key
        mask = keep if options["mask"] == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    call = kernel.KernelCall(
        rand(2, 4, 11, 8) * 3, rand(2, 2, 11, 8) * 3, rand(2, 2, 11, 8), 8**-0.5, mask, options.get("causal", False),
        groups=2, softcap=options.get("softcap"), sinks=rand(1, 4, 1, 1) * 2 if options.get("sinks") else None,
    )
    assert call.explicit
    leaves, probs, output = _explicit_reference(call)
    real_rows = slice(3, None) if mask is not None else slice(None)  # example 1's keyless rows: eager's are uniform
    torch.testing.assert_close(call.probs(slice(0, 11))[:, :, real_rows], probs.detach()[:, :, real_rows])
    torch.testing.assert_close(call.erased_output(None, (4, 5))[:, real_rows], output.detach()[:, real_rows])
    grad_output = rand(2, 11, 4, 8)
    grad_output[:, : real_rows.start or 0] = 0
    expected = torch.autograd.grad(output, leaves, grad_output)
    rows = [slice(start, min(start + 5, 11)) for start in range(0, 11, 5)]
    for got, want in zip(call.input_grads(grad_output, rows), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    erased = torch.rand(2, 11, generator=generator) < 0.3
    _, _, erased_output = _explicit_reference(call, erased)
    actual = call.erased_output(call.erase_bias(erased, None), (4, 5))
    torch.testing.assert_close(actual[:, real_rows], erased_output.detach()[:, real_rows].nan_to_num(0.0))


@pytest.mark.parametrize("decoder", EXPLICIT_DECODERS)
def test_softcap_and_sinks_stream_as_eager_capture_explains_them(decoder):
    """Gemma-2 (logit softcap, sliding window) and gpt-oss (sinks, sliding window, experts),
    which transformers runs only eagerly: streamed, every method's answer explanation
    (per token and as a span), erasure and the model's output equal eager capture's, left
    padding included, and the model is left as found."""
    model, prompts = make_decoder(decoder), make_prompts(side="left")
    continuation, args = torch.tensor([[7, 8], [10, 11], [13, 14]]), (prompts.attention_mask,)
    before = model_state(model)
    for method in METHODS:
        cls = METHODS[method].cls
        explainer = cls(model, capture="streaming")
        streamed = [
            explainer.attribute_continuation(prompts.input_ids, continuation, args),
            explainer.attribute_span(prompts.input_ids, continuation, args),
        ]
        assert explainer.last_capture == "streaming", explainer.last_capture
        eager = cls(model, capture="eager")
        expected = [
            eager.attribute_continuation(prompts.input_ids, continuation, args),
            eager.attribute_span(prompts.input_ids, continuation, args),
        ]
        for got, want in zip(_flat(streamed), _flat(expected)):
            _rel_close(got, want)
        assert all(bool(score.abs().sum() > 0) for score in _flat(expected)), method
    erased = prompts.real & (torch.rand(prompts.real.shape, generator=torch.Generator().manual_seed(0)) < 0.4)
    erased[:, -1] = False
    streamed = attention_erasure(model, prompts.input_ids, erased, args, capture="streaming")
    eager = attention_erasure(model, prompts.input_ids, erased, args, capture="eager")
    _rel_close(streamed.original, eager.original)
    _rel_close(streamed.erased, eager.erased)
    assert (streamed.erased - streamed.original).abs().max() > 1e-4, "the erasure should move the output"
    from captum_attention.metrics import attention_permutation

    options = dict(layers=[0, -1], heads=[0, 3], n_permutations=2, seed=4)
    streamed = attention_permutation(model, prompts.input_ids, args, capture="streaming", **options)
    eager = attention_permutation(model, prompts.input_ids, args, capture="eager", **options)
    _rel_close(streamed.median_tvd, eager.median_tvd, rel=1e-4)
    assert streamed.median_tvd.max() > 1e-4, "the permutation should move the output"
    assert_same_state(before, model_state(model))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), groups=st.integers(1, 3), length=st.integers(1, 13),
    causal=st.booleans(), softcap=st.one_of(st.none(), st.floats(0.3, 5.0)), sinks=st.booleans(),
    padding=st.integers(0, 12), block_rows=st.integers(1, 13), seed=st.integers(0, 2**16),
)
def test_explicit_calls_equal_the_eager_formula_on_any_shape(
    batch, kv_heads, groups, length, causal, softcap, sinks, padding, block_rows, seed
):
    """Property: for any shape, grouping, causal flag, cap (1 where neither is drawn),
    sinks, left padding of the last example's keys and block size, an explicit call's
    output and gradients equal the eager formula's."""
    padding = min(padding, length - 1)
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    heads = kv_heads * groups
    mask = None
    if padding and not causal:
        keep = torch.ones(batch, 1, length, length, dtype=torch.bool)
        keep[-1, ..., :padding] = False
        mask = keep
    call = kernel.KernelCall(
        rand(batch, heads, length, 8) * 2, rand(batch, kv_heads, length, 8) * 2, rand(batch, kv_heads, length, 8), 8**-0.5,
        mask, causal, groups=groups, softcap=softcap, sinks=rand(1, heads, 1, 1) * 2 if sinks else None,
    )
    if not call.explicit:
        call = dataclasses.replace(call, softcap=1.0)
    leaves, _, output = _explicit_reference(call)
    torch.testing.assert_close(call.erased_output(None, (heads, block_rows)), output.detach(), rtol=1e-5, atol=1e-5)
    grad_output = rand(batch, length, heads, 8)
    expected = torch.autograd.grad(output, leaves, grad_output)
    rows = [slice(start, min(start + block_rows, length)) for start in range(0, length, block_rows)]
    for got, want in zip(call.input_grads(grad_output, rows), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max().clamp(min=1)))
