"""The adapter of Hugging Face ``transformers`` models."""

from __future__ import annotations

import contextvars
import inspect
import threading
import weakref
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch
from torch import Tensor, nn

from ..._compat import (
    StreamingUnsupported,
    attn_implementation,
    called_transformers_model,
    error_line,
    forward_hooks,
    hooked_modules,
    implementation_owner,
    model_configs,
    recorder_specs,
    runnable_implementation,
    transformers_models,
)
from ...maps import dense_weight
from ..guard import ClampedSoftmax, SharedPatch, every_forward
from .protocol import (
    AdapterBase, AttentionNotFoundError, AttentionSite, RelevanceSites, Role, UnsupportedModelError, bound_argument, extended_per_token, per_token,
    parent_module,
)
from .grids import grid_sites, note_grid_calls, on_grids, on_patch_grid, window_layers
from .images import CROSS_ATTENDED, ENCODED_IMAGES, TOWER_INPUTS, cross_attended_real, image_encoder_config, language_model_of



_NGRAM_STREAMS = (
    "its output comes from n-gram prediction streams, and the maps it returns are those of "
    "its main stream, which do not reach the output"
)
OUT_OF_SCOPE = {
    "prophetnet": _NGRAM_STREAMS,
    "xlm-prophetnet": _NGRAM_STREAMS,
    "minimax": "its lightning (linear) attention layers have no softmax attention maps",
    "t5gemma2": (
        "its decoder attends to its own tokens and the encoder's in one merged attention call, "
        "which the encoder-decoder rules (self- and cross-attention apart) cannot split"
    ),
}
"""Model types whose recorded maps are not the attention that computes their output, by
``config.model_type``, with the reason the refusal gives."""

OUT_OF_SCOPE_CLASSES = {
    "BlipForQuestionAnswering": (
        "its answer decoder cross-attends to a question encoder that itself cross-attends to the image, a chain "
        "of stacks the methods' rules do not follow, and its forward returns no answer logits (BLIP's captioner, "
        "BlipForConditionalGeneration, is covered)"
    ),
    "BlipForImageTextRetrieval": (
        "its text encoder cross-attends to the image's states in every layer, and its matching score reads that "
        "encoder's first token, a pair of stacks the methods' rules do not follow (BLIP's captioner, "
        "BlipForConditionalGeneration, is covered; for the image alone, pass its vision_model as the model)"
    ),
}
"""Model classes of a covered model type that are not covered, by class name, with the
reason the refusal gives (for the model or any model it holds)."""

AUDIO_INPUTS = ("input_features", "input_values")
"""The main inputs of audio models (Whisper's log-mel features, wav2vec 2.0's waveform),
which are not covered: no token stands for the frames their convolutions make."""

_MEAN_POOLING_CLASSIFIERS = {
    "ImageGPTForImageClassification": 0, "IJepaForImageClassification": 0, "SiglipForImageClassification": 0,
    "Siglip2ForImageClassification": 0, "SegformerForImageClassification": 0, "PvtV2ForImageClassification": 0,
    "CLIPForImageClassification": 1, "MetaClip2ForImageClassification": 1,
}
"""Classifiers that read the mean of their tokens from the given one on (after CLIP's class
token), where no config flag says so."""

def _mean_pooled_from(model: nn.Module) -> int | None:
    """Where a classifier reads the mean of its tokens, the first token of that mean:
    shifted-window classifiers (Swin, the last stage's tokens; not an encoder-decoder with
    a window encoder, Donut, whose decoder's rows are read), :data:`_MEAN_POOLING_CLASSIFIERS`,
    ``use_mean_pooling`` image and video classifiers (BEiT and Data2Vec-Vision after their
    class token, VideoMAE) and text classifiers whose ``classifier_pooling`` averages the
    tokens or their logits (ModernBERT's ``"mean"``, EuroBERT's ``"mean"`` and ``"late"``);
    None for the others."""
    name = type(model).__name__
    if window_layers(model) and _encoder_of(model) is None:
        return 0
    if name in _MEAN_POOLING_CLASSIFIERS:
        return _MEAN_POOLING_CLASSIFIERS[name]
    config = getattr(model, "config", None)
    if getattr(config, "classifier_pooling", None) in ("mean", "late") and name.endswith("ForSequenceClassification"):
        return 0
    if getattr(config, "use_mean_pooling", False) and name.endswith(("ForImageClassification", "ForVideoClassification")):
        return int(any(n.split(".")[-1] == "cls_token" for n, _ in model.named_parameters()))
    return None


def check_called_with_ids(forward_func: Callable[..., Any]) -> None:
    """A one-line error for a sentence-transformers model as ``forward_func``: its forward
    takes a dict of features, not the ids and mask it would be called with."""
    if type(forward_func).__module__.startswith("sentence_transformers."):
        raise TypeError(
            f"A {type(forward_func).__name__}'s forward takes a dict of features: give forward_func a function of the "
            "ids and the mask that returns the score to explain (for an embedding, its similarity to a reference) "
            "and pass the transformers model inside as model=encoder[0].auto_model (docs/captum.rst, sentence "
            "embeddings)."
        )


class HuggingFaceAdapter(AdapterBase):
    """Adapter for Hugging Face ``transformers`` models: encoders (BERT, RoBERTa, ...),
    decoders (GPT-2, Llama, Qwen2, ...), encoder-decoders (T5, BART) and ViT/DeiT.

    Attention modules are the ones each model class declares itself in its
    ``_can_record_outputs`` (the declaration transformers uses for
    ``output_attentions=True``), matched inside that class's own sub-tree, so any
    architecture that supports ``output_attentions`` is found without a list of class
    names here. Under eager attention those modules return the probabilities at the
    declared output index; they are the tensor that weighted the values. Models loaded
    with ``sdpa``/flash attention run ``eager`` for an eager capture (and eager-loaded
    ones ``sdpa`` for a streaming one) in the capture's own thread only: the configs'
    ``_attn_implementation`` reads a context variable first while a capture holds it,
    so another thread's forward of the model meanwhile runs what the model was loaded
    with, and nothing on the model changes.

    The padding mask is the ``attention_mask`` argument of the outermost
    ``PreTrainedModel`` call (and ``decoder_attention_mask`` for encoder-decoders).
    In an encoder-decoder, self-attention inside ``model.get_encoder()`` has the role
    ``"encoder"``, other self-attention ``"decoder"``, and ``cross_attentions`` modules
    ``"cross"``.

    Args:
        kinds (sequence of str, optional): which ``_can_record_outputs`` entries to
            capture. Default: ``("attentions", "cross_attentions")``.
    """

    def __init__(self, kinds: Sequence[str] = ("attentions", "cross_attentions")) -> None:
        self.kinds = tuple(kinds)

    @staticmethod
    def _pretrained_models(model: nn.Module) -> list[nn.Module]:
        from transformers import PreTrainedModel

        return [m for m in model.modules() if isinstance(m, PreTrainedModel)]

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [site.module for site in self.attention_sites(model)]

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        reason = OUT_OF_SCOPE.get(str(getattr(getattr(model, "config", None), "model_type", "")))
        if reason is not None:
            raise UnsupportedModelError(f"{type(model).__name__} cannot be explained through attention maps: {reason}.")
        if getattr(model, "main_input_name", None) in AUDIO_INPUTS:
            raise UnsupportedModelError(
                f"{type(model).__name__} reads audio ({model.main_input_name}): audio models are not supported, no token "
                "stands for the frames its convolutions make."
            )
        held = next((inner for inner in self._pretrained_models(model) if type(inner).__name__ in OUT_OF_SCOPE_CLASSES), None)
        if held is not None:
            raise UnsupportedModelError(f"{type(held).__name__} cannot be explained: {OUT_OF_SCOPE_CLASSES[type(held).__name__]}.")
        _refuse_virtual_tokens(model)
        encoder = _encoder_of(model)
        if encoder is None:
            _refuse_a_held_encoder_decoder(model)
        encoder_modules = set(encoder.modules()) if encoder is not None else set()
        found: dict[nn.Module, AttentionSite] = {}
        declared: list[str] = []
        # Innermost declarations first: each model class describes its own sub-tree.
        for submodel in reversed(self._pretrained_models(model)):
            specs = recorder_specs(type(submodel), self.kinds)
            declared += [s.target_class.__name__ if s.target_class else str(s.class_name) for _, s in specs]
            for name, module in submodel.named_modules():
                match = next((kind_spec for kind_spec in specs if kind_spec[1].matches(name, module)), None)
                if match is None or module in found:
                    continue
                kind, spec = match
                role: Role = "cross" if kind == "cross_attentions" else "self"
                if role == "self" and encoder is not None:
                    role = "encoder" if module in encoder_modules else "decoder"
                found[module] = AttentionSite(module, role, self.is_causal(module), spec.index)
        probed = [(inner, inner) for inner in transformers_models(model)] if not found else [
            (inner, model) for inner in _undeclared_parts(model, encoder, found, self.kinds)
        ]
        returned = [returned_attention(inner, run) for inner, run in probed]
        for module, index, cross in (site for r in returned for site in r.sites):
            role = "cross" if cross else "encoder" if module in encoder_modules else "decoder" if encoder is not None else "self"
            found[module] = AttentionSite(module, role, self.is_causal(module), index)
        if not found:
            reason = "; ".join(r.reason for r in returned) or "it holds no transformers model"
            raise AttentionNotFoundError(
                f"No attention maps found in {type(model).__name__}: it declares no attention "
                f"modules in `_can_record_outputs` under {self.kinds} (declared: "
                f"{sorted(set(declared)) or 'none'}) and {reason}. If its attention "
                "lives elsewhere, name the modules: adapter=ModuleAdapter([...attention modules...])."
            )
        order = {module: index for index, module in enumerate(model.modules())}
        ordered = sorted(_language_model_sites(model, found), key=lambda site: order[site.module])
        return grid_sites(model, ordered, "encoder" if encoder is not None else "self")

    def as_heads(self, module: nn.Module, probs: Tensor) -> Tensor:
        """Probabilities as heads; a window or reduced-key attention's as maps over the
        first stage's patches (:mod:`.grids`)."""
        on_grid = on_patch_grid(module, probs, gradient=False)
        return super().as_heads(module, probs) if on_grid is None else on_grid

    def gradient_as_heads(self, module: nn.Module, grads: Tensor) -> Tensor:
        on_grid = on_patch_grid(module, grads, gradient=True)
        return super().as_heads(module, grads) if on_grid is None else on_grid

    def readout_rows(self, model: nn.Module, real: Tensor) -> Tensor | None:
        """Classifiers that read the mean of their tokens (:func:`_mean_pooled_from`), each
        real token from the first of the mean on weighing alike; DeiT's classifier with
        its teacher, the average of two heads on its class and distillation tokens, 1/2
        each; DINOv2's, a linear head on its class token beside its patches' mean (after
        the register tokens), 1/2 on the class token and 1/2 over the patches."""
        name = type(model).__name__
        first = _mean_pooled_from(model)
        rows = real.float()
        if first is not None:
            rows[:, :first] = 0
            return rows / rows.sum(dim=1, keepdim=True)
        if name == "DeiTForImageClassificationWithTeacher":
            rows[:, 2:] = 0
            return rows / 2
        if name in ("Dinov2ForImageClassification", "Dinov2WithRegistersForImageClassification"):
            start = 1 + int(getattr(model.config, "num_register_tokens", 0))
            patches = rows[:, start:] / rows[:, start:].sum(dim=1, keepdim=True)
            rows[:, 1:] = 0
            rows[:, start:] = patches
            return rows / 2
        return None

    def read_probs(self, site: AttentionSite, output: Any) -> Tensor | None:
        if not isinstance(output, (tuple, list)) or len(output) <= site.output_index:
            return None
        return output[site.output_index]

    def is_causal(self, module: nn.Module) -> bool | None:
        # transformers' attention modules carry it (T5's declared layer on its T5Attention)
        for inner in module.modules():
            causal = getattr(inner, "is_causal", None)
            if isinstance(causal, bool):
                return causal
        return None

    def is_encoder_decoder(self, model: nn.Module) -> bool:
        return reads_decoder_ids(model)

    def keyword_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        """A generating Hugging Face model (a causal LM or an encoder-decoder) called with
        Captum's positional arguments, by name.

        ``(inputs..., *additional_forward_args)`` map to ``(input_ids, attention_mask)`` for
        causal language models and to ``(input_ids, decoder_input_ids, attention_mask,
        decoder_attention_mask)`` for encoder-decoders, their classifiers included
        (``inputs_embeds`` /
        ``decoder_inputs_embeds`` for float inputs). A causal language model given a
        left-padded mask gets ``position_ids`` counted over the real tokens, as ``generate``
        does. Other Hugging Face models (classifiers, image models) get the arguments by the
        names of their forward's parameters in order, cache parameters left out (GPT-2's
        classifier takes its cache second; Captum's second argument is the
        mask), float embeddings in the place of ``input_ids`` as ``inputs_embeds``; a PEFT
        model is called as the model it wraps; other forward functions are returned as
        they are.
        """
        check_called_with_ids(forward_func)
        model = called_transformers_model(forward_func)
        if model is None:
            return forward_func
        called = cast(nn.Module, forward_func)
        encoder_decoder = self.is_encoder_decoder(model)
        if not (encoder_decoder or model.can_generate()):
            return _ByParameterName(called)
        return _KeywordForward(called, encoder_decoder)

    def named_forward(self, forward_func: Callable[..., Any]) -> Callable[..., Any]:
        """A Hugging Face model called as ``forward_func(input_ids, attention_mask)`` with
        those two by name, whatever the model's parameters in between (GPT-2's cache, X-MOD's
        language ids, RoCBert's shape ids) and whatever it is (an encoder-decoder
        classifier's mask stays its mask, where :meth:`keyword_forward` gives Captum's second
        input, the decoder's ids), a PEFT model as the model it wraps; other forward
        functions as they are."""
        check_called_with_ids(forward_func)
        return forward_func if called_transformers_model(forward_func) is None else _IdsAndMask(cast(nn.Module, forward_func))

    def patch_grid(self, model: nn.Module, images: Tensor) -> tuple[int, int] | None:
        """``patch_size`` of the config (CLIP, SigLIP: of its image tower); SegFormer's first
        overlapping patch embedding, a convolution of stride ``strides[0]`` padded by half its
        kernel, gives ``ceil(side / stride)`` patches."""
        config = getattr(model, "config", None)
        strides = getattr(config, "strides", None)
        if isinstance(strides, (list, tuple)) and isinstance(getattr(config, "patch_sizes", None), (list, tuple)):
            return -(-images.shape[-2] // strides[0]), -(-images.shape[-1] // strides[0])
        patch = next((getattr(c, "patch_size", None) for c in (image_encoder_config(config), config)
                      if getattr(c, "patch_size", None) is not None), None)
        if patch is None:
            return None
        rows, columns = (patch, patch) if isinstance(patch, int) else tuple(patch)
        return images.shape[-2] // rows, images.shape[-1] // columns

    def mask_modules(self, model: nn.Module) -> list[nn.Module]:
        return self._pretrained_models(model)

    def image_tower_apart(self, model: nn.Module) -> str | None:
        """The first of :func:`_image_models`, by its name in ``model``."""
        towers = set(_image_models(model))
        return next((name for name, module in model.named_modules() if module in towers), None)

    def padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """The ``attention_mask`` of the outermost call; a model whose tokens are flattened
        patches at their images' native sizes (SigLIP2's classifier), taking none, marks
        its real patches in ``pixel_attention_mask``."""
        parameters = inspect.signature(module.forward).parameters
        if "attention_mask" not in parameters and {"pixel_attention_mask", "spatial_shapes"} <= set(parameters):
            return bound_argument(module.forward, "pixel_attention_mask", args, kwargs)
        return bound_argument(module.forward, "attention_mask", args, kwargs)

    def decoder_padding_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        return bound_argument(module.forward, "decoder_attention_mask", args, kwargs)

    def cross_attended_mask(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """Mllama's: its images' real tiles (:func:`.images.cross_attended_real`), from the
        ``aspect_ratio_ids`` and ``aspect_ratio_mask`` it is called with."""
        config = getattr(module, "config", None)
        if getattr(config, "model_type", None) not in CROSS_ATTENDED:
            return None
        names = ("aspect_ratio_ids", "aspect_ratio_mask")
        image_inputs = {name: bound_argument(module.forward, name, args, kwargs) for name in names}
        if any(value is None for value in image_inputs.values()):
            return None  # a text-only call: no cross-attention runs
        return cross_attended_real(config, image_inputs)

    streams = True
    propagates_relevance = True

    def output_projection(self, model: nn.Module, module: nn.Module) -> Tensor | None:
        """The attention module's own projection (``o_proj``, ``out_proj``, ``o``,
        ``c_proj``, ``out_lin``, ``dense``), or, where the declared module is the inner
        self-attention (BERT family), its parent's ``output.dense``: its floating-point
        weight (a weight quantized as a tensor subclass, torchao's or optimum-quanto's,
        dequantized), None where it holds none as a plain linear layer does (wrapped by
        PEFT's adapters, or quantized: bitsandbytes' layers are ``nn.Linear`` with packed
        integer weights)."""
        parent = parent_module(model, module)
        candidates = [getattr(module, name, None) for name in _PROJECTIONS]
        if parent is not None:
            candidates.append(getattr(getattr(parent, "output", None), "dense", None))
        projection = next((c for c in candidates if isinstance(c, nn.Module)), None)
        weight = dense_weight(getattr(projection, "weight", None))
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            return None
        if isinstance(projection, nn.Linear) and tuple(weight.shape) == (projection.out_features, projection.in_features):
            return weight
        if type(projection).__name__ == "Conv1D":  # GPT-2's (in, out) weight
            return weight.t()
        return None

    def input_embeddings(self, model: nn.Module) -> list[nn.Module]:
        """``get_input_embeddings()`` of the encoder and the decoder (one module where they
        share it, as T5's ``shared``), else of the model; of a module that names none (the
        user's own around a backbone), those of the transformers models it holds. An
        encoder-decoder whose ``get_decoder()`` is its whole language model (Florence-2's
        BART) names that model's decoder."""
        models = [model] if hasattr(model, "get_input_embeddings") else transformers_models(model)
        owners = [
            owner
            for inner in models
            for owner in ([getattr(inner, "get_encoder")(), self._decoder_stack(inner)] if self.is_encoder_decoder(inner) else [inner])
        ]
        modules: list[nn.Module] = []
        for owner in owners:
            try:
                embedding = getattr(self._embedding_stack(owner), "get_input_embeddings", lambda: None)()
            except NotImplementedError as error:  # transformers cannot name them for this class
                embedding = _patch_embedding(owner)
                if embedding is None:
                    raise UnsupportedModelError(
                        f"{type(owner).__name__} does not name its input embeddings "
                        "(get_input_embeddings is not implemented), which AttnLRP starts from."
                    ) from error
            if isinstance(embedding, nn.Module) and not any(embedding is m for m in modules):
                modules.append(embedding)
        return modules

    def _embedding_stack(self, model: nn.Module) -> nn.Module:
        """The module whose input embeddings ``model``'s forward calls: the encoder stack of
        an encoder-only model that names its own embeddings apart (T5's encoder model and
        token classifier, whose ``shared`` their stack's ``embed_tokens`` ties without
        calling it), else ``model``."""
        if self.is_encoder_decoder(model) or not callable(getattr(model, "get_encoder", None)):
            return model
        try:
            stack = getattr(model, "get_encoder")()
            own = stack.get_input_embeddings() if stack is not model and callable(getattr(stack, "get_input_embeddings", None)) else None
        except (AttributeError, NotImplementedError):  # transformers cannot name them for this class
            return model
        return stack if isinstance(own, nn.Module) else model

    def _decoder_stack(self, model: nn.Module) -> nn.Module:
        """An encoder-decoder's decoder: its ``get_decoder()``, or that module's own where it
        is an encoder-decoder itself (Florence-2's language model)."""
        decoder = getattr(model, "get_decoder")()
        while decoder is not model and self.is_encoder_decoder(decoder) and callable(getattr(decoder, "get_decoder", None)):
            model, decoder = decoder, decoder.get_decoder()
        return decoder

    def merged_embeddings(self, model: nn.Module) -> nn.Module | None:
        """A vision-language model's language model (:mod:`.images`); an encoder-decoder's
        encoder where it reads the image's features among its tokens (Florence-2's)."""
        if self.is_encoder_decoder(model) and _image_models(model):
            get_encoder = getattr(model, "get_encoder", None)
            encoder = get_encoder() if callable(get_encoder) else None
            return encoder if isinstance(encoder, nn.Module) else None
        return language_model_of(model)

    def generated_inputs(self, model: nn.Module, inputs: Mapping[str, Any], prompt_length: int, new_tokens: int) -> dict[str, Any]:
        """As the model's own ``_update_model_kwargs_for_generation`` extends them, one token
        at a time as ``generate`` calls it without a cache, the whole sequence at each step
        (PaliGemma marks generated tokens as its causal suffix; the generic update repeats
        the last token type; Mllama repeats the last token's ``cross_attention_mask``). An
        update that reads the forward's own outputs (Idefics' image states) is refused in
        one line."""
        from transformers.utils import ModelOutput

        update: Callable[..., dict[str, Any]] | None = getattr(model, "_update_model_kwargs_for_generation", None)
        generated = {key: value for key, value in inputs.items() if per_token(value, prompt_length, key)}
        if update is not None:
            try:
                for _ in range(new_tokens):
                    generated = update(ModelOutput(), {**generated, "use_cache": False}, is_encoder_decoder=False, num_new_tokens=1)
            except AttributeError as error:
                raise UnsupportedModelError(
                    f"{type(model).__name__} extends its inputs over generated tokens from its forward's outputs ({error}): "
                    "its image inputs cannot be extended over the answer as generate extends them."
                ) from error
        return extended_per_token(inputs, prompt_length, new_tokens, generated)

    def relevance_sites(self, model: nn.Module) -> RelevanceSites:
        """Activations: torch's element-wise modules and every class of transformers'
        activation table (``ACT2CLS``); norms: ``nn.LayerNorm``, ``nn.RMSNorm`` and the
        families' own norm modules, which transformers names ``*Norm`` (``LlamaRMSNorm``,
        ``T5LayerNorm``, ...), but for a module so named that holds another norm: a block
        around norms (DBRX's ``DbrxNormAttentionNorm`` holds its attention between two,
        wav2vec 2.0's ``*StableLayerNorm`` layers theirs), whose products take their rules."""
        from transformers.activations import ACT2CLS

        table = [entry[0] if isinstance(entry, tuple) else entry for entry in ACT2CLS.values()]
        activations = TORCH_ACTIVATIONS + tuple(cls for cls in table if isinstance(cls, type))
        modules = list(model.modules())
        named_norms = [m for m in modules if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")]
        found = set(named_norms)
        return RelevanceSites(
            [m for m in modules if isinstance(m, activations)],
            [m for m in named_norms if not any(inner in found for inner in m.modules() if inner is not m)],
        )

    def prepared(self, model: nn.Module, streaming: bool) -> AbstractContextManager[None]:
        return _prepared(self, model, "sdpa" if streaming else "eager")


def _language_model_sites(model: nn.Module, found: dict[nn.Module, AttentionSite]) -> list[AttentionSite]:
    """A vision-language model's sites in its language model, which reads the tokens (its
    vision tower attends over the patches), but its image sub-models'
    (:func:`_image_models`); of a model that names none, every site but theirs."""
    language_model = language_model_of(model)
    images = {module for image_model in _image_models(model) for module in image_model.modules()}
    if language_model is None:
        return [site for site in found.values() if site.module not in images]
    inside = set(language_model.modules()) - images  # GIT's holds its image encoder
    sites = [site for site in found.values() if site.module in inside]
    names = {module: name for name, module in model.named_modules()}
    cross = [site.role == "cross" or _takes_other_states(site.module, names[site.module]) for site in sites]
    if any(cross) and getattr(model.config, "model_type", None) in CROSS_ATTENDED:
        return [replace(site, role="cross" if is_cross else "decoder") for site, is_cross in zip(sites, cross)]
    read = {site.module for site in sites}
    unread = [name for module, name in names.items() if module in inside and module not in read and type(module) in {type(m) for m in read}]
    if any(cross) or unread:  # Idefics' gated cross-attention: the class of its self-attention, declared for none of its outputs
        raise UnsupportedModelError(
            f"{type(model).__name__}'s language model reads the image through cross-attention layers"
            f"{f' ({unread[0]})' if unread else ''}, whose keys are the vision tower's outputs rather than tokens of its "
            "sequence: its answers are not explained yet."
        )
    return sites


IMAGE_CONFIGS = ("vision_config", "vq_config")
"""The sub-configs of a model that reads tokens whose sub-models read its images (GIT's
image encoder, Chameleon's VQ-VAE, which turns an image into codes of its vocabulary,
Florence-2's vision tower)."""


def _image_models(model: nn.Module) -> list[nn.Module]:
    """The sub-models of a model that reads tokens (a decoder, or an encoder-decoder whose
    encoder reads the image's features among its tokens) built from its image sub-configs
    (:data:`IMAGE_CONFIGS`): their attention runs over an image's patches or features, not
    over the tokens."""
    config = getattr(model, "config", None)
    if getattr(model, "main_input_name", None) != "input_ids":
        return []
    kinds = tuple(type(sub) for name in IMAGE_CONFIGS if (sub := getattr(config, name, None)) is not None)
    return [sub for sub in HuggingFaceAdapter._pretrained_models(model) if sub is not model and isinstance(sub.config, kinds)] if kinds else []


_CROSS_STATES = {"cross_attention_states", "encoder_hidden_states"}
"""Forward parameters of an attention module whose keys are another sequence's states."""


def _takes_other_states(module: nn.Module, name: str) -> bool:
    """Whether an attention module reads another sequence's states: its forward takes them
    (:data:`_CROSS_STATES`), unless the model calls it its self-attention (Kosmos-2's
    ``self_attn``, BLIP's ``attention.self`` beside its ``crossattention.self``: one class
    for both)."""
    return bool(_CROSS_STATES & set(inspect.signature(module.forward).parameters)) and name.split(".")[-1] != "self_attn" and not name.endswith("attention.self")


def _patch_embedding(model: nn.Module) -> nn.Module | None:
    """The first module named ``patch_embedding(s)`` (CLIP's vision tower names its patch
    convolution so, but its image classifier does not return it as input embeddings)."""
    return next((m for name, m in model.named_modules() if name.split(".")[-1] in ("patch_embedding", "patch_embeddings")), None)


@contextmanager
def _prepared(adapter: HuggingFaceAdapter, model: nn.Module, implementation: str) -> Iterator[None]:
    """``model`` running ``implementation``; a model whose attention modules were found
    through ``output_attentions`` (:func:`returned_attention`) is also called with
    ``output_attentions=True``, without which they return no probabilities; a
    window or reduced-key model's attention notes where it ran (eager only)."""
    grids = on_grids(model)
    if grids and implementation != "eager":
        raise StreamingUnsupported(
            "its attention runs per shifted window or over reduced keys, read from the eager probabilities"
        )
    with _implementation(model, implementation), ExitStack() as stack:
        for inner in adapter._pretrained_models(model):
            if _RETURNED.get(inner, (None, ReturnedAttention(())))[1].sites:
                stack.enter_context(every_forward(inner, _output_attentions))
        if grids:
            note_grid_calls(model, adapter.attention_sites(model), stack)
        yield


def _output_attentions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return args, {**kwargs, "output_attentions": True}


@dataclass(frozen=True)
class ReturnedAttention:
    """The modules whose output holds, at ``index``, a map the model returns with
    ``output_attentions=True`` (``cross``: among its ``cross_attentions``); or why none
    were found."""

    sites: tuple[tuple[nn.Module, int, bool], ...]
    reason: str = ""


_RETURNED: "weakref.WeakKeyDictionary[nn.Module, tuple[str | None, ReturnedAttention]]" = weakref.WeakKeyDictionary()
"""Per model: the attention implementation it was probed under, and what was found."""


def returned_attention(model: nn.Module, run: nn.Module | None = None) -> ReturnedAttention:
    """The second way to the attention of a transformers model that declares none: one
    eager forward of a 4-token probe input with ``output_attentions=True``, matching each
    returned map, by identity, to the innermost module whose output holds it (the tensor
    that weighted the values, under eager attention). A sub-model (an encoder-decoder's
    decoder, given its encoder's states) is probed through the forward of the model that
    holds it, ``run``, with ``output_attentions=True`` given to the sub-model alone (a
    model that declares its attention keeps transformers' recording hooks once asked for
    them). Cached per model and attention implementation (a model reloaded or switched to
    eager is probed again)."""
    implementation = attn_implementation(model)
    cached = _RETURNED.get(model)
    if cached is None or cached[0] != implementation:
        cached = _RETURNED[model] = (implementation, _probe_returned_attention(model, run or model))
    return cached[1]


def _probe_returned_attention(model: nn.Module, run: nn.Module) -> ReturnedAttention:
    import torch

    inputs = _probe_inputs(run)
    if inputs is None:
        return ReturnedAttention((), "no probe input can be built for it (neither token ids nor pixel values)")
    first_output: dict[int, tuple[nn.Module, int, Tensor]] = {}  # the tensor kept alive: ids stay unique
    returned: list[Any] = []

    def keep(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            for index, item in enumerate(output):
                if isinstance(item, Tensor):
                    first_output.setdefault(id(item), (module, index, item))

    with ExitStack() as stack:
        for module in run.modules():
            stack.callback(module.register_forward_hook(keep).remove)
        stack.callback(model.register_forward_hook(lambda module, args, output: returned.append(output)).remove)
        try:
            with torch.no_grad(), _implementation(run, "eager"), every_forward(model, _output_attentions):
                as_probed = run(**inputs)[0]
        except Exception as error:  # noqa: BLE001 - any failure means: not found this way
            reason = error_line(error)
            return ReturnedAttention((), f"a probe forward with output_attentions=True failed ({reason[:120]})")
    with torch.no_grad():
        as_loaded = run(**inputs)[0]
    output = returned[0]
    if not torch.allclose(as_probed, as_loaded, rtol=1e-3, atol=1e-4 * float(as_loaded.abs().max())):
        return ReturnedAttention((), (
            "its output_attentions come from another attention path than the "
            f"{attn_implementation(model)!r} one it runs (its outputs differ); load it with "
            "attn_implementation='eager'"
        ))
    sites: dict[nn.Module, tuple[nn.Module, int, bool]] = {}
    inside = set(model.modules())
    for key in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions"):
        for attention in _flattened(getattr(output, key, None) or ()):
            holder = first_output.get(id(attention)) if isinstance(attention, Tensor) and attention.dim() == 4 else None
            if holder is not None and holder[2] is attention and holder[0] is not model and holder[0] in inside:
                sites.setdefault(holder[0], (holder[0], holder[1], key == "cross_attentions"))
    if not sites:
        reason = "its output_attentions hold no (batch, heads, queries, keys) map a module returns"
        if attn_implementation(model) not in (None, "eager"):  # BEiT-like models pick their attention classes when built
            reason += f" under {attn_implementation(model)!r}; if it chose its attention classes when built, load it with attn_implementation='eager'"
        return ReturnedAttention((), reason)
    order = {module: index for index, module in enumerate(model.modules())}
    return ReturnedAttention(tuple(sorted(sites.values(), key=lambda site: order[site[0]])))


def _undeclared_parts(model: nn.Module, encoder: nn.Module | None, found: Mapping[nn.Module, AttentionSite], kinds: Sequence[str]) -> list[nn.Module]:
    """The outermost transformers sub-models of an encoder-decoder that declare no
    attention and hold none of the ``found`` sites: an encoder or a decoder that declares
    none beside one that does (TrOCR's decoder after a ViT, Donut's Swin before an MBart),
    probed through the whole model's forward."""
    from transformers import PreTrainedModel

    if encoder is None:
        return []
    undeclared: list[nn.Module] = []
    inside: set[nn.Module] = set()
    for inner in model.modules():  # outer models before the ones they hold
        if inner is model or inner in inside or not isinstance(inner, PreTrainedModel) or recorder_specs(type(inner), kinds):
            continue
        modules = set(inner.modules())
        if not modules & found.keys():
            undeclared.append(inner)
            inside |= modules
    return undeclared


def _flattened(maps: Any) -> Iterator[Any]:
    """The maps of ``output_attentions``, whether one per layer or nested per stage (PVTv2)."""
    for item in maps:
        if isinstance(item, (tuple, list)):
            yield from _flattened(item)
        else:
            yield item


def _probe_inputs(model: nn.Module) -> dict[str, Tensor] | None:
    """A 4-token (or one small image) input for ``model``, on its device."""
    import torch

    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else None
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = int(getattr(config, "vocab_size", None) or 8)
        ids = torch.arange(4, device=device).remainder(vocab)[None]
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if reads_decoder_ids(model):
            inputs["decoder_input_ids"] = ids
        return inputs
    if name == "pixel_values":
        vision = image_encoder_config(config) or config
        size = getattr(vision, "image_size", 224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = getattr(vision, "num_channels", 3)
        inputs = {"pixel_values": torch.zeros(1, channels, height, width, device=device, dtype=parameter.dtype if parameter is not None else None)}
        if reads_decoder_ids(model):  # an image encoder before a text decoder
            vocab = int(getattr(getattr(config, "decoder", config), "vocab_size", None) or 8)
            inputs["decoder_input_ids"] = torch.arange(4, device=device).remainder(vocab)[None]
        return inputs
    return None


TORCH_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.ELU, nn.Softplus, nn.Hardswish, nn.LeakyReLU, nn.ReLU,
)
"""torch's element-wise activation modules."""

_PROJECTIONS = ("o_proj", "out_proj", "o", "c_proj", "out_lin", "dense")
"""Names transformers' attention modules give their output projection."""


EXACT_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""The attention implementations whose semantics the captures reproduce exactly: softmax
attention over the same logits, which eager capture reads and streaming recomputes.
A model set to any other (a function registered with ``AttentionInterface``) is refused:
switching it to ``eager`` or ``sdpa`` would explain another model."""


@contextmanager
def _implementation(model: nn.Module, wanted: str) -> Iterator[None]:
    """``model`` running the attention implementation ``wanted`` in this context only,
    pinned there also when it already runs it (another thread's
    ``set_attn_implementation`` during the call changes the model for the others only).
    A wrapper (a PEFT model, the user's own module) has each transformers model it holds
    switched."""
    views: dict[int, str] = {}
    for inner in transformers_models(model):
        views.update(_views(inner, wanted))
    if not views:
        yield
        return
    patches: list[SharedPatch] = []
    token = None
    try:
        for owner in {implementation_owner(type(config)) for config in model_configs(model)}:
            patches.append(_view_patch(owner))
            patches[-1].acquire()
        token = _VIEWED.set({**_VIEWED.get(), **views})
        yield
    finally:
        if token is not None:
            _VIEWED.reset(token)
        for patch in patches:
            patch.release()


def _views(model: nn.Module, wanted: str) -> dict[int, str]:
    """The implementation each config (by ``id``) of the transformers model ``model``
    reports while it runs ``wanted``, or runs as it is where it cannot switch."""
    original = attn_implementation(model)
    if original is not None and original not in EXACT_IMPLEMENTATIONS:
        raise ValueError(
            f"{type(model).__name__} runs the attention function {original!r}, whose semantics the "
            "capture cannot reproduce: explain it with a built-in implementation "
            "(model.set_attn_implementation('sdpa') or 'eager')."
        )
    configs = model_configs(model)
    runnable: str | None
    if original == wanted == "eager" and any(getattr(c, "_attn_implementation", None) not in (None, "eager") for c in configs):
        runnable = "eager"  # a sub-model left on sdpa under an eager top config (GOT-OCR2's language model)
    else:
        runnable = _runnable(model, original, wanted)
        runnable = None if runnable == original else runnable
    if runnable is None:  # pinned as each config runs now
        return {id(c): c._attn_implementation for c in configs if getattr(c, "_attn_implementation", None) is not None}
    return {id(config): runnable for config in configs}


EXPLICIT_FAMILIES = frozenset({
    "gemma2", "vaultgemma", "t5gemma", "t5_gemma_module",  # logit softcap
    "gpt_oss", "mimo_v2_flash", "hy_v4", "flint",  # a sink logit per head in the softmax
})
"""Model types that transformers runs only eagerly because ``sdpa`` has no logit softcap
or attention sinks, and whose eager attention is sdpa's plus exactly those, the sinks as
a column of the softmax that the returned maps drop (checked on 5.24, and against
``output_attentions`` by the architecture sweep): streaming runs them through the
attention interface's ``sdpa`` entry, where each call is computed from its probabilities
(:attr:`~captum_attention.maps.kernel.KernelCall.explicit`). Not Granite-SWA: its sinks
scale the output and its maps sum to 1."""


def _runnable(model: nn.Module, original: str | None, wanted: str) -> str | None:
    """What ``model`` runs if switched to ``wanted`` (None: it stays as it is)."""
    try:
        return None if original in (None, wanted) else runnable_implementation(model, wanted)
    except (ValueError, ImportError) as error:
        if wanted != "sdpa":
            raise
        if all(getattr(config, "model_type", None) in EXPLICIT_FAMILIES for config in model_configs(model)):
            return wanted
        reason = error_line(error)
        raise StreamingUnsupported(f"{type(model).__name__} cannot run sdpa attention ({reason})") from error


_VIEWED: contextvars.ContextVar[dict[int, str]] = contextvars.ContextVar("captum_attention_viewed", default={})
"""The attention implementation each config (by ``id``) reports in this context."""
_VIEW_PATCHES: dict[type, SharedPatch] = {}
_VIEW_PATCHES_LOCK = threading.Lock()


def _view_patch(owner: type) -> SharedPatch:
    """The patch that makes ``owner``'s ``_attn_implementation`` property read
    :data:`_VIEWED` first: the capture's context sees the implementation it switched
    to, every other thread and context the model's own (``set_attn_implementation``
    would change it for all of them)."""
    with _VIEW_PATCHES_LOCK:
        patch = _VIEW_PATCHES.get(owner)
        if patch is None:

            def viewed(config: Any) -> Any:
                wanted = _VIEWED.get().get(id(config))
                return _VIEW_PATCHES[owner].original.__get__(config) if wanted is None else wanted

            def assign(config: Any, value: Any) -> None:
                _VIEW_PATCHES[owner].original.__set__(config, value)

            patch = _VIEW_PATCHES[owner] = SharedPatch(
                lambda: vars(owner)["_attn_implementation"],
                lambda value: setattr(owner, "_attn_implementation", value),
                property(viewed, assign),
            )
        return patch


@dataclass(frozen=True)
class _KeywordForward:
    """A generating Hugging Face model called with positional arguments (see
    :meth:`HuggingFaceAdapter.keyword_forward`)."""

    model: nn.Module
    encoder_decoder: bool

    @property
    def names(self) -> list[str]:
        if self.encoder_decoder and getattr(self.model, "main_input_name", None) == "pixel_values":
            return ["pixel_values", "decoder_input_ids", "decoder_attention_mask"]
        if self.encoder_decoder:
            return ["input_ids", "decoder_input_ids", "attention_mask", "decoder_attention_mask"]
        return ["input_ids", "attention_mask"]

    def __call__(self, *args: Any) -> Any:
        kwargs, keywords = self._named(args)
        verdict = _PADDING_VERDICTS.get(self.model)
        if self._positions_given(kwargs) and not (verdict is not None and verdict.native_positions):
            kwargs["position_ids"] = _real_positions(kwargs["attention_mask"])
        return self.model(**kwargs, **keywords)

    def confirm_left_padding(self, *args: Any) -> None:
        """Before a causal model's first left-padded call (outside any capture: it runs the
        model), a one-line error where it reads a left-padded prompt otherwise than the
        prompt alone (:meth:`left_padding_read`)."""
        reason = self.left_padding_read(*args)
        if reason is not None:
            raise UnsupportedModelError(f"{reason} Pad its prompts on the right, or explain each alone.")

    def left_padding_read(self, *args: Any) -> str | None:
        """Whether the first left-padded prompt's next-token logits differ from the prompt's
        alone, and how (None where they do not): with position ids over its real tokens, as
        ``generate`` gives them, or, where those move them and the model's own positions do
        not (RoBERTa's, counted from the ids), with none from then on. A decoder with
        learned positions and no position ids (BART's, Marian's, XLM's) reads the padding.
        Decided once per model, its dtype and the user's forward hooks on it (a hook added
        or removed is probed again); a model in training mode, whose dropout tells any two
        forwards apart, is not checked (the capture warns of it). A vision-language model's
        prompt is probed with its image inputs (Kosmos-2 counts its positions from the ids,
        as RoBERTa does), where they hold one row per example; flattened patches of several
        examples are not checked."""
        kwargs, keywords = self._named(args)
        if self.model.training or not self._positions_given(kwargs):
            return None
        _refuse_virtual_tokens(self.model)  # they move every position: that is the refusal to give
        mask = kwargs["attention_mask"]
        padded = (mask[:, 0] == 0) & (mask != 0).any(dim=1)
        if not bool(padded.any()):
            return None
        # the image inputs' names (PaliGemma's token types), whether the tower reads the images or they come encoded
        conditions = (*verdict_conditions(self.model), tuple(sorted(set(keywords) - {*TOWER_INPUTS, ENCODED_IMAGES})))
        verdict = _PADDING_VERDICTS.get(self.model)
        if verdict is None or verdict.conditions != conditions:
            row = int(padded.nonzero()[0])
            images = _example_inputs(keywords, row, len(mask))
            if images is None:
                return None
            verdict = self._probe({name: value[row : row + 1] for name, value in kwargs.items()}, conditions, images)
            if verdict is None:
                return None  # the capture refuses the model's non-finite outputs itself, naming where they arise
            _PADDING_VERDICTS[self.model] = verdict
        return verdict.reason

    def _probe(self, one: dict[str, Tensor], conditions: tuple, images: dict[str, Any]) -> _PaddingVerdict | None:
        """The verdict on one left-padded prompt ``one`` (with its ``images``, a
        vision-language model's): its next-token logits padded, with and without position
        ids, against the prompt's alone (None where any is not finite; a model that fails on
        the padded prompt reads it otherwise, by that failure)."""
        real = one["attention_mask"][0] != 0
        width = len(real)
        alone_images = {name: value[:, real] if per_token(value, width) else value for name, value in images.items()}
        with torch.no_grad(), ClampedSoftmax():  # as the capture runs a float64 model
            alone = _next_token_logits(self.model(**{name: value[:, real] for name, value in one.items()}, **alone_images))
            try:
                given = _next_token_logits(self.model(**one, **images, position_ids=_real_positions(one["attention_mask"])))
                if not bool(alone.isfinite().all() and given.isfinite().all()):
                    return None
                if _same_logits(given, alone):
                    return _PaddingVerdict(conditions, None)
                native = _next_token_logits(self.model(**one, **images))
            except RuntimeError as error:  # its own attention fails on a padding mask (Dory's sliding windows)
                reason = error_line(error)
                return _PaddingVerdict(conditions, f"{type(self.model).__name__} fails on a left-padded prompt ({reason}).")
        if _same_logits(native, alone):
            return _PaddingVerdict(conditions, None, native_positions=True)
        hooked = hooked_modules(self.model)
        hook = f", or the forward hook on {', '.join(hooked[:3])} reads the padding" if hooked else ""
        return _PaddingVerdict(
            conditions,
            f"{type(self.model).__name__} reads a left-padded prompt otherwise than the prompt alone: its next-token "
            f"logits move by {_moved(given, alone):.2g} of their scale, with or without position ids over the real tokens "
            f"(it counts positions from the first column, as learned positions read without position ids do, or reads "
            f"the padding tokens{hook}).",
        )

    def _named(self, args: tuple) -> tuple[dict[str, Any], dict[str, Any]]:
        """Captum's positional inputs by name, and the keyword arguments of a mapping given last."""
        names = self.names
        args, keywords = _keywords(args)
        if len(args) > len(names):
            raise TypeError(
                f"{type(self.model).__name__} was given {len(args)} positional inputs; as "
                f"forward_func it takes at most {len(names)}: {names}, and a dict of keyword "
                "arguments last (a vision-language model's image inputs). Wrap it in a function "
                "to pass more."
            )
        kwargs: dict[str, Any] = {}
        for name, value in zip(names, args):
            if isinstance(value, Tensor) and value.is_floating_point() and name.endswith("input_ids"):
                name = name.replace("input_ids", "inputs_embeds")
            kwargs[name] = value
        return kwargs, keywords

    def _positions_given(self, kwargs: dict[str, Any]) -> bool:
        """Whether a causal model's prompts are padded on the left, where position ids over
        the real tokens are given (not to a model that places its tokens itself)."""
        mask = kwargs.get("attention_mask")
        left_padded = isinstance(mask, Tensor) and bool((mask[:, 0] == 0).any())
        return not self.encoder_decoder and left_padded and not _places_its_own(self.model)


def _example_inputs(keywords: dict[str, Any], row: int, batch: int) -> dict[str, Any] | None:
    """The keyword inputs (a vision-language model's image inputs) of example ``row`` of a
    batch, or None where one of them holds no row per example (flattened patches of
    several examples, their images encoded together)."""
    taken: dict[str, Any] = {}
    for name, value in keywords.items():
        if name == ENCODED_IMAGES and batch > 1:
            return None  # the batch's images, encoded together
        if not isinstance(value, Tensor) or batch == 1:
            taken[name] = value
        elif value.dim() >= 1 and value.shape[0] == batch:
            taken[name] = value[row : row + 1]
        else:
            return None
    return taken


@dataclass(frozen=True)
class _PaddingVerdict:
    """What :meth:`_KeywordForward.left_padding_read` found for a causal model under
    ``conditions`` (:func:`verdict_conditions`): the ``reason`` it reads a left-padded
    prompt otherwise than alone (None: it does not), and whether it places the prompt's
    tokens right only without position ids (RoBERTa's, counting positions from the ids)."""

    conditions: tuple
    reason: str | None
    native_positions: bool = False


_PADDING_VERDICTS: weakref.WeakKeyDictionary[nn.Module, _PaddingVerdict] = weakref.WeakKeyDictionary()


def verdict_conditions(model: nn.Module) -> tuple:
    """What a verdict on how ``model`` reads its inputs (its left padding, its batches)
    holds for: its parameters' dtype and the user's forward hooks (by handle id: one
    removed and added again is another hook)."""
    dtypes = sorted({str(parameter.dtype) for parameter in model.parameters()})
    return tuple(dtypes), tuple(forward_hooks(model))


def _real_positions(mask: Tensor) -> Tensor:
    """Position ids over the real tokens of padded prompts, as ``generate`` gives them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _next_token_logits(output: Any) -> Tensor:
    """The logits at the last position of a causal model's output."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    return logits[:, -1]


def _same_logits(actual: Tensor, expected: Tensor) -> bool:
    """Equal within the rounding of a forward: 1e-4 of the logits' scale in float32 and
    float64, four units of the last place in half precision (kernels picked by sequence
    length round differently; a position read wrong moves a trained model's logits far
    more)."""
    tolerance = max(1e-4, 4 * torch.finfo(expected.dtype).eps)
    return bool(_moved(actual, expected) <= tolerance)


def _moved(actual: Tensor, expected: Tensor) -> float:
    """The largest difference of two sets of logits, relative to the scale of the second."""
    actual, expected = actual.float(), expected.float()
    return float((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def _keywords(args: tuple) -> tuple[tuple, dict[str, Any]]:
    """Positional arguments, and the keyword arguments of a mapping given last (a
    vision-language model's ``pixel_values``, ``image_grid_thw``, ...: the processor's
    output)."""
    if args and isinstance(args[-1], Mapping):
        return args[:-1], dict(args[-1])
    return args, {}


def _places_its_own(model: nn.Module) -> bool:
    """Whether the model computes its positions from the mask itself (Qwen2-VL's
    multimodal rotary positions, ``get_rope_index``), as ``generate`` lets it."""
    return any(callable(getattr(m, "get_rope_index", None)) for m in (model, getattr(model, "model", None)))


_CACHE_PARAMETERS = ("cache", "past_key_values", "past_key_value", "cache_params", "mems")
"""Forward parameters that hold a generation cache, never one of Captum's positional inputs."""


@dataclass(frozen=True)
class _IdsAndMask:
    """A Hugging Face model given token ids and their mask by name (see
    :meth:`HuggingFaceAdapter.named_forward`)."""

    model: nn.Module

    def __call__(self, input_ids: Tensor, attention_mask: Tensor) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


@dataclass(frozen=True)
class _ByParameterName:
    """A Hugging Face model given Captum's positional arguments by the names of its
    forward's parameters, cache parameters left out; float embeddings given where it takes
    ``input_ids`` are passed as ``inputs_embeds`` (see :meth:`HuggingFaceAdapter.keyword_forward`)."""

    model: nn.Module

    def __call__(self, *args: Any) -> Any:
        parameters = inspect.signature(self.model.forward).parameters.values()
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [name for name in names if name not in _CACHE_PARAMETERS]
        args, keywords = _keywords(args)
        if len(args) > len(names):
            raise TypeError(
                f"{type(self.model).__name__} was given {len(args)} positional inputs; its forward takes "
                f"at most {len(names)} ({names}). Wrap it in a function to pass more."
            )
        kwargs = {**dict(zip(names, args)), **keywords}
        if isinstance(kwargs.get("input_ids"), Tensor) and kwargs["input_ids"].is_floating_point():
            kwargs["inputs_embeds"] = kwargs.pop("input_ids")
        return self.model(**kwargs)


def _refuse_virtual_tokens(model: nn.Module) -> None:
    """A one-line error for a PEFT model that learns a prompt (prompt, prefix or p-tuning):
    its forward adds virtual tokens that no input token stands for (``active_peft_config``
    of peft's ``PeftModel``)."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config, "peft_type", "prompt learning")
        raise UnsupportedModelError(
            f"{type(model).__name__} adds {getattr(config, 'num_virtual_tokens', 'its')} virtual tokens of PEFT's "
            f"{getattr(kind, 'value', kind)} inside its forward, which no input token stands for: "
            "a model that learns a prompt is not explained (a LoRA adapter, merged or not, is)."
        )


def _refuse_a_held_encoder_decoder(model: nn.Module) -> None:
    """A one-line error for a module that holds an encoder-decoder (the user's own around
    one): its source and target are explained as the two inputs of the encoder-decoder's
    call, which a module of other inputs does not give."""
    held = next((inner for inner in transformers_models(model) if inner is not model and _encoder_of(inner) is not None), None)
    if held is not None:
        raise UnsupportedModelError(
            f"{type(model).__name__} holds the encoder-decoder {type(held).__name__}, whose source and target "
            f"are explained as its call's two inputs: pass model=<the {type(held).__name__}>, a forward_func "
            "of (input_ids, decoder_input_ids, *additional_forward_args) and inputs=(input_ids, decoder_input_ids)."
        )


def reads_decoder_ids(model: Any) -> bool:
    """Whether ``model`` is an encoder-decoder whose forward reads a decoder's ids: its
    config says so, and its forward names them (or names no ids at all, as a PEFT model's
    passes its arguments on). UMT5's token classifier keeps its family's
    ``is_encoder_decoder`` over an encoder alone, and takes no decoder ids."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    forward = getattr(model, "forward", None)
    takes = inspect.signature(forward).parameters if callable(forward) else {}
    return "decoder_input_ids" in takes or "input_ids" not in takes


def _encoder_of(model: nn.Module) -> nn.Module | None:
    """The encoder of a Hugging Face encoder-decoder model, else None."""
    if not reads_decoder_ids(model):
        return None
    get_encoder = getattr(model, "get_encoder", None)
    return get_encoder() if callable(get_encoder) else None
