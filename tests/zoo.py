"""Every architecture transformers registers for five task heads (sequence classification,
causal and sequence-to-sequence language models, image classification, image-text-to-text),
built tiny from its own config class, explained by every registered method and checked.

An architecture/method pair ends in one of:

- ``exact``: the scores equal a direct re-computation from an eager twin's
  ``output_attentions`` and ``torch.autograd.grad`` (``methods.py`` and
  ``seq2seq_reference.py``), within :data:`REL` of their scale; AttnLRP, which is no
  function of the maps, gives the same scores streaming and eager; KnockoutGradient
  equals Σ A(G − ΣAG) of the twin's maps, and KnockoutLRP that with AttnLRP's relevance
  at its top token (``test_the_knockout_methods_are_exact_or_refused_in_one_line``);
  LearnedAttention (uniform weights) equals the mean of the twin's maps' row over every
  layer and head, and the methods that decompose a layer (:data:`CHECKED_BY_THEMSELVES`),
  whose calls check their sums against the model's own tensors and refuse where they do
  not add up, give the same scores streaming and eager
  (``test_the_context_mixing_methods_are_exact_or_refused_in_one_line``); a causal LM's
  :func:`~captum_attention.metrics.attention_shares` equal the largest entries of the
  twin's maps (:func:`shares_outcome`);
- ``refused``: the library raised :class:`~captum_attention.UnsupportedModelError` with a
  one-line reason;
- ``not built``: transformers itself cannot build or run the tiny model here (a missing
  optional dependency, a config the tiny sizes break); the reason is kept;
- ``error`` / ``wrong``: any other exception, or scores off the reference: a defect.

``python tests/zoo.py [--heads ...] [--json out.json]`` runs the sweep (one process per
head runs them side by side); ``python tests/zoo.py --from-json a.json b.json --rst
docs/support.rst`` writes the support table; ``tests/test_zoo.py`` asserts the sweep.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import transformers as tf
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from methods import METHODS, _row, reference_decisive, reference_grad_sam, reference_knockout  # noqa: E402
from seq2seq_reference import SEQ2SEQ_REFERENCES, Seq2SeqReference, cross_attending_reference  # noqa: E402
from grid_reference import reduced_maps_and_grads, window_layers, window_maps_and_grads  # noqa: E402
from removal_reference import comprehensiveness_alone  # noqa: E402

from captum_attention import METHODS as REGISTERED  # noqa: E402
from captum_attention.attr import REGISTRY  # noqa: E402
from captum_attention import UnsupportedModelError  # noqa: E402
from captum_attention.capture.adapters.images import cross_attends_images, image_read_apart, leading_image_features  # noqa: E402

HEADS = {
    "sequence classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "causal LM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq LM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}
POSITION_HEADS = {
    "question answering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "token classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "masked LM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
}
"""The heads whose logits are read at a token (an answer's start, a word's label, a
mask's token): swept apart, at :data:`POSITION` (``explain`` and ``evaluate`` read them
so)."""
FLOAT64_POSITIONS = ("mobilebert",)
"""Families swept at a token in float64: MobileBERT's NoNorm layers leave the tiny random
model's token states at 1e4-1e5 (its classifier's pooler bounds them), where float32
rounding alone moves the gradients by 1%."""
POSITION = 3
"""The token whose logits a :data:`POSITION_HEADS` case explains."""
REL = 1e-4
"""Tolerance relative to the scores' scale: fp32 sdpa and eager forwards of random tiny
models differ by up to about 3e-5 of it; a wrong result is off by far more."""

SEQ_LEN, IMAGE_SIZE, VOCAB = 8, 32, 99
TEXT_TARGET, LM_TARGET = 1, 5

TINY: dict[str, Any] = dict(
    hidden_size=32, d_model=32, n_embd=32, embed_dim=32, dim=32, hidden_dim=32, d_embed=32, n_embed=32, out_hidden_size=32,
    num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, encoder_layers=2, decoder_layers=2,
    num_decoder_layers=2, num_attention_heads=4, n_head=4, n_heads=4, num_heads=4, encoder_attention_heads=4,
    decoder_attention_heads=4, num_key_value_heads=2, head_dim=8, d_kv=8, kv_channels=8,
    intermediate_size=36, ffn_dim=36, encoder_ffn_dim=36, decoder_ffn_dim=36, d_ff=36, n_inner=36, d_inner=36,
    vocab_size=VOCAB, max_position_embeddings=64, n_positions=64, max_seq_len=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, num_labels=3,
    image_size=IMAGE_SIZE, patch_size=8, projection_dim=32, projection_hidden_size=32, mm_tokens_per_image=4, window_size=2, depths=[1, 1], num_channels=3, entity_vocab_size=10, num_latents=8, d_latents=32,
    attention_types=[[["global", "local"], 1]], attn_layer_indices=[], layer_types=None,
    initializer_range=0.2, num_experts=4, num_local_experts=4, n_routed_experts=4, moe_intermediate_size=16,
    num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=16, q_lora_rank=16,
    kv_lora_rank=16, qk_rope_head_dim=4, rotary_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2, text_hidden_size=32,
    mamba_n_heads=4,
)
"""Constructor arguments of a tiny model, passed where a config class takes them (under
their own or their ``attribute_map`` name). Widths are multiples of 4: the experts'
grouped matrix products need rows of 16 bytes."""


@dataclass(frozen=True)
class Architecture:
    model_type: str
    class_name: str
    head: str

    @property
    def name(self) -> str:
        return f"{self.head}/{self.model_type}"


def architectures(head: str) -> list[Architecture]:
    """Every (model type, class) transformers registers for ``head``."""
    from transformers.models.auto import modeling_auto

    found = []
    for model_type, names in getattr(modeling_auto, {**HEADS, **POSITION_HEADS}[head]).items():
        found.append(Architecture(model_type, names[0] if isinstance(names, tuple) else names, head))
    return found


def _tiny_kwargs(config_class: type, head: str = "") -> dict[str, Any]:
    accepted: set[str] = set()
    for cls in config_class.__mro__[:-1]:
        try:
            accepted |= set(inspect.signature(cls.__init__).parameters)
        except (TypeError, ValueError):
            continue
    renamed = getattr(config_class, "attribute_map", {}) or {}
    kwargs = {}
    for key, value in TINY.items():
        name = key if key in accepted else renamed.get(key)
        if name in accepted:
            kwargs[name] = _per_stage(config_class, name, value)
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    defaults = config_class() if any(c is tf.AutoConfig for c in sub_configs.values()) else None
    for key, sub_class in sub_configs.items():
        if sub_class is tf.AutoConfig:  # the family's default sub-model, made tiny
            default = getattr(defaults, key, None)
            if default is not None and hasattr(default, "model_type"):
                kwargs[key] = {**_tiny_kwargs(type(default)), "model_type": default.model_type}
        elif isinstance(sub_class, type):
            kwargs[key] = _tiny_kwargs(sub_class)
    if "num_encoder_blocks" in accepted or config_class.model_type == "florence_vision":  # every per-stage list as long as depths
        if "num_encoder_blocks" in accepted:  # SegFormer, PVT (Florence-2's DaViT names no count)
            kwargs["num_encoder_blocks"] = len(TINY["depths"])
        for name, parameter in inspect.signature(config_class.__init__).parameters.items():
            if name not in kwargs and isinstance(parameter.default, (list, tuple)) and len(parameter.default) > len(TINY["depths"]):
                kwargs[name] = list(parameter.default)[: len(TINY["depths"])]
    if "kv_lora_rank" in kwargs and "num_key_value_heads" in kwargs:  # latent attention has a key per query head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", TINY["num_attention_heads"])
    if "mrope_section" in (getattr(config_class, "ignore_keys_at_rope_validation", None) or set()):
        kwargs["rope_parameters"] = _tiny_mrope(config_class)
    if "image_grid_pinpoints" in accepted:  # LLaVA-NeXT's any-resolution tiles: one, of the tiny image's size
        kwargs["image_grid_pinpoints"] = [[IMAGE_SIZE, IMAGE_SIZE]]
    layers = inspect.signature(config_class.__init__).parameters.get("vision_feature_layer")
    if layers is not None and _takes_list(layers):  # VipLLaVA's and Molmo2's several layers, in the tiny tower
        kwargs["vision_feature_layer"] = [-2, -1]
    if "layer_types" in accepted and (hybrid := _tiny_layer_types(config_class)) is not None:
        kwargs["layer_types"] = hybrid
    if "global_attn_indexes" in accepted:  # SAM's windowed tower (DeepSeek-VL's high-resolution one): its global layer among the tiny ones
        kwargs["global_attn_indexes"] = [TINY["num_hidden_layers"] - 1]
    if "attn_layer_period" in accepted:  # Jamba: attention every 8th layer from the 5th; the tiny model's second
        kwargs.update(attn_layer_period=2, attn_layer_offset=1)
    if config_class.model_type == "bamba":  # a Mamba layer, then attention (its default names no attention layer)
        kwargs["attn_layer_indices"] = [1]
    if config_class.model_type == "granitemoehybrid":  # the same (Granite 4.0's checkpoints name theirs)
        kwargs["layer_types"] = ["linear_attention", "full_attention"]
    if config_class.model_type in ("zamba", "zamba2"):  # a Mamba layer, then one with the shared attention block
        kwargs["layers_block_type"] = ["mamba", "hybrid"]
        for jamba_setting in ("attn_layer_period", "attn_layer_offset"):
            kwargs.pop(jamba_setting, None)
    if config_class.model_type == "zaya":  # one expert per token, all it runs
        kwargs["num_experts_per_tok"] = 1
    if config_class.model_type == "lfm2_moe":  # a convolution layer, then attention (its default names none)
        kwargs["layer_types"] = ["conv", "full_attention"]
    if config_class.model_type == "gemma3n_text":  # no layer of the tiny two reads another's keys and values
        kwargs["num_kv_shared_layers"] = 0
    if config_class.model_type == "layoutlmv3":  # four coordinates' and two sizes' embeddings, concatenated to the tiny width
        kwargs.update(coordinate_size=4, shape_size=8)
    if config_class.model_type == "longcat_flash":  # its rotary embedding's width is head_dim, its checkpoints' rotated part
        kwargs["head_dim"] = TINY["qk_rope_head_dim"]
    if config_class.model_type == "kolibri1_1":  # a sliding layer, then an indexed one choosing 4 keys; NVFP4 rounding in blocks of 16 features
        kwargs.update(head_dim=16, layer_types=["sliding_attention", "indexed_attention"], sliding_window=4, index_num_heads=2,
                      index_topk=4, index_pool_size=4, index_compression=2, index_num_local_tokens=2, index_num_sink_tokens=1)
    if config_class.model_type == "esmc":  # no grouped-query attention
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]
    if config_class.model_type == "hiera":  # its query pooling in the first of the tiny stages
        kwargs["num_query_pool"] = 1
    if config_class.model_type == "pvt":  # its last stage, which reads a class token, reduces no keys (as the full model's)
        kwargs["sequence_reduction_ratios"] = [2, 1]
    if config_class.model_type == "squeezebert":  # its embeddings at the tiny width, which its layers' grouped convolutions read
        kwargs["embedding_size"] = TINY["hidden_size"]
    if config_class.model_type == "dbrx":  # its attention reads the rotary base and the clip of its checkpoints from its own sub-config
        kwargs["attn_config"] = {**kwargs.get("attn_config", {}), "rope_theta": 10000.0, "clip_qkv": 8.0}
    if "block_types" in accepted:  # RecurrentGemma: two recurrent blocks, then attention; the tiny model's second
        kwargs["block_types"] = ["recurrent", "attention"]
    if "cross_attention_layers" in accepted:  # Mllama's text model: its last tiny layer cross-attends
        kwargs["cross_attention_layers"] = [TINY["num_hidden_layers"] - 1]
    if "intermediate_layers_indices" in accepted:  # Mllama's tower: one intermediate layer of the tiny ones, beside its last
        kwargs.update(intermediate_layers_indices=[0], vision_output_dim=2 * TINY["hidden_size"])
    if "pixel_shuffle_ratio" in accepted and "projector_input_dim" in accepted:  # Llama 4's tower: its pixel shuffle
        ratio = inspect.signature(config_class.__init__).parameters["pixel_shuffle_ratio"].default  # reads hidden / ratio²
        hidden = TINY["hidden_size"]
        kwargs.update(intermediate_size=int(hidden / ratio**2), projector_input_dim=hidden, projector_output_dim=hidden,
                      vision_output_dim=hidden)
    if "window_size" in accepted and "spatial_merge_size" in accepted:  # Qwen2.5-VL's windows: one merged patch each, at the tiny patch size
        kwargs["window_size"] = TINY["patch_size"] * 2
    if "index_kpool" in accepted:  # GLM-5-Next: no rotary part in its indexed attention, keys pooled in pairs, linear layers of tiny heads
        kwargs.update(qk_rope_head_dim=0, index_topk=4, index_kpool=2, index_head_dim=8, index_n_heads=2, linear_head_dim=8,
                      linear_num_heads=4)
    if config_class.model_type == "cohere_compass_text":  # interleaved multimodal rotary positions per layer type
        kwargs["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}}
    if config_class.model_type == "step3p5":  # Step3p7's text model: its mask is built for sliding layers whether or not it has any
        kwargs["sliding_window"] = 4
    if config_class.model_type == "deepseek_ocr2_text":  # a dense layer, then one of experts (no default list)
        kwargs["mlp_layer_types"] = ["dense", "sparse"]
    if config_class.model_type == "granite4_vision":  # its tower's features enter the tiny LM's layers
        kwargs.update(deepstack_layer_map=[[0, 0], [1, 1]], spatial_target_layers=[0, 1, 0, 1], downsample_rate="1/2")
        kwargs["vision_config"] = {**kwargs["vision_config"], "hidden_size": 64}  # its Q-Former has one head per 64 features
    if config_class.model_type == "deepseek_ocr2_sam_vision_model":  # DeepSeek-OCR-2's SAM neck's channels end at the tiny encoder's width
        kwargs["downsample_channels"] = [16, TINY["hidden_size"]]
    if config_class.model_type == "chameleon":  # its images as codes of a tiny VQ-VAE (16 per image), named in the vocabulary
        kwargs["vq_config"] = dict(embed_dim=8, num_embeddings=8, resolution=IMAGE_SIZE, base_channels=32, latent_channels=8,
                                   channel_multiplier=[1, 1, 1, 1], num_res_blocks=1)
        kwargs["vocabulary_map"] = {"<image>": VOCAB - 1, **{_image_code_name(code): VOCAB - 20 + code for code in range(8)}}
    if config_class.model_type == "emu3":  # its images as codes of a tiny VQ-VAE (4 × 4, an end of line after each row)
        kwargs["vq_config"] = dict(codebook_size=8, embed_dim=8, latent_channels=8, base_channels=32, channel_multiplier=[1, 1, 1, 1],
                                   num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=4)
        kwargs["vocabulary_map"] = {"<image>": VOCAB - 1, "<|extra_200|>": VOCAB - 2,
                                    **{f"<|visual token {code:06d}|>": VOCAB - 20 + code for code in range(8)}}
    if config_class.model_type == "florence_vision":  # Florence-2's DaViT: its channel attention's groups, one per head
        kwargs["num_groups"] = kwargs["num_heads"]
    if config_class.model_type == "kosmos-2.5":  # its image's latent queries, as many as the tiny image has patches
        kwargs["latent_query_num"] = 16
    if config_class.model_type == "nemotron_h_omni":  # its tower's default setting, which the tiny one repeats, and its width
        kwargs["vision_config"] = {**kwargs["vision_config"], "video_temporal_patch_size": 2}
        kwargs.update(vision_hidden_size=TINY["hidden_size"], projector_hidden_size=TINY["hidden_size"])
    if config_class.model_type == "muse_spark_audio":  # Muse Spark's audio pyramid: one stage per tiny layer
        kwargs.update(patch_sizes=[4, 2], hidden_sizes=[16, 32])
    if config_class.model_type in ("muse_glimmer", "muse_spark"):  # their adapters read the tower's patches merged 2 × 2
        kwargs["out_hidden_size"] = 4 * TINY["hidden_size"]
    if config_class.model_type == "muse_spark":
        kwargs["projector_hidden_size"] = TINY["hidden_size"]
    if "projector_patch_to_query_dict" in accepted:  # Aria's projector: queries per image by its patch count, the tiny image's
        kwargs["projector_patch_to_query_dict"] = {(IMAGE_SIZE // TINY["patch_size"]) ** 2: 4}
    if config_class.model_type == "paddleocr_vl_text":  # its rotary splits into sections its defaults do not name
        kwargs["rope_parameters"] = {**config_class().rope_parameters, "mrope_section": [1, 1, TINY["head_dim"] // 2 - 2]}
    if head == "causal LM":  # encoders' LM heads (BertLMHeadModel, XLM) as transformers' tests build them
        kwargs.update({flag: True for flag in ("is_decoder", "causal") if flag in accepted})
    return {k: v for k, v in kwargs.items() if v is not None}


def _image_code_name(code: int) -> str:
    """Chameleon's vocabulary name of its VQ-VAE's code: its digits as letters (0: A)."""
    return "IMGIMG" + "".join(chr(ord("A") + int(digit)) for digit in str(code)) + "Z"


SOFTMAX_LAYERS = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")
"""The layer types of hybrid models whose calls are softmax attention."""


def _tiny_layer_types(config_class: type) -> list[str] | None:
    """The two tiny layers of a hybrid (Qwen3-Next, Qwen3.5, Kimi-Linear, Bailing, LFM3)
    whose two layers of its own pattern would hold none of its attention (linear
    attention or convolutions alone): one of its first kind, then one of its attention;
    None for any other model."""
    try:
        tiny = getattr(config_class(num_hidden_layers=TINY["num_hidden_layers"]), "layer_types", None)
        default = getattr(config_class(), "layer_types", None)
    except Exception:  # noqa: BLE001 - a config that does not build so is no hybrid of this kind
        return None
    if not isinstance(tiny, list) or not isinstance(default, list) or any(kind in SOFTMAX_LAYERS for kind in tiny):
        return None
    attention = next((kind for kind in default if kind in SOFTMAX_LAYERS), None)
    return None if attention is None else [tiny[0], attention]


def _tiny_mrope(config_class: type) -> dict[str, Any] | None:
    """Multimodal rotary positions (Qwen2-VL's, GLM-4V's) over the tiny head: the default
    rope parameters, the rotated half split into temporal, height and width sections (the
    default sections are the full-size model's); None where the defaults name none, or
    per layer type."""
    config = config_class()
    default = dict(getattr(config, "rope_parameters", None) or {})
    if not default or any(isinstance(value, dict) for value in default.values()):
        return None
    rotated = TINY["qk_rope_head_dim"] if hasattr(config, "qk_rope_head_dim") else TINY["head_dim"]  # HY-V4-VL's latent attention
    half = int(rotated * float(default.get("partial_rotary_factor", 1.0))) // 2
    return {**default, "mrope_section": [half // 4, half // 4, half - 2 * (half // 4)]}


def _per_stage(config_class: type, name: str, value: Any) -> Any:
    """``value`` once per stage (two, as ``depths``) where the config takes a list (Swin's
    ``num_heads``; ERNIE-4.5-VL's experts' width per modality, Molmo2's image size, typed
    as lists alone)."""
    try:
        parameter = inspect.signature(config_class.__init__).parameters[name]
    except (KeyError, TypeError, ValueError):
        return value
    if value is not None and _takes_list(parameter) and not isinstance(value, (list, tuple)):
        return [value] * len(TINY["depths"])
    return value


def _takes_list(parameter: inspect.Parameter) -> bool:
    """Whether a config's parameter takes a list: its default is one, or its type names
    lists alone (or None)."""
    kinds = [kind.strip() for kind in str(parameter.annotation).split("|") if kind.strip() != "None"]
    lists_only = bool(kinds) and all(kind.startswith(("list[", "tuple[")) for kind in kinds)
    return isinstance(parameter.default, (list, tuple)) or lists_only


class NotBuilt(Exception):
    """transformers cannot build or run this tiny model here."""


def build(architecture: Architecture, seed: int = 0, implementation: str | None = None) -> nn.Module:
    """The tiny model, with the attention implementation transformers picks by default
    (sdpa where it has one) or ``implementation``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    logging.disable(logging.WARNING)
    try:
        config_class = CONFIG_MAPPING[architecture.model_type]
        own = getattr(getattr(tf, architecture.class_name, None), "config_class", None)
        if own in (getattr(config_class, "sub_configs", None) or {}).values():  # a multimodal family's causal LM (Llama 4's): its text model's
            config_class = own
        config = config_class(**_tiny_kwargs(config_class, architecture.head))
        if architecture.head == "image-text-to-text":  # the image token inside the tiny vocabulary
            for name in ("image_token_id", "image_token_index"):
                if hasattr(config, name) and (getattr(config, name) is None or isinstance(getattr(config, name), int)):
                    setattr(config, name, VOCAB - 1)
            if architecture.model_type in BOUNDED_IMAGES:
                (config.image_start_token_id,), (config.image_end_token_id,) = BOUNDED_IMAGES[architecture.model_type]
            if architecture.model_type in OMNI_THINKERS and not hasattr(config, "vision_start_token_id"):
                config.vision_start_token_id = VOCAB - 2  # their checkpoints' configs carry it; the config class does not
        if implementation is not None:
            config._attn_implementation = implementation
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(tf, architecture.class_name)(config).eval()
        if architecture.model_type == "xmod":  # its adapters per language: its first, as a checkpoint's user sets one
            model.set_default_language(config.languages[0])
        return model
    except Exception as error:  # noqa: BLE001 - whatever stops transformers building it
        raise NotBuilt(_one_line(error)) from error
    finally:
        logging.disable(logging.NOTSET)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


@dataclass
class Case:
    """The inputs one architecture is explained on, and how its output becomes the score."""

    model: nn.Module
    architecture: Architecture
    inputs: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    args: tuple[Any, ...] | None
    target: int
    images: dict[str, torch.Tensor] | None = None  # a vision-language model's image inputs; SigLIP2's classifier's patch mask and grid
    position: int | None = None  # the token whose logits are explained (POSITION_HEADS); None: the head's own rows
    output: str = "logits"  # the output explained: a question answerer's start_logits

    @property
    def encoder_decoder(self) -> bool:
        return reads_decoder_ids(self.model)

    def keywords(self) -> dict[str, torch.Tensor]:
        """The reference forward's arguments."""
        if isinstance(self.inputs, torch.Tensor) and self.inputs.is_floating_point():
            return {"pixel_values": self.inputs, **(self.images or {})}
        if self.encoder_decoder:
            source, target = self.inputs  # type: ignore[misc]
            return {"input_ids": source, "attention_mask": torch.ones_like(source), "decoder_input_ids": target, **(self.images or {})}
        return {"input_ids": self.inputs, "attention_mask": torch.ones_like(self.inputs), **(self.images or {})}  # type: ignore[arg-type]

    def logits_of(self, out: Any) -> torch.Tensor:
        return getattr(out, self.output)

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        if self.position is not None:  # a start logit (its token is the class), or a label's at its token
            logits = logits[:, self.position]
            return (logits if logits.dim() == 1 else logits[:, self.target]).sum()
        if logits.dim() == 3:  # a language model: the last position's target token
            logits = logits[:, -1]
        return logits[:, self.target].sum()


def reads_decoder_ids(model: nn.Module) -> bool:
    """Whether the model is an encoder-decoder that reads a decoder's ids: its config says
    so and its forward takes them (UMT5's token classifier keeps its family's config flag
    over an encoder alone)."""
    takes = inspect.signature(model.forward).parameters
    return bool(getattr(model.config, "is_encoder_decoder", False)) and "decoder_input_ids" in takes


def runs(case: Case) -> Case:
    """``case``, once its model has run on its inputs (else :class:`NotBuilt`: the tiny
    model or the sweep's inputs do not suit it, which is no defect of the library)."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.model(**case.keywords())
    except Exception as error:  # noqa: BLE001 - whatever stops the model itself
        raise NotBuilt(f"the model itself fails: {_one_line(error)}") from error
    return case


def make_case(model: nn.Module, architecture: Architecture) -> Case:
    generator = torch.Generator().manual_seed(1)
    config = model.config
    if architecture.head == "image-text-to-text":
        return vision_language_case(model, architecture, generator)
    if architecture.head == "image classification" and "spatial_shapes" in inspect.signature(model.forward).parameters:
        return native_size_image_case(model, architecture, generator)
    if architecture.head == "image classification" and model.main_input_name != "input_ids":  # ImageGPT reads colour ids
        vision = getattr(config, "vision_config", config)
        size = getattr(vision, "image_size", IMAGE_SIZE)
        size = size if isinstance(size, int) else size[0]
        pixels = torch.randn(2, getattr(vision, "num_channels", 3), size, size, generator=generator)
        return Case(model, architecture, pixels, None, TEXT_TARGET)
    ids = torch.randint(3, VOCAB, (2, SEQ_LEN), generator=generator)
    ids[:, -1] = 2  # an end of sequence: BART-like classifiers read its position
    target = LM_TARGET if architecture.head in ("causal LM", "seq2seq LM") else TEXT_TARGET
    if architecture.head in POSITION_HEADS:
        return position_case(model, architecture, ids)
    if reads_decoder_ids(model):
        decoder_ids = torch.cat([torch.ones_like(ids[:, :1]), ids[:, :-1]], dim=1)  # shifted right
        return Case(model, architecture, (ids, decoder_ids), (torch.ones_like(ids), torch.ones_like(ids)), target)
    second = list(inspect.signature(model.forward).parameters)[1:2]
    mask = (torch.ones_like(ids),) if second == ["attention_mask"] else None  # else it would land in another argument
    return Case(model, architecture, ids, mask, target)


def position_case(model: nn.Module, architecture: Architecture, ids: torch.Tensor) -> Case:
    """A question answerer's start logit, a token classifier's label or a masked language
    model's token at :data:`POSITION`; an encoder-decoder's is not built (``explain``
    refuses its answers, and takes it for a sequence-to-sequence model otherwise: its
    decoder reads the text again)."""
    if reads_decoder_ids(model):
        raise NotBuilt("an encoder-decoder: explain refuses its answers and reads it as a sequence-to-sequence model")
    if architecture.model_type in FLOAT64_POSITIONS:
        model = model.double()
    second = list(inspect.signature(model.forward).parameters)[1:2]
    mask = (torch.ones_like(ids),) if second == ["attention_mask"] else None
    question = architecture.head == "question answering"
    return Case(model, architecture, ids, mask, TEXT_TARGET, position=POSITION, output="start_logits" if question else "logits")


def native_size_image_case(model: nn.Module, architecture: Architecture, generator: torch.Generator) -> Case:
    """SigLIP2's native sizes: two images of 4 × 4 patches, flattened, with their grid and
    mask (given as the image's inputs besides the patches)."""
    vision = getattr(model.config, "vision_config", model.config)
    patch, side = int(vision.patch_size), 4
    pixels = torch.rand(2, side * side, getattr(vision, "num_channels", 3) * patch * patch, generator=generator)
    grid = {"pixel_attention_mask": torch.ones(2, side * side, dtype=torch.long), "spatial_shapes": torch.tensor([[side, side]] * 2)}
    return Case(model, architecture, pixels, tuple(grid.values()), TEXT_TARGET, grid)


def vision_language_case(model: nn.Module, architecture: Architecture, generator: torch.Generator) -> Case:
    """One image of the vision tower's size, ``(1, channels, size, size)`` (flattened
    patches and their grid where the model takes ``image_grid_thw``; the image and its one
    tile for LLaVA-NeXT's any-resolution tiles), after BOS, as many image tokens as the
    model's image features, then text (GIT's: no image token, its features before the
    text); a family whose images come otherwise is not built."""
    from captum_attention.capture.adapters.images import image_token_id

    vision = getattr(model.config, "vision_config", None) or getattr(model.config, "vq_config", None)  # Chameleon: a VQ-VAE
    token = image_token_id(model.config)
    if cross_attends_images(model):
        return cross_attending_case(model, architecture, generator)
    image_features = getattr(model, "get_image_features", None) or getattr(getattr(model, "model", None), "get_image_features", None)
    if architecture.model_type == "idefics":
        return gated_cross_attention_case(model, architecture, generator)
    if leading_image_features(model) is not None:  # GIT: the image's features before the tokens, no image token
        size = int(vision.image_size)
        images = {"pixel_values": torch.randn(1, 3, size, size, generator=generator)}
        ids = torch.tensor([[1, 5, 6, 7]])
        return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)
    if architecture.model_type in LINEAR_PATCHES and token is not None and image_features is not None:
        return linear_patches_case(model, architecture, generator, token)
    if architecture.model_type in POSITION_MASKED:  # Kosmos-2: its images' positions marked by a mask, not by a token
        token = VOCAB - 1
    if vision is None or token is None or image_features is None:  # DeepSeek-VL, Janus: their base model's
        raise NotBuilt("no vision config, image token or get_image_features: not a vision-language model of this sweep's kind")
    size = getattr(vision, "image_size", IMAGE_SIZE)
    size = size if isinstance(size, int) else size[0]
    pixels = torch.randn(1, getattr(vision, "num_channels", 3), size, size, generator=generator)
    inner = getattr(getattr(model, "model", None), "get_image_features", None)
    wanted = dict(inspect.signature(image_features).parameters)
    if inner is not None and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in wanted.values()):  # MiniCPM-V's outer one names none
        wanted = dict(inspect.signature(inner).parameters)
    images = {"pixel_values": pixels[:, None] if "pixel_attention_mask" in wanted else pixels}  # Idefics: images per example
    if "high_res_pixel_values" in wanted:  # DeepSeek-VL's hybrid: the image again for its high-resolution tower
        high = model.config.high_res_vision_config
        images["high_res_pixel_values"] = torch.randn(1, getattr(high, "num_channels", 3), high.image_size, high.image_size, generator=generator)
    if "target_sizes" in wanted:  # MiniCPM-V: each image's patch grid
        images["target_sizes"] = torch.tensor([[size // vision.patch_size] * 2])
    if "qformer_input_ids" in wanted:  # InstructBLIP: the instruction its Q-Former reads beside the image
        images.update(qformer_input_ids=torch.tensor([[5, 6, 7]]), qformer_attention_mask=torch.ones(1, 3, dtype=torch.long))
    if "image_sizes" in wanted:
        images["image_sizes"] = torch.tensor([[size, size]])
    if architecture.model_type in TILE_MASKED:
        images["pixel_attention_mask"] = torch.ones(1, 1, dtype=torch.bool)
    if "spatial_shapes" in wanted:  # LFM2-VL (SigLIP2's native sizes): patches flattened, their grid and mask
        patch, side = int(vision.patch_size), 2 * int(model.config.downsample_factor)
        pixels = torch.rand(1, side * side, getattr(vision, "num_channels", 3) * patch * patch, generator=generator)
        images = {"pixel_values": pixels, "spatial_shapes": torch.tensor([[side, side]]), "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.long)}
    if "flattened_patches" in wanted:  # Kosmos-2.5: one image's patches flattened after their row and column (1-based)
        grid = torch.tensor([[row, column] for row in range(1, 5) for column in range(1, 5)], dtype=torch.float)
        patches = torch.rand(1, len(grid), int(vision.patch_embed_hidden_size), generator=generator)
        images = {"flattened_patches": torch.cat([grid[None], patches], dim=-1)}
    if "image_token_pooling" in wanted:  # Molmo2: one crop's patches flattened, each image token pooling 2 × 2 of them
        patch, side = int(vision.patch_size), size // int(vision.patch_size)
        pixels = torch.rand(1, side * side, getattr(vision, "num_channels", 3) * patch * patch, generator=generator)
        pooled = [[(2 * r + i) * side + 2 * c + j for i in range(2) for j in range(2)] for r in range(side // 2) for c in range(side // 2)]
        images = {"pixel_values": pixels, "image_token_pooling": torch.tensor(pooled), "image_grids": torch.tensor([[side // 2, side // 2, 0, 0]])}
    if "image_grid_hw" in wanted:  # Nemotron-H Omni (RADIO): patches flattened, their grid, shuffled 2 × 2 after the tower
        patch = int(vision.patch_size)
        pixels = torch.rand(16, getattr(vision, "num_channels", 3) * patch * patch, generator=generator)
        images = {"pixel_values": pixels, "image_grid_hw": torch.tensor([[4, 4]])}
    if getattr(model.config, "image_grid_pinpoints", None):  # LLaVA-NeXT: the image resized, then its one tile
        images["pixel_values"] = pixels[:, None].expand(-1, 2, -1, -1, -1)
    if "image_position_ids" in wanted:  # Gemma 4: patches flattened per image and their (x, y), pooled k × k
        patch, pool = int(vision.patch_size), int(vision.pooling_kernel_size)
        patch, side = (patch, 2 * pool) if hasattr(vision, "num_hidden_layers") else (patch * pool, 2)  # no tower: k × k in one
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), dim=-1)
        images = {"pixel_values": torch.rand(1, side * side, 3 * patch * patch, generator=generator), "image_position_ids": grid.reshape(1, -1, 2)}
    if "image_grid_thw" in wanted:  # Qwen2-VL-like: the patches flattened, merged m × m
        patch, merge = int(vision.patch_size), _first_setting(vision, ("spatial_merge_size", "merge_size", "merge_kernel_size"))
        side = max(merge, size // patch // merge * merge)
        depth = _first_setting(vision, ("temporal_patch_size", "patch_temporal")) * patch * patch
        channels = _first_setting(vision, ("in_channels", "in_chans", "num_channels"), 3)
        pixels = torch.randn(side * side, channels * depth, generator=generator)
        if architecture.model_type in PATCHES_AS_IMAGES:
            pixels = pixels.view(side * side, channels, patch, patch)
        images = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]])}
        if architecture.model_type == "inkling2":  # its grid counts merged tokens, each token's pixels with their channels last
            tokens = side // merge
            pixels = torch.randn(tokens * tokens, patch * merge, patch * merge, channels, generator=generator)
            images = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, tokens, tokens]])}
        if inner is not None and "image_merge_sizes" in inspect.signature(inner).parameters:  # VideoLLaMA 3: the merge per image
            images["image_merge_sizes"] = torch.tensor([merge])
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            features = image_features(**images)
    except Exception as error:  # noqa: BLE001 - its images come in another form
        raise NotBuilt(f"its image features from one (1, C, {size}, {size}) image: {_one_line(error)}") from error
    deepstack = getattr(features, "deepstack_features", None)  # Granite 4 Vision's: (LM layer, features) pairs alone
    features = getattr(features, "pooler_output", features)
    if features is None and deepstack:
        features = deepstack[0][1]
    count = sum(f.shape[-2] if f.dim() == 3 else f.shape[0] for f in (features if isinstance(features, (list, tuple)) else [features]))
    start, end = BOUNDED_IMAGES.get(architecture.model_type, ((), ()))
    ids = torch.tensor([[1, *start, *[token] * count, *end, 5, 6, 7]])
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        images["mm_token_type_ids"] = (ids == token).long()
    if architecture.model_type in POSITION_MASKED:
        images[POSITION_MASKED[architecture.model_type]] = (ids == token).long()
    if architecture.model_type in PREFIX_TOKEN_TYPES:
        images["token_type_ids"] = PREFIX_TOKEN_TYPES[architecture.model_type](ids, token)
    if getattr(model.config, "is_encoder_decoder", False):  # Florence-2: the image's tokens in the encoder's input
        answer = torch.tensor([[1, 5, 6]])
        return Case(model, architecture, (ids, answer), (torch.ones_like(ids), torch.ones_like(answer), images), LM_TARGET, images)
    return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)


POSITION_MASKED = {"kosmos-2": "image_embeds_position_mask", "kosmos-2.5": "image_embeds_position_mask"}
"""Families whose image features replace the positions a mask marks (the sweep's prompt
puts its image tokens there)."""

ENCODER_DECODER_IMAGES = "an encoder-decoder, its image in the encoder's input: this sweep reads a decoder's prompt"
"""Why the sweeps of a decoder's prompt do not build Florence-2's case."""

LINEAR_PATCHES = ("fuyu",)
"""Families without a vision tower, whose image features are a linear map of the image's
flattened patches (Fuyu's)."""


def linear_patches_case(model: nn.Module, architecture: Architecture, generator: torch.Generator, token: int) -> Case:
    """Fuyu's: four patches of ``patch_size²`` pixels, flattened, one image token each
    after BOS, then text."""
    config = model.config
    patches = torch.randn(1, 4, config.num_channels * config.patch_size**2, generator=generator)
    images = {"pixel_values": patches}
    ids = torch.tensor([[1, *[token] * patches.shape[1], 5, 6, 7]])
    return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)


def gated_cross_attention_case(model: nn.Module, architecture: Architecture, generator: torch.Generator) -> Case:
    """Idefics': one image of the tower's size, read by the gated cross-attention of every
    token, as its image attention mask says; the prompt holds no image token."""
    size = model.config.vision_config.image_size
    images = {"pixel_values": torch.randn(1, 1, 3, size, size, generator=generator), "image_attention_mask": torch.ones(1, 4, 1, dtype=torch.long)}
    ids = torch.tensor([[1, 5, 6, 7]])
    return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)


def cross_attending_case(model: nn.Module, architecture: Architecture, generator: torch.Generator) -> Case:
    """Mllama's: one image of one tile (of ``max_num_tiles``), its token after BOS, every
    later token seeing it (as its processor's cross-attention mask says); the tanh gates,
    zero when built, opened so that the image reaches the output. BLIP's: one image of the
    tower's size, which every token reads; no image token."""
    vision = model.config.vision_config
    if architecture.model_type == "blip":
        size = int(vision.image_size)
        images = {"pixel_values": torch.randn(1, 3, size, size, generator=generator)}
        ids = torch.tensor([[1, 5, 6, 7]])
        return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)
    tiles, size = int(vision.max_num_tiles), int(vision.image_size)
    pixels = torch.zeros(1, 1, tiles, int(vision.num_channels), size, size)
    pixels[:, :, 0] = torch.randn(pixels.shape[3:], generator=generator)
    ids = torch.tensor([[1, VOCAB - 1, 5, 6, 7]])
    cross = torch.zeros(1, ids.shape[1], 1, tiles, dtype=torch.long)
    cross[:, 1:, :, 0] = 1
    mask = torch.zeros(1, 1, tiles, dtype=torch.long)
    mask[..., 0] = 1
    images = {"pixel_values": pixels, "aspect_ratio_ids": torch.tensor([[1]]), "aspect_ratio_mask": mask, "cross_attention_mask": cross}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("_gate"):
                parameter.fill_(0.5)
    return Case(model, architecture, ids, (torch.ones_like(ids), images), LM_TARGET, images)


def _first_setting(config: Any, names: tuple[str, ...], default: int = 1) -> int:
    """The first of ``names`` that ``config`` sets (a square kernel's side), else ``default``."""
    value = next((getattr(config, name) for name in names if getattr(config, name, None)), default)
    return int(value[0] if isinstance(value, (list, tuple)) else value)


PATCHES_AS_IMAGES = {"paddleocr_vl", "kimi_k25"}
"""Qwen2-VL-like families whose flattened patches come as ``(patches, channels, p, p)``."""

BOUNDED_IMAGES = {"ovis2_5": ((VOCAB - 3,), (VOCAB - 2,))}
"""The tokens around an image that a family's forward requires (Ovis2.5's, embedded as
its visual indicators), inside the tiny vocabulary."""

TILE_MASKED = {"granite_docling"}
"""Families whose images come as tiles with a ``(batch, tiles)`` mask of the real ones."""


GENERATED_TOKEN_TYPES = {"paligemma": 1}
"""The token type a family's ``generate`` gives the answer's tokens (PaliGemma's causal
suffix), where it is not its prompt's text's."""

OMNI_THINKERS = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
"""Qwen's omni models' thinkers, whose rotary positions read ``vision_start_token_id``."""

PREFIX_TOKEN_TYPES: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "paligemma": lambda ids, token: torch.zeros_like(ids),  # the whole prompt its prefix
    "gemma3": lambda ids, token: (ids == token).long(),  # the image tokens
    "shieldgemma2": lambda ids, token: (ids == token).long(),
}
"""The token types a prefix language model's processor gives a prompt (its bidirectional
part); without them transformers runs PaliGemma's sdpa attention both ways over the whole
sequence but its eager attention causally."""


class NoReference(Exception):
    """The eager twin's ``output_attentions`` are no softmax maps of the tokens whose
    gradient reaches the score."""


@dataclass
class StackReference:
    """``methods.py``'s reference object: per layer ``(B, H, N, N)`` maps and gradients."""

    attentions: list[torch.Tensor]
    grads: list[torch.Tensor]


def eager_output(case: Case, **extra: Any) -> Any:
    """The eager twin's output with ``output_attentions`` (and the ``extra`` arguments),
    in the autograd graph."""
    twin = copy.deepcopy(case.model)
    try:
        twin.set_attn_implementation("eager")
    except Exception:  # noqa: BLE001 - a model that runs only its own attention
        pass
    inner: list[Any] = []  # the base model's output: some heads return only some of its maps (T5Gemma's classifier)
    hooks = [child.register_forward_hook(lambda _m, _a, out: inner.append(out)) for child in twin.children()]
    try:
        out = twin(**case.keywords(), **extra, output_attentions=True)
    except Exception as error:  # noqa: BLE001
        raise NotBuilt(_one_line(error)) from error
    finally:
        for hook in hooks:
            hook.remove()
    if case.encoder_decoder and getattr(out, "encoder_attentions", None) is None:
        full = next((o for o in inner if getattr(o, "encoder_attentions", None) is not None), None)
        if full is not None:
            out = SimpleNamespace(logits=out.logits, encoder_attentions=full.encoder_attentions,
                                  decoder_attentions=full.decoder_attentions, cross_attentions=full.cross_attentions)
    if not hasattr(out, "attentions") and hasattr(out, "language_model_outputs"):  # BLIP-2's: its language model's maps
        out = SimpleNamespace(logits=out.logits, attentions=out.language_model_outputs.attentions)
    text = next((o for o in inner if getattr(o, "cross_attentions", None)), None)  # maps, not None nor an empty tuple
    if text is not None and not case.encoder_decoder and cross_attends_images(case.model):  # BLIP's text decoder: per layer, self- then cross-attention
        out = SimpleNamespace(logits=out.logits, attentions=[m for pair in zip(text.attentions, text.cross_attentions) for m in pair])
    return out


def _maps_and_grads(case: Case, groups: list[Any], logits: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    flat = [a for group in groups for a in (group or ())]
    if not flat or not all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in flat):
        raise NoReference("no (batch, heads, queries, keys) attention maps")
    if not all(bool((a >= 0).all() and (a.sum(-1) <= 1 + 1e-4).all()) for a in flat):  # < 1: attention sinks
        raise NoReference("the maps are no probabilities")
    if not all(a.requires_grad for a in flat):  # attention run under no_grad: references of the maps alone
        return [[(a.detach().double(), None) for a in (group or ())] for group in groups]  # type: ignore[misc]
    grads = torch.autograd.grad(case.score(logits), flat, allow_unused=True, retain_graph=True)
    if any(g is None for g in grads):
        raise NoReference("a returned map does not reach the output")
    pairs = iter(zip([a.detach().double() for a in flat], [g.double() for g in grads]))  # references in float64
    return [[next(pairs) for _ in (group or ())] for group in groups]


def is_causal(attentions: list[torch.Tensor]) -> bool:
    later = torch.ones(attentions[0].shape[-2:], dtype=torch.bool).triu(1)
    return all(bool((a[..., later] == 0).all()) for a in attentions)


MEAN_FROM = {
    "ImageGPTForImageClassification": 0, "IJepaForImageClassification": 0, "SiglipForImageClassification": 0,
    "SwinForImageClassification": 0, "Swinv2ForImageClassification": 0, "DonutSwinForImageClassification": 0,
    "SegformerForImageClassification": 0, "PvtV2ForImageClassification": 0, "Siglip2ForImageClassification": 0,
    "CLIPForImageClassification": 1, "MetaClip2ForImageClassification": 1,
    "BeitForImageClassification": 1, "Data2VecVisionForImageClassification": 1,
}
"""The first token of the mean each classifier reads, as its forward pools: ``hidden.mean(dim=1)``,
``hidden[:, 1:].mean(1)`` (BEiT-like models under their default ``use_mean_pooling``)."""


def read_rows(model: nn.Module, tokens: int) -> torch.Tensor | None:
    """The weights of the rows ``model``'s logits read, as its forward computes them, where
    it reads several: a mean (:func:`mean_pooled_from`); DeiT with its teacher,
    ``(cls_classifier(h[:, 0]) + distillation_classifier(h[:, 1])) / 2``; DINOv2,
    ``classifier(cat([h[:, 0], h[:, 1 + registers:].mean(1)]))``, its class token and its
    patches' mean taken as halves. None where it reads one row."""
    weights = torch.zeros(tokens)
    pooled_from = mean_pooled_from(model)
    name = type(model).__name__
    if pooled_from is not None:
        weights[pooled_from:] = 1 / (tokens - pooled_from)
    elif name == "DeiTForImageClassificationWithTeacher":
        weights[:2] = 0.5
    elif name in ("Dinov2ForImageClassification", "Dinov2WithRegistersForImageClassification"):
        patches_from = 1 + getattr(model.config, "num_register_tokens", 0)
        weights[0], weights[patches_from:] = 0.5, 0.5 / (tokens - patches_from)
    else:
        return None
    return weights


def mean_pooled_from(model: nn.Module) -> int | None:
    """The first token of the mean ``model``'s output reads; None where it reads one token."""
    if getattr(model.config, "classifier_pooling", None) in ("mean", "late"):  # ModernBERT, EuroBERT
        return 0
    if getattr(model.config, "use_mean_pooling", True) is False:
        return None
    return MEAN_FROM.get(type(model).__name__)


def reference(case: Case) -> Callable[[str], Any]:
    """Each map method's reference scores from the eager twin, by method name (raises
    :class:`NoReference` where the twin returns no usable maps)."""
    on_grids = window_maps_and_grads if window_layers(case.model) else None
    if any(hasattr(m, "sequence_reduction_ratio") or hasattr(m, "spatial_reduction_ratio") for m in case.model.modules()):
        on_grids = reduced_maps_and_grads
    out = None if on_grids else eager_output(case)
    if case.encoder_decoder:
        groups = [out.encoder_attentions, out.decoder_attentions, out.cross_attentions]
        encoder, decoder, cross = _maps_and_grads(case, groups, case.logits_of(out))
        source, target = case.inputs  # type: ignore[misc]
        batch = source.shape[0]
        pair = Seq2SeqReference(encoder, decoder, cross, [source.shape[1]] * batch, [target.shape[1]] * batch)

        def seq2seq(method: str) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [SEQ2SEQ_REFERENCES[method](pair, b) for b in range(batch)]  # type: ignore[misc]
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])

        return seq2seq
    if case.images is not None and cross_attends_images(case.model):
        return cross_attending_reference_of(case, out)
    if on_grids:  # Swin, SegFormer: every layer on the first stage's patches
        maps, grads = on_grids(case.model, case.keywords(), case.score)
        pairs, without_grads = list(zip(maps, grads)), False
    else:
        (pairs,) = _maps_and_grads(case, [out.attentions], case.logits_of(out))
        without_grads = any(g is None for _, g in pairs)
    ref = StackReference([a.float() for a, _ in pairs], [a.float() if g is None else g.float() for a, g in pairs])  # methods.py's dtype
    if len({a.shape[-2:] for a in ref.attentions}) > 1 or ref.attentions[0].shape[-1] != ref.attentions[0].shape[-2]:
        raise NoReference("the maps are not square over one sequence")
    tokens = ref.attentions[0].shape[-1]
    lengths = [tokens] * ref.attentions[0].shape[0]
    leading = tokens - case.inputs.shape[1] if case.images is not None and leading_image_features(case.model) else 0  # type: ignore[union-attr]

    def apart(scores: torch.Tensor) -> Any:
        """GIT's: ``(image feature scores, token scores)``, as its methods return them; a
        causal logit read before the last token gives the later tokens nothing."""
        if case.position is not None:
            scores = torch.nn.functional.pad(scores, (0, tokens - scores.shape[-1]))
        return (scores[:, :leading], scores[:, leading:]) if leading else scores

    generates = bool(case.model.can_generate()) if hasattr(case.model, "can_generate") else False
    query: int | torch.Tensor = tokens - 1 if generates or is_causal(ref.attentions) else 0  # a prefix LM reads its last row too
    rows = read_rows(case.model, tokens)
    if rows is not None:  # the classifier reads these rows
        query = rows
    if case.position is not None:
        query = case.position
        if is_causal(ref.attentions):  # the logit reads the tokens up to its own, as a prompt of them alone
            lengths = [case.position + 1] * len(lengths)

    def stack(method: str) -> Any:
        if without_grads and REGISTRY[method].spec.needs != "forward":
            raise NoReference("the maps carry no gradient")
        if method == "grad_sam":
            return apart(reference_grad_sam(ref, lengths))
        if method == "knockout_gradient":
            return apart(reference_knockout(ref, lengths))
        if method == "learned_attention":
            return apart(reference_mean_row(ref, lengths, query))
        if method == "knockout_lrp":  # the relevance is AttnLRP's own, which this sweep checks streaming against eager
            relevance = explain(case, "attn_lrp")
            relevance = torch.cat(relevance, dim=1) if isinstance(relevance, tuple) else relevance.flatten(1)  # a patch grid: the last tokens
            return apart(reference_decisive(reference_knockout(ref, lengths)[:, -relevance.shape[1] :], relevance))
        return apart(METHODS[method].reference(ref, lengths, query))  # type: ignore[misc]

    return stack


def cross_attending_reference_of(case: Case, out: Any) -> Callable[[str], tuple[torch.Tensor, torch.Tensor]]:
    """Mllama's and BLIP's references (``seq2seq_reference.py``): the self- and
    cross-attention in layer order, at the last row, over the states of Mllama's one real
    tile, of BLIP's image."""
    (pairs,) = _maps_and_grads(case, [out.attentions], out.logits)
    tokens = case.inputs.shape[1]  # type: ignore[union-attr]
    cross_keys = next(a.shape[-1] for a, _ in pairs if a.shape[-1] != tokens)
    real = torch.ones(cross_keys, dtype=torch.bool)
    if "aspect_ratio_mask" in case.images:  # type: ignore[operator]
        per_tile = cross_keys // case.images["aspect_ratio_mask"].shape[-1]  # type: ignore[index]
        real = case.images["aspect_ratio_mask"].bool().repeat_interleave(per_tile, dim=-1).flatten(1)[0]  # type: ignore[index]
    states = real.nonzero().flatten()
    layers = [
        ("decoder", a[0], g[0]) if a.shape[-1] == tokens else ("cross", a[0][..., states], g[0][..., states]) for a, g in pairs
    ]

    def scores(method: str) -> tuple[torch.Tensor, torch.Tensor]:
        source, target = cross_attending_reference(method, layers, [tokens - 1])
        placed = torch.zeros(len(real), dtype=torch.float64)
        placed[states] = source
        return placed[None], target[None]

    return scores


def reference_mean_row(ref: StackReference, lengths: list[int], query: int | torch.Tensor) -> torch.Tensor:
    """LearnedAttention's uniform weights: the explained row of every layer's and head's
    map, averaged, per example over its real block."""
    if len({a.shape[1] for a in ref.attentions}) > 1:
        raise NoReference("the layers have different numbers of heads")
    heads = len(ref.attentions) * ref.attentions[0].shape[1]
    scores = torch.zeros(len(lengths), max(lengths))
    for b, n in enumerate(lengths):
        summed = sum(a[b, :, :n, :n].double().sum(dim=0) for a in ref.attentions)
        scores[b, :n] = (_row(summed, query) / heads).float()
    return scores


def explained_output(case: Case) -> float:
    """The largest explained output ``|f|`` of the case's examples: AttnLRP's relevances
    redistribute it, so a difference ε between two forwards (sdpa and eager, about 3e-5 of
    the activations in float32) moves them by about ε·|f| even where the tokens keep only a
    sliver of it (ModernBERT's bias-free norms leave them 1e-4 of the logit)."""
    with torch.no_grad():
        logits = case.logits_of(case.model(**case.keywords()))
    if case.position is not None:
        logits = logits[:, case.position]
        return float((logits if logits.dim() == 1 else logits[:, case.target]).abs().max())
    logits = logits[:, -1] if logits.dim() == 3 else logits
    return float(logits[:, case.target].abs().max())


def _close(actual: Any, expected: Any, floor: float = 1e-30) -> bool:
    """Whether ``actual`` equals ``expected`` within :data:`REL` of the larger of its
    scale and ``floor``."""
    pairs = zip(actual, expected) if isinstance(expected, tuple) else [(actual, expected)]
    for got, want in pairs:
        got = got.detach().float()
        if got.dim() == 3 and want.dim() == 2:  # a patch grid: the last rows·columns tokens
            got, want = got.flatten(1), want[:, -got.shape[-2] * got.shape[-1] :]
        if got.shape != want.shape or not bool(torch.isfinite(got).all()):
            return False
        want = want.float()
        scale = want.abs().max().clamp(min=floor)
        if not bool(((got - want).abs() <= REL * scale).all()):
            return False
    return True


@dataclass(frozen=True)
class Outcome:
    status: str  # exact, refused, not built, error, wrong; runs (report_outcome)
    detail: str = ""


VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"norm_attention(residual=True)": ("norm_attention", {"residual": True})}
"""Swept names that are a registered method with options."""

CHECKED_BY_THEMSELVES = ("norm_attention", "norm_attention(residual=True)", "alti", "alti_logit", "value_zeroing")
"""Methods with no reference from the maps alone (they read the values, the norms, the
unembedding, or re-run layers), whose calls check their decomposition against the model's
own tensors (what the output projection received, the layer's states, the logits) and
refuse where it does not add up; the sweep checks them finite and the same streaming and
eager (Value Zeroing's re-runs are the model's own layers)."""


def explain(case: Case, method: str, capture: str = "auto") -> Any:
    name, options = VARIANTS.get(method, (method, {}))
    cls = REGISTRY[name]
    options = {**options, "target": case.target} if cls.spec.uses_target else dict(options)
    if case.position is not None:
        return _explain_position(case, cls, options, capture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(case.model, capture=capture).attribute(case.inputs, additional_forward_args=case.args, **options)


def _explain_position(case: Case, cls: Any, options: dict[str, Any], capture: str) -> Any:
    """The method's call at the case's token, on a forward of its output, as ``explain``
    calls it: ``target`` the token (a start logit) or ``(token, label)``."""
    def forward(ids: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return case.logits_of(case.model(input_ids=ids, **({"attention_mask": args[0]} if args else {})))

    if "target" in options:
        options["target"] = case.position if case.output == "start_logits" else (case.position, case.target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(forward, model=case.model, capture=capture).attribute(
            case.inputs, additional_forward_args=case.args, query_index=case.position, **options
        )


IN_OUTPUT_UNITS = ("knockout_gradient", "knockout_lrp")
"""Methods whose scores are changes of the explained output, compared within :data:`REL` of
it where every token's is 0 (a layer of one reduced key, whose knockout changes nothing,
leaves float32 noise of 1e-9), as AttnLRP's relevances are."""

SINGLE_STACK = "is defined for one self-attention stack"
"""The ValueError of a method without encoder-decoders (KnockoutGradient) on one: a refusal."""

EAGER_ONLY = "load it with attn_implementation='eager'"
"""The refusal of a model whose maps come only from its eager path: the sweep then
builds it eager, as the message asks, and checks that."""


def outcomes(architecture: Architecture, methods: list[str]) -> dict[str, Outcome]:
    """Each method's :class:`Outcome` on ``architecture`` as transformers builds it; where
    that is refused with :data:`EAGER_ONLY`, on the model built eager (the outcome's
    detail says so)."""
    found = _outcomes(architecture, methods)
    if not any(o.status == "refused" and EAGER_ONLY in o.detail for o in found.values()):
        return found
    eager = _outcomes(architecture, methods, "eager")
    return {m: loaded_eager(o) for m, o in eager.items()}


def loaded_eager(outcome: Outcome) -> Outcome:
    """``outcome`` of the model built eager, as its detail then says."""
    return Outcome(outcome.status, f"when loaded with attn_implementation='eager'; {outcome.detail}".rstrip("; "))


def _outcomes(architecture: Architecture, methods: list[str], implementation: str | None = None) -> dict[str, Outcome]:
    try:
        case = runs(make_case(build(architecture, implementation=implementation), architecture))
    except NotBuilt as error:
        return {method: Outcome("not built", str(error)) for method in methods}
    if architecture.head == "seq2seq LM" and not case.encoder_decoder:  # a speech model's language model
        return {method: Outcome("not built", "not an encoder-decoder: its text model is a causal LM") for method in methods}
    found: dict[str, Outcome] = {}
    expected: Callable[[str], Any] | Exception | None = None
    for method in methods:
        try:
            scores = explain(case, method)
        except (UnsupportedModelError, ValueError) as error:
            message = str(error).strip()
            refused = isinstance(error, UnsupportedModelError) or SINGLE_STACK in message
            found[method] = Outcome("refused" if refused and "\n" not in message else "error", message)
            continue
        except Exception as error:  # noqa: BLE001 - the defect the sweep reports
            found[method] = Outcome("error", _one_line(error))
            continue
        if method == "attn_lrp" or method in CHECKED_BY_THEMSELVES:
            try:
                same = _close(scores, explain(case, method, "eager"), floor=explained_output(case) if method == "attn_lrp" else 1e-30)
            except Exception as error:  # noqa: BLE001 - the defect the sweep reports, unless transformers' eager path fails
                try:
                    eager_output(case)
                    found[method] = Outcome("error", f"eager: {_one_line(error)}")
                except NotBuilt as failure:
                    found[method] = Outcome("not built", f"eager: {failure}")
                continue
            found[method] = Outcome("exact") if same else Outcome("wrong", "streaming differs from eager")
            continue
        if expected is None:
            try:
                expected = reference(case)
            except (NotBuilt, NoReference) as error:
                expected = error
            except Exception as error:  # noqa: BLE001 - outputs the reference cannot read
                expected = NoReference(_one_line(error))
        if isinstance(expected, NotBuilt):
            found[method] = Outcome("not built", str(expected))
        elif isinstance(expected, Exception):
            found[method] = Outcome("wrong", f"scores given where there is no reference ({expected})")
        else:
            try:
                close = _close(scores, expected(method), floor=explained_output(case) if method in IN_OUTPUT_UNITS else 1e-30)
            except NoReference as error:
                found[method] = Outcome("wrong", f"scores given where there is no reference ({error})")
                continue
            found[method] = Outcome("exact") if close else Outcome("wrong", "scores off the reference")
    return found


def refusal_outcome(error: Exception, built_eager: Callable[[], Outcome] | None) -> Outcome:
    """``refused`` for a one-line error, else ``error``; where it asks for the eager model
    and ``built_eager`` is given, that check on the model built eager."""
    message = str(error).strip()
    if EAGER_ONLY in message and built_eager is not None:
        return loaded_eager(built_eager())
    return Outcome("refused" if "\n" not in message else "error", message)


def shares_outcome(architecture: Architecture, implementation: str | None = None) -> Outcome:
    """:func:`~captum_attention.metrics.attention_shares` of a causal LM's prompt and a
    one-token answer, each prompt token its own segment but the first (never removed):
    ``exact`` where it equals, per token j, the largest A_ij of the eager twin's maps of
    the prompt and answer over every layer, head and row i ≠ j; refused in one line; or an
    error. Where the call asks for the eager model, on the model built eager. An
    image-text-to-text model's prompt is read with its image inputs, the image's tokens
    and markers of no segment (0), its answer typed as ``generate`` types it."""
    from captum_attention.capture.adapters.images import image_marker_ids, marked_image_positions
    from captum_attention.metrics import attention_shares

    try:
        case = runs(make_case(build(architecture, implementation=implementation), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    if case.encoder_decoder:  # Florence-2
        return Outcome("not built", ENCODER_DECODER_IMAGES)
    prompt = case.inputs
    assert isinstance(prompt, torch.Tensor)
    answer = torch.full((prompt.shape[0], 1), LM_TARGET)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shares = attention_shares(case.model, prompt, torch.ones_like(prompt), answer, image_inputs=case.images)
    except (UnsupportedModelError, ValueError) as error:
        return refusal_outcome(error, None if implementation else lambda: shares_outcome(architecture, "eager"))
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    full = torch.cat([prompt, answer], dim=1)
    tokens = prompt.shape[1]
    images = None if case.images is None else _example_images(case, full, architecture)
    if images is not None and architecture.model_type in GENERATED_TOKEN_TYPES:
        images["token_type_ids"][:, tokens:] = GENERATED_TOKEN_TYPES[architecture.model_type]
    answered = Case(case.model, architecture, full, None if images is None else (torch.ones_like(full), images), LM_TARGET, images)
    try:  # the model's own forward, as an unpadded prompt is explained (RoBERTa's positions counted from the ids)
        maps = [a for a in eager_output(answered).attentions]
    except NotBuilt as error:
        return Outcome("not built", f"eager: {error}")
    leading = maps[0].shape[-1] - full.shape[1] if maps and leading_image_features(case.model) else 0  # GIT's image features
    maps = [a[..., leading:, leading:] for a in maps]  # their rows never attend to the tokens
    if not maps or not all(isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[-1] == full.shape[1] for a in maps):
        return Outcome("wrong", "shares given where the eager twin returns no maps of the tokens")
    others = ~torch.eye(full.shape[1], dtype=torch.bool)[:, :tokens]  # row i, key j < tokens: i ≠ j
    expected = torch.stack([a.detach().float()[..., :tokens].masked_fill(~others, 0.0).amax(dim=(1, 2)) for a in maps]).amax(dim=0)
    expected[:, 0] = 0.0
    if images is not None:  # the image's tokens and markers, or the positions a mask gives its features (Kosmos-2's)
        marked = marked_image_positions(case.images, prompt.shape)
        image = torch.isin(prompt, torch.tensor(image_marker_ids(case.model.config)))
        expected = expected.masked_fill(image if marked is None else image | marked, 0.0)
    return Outcome("exact") if _close(shares, expected) else Outcome("wrong", "shares off the eager twin's maps")


def left_padding_outcome(architecture: Architecture, implementation: str | None = None) -> Outcome:
    """Grad-SAM on a causal LM's batch of two prompts, the second left-padded by two
    columns: ``exact`` where its real tokens' scores equal the prompt's alone and unpadded
    (and the first prompt's its own alone), refused in one line, ``not built`` (the model
    itself fails on the padded batch), or else wrong or an error. Where the call asks for the eager model, on the model built eager."""
    try:
        case = runs(make_case(build(architecture, implementation=implementation), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    ids = case.inputs
    assert isinstance(ids, torch.Tensor)
    if "attention_mask" not in inspect.signature(case.model.forward).parameters:
        return Outcome("not built", "its forward takes no attention mask")
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    padded = ids.masked_fill(mask == 0, 0)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            case.model(input_ids=padded, attention_mask=mask)
    except Exception as error:  # noqa: BLE001 - the model itself fails on a mask with zeros
        return Outcome("not built", f"the model itself fails on a left-padded mask: {_one_line(error)}")
    explainer = REGISTRY["grad_sam"](case.model)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            together = explainer.attribute(padded, target=case.target, additional_forward_args=(mask,))
            alone = [explainer.attribute(padded[b : b + 1, mask[b] != 0], target=case.target) for b in range(2)]
    except (UnsupportedModelError, ValueError) as error:
        return refusal_outcome(error, None if implementation else lambda: left_padding_outcome(architecture, "eager"))
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    rows = [together[b : b + 1, mask[b] != 0] for b in range(2)]
    return Outcome("exact") if all(_close(r, a) for r, a in zip(rows, alone)) else Outcome("wrong", "off each prompt alone")


def vision_language_left_padding_outcome(architecture: Architecture) -> Outcome:
    """Grad-SAM on an image-text-to-text model's batch of two examples with the same image,
    the first prompt two text tokens shorter and left-padded by two columns: ``exact``
    where each example's real tokens score as that prompt and image alone, unpadded,
    refused in one line, ``not built`` (the sweep's image inputs, or the model itself on the
    padded batch, or its own logits off each example's alone: HunYuan-VL's second example,
    padded or not), or else wrong or an error."""
    try:
        case = runs(make_case(build(architecture), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    if case.encoder_decoder:  # Florence-2
        return Outcome("not built", ENCODER_DECODER_IMAGES)
    short = case.inputs
    assert isinstance(short, torch.Tensor) and case.images is not None
    long = torch.cat([short, torch.tensor([[8, 9]])], dim=1)
    ids = torch.cat([torch.cat([torch.zeros_like(short[:, :2]), short], dim=1), long])
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    rows = [_example_images(case, short, architecture), _example_images(case, long, architecture)]
    batch = _batched_images(rows, ids.shape[1])
    explainer = REGISTRY["grad_sam"](case.model)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            together_logits = case.model(input_ids=ids, attention_mask=mask, **batch).logits[:, -1]
            alone_logits = [case.model(input_ids=i, attention_mask=torch.ones_like(i), **r).logits[:, -1] for i, r in zip((short, long), rows)]
    except Exception as error:  # noqa: BLE001 - the model itself fails on a left-padded batch
        return Outcome("not built", f"the model itself fails on a left-padded batch: {_one_line(error)}")
    if not _close(together_logits, torch.cat(alone_logits)):  # the model's own batch differs: nothing to match
        return Outcome("not built", "the model itself gives the batch's examples other logits than each alone")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            together = explainer.attribute(ids, target=case.target, additional_forward_args=(mask, batch))
            alone = [
                explainer.attribute(row_ids, target=case.target, additional_forward_args=(torch.ones_like(row_ids), images))
                for row_ids, images in zip((short, long), rows)
            ]
    except (UnsupportedModelError, ValueError) as error:
        return refusal_outcome(error, None)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    parts = together if isinstance(together, tuple) else (together,)  # Mllama's: the image's, the tokens'

    def example_part(part: torch.Tensor, b: int) -> torch.Tensor:
        return part[b : b + 1, mask[b] != 0] if part.shape[1] == ids.shape[1] else part[b : b + 1]

    padded_rows = [tuple(example_part(part, b) for part in parts) for b in range(2)]
    alone_rows = [a if isinstance(a, tuple) else (a,) for a in alone]
    return Outcome("exact") if all(_close(r, a) for r, a in zip(padded_rows, alone_rows)) else Outcome("wrong", "off each example alone")


def ablation_outcome(architecture: Architecture) -> Outcome:
    """The context metrics' ablations of a causal LM's prompt (an encoder-decoder's source),
    or an image-text-to-text model's with its image inputs given (:func:`~captum_attention.metrics.ablated_log_probs`):
    the whole prompt, then two of its last three tokens deleted, then the third, in one
    left-padded batch. ``exact`` where each equals the answer's log-probability after the
    prompt with those tokens deleted, run alone (its per-token image inputs those of the
    kept tokens), refused in one line, ``not built`` (the sweep's inputs, or the model
    itself on the shortened prompt), else wrong or an error."""
    from captum_attention.metrics import ablated_log_probs
    from captum_attention.metrics.context import answer_log_probs

    try:
        case = runs(make_case(build(architecture), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    source = case.inputs[0] if case.encoder_decoder else case.inputs  # an encoder-decoder's answer: from its source
    assert isinstance(source, torch.Tensor)
    if case.encoder_decoder and getattr(case.model.generation_config, "decoder_start_token_id", None) is None:
        case.model.generation_config.decoder_start_token_id = case.model.config.pad_token_id  # T5's checkpoints start from padding
    ids, images = source[:1], case.images
    answer = torch.tensor([[8, 9]])
    kept = torch.ones(1, 3, ids.shape[1], dtype=torch.bool)
    kept[0, 1, -3:-1] = False  # the image-text prompt's text tokens 5 and 6
    kept[0, 2, -1] = False  # its text token 7

    def alone(tokens: torch.Tensor) -> torch.Tensor:
        cut = None if images is None else {
            name: value[:, tokens] if value.dim() >= 2 and value.shape[1] == ids.shape[1] else value for name, value in images.items()
        }
        return answer_log_probs(case.model, ids[:, tokens], torch.ones_like(ids[:, tokens]), answer, cut)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = torch.cat([alone(kept[0, a]) for a in range(kept.shape[1])])
    except Exception as error:  # noqa: BLE001 - the model itself fails on the shortened prompt
        return Outcome("not built", f"the model itself fails on a shortened prompt: {_one_line(error)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = ablated_log_probs(case.model, ids, torch.ones_like(ids), answer, kept, image_inputs=images)[0]
    except ValueError as error:  # UnsupportedModelError among them
        message = str(error).strip()
        return Outcome("refused" if "\n" not in message else "error", message)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    if not bool(torch.isfinite(values).all()) or not torch.allclose(values.float(), expected.float(), atol=1e-4):
        return Outcome("wrong", f"{values.tolist()} against each alone {expected.tolist()}")
    return Outcome("exact")


def image_relevance_outcome(architecture: Architecture) -> Outcome:
    """AttnLRP of an image-text-to-text model's case: ``exact`` where the image's tokens
    (the config's image token, or the positions an image input marks; an encoder-decoder's
    among its source's; the states a cross-attending model reads) hold relevance, ``not built`` where the image does not move the
    logits (its tiny projection zero at initialisation: no relevance to hold), refused in
    one line, else ``wrong`` (the image moves the logits and its tokens score 0: relevance
    read where the image's features do not reach) or an error."""
    from captum_attention.capture.adapters.images import image_token_id, marked_image_positions

    try:
        case = runs(make_case(build(architecture), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    assert case.images is not None
    tower_input = next((name for name in ("pixel_values", "flattened_patches") if name in case.images), None)
    if tower_input is None:
        return Outcome("not built", "the case gives no pixels to move")
    moved = {**case.images, tower_input: case.images[tower_input] + 1.0}
    ids = case.inputs[0] if case.encoder_decoder else case.inputs
    keywords = {"decoder_input_ids": case.inputs[1]} if case.encoder_decoder else {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        difference = (case.model(input_ids=ids, **keywords, **case.images).logits
                      - case.model(input_ids=ids, **keywords, **moved).logits).abs().max()
    if float(difference) < 1e-6:
        return Outcome("not built", "the image does not move the tiny model's logits")
    try:
        scores = explain(case, "attn_lrp")
    except (UnsupportedModelError, ValueError) as error:
        message = str(error).strip()
        return Outcome("refused" if "\n" not in message else "error", message)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    if image_read_apart(case.model):  # Mllama, BLIP, GIT: the image's states (features) are the first of the pair
        held = scores[0]
    else:
        tokens = scores[0] if isinstance(scores, tuple) else scores
        token = image_token_id(case.model.config)
        image = torch.zeros_like(ids, dtype=torch.bool) if token is None else ids == token
        marked = marked_image_positions(case.images, ids.shape)
        image = image if marked is None else image | marked
        if not bool(image.any()):
            return Outcome("not built", "no image token in the case's prompt")
        held = tokens[..., : ids.shape[1]][image]
    if float(held.abs().sum()) == 0.0:
        return Outcome("wrong", f"the image moves the logits by {float(difference):.2g}, and its tokens score 0")
    return Outcome("exact")


def _example_images(case: Case, ids: torch.Tensor, architecture: Architecture) -> dict[str, torch.Tensor]:
    """The sweep's image inputs for the prompt ``ids`` (its token types; Mllama's
    cross-attention mask, each later token seeing the image)."""
    from captum_attention.capture.adapters.images import image_token_id

    assert case.images is not None
    images = dict(case.images)
    token = image_token_id(case.model.config)
    if "mm_token_type_ids" in images:
        images["mm_token_type_ids"] = (ids == token).long()
    if "token_type_ids" in images:
        images["token_type_ids"] = PREFIX_TOKEN_TYPES[architecture.model_type](ids, token)
    if architecture.model_type in POSITION_MASKED:
        images[POSITION_MASKED[architecture.model_type]] = (ids == VOCAB - 1).long()
    if "cross_attention_mask" in images:
        cross = images["cross_attention_mask"]
        images["cross_attention_mask"] = torch.cat([cross, cross[:, -1:].expand(-1, ids.shape[1] - cross.shape[1], -1, -1)], dim=1)
    return images


def _batched_images(rows: list[dict[str, torch.Tensor]], width: int) -> dict[str, torch.Tensor]:
    """The examples' image inputs as one batch ``width`` tokens wide: per-token inputs
    left-padded with zeros, flattened patches and their grids (Qwen2-VL's) one image after
    the other, the rest stacked on the batch's axis."""
    batch = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if name in ("mm_token_type_ids", "token_type_ids", "cross_attention_mask", "image_embeds_position_mask"):
            values = [torch.cat([v.new_zeros((1, width - v.shape[1], *v.shape[2:])), v], dim=1) for v in values]
        batch[name] = torch.cat(values)
    return batch


REPORT_WORDS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]", ".", *"where did ada live lived in london".split()]
"""The report sweep's WordPiece vocabulary: its [CLS] and [SEP] the tiny configs' start
and end ids (1 and 2), which Longformer's answerer counts."""

REPORT_TEXTS = ("ada lived in london .", " ".join(["ada lived in london ."] * 16))
"""A text within the tiny models' 64 positions, and one of 82 tokens: read in windows."""


def report_outcome(architecture: Architecture) -> Outcome:
    """How ``explain``'s report of a logit read at a token (a question answerer's answer, a
    token classifier's labels, a masked language model's masks) fares on the tiny model with
    a WordPiece tokenizer that names no padding token and gives no token types, on a short
    text and one read in windows: "runs" where both run (their scores are the methods'
    own, which the position sweep checks), "refused" in one line, "not built" where the
    model itself fails on the tokenizer's inputs, else "error"."""
    from captum_attention.presentation.question_answering import explain_question
    from captum_attention.presentation.token_class import explain_masks, explain_token_labels

    try:
        model = build(architecture)
    except NotBuilt as error:
        return Outcome("not built", str(error))
    tokenizer = report_tokenizer()
    question = ("where did ada live",) if architecture.head == "question answering" else ()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(**tokenizer(*question, REPORT_TEXTS[0], return_tensors="pt"))
    except Exception as error:  # noqa: BLE001 - whatever stops the model itself
        return Outcome("not built", f"the model itself fails: {_one_line(error)}")
    for text in REPORT_TEXTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if question:
                    explain_question(model, tokenizer, *question, text, None, ["raw", "attn_lrp"])
                elif architecture.head == "token classification":
                    explain_token_labels(model, tokenizer, text, None, ["raw", "attn_lrp"])
                else:
                    explain_masks(model, tokenizer, text.replace("london", "[MASK]"), None, ["raw", "attn_lrp"])
        except (ValueError, UnsupportedModelError) as error:
            message = str(error).strip()
            return Outcome("refused" if "\n" not in message else "error", message)
        except Exception as error:  # noqa: BLE001 - anything else is a defect
            return Outcome("error", f"{type(error).__name__}: {_one_line(error)}")
    return Outcome("runs")


def report_tokenizer() -> Any:
    """The report sweep's tokenizer (:data:`REPORT_WORDS`): no padding token, no token types."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        vocab = Path(folder) / "vocab.txt"
        vocab.write_text("\n".join(REPORT_WORDS) + "\n")
        tokenizer = tf.BertTokenizerFast(vocab=str(vocab), model_input_names=["input_ids", "attention_mask"])
    tokenizer.pad_token = None
    return tokenizer


def removal_outcome(architecture: Architecture) -> Outcome:
    """ERASER comprehensiveness of a sequence classifier given as it is, on a batch whose
    deletions leave one row shorter (padded) than the other, the last token (an end of
    sequence that BART-like classifiers read) kept: ``exact`` where it equals each example
    alone and unpadded (where the padding moves the model's output, its deletions batched by
    length), refused in one line, ``not built`` where the model cannot run on token ids and a
    mask alone, or on an example with tokens deleted, else an error or wrong."""
    from captum_attention.metrics import comprehensiveness

    try:
        case = runs(make_case(build(architecture), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    ids = case.inputs[0] if isinstance(case.inputs, tuple) else case.inputs
    assert isinstance(ids, torch.Tensor)
    mask = torch.ones_like(ids)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, -1] = True
    keep[0, :2] = True  # 5 removable tokens against 7: the rows keep 5 and 4
    scores = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))

    def forward(row_ids: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
        return case.model(input_ids=row_ids, attention_mask=row_mask).logits

    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            forward(ids, mask)
    except Exception as error:  # noqa: BLE001 - the model itself takes more than ids and a mask
        return Outcome("not built", f"the model itself fails on ids and a mask: {_one_line(error)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = comprehensiveness_alone(forward, ids, mask, scores, keep, 0.5, TEXT_TARGET)
    except Exception as error:  # noqa: BLE001 - the model itself fails on a shortened example (Funnel's pooling)
        return Outcome("not built", f"the model itself fails on an example with tokens deleted: {_one_line(error)}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            drops = comprehensiveness(case.model, ids, mask, scores, target=TEXT_TARGET, bins=(50,), keep=keep)[:, 0]
    except ValueError as error:
        message = str(error).strip()
        return Outcome("refused" if "\n" not in message else "error", message)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    return Outcome("exact") if torch.allclose(drops, expected, atol=1e-5) else Outcome("wrong", "off each example alone")


def two_stack_report_outcome(architecture: Architecture) -> Outcome:
    """``explain``'s methods (:func:`~captum_attention.presentation.explain.report_methods`,
    Integrated Gradients included) on a sequence classifier whose decoder reads the text
    again (BART's): ``exact`` where a text padded on the right in a batch scores as alone
    (the scores themselves are each method's own, which the tests of
    ``classifier_decoder_ids`` and ``text_scores`` check), refused in one line, ``not
    built`` where the model itself fails on the texts or moves its output with the padding
    (``explain`` then pads on the other side or one text at a time), else an error or
    wrong. Not swept: the classifiers of one stack."""
    from captum_attention.presentation.explain import report_methods

    try:
        model = build(architecture)
    except NotBuilt as error:
        return Outcome("not built", str(error))
    if not reads_decoder_ids(model):
        return Outcome("not built", "a classifier of one stack")
    config = model.config
    eos, pad = config.eos_token_id, config.pad_token_id if config.pad_token_id is not None else 0
    lengths = torch.tensor([[7], [5]])
    mask = (torch.arange(7) < lengths).long()
    ids = torch.randint(5, 40, mask.shape, generator=torch.Generator().manual_seed(0))
    ids[torch.arange(2), lengths[:, 0] - 1] = eos
    ids = ids.masked_fill(mask == 0, pad)
    alone = (ids[1:, :5], mask[1:, :5])
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            padded_logits, alone_logits = model(input_ids=ids, attention_mask=mask).logits[1], model(input_ids=alone[0], attention_mask=alone[1]).logits[0]
    except Exception as error:  # noqa: BLE001 - whatever stops the model itself
        return Outcome("not built", f"the model itself fails: {_one_line(error)}")
    if not torch.allclose(padded_logits, alone_logits, atol=1e-5):
        return Outcome("not built", "the model's own output moves with padding on the right")
    targets = torch.tensor([0, 1])
    baseline = lambda text: torch.where(text == eos, text, torch.full_like(text, pad))  # noqa: E731 - the end kept, as explain's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            methods = report_methods(model, 8, [*REGISTERED, "integrated_gradients"])
            off = {}
            for name, method in methods.items():
                batched = method.run(ids, mask, targets, baseline(ids))
                single = method.run(*alone, targets[1:], baseline(alone[0]))
                if not _close(batched[1:, :5], single):
                    off[name] = float((batched[1:, :5] - single).abs().max())
    except ValueError as error:
        message = str(error).strip()
        return Outcome("refused" if "\n" not in message else "error", message)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    return Outcome("wrong", f"padded off alone: {off}") if off else Outcome("exact")


def decomposition_outcome(architecture: Architecture, multiply_by_inputs: bool = True) -> Outcome:
    """DecompX on ``architecture``: ``exact`` where its shares add up to the explained
    logit (the call checks it, else refuses; ``multiply_by_inputs=False``: the shares read
    from its sensitivity's backward), refused in one line, or an error. A speech model's
    language model is not built, as in :func:`outcomes`."""
    from captum_attention import DecompX

    try:
        case = runs(make_case(build(architecture), architecture))
    except NotBuilt as error:
        return Outcome("not built", str(error))
    if architecture.head == "seq2seq LM" and not case.encoder_decoder:
        return Outcome("not built", "not an encoder-decoder: its text model is a causal LM")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            explainer = DecompX(case.model, multiply_by_inputs=multiply_by_inputs)
            explainer.attribute(case.inputs, target=case.target, additional_forward_args=case.args)
    except (UnsupportedModelError, ValueError) as error:  # ValueError: an encoder-decoder, refused by every single-stack method
        message = str(error).strip()
        return Outcome("refused" if "\n" not in message else "error", message)
    except Exception as error:  # noqa: BLE001 - the defect the sweep reports
        return Outcome("error", _one_line(error))
    return Outcome("exact")


def support_rst(results: dict[Architecture, dict[str, Outcome]], command: str) -> str:
    """The support table of ``docs/support.rst``: per head, each architecture's outcome per
    method, and the first reason given."""
    methods = list(next(iter(results.values())))
    lines = [
        "Supported architectures", "=======================", "",
        "Every architecture transformers registers for five task heads, built tiny from its",
        "own config class and explained by every registered method (``tests/zoo.py``; a",
        "sequence-to-sequence LM at its last target position: its answers' spans and rows",
        "are checked in ``tests/test_seq2seq_answers.py``; an image-text-to-text model at its",
        "last position, with one image of its vision tower's size (as flattened patches with",
        "their grid for Qwen2-VL's kind, with their positions for Gemma 4's and SigLIP2's native",
        "sizes, with one tile for LLaVA-NeXT's, with the processor's token types for prefix LMs,",
        "as one real tile of a tiled image with its mask or cross-attention mask for Idefics 3's",
        "kind and Mllama); their spans, rows and grids, two images of different sizes",
        "and left padding are checked in ``tests/test_vlm_answers.py``):",
        "**exact** equals the ``output_attentions`` + ``autograd`` reference (Swin's windows:",
        "each window attention run through the model's own partition; SegFormer's and PVTv2's",
        "reduced keys: spread by one-hot assignments; both on the first stage's patches;",
        "AttnLRP: streaming equals eager, which says nothing where only eager runs: no sdpa,",
        "windows or reduced keys; AttnLRP's references written from the weights are in",
        "``tests/test_attn_lrp.py`` and, for those grids, ``tests/test_grids.py``); **refused** names",
        "its reason in one line; **not built**: transformers itself cannot build or run the tiny",
        "model here, or the sweep cannot make the inputs its images need (the reason says which);",
        "**error** and **wrong** are defects still open. Generated by::", "",
        f"    {command}", "",
        f"with transformers {tf.__version__} (``pytest -m zoo`` sweeps the version installed).", "",
    ]
    for head in HEADS:
        rows = [(a, found) for a, found in results.items() if a.head == head]
        if not rows:
            continue
        counts = {status: sum(o.status == status for _, f in rows for o in f.values()) for status in STATUSES}
        title = head[0].upper() + head[1:]
        lines += [title, "-" * len(title), "", ", ".join(f"{n} {s}" for s, n in counts.items() if n) + " (architecture × method).", ""]
        lines += [".. list-table::", "   :header-rows: 1", "", "   * - model type"]
        lines += [f"     - {m}" for m in methods] + ["     - reason"]
        for architecture, found in rows:
            detail = next((o.detail for o in found.values() if o.detail), "")
            lines += [f"   * - ``{architecture.model_type}``"]
            lines += [f"     - {found[m].status}" for m in methods]
            lines += [f"     - {_rst_text(detail[:200])}"]
        lines.append("")
    return "\n".join(lines)


STATUSES = ("exact", "refused", "not built", "error", "wrong")


def _rst_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("`", "'").replace("*", "\\*").replace("|", "\\|") or "—"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", default=list(HEADS))
    parser.add_argument("--methods", nargs="+", default=list(REGISTERED))
    parser.add_argument("--only", nargs="+", help="model types")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("--rst", type=Path, help="write the support table here (docs/support.rst)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="the table from earlier --json runs, no sweep")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[Architecture, dict[str, Outcome]] = {}
    for saved in options.from_json or []:
        for row in json.loads(saved.read_text()):
            results[Architecture(*row["architecture"])] = {m: Outcome(*o) for m, o in row["outcomes"].items()}
    for head in [] if options.from_json else options.heads:
        for architecture in architectures(head):
            if options.only and architecture.model_type not in options.only:
                continue
            found = results[architecture] = outcomes(architecture, options.methods)
            details = sorted({o.detail[:160] for o in found.values() if o.detail})
            print(f"{architecture.name}: " + " ".join(f"{m}={o.status}" for m, o in found.items())
                  + "".join(f"\n    {d}" for d in details), flush=True)
            if options.json:
                rows = [{"architecture": [a.model_type, a.class_name, a.head],
                         "outcomes": {m: [o.status, o.detail] for m, o in f.items()}} for a, f in results.items()]
                options.json.write_text(json.dumps(rows, indent=1))
    if options.rst:
        command = "python tests/zoo.py --json <heads>.json; python tests/zoo.py --from-json <heads>.json ... --rst docs/support.rst"
        options.rst.write_text(support_rst(results, command))


if __name__ == "__main__":
    main()
