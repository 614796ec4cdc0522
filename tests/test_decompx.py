"""DecompX (Modarressi et al., ACL 2023) against recomputations written from the authors'
code (``mohsenfayyaz/DecompX``, ``src/modeling_bert.py`` with the paper's configuration:
biases included and shared by ``absdot``, both norms, the feed-forward with ``GeLU_ZO``,
``vector`` aggregation, the pooler's ``tanh`` at its zero-origin slope, the classifier):
each example's real tokens through an eager copy's attentions and hidden states, module
by module, with the attribution vectors of shape ``(tokens, tokens, hidden)``. The
pre-norm language models (GPT-2, Llama, which the authors' code does not cover) follow
the same rules, written out the same way: each norm's bias shared by ``absdot`` where it
is added, the value bias in the first layer kept by each token and later carried into the
output projection's, Llama's gated feed-forward with the activation held."""

from __future__ import annotations

import copy

import pytest
import torch
from constants import VOCAB
from conftest import assert_same_state, make_batch, make_model, model_state
from lm_models import answer_rows, make_decoder, make_prompts, make_vision, make_encoder_decoder, make_word_tokenizer, one_stack_case

from captum_attention import DecompX, UnsupportedModelError
from captum_attention.attr import METHODS, REGISTRY


def _share_bias(vectors, bias, by=None):
    """The authors' ``bias_decomposer`` (``absdot``) over the token axis -2 (its weights
    held in the autograd graph, so that a gradient through the rules is their linear
    part's)."""
    weights = torch.einsum("...kd,...d->...k", (vectors if by is None else by).detach(), bias).abs()
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-12)
    return vectors + weights[..., None] * bias


def _norm_shares(vectors, states, norm, centred: bool):
    """The authors' ``ln_decomposer``: each share centred (LayerNorm), divided by the
    token's standard deviation (or root mean square) of ``states``, times γ; β shared."""
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if centred:
        spread = (states - states.mean(-1, keepdim=True)).pow(2).mean(-1, keepdim=True)
        vectors = vectors - vectors.mean(-1, keepdim=True)
    else:
        spread = states.pow(2).mean(-1, keepdim=True)
    normed = vectors / (spread[..., None, :] + eps).sqrt() * norm.weight
    bias = getattr(norm, "bias", None)
    return normed if bias is None else _share_bias(normed, bias)


def _positions(model, mask) -> dict:
    """A decoder's positions counted from each row's first real token (left padding)."""
    return {} if model.config.model_type not in ("llama", "gpt2", "qwen2", "gemma2", "olmo") else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _eager_run(model, ids, mask):
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return model, model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True, **_positions(model, mask))


def _value_shares(shares, weight, bias, first: bool, heads: int):
    """Each token's value of each share ``(H, i, k, dh)``: the first layer's keep their
    bias at their own token."""
    values = torch.einsum("ikd,vd->ikv", shares, weight)
    if first:
        values = values + torch.eye(shares.shape[0])[..., None] * bias
    return values.view(*values.shape[:2], heads, -1).permute(2, 0, 1, 3)


def _attended(attn, values, out_weight, groups: int):
    """Σ_j α_ij W_O^h v_{j,k} summed over heads ``(i, k, D)``; ``values`` per key-value head."""
    values = values.repeat_interleave(groups, dim=0)
    heads, head_dim = attn.shape[0], values.shape[-1]
    per_head = out_weight.view(out_weight.shape[0], heads, head_dim)
    return torch.einsum("hij,hjkv,dhv->ikd", attn, values, per_head)


def _first_shares(x, local: bool):
    """The first layer's shares ``(i, k, D)``, token k's state alone at i = k; a leaf
    requiring grad where the sensitivity is asked (``local``)."""
    shares = torch.einsum("ik,id->ikd", torch.eye(len(x)), x)
    return shares.requires_grad_() if local else shares


def _score(logit, first, local: bool):
    """Each token's share of ``logit`` ``(k,)``; ``local``: the L1 norm of the gradient of
    its sum at each token's own first-layer share (``first`` ``(i, k, D)``, i = k)."""
    if not local:
        return logit.detach()
    (grad,) = torch.autograd.grad(logit.sum(), first)
    return grad.diagonal(dim1=0, dim2=1).abs().sum(dim=0)


def bert_reference(model, ids, mask, target, local: bool = False) -> torch.Tensor:
    """``local``: the sensitivity of ``DecompX(multiply_by_inputs=False)`` instead."""
    eager, out = _eager_run(model, ids, mask)
    scores = torch.zeros(ids.shape)
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        shares = None
        for layer_index, layer in enumerate(eager.bert.encoder.layer):
            x = out.hidden_states[layer_index][b, real]
            attn = out.attentions[layer_index][b][:, real][:, :, real]
            sa, so = layer.attention.self, layer.attention.output
            heads = sa.num_attention_heads
            first = shares is None
            if first:
                shares = leaf = _first_shares(x, local)
            values = _value_shares(shares, sa.value.weight, sa.value.bias, first, heads)
            attended = _attended(attn, values, so.dense.weight, 1)
            joined = so.dense.bias if first else so.dense.weight @ sa.value.bias + so.dense.bias
            residual = _share_bias(attended + shares, joined)
            context = torch.einsum("hij,jhv->ihv", attn, sa.value(x).view(len(x), heads, -1)).flatten(1)
            pre_ln = so.dense(context) + x
            post_ln = _norm_shares(residual, pre_ln, so.LayerNorm, True)
            attention_output = so.LayerNorm(pre_ln)
            z = layer.intermediate.dense(attention_output)
            a = layer.intermediate.intermediate_act_fn(z)
            ffn = _share_bias(torch.einsum("ld,ikd->ikl", layer.intermediate.dense.weight, post_ln), layer.intermediate.dense.bias)
            ffn = ffn * (a / (z + 1e-12))[:, None]
            ffn = _share_bias(torch.einsum("ikl,dl->ikd", ffn, layer.output.dense.weight), layer.output.dense.bias)
            shares = _norm_shares(post_ln + ffn, layer.output.dense(a) + attention_output, layer.output.LayerNorm, True)
        pooler = eager.bert.pooler.dense
        zp = pooler(out.hidden_states[-1][b, real][0])
        pooled = _share_bias(torch.einsum("ld,kd->kl", pooler.weight, shares[0]), pooler.bias) * (torch.tanh(zp) / (zp + 1e-12))
        logits = _share_bias(torch.einsum("cd,kd->kc", eager.classifier.weight, pooled), eager.classifier.bias)
        scores[b, real] = _score(logits[:, target[b]], leaf, local)
    return scores


def decoder_reference(model, family: str, ids, mask, position: int, tokens, local: bool = False) -> torch.Tensor:
    """The same rules on a pre-norm language model, for the logits of ``tokens`` ``(B,)``
    at ``position`` (``local``: their sensitivity)."""
    eager, out = _eager_run(model, ids, mask)
    scores = torch.zeros(ids.shape)
    layers = eager.model.layers if family == "llama" else eager.transformer.h
    centred = family == "gpt2"
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        shares = None
        for layer_index, layer in enumerate(layers):
            x = out.hidden_states[layer_index][b, real]
            attn = out.attentions[layer_index][b][:, real][:, :, real]
            first = shares is None
            if first:
                shares = leaf = _first_shares(x, local)
            if family == "llama":
                ln1, ln2, attention = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn
                heads, kv_heads = eager.config.num_attention_heads, eager.config.num_key_value_heads
                v_weight, v_bias = attention.v_proj.weight, torch.zeros(attention.v_proj.out_features)
                o_weight, o_bias = attention.o_proj.weight, torch.zeros(attention.o_proj.out_features)
            else:
                ln1, ln2, attention = layer.ln_1, layer.ln_2, layer.attn
                heads = kv_heads = eager.config.n_head
                width = x.shape[-1]
                v_weight, v_bias = attention.c_attn.weight[:, 2 * width :].t(), attention.c_attn.bias[2 * width :]
                o_weight, o_bias = attention.c_proj.weight.t(), attention.c_proj.bias
            normed = _norm_shares(shares, x, ln1, centred)
            values = _value_shares(normed, v_weight, v_bias, first, kv_heads)
            attended = _attended(attn, values, o_weight, heads // kv_heads)
            heads_bias = v_bias.view(kv_heads, -1).repeat_interleave(heads // kv_heads, dim=0).flatten()
            joined = o_bias if first else o_weight @ heads_bias + o_bias
            residual = shares + _share_bias(attended, joined, by=attended + shares)
            after_attention = residual.sum(dim=1).detach()  # equal to the model's, checked by the sum below
            normed = _norm_shares(residual, after_attention, ln2, centred)
            states = ln2(after_attention)
            if family == "llama":
                mlp = layer.mlp
                held = mlp.act_fn(mlp.gate_proj(states))
                up = torch.einsum("fd,ikd->ikf", mlp.up_proj.weight, normed) * held[:, None]
                ffn = torch.einsum("df,ikf->ikd", mlp.down_proj.weight, up)
            else:
                mlp = layer.mlp
                z = mlp.c_fc(states)
                a = mlp.act(z)
                ffn = _share_bias(torch.einsum("df,ikd->ikf", mlp.c_fc.weight, normed), mlp.c_fc.bias) * (a / (z + 1e-12))[:, None]
                ffn = _share_bias(torch.einsum("fd,ikf->ikd", mlp.c_proj.weight, ffn), mlp.c_proj.bias)
            shares = residual + ffn
        final = eager.model.norm if family == "llama" else eager.transformer.ln_f
        last = shares.sum(dim=1).detach()
        query = int(real[: position + 1].sum()) - 1
        normed = _norm_shares(shares, last, final, centred)[query]
        scores[b, real] = _score(normed @ eager.lm_head.weight[tokens[b]], leaf, local)
    return scores


def test_decompx_equals_the_authors_computation_on_bert(capture_mode):
    model, ids, mask, _ = one_stack_case("bert")
    before = model_state(model)
    target = [1, 0, 1]
    scores = DecompX(model, capture=capture_mode).attribute(ids, target=target, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    expected = bert_reference(model, ids, mask, target)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    logits = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(scores.sum(dim=1), logits[torch.arange(3), target].detach(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_decompx_on_language_models_equals_the_same_rules_written_out(family, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **_positions(model, mask)).logits[:, query]
    tokens = torch.tensor([5, 9, 3])
    scores = DecompX(model, capture=capture_mode).attribute(ids, target=tokens.tolist(), additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    torch.testing.assert_close(scores, decoder_reference(model, family, ids, mask, query, tokens), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(scores.sum(dim=1), logits[torch.arange(3), tokens], atol=1e-4, rtol=1e-4)
    assert bool((scores[mask == 0] == 0).all())


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_the_sensitivity_equals_the_rules_gradient_written_out(family, capture_mode):
    """``multiply_by_inputs=False``: the L1 norm of each token's gradient through the
    written-out rules (their bias shares held), from one backward on any model."""
    model, ids, mask, query = one_stack_case(family)
    before = model_state(model)
    target = [1, 0, 1] if family == "bert" else [5, 9, 3]
    scores = DecompX(model, capture=capture_mode, multiply_by_inputs=False).attribute(ids, target=target, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    if family == "bert":
        expected = bert_reference(model, ids, mask, target, local=True)
    else:
        expected = decoder_reference(model, family, ids, mask, query, torch.tensor(target), local=True)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert bool((scores[mask == 0] == 0).all()) and bool((scores >= 0).all())


@pytest.mark.parametrize("family", ["llama", "gemma2", "arcee"])
def test_a_model_without_biases_takes_one_backward_for_the_share_forwards_scores(family, capture_mode, monkeypatch):
    """Without a bias the forward on the shares is linear in the first layer's input, so
    one backward gives every token's share (Gemma-2: softcapped attention and logits, a
    norm on the attention output; Arcee: an activation that gates nothing, at its slope);
    the forward on N + 1 rows is not run."""
    import captum_attention.attr.decompx as decompx

    model, prompts = make_decoder(family), make_prompts(side="left")
    ids, mask = prompts.input_ids, prompts.attention_mask
    before = model_state(model)
    with monkeypatch.context() as patched:
        patched.setattr(decompx, "without_biases", lambda modules: False)
        shared = DecompX(model, capture=capture_mode).attribute(ids, target=[2, 1, 2], additional_forward_args=(mask,))

    def no_share_forward(*args, **kwargs):
        raise AssertionError("the forward on the shares ran")

    monkeypatch.setattr(decompx, "share_outputs", no_share_forward)
    scores = DecompX(model, capture=capture_mode).attribute(ids, target=[2, 1, 2], additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    torch.testing.assert_close(scores, shared, atol=1e-5, rtol=1e-4)
    gpt2 = make_decoder("gpt2")
    with pytest.raises(AssertionError, match="the forward on the shares ran"):  # biases: shared by absdot, not linear
        DecompX(gpt2).attribute(ids, target=[2, 1, 2], additional_forward_args=(mask,))


def test_under_no_grad_the_backward_still_runs(monkeypatch):
    """Captum's NoiseTunnel calls ``attribute`` under ``torch.no_grad``: the shares and the
    sensitivity still come from the held backward, not from the forward on the shares."""
    import captum_attention.attr.decompx as decompx
    from captum.attr import NoiseTunnel

    model, ids, mask, _ = one_stack_case("llama")
    args = dict(target=[5, 9, 3], additional_forward_args=(mask,))
    expected = {mode: DecompX(model, multiply_by_inputs=mode).attribute(ids, **args) for mode in (True, False)}

    def no_share_forward(*arguments):
        raise AssertionError("the forward on the shares ran")

    monkeypatch.setattr(decompx, "share_outputs", no_share_forward)
    for mode in (True, False):
        with torch.no_grad():
            torch.testing.assert_close(DecompX(model, multiply_by_inputs=mode).attribute(ids, **args), expected[mode])
    embeddings = model.get_input_embeddings()(ids).detach()
    tunnel = NoiseTunnel(DecompX(model, multiply_by_inputs=False))
    smoothed = tunnel.attribute(embeddings, nt_type="smoothgrad", nt_samples=2, stdevs=0.01, **args)
    assert smoothed.shape == ids.shape and bool((smoothed[mask == 0] == 0).all())


def test_one_example_alone_scores_as_in_a_padded_batch():
    model, ids, mask, query = one_stack_case("llama")
    explainer = DecompX(model)
    batched = explainer.attribute(ids, target=[4, 4, 4], additional_forward_args=(mask,))
    real = mask[2].bool()
    alone = explainer.attribute(ids[2:3, real], target=4)
    torch.testing.assert_close(batched[2, real], alone[0], atol=1e-5, rtol=1e-4)


def test_answers_spans_and_the_llm_interface():
    model = make_decoder("llama")
    explainer = DecompX(model)
    rows, ids, mask = answer_rows(explainer)  # the span is the rows' sum
    second = explainer.attribute(ids, target=[9, 3, 4], additional_forward_args=(mask,))
    torch.testing.assert_close(rows[:, 1, : ids.shape[1]], second, atol=1e-5, rtol=1e-4)
    from captum.attr import TextTokenInput

    from captum_attention import LLMAttentionAttribution

    tokenizer = make_word_tokenizer()
    prompt = TextTokenInput("the secret code is", tokenizer)
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(prompt, target="seven")
    ids = tokenizer("the secret code is", return_tensors="pt").input_ids  # BOS included, as the interface reads it
    answer = torch.tensor([tokenizer.encode("seven", add_special_tokens=False)])
    direct = explainer.attribute_span(ids, answer)[0, : ids.shape[1]]
    torch.testing.assert_close(result.seq_attr, direct, atol=1e-5, rtol=1e-4)  # signed logit shares, as attribute gives them


def test_refusals_name_the_problem():
    encoder_decoder = make_encoder_decoder("t5")
    with pytest.raises(ValueError, match="one self-attention stack"):
        DecompX(encoder_decoder).attribute((torch.tensor([[5, 6, 7]]), torch.tensor([[0, 5]])))
    model, ids, mask, _ = one_stack_case("bert")
    with pytest.raises(ValueError, match="return_maps"):
        DecompX(model).attribute(ids, additional_forward_args=(mask,), return_maps=True)
    model.train()
    with pytest.raises(ValueError, match="model.eval"):
        DecompX(model).attribute(ids, additional_forward_args=(mask,))
    functional = copy.deepcopy(model.eval())
    intermediate = functional.bert.encoder.layer[0].intermediate
    del intermediate.intermediate_act_fn
    intermediate.intermediate_act_fn = lambda t: 0.5 * t * (1.0 + torch.erf(t / 2**0.5))  # GELU through erf, not linearised
    before = model_state(functional)
    with pytest.raises(UnsupportedModelError, match="add up to logits"):
        DecompX(functional).attribute(ids, additional_forward_args=(mask,))
    assert_same_state(before, model_state(functional))


def test_without_biases_the_forward_on_the_shares_decides_where_the_backward_does_not_add_up(capture_mode, monkeypatch):
    import captum_attention.attr.decompx as decompx

    model, prompts = copy.deepcopy(make_decoder("llama")), make_prompts(side="left")
    mlp = model.model.layers[0].mlp
    del mlp.act_fn
    mlp.act_fn = lambda t: 0.5 * t * (1.0 + torch.erf(t / 2**0.5))  # GELU through erf, not linearised
    before = model_state(model)
    share_forwards = []
    share_outputs = decompx.share_outputs
    monkeypatch.setattr(decompx, "share_outputs", lambda *args: share_forwards.append(args) or share_outputs(*args))
    with pytest.raises(UnsupportedModelError, match="add up to logits"):
        DecompX(model, capture=capture_mode).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))
    assert len(share_forwards) == 1
    assert_same_state(before, model_state(model))


@pytest.mark.parametrize("family", ["roberta", "electra", "albert", "distilbert", "qwen2", "gemma2"])
def test_other_families_shares_add_up_to_their_logits_in_both_modes(family):
    """RoBERTa's head calls torch.tanh, DistilBERT's an inline nn.ReLU(), ALBERT shares one
    layer and norms inside its attention, Gemma-2 caps its logits with tanh and norms the
    attention output before the residual: all linearised where they run."""
    if family in ("qwen2", "gemma2"):
        model, prompts = make_decoder(family), make_prompts(side="left")
        ids, mask = prompts.input_ids, prompts.attention_mask
        query = ids.shape[1] - 1
    else:
        model = make_model(family)
        batch = make_batch(model)
        ids, mask, query = batch.input_ids, batch.attention_mask, None
    scores = {mode: DecompX(model, capture=mode).attribute(ids, target=[2, 1, 2], additional_forward_args=(mask,))
              for mode in ("eager", "streaming")}
    torch.testing.assert_close(scores["eager"], scores["streaming"])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **_positions(model, mask)).logits
    logits = logits if query is None else logits[:, query]
    torch.testing.assert_close(scores["eager"].sum(dim=1), logits[torch.arange(3), torch.tensor([2, 1, 2])], atol=1e-4, rtol=1e-4)


def test_a_mixture_of_experts_is_refused_in_one_line():
    prompts = make_prompts(side="left")
    with pytest.raises(UnsupportedModelError, match="router"):
        DecompX(make_decoder("gpt_oss")).attribute(prompts.input_ids, additional_forward_args=(prompts.attention_mask,))


def test_registered_out_of_reports():
    assert REGISTRY["decompx"] is DecompX and "decompx" not in METHODS


@pytest.mark.parametrize("name", ["vit", "deit"])
def test_vision_transformers_give_a_patch_grid_in_both_modes(name):
    """The shares of the patches (DeiT: the class and distillation heads' mean) on the
    grid; the call itself checks that every token's share adds up to the logit."""
    model = make_vision(name)
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    grids = {mode: DecompX(model, capture=mode).attribute(images, target=[0, 2]) for mode in ("eager", "streaming")}
    assert grids["eager"].shape == (2, 4, 4)
    torch.testing.assert_close(grids["eager"], grids["streaming"])


def test_half_precision_gives_the_float32_shares_within_its_rounding():
    model, ids, mask, _ = one_stack_case("llama")
    half_model = copy.deepcopy(model).to(torch.bfloat16)
    full = DecompX(copy.deepcopy(half_model).float()).attribute(ids, target=[5, 9, 3], additional_forward_args=(mask,))  # the same weights
    half = DecompX(half_model).attribute(ids, target=[5, 9, 3], additional_forward_args=(mask,))
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=0.05 * float(full.abs().max()), rtol=0.0)


@pytest.mark.parametrize("model_type", ["bloom", "gpt_neo", "deberta-v2", "roformer"])
def test_families_with_their_own_attention_add_up_through_their_softmax(model_type):
    """Attention outside transformers' sdpa function: the probabilities are held where the
    eager attention's softmax computes them, and the value bias taken out before the
    output projection."""
    from zoo import architectures, decomposition_outcome

    architecture = next(a for a in architectures("sequence classification") if a.model_type == model_type)
    outcome = decomposition_outcome(architecture)
    assert outcome.status == "exact", outcome


def test_a_norm_with_its_epsilon_in_its_code_is_read_through_its_outputs():
    """OLMo's LayerNorm has no weight, bias or epsilon attribute (1e-5 in its forward):
    its linear map is found among the common epsilons, checked against its outputs, and
    DecompX's and ALTI's calls on OLMo add up."""
    import transformers as tf

    from captum_attention import ALTI
    from captum_attention.capture.residual import linear_norm

    norm = tf.models.olmo.modeling_olmo.OlmoLayerNorm(16)
    states = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)) * 1e-2  # the epsilon matters at this scale
    torch.testing.assert_close(linear_norm(norm, states, norm(states))(states), norm(states))
    torch.manual_seed(0)
    model = tf.OlmoForCausalLM(tf.OlmoConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )).eval()
    prompts = make_prompts(side="left")
    ids, mask = prompts.input_ids, prompts.attention_mask
    scores = DecompX(model).attribute(ids, target=[2, 1, 2], additional_forward_args=(mask,))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, **_positions(model, mask)).logits[:, -1]
    torch.testing.assert_close(scores.sum(dim=1), logits[torch.arange(3), torch.tensor([2, 1, 2])], atol=1e-4, rtol=1e-4)
    assert torch.isfinite(ALTI(model).attribute(ids, additional_forward_args=(mask,))).all()


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_one_examples_copies_take_its_images_encoded_once(family, monkeypatch):
    """DecompX's N + 1 copies of one example about an image take it through the vision
    tower once (transformers' ``mm_encoder_outputs``) beside the explained forward, not
    once per copy, with the shares of the copies that carry the pixels; where the encoded
    images fail the forward, the copies carry them."""
    from vlm_models import ANSWER, family_example, tower_rows

    from captum_attention.attr import decompx

    model, ids, images = family_example(family)
    args = (torch.ones_like(ids), images)
    tokens = ids.shape[1] + ANSWER.shape[1]

    def span() -> torch.Tensor:
        return DecompX(model).attribute_span(ids, ANSWER[:1], additional_forward_args=args)

    encoded, one_image = span(), tower_rows(model, lambda: model(input_ids=ids, **images), monkeypatch)
    assert tower_rows(model, span, monkeypatch) == 2 * one_image, "the explained forward, and the images encoded once"
    with monkeypatch.context() as patch:
        patch.setattr(decompx, "encoded_images", lambda model, images: None)
        carried = span()
        assert tower_rows(model, span, monkeypatch) == (2 + tokens) * one_image, "the explained forward, and each copy"
    torch.testing.assert_close(encoded, carried, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(model, "_expand_multimodal_outputs", lambda *args, **kwargs: 1 / 0)
    torch.testing.assert_close(span(), carried, rtol=1e-5, atol=1e-6)
