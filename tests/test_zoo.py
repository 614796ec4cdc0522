"""Every architecture of transformers' five task heads: exact, or refused in one line
(``zoo.py`` builds and checks them). The full sweep is marked ``zoo`` (``pytest -m zoo``;
its multimodal configs take minutes to build); by default the popular families and the
regressions below run."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import assert_same_state, model_state
from zoo import (
    CHECKED_BY_THEMSELVES, EAGER_ONLY, HEADS, IMAGE_SIZE, POSITION_HEADS, Architecture, _close, architectures, build, decomposition_outcome, explain,
    left_padding_outcome, make_case, outcomes, reference, removal_outcome, report_outcome, runs, shares_outcome,
    two_stack_report_outcome,
    ablation_outcome, image_relevance_outcome, vision_language_left_padding_outcome,
)

from captum_attention import METHODS, AttnLRP, GradSAM, KnockoutLRP, RawAttention, UnsupportedModelError
from captum_attention.capture.adapters.huggingface import returned_attention

POPULAR = {
    "sequence classification": (
        "bert", "llama", "gpt2", "bart", "mbart", "plbart", "t5", "bloom", "falcon", "mpt", "gpt_neo",
        "deberta", "deberta-v2", "gemma2", "mixtral", "gptj", "t5gemma",
    ),
    "causal LM": ("bigbird_pegasus", "qwen2", "xlm", "ctrl", "got_ocr2", "deepseek_v2", "gpt_oss"),
    "image classification": ("vit", "clip", "siglip", "data2vec-vision", "swin", "swinv2", "donut-swin", "segformer", "pvt_v2"),
    "seq2seq LM": ("t5", "bart", "marian", "m2m_100", "pegasus"),
    "image-text-to-text": (
        "llava", "llava_next", "idefics3", "mistral3", "qwen2_vl", "qwen3_vl", "paligemma", "gemma3", "mllama", "blip-2", "fuyu", "kosmos-2",
    ),
}
"""The families every user meets, and the ones that once failed or were wrong."""


def _architecture(head: str, model_type: str) -> Architecture:
    return next(a for a in architectures(head) if a.model_type == model_type)


def _assert_exact_or_refused(architecture: Architecture) -> None:
    found = outcomes(architecture, list(METHODS))
    bad = {m: o for m, o in found.items() if o.status in ("error", "wrong")}
    assert not bad, f"{architecture.name}: {bad}"


@pytest.mark.parametrize("head, model_type", [(head, t) for head, types in POPULAR.items() for t in types])
def test_popular_family_is_exact(head, model_type):
    found = outcomes(_architecture(head, model_type), list(METHODS))
    assert {o.status for o in found.values()} == {"exact"}, found


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in HEADS for a in architectures(head)], ids=lambda a: a.name)
def test_every_architecture_is_exact_or_refused_in_one_line(architecture):
    _assert_exact_or_refused(architecture)


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in POSITION_HEADS for a in architectures(head)], ids=lambda a: a.name)
def test_a_logit_read_at_a_token_is_exact_or_refused_in_one_line(architecture):
    """A question answerer's start logit, a token classifier's label and a masked language
    model's token, each at one token, as ``explain`` and ``evaluate`` read them."""
    _assert_exact_or_refused(architecture)


@pytest.mark.parametrize("head, model_type", [("question answering", "bert"), ("question answering", "roberta"),
                                              ("token classification", "bert"), ("token classification", "distilbert"),
                                              ("token classification", "t5"), ("token classification", "umt5"),
                                              ("masked LM", "bert"),
                                              ("masked LM", "roberta")])
def test_a_popular_answerers_and_taggers_logit_at_a_token_is_exact(head, model_type):
    found = outcomes(_architecture(head, model_type), list(METHODS))
    assert {o.status for o in found.values()} == {"exact"}, found


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in POSITION_HEADS for a in architectures(head)], ids=lambda a: a.name)
def test_the_report_of_a_logit_read_at_a_token_runs_or_is_refused_in_one_line(architecture):
    """``explain``'s report of an answer, a tagger's labels or a masked model's tokens, with
    a tokenizer that names no padding token, on a short text and one read in windows."""
    outcome = report_outcome(architecture)
    assert outcome.status in ("runs", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.parametrize("head, model_type", [("question answering", "bert"), ("question answering", "gpt2"),
                                              ("token classification", "ibert"), ("token classification", "mpt"),
                                              ("token classification", "umt5"), ("masked LM", "modernbert")])
def test_a_popular_or_once_failing_report_of_a_logit_at_a_token_runs(head, model_type):
    """GPT-2's answerer failed to pad its windows, I-BERT's and MPT's taggers ran past
    their positions, UMT5's tagger was taken for an encoder-decoder."""
    outcome = report_outcome(_architecture(head, model_type))
    assert outcome.status == "runs", outcome


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("sequence classification"), ids=lambda a: a.name)
def test_the_report_of_a_classifier_that_reads_its_text_twice_is_each_text_alone_or_refused(architecture):
    """``explain``'s methods on an encoder-decoder's classifier (its decoder reads the text
    again, shifted): a text padded in a batch scores as alone."""
    outcome = two_stack_report_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.parametrize("model_type", ["bart", "mbart"])
def test_the_report_of_bart_and_mbart_classifiers_is_each_text_alone(model_type):
    """BART's decoder reads the text after its start token, mBART's after the text's last
    token moved to the front: both read from the model's own call."""
    outcome = two_stack_report_outcome(_architecture("sequence classification", model_type))
    assert outcome.status == "exact", outcome


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in HEADS for a in architectures(head)], ids=lambda a: a.name)
def test_the_knockout_methods_are_exact_or_refused_in_one_line(architecture):
    """KnockoutGradient against Σ A(G − ΣAG) from the eager twin; KnockoutLRP against that
    with AttnLRP's relevance at its top token."""
    found = outcomes(architecture, ["knockout_gradient", "knockout_lrp"])
    bad = {m: o for m, o in found.items() if o.status in ("error", "wrong")}
    assert not bad, f"{architecture.name}: {bad}"


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in HEADS for a in architectures(head)], ids=lambda a: a.name)
def test_the_context_mixing_methods_are_exact_or_refused_in_one_line(architecture):
    """LearnedAttention against the twin's maps; the decomposing methods finite and the
    same in both capture modes where their own checks let them run."""
    found = outcomes(architecture, ["learned_attention", *CHECKED_BY_THEMSELVES])
    bad = {m: o for m, o in found.items() if o.status in ("error", "wrong")}
    assert not bad, f"{architecture.name}: {bad}"


@pytest.mark.parametrize("head, model_type", [("causal LM", "hy_v4"), ("causal LM", "laguna"), ("sequence classification", "convbert")])
def test_the_context_mixing_methods_refuse_gates_and_mixed_heads_and_compare_hyper_connections(head, model_type):
    """HY-V4 and Laguna gate the attention output before its projection (NormAttention
    refuses), HY-V4 keeps several streams per token (Value Zeroing compares them as one
    vector), ConvBERT's projection takes convolution heads beside the attention's."""
    found = outcomes(_architecture(head, model_type), ["learned_attention", *CHECKED_BY_THEMSELVES])
    assert found["norm_attention"].status in ("refused", "not built"), found
    assert not {m: o for m, o in found.items() if o.status in ("error", "wrong")}, found


def test_alti_refuses_a_layer_of_several_streams_per_token_in_one_line():
    """Gemma-3n's layers carry four streams per token (AltUp): ALTI and ALTI-Logit compared
    them with the tokens' mask and failed with an IndexError."""
    found = outcomes(_architecture("causal LM", "gemma3n_text"), ["alti", "alti_logit"])
    assert {o.status for o in found.values()} == {"refused"}, found
    assert all("several streams per token" in o.detail for o in found.values()), found


def test_integrated_gradients_of_an_answer_about_an_image_copy_the_embeddings_they_move():
    """Kosmos-2 writes its image's features into the input embeddings in place, which
    Captum's moved embeddings (a leaf that requires grad) would not allow: they are copied
    first, and the image's positions (its mask's) score 0. Idefics extends its image mask
    over generated tokens from its forward's outputs, which one forward of prompt and
    answer has none of: refused in one line."""
    from captum_attention.metrics.context import kept_image_tokens
    from captum_attention.presentation.explain import answer_integrated_gradients

    answer = torch.tensor([[8, 9]])
    kosmos, idefics = _architecture("image-text-to-text", "kosmos-2"), _architecture("image-text-to-text", "idefics")
    case = make_case(build(kosmos), kosmos)
    scores = answer_integrated_gradients(case.model, case.inputs[:1], answer, 4, case.images)
    held = kept_image_tokens(case.model, case.inputs[:1], None, case.images)
    assert bool(held.any()) and bool((scores[held] == 0).all()) and float(scores[~held].abs().max()) > 0
    case = make_case(build(idefics), idefics)
    with pytest.raises(UnsupportedModelError, match="extends its inputs over generated tokens from its forward's outputs"):
        answer_integrated_gradients(case.model, case.inputs[:1], answer, 4, case.images)


def test_the_residual_decompositions_refuse_layers_that_carry_several_streams_per_token():
    """GLM-5-Next's layers take and return ``(B, N, S, D)`` hidden states (hyper-connections
    as a dimension of their own): NormAttention with the residual refuses in one line, as
    the decompositions of one residual vector per token must, and the methods that read
    the attention alone are exact."""
    found = outcomes(_architecture("image-text-to-text", "glm5_next"), ["norm_attention", "norm_attention(residual=True)", "attn_lrp"])
    assert {found[m].status for m in ("norm_attention", "attn_lrp")} == {"exact"}, found
    residual = found["norm_attention(residual=True)"]
    assert residual.status == "refused" and "several streams per token" in residual.detail, found


@pytest.mark.parametrize("head, model_type", [("causal LM", "qwen3_next"), ("sequence classification", "jamba")])
def test_a_hybrid_with_linear_attention_is_built_with_an_attention_layer(head, model_type):
    """Qwen3-Next's and Jamba's first tiny layers would hold no attention (the model then
    fails): the sweep builds one of linear attention, then one of attention, where the
    methods that read the attention are exact and those that roll the layers out refuse."""
    found = outcomes(_architecture(head, model_type), list(METHODS))
    assert {found[m].status for m in ("grad_sam", "raw", "attn_lrp")} == {"exact"}, found
    assert found["rollout"].status == "refused" and "mixes tokens outside them" in found["rollout"].detail, found


def test_knockout_lrp_takes_attn_lrps_relevance_where_a_norm_module_returns_its_scale_alone():
    """HY-V4's hyper-connections multiply by the scale their norm module returns: a constant
    under AttnLRP's rules, also under the switch with which KnockoutLRP turns them off for
    its second backward (it once halved the relevance through that product)."""
    architecture = _architecture("causal LM", "hy_v4")
    case = runs(make_case(build(architecture), architecture))
    every_token = KnockoutLRP(case.model, decisive=case.inputs.shape[1])
    relevance = AttnLRP(case.model).attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    taken = every_token.attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    torch.testing.assert_close(taken, relevance, rtol=0, atol=1e-6 * float(relevance.abs().max()))


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("causal LM") + architectures("image-text-to-text"), ids=lambda a: a.name)
def test_attention_shares_are_exact_or_refused_in_one_line(architecture):
    outcome = shares_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.parametrize("model_type", ["llava", "paligemma", "qwen2_vl"])
def test_attention_shares_of_a_prompt_about_an_image_are_the_eager_maps(model_type):
    """PaliGemma's answer is its causal suffix (token type 1), as its ``generate`` types it."""
    outcome = shares_outcome(_architecture("image-text-to-text", model_type))
    assert outcome.status == "exact", outcome



@pytest.mark.parametrize("model_type, status", [("qwen2", "exact"), ("gpt2", "exact"), ("roberta", "exact"), ("xlm", "refused")])
def test_a_left_padded_batch_is_each_prompt_alone_or_refused(model_type, status):
    """Position ids over the real tokens (Qwen2's rotary positions, GPT-2's absolute
    ones); none for RoBERTa, which counts them from the ids past the padding; XLM reads
    its learned positions from the first column either way."""
    outcome = left_padding_outcome(_architecture("causal LM", model_type))
    assert outcome.status == status, outcome


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("causal LM"), ids=lambda a: a.name)
def test_a_left_padded_batch_is_each_prompt_alone_or_refused_on_every_causal_lm(architecture):
    outcome = left_padding_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("image-text-to-text"), ids=lambda a: a.name)
def test_a_left_padded_batch_of_images_and_prompts_is_each_example_alone_or_refused(architecture):
    outcome = vision_language_left_padding_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.parametrize("head, model_type", [
    ("image-text-to-text", "llava"), ("image-text-to-text", "qwen2_vl"), ("image-text-to-text", "mllama"),
    ("image-text-to-text", "hunyuan_vl"), ("image-text-to-text", "ovis2_5"), ("image-text-to-text", "minicpmv4_6"),
    ("image-text-to-text", "kosmos-2"), ("image-text-to-text", "molmo2"),
    ("causal LM", "qwen2"), ("causal LM", "xlm"), ("causal LM", "dory"), ("seq2seq LM", "t5"), ("seq2seq LM", "bart"),
])
def test_the_ablations_of_a_prompt_are_each_ablated_prompt_alone(head, model_type):
    """HunYuan-VL scores the second of two copies of a prompt otherwise than the first, and
    MiniCPM-V fails on them (it packs a batch's images into one row), as Molmo2 does (it
    asks for the crops of several images): their ablations run one at a time; Ovis2.5 fails without its image's start and end tokens, which are never
    removed. XLM reads the left padding, and Dory's sliding-window attention fails on it:
    their ablations run in batches of one length, unpadded."""
    outcome = ablation_outcome(_architecture(head, model_type))
    assert outcome.status == "exact", outcome


@pytest.mark.zoo
@pytest.mark.parametrize(
    "architecture", [a for head in ("causal LM", "seq2seq LM", "image-text-to-text") for a in architectures(head)], ids=lambda a: a.name
)
def test_the_ablations_of_a_prompt_are_each_alone_or_refused_on_every_language_model(architecture):
    outcome = ablation_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("image-text-to-text"), ids=lambda a: a.name)
def test_attn_lrps_image_tokens_hold_relevance_wherever_the_image_moves_the_logits(architecture):
    """Streaming against eager cannot show relevance read where the image's features do not
    reach (both read it there): Chameleon's, Emu3's, Fuyu's, Kosmos-2's, Kosmos-2.5's and
    Granite 4 Vision's image tokens scored 0, Florence-2's too."""
    outcome = image_relevance_outcome(architecture)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


def test_a_model_whose_streamed_gradient_is_not_finite_on_a_left_padded_batch_is_explained_eager():
    """Gemma-3n's own backward under sdpa attention is NaN over a left-padded example's
    whole row (its fully masked padded rows; the logits are finite): Grad-SAM returned NaN
    scores at its real tokens. capture='auto' runs such a call again eager, where each
    prompt scores as alone, in attribute, attribute_span and attribute_continuation alike;
    capture='streaming' refuses it in one line."""
    architecture = _architecture("causal LM", "gemma3n_text")
    assert left_padding_outcome(architecture).status == "exact"
    model = build(architecture)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    with pytest.raises(UnsupportedModelError, match=r"^The scores of examples \[0\] are not finite at their real tokens, while the explained logits are: .* or pass capture='auto' or 'eager'\.$"):
        GradSAM(model, capture="streaming").attribute(ids, additional_forward_args=(mask,))
    prompts, continuation = ids[:, :4], ids[:, 4:]
    auto, eager = GradSAM(model), GradSAM(model, capture="eager")
    for call in ("attribute_span", "attribute_continuation"):
        found = getattr(auto, call)(prompts, continuation, additional_forward_args=(mask[:, :4],))
        assert auto.last_capture.startswith("eager: the streamed scores were not finite at real tokens")
        assert found.isfinite().all()
        torch.testing.assert_close(found, getattr(eager, call)(prompts, continuation, additional_forward_args=(mask[:, :4],)))
    auto.attribute(ids[1:])
    assert auto.last_capture == "streaming"


def test_a_model_that_fails_on_a_left_padded_prompt_refuses_a_padded_batch_in_one_line():
    model = build(_architecture("causal LM", "dory"))
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    with pytest.raises(UnsupportedModelError, match=r"DoryForCausalLM fails on a left-padded prompt \(.*\)\. Pad its prompts on the right"):
        GradSAM(model).attribute(ids, additional_forward_args=((ids != 0).long(),))


@pytest.mark.parametrize("model_type", ["qwen2_vl", "video_llama_3"])
def test_decompx_repeats_one_examples_flattened_patches_for_its_copies(model_type):
    """Qwen2-VL's patches and image grid, VideoLLaMA 3's per-image merge sizes too: the
    shares add up to the explained logit (the call checks it, else refuses)."""
    outcome = decomposition_outcome(_architecture("image-text-to-text", model_type))
    assert outcome.status == "exact", outcome


def test_a_language_model_that_cross_attends_to_its_images_with_attention_no_output_declares_is_refused():
    """Idefics' gated cross-attention runs the class of its self-attention, declared for no
    output: the capture would read the self-attention alone (and AttnLRP's rules miss the
    cross-attention's softmax)."""
    found = outcomes(_architecture("image-text-to-text", "idefics"), list(METHODS))
    assert {o.status for o in found.values()} == {"refused"}, found
    assert all("reads the image through cross-attention layers (model.gated_cross_attn_layers.0.cross_attn)" in o.detail for o in found.values())


def test_decompx_refuses_a_model_that_fails_on_copies_of_its_image_inputs_in_one_line():
    outcome = decomposition_outcome(_architecture("image-text-to-text", "minicpmv4_6"))
    assert outcome.status == "refused", outcome
    assert "fails on copies of its image inputs" in outcome.detail


@pytest.mark.parametrize("head, model_type", [("causal LM", "gpt_neox"), ("sequence classification", "falcon")])
def test_an_output_projection_named_dense_is_read(head, model_type):
    found = outcomes(_architecture(head, model_type), ["norm_attention"])
    assert found["norm_attention"].status == "exact", found


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", [a for head in HEADS for a in architectures(head)], ids=lambda a: a.name)
@pytest.mark.parametrize("multiply_by_inputs", [True, False], ids=["shares", "sensitivity"])
def test_decompx_adds_up_or_is_refused_in_one_line(architecture, multiply_by_inputs):
    outcome = decomposition_outcome(architecture, multiply_by_inputs)
    assert outcome.status in ("exact", "refused", "not built"), f"{architecture.name}: {outcome}"


def test_encoder_decoder_classifier_gets_the_decoder_ids_it_was_given():
    architecture = _architecture("sequence classification", "bart")
    case = make_case(build(architecture), architecture)
    source, target = case.inputs
    seen = {}
    hook = case.model.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        explain(case, "raw")
    finally:
        hook.remove()
    assert torch.equal(seen["input_ids"], source) and torch.equal(seen["decoder_input_ids"], target)


def test_transformer_attribution_source_scores_of_order_1e_5_are_exact_in_both_modes():
    """This BART's source relevances are about 2e-5 next to a target score of 1: as R·1 - 1
    in float32 they came out up to 70% off (streaming) and 1% off (eager)."""
    architecture = _architecture("sequence classification", "bart")
    case = make_case(build(architecture), architecture)
    expected_source, _ = reference(case)("transformer_attribution")
    assert 0 < expected_source.abs().max() < 1e-4
    for capture in ("streaming", "eager"):
        source, _ = explain(case, "transformer_attribution", capture)
        assert (source - expected_source).abs().max() <= 1e-4 * expected_source.abs().max(), capture


def test_a_model_without_sdpa_is_explained_eager_with_the_reason():
    """Granite-SWA runs only eagerly, and its sinks scale the output (its maps sum to 1):
    not a softmax sink the recomputation models."""
    architecture = _architecture("causal LM", "granite_swa")
    case = make_case(build(architecture), architecture)
    explainer = GradSAM(case.model)
    explainer.attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    assert explainer.last_capture.startswith("eager: GraniteSWAForCausalLM cannot run sdpa attention")
    with pytest.raises(ValueError, match="capture='streaming' is not possible here"):
        GradSAM(case.model, capture="streaming").attribute(case.inputs, target=case.target, additional_forward_args=case.args)


@pytest.mark.parametrize("head, model_type", [
    ("sequence classification", "gemma2"), ("sequence classification", "t5gemma"), ("causal LM", "vaultgemma"),
    ("causal LM", "gpt_oss"), ("causal LM", "mimo_v2_flash"), ("causal LM", "hy_v4"), ("causal LM", "flint"),
])
def test_softcap_and_sink_families_stream(head, model_type):
    """The families transformers runs only eagerly for their logit softcap or sinks stream
    (their outcomes, streamed, are checked against the eager twin's maps by the sweep)."""
    architecture = _architecture(head, model_type)
    case = make_case(build(architecture), architecture)
    explainer = GradSAM(case.model)
    explainer.attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    assert explainer.last_capture == "streaming"


def test_a_decoder_whose_modules_say_not_causal_is_read_as_causal_from_its_probabilities():
    architecture = _architecture("causal LM", "bigbird_pegasus")
    case = make_case(build(architecture), architecture)
    assert not any(getattr(m, "is_causal", True) for m in case.model.modules() if type(m).__name__.endswith("Attention"))
    expected = reference(case)("raw")
    for capture in ("eager", "auto"):  # it has no sdpa: auto runs eager too
        scores = explain(case, "raw", capture)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_attention_found_through_output_attentions_leaves_the_model_as_found():
    architecture = _architecture("sequence classification", "bloom")
    model = build(architecture)
    assert not tf.BloomForSequenceClassification._can_record_outputs
    case = make_case(model, architecture)
    before = model_state(model)
    explainer = RawAttention(model)
    explainer.attribute(case.inputs, additional_forward_args=case.args)
    assert explainer.last_capture.startswith("eager: BloomAttention did not call transformers' sdpa")
    assert_same_state(before, model_state(model))
    out = model(*case.inputs) if isinstance(case.inputs, tuple) else model(case.inputs)
    assert out.attentions is None  # output_attentions is not left on


def test_maps_that_are_not_the_attention_the_model_runs_are_refused():
    """Falcon loaded with sdpa returns maps computed without the causal mask under
    output_attentions=True: explaining them would explain another model."""
    architecture = _architecture("sequence classification", "falcon")
    case = make_case(build(architecture), architecture)
    eager = make_case(build(architecture, implementation="eager"), architecture)
    if returned_attention(case.model).reason:
        with pytest.raises(UnsupportedModelError, match=EAGER_ONLY) as refused:
            GradSAM(case.model).attribute(case.inputs, target=1, additional_forward_args=case.args)
        assert "\n" not in str(refused.value)
    else:  # transformers 5.25 computes those maps with the mask: they are the attention it runs
        torch.testing.assert_close(explain(case, "raw"), explain(eager, "raw"), rtol=1e-4, atol=1e-6)
    scores = explain(eager, "raw")
    expected = reference(eager)("raw")
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_model_without_attention_maps_is_refused_in_one_line():
    architecture = _architecture("sequence classification", "xlnet")
    case = make_case(build(architecture), architecture)
    for name in METHODS:
        with pytest.raises(UnsupportedModelError) as refused:
            explain(case, name)
        assert "\n" not in str(refused.value) and "XLNet" in str(refused.value)


def test_attn_lrp_reads_patch_convolutions_and_tuple_embeddings_as_patch_tokens():
    """CLIP's classifier names no input embeddings (its patch convolution is found by
    name), SigLIP's are a convolution's (B, d, h, w) output, BEiT-like ones return a tuple:
    each is read as one relevance per patch, on the patch grid. (The values are checked
    against references written from the rules for ViT, DeiT, Swin, SegFormer and PVTv2:
    ``tests/test_attn_lrp.py``, ``tests/test_grids.py``.)"""
    for model_type in ("clip", "siglip", "data2vec-vision"):
        architecture = _architecture("image classification", model_type)
        model = build(architecture, implementation="eager" if model_type == "data2vec-vision" else None)
        case = make_case(model, architecture)
        scores = explain(case, "attn_lrp")
        rows, columns = scores.shape[-2:]
        assert rows * columns == (IMAGE_SIZE // 8) ** 2 and bool(scores.abs().sum() > 0), model_type


@pytest.mark.parametrize("model_type, reason", [
    ("prophetnet", "n-gram prediction streams"), ("minimax", "linear"), ("t5gemma2", "merged attention"),
])
def test_architectures_out_of_scope_are_refused_by_name(model_type, reason):
    head = "causal LM" if model_type == "prophetnet" else "sequence classification"
    found = outcomes(_architecture(head, model_type), list(METHODS))
    assert {o.status for o in found.values()} == {"refused"}, found
    assert all(reason in o.detail and "\n" not in o.detail for o in found.values())


def test_attention_run_under_no_grad_refuses_the_gradient_methods_only():
    found = outcomes(_architecture("causal LM", "hrm_text"), list(METHODS))
    assert found["grad_sam"].status == found["transformer_attribution"].status == "refused"
    assert "torch.no_grad" in found["grad_sam"].detail
    assert found["rollout"].status == found["raw"].status == "exact"


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_a_classifier_that_reads_the_mean_of_its_tokens_is_explained_at_that_mean(pooling):
    """ModernBERT reads ``classifier_pooling`` when it runs: the default row follows it."""
    architecture = _architecture("sequence classification", "modernbert")
    model = build(architecture)
    model.config.classifier_pooling = pooling
    case = runs(make_case(model, architecture))
    expected = reference(case)
    for method in ("rollout", "transformer_attribution", "raw"):
        assert _close(explain(case, method), expected(method)), (pooling, method)


def test_a_shortened_sequence_is_refused_in_one_line_naming_both_attentions():
    """CANINE attends over its characters, then over a downsampled sequence."""
    found = outcomes(_architecture("sequence classification", "canine"), ["grad_sam", "raw"])
    assert {o.status for o in found.values()} == {"refused"}
    assert all("attends over 2 positions, while CanineSelfAttention (call 0) attends over the 8 input tokens" in o.detail
               for o in found.values())


@pytest.mark.parametrize("model_type, status", [("gpt2", "exact"), ("bart", "exact"), ("xlnet", "exact")])
def test_deleting_tokens_from_a_padded_batch_is_exact_or_refused(model_type, status):
    """GPT-2 finds its last token by its pad id, BART's mask is no decoder input, XLNet
    reads its last position, which the right padding moves: its deletions run in batches
    of one length, unpadded."""
    outcome = removal_outcome(_architecture("sequence classification", model_type))
    assert outcome.status == status, outcome


@pytest.mark.zoo
@pytest.mark.parametrize("architecture", architectures("sequence classification"), ids=lambda a: a.name)
def test_deleting_tokens_is_exact_or_refused_in_one_line_on_every_classifier(architecture):
    outcome = removal_outcome(architecture)
    assert outcome.status not in ("error", "wrong"), f"{architecture.name}: {outcome}"
