"""The Triton kernels of the streaming reductions, run by Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``), against the eager block reductions they replace on a GPU: fp32
and bf16, grouped-query heads, the kernel's causal flag, boolean and additive masks
(padding on either side), odd lengths. ``conftest.py`` sets ``TRITON_INTERPRET=1`` before
anything imports triton."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import counted

pytest.importorskip("triton")

from captum_attention.maps import fused  # noqa: E402
from captum_attention.maps.kernel import KernelCall  # noqa: E402
from captum_attention.maps.streaming import exp_terms  # noqa: E402


def _call(batch=2, heads=4, kv_heads=2, queries=37, keys=37, dim=16, dtype=torch.float32, causal=False, mask=None, seed=0,
          softcap=None, sinks=False):
    generator = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
    call = KernelCall(rand(batch, heads, queries, dim), rand(batch, kv_heads, keys, dim), rand(batch, kv_heads, keys, dim),
                      1 / math.sqrt(dim), mask, causal, groups=heads // kv_heads, softcap=softcap,
                      sinks=rand(1, heads, 1, 1) * 2 if sinks else None)
    return call, rand(batch, queries, heads, dim)


def _eager(call, grad_output, key_weights):
    """Per head and query row Σ_j (A ⊙ G⁺)_ij·w_j, from the eager block functions."""
    rows = slice(0, call.num_queries)
    logits, grads = call.logits(rows), call.grad_probs(grad_output, rows)
    weights = key_weights[:, None, None, : logits.shape[-1]].float()
    norm, terms = exp_terms(logits, grads, weights, call.sink_logits())
    return terms.sum(-1) / norm, terms / norm[..., None]


def _padding(batch, keys, left):
    lengths = torch.tensor([keys, keys - 9])
    positions = torch.arange(keys)
    return positions[None] >= keys - lengths[:, None] if left else positions[None] < lengths[:, None]


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "bf16": {"dtype": torch.bfloat16},
    "one head per key head": {"kv_heads": 4},
    "odd lengths": {"queries": 5, "keys": 70},
    "wide heads": {"dim": 32},
    "narrow heads": {"dim": 8},
    "heads of 80": {"dim": 80, "queries": 20, "keys": 20},
    "softcap": {"softcap": 0.4},
    "sinks, causal": {"sinks": True, "causal": True},
    "softcap and sinks, bf16": {"softcap": 0.4, "sinks": True, "dtype": torch.bfloat16},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_row_and_column_sums_equal_the_eager_reduction(case):
    call, grad_output = _call(**CASES[case])
    key_weights = torch.ones(2, call.num_keys)
    key_weights[1, -3:] = 0  # padding keys
    expected_rows, terms = _eager(call, grad_output, key_weights)
    tolerance = 2e-2 if CASES[case].get("dtype") == torch.bfloat16 else 1e-5
    rows = fused.positive_row_sums(call, grad_output, key_weights)
    torch.testing.assert_close(rows, expected_rows, rtol=tolerance, atol=tolerance * float(expected_rows.abs().max()))
    row_weights = torch.rand(2, call.num_queries, generator=torch.Generator().manual_seed(5))
    expected_columns = torch.einsum("bq,bhqk->bk", row_weights, terms)
    columns = fused.weighted_column_sums(call, grad_output, row_weights, key_weights)
    torch.testing.assert_close(columns, expected_columns, rtol=tolerance, atol=tolerance * float(expected_columns.abs().max()))


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_probability_row_and_column_sums_equal_the_eager_maps(case):
    """Rollout's reductions: the same sums of P alone."""
    call, _ = _call(**CASES[case])
    key_weights = torch.ones(2, call.num_keys)
    key_weights[1, -3:] = 0
    probs = call.probs(slice(0, call.num_queries)).float() * key_weights[:, None, None, :]
    tolerance = 2e-2 if CASES[case].get("dtype") == torch.bfloat16 else 1e-5
    torch.testing.assert_close(fused.row_sums(call, key_weights), probs.sum(-1), rtol=tolerance, atol=tolerance)
    row_weights = torch.rand(2, call.num_queries, generator=torch.Generator().manual_seed(5))
    expected = torch.einsum("bq,bhqk->bk", row_weights, probs)
    columns = fused.column_sums(call, row_weights, key_weights)
    torch.testing.assert_close(columns, expected, rtol=tolerance, atol=tolerance * float(expected.abs().max()))


ERASURE_CASES = {**CASES, "causal, odd lengths": {"causal": True, "queries": 45, "keys": 45}}


@pytest.mark.parametrize("heads", [None, [0, 3]], ids=["every head", "two heads"])
@pytest.mark.parametrize("case", ERASURE_CASES, ids=list(ERASURE_CASES))
def test_the_erased_attention_equals_the_block_by_block_kernel(case, heads):
    """Erasure's kernel: the call's output with the erased keys scored -inf, against the
    model's kernel run block by block with that mask, a row left without keys 0."""
    call, _ = _call(**ERASURE_CASES[case])
    erased = torch.rand(2, call.num_keys, generator=torch.Generator().manual_seed(6)) < 0.3
    erased[0, 0] = True  # under the causal flag, example 0's first row keeps no key on the erased heads
    erase = call.erase_bias(erased, heads)
    expected = call.erased_output(erase, (call.num_heads, 7))
    actual = fused.erased_attention(call, erase)
    assert actual.dtype == call.query.dtype
    tolerance = 2e-2 if ERASURE_CASES[case].get("dtype") == torch.bfloat16 else 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance * float(expected.abs().max()))
    assert (actual - call.erased_output(torch.zeros_like(erase), (call.num_heads, 7))).abs().max() > 0.1, "the erasure moves the output"
    if call.causal:
        erased_heads = slice(None) if heads is None else heads
        assert bool((actual[0, 0, erased_heads] == 0).all())


@pytest.mark.parametrize("kind", ["bool left padding", "bool right padding", "additive causal + padding"])
def test_masks_as_transformers_passes_them(kind):
    keep = _padding(2, 37, left="left" in kind)
    if kind.startswith("bool"):
        mask = keep[:, None, None, :]  # (B, 1, 1, K): broadcast over heads and queries
    else:
        causal = torch.ones(37, 37).tril().bool()
        allowed = causal[None] & keep[:, None, :]
        mask = torch.zeros(2, 1, 37, 37).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    call, grad_output = _call(mask=mask)
    key_weights = keep.float()
    expected_rows, terms = _eager(call, grad_output, key_weights)
    rows = fused.positive_row_sums(call, grad_output, key_weights)
    torch.testing.assert_close(rows, expected_rows, rtol=1e-5, atol=1e-5 * float(expected_rows.abs().max()))
    erase = call.erase_bias(torch.rand(2, 37, generator=torch.Generator().manual_seed(6)) < 0.3, None)
    expected = call.erased_output(erase, (call.num_heads, 7))
    torch.testing.assert_close(fused.erased_attention(call, erase), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("tiles", sorted({fused.TILES["cuda"], fused.Tiles(16, 64), fused.Tiles(64, 16)}, key=str), ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_every_launch_shape_computes_the_same_sums(tiles, causal, monkeypatch):
    """The GPU's tiles and others (more rows than keys per step, and fewer), run by the
    interpreter on lengths that leave each a partial last tile, against the eager
    reduction: the online rescaling over several key steps and the causal key bound."""
    monkeypatch.setitem(fused.TILES, "cpu", tiles)
    call, grad_output = _call(queries=100, keys=100, causal=causal)
    key_weights = torch.ones(2, 100)
    key_weights[1, -3:] = 0
    expected_rows, terms = _eager(call, grad_output, key_weights)
    rows = fused.positive_row_sums(call, grad_output, key_weights)
    torch.testing.assert_close(rows, expected_rows, rtol=1e-5, atol=1e-5 * float(expected_rows.abs().max()))
    row_weights = torch.rand(2, 100, generator=torch.Generator().manual_seed(5))
    expected_columns = torch.einsum("bq,bhqk->bk", row_weights, terms)
    columns = fused.weighted_column_sums(call, grad_output, row_weights, key_weights)
    torch.testing.assert_close(columns, expected_columns, rtol=1e-5, atol=1e-5 * float(expected_columns.abs().max()))
    erase = call.erase_bias(torch.rand(2, 100, generator=torch.Generator().manual_seed(6)) < 0.3, None)
    expected = call.erased_output(erase, (call.num_heads, 7))
    torch.testing.assert_close(fused.erased_attention(call, erase), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_a_row_whose_every_key_is_masked_sums_to_zero():
    mask = torch.ones(2, 1, 37, 37, dtype=torch.bool)
    mask[0, :, 3] = False
    call, grad_output = _call(mask=mask)
    rows = fused.positive_row_sums(call, grad_output, torch.ones(2, 37))
    assert bool(torch.isfinite(rows).all()) and bool((rows[0, :, 3] == 0).all())


KERNEL_FAMILIES = (
    "bert", "distilbert", "gpt2", "llama", "qwen2", "t5", "bart", "vit", "deit", "llama without padding", "gemma2", "gpt_oss",
)


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_the_methods_give_the_same_scores_through_the_kernels(family, monkeypatch, caplog):
    """Dispatch, on every family the streaming tests cover: with the kernels on for the CPU
    (the interpreter), Grad-SAM on both axes, Transformer Attribution, rollout and erasure
    equal the compiled-or-eager block reductions; left padding included and, without
    padding, the kernel's causal flag. T5's calls carry a position bias: they keep the
    block reductions. The debug log says which path reduced each call."""
    from test_streaming import _case, _flat, _gradient_scores, _rel_close

    from captum_attention import AttentionRollout
    from captum_attention.maps import streaming
    from captum_attention.metrics import attention_erasure

    model, inputs, args, real = _case(family.removesuffix(" without padding"))
    if family.endswith("without padding"):
        inputs, args, real = inputs[:, -5:], (torch.ones_like(inputs[:, -5:]),), torch.ones_like(real[:, -5:])
    erased = real & (torch.rand(real.shape, generator=torch.Generator().manual_seed(2)) < 0.3)
    erased[:, 0] = False
    calls = []
    for name in ("positive_row_sums", "weighted_column_sums", "row_sums", "column_sums", "erased_attention"):
        monkeypatch.setattr(fused, name, counted(getattr(fused, name), calls))

    def explain():
        return _flat([
            *_gradient_scores(model, inputs, args, target=None if family == "bart" else 1),  # BART's token 1 pads
            AttentionRollout(model, capture="streaming").attribute(inputs, additional_forward_args=args),
            attention_erasure(model, inputs, erased, args, capture="streaming").erased,
        ])

    with caplog.at_level("DEBUG", logger=streaming.__name__):
        expected = explain()
        assert not calls and "Triton" not in caplog.text
        assert "eager block reductions reduce a call" in caplog.text and "block computations reduce a call" in caplog.text
        assert all(bool(score.abs().sum() > 0) for score in expected)
        caplog.clear()
        monkeypatch.setitem(streaming.FUSED_KERNEL_DEVICES, "cpu", True)
        for actual, wanted in zip(explain(), expected):
            _rel_close(actual, wanted)
    assert ("Triton kernels reduce a call" in caplog.text) == (family != "t5")
    if family == "t5":
        assert not calls
    else:  # every method went through the kernels
        assert {"positive_row_sums", "weighted_column_sums", "erased_attention"} <= set(calls)
        assert family == "bart" or {"row_sums", "column_sums"} <= set(calls)


def _refusing(error):
    def launch(*args, **kwargs):
        raise error

    return launch


def test_a_kernel_triton_cannot_launch_leaves_the_block_reductions_with_one_warning(monkeypatch):
    """Where Triton cannot compile or launch a kernel on a device (too little shared
    memory, an instruction the card lacks), the kernels turn off for that device with one
    warning and every method's scores are the block reductions'; other errors, and
    the interpreter's, are raised as they are."""
    from test_streaming import _case, _flat, _gradient_scores, _rel_close
    from triton.runtime.errors import InterpreterError, OutOfResources

    from captum_attention import AttentionRollout
    from captum_attention.maps import streaming
    from captum_attention.metrics import attention_erasure

    model, inputs, args, real = _case("llama")
    erased = real & (torch.arange(real.shape[1]) % 3 == 1)

    def explain():
        return _flat([
            *_gradient_scores(model, inputs, args, target=1),
            AttentionRollout(model, capture="streaming").attribute(inputs, additional_forward_args=args),
            attention_erasure(model, inputs, erased, args, capture="streaming").erased,
        ])

    expected = explain()
    monkeypatch.setitem(streaming.FUSED_KERNEL_DEVICES, "cpu", True)
    for name in ("_launch", "erased_attention"):
        monkeypatch.setattr(fused, name, _refusing(OutOfResources(300000, 232448, "shared memory")))
    with pytest.warns(RuntimeWarning, match=r"Triton cannot run the streaming kernels on cpu \(out of resource") as warned:
        actual = explain()
    assert len(warned) == 1 and not streaming.FUSED_KERNEL_DEVICES["cpu"]
    for score, wanted in zip(actual, expected):
        _rel_close(score, wanted)
    for error in (ValueError("a bug of ours"), InterpreterError("a kernel the interpreter cannot run")):
        monkeypatch.setitem(streaming.FUSED_KERNEL_DEVICES, "cpu", True)
        monkeypatch.setattr(fused, "_launch", _refusing(error))
        with pytest.raises(type(error)):
            _gradient_scores(model, inputs, args, target=1)
        assert streaming.FUSED_KERNEL_DEVICES["cpu"]
