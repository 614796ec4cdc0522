"""Value Zeroing (Mohebbi et al., EACL 2023) against a recomputation written from the
authors' code: for every layer l and token t, a whole forward of the model with token t's
value vector zeroed by a hook on layer l's value projection (every head), token i's layer
output compared with the original by cosine distance (1 - x·y / (|x||y|), as
``sklearn.metrics.pairwise.cosine_distances``), each row divided by its sum, and the layers
rolled out without a residual (``compute_joint_attention(..., res=False)``: joint^l = C^l ·
joint^(l-1)); the explained query's row."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_state, model_state
from lm_models import (
    answer_rows, explains_through_the_llm_interface, make_decoder, make_encoder_decoder, make_prompts, one_stack_case,
)

from captum_attention import UnsupportedModelError, ValueZeroing
from captum_attention.attr import METHODS, REGISTRY, _decomposed, value_zeroing


def _layers(model, family: str):
    """Per layer: the layer module and the module whose output holds the values (GPT-2:
    the last third of c_attn's)."""
    if family == "bert":
        return [(layer, layer.attention.self.value) for layer in model.bert.encoder.layer]
    if family == "llama":
        return [(layer, layer.self_attn.v_proj) for layer in model.model.layers]
    return [(block, block.attn.c_attn) for block in model.transformer.h]


def _layer_outputs(model, family: str, ids, mask, zero=None) -> list[torch.Tensor]:
    """Every layer's output ``(B, T, D)``; ``zero = (layer, example, token)`` zeroes that
    token's value vector in that layer."""
    outputs: list[torch.Tensor] = []
    handles = []
    for index, (layer, values) in enumerate(_layers(model, family)):
        handles.append(layer.register_forward_hook(lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)))
        if zero is not None and zero[0] == index:

            def zeroed(module, args, out, example=zero[1], token=zero[2]):
                out = out.clone()
                width = out.shape[-1] // 3 if family == "gpt2" else out.shape[-1]
                out[example, token, out.shape[-1] - width :] = 0.0
                return out

            handles.append(values.register_forward_hook(zeroed))
    positions = {} if family == "bert" else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}  # left padding
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask, **positions)
    finally:
        for handle in handles:
            handle.remove()
    return [output.double() for output in outputs]


def reference(model, family: str, ids, mask, query: int) -> torch.Tensor:
    original = _layer_outputs(model, family, ids, mask)
    batch, length = ids.shape
    layers = len(original)
    mixing = torch.zeros(batch, layers, length, length, dtype=torch.float64)
    for b in range(batch):
        for layer in range(layers):
            for t in range(length):
                if not mask[b, t]:
                    continue
                moved = _layer_outputs(model, family, ids, mask, zero=(layer, b, t))[layer][b]
                kept = original[layer][b]
                cosine = (moved * kept).sum(-1) / (moved.norm(dim=-1) * kept.norm(dim=-1))
                mixing[b, layer, :, t] = torch.where(mask[b].bool(), 1.0 - cosine, 0.0)  # padding rows: 0
    totals = mixing.sum(dim=-1, keepdim=True)
    mixing = mixing / torch.where(totals > 0, totals, 1.0)
    joint = mixing[:, 0]
    for layer in range(1, layers):
        joint = mixing[:, layer] @ joint
    return joint[:, query].float()


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_value_zeroing_equals_the_authors_computation(family, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    scores = ValueZeroing(model).attribute(ids, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    expected = reference(model, family, ids, mask, query)
    assert bool((expected[mask.bool()] > 0).any())
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_every_layers_matrix_and_streaming_equals_eager(monkeypatch):
    """Streaming carries the row down a layer at a time, here one row of each matrix per
    block; eager keeps every layer's matrix."""
    monkeypatch.setattr(_decomposed, "MIXING_BLOCK_ELEMENTS", 1)
    model, ids, mask, _ = one_stack_case("bert")
    eager, maps = ValueZeroing(model, capture="eager").attribute(ids, additional_forward_args=(mask,), return_maps=True)
    streamed = ValueZeroing(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-6)
    assert maps.shape == (ids.shape[0], model.config.num_hidden_layers, ids.shape[1], ids.shape[1])  # (B, L, N, N)
    real = mask.bool()
    for layer in range(maps.shape[1]):
        torch.testing.assert_close(maps[:, layer].sum(-1)[real], torch.ones(int(real.sum())))


def test_a_span_and_an_answers_rows_share_one_computation():
    model = make_decoder("llama")
    explainer = ValueZeroing(model)
    rows, ids, mask = answer_rows(explainer)
    second = reference(model, "llama", ids, mask, ids.shape[1] - 1)
    torch.testing.assert_close(rows[:, 1, : ids.shape[1]], second, rtol=1e-5, atol=1e-5 * second.abs().max().item())
    explains_through_the_llm_interface(explainer)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_a_token_no_query_reads_moves_no_output(family):
    """Causal attention: zeroing a later token's value leaves every earlier output as it
    was, so those distances are 0 to the last bits of float32 (1 - cos of vectors equal
    but for a few units of the last place: below 5e-14 of the row). They are measured from
    the layer re-run with nothing zeroed; measured from the eager forward's own outputs,
    another kernel's rounding, they were 1.4-6e-13."""
    model = make_decoder(family)
    prompts = make_prompts(side="left")
    _, maps = ValueZeroing(model, capture="eager").attribute(
        prompts.input_ids, additional_forward_args=(prompts.attention_mask,), return_maps=True
    )
    later = torch.ones(maps.shape[-2:], dtype=torch.bool).triu(1)
    assert float(maps[..., later].abs().max()) < 5e-14
    assert bool((maps[..., ~later] > 1e-6).any())


def test_registered_out_of_reports_and_clear_refusals(monkeypatch):
    assert REGISTRY["value_zeroing"] is ValueZeroing and "value_zeroing" not in METHODS
    model, ids, mask, _ = one_stack_case("bert")
    with pytest.raises(TypeError, match="unexpected keyword argument 'layer'"):
        ValueZeroing(model).attribute(ids, additional_forward_args=(mask,), layer=0)
    with pytest.raises(ValueError, match="one self-attention stack"):
        ValueZeroing(make_encoder_decoder("t5")).attribute((ids[:, :4], ids[:, :3]))
    model.train()
    with pytest.raises(ValueError, match=r"call model.eval\(\)"), pytest.warns(UserWarning, match="training mode"):
        ValueZeroing(model, capture="eager").attribute(ids, additional_forward_args=(mask,))
    model.eval()
    from captum_attention.capture.adapters.huggingface import HuggingFaceAdapter

    monkeypatch.setattr(HuggingFaceAdapter, "layer_block", lambda self, model, module: None)
    with pytest.raises(UnsupportedModelError, match=r"found 0 layer calls for \d+ attention calls") as refused:
        ValueZeroing(model).attribute(ids, additional_forward_args=(mask,))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["distilbert", "qwen2", "vit", "deit", "gemma2", "gpt_oss"])
def test_the_other_families_stream_as_they_run_eagerly(family):
    """Breadth: the families of the streaming tests (a logit softcap, sinks, class and
    distillation tokens) give the same scores in both capture modes, non-negative (0 at
    padding), each real token's row normalised."""
    from test_streaming import _case as streaming_case

    model, inputs, args, real = streaming_case(family)
    eager, maps = ValueZeroing(model, capture="eager").attribute(inputs, additional_forward_args=args, return_maps=True)
    streamed = ValueZeroing(model, capture="streaming").attribute(inputs, additional_forward_args=args)
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-6)
    assert bool((eager >= 0).all()) and bool((eager > 0).any())
    if eager.shape == real.shape:  # a vision transformer's scores come on its patch grid
        assert bool((eager[~real] == 0).all())
    torch.testing.assert_close(maps[:, -1].sum(-1)[real], torch.ones(int(real.sum())), rtol=1e-5, atol=1e-5)


def test_a_model_whose_attention_does_not_run_through_transformers_is_refused_in_one_line():
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), num_layers=2, enable_nested_tensor=False
    ).eval()
    with pytest.raises(UnsupportedModelError, match="made 0 such calls") as refused:
        ValueZeroing(encoder).attribute(torch.randn(2, 5, 16), query_index=0)
    assert "\n" not in str(refused.value)


def test_a_layer_whose_rerun_differs_from_its_forward_is_refused_in_one_line(capture_mode):
    """A layer that reads something besides its arguments (here a hook's call count; Dory's
    layers do) gives other outputs when re-run: the distances would measure that."""
    model, ids, mask, _ = one_stack_case("llama")
    calls = []

    def drift(module, args, output):
        calls.append(None)
        return (output[0] + 0.1 * (len(calls) > 1), *output[1:]) if isinstance(output, tuple) else output + 0.1 * (len(calls) > 1)

    handle = model.model.layers[-1].register_forward_hook(drift)
    try:
        full = mask[:, 0] != 0  # unpadded: the drift would also tell a padded prompt from the prompt alone
        explain = lambda: ValueZeroing(model).attribute(ids[full], additional_forward_args=(mask[full],))  # noqa: E731
        assert_refused_in_one_line(model, explain, "re-run with no value zeroed gives other outputs")
    finally:
        handle.remove()


def _bfloat16_llama_case():
    """A bfloat16 Llama (transformers' initialisation, whose bfloat16 forward stays within
    rounding of its float32 one) and 64 tokens; its float64 twin with the same (bfloat16)
    weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    twin = LlamaForCausalLM(config).eval()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(3, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    return model, twin.double(), ids, torch.ones_like(ids)


def test_half_precision_layers_are_re_run_as_float32_copies(capture_mode):
    """A distance is that of two nearly equal outputs (one token's value of 64 removed), so
    the re-runs' rounding weighs about 64 times more in it than in the outputs: re-run in
    bfloat16, the scores were 3% of their scale away from the float64 recomputation of
    the same weights; float32 copies of the layers bring them within 1e-3. The copies run
    the user's hooks (shared, not copied: this one holds a lock, which cannot be copied).
    The model keeps its weights, dtype and hooks."""
    model, twin, ids, mask = _bfloat16_llama_case()
    counters = [_Counter() for _ in model.model.layers]
    handles = [layer.register_forward_hook(counter) for layer, counter in zip(model.model.layers, counters)]
    try:
        before = model_state(model)
        scores = ValueZeroing(model).attribute(ids, additional_forward_args=(mask,))
        assert_same_state(before, model_state(model))
    finally:
        for handle in handles:
            handle.remove()
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(counter.calls == 1 + 1 + ids.shape[1] for counter in counters)  # the forward, a re-run unzeroed, one per token
    expected = reference(twin, "llama", ids, mask, ids.shape[1] - 1)
    torch.testing.assert_close(scores.float(), expected, rtol=0, atol=1e-3 * expected.abs().max().item())


def test_a_half_precision_layer_that_moves_by_more_than_one_percent_is_re_run_as_its_copy(capture_mode):
    """A bfloat16 layer's output moves by about 1% of its scale between the eager
    forward's kernel and the re-run's sdpa, and against its float32 copy (1.1% on this
    randomly initialised Llama): under eager capture the model was refused as one that
    "reads something besides its arguments", and streamed its copy was given up for
    bfloat16 re-runs with a warning. Both now re-run the float32 copies, within 2% of the
    float64 recomputation of the same weights."""
    model, prompts = make_decoder("llama").to(torch.bfloat16), make_prompts(side="left")
    twin = make_decoder("llama").to(torch.bfloat16).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = ValueZeroing(model).attribute(prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,))
    expected = ValueZeroing(twin).attribute(prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,))
    torch.testing.assert_close(scores, expected, rtol=0, atol=2e-2 * expected.abs().max().item())


class _Counter:
    """A hook that counts its calls under a lock (so it cannot be deep-copied); as a
    forward pre-hook it also casts the module's input to ``cast`` where given."""

    def __init__(self, cast: torch.dtype | None = None) -> None:
        self.lock, self.calls, self.cast = threading.Lock(), 0, cast

    def __call__(self, module, args, *output):
        with self.lock:
            self.calls += 1
        return (args[0].to(self.cast), *args[1:]) if self.cast is not None else None


def test_a_half_precision_layer_whose_copy_fails_is_re_run_as_it_is(monkeypatch):
    """A forward pre-hook of the user's that casts a projection's input to bfloat16 (the
    hooks are shared with the copies) makes the float32 copies fail: the layers are then
    re-run in their own dtype, as without the copies, with a warning that says so."""
    model, _, ids, mask = _bfloat16_llama_case()
    ids, mask = ids[:, :12], mask[:, :12]
    handles = [layer.self_attn.q_proj.register_forward_pre_hook(_Counter(torch.bfloat16)) for layer in model.model.layers]
    try:
        with pytest.warns(UserWarning, match=r"re-runs LlamaDecoderLayer in torch.bfloat16: its float32 copy could not be run"):
            scores = ValueZeroing(model).attribute(ids, additional_forward_args=(mask,))
        monkeypatch.setattr(value_zeroing, "_half_precision", lambda block: False)
        torch.testing.assert_close(scores, ValueZeroing(model).attribute(ids, additional_forward_args=(mask,)), rtol=0, atol=0)
    finally:
        for handle in handles:
            handle.remove()
