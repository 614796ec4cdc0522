"""ALTI (Ferrando et al., EMNLP 2022), ALTI-Logit (Ferrando et al., ACL 2023) and the norm-based
attention with its residual and norm (Kobayashi et al., EMNLP 2021) against a
recomputation written from the authors' code (``mt-upc/transformer-contributions``'s
``ModelWrapper.get_contributions``, ``normalize_contributions(scaling='min_sum')`` and
``compute_joint_attention``; ``mt-upc/logit-explanations``' ``get_logit_contributions`` and
``track2input_tokens``): one unpadded example at a time (the authors' batch of one), the
eager model's ``output_attentions`` and ``output_hidden_states``, the value projections'
outputs and the norms' inputs read by hooks, the transformed vectors built as the authors'
einsums build them (their ``l_transform``: centring and γ as matrices, over the standard
deviation of the norm's input), and compared with the library's batched, padded call."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, model_state
from lm_models import answer_rows, make_decoder, make_encoder_decoder, make_prompts, make_word_tokenizer, one_stack_case

from captum_attention import (
    ALTI, ALTILogit, GradSAM, LLMAttentionAttribution, NormAttention, RawAttention, UnsupportedModelError, ValueZeroing,
)
from captum_attention.attr import METHODS, REGISTRY, _decomposed
from captum_attention.capture.adapters import HuggingFaceAdapter
from captum_attention.capture.adapters.mixing import tokens_mixed_outside_attention
from captum_attention.maps import context_mixing, streaming


def _modules(model, family: str):
    """Per layer, as the authors' config names them: the values' module, the output
    projection as ``(out, in)`` weight and its bias, the norm after the residual (``ln1``,
    post-norm only) and the norm that takes the attention block's output (``ln2``)."""
    if family in ("bert", "git"):  # GIT's text model: BERT's layers
        layers = model.bert.encoder.layer if family == "bert" else model.git.encoder.layer
        return [(layer.attention.self.value, layer.attention.output.dense.weight, layer.attention.output.dense.bias,
                 layer.attention.output.LayerNorm, layer.output.LayerNorm) for layer in layers]
    if family == "albert":  # one layer at every depth; the residual joins at a norm inside its attention module
        layer = model.albert.encoder.albert_layer_groups[0].albert_layers[0]
        attention = layer.attention
        return [(attention.value, attention.dense.weight, attention.dense.bias, attention.LayerNorm, layer.full_layer_layer_norm)
                ] * model.config.num_hidden_layers
    if family == "llama":
        return [(layer.self_attn.v_proj, layer.self_attn.o_proj.weight, None, None, layer.post_attention_layernorm)
                for layer in model.model.layers]
    if family == "gptj":  # attention beside the feed-forward: no norm takes the sum (its check: _run's "beside")
        return [(block.attn.v_proj, block.attn.out_proj.weight, None, None, block.ln_1) for block in model.transformer.h]
    if family == "gemma2":  # the sum of the input and the normed attention output: the feed-forward's norm's input
        return [(layer.self_attn.v_proj, layer.self_attn.o_proj.weight, None, None, layer.pre_feedforward_layernorm)
                for layer in model.model.layers]
    if family == "gemma4":  # Gemma-2's wiring, the values through their norm
        return [(layer.self_attn.v_norm, layer.self_attn.o_proj.weight, None, None, layer.pre_feedforward_layernorm)
                for layer in model.model.layers]
    return [(block.attn.c_attn, block.attn.c_proj.weight.t(), block.attn.c_proj.bias, None, block.ln_2)
            for block in model.transformer.h]


def _attention_norms(model, family: str):
    """Per layer, the norm on the attention output before the residual (Gemma-2's
    ``post_attention_layernorm``), or None."""
    if family in ("gemma2", "gemma4"):
        return [layer.post_attention_layernorm for layer in model.model.layers]
    return [None] * len(_modules(model, family))


def _reach(model, family: str) -> list[float]:
    """Per layer, the product of the numbers it and the layers above multiply their
    outputs by (Gemma-4's ``layer_scalar``): what its attention adds reaches the final
    norm times it."""
    if family != "gemma4":
        return [1.0] * len(_modules(model, family))
    scalars = torch.tensor([float(layer.layer_scalar) for layer in model.model.layers], dtype=torch.float64)
    return scalars.flip(0).cumprod(0).flip(0).tolist()


def _final(model, family: str):
    """The final norm and the unembedding weight ``(V, D)``."""
    if family in ("llama", "gemma2", "gemma4"):
        return model.model.norm, model.lm_head.weight
    return model.transformer.ln_f, model.lm_head.weight


def _rms_params(norm, family: str):
    """An RMSNorm's γ and ε as it computes them (Gemma's multiplies by 1 + its weight)."""
    weight = norm.weight.detach().double()
    return (1.0 + weight, norm.eps) if family == "gemma2" else (weight, norm.variance_epsilon)


def _through_attention_norm(model, family: str, layer: int, seen, vectors, rows):
    """``vectors`` ``(r, ..., D)`` of the query ``rows`` through the layer's norm on the
    attention output as the linear map it is at those rows' statistics (none: unchanged)."""
    norm = _attention_norms(model, family)[layer]
    if norm is None:
        return vectors
    gamma, eps = _rms_params(norm, family)
    out, coef = _l_transform(vectors, gamma, seen["lna"][layer][0, rows].double(), False, eps)
    return out * coef.reshape(-1, *[1] * (vectors.dim() - 1))


def _run(model, family: str, ids):
    """One unpadded example ``(1, T)`` through an eager copy of the model: attentions,
    hidden states, logits, and per layer the values ``(H_kv, T, d)`` and each hooked norm's
    input; the final norm's input."""
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    seen: dict = {"values": [], "ln1": [], "ln2": [], "lna": [], "mlp": [], "beside": [], "final": []}
    handles = []

    def keep(name, transform=lambda t: t):
        return lambda module, args, output: seen[name].append(transform(args[0] if name != "values" else output).detach())

    heads, kv_heads = model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    for values, _, _, ln1, ln2 in dict.fromkeys(_modules(model, family)):  # a shared layer's hooks once
        third = (lambda t: t[..., 2 * t.shape[-1] // 3 :]) if family == "gpt2" else (lambda t: t)
        handles.append(values.register_forward_hook(keep("values", third)))
        handles.append(ln2.register_forward_hook(keep("ln2")))
        if ln1 is not None:
            handles.append(ln1.register_forward_hook(keep("ln1")))
    for norm in _attention_norms(model, family):
        if norm is not None:
            handles.append(norm.register_forward_hook(keep("lna")))
    if family == "gptj":  # each block's output less its feed-forward's: the stream the attention alone leaves
        for block in model.transformer.h:
            handles.append(block.mlp.register_forward_hook(lambda module, args, output: seen["mlp"].append(output.detach())))
            handles.append(block.register_forward_hook(
                lambda module, args, output: seen["beside"].append((output[0] if isinstance(output, tuple) else output).detach() - seen["mlp"][-1])))
    if family not in ("bert", "albert", "git"):
        handles.append(_final(model, family)[0].register_forward_hook(keep("final")))
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    seen["values"] = [v[0].view(v.shape[1], kv_heads, -1).transpose(0, 1) for v in seen["values"]]
    return out, seen, heads, kv_heads


def _l_transform(x, weight, pre_ln_states, centred: bool, eps: float):
    """The authors' ``l_transform``: x·(I - 1/D)·diag(γ) over each position's deviation."""
    size = weight.shape[0]
    mean = torch.eye(size, dtype=x.dtype) - (1.0 / size if centred else 0.0) * torch.ones(size, size, dtype=x.dtype)
    out = torch.einsum("...e,ef,fg->...g", x, mean, torch.diag(weight.to(x.dtype)))
    spread = pre_ln_states.var(-1, unbiased=False) if centred else pre_ln_states.pow(2).mean(-1)
    return out, 1.0 / torch.sqrt(spread + eps)


def _layer_vectors(attn, values, weight, heads, kv_heads):
    """``(T, T, D)`` Σ_h α[h, i, j] v^h_j W_O^hᵀ (the authors' ``summed_weighted_layer``)."""
    values = values.repeat_interleave(heads // kv_heads, dim=0).double()  # (H, T, d)
    dense = weight.double().view(weight.shape[0], heads, -1)
    transformed = torch.einsum("hsv,dhv->hsd", values, dense)
    return torch.einsum("hks,hsd->hksd", attn.double(), transformed).sum(0)


def _alti_layers(model, family: str, ids):
    """The authors' per-layer contributions, normalised (``min_sum``), for one example."""
    out, seen, heads, kv_heads = _run(model, family, ids)
    layers = []
    for layer, (_, weight, bias, ln1, ln2) in enumerate(_modules(model, family)):
        hidden = out.hidden_states[layer][0].double()
        summed = _layer_vectors(out.attentions[layer][0], seen["values"][layer], weight.detach(), heads, kv_heads)
        summed = _through_attention_norm(model, family, layer, seen, summed, slice(None))
        residual = summed + torch.einsum("sk,sd->skd", torch.eye(hidden.shape[0], dtype=hidden.dtype), hidden)
        if ln1 is not None:  # post-norm: T_i(x_j) through LN1's linear map; y: LN1's output
            pre = seen["ln1"][layer][0].double()
            vectors, coef = _l_transform(residual, ln1.weight.detach(), pre, True, ln1.eps)
            vectors = vectors * coef[:, None, None]
            resultant = ln1(seen["ln1"][layer]).detach()[0].double()
        else:  # pre-norm: y = Σ_j T_i(x_j) + b_O, the input of the next norm
            vectors = residual
            resultant = vectors.sum(1) + (0.0 if bias is None else bias.detach().double())
            expected = seen["beside" if family == "gptj" else "ln2"][layer][0].double()
            torch.testing.assert_close(resultant, expected, rtol=1e-5, atol=1e-5)
        importance = -F.pairwise_distance(vectors, resultant[:, None, :], p=1)
        contributions = (importance + resultant.abs().sum(-1)[:, None]).clamp(min=0)
        layers.append(contributions / contributions.sum(-1, keepdim=True))
    return layers, out, seen


def _rollout(layers):
    joint = [layers[0]]
    for layer in layers[1:]:
        joint.append(layer @ joint[-1])
    return joint


def _examples(ids, mask):
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        yield b, real, ids[b, real][None]


def reference(model, family: str, ids, mask, query: int) -> torch.Tensor:
    """ALTI's row of the explained query, per example, at its real positions."""
    scores = torch.zeros(ids.shape)
    for b, real, example in _examples(ids, mask):
        row = query if family in ("bert", "albert") else int(real.sum()) - 1  # decoders: left padding, the last token
        layers, _, _ = _alti_layers(model, family, example)
        scores[b, real] = _rollout(layers)[-1][row].float()
    return scores


def logit_reference(model, family: str, ids, mask, tokens=None) -> torch.Tensor:
    """ALTI-Logit (``logit_aff_x_j_alti`` summed over layers) for the predicted token, or
    ``tokens[b]``, at each example's last position."""
    scores = torch.zeros(ids.shape)
    final, embed = _final(model, family)
    centred = family in ("gpt2", "gptj")  # their LayerNorm; Llama's and Gemma's RMSNorm: γ·z / rms
    for b, real, example in _examples(ids, mask):
        layers, out, seen = _alti_layers(model, family, example)
        joint = _rollout(layers)
        pos = example.shape[1] - 1
        token = int(out.logits[0, pos].argmax()) if tokens is None else int(tokens[b])
        pre_lnf = seen["final"][0][0].double()
        heads, kv_heads = model.config.num_attention_heads, getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
        total = torch.zeros(example.shape[1], dtype=torch.float64)
        reach = _reach(model, family)
        for layer, (_, weight, _, _, _) in enumerate(_modules(model, family)):
            aff = _layer_vectors(out.attentions[layer][0], seen["values"][layer], weight.detach(), heads, kv_heads)
            aff = _through_attention_norm(model, family, layer, seen, aff[pos : pos + 1], slice(pos, pos + 1))[0]
            gamma, eps = (final.weight.detach(), final.eps) if centred else _rms_params(final, family)
            lin, coef = _l_transform(aff, gamma, pre_lnf[pos], centred, eps)
            logits = (lin * coef) @ embed.detach()[token].double() * reach[layer]  # (T,) Δlogit^l per token j
            total += logits if layer == 0 else logits @ joint[layer - 1]
        scores[b, real] = total.float()
    return scores


def residual_norms_reference(model, family: str, ids, mask, query: int, layer: int) -> torch.Tensor:
    """Kobayashi et al. (2021)'s ``post_ln_norm`` (``residual_weighted_norm`` in a pre-norm
    layer) at the query row, per example, as their modified ``BertSelfAttention`` computes
    it: each vector of the sum centred by its own mean, over the norm input's deviation,
    times γ."""
    scores = torch.zeros(ids.shape)
    for b, real, example in _examples(ids, mask):
        row = query if family in ("bert", "albert") else int(real.sum()) - 1
        scores[b, real] = example_residual_norms(model, family, example, row, layer)
    return scores


def example_residual_norms(model, family: str, example, row: int, layer: int) -> torch.Tensor:
    """:func:`residual_norms_reference` of one unpadded example ``(1, T)`` at its ``row``,
    over every position the layer attends to."""
    out, seen, heads, kv_heads = _run(model, family, example)
    layers = _modules(model, family)
    layer = layer % len(layers)
    weight, ln1 = layers[layer][1], layers[layer][3]
    hidden = out.hidden_states[layer][0].double()  # the layer's input
    summed = _layer_vectors(out.attentions[layer][0], seen["values"][layer], weight.detach(), heads, kv_heads)
    summed = _through_attention_norm(model, family, layer, seen, summed[row : row + 1], slice(row, row + 1))[0]
    residual = summed + torch.eye(hidden.shape[0], dtype=hidden.dtype)[row][:, None] * hidden[row]
    if ln1 is not None:
        pre = seen["ln1"][layer][0, row].double()
        var = (pre - pre.mean()).pow(2).mean()
        residual = (residual - residual.mean(-1, keepdim=True)) / (var + ln1.eps) ** 0.5 * ln1.weight.detach().double()
    return residual.norm(dim=-1).float()


@pytest.mark.parametrize("layer", [-1, 0])
@pytest.mark.parametrize("family", ["bert", "albert", "llama", "gpt2", "gemma2", "gptj", "gemma4"])
def test_norm_attention_with_the_residual_equals_kobayashi_2021(family, layer, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    scores = NormAttention(model).attribute(ids, additional_forward_args=(mask,), layer=layer, residual=True)
    assert_same_state(before, model_state(model))
    expected = residual_norms_reference(model, family, ids, mask, query, layer)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    plain = NormAttention(model).attribute(ids, additional_forward_args=(mask,), layer=layer)
    assert not torch.allclose(plain, scores)


@pytest.mark.parametrize("family", ["bert", "albert", "llama", "gpt2", "gemma2", "gptj", "gemma4"])
def test_alti_equals_the_authors_computation(family, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    scores = ALTI(model).attribute(ids, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    expected = reference(model, family, ids, mask, query)
    assert expected.abs().sum() > 0 and not scores.requires_grad
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.fixture
def compiled_contributions(monkeypatch):
    """Every block's contributions compiled at once, as layers of 512+ tokens compute them
    once the eager budget is spent, in pieces of 4 rows and 3 keys; the compiled functions,
    by (function, device)."""
    monkeypatch.setattr(context_mixing, "ALTI_COMPILE_MIN_PAIRS", 0)
    monkeypatch.setitem(context_mixing.ALTI_TILE, "cpu", (4, 3))
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", 0.0)
    monkeypatch.setattr(streaming, "_COMPILED", {})
    return streaming._COMPILED


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_compiled_contributions_equal_the_authors_computation(family, compiled_contributions):
    """The contributions compiled into one loop per block give ALTI and ALTI-Logit the
    authors' figures."""
    model, ids, mask, query = one_stack_case(family)
    expected = reference(model, family, ids, mask, query)
    for capture in ("streaming", "eager"):
        scores = ALTI(model, capture=capture).attribute(ids, additional_forward_args=(mask,))
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert compiled_contributions[(context_mixing._mixed_nearness, "cpu")] is not None
    if family == "llama":
        logits = ALTILogit(model).attribute(ids, additional_forward_args=(mask,))
        wanted = logit_reference(model, family, ids, mask)
        torch.testing.assert_close(logits, wanted, rtol=1e-5, atol=1e-5 * wanted.abs().max().item())


def test_a_failing_compiler_leaves_the_contributions_eager(monkeypatch, compiled_contributions, failing_compiler):
    model, ids, mask, _ = one_stack_case("llama")
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", float("inf"))  # the same pieces, never compiled
    expected = ALTI(model).attribute(ids, additional_forward_args=(mask,))
    monkeypatch.setattr(streaming, "COMPILE_AFTER_SECONDS", 0.0)
    assert torch.equal(ALTI(model).attribute(ids, additional_forward_args=(mask,)), expected)
    assert compiled_contributions[(context_mixing._mixed_nearness, "cpu")] is None, "a failure is remembered"


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "gptj", "gemma4"])
def test_alti_logit_equals_the_authors_computation(family, capture_mode):
    model, ids, mask, _ = one_stack_case(family)
    model.config.final_logit_softcapping = None  # Gemma-2's logit cap (refused below) off: Gemma-3's and OLMo-2's wiring
    before = model_state(model)
    scores = ALTILogit(model).attribute(ids, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    expected = logit_reference(model, family, ids, mask)
    assert (expected < 0).any() and (expected > 0).any()  # signed, in logit units
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    tokens = torch.tensor([5, 9, 11])
    chosen = ALTILogit(model).attribute(ids, target=tokens, additional_forward_args=(mask,))
    torch.testing.assert_close(chosen, logit_reference(model, family, ids, mask, tokens), rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_answers_rows_and_spans_and_the_llm_interface():
    model = make_decoder("llama")
    rows, ids, mask = answer_rows(ALTI(model))
    second = reference(model, "llama", ids, mask, ids.shape[1] - 1)
    torch.testing.assert_close(rows[:, 1, : ids.shape[1]], second, rtol=1e-5, atol=1e-6)
    logit_rows, ids, mask = answer_rows(ALTILogit(model))
    expected = logit_reference(model, "llama", ids, mask, tokens=torch.tensor([9, 3, 4]))
    torch.testing.assert_close(logit_rows[:, 1, : ids.shape[1]], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    tokenizer = make_word_tokenizer()
    from captum.attr import TextTokenInput

    for explainer in (ALTI(model), ALTILogit(model)):
        result = LLMAttentionAttribution(explainer, tokenizer).attribute(TextTokenInput("the secret code is", tokenizer), target="seven")
        assert result.seq_attr.shape == (5,) and bool(result.seq_attr.ne(0).any())


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss"])
@pytest.mark.parametrize("pieces", [False, True])
def test_streaming_equals_eager_across_families(family, pieces, monkeypatch):
    """Also with streaming's contributions in pieces of 2 rows and 3 keys (eager: whole
    blocks), which under gpt-oss's window of 4 keys start past the first key."""
    model = make_decoder(family)
    _, ids, mask, _ = one_stack_case("llama")
    for method in (ALTI, ALTILogit):
        eager = method(model, capture="eager").attribute(ids, additional_forward_args=(mask,))
        with monkeypatch.context() as patched:
            if pieces:
                patched.setattr(context_mixing, "ALTI_COMPILE_MIN_PAIRS", 0)
                patched.setitem(context_mixing.ALTI_TILE, "cpu", (2, 3))
                patched.setattr(streaming, "COMPILE_AFTER_SECONDS", float("inf"))
            streamed = method(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
        torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-6 * eager.abs().max().item())
        assert bool(eager[~mask.bool()].eq(0).all())


@pytest.mark.parametrize("method", [ALTI, ALTILogit])
def test_streaming_descends_the_layers_without_a_whole_matrix_and_equals_eager(method, monkeypatch):
    """Streaming carries the explained rows down from the top, each layer's matrix used
    block by block: never built whole (the eager cache would be), for a row, a span and
    every row of a continuation at once, each equal to eager's full matrices."""
    from captum_attention.attr import _decomposed

    model, prompts = make_decoder("llama"), make_prompts(side="left")
    ids, mask = prompts.input_ids, prompts.attention_mask
    continuation = torch.tensor([[7, 8, 9], [9, 10, 3], [11, 12, 4]])
    calls = {
        "row": lambda e: e.attribute(ids, additional_forward_args=(mask,)),
        "span": lambda e: e.attribute_span(ids, continuation, additional_forward_args=(mask,)),
        "rows": lambda e: e.attribute_continuation(ids, continuation, additional_forward_args=(mask,)),
    }
    eager = {name: call(method(model, capture="eager")) for name, call in calls.items()}

    def whole(*args, **kwargs):
        raise AssertionError("streaming built every layer's whole matrix")

    monkeypatch.setattr(_decomposed, "_contributions", whole)
    for name, call in calls.items():
        streamed = call(method(model, capture="streaming"))
        torch.testing.assert_close(streamed, eager[name], rtol=1e-5, atol=1e-6 * eager[name].abs().max().item())


@pytest.mark.parametrize("states", [False, True, -1, 0])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_the_forward_records_the_module_states_of_the_layers_asked_for(family, states):
    """Each recorded layer's states are its modules' own, in the order they returned: those
    a hook on every module of the layer sees with the layer's output shape, inputs included
    where they have it too (nothing wider, such as a feed-forward's inner states), and
    none of the modules inside the attention module (its projections)."""
    from contextlib import ExitStack

    from captum_attention.capture import LayerBlocks, default_adapter

    model, ids, mask, _ = one_stack_case(family)
    blocks = list(model.bert.encoder.layer if family == "bert" else model.transformer.h)
    attention = [block.attention.self if family == "bert" else block.attn for block in blocks]
    projections = {id(m) for a in attention for m in a.modules() if m is not a}
    assert len(projections) >= 2 * len(blocks)  # query, key, value (BERT); c_attn, c_proj (GPT-2)
    seen: list[list] = [[] for _ in blocks]

    def watch(index):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[-1] == model.config.hidden_size:
                first = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].shape == hidden.shape else None
                seen[index].append((module, first, hidden))
        return hook

    probe = LayerBlocks(states)
    with ExitStack() as stack, torch.no_grad():
        for index, block in enumerate(blocks):
            for module in block.modules():
                if module is not block and id(module) not in projections:
                    stack.callback(module.register_forward_hook(watch(index)).remove)
        probe.enter(model, default_adapter(model), stack)
        model(ids, attention_mask=mask)
    calls = probe.result().calls
    layers = list(range(len(blocks))) if states is True else [] if states is False else [range(len(blocks))[states]]
    assert len(calls) == len(blocks) > 2 and [index for index, call in enumerate(calls) if call.states is not None] == layers
    for index in layers:
        recorded = calls[index].states
        assert [state.module for state in recorded] == [module for module, _, _ in seen[index]]
        for state, (_, first, hidden) in zip(recorded, seen[index]):
            assert torch.equal(state.output, hidden) and state.output.shape == calls[index].output.shape
            assert (state.inputs is None) == (first is None) and (first is None or torch.equal(state.inputs, first))


def test_a_module_output_changed_in_place_after_its_use_is_read_as_it_was(capture_mode):
    """Falcon adds its attention output into its feed-forward's output in place: the states
    a forward keeps are copies, so such a layer gets the scores of one that does not."""
    model, ids, mask, _ = one_stack_case("gptj")
    expected = ALTI(model).attribute(ids, additional_forward_args=(mask,))
    outputs: list = []

    def keep(module, args, output) -> None:
        outputs.append(output)

    def change_in_place(module, args, output) -> None:  # after the block used it
        outputs.pop().add_(1.0)

    for block in model.transformer.h:
        block.mlp.register_forward_hook(keep)
        block.register_forward_hook(change_in_place)
    torch.testing.assert_close(ALTI(model).attribute(ids, additional_forward_args=(mask,)), expected, rtol=0, atol=0)


def test_a_layer_called_twice_gets_the_scores_of_its_copy(capture_mode):
    """A forward that calls one layer twice (shared weights) is decomposed call by call: its
    scores equal those of the same model with a copy in the second call's place."""
    model = make_decoder("llama")
    model.config.use_cache = False  # the shared layer's cache index would collide
    prompts = make_prompts(side="left")
    shared, unshared = copy.deepcopy(model), copy.deepcopy(model)
    shared.model.layers[2] = shared.model.layers[0]
    unshared.model.layers[2] = copy.deepcopy(unshared.model.layers[0])
    unshared.model.layers[2].self_attn.layer_idx = 2
    runs = [lambda m: ALTI(m).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))]
    runs += [lambda m, layer=layer: NormAttention(m).attribute(
        prompts.input_ids, additional_forward_args=(prompts.attention_mask,), residual=True, layer=layer) for layer in (-1, 1)]
    for run in runs:
        expected = run(unshared)
        assert expected.abs().sum() > 0
        torch.testing.assert_close(run(shared), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_layers_that_are_not_a_sum_over_tokens_are_refused_in_one_line():
    model, ids, mask, _ = one_stack_case("llama")
    scaled = make_decoder("llama")
    scaled.model.layers[1].self_attn.register_forward_hook(  # the attention's branch scaled (MiniCPM-3's scale_depth)
        lambda module, args, output: (output[0] * 0.5, *output[1:]))
    before = model_state(scaled)
    with pytest.raises(UnsupportedModelError, match="No norm in LlamaDecoderLayer takes the sum of its input and its attention "
                       "output, nor the attention output before a residual") as refused:
        ALTI(scaled).attribute(ids, additional_forward_args=(mask,))
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(scaled))
    bert, bert_ids, bert_mask, _ = one_stack_case("bert")
    with pytest.raises(UnsupportedModelError, match="next-token logit"):
        ALTILogit(bert).attribute(bert_ids, additional_forward_args=(bert_mask,))
    with pytest.raises(ValueError, match="one self-attention stack"):
        ALTI(make_encoder_decoder("t5")).attribute((ids[:, :4], ids[:, :3]))


def test_layers_that_weight_another_layers_values_are_refused_by_the_rollouts(capture_mode):
    """Gemma-4's key-value sharing: its last two layers weight the values of the first two,
    computed from those layers' inputs, not from the inputs ALTI's rollout carries each
    layer's vectors through (nor those Value Zeroing re-runs each layer on)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0, num_kv_shared_layers=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0,
    )).eval()
    prompts = make_prompts(side="left")
    before = model_state(model)
    for method in (ALTI, ALTILogit):
        with pytest.raises(UnsupportedModelError, match=r"call 2 of Gemma4ForCausalLM weights the values of call 0 \(key-value "
                           r"sharing across layers\)") as refused:
            method(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
        assert "\n" not in str(refused.value)
    with pytest.raises(UnsupportedModelError, match="Value Zeroing zeroes each layer's own values, but attention calls 2, 3 of "
                       "Gemma4ForCausalLM reuse an earlier layer's keys and values"):  # streaming ran, zeroing them as its own
        ValueZeroing(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("layer_types", [
    ["full_attention", "linear_attention", "full_attention"],
    ["linear_attention", "full_attention", "full_attention"],
    ["full_attention", "full_attention", "linear_attention"],
])
def test_a_stack_with_layers_without_attention_is_refused_by_the_rollouts(layer_types):
    """A hybrid's linear attention (a gated delta rule) mixes tokens in layers a rollout of
    the attention layers would skip: between them, before or after them. Every method that
    rolls the attention layers out refuses it, and the others run."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    torch.manual_seed(0)
    model = OlmoHybridForCausalLM(OlmoHybridConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=layer_types, pad_token_id=0,
    )).eval()
    prompts = make_prompts(side="left")
    rolling = [cls for cls in REGISTRY.values() if cls.spec.rolls_out]
    assert {cls.spec.name for cls in rolling} == {"rollout", "transformer_attribution", "attention_flow", "alti", "alti_logit",
                                                  "value_zeroing"}
    for method in rolling:
        with pytest.raises(UnsupportedModelError, match=f"{method.spec.readable_name} rolls out the attention layers, but "
                           "OlmoHybridForCausalLM also mixes tokens outside them \\(OlmoHybridLinearAttentionDecoderLayer "
                           "layers without attention\\): use AttnLRP") as refused:
            method(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
        assert "\n" not in str(refused.value)
    for method in (GradSAM, RawAttention):
        assert method(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,)).shape == prompts.input_ids.shape


def _falcon_h1() -> torch.nn.Module:
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4, pad_token_id=0,
    ))


def _convbert() -> torch.nn.Module:
    from transformers import ConvBertConfig, ConvBertForSequenceClassification

    return ConvBertForSequenceClassification(ConvBertConfig(
        vocab_size=64, hidden_size=32, embedding_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        conv_kernel_size=3, num_labels=2, pad_token_id=0,
    ))


@pytest.mark.parametrize("build, mixer", [
    (_falcon_h1, "FalconH1Mixer"),  # a state-space branch beside the attention in every layer
    (_convbert, "SeparableConv1D"),  # convolution heads beside the attention heads
])
def test_a_convolution_over_the_tokens_inside_the_attention_layers_is_refused_by_the_rollouts(build, mixer):
    """A convolution whose windows overlap along the tokens mixes them inside the attention
    layers, outside the attention probabilities; every method that rolls the layers out
    (and explains this kind of model) refuses it, and the others run."""
    torch.manual_seed(0)
    model = build().eval()
    classifier = mixer == "SeparableConv1D"
    prompts = make_prompts(side="right" if classifier else "left")
    before = model_state(model)
    for method in [cls for cls in REGISTRY.values() if cls.spec.rolls_out and (cls.spec.classifiers or not classifier)]:
        with pytest.raises(UnsupportedModelError, match=f"{method.spec.readable_name} rolls out the attention layers, but "
                           f"{type(model).__name__} also mixes tokens outside them \\(a convolution over the tokens in {mixer}\\)"):
            method(model).attribute(prompts.input_ids, target=0 if classifier else None,
                                    additional_forward_args=(prompts.attention_mask,))
    for method in (GradSAM, RawAttention):
        scores = method(model).attribute(prompts.input_ids, target=0 if classifier else None,
                                         additional_forward_args=(prompts.attention_mask,))
        assert scores.shape == prompts.input_ids.shape
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("kernel, stride, mixes", [(1, 1, False), (2, 2, False), (3, 1, True), (3, 2, True)])
def test_a_convolution_mixes_the_tokens_where_its_windows_overlap(kernel, stride, mixes):
    """Kernel 1 (a projection per token, as SqueezeBERT's) or a stride equal to the kernel
    (cells merged, as SegFormer's reduced keys) mix nothing; overlapping windows do."""
    model, _, _, _ = one_stack_case("llama")
    model = copy.deepcopy(model)
    model.model.layers[1].mlp.add_module("conv", torch.nn.Conv1d(4, 4, kernel, stride=stride))
    found = tokens_mixed_outside_attention(model, HuggingFaceAdapter())
    assert found == ("a convolution over the tokens in LlamaMLP" if mixes else None)


def test_a_stream_changed_between_two_attention_layers_is_refused_by_the_decompositions(capture_mode):
    """Tokens mixed between two layers outside any layer (each token given a share of the
    one before it), which ALTI's rollout would skip."""
    model, ids, mask, _ = one_stack_case("llama")
    model.model.layers[1].register_forward_pre_hook(
        lambda module, args: (args[0] + 0.5 * torch.roll(args[0], 1, dims=1), *args[1:]))
    full = mask[:, 0] != 0  # unpadded: the mixing would also carry the left padding into the prompts
    for method in (ALTI, ALTILogit):
        with pytest.raises(UnsupportedModelError, match="the input of LlamaForCausalLM's attention layer 1 is not the output "
                           "of its attention layer 0: something between them changes the residual stream"):
            method(model).attribute(ids[full], additional_forward_args=(mask[full],))


def test_a_layer_skipped_between_the_attention_layers_is_no_refusal():
    """Mllama's cross-attention layer between two self-attention layers, skipped without an
    image: the stream passes it unchanged, and the rollout covers every layer that ran."""
    from transformers import MllamaForCausalLM, MllamaTextConfig

    torch.manual_seed(0)
    model = MllamaForCausalLM(MllamaTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        cross_attention_layers=[1], pad_token_id=0,
    )).eval()
    prompts = make_prompts(side="left")
    scores = ALTI(model).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    torch.testing.assert_close(scores.sum(-1), torch.ones(scores.shape[0]))


def test_post_norm_language_models_are_refused_by_alti_logit():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=24)).eval()
    ids = torch.randint(3, 40, (2, 6))
    assert ALTI(model).attribute(ids, query_index=3).shape == (2, 6)
    with pytest.raises(UnsupportedModelError, match="post-norm layers of BertForMaskedLM"):
        ALTILogit(model).attribute(ids, query_index=3)


def test_capped_logits_are_refused(monkeypatch):
    model, ids, mask, _ = one_stack_case("gpt2")
    original = type(model).forward

    def capped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    monkeypatch.setattr(type(model), "forward", capped)
    with pytest.raises(UnsupportedModelError, match="logit cap or scale"):
        ALTILogit(model).attribute(ids, additional_forward_args=(mask,))


def test_registered_out_of_reports():
    assert REGISTRY["alti"] is ALTI and REGISTRY["alti_logit"] is ALTILogit
    assert "alti" not in METHODS and "alti_logit" not in METHODS


@pytest.mark.parametrize(
    "head, model_type",
    [("causal LM", "opt"), ("sequence classification", "distilbert"), ("image classification", "vit")],
)
def test_other_wirings_stream_as_they_run_eager_and_their_rows_sum_to_one(head, model_type):
    """OPT flattens the tokens before its second norm, DistilBERT names its post-norms
    differently, ViT is a pre-norm encoder of patches: each found from its own modules."""
    import zoo

    architecture = next(a for a in zoo.architectures(head) if a.model_type == model_type)
    case = zoo.runs(zoo.make_case(zoo.build(architecture), architecture))
    eager = ALTI(case.model, capture="eager").attribute(case.inputs, additional_forward_args=case.args)
    streamed = ALTI(case.model, capture="streaming").attribute(case.inputs, additional_forward_args=case.args)
    torch.testing.assert_close(streamed, eager, rtol=1e-5, atol=1e-6)
    totals = eager.flatten(1).sum(dim=1)
    if head == "image classification":  # the patches' share: the class token's is not on the grid
        assert bool(((totals > 0.5) & (totals < 1.0)).all())
    else:
        torch.testing.assert_close(totals, torch.ones(len(eager)), rtol=1e-5, atol=1e-5)


def test_blocks_of_a_few_rows_give_the_scores_of_one_block(monkeypatch):
    model, ids, mask, _ = one_stack_case("llama")
    explainers = [(ALTI(model), {}), (ALTILogit(model), {}), (NormAttention(model), {"residual": True})]
    whole = [explainer.attribute(ids, additional_forward_args=(mask,), **options) for explainer, options in explainers]
    monkeypatch.setitem(_decomposed.BLOCK_ELEMENTS, "cpu", 3 * ids.shape[1] * model.config.hidden_size * 2)  # 2 rows
    row = ids.shape[1] * model.config.hidden_size  # a row's transformed vectors
    assert len(list(_decomposed.row_blocks(3, ids.shape[1], row, torch.device("cpu")))) == 4
    for (explainer, options), expected in zip(explainers, whole):
        torch.testing.assert_close(explainer.attribute(ids, additional_forward_args=(mask,), **options), expected,
                                   rtol=1e-5, atol=1e-6)


def test_the_sum_over_tokens_is_checked_on_rows_spread_from_first_to_last(monkeypatch):
    """The layer's sum over tokens is compared with the model's states on a few runs of rows
    from the first to the last; one wrong run of attention rows among them is refused in one line."""
    monkeypatch.setattr(_decomposed, "CHECKED_ROWS", 6)
    monkeypatch.setattr(_decomposed, "CHECKED_RUN", 2)
    model, ids, mask, _ = one_stack_case("llama")
    tokens = ids.shape[1]
    checked = _decomposed.checked_rows(tokens)
    middle = round((tokens - 2) / 2)
    assert tokens > 6 and checked == [slice(0, 2), slice(middle, middle + 2), slice(tokens - 2, tokens)]
    assert _decomposed.checked_rows(6) == [slice(0, 6)]
    original = _decomposed.attention_rows

    def one_wrong_row(record, call, rows):
        probs = original(record, call, rows)
        return probs.flip(-1) if rows.start == middle else probs

    monkeypatch.setattr(_decomposed, "attention_rows", one_wrong_row)
    with pytest.raises(UnsupportedModelError, match="No norm in LlamaDecoderLayer takes the sum") as refused:
        ALTI(model).attribute(ids, additional_forward_args=(mask,))
    assert "\n" not in str(refused.value)
