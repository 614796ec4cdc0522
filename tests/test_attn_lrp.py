"""AttnLRP: against an independent re-implementation of the rules, conservation, every
family, both capture modes, invariances, and the model left as found."""

from __future__ import annotations

import pytest
import torch
from captum.attr import NoiseTunnel
from conftest import assert_same_state, make_batch, make_model, model_state, with_random_biases
from lm_models import make_decoder, make_prompts
from lrp_reference import (
    bart_relevance,
    bert_relevance,
    dbrx_relevance,
    distilbert_relevance,
    gpt2_relevance,
    llama_relevance,
    t5_relevance,
    vit_relevance,
)
from test_streaming import FAMILIES, _case
from zoo import architectures, build, explain, make_case

from captum_attention import METHODS, AttnLRP
from captum_attention._compat import attention_function
from captum_attention.maps.lrp import (
    RuleSwitch, held_constant, identity_rule, layer_norm_rule, linear_rule, rms_norm_rule, share_gradient,
)

UNIT_ROUNDOFF = 2.0**-24


def _bert_case():
    model = with_random_biases(make_model("bert"))
    batch = make_batch(model)
    return model, batch.input_ids, batch.attention_mask, torch.tensor([1, 0, 1]), bert_relevance


def _llama_case():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    with torch.no_grad():
        target = model(prompts.input_ids, attention_mask=prompts.attention_mask).logits[:, -1].argmax(dim=-1)
    return model, prompts.input_ids, prompts.attention_mask, target, llama_relevance


@pytest.mark.parametrize("case", [_bert_case, _llama_case], ids=["bert", "llama"])
def test_the_reference_conserves_the_logit_term_by_term(case):
    """Σ_t R_t + Σ absorbed = S per example. Tolerance: the float32 roundoff of the longest
    accumulation, (layers + 2) sums of at most ``width`` products each, relative to the
    sum of the terms' magnitudes: (L + 2)·width·u·Σ|terms|."""
    model, ids, mask, target, reference = case()
    decomposition = reference(model, ids, mask, target)
    config = model.config
    width = max(config.hidden_size, config.intermediate_size, ids.shape[1])
    tolerance = (config.num_hidden_layers + 2) * width * UNIT_ROUNDOFF * decomposition.magnitude
    total = decomposition.relevance.sum(dim=1) + decomposition.absorbed
    assert ((total - decomposition.explained).abs() <= tolerance).all(), (total, decomposition.explained, tolerance)
    assert (decomposition.relevance.abs().sum(dim=1) > 10 * tolerance).all(), "the tokens hold relevance"
    assert (decomposition.absorbed.abs() > 100 * tolerance).all(), "biases and the softmax absorb some"


@pytest.mark.parametrize("case", [_bert_case, _llama_case], ids=["bert", "llama"])
def test_attn_lrp_equals_the_reference(case, capture_mode):
    model, ids, mask, target, reference = case()
    expected = reference(model, ids, mask, target).relevance * mask
    actual = AttnLRP(model).attribute(ids, target=target, additional_forward_args=(mask,))
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


TARGET = 1  # a class of the classifiers, a token of the language models (BART's pad id is 1: not there)


def _reference(family: str, gamma: float):
    """``(library relevance, reference relevance)`` per embedded sequence for one family of
    ``test_streaming``'s cases, the reference written from the paper's rules
    (``lrp_reference``); ``gamma``: the γ-rule in every linear layer."""
    model, inputs, args, _ = _case(family)
    if family in ("vit", "deit"):
        target = torch.tensor([TARGET, TARGET])
        return model, inputs, args, [vit_relevance(model, inputs, target, gamma).relevance[:, -16:]], lambda r: [r.flatten(1)[:, -16:]]
    if family in ("t5", "bart"):
        source, decoder = inputs
        target = torch.full((len(source),), 5 if family == "bart" else TARGET)
        reference = {"t5": t5_relevance, "bart": bart_relevance}[family]
        pair = reference(model, source, decoder, *args, target, gamma)
        masks = args
        return model, inputs, args, [pair.source * masks[0], pair.target * masks[1]], list
    ids, (mask,) = inputs, args
    target = torch.full((len(ids),), TARGET)
    reference = {
        "bert": bert_relevance, "distilbert": distilbert_relevance, "gpt2": gpt2_relevance,
        "llama": llama_relevance, "qwen2": llama_relevance,
    }[family]
    return model, inputs, args, [reference(model, ids, mask, target, gamma=gamma).relevance * mask], lambda r: [r]


@pytest.mark.parametrize("model_type", ["persimmon", "llama"])
def test_embeddings_given_as_inputs_are_explained_as_the_ids_they_embed(model_type, capture_mode):
    """Given as inputs, the embeddings were leaves, which the rules take for weights:
    Persimmon's first layer norm, which reads them directly, lost its rule (relevance off by
    up to 0.3 of the scale). The model now reads copies of them, as it reads the recorded
    output of its input embeddings."""
    model = build(next(a for a in architectures("causal LM") if a.model_type == model_type))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        embedded = model.get_input_embeddings()(ids)
    expected = AttnLRP(model).attribute(ids, target=5)
    assert expected.abs().max() > 0
    torch.testing.assert_close(AttnLRP(model).attribute(embedded, target=5), expected, rtol=1e-5, atol=1e-6)


def _inputs_given(case, module) -> tuple[list, dict]:
    """The positional and keyword arguments ``module`` receives in one forward of the case."""
    given: list = []
    handle = module.register_forward_pre_hook(lambda module, args, kwargs: given.append((args, kwargs)), with_kwargs=True)
    try:
        with torch.no_grad():
            case.model(input_ids=case.inputs, **case.images)
    finally:
        handle.remove()
    return given[0]


def _relevance_and_input_gradients(case, modules) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """AttnLRP of the case, and the gradient its backward gives each module's input hidden
    states (read by hooks)."""
    grads: dict[int, torch.Tensor] = {}

    def gradient_of_input(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: grads.__setitem__(index, grad))
        return hook

    handles = [module.register_forward_pre_hook(gradient_of_input(i), with_kwargs=True) for i, module in enumerate(modules)]
    try:
        mask = torch.ones_like(case.inputs)
        scores = AttnLRP(case.model).attribute(case.inputs, target=case.target, additional_forward_args=(mask, case.images))
    finally:
        for handle in handles:
            handle.remove()
    return scores, [grads[i] for i in range(len(modules))]


@pytest.mark.parametrize("model_type", ["chameleon", "emu3", "fuyu"])
def test_image_features_scattered_into_the_embeddings_hold_their_relevance(model_type, capture_mode):
    """Chameleon, Emu3 and Fuyu scatter the image's features (its codes' embeddings, its
    projected patches) into the embeddings inside the model, which names no language model
    reading them: relevance was read at the tokens' own embeddings, which the features
    overwrite (the image's tokens scored 0). The embeddings with the features scattered in
    are now where relevance stops: the scores equal AttnLRP given those embeddings (the
    first layer's input) as inputs."""
    from captum_attention.capture.adapters.images import image_token_id

    architecture = next(a for a in architectures("image-text-to-text") if a.model_type == model_type)
    case = make_case(build(architecture), architecture)
    first_layer = next(module for name, module in case.model.named_modules() if name.endswith("layers.0"))
    args, kwargs = _inputs_given(case, first_layer)
    merged = args[0] if args else kwargs["hidden_states"]
    mask = torch.ones_like(case.inputs)
    scores = AttnLRP(case.model).attribute(case.inputs, target=case.target, additional_forward_args=(mask, case.images))
    expected = AttnLRP(case.model).attribute(merged, target=case.target, additional_forward_args=(mask,))
    image = case.inputs == image_token_id(case.model.config)
    assert bool(image.any()) and bool((expected[image] != 0).all())
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_image_features_written_over_the_embeddings_hold_their_relevance(capture_mode):
    """Kosmos-2 writes its image's features over its image tokens' embeddings in place
    (``inputs_embeds[mask] = image_embeds``): the image's tokens scored 0. Each token now
    holds its embedding's relevance, or the feature's written over it: the embeddings with
    the features written in, times the embedding scale and the gradient of the first
    layer's input (the positions added there hold none), read by a hook."""
    architecture = next(a for a in architectures("image-text-to-text") if a.model_type == "kosmos-2")
    case = make_case(build(architecture), architecture)
    text = case.model.text_model.model
    given = _inputs_given(case, text)[1]
    scores, (first,) = _relevance_and_input_gradients(case, [text.layers[0]])
    image = given["image_embeds_position_mask"].bool()
    with torch.no_grad():
        merged = text.embed_tokens(case.inputs)
        merged[image] = given["image_embeds"].reshape(-1, merged.shape[-1])
    expected = (merged * text.embed_scale * first).sum(dim=-1)
    assert bool((expected[image] != 0).all())
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_image_features_added_deeper_hold_their_relevance(capture_mode):
    """Qwen3-VL adds its vision tower's intermediate features to the image's tokens after
    its first layers (deepstack): their relevance, which flowed into the tower, was lost,
    and the image's tokens held only their embeddings'. Each token now holds its merged
    embedding's relevance and the added features', each the feature times the gradient of
    the hidden states it was added to (read by hooks on the layers' inputs)."""
    import copy

    architecture = next(a for a in architectures("image-text-to-text") if a.model_type == "qwen3_vl")
    config = copy.deepcopy(build(architecture).config)
    config.vision_config.deepstack_visual_indexes = [0, 1]  # both of the tiny tower's layers, added after the text's first two
    config.text_config.num_hidden_layers = 3
    torch.manual_seed(0)
    case = make_case(build(architecture).__class__(config).eval(), architecture)
    language_model = case.model.model.language_model
    given = _inputs_given(case, language_model)[1]
    scores, grads = _relevance_and_input_gradients(case, [*language_model.layers, language_model.norm])
    image = given["visual_pos_masks"]
    expected = (given["inputs_embeds"] * grads[0]).sum(dim=-1)
    added = [(features * grads[k + 1][image]).sum(dim=-1) for k, features in enumerate(given["deepstack_visual_embeds"])]
    assert len(added) == 2 and all(bool((share != 0).all()) for share in added)
    expected[image] += sum(added)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_florence2s_image_tokens_hold_the_relevance_of_the_image_features_its_encoder_reads(capture_mode):
    """Florence-2's encoder reads its tokens' embeddings with the image's features in place
    of its image tokens. The relevance stops there, as a decoder's merged embeddings hold
    it (the image tokens scored 0: relevance was read at the tokens' own embeddings, which
    the features replace): the source's scores, the image's tokens among them, and the
    target's equal BART's reference run from those merged embeddings."""
    from test_encoder_decoder import _tiny_florence2

    model = _tiny_florence2()
    images = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        features = model.model.get_image_features(**images).pooler_output
        count = features.shape[1]
        source = torch.tensor([[1, *[model.config.image_token_id] * count, 5, 6, 7]])
        embedded = model.get_input_embeddings()(source)
        merged = embedded.masked_scatter((source == model.config.image_token_id)[..., None].expand_as(embedded), features)
    decoder = torch.tensor([[1, 9, 10]])
    masks = (torch.ones_like(source), torch.ones_like(decoder))
    expected = bart_relevance(model, source, decoder, *masks, torch.tensor([5]), source_embeddings=merged)
    actual = AttnLRP(model).attribute((source, decoder), target=5, additional_forward_args=(*masks, images))
    assert expected.source[0, 1 : 1 + count].abs().min() > 0
    for got, want in zip(actual, (expected.source, expected.target)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("gamma", [0.0, 0.25])
@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "qwen2", "t5", "bart", "vit", "deit"])
def test_every_family_equals_its_reference(family, gamma, capture_mode):
    """AttnLRP against ``lrp_reference``'s forward of each family written from the rules
    (GPT-2's ``Conv1D`` and tanh GELU, DistilBERT's ReLU head, Qwen2's biased projections,
    T5's position biases and RMS norms, BART's post-norm layers and cross-attention, ViT's and
    DeiT's patch embeddings and special tokens), with the ε-rule and with the γ-rule."""
    model, inputs, args, expected, parts = _reference(family, gamma)
    target = 5 if family == "bart" else TARGET
    actual = parts(AttnLRP(model, gamma=gamma).attribute(inputs, target=target, additional_forward_args=args))
    for got, want in zip(actual, expected):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_and_eager_rules_give_the_same_relevance(family):
    model, inputs, args, _ = _case(family)
    target = 5 if family == "bart" else TARGET
    streamed = AttnLRP(model, capture="streaming").attribute(inputs, target=target, additional_forward_args=args)
    eager = AttnLRP(model, capture="eager").attribute(inputs, target=target, additional_forward_args=args)
    for actual, expected in zip(*(x if isinstance(x, tuple) else (x,) for x in (streamed, eager))):
        assert torch.isfinite(actual).all() and actual.abs().sum() > 0
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("family", ("bert", "gpt2", "llama", "t5", "vit"))
def test_each_example_alone_gets_its_batched_relevance_and_the_model_is_left_as_found(family, capture_mode):
    model, inputs, args, real = _case(family)
    before, original = model_state(model), attention_function("sdpa")
    batched = AttnLRP(model).attribute(inputs, target=TARGET, additional_forward_args=args)
    assert_same_state(before, model_state(model))
    assert attention_function("sdpa") is original
    assert all(p.grad is None for p in model.parameters())
    pairs = isinstance(inputs, tuple)
    for b in range(2):
        one = (tuple(x[b : b + 1] for x in inputs) if pairs else inputs[b : b + 1])
        one_args = None if args is None else tuple(a[b : b + 1] for a in args)
        alone = AttnLRP(model).attribute(one, target=TARGET, additional_forward_args=one_args)
        for part_alone, part_batched in zip(*(x if pairs else (x,) for x in (alone, batched))):
            n, scale = part_alone.shape[1], part_batched.abs().max().item()
            expected = part_batched[b, -n:] if family in ("gpt2", "llama") else part_batched[b, :n]
            # T5 (no attention scaling) rounds the same sums differently in a batch: 2e-5 of the scale on some CPUs
            torch.testing.assert_close(part_alone[0], expected, rtol=1e-4, atol=5e-5 * scale)
    if not pairs and batched.dim() == 2:
        assert (batched[~real] == 0).all(), "padding scores 0"


def test_frozen_parameters_change_nothing():
    model, ids, args, _ = _case("bert")
    expected = AttnLRP(model).attribute(ids, target=TARGET, additional_forward_args=args)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    torch.testing.assert_close(AttnLRP(model).attribute(ids, target=TARGET, additional_forward_args=args), expected)
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["causal LM/falcon", "image classification/swinv2", "causal LM/jamba", "causal LM/qwen3_next"])
def test_weights_multiplied_by_hand_are_weights_to_the_rules(name, capture_mode):
    """Falcon's linear layers compute ``x @ weight.T``, SwinV2 scales its attention by
    ``exp(logit_scale)``, the state-space and gated layers of Jamba and Qwen3-Next by
    ``exp(A_log)`` and the like: a tensor computed from the weights alone was taken for an
    activation, and its product with one got the rule of two activations (half the
    relevance to the weights), where frozen weights gave the linear rule (Falcon's
    relevance moved by more than its own scale). A weight-only factor is a constant."""
    head, model_type = name.split("/")
    architecture = next(a for a in architectures(head) if a.model_type == model_type)
    case = make_case(build(architecture), architecture)
    expected = explain(case, "attn_lrp")
    for parameter in case.model.parameters():
        parameter.requires_grad_(False)
    for actual, frozen in zip(_tuple(explain(case, "attn_lrp")), _tuple(expected)):
        torch.testing.assert_close(actual, frozen, rtol=1e-5, atol=1e-5 * float(frozen.abs().max()))


def test_a_block_named_like_a_norm_takes_the_rules_inside_it(capture_mode):
    """DBRX's ``DbrxNormAttentionNorm`` holds its attention between two layer norms: taken
    for a norm by its name, its products got no rule, and the eager capture's relevance
    reached three times the rules' (the streaming kernel's own rule hid it there). Against
    the rules written out from the weights."""
    architecture = next(a for a in architectures("causal LM") if a.model_type == "dbrx")
    case = make_case(build(architecture), architecture)
    expected = dbrx_relevance(case.model, case.inputs, torch.full((len(case.inputs),), case.target)).relevance
    assert expected.abs().max() > 0
    actual = AttnLRP(case.model).attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def _tuple(scores):
    return scores if isinstance(scores, tuple) else (scores,)


def test_continuation_rows_equal_the_prefixes_explained_alone():
    model, prompts = make_decoder("llama"), make_prompts(side="left")
    continuation = torch.tensor([[5, 9], [7, 3], [11, 4]])
    rows = AttnLRP(model).attribute_continuation(prompts.input_ids, continuation, (prompts.attention_mask,))
    for step in range(2):
        ids = torch.cat([prompts.input_ids, continuation[:, :step]], dim=1)
        mask = torch.cat([prompts.attention_mask, torch.ones_like(continuation[:, :step])], dim=1)
        alone = AttnLRP(model).attribute(ids, target=continuation[:, step], additional_forward_args=(mask,))
        torch.testing.assert_close(rows[:, step, : ids.shape[1]], alone, rtol=1e-5, atol=1e-6)


def test_given_embeddings_and_noise_tunnel():
    model, ids, args, _ = _case("bert")
    embeddings = model.get_input_embeddings()(ids).detach()
    from_ids = AttnLRP(model).attribute(ids, target=TARGET, additional_forward_args=args)
    from_embeddings = AttnLRP(model).attribute(embeddings, target=TARGET, additional_forward_args=args)
    torch.testing.assert_close(from_embeddings, from_ids, rtol=1e-5, atol=1e-6)
    tunnel = NoiseTunnel(AttnLRP(model)).attribute(
        embeddings, nt_type="smoothgrad", nt_samples=3, stdevs=0.0, target=TARGET, additional_forward_args=args
    )
    torch.testing.assert_close(tunnel, from_ids, rtol=1e-5, atol=1e-6)


def test_registered_and_clear_errors():
    assert METHODS["attn_lrp"] is AttnLRP
    model, ids, args, _ = _case("bert")
    with pytest.raises(ValueError, match="no maps"):
        AttnLRP(model).attribute(ids, additional_forward_args=args, return_maps=True)


def test_each_rule_on_its_own():
    """Uniform: the halves of a product's relevance sum to it; identity: R_x = R_y;
    norms: the gradient with the scale held constant; all forwards unchanged."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 4, generator=generator, requires_grad=True) for _ in range(2))
    upstream = torch.randn(3, 4, generator=generator)
    product = share_gradient(a, 0.5) * share_gradient(b, 0.5)
    grad_a, grad_b = torch.autograd.grad(product, (a, b), upstream)
    torch.testing.assert_close((a * grad_a + b * grad_b).detach(), (a * b * upstream).detach())
    y = torch.nn.functional.gelu(a).detach()
    (grad_x,) = torch.autograd.grad(identity_rule(a, y), a, upstream)
    torch.testing.assert_close(a.detach() * grad_x, y * upstream)
    weight = torch.randn(4, generator=generator)
    out = layer_norm_rule(a, (4,), weight, None, 1e-5)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(a, (4,), weight, None, 1e-5))
    (grad_x,) = torch.autograd.grad(out, a, upstream)
    scale = torch.rsqrt(a.detach().var(dim=-1, unbiased=False, keepdim=True) + 1e-5)
    expected = torch.autograd.functional.vjp(lambda x: (x - x.mean(-1, keepdim=True)) * scale * weight, a.detach(), upstream)[1]
    torch.testing.assert_close(grad_x, expected)
    out = rms_norm_rule(a, (4,), weight, 1e-6)
    (grad_x,) = torch.autograd.grad(out, a, upstream)
    scale = torch.rsqrt(a.detach().pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(grad_x, upstream * weight * scale)


def test_each_rule_with_its_switch_off_passes_the_ordinary_gradient():
    """A rule given a RuleSwitch: on, the rule's backward, as without a switch; off, on the
    same forward's graph, the ordinary gradient of the operation it stands for."""
    F = torch.nn.functional
    generator = torch.Generator().manual_seed(1)
    x, other = (torch.randn(3, 4, generator=generator, requires_grad=True) for _ in range(2))
    weight, bias, upstream = (torch.randn(*shape, generator=generator) for shape in ((4,), (4,), (3, 4)))
    linear_weight = torch.randn(4, 4, generator=generator)

    def rms(x):
        return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

    cases = {  # (the rule, given a switch or None; the operation)
        "uniform": (lambda s: share_gradient(x, 0.5, s) * share_gradient(other, 0.5, s), lambda: x * other),
        "identity": (lambda s: identity_rule(x, F.gelu(x), s), lambda: F.gelu(x)),
        "held constant": (lambda s: x * held_constant(rms(x), s), lambda: x * rms(x)),
        "layer norm": (lambda s: layer_norm_rule(x, (4,), weight, bias, 1e-5, s), lambda: F.layer_norm(x, (4,), weight, bias, 1e-5)),
        "rms norm": (lambda s: rms_norm_rule(x, (4,), weight, 1e-6, s), lambda: F.rms_norm(x, (4,), weight, 1e-6)),
        "gamma": (lambda s: linear_rule(x, linear_weight, bias, 0.25, switch=s), lambda: F.linear(x, linear_weight, bias)),
    }
    for name, (ruled, operation) in cases.items():
        switch = RuleSwitch()
        output = ruled(switch)
        torch.testing.assert_close(output, operation(), msg=name)
        (relevance_grad,) = torch.autograd.grad(output, x, upstream, retain_graph=True)
        torch.testing.assert_close(relevance_grad, torch.autograd.grad(ruled(None), x, upstream)[0], msg=name)
        switch.rules = False
        (ordinary,) = torch.autograd.grad(operation(), x, upstream)
        torch.testing.assert_close(torch.autograd.grad(output, x, upstream)[0], ordinary, msg=name)
        assert not torch.allclose(relevance_grad, ordinary), name


def test_another_thread_gets_the_ordinary_gradient_of_the_same_model_during_a_call():
    import threading

    model, ids, args, _ = _case("bert")

    def ordinary_gradient():
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings, attention_mask=args[0]).logits
        return torch.autograd.grad(logits[:, TARGET].sum(), embeddings)[0]

    expected = ordinary_gradient()
    started, release, seen = threading.Event(), threading.Event(), []
    layer = model.bert.encoder.layer[1]

    def pause(module, inputs):
        if threading.current_thread() is threading.main_thread():
            started.set()
            release.wait(timeout=30)

    def run_other():
        started.wait(timeout=30)
        seen.append(ordinary_gradient())
        release.set()

    handle = layer.register_forward_pre_hook(pause)
    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        relevance = AttnLRP(model).attribute(ids, target=TARGET, additional_forward_args=args)
    finally:
        handle.remove()
        release.set()
        thread.join()
    torch.testing.assert_close(seen[0], expected)
    torch.testing.assert_close(relevance, AttnLRP(model).attribute(ids, target=TARGET, additional_forward_args=args))


def _gamma_relevance_by_loops(x, weight, bias, relevance, gamma):
    """The generalised γ-rule written out per input, output and sign (float64): output j of
    sign s shares R_j over the contributions x_i·w'_ij, w' = w + γ·(w's part of sign s·sign(x_i)),
    plus the bias's, in proportion."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        y = weight @ x[b] + bias
        for j in range(weight.shape[0]):
            if y[j] == 0:
                continue
            sign = 1.0 if y[j] > 0 else -1.0
            favoured = [w + gamma * (max(w, 0.0) if sign * xi >= 0 else min(w, 0.0)) for w, xi in zip(weight[j].tolist(), x[b].tolist())]
            contributions = [xi * w for xi, w in zip(x[b].tolist(), favoured)]
            bias_part = float(bias[j]) + gamma * (max(float(bias[j]), 0.0) if sign > 0 else min(float(bias[j]), 0.0))
            z = sum(contributions) + bias_part
            for i, c in enumerate(contributions):
                out[b, i] += c / z * relevance[b, j]
    return out


@pytest.mark.parametrize("gamma", [0.25, 1.0])
def test_the_gamma_rule_equals_its_definition_and_conserves_without_bias(gamma):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 6, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    bias = torch.randn(4, generator=generator, dtype=torch.float64)
    upstream = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    inputs = x.clone().requires_grad_()
    output = linear_rule(inputs, weight, bias, gamma)
    torch.testing.assert_close(output, torch.nn.functional.linear(x, weight, bias))
    (grad,) = torch.autograd.grad(output, inputs, upstream)
    relevance = output.detach() * upstream
    expected = _gamma_relevance_by_loops(x, weight, bias, relevance, gamma)
    torch.testing.assert_close(x * grad, expected, rtol=1e-5, atol=1e-8)  # the rule adds 1e-6 to |z|
    (grad,) = torch.autograd.grad(linear_rule(inputs, weight, None, gamma), inputs, upstream)
    conserved = (torch.nn.functional.linear(x, weight) * upstream).sum(dim=1)
    torch.testing.assert_close((x * grad).sum(dim=1), conserved, rtol=1e-5, atol=0.0)  # up to the 1e-6 stabiliser


@pytest.mark.parametrize("family", ("vit", "gpt2", "bert"))
def test_gamma_changes_the_relevance_and_leaves_the_model_as_found(family):
    model, inputs, args, _ = _case(family)
    before = model_state(model)
    epsilon = AttnLRP(model).attribute(inputs, target=TARGET, additional_forward_args=args)
    gamma = AttnLRP(model, gamma=0.25).attribute(inputs, target=TARGET, additional_forward_args=args)
    assert torch.isfinite(gamma).all() and (gamma - epsilon).abs().max() > 1e-3 * epsilon.abs().max()
    assert_same_state(before, model_state(model))
    with pytest.raises(ValueError, match="gamma"):
        AttnLRP(model, gamma=-1.0)


def _without_gamma_on_conv1d(monkeypatch):
    """GPT-2's ``Conv1D`` (``torch.addmm``) left to the ordinary gradient under γ."""
    from captum_attention.capture import lrp

    original = lrp._RuleMode.__torch_function__

    def mutated(self, func, types, args=(), kwargs=None):
        if func is torch.addmm:
            return func(*args, **(kwargs or {}))
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(lrp._RuleMode, "__torch_function__", mutated)


def _without_identity_on_gelu(monkeypatch):
    """GPT-2's GELU module no longer an activation site (its ordinary gradient instead of
    the identity rule)."""
    from transformers.activations import NewGELUActivation

    from captum_attention.capture.adapters.huggingface import HuggingFaceAdapter
    from captum_attention.capture.adapters.protocol import RelevanceSites

    original = HuggingFaceAdapter.relevance_sites

    def mutated(self, model):
        sites = original(self, model)
        return RelevanceSites([m for m in sites.activations if not isinstance(m, NewGELUActivation)], sites.norms)

    monkeypatch.setattr(HuggingFaceAdapter, "relevance_sites", mutated)


@pytest.mark.parametrize("mutation, gamma", [(_without_gamma_on_conv1d, 0.25), (_without_identity_on_gelu, 0.0)])
def test_the_gpt2_reference_catches_a_rule_left_out(monkeypatch, mutation, gamma):
    """Mutation test: with one of AttnLRP's rules dropped on GPT-2, its relevance leaves the
    reference's tolerance by far (so ``test_every_family_equals_its_reference`` fails)."""
    model, inputs, args, (expected,), _ = _reference("gpt2", gamma)
    mutation(monkeypatch)
    mutated = AttnLRP(model, gamma=gamma).attribute(inputs, target=TARGET, additional_forward_args=args)
    scale = expected.abs().max().item()
    assert (mutated - expected).abs().max().item() > 100 * 1e-5 * scale
