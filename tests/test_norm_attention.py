"""Norm-based attention (Kobayashi et al., EMNLP 2020) against a recomputation written from
the paper's definition as the authors' code computes it (``summed_weighted_norm``): the
eager model's ``output_attentions``, its value projections' outputs read by hooks, each
head's slice of the output projection, one example, head and token at a time."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_state, model_state
from lm_models import answer_rows, explains_through_the_llm_interface, make_decoder, make_encoder_decoder, one_stack_case

from captum_attention.attr import REGISTRY
from captum_attention.attr.norm_attention import NormAttention


def _values_and_projection(model, family: str):
    """Per layer: a hook that keeps the values ``(B, heads_kv, T, d)`` and the output
    projection as ``(hidden, H · d)`` (columns of head m: ``m·d`` to ``(m+1)·d``)."""
    kept: list[torch.Tensor] = []
    if family == "bert":
        layers = [(layer.attention.self.value, layer.attention.output.dense.weight) for layer in model.bert.encoder.layer]
        heads, kv_heads = model.config.num_attention_heads, model.config.num_attention_heads
    elif family == "llama":
        layers = [(layer.self_attn.v_proj, layer.self_attn.o_proj.weight) for layer in model.model.layers]
        heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    else:  # GPT-2: c_attn's last third, c_proj's (in, out) weight
        layers = [(block.attn.c_attn, block.attn.c_proj.weight.t()) for block in model.transformer.h]
        heads = kv_heads = model.config.n_head

    def keep(module, args, output):
        if family == "gpt2":
            output = output.split(output.shape[-1] // 3, dim=-1)[2]
        batch, length, width = output.shape
        kept.append(output.detach().view(batch, length, kv_heads, width // kv_heads).transpose(1, 2))

    handles = [module.register_forward_hook(keep) for module, _ in layers]
    return kept, [weight.detach() for _, weight in layers], heads, kv_heads, handles


def reference(model, family: str, ids, mask, layer: int, query: int) -> torch.Tensor:
    """‖Σ_m α^m[q, j] · v^m_j W_O^mᵀ‖ per example and token j, head by head in loops."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    values, projections, heads, kv_heads, handles = _values_and_projection(eager, family)
    positions = {} if family == "bert" else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}  # left padding
    try:
        with torch.no_grad():
            attentions = eager(ids, attention_mask=mask, output_attentions=True, **positions).attentions
    finally:
        for handle in handles:
            handle.remove()
    attn, value, projection = attentions[layer], values[layer], projections[layer]
    head_dim = value.shape[-1]
    scores = torch.zeros(ids.shape)
    for b in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            total = torch.zeros(projection.shape[0])
            for m in range(heads):
                transformed = projection[:, m * head_dim : (m + 1) * head_dim] @ value[b, m // (heads // kv_heads), j]
                total += attn[b, m, query, j] * transformed
            scores[b, j] = total.norm()
    return scores * mask


@pytest.mark.parametrize("layer", [-1, 0])
@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_norm_attention_equals_the_papers_definition(family, layer, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    scores = NormAttention(model).attribute(ids, additional_forward_args=(mask,), layer=layer)
    assert_same_state(before, model_state(model))
    expected = reference(model, family, ids, mask, layer, query)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_a_span_sums_its_rows_norms_and_the_llm_interface_takes_it():
    model = make_decoder("llama")
    explainer = NormAttention(model)
    rows, ids, mask = answer_rows(explainer)
    second = reference(model, "llama", ids, mask, -1, ids.shape[1] - 1)
    torch.testing.assert_close(rows[:, 1, : ids.shape[1]], second, rtol=1e-5, atol=1e-6 * second.abs().max().item())
    explains_through_the_llm_interface(explainer)


def test_registered_out_of_reports_and_clear_refusals():
    from captum_attention import METHODS

    assert REGISTRY["norm_attention"] is NormAttention and "norm_attention" not in METHODS
    model, ids, mask, _ = one_stack_case("bert")
    with pytest.raises(ValueError, match="no maps"):
        NormAttention(model).attribute(ids, additional_forward_args=(mask,), return_maps=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_fusion'"):
        NormAttention(model).attribute(ids, additional_forward_args=(mask,), head_fusion="mean")
    seq2seq = make_encoder_decoder("t5")
    with pytest.raises(ValueError, match="one self-attention stack"):
        NormAttention(seq2seq).attribute((ids[:, :4], ids[:, :3]))


def test_a_model_whose_output_projection_is_unknown_is_refused_in_one_line(monkeypatch):
    from captum_attention import UnsupportedModelError
    from captum_attention.capture.adapters.huggingface import HuggingFaceAdapter

    model, ids, mask, _ = one_stack_case("bert")
    monkeypatch.setattr(HuggingFaceAdapter, "output_projection", lambda self, model, module: None)
    for capture in ("streaming", "eager"):
        with pytest.raises(UnsupportedModelError, match="output projection of BertSelfAttention") as refused:
            NormAttention(model, capture=capture).attribute(ids, additional_forward_args=(mask,))
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_gate_between_the_attention_and_its_projection_is_refused_in_one_line(family, capture_mode):
    """A forward pre-hook that scales what the last layer's output projection receives
    (as HY-V4's and Laguna's gates do): the norms of the ungated values would be wrong."""
    model, ids, mask, _ = one_stack_case(family)
    projection = model.model.layers[-1].self_attn.o_proj if family == "llama" else model.transformer.h[-1].attn.c_proj
    handle = projection.register_forward_pre_hook(lambda module, args: (torch.sigmoid(args[0]) * args[0],))
    try:
        explain = lambda: NormAttention(model).attribute(ids, additional_forward_args=(mask,))  # noqa: E731
        assert_refused_in_one_line(model, explain, "receives something other than the heads' attention-weighted values")
        NormAttention(model).attribute(ids, additional_forward_args=(mask,), layer=0)  # the first layer has no gate
    finally:
        handle.remove()


class _Int8Linear(torch.nn.Linear):
    """As bitsandbytes' 8-bit layer holds it: an ``nn.Linear`` whose weight is int8, with
    a scale per output row."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        scale = linear.weight.detach().abs().amax(dim=1, keepdim=True) / 127
        self.weight = torch.nn.Parameter((linear.weight.detach() / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight.float() * self.scale, self.bias)


@pytest.mark.parametrize("name", ["norm_attention", "alti", "alti_logit"])
def test_a_quantized_output_projection_is_refused_not_read_as_its_integers(name):
    """Read as its weight, an int8 projection gave norms on the integers' scale (NormAttention
    returned scores with no error); the methods that read the weight refuse it, and Value
    Zeroing and DecompX, which run it, explain the model."""
    model, ids, mask, _ = one_stack_case("llama")
    for layer in model.model.layers:
        layer.self_attn.o_proj = _Int8Linear(layer.self_attn.o_proj).eval()
    answer = torch.tensor([[5], [6], [7]])[: len(ids)]
    explain = lambda: REGISTRY[name](model).attribute_span(ids, answer, additional_forward_args=(mask,))  # noqa: E731
    assert_refused_in_one_line(model, explain, "output projection of LlamaAttention as a floating-point weight.*merge_and_unload")
    if name == "alti":
        for runs_it in ("value_zeroing", "decompx"):
            assert torch.isfinite(REGISTRY[runs_it](model).attribute_span(ids, answer, additional_forward_args=(mask,))).all()
