"""Tiny vision-language models (two-layer vision towers and language models, fixed seeds)
and prompts with their image inputs: two examples padded on the left, one image each;
Qwen2-VL's two images of different sizes."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn

IMAGE = 99  # the image token id
TEXT = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
FAMILIES = ("llava", "llava_full", "paligemma", "gemma3", "qwen2_vl", "idefics3", "mistral3", "pixtral", "llava_next")
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # LLaVA-NeXT's resolutions: tiles of 32 × 32
ANSWER = torch.tensor([[8, 9], [11, 12]])


def make_vlm(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if family in ("llava", "llava_full"):  # "full": CLIP's class token kept, first of each image's tokens
        strategy = "full" if family == "llava_full" else "default"
        config: Any = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**VISION), text_config=tf.LlamaConfig(**TEXT), image_token_id=IMAGE,
            vision_feature_select_strategy=strategy,
        )
        return tf.LlavaForConditionalGeneration(config).eval()
    if family == "paligemma":
        config = tf.PaliGemmaConfig(
            vision_config=tf.SiglipVisionConfig(**VISION), text_config=tf.GemmaConfig(**TEXT, head_dim=8), image_token_id=IMAGE, projection_dim=32
        )
        return tf.PaliGemmaForConditionalGeneration(config).eval()
    if family == "gemma3":
        config = tf.Gemma3Config(vision_config=dict(VISION), text_config=dict(**TEXT, head_dim=8), mm_tokens_per_image=4, image_token_index=IMAGE)
        model = tf.Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # initialised to zeros: no image would reach the language model
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.2)
        return model
    if family == "qwen2_vl":
        config = tf.Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
            text_config=dict(**TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
            image_token_id=IMAGE, video_token_id=98, vision_start_token_id=97,
        )
        return tf.Qwen2VLForConditionalGeneration(config).eval()
    if family == "idefics3":
        config = tf.Idefics3Config(vision_config=dict(VISION), text_config=tf.LlamaConfig(**TEXT), image_token_id=IMAGE, scale_factor=2)
        return tf.Idefics3ForConditionalGeneration(config).eval()
    if family == "mistral3":  # a Pixtral vision tower: images at their own sizes, patches merged 2 × 2
        config = tf.Mistral3Config(
            vision_config=dict(VISION, head_dim=8), text_config=dict(**TEXT, head_dim=8), image_token_index=IMAGE, spatial_merge_size=2
        )
        return tf.Mistral3ForConditionalGeneration(config).eval()
    if family == "pixtral":  # LLaVA with a Pixtral vision tower (Pixtral-12B): images at their own sizes
        config = tf.LlavaConfig(
            vision_config=tf.PixtralVisionConfig(**VISION, head_dim=8), text_config=tf.MistralConfig(**TEXT, head_dim=8),
            image_token_id=IMAGE, vision_feature_select_strategy="full", vision_feature_layer=-1,
        )
        return tf.LlavaForConditionalGeneration(config).eval()
    if family == "llava_next":
        config = tf.LlavaNextConfig(
            vision_config=tf.CLIPVisionConfig(**VISION), text_config=tf.LlamaConfig(**TEXT), image_token_id=IMAGE,
            image_grid_pinpoints=PINPOINTS,
        )
        return tf.LlavaNextForConditionalGeneration(config).eval()
    raise KeyError(family)


TOKENS_PER_IMAGE = {"llava": (16, 16), "llava_full": (17, 17), "paligemma": (16, 16), "gemma3": (4, 4), "idefics3": (4, 4), "qwen2_vl": (4, 6), "mistral3": (4, 2), "pixtral": (16, 8), "llava_next": (52, 56)}
GRIDS = {
    "llava": [(4, 4)] * 2, "llava_full": [(4, 4)] * 2, "paligemma": [(4, 4)] * 2, "gemma3": [(2, 2)] * 2, "idefics3": [(2, 2)] * 2,
    "qwen2_vl": [(2, 2), (2, 3)], "mistral3": [(2, 2), (2, 1)], "pixtral": [(4, 4), (4, 2)],
    "llava_next": [(4, 4), (4, 4)],  # the whole image resized; its tiles' grids are (4, 8) and (8, 4)
}


@dataclass
class VLMPrompt:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    images: dict[str, torch.Tensor]

    @property
    def args(self) -> tuple:
        return self.attention_mask, self.images


def make_vlm_prompt(family: str, seed: int = 3) -> VLMPrompt:
    """``[BOS, image tokens, text..., 10 + b]`` per example, padded on the left."""
    rows = [[1] + [IMAGE] * count + text + [10 + b] for b, (count, text) in enumerate(zip(TOKENS_PER_IMAGE[family], ([5, 6], [7])))]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, length - len(row) :], mask[b, length - len(row) :] = torch.tensor(row), 1
    generator = torch.Generator().manual_seed(seed)
    if family == "qwen2_vl":  # 16×16 and 16×24 pixels: 4×4 and 4×6 patches of 4, merged 2×2
        grids = torch.tensor([[1, 4, 4], [1, 4, 6]])
        pixels = torch.randn(16 + 24, 3 * 2 * 4 * 4, generator=generator)
        return VLMPrompt(ids, mask, {"pixel_values": pixels, "image_grid_thw": grids, "mm_token_type_ids": (ids == IMAGE).long()})
    if family == "llava_next":  # a 32 × 64 and a 64 × 32 image, through the processor
        pictures = llava_next_pictures(seed)
        return VLMPrompt(ids, mask, dict(llava_next_processor()(images=pictures, return_tensors="pt", do_rescale=False)))
    shape = (2, 1, 3, 32, 32) if family == "idefics3" else (2, 3, 32, 32)
    images = {"pixel_values": torch.randn(*shape, generator=generator)}
    if family in ("mistral3", "pixtral"):  # the second image 32 × 16 pixels, padded to the first's size
        images["pixel_values"][1, :, :, 16:] = 0.0
        images["image_sizes"] = torch.tensor([[32, 32], [32, 16]])
    if family == "paligemma":  # as its processor types them: the prompt is its prefix, padding 0 too
        images["token_type_ids"] = torch.zeros_like(ids)
    return VLMPrompt(ids, mask, images)


def with_answer(prompt: VLMPrompt, answer: torch.Tensor = ANSWER) -> VLMPrompt:
    """The prompt followed by the answer (text: not an image token; PaliGemma's suffix, as
    its ``generate`` types it)."""
    images = dict(prompt.images)
    if "mm_token_type_ids" in images:
        images["mm_token_type_ids"] = torch.cat([images["mm_token_type_ids"], torch.zeros_like(answer)], dim=1)
    if "token_type_ids" in images:
        images["token_type_ids"] = torch.cat([images["token_type_ids"], torch.ones_like(answer)], dim=1)
    return VLMPrompt(
        torch.cat([prompt.input_ids, answer], dim=1), torch.cat([prompt.attention_mask, torch.ones_like(answer)], dim=1), images
    )


@dataclass
class VLMReference:
    attentions: list[torch.Tensor]
    grads: list[torch.Tensor]


def vlm_span_reference(model: nn.Module, family: str, prompt: VLMPrompt, answer: torch.Tensor = ANSWER) -> VLMReference:
    """The language model's attention from an eager twin's ``output_attentions``, and its
    gradient for S = Σ_b Σ_k log p(answer[b, k]): the answer read at its positions."""
    sequence = with_answer(prompt, answer)
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    positions = {} if family == "qwen2_vl" else {"position_ids": (sequence.attention_mask.cumsum(-1) - 1).clamp(min=0)}
    out = twin(input_ids=sequence.input_ids, attention_mask=sequence.attention_mask, output_attentions=True, **positions, **sequence.images)
    length, k = sequence.input_ids.shape[1], answer.shape[1]
    log_probs = out.logits[:, length - k - 1 : length - 1].log_softmax(dim=-1)
    assert len(out.attentions) == TEXT["num_hidden_layers"], "the language model's attention only"
    grads = torch.autograd.grad(log_probs.gather(2, answer[..., None]).sum(), out.attentions)
    return VLMReference([a.detach() for a in out.attentions], list(grads))


def _word_tokenizer(image_token: str, **special_tokens: str) -> Any:
    """A word-level tokenizer of ``lm_models.WORDS`` whose ``image_token`` is the image token
    and each of ``special_tokens`` (its name: its text, Gemma 3's ``boi_token``) a special
    token, its id counting down from the image token's."""
    from lm_models import WORDS
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = {text: IMAGE - 1 - i for i, text in enumerate(special_tokens.values())}
    words = {f"w{i}": i for i in range(len(WORDS), IMAGE - len(specials))}
    vocabulary = {word: i for i, word in enumerate(WORDS)} | words | specials | {image_token: IMAGE}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"image_token": image_token, **special_tokens},
    )


def save_llava_checkpoint(folder) -> nn.Module:
    """The tiny LLaVA saved with a processor (a word-level tokenizer whose ``<image>`` is
    the image token, CLIP's image processor at 32 × 32): a checkpoint the command line loads."""
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = tf.LlavaProcessor(
        image_processor=images, tokenizer=_word_tokenizer("<image>"), patch_size=8, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1,
    )
    model = make_vlm("llava")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def save_paligemma_checkpoint(folder) -> nn.Module:
    """The tiny PaliGemma saved with its processor (the word-level tokenizer, SigLIP's image
    processor at 32 × 32, 16 image tokens): a checkpoint the command line loads, whose
    processor gives the prompt's ``token_type_ids`` (0: the prefix, read both ways)."""
    images = tf.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = TOKENS_PER_IMAGE["paligemma"][0]
    processor = tf.PaliGemmaProcessor(image_processor=images, tokenizer=_word_tokenizer("<image>"))
    model = make_vlm("paligemma")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def save_gemma3_checkpoint(folder) -> nn.Module:
    """The tiny Gemma 3 saved with its processor (the word-level tokenizer, whose ``<boi>``
    its processor expands into the image's 4 tokens between ``<boi>`` and ``<eoi>``; Gemma
    3's image processor at 32 × 32): a checkpoint the command line loads, whose processor
    gives ``token_type_ids`` (1: the image's tokens, read both ways). Its 4 × 4 patches are
    pooled into 2 × 2 image tokens."""
    tokenizer = _word_tokenizer("<img>", boi_token="<boi>", eoi_token="<eoi>")
    images = tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE["gemma3"][0])
    model = make_vlm("gemma3")
    model.config.boi_token_index, model.config.eoi_token_index = tokenizer.boi_token_id, tokenizer.eoi_token_id
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def save_florence2_checkpoint(folder) -> nn.Module:
    """A tiny Florence-2 (the architecture sweep's DaViT tower and BART, its vocabulary this
    module's) saved with its processor (the word-level tokenizer, CLIP's image processor at
    32 × 32, whose images the tower turns into 5 tokens: their mean, then a 2 × 2 grid)."""
    torch.manual_seed(0)
    vision = dict(
        depths=[1, 1], patch_size=[8, 8], patch_stride=[4, 2], patch_padding=[3, 1], patch_prenorm=[False, True],
        embed_dim=[32, 32], num_heads=[4, 4], num_groups=[4, 4], window_size=2, projection_dim=32, max_position_embeddings=64,
    )
    text = dict(
        vocab_size=TEXT["vocab_size"], d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2,
    )
    model = tf.Florence2ForConditionalGeneration(tf.Florence2Config(text_config=text, vision_config=vision, image_token_id=IMAGE)).eval()
    images = tf.CLIPImageProcessorPil(size={"height": 32, "width": 32}, do_center_crop=False)
    images.image_seq_length = 5
    model.save_pretrained(folder)
    tf.Florence2Processor(image_processor=images, tokenizer=_word_tokenizer("<image>")).save_pretrained(folder)
    return model


def llava_next_processor() -> Any:
    """LLaVA-NeXT's image processor at tiles of 32 × 32, pixels kept in [0, 1]."""
    return tf.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS,
        image_mean=[0.0] * 3, image_std=[1.0] * 3,
    )


def llava_next_pictures(seed: int = 3) -> list:
    """A 32 × 64 and a 64 × 32 image (height × width), float ``(H, W, 3)`` in [0, 1]."""
    import numpy as np

    generator = np.random.default_rng(seed)
    return [generator.random((32, 64, 3)).astype("float32"), generator.random((64, 32, 3)).astype("float32")]


MLLAMA_TILES = ([2], [4, 1])  # per example, its images' tiles: a 1 × 2, then a 2 × 2 and a 1 × 1 image
MLLAMA_RATIOS = {2: 2, 4: 6, 1: 1}  # tiles → aspect_ratio_id (1 + index in supported_aspect_ratios)


def make_mllama(seed: int = 0) -> nn.Module:
    """A tiny Mllama: 16-pixel tiles of 2 × 2 patches (5 states each with the class token),
    three text layers, the second cross-attending, its tanh gates opened (zero at
    initialisation, which would shut the image out)."""
    torch.manual_seed(seed)
    config = tf.MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                           image_size=16, patch_size=8, max_num_tiles=4, intermediate_layers_indices=[0], vision_output_dim=64),
        text_config=dict(TEXT, num_hidden_layers=3, cross_attention_layers=[1], pad_token_id=0),
        image_token_index=IMAGE,
    )
    model = tf.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                parameter.fill_(0.8)
    return model


def make_mllama_prompt(seed: int = 3) -> VLMPrompt:
    """``[BOS, image, 5, 6, 10]`` and ``[BOS, image, 7, image, 8, 11]`` padded on the left,
    their cross-attention mask as Mllama's processor builds it (each image seen from its
    token on, up to the next image's), padding tiles and the missing image zero."""
    from transformers.models.mllama.processing_mllama import convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask

    rows = [[1, IMAGE, 5, 6, 10], [1, IMAGE, 7, IMAGE, 8, 11]]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, length - len(row) :], mask[b, length - len(row) :] = torch.tensor(row), 1
    spans = [get_cross_attention_token_mask(row.tolist(), IMAGE) for row in ids]
    cross = convert_sparse_cross_attention_mask_to_dense(spans, [list(t) for t in MLLAMA_TILES], 4, length)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 2, 4, 3, 16, 16, generator=generator)
    ratio_ids, ratio_mask = torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2, 4, dtype=torch.long)
    for b, tiles in enumerate(MLLAMA_TILES):
        for i, count in enumerate(tiles):
            ratio_ids[b, i], ratio_mask[b, i, :count] = MLLAMA_RATIOS[count], 1
    pixels *= ratio_mask[..., None, None, None]  # the processor's padding tiles are zeros
    images = dict(pixel_values=pixels, aspect_ratio_ids=ratio_ids, aspect_ratio_mask=ratio_mask, cross_attention_mask=torch.as_tensor(cross))
    return VLMPrompt(ids, mask, images)


def mllama_with_answer(prompt: VLMPrompt, answer: torch.Tensor = ANSWER) -> VLMPrompt:
    """The prompt followed by the answer, each answer token seeing what the last prompt
    token saw (as Mllama's ``generate`` extends the cross-attention mask)."""
    cross = prompt.images["cross_attention_mask"]
    images = dict(prompt.images, cross_attention_mask=torch.cat([cross] + [cross[:, -1:]] * answer.shape[1], dim=1))
    return VLMPrompt(torch.cat([prompt.input_ids, answer], dim=1), torch.cat([prompt.attention_mask, torch.ones_like(answer)], dim=1), images)


def mllama_states_real(prompt: VLMPrompt, per_tile: int = 5) -> torch.Tensor:
    """``(B, images · tiles · per_tile)``: the vision states of real tiles of present images."""
    real = prompt.images["aspect_ratio_mask"].bool() & (prompt.images["aspect_ratio_ids"] != 0)[..., None]
    return real[..., None].expand(*real.shape, per_tile).flatten(1)


def mllama_span_reference(model: nn.Module, prompt: VLMPrompt, answer: torch.Tensor = ANSWER) -> VLMReference:
    """The text model's self- and cross-attention in layer order (an eager twin's
    ``output_attentions``) and their gradients for the answer's summed log-probabilities."""
    sequence = mllama_with_answer(prompt, answer)
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    positions = (sequence.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = twin(input_ids=sequence.input_ids, attention_mask=sequence.attention_mask, position_ids=positions, output_attentions=True, **sequence.images)
    length, k = sequence.input_ids.shape[1], answer.shape[1]
    log_probs = out.logits[:, length - k - 1 : length - 1].log_softmax(dim=-1)
    assert len(out.attentions) == 3 and out.attentions[1].shape[-1] != length, "self, cross, self"
    grads = torch.autograd.grad(log_probs.gather(2, answer[..., None]).sum(), out.attentions)
    return VLMReference([a.detach() for a in out.attentions], list(grads))


def save_mllama_checkpoint(folder) -> nn.Module:
    """The tiny Mllama saved with its processor (the word-level tokenizer, ``<|image|>`` its
    image token; Mllama's image processor cutting images into up to four 16-pixel tiles)."""
    images = tf.MllamaImageProcessor(size={"height": 16, "width": 16}, max_image_tiles=4)
    processor = tf.MllamaProcessor(image_processor=images, tokenizer=_word_tokenizer("<|image|>"))
    model = make_mllama()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def tower_rows(model: torch.nn.Module, call, monkeypatch) -> int:
    """How many rows (images, or Qwen2-VL's patches) the vision tower reads during ``call()``
    (counted in its forward: a hook would be the user's, which the verdicts on the model's
    batches depend on)."""
    tower = getattr(model.model, "vision_tower", None) or model.model.visual
    rows = []
    forward = type(tower).forward

    def counted(self, *args, **kwargs):
        rows.append(len(args[0] if args else kwargs["pixel_values"]))
        return forward(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(type(tower), "forward", counted)
        call()
    return sum(rows)


def one_example(prompt: VLMPrompt, b: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Example ``b`` of a padded batch alone: its real tokens ``(1, n)`` and its image inputs
    (Qwen2-VL's flattened patches split by its images' grids)."""
    real = prompt.attention_mask[b] != 0
    images = {}
    for name, value in prompt.images.items():
        if name == "pixel_values" and "image_grid_thw" in prompt.images:
            images[name] = value.split(prompt.images["image_grid_thw"].prod(-1).tolist())[b]
        elif value.dim() >= 2 and value.shape[1] == prompt.input_ids.shape[1]:
            images[name] = value[b : b + 1, real]
        else:
            images[name] = value[b : b + 1]
    return prompt.input_ids[b : b + 1, real], images


def family_example(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict[str, torch.Tensor]]:
    """A tiny model and its first example, with Gemma 3's token types (1 at the image's
    tokens) as its processor gives them."""
    if family == "mllama":
        model, prompt = make_mllama(), make_mllama_prompt()
    else:
        model, prompt = make_vlm(family), make_vlm_prompt(family)
    ids, images = one_example(prompt, 0)
    if family == "gemma3":
        images["token_type_ids"] = (ids == IMAGE).long()
    return model, ids, images


def make_blip(seed: int = 0) -> nn.Module:
    """A tiny BLIP captioner: a two-layer ViT over 32 × 32 images in 4 × 4 patches of 8
    (17 states with the class token), a two-layer text decoder cross-attending to them in
    every layer, the weights of both drawn wide enough (0.2) that the image moves its
    log-probabilities (BLIP's defaults, 1e-10 for the ViT and 0.02 for the decoder, leave
    them within 1e-5 of a blank image's); ``[BOS]`` is 1 and ``[SEP]`` 2, as its
    ``generate`` reads them."""
    torch.manual_seed(seed)
    text = dict(TEXT, encoder_hidden_size=32, bos_token_id=1, sep_token_id=2, pad_token_id=0, initializer_range=0.2)
    text.pop("num_key_value_heads")
    return tf.BlipForConditionalGeneration(tf.BlipConfig(text_config=text, vision_config=dict(VISION, initializer_range=0.2))).eval()


def make_blip_prompt(seed: int = 3) -> VLMPrompt:
    """``[BOS, 5, 6, 10]`` and ``[BOS, 7, 11]`` padded on the left, one image each."""
    rows = [[1, 5, 6, 10], [1, 7, 11]]
    ids = torch.zeros(len(rows), 4, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, 4 - len(row) :] = torch.tensor(row)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return VLMPrompt(ids, (ids != 0).long(), {"pixel_values": pixels})


def blip_span_reference(model: nn.Module, input_ids: torch.Tensor, pixels: torch.Tensor, answer: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """One unpadded example's text decoder, read from its ``output_attentions``: per layer
    ``("decoder", self-attention, gradient)`` then ``("cross", cross-attention over the
    image's states, gradient)``, ``(heads, queries, keys)``, the gradients of the answer's
    summed log-probabilities."""
    sequence = torch.cat([input_ids, answer], dim=1)
    states = model.vision_model(pixel_values=pixels).last_hidden_state
    out = model.text_decoder(input_ids=sequence, encoder_hidden_states=states, output_attentions=True)
    length, k = sequence.shape[1], answer.shape[1]
    log_probs = out.logits[:, length - k - 1 : length - 1].log_softmax(dim=-1)
    maps = [m for pair in zip(out.attentions, out.cross_attentions) for m in pair]
    grads = torch.autograd.grad(log_probs.gather(2, answer[..., None]).sum(), maps)
    return [(role, m[0].detach(), g[0]) for role, m, g in zip(["decoder", "cross"] * len(out.attentions), maps, grads)]


def save_blip_checkpoint(folder) -> nn.Module:
    """The tiny BLIP saved with its processor: a WordPiece tokenizer of ``lm_models.WORDS``
    (``<pad>`` 0, ``<s>`` 1 its BOS, ``</s>`` 2 its [SEP], ``[CLS]`` 99 what the processor
    puts first) and BLIP's image processor at 32 × 32."""
    from pathlib import Path

    from lm_models import WORDS

    vocabulary = [*WORDS, *(f"w{i}" for i in range(len(WORDS), IMAGE)), "[CLS]"]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "vocab.txt").write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    tokenizer = tf.BertTokenizerFast(
        str(Path(folder) / "vocab.txt"), do_lower_case=False, unk_token="<pad>", sep_token="</s>", pad_token="<pad>",
        cls_token="[CLS]", mask_token="<pad>", bos_token="<s>",
    )
    images = tf.BlipImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.BlipProcessor(image_processor=images, tokenizer=tokenizer)
    model = make_blip()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


GIT_IMAGE_SIZE, GIT_PATCH = 32, 16
GIT_FEATURES = (GIT_IMAGE_SIZE // GIT_PATCH) ** 2 + 1
"""GIT's image features before its tokens: its image encoder's class token and 2 × 2 patches."""


def make_git(seed: int = 0, frames: int | None = None) -> nn.Module:
    """A tiny GIT: a two-layer CLIP image encoder over 32 × 32 images in 2 × 2 patches of
    16, its features projected and put before the tokens of a two-layer text model;
    ``<s>`` (1) its BOS, ``</s>`` (2) its EOS (the [SEP] its processor ends a prompt with);
    ``frames``: a video's, each frame's features after the last's."""
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=GIT_IMAGE_SIZE,
                  patch_size=GIT_PATCH)
    config = tf.GitConfig(vision_config=vision, vocab_size=IMAGE + 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=37, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                          num_image_with_embedding=frames)
    return tf.GitForCausalLM(config).eval()


def save_git_checkpoint(folder) -> nn.Module:
    """The tiny GIT saved with its processor: a WordPiece tokenizer of ``lm_models.WORDS``
    (``<s>`` its [CLS], ``</s>`` its [SEP]) and CLIP's image processor at 32 × 32."""
    from pathlib import Path

    from lm_models import WORDS

    vocabulary = [*WORDS, *(f"w{i}" for i in range(len(WORDS), IMAGE + 1))]
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "vocab.txt").write_text("\n".join(vocabulary) + "\n", encoding="utf-8")
    tokenizer = tf.BertTokenizerFast(
        str(Path(folder) / "vocab.txt"), do_lower_case=False, unk_token="<pad>", sep_token="</s>", pad_token="<pad>",
        cls_token="<s>", mask_token="<pad>", model_input_names=["input_ids", "attention_mask"],  # as GIT's checkpoints' tokenizer
    )
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": GIT_IMAGE_SIZE}, crop_size={"height": GIT_IMAGE_SIZE, "width": GIT_IMAGE_SIZE})
    model = make_git()
    model.save_pretrained(folder)
    tf.GitProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return model


DECODERS = {
    "gpt2": lambda vocab: tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, add_cross_attention=True, is_decoder=True),
    "bert": lambda vocab: tf.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, add_cross_attention=True, is_decoder=True),
    "trocr": lambda vocab: tf.TrOCRConfig(vocab_size=vocab, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                          decoder_ffn_dim=64, cross_attention_hidden_size=32),
}
"""The text decoders an image captioner's ViT is put before (TrOCR's declares no attention
modules and computes its attention by hand)."""

DONUT = "donut"
"""The captioner of a Donut-Swin (shifted windows; 8 × 8 patches of 4, merged to 4 × 4,
two heads) before an MBart decoder (four heads), as Donut and Nougat are."""


def _captioner_config(decoder: str, vocab: int) -> tf.VisionEncoderDecoderConfig:
    if decoder == DONUT:
        encoder = tf.DonutSwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=2)
        text = tf.MBartConfig(vocab_size=vocab, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                              is_decoder=True, add_cross_attention=True)
        return tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, text)
    encoder = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)
    return tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, DECODERS[decoder](vocab))


def make_captioner(decoder: str, vocab: int = 100) -> tf.VisionEncoderDecoderModel:
    """A two-layer ViT over 32 × 32 images in 4 × 4 patches of 8 (17 states with its class
    token) before a two-layer ``decoder`` of ``vocab`` tokens (or, for :data:`DONUT`,
    Donut's); the decoder starts from token 1."""
    torch.manual_seed(0)
    config = _captioner_config(decoder, vocab)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    model = tf.VisionEncoderDecoderModel(config).eval()
    model.generation_config.decoder_start_token_id, model.generation_config.pad_token_id = 1, 0
    return model


def save_captioner_checkpoint(folder, decoder: str) -> nn.Module:
    """The tiny captioner (:func:`make_captioner`, the vocabulary ``lm_models.WORDS``) saved
    with the word-level tokenizer and ViT's image processor at 32 × 32, as captioners'
    checkpoints hold them (no processor of both)."""
    from lm_models import WORDS, make_word_tokenizer

    model = make_captioner(decoder, len(WORDS))
    model.save_pretrained(folder)
    make_word_tokenizer().save_pretrained(folder)
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return model


def check_cross_attending_span(method: str, model: nn.Module, prompt: Any, expected: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``attribute_span`` of :data:`ANSWER` after ``prompt`` by a model that cross-attends to
    its image's states (Mllama, BLIP) leaves the model as it found it and equals the
    ``expected`` ``(state scores, text scores)`` within 1e-5 of each one's largest; the
    states' scores returned."""
    from conftest import assert_same_state, model_state
    from methods import METHODS

    before = model_state(model)
    source, target = METHODS[method].cls(model).attribute_span(prompt.input_ids, ANSWER, additional_forward_args=prompt.args)
    assert_same_state(before, model_state(model))
    if method != "grad_sam":  # Grad-SAM's scores follow the queries: the states are none
        assert expected[0].abs().max() > 0, "the image's states are scored"
    for scores, wanted in zip((source, target), expected):
        torch.testing.assert_close(scores, wanted, rtol=1e-5, atol=1e-5 * wanted.abs().max().item())
    return source

