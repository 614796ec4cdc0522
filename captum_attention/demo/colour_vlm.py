"""A tiny vision-language model that answers what colour the square is: the image region
that decides its answer is known.

Each noisy grey 32×32 image holds one 8×8 square, red, green or blue, at a random place
(:func:`~captum_attention.demo.shapes.shape_images`); the prompt is ``<image> what colour
is the square ?`` and the answer the colour's word. The model is a LLaVA: a CLIP vision
tower (4×4 patches, so 64 image tokens in an 8×8 grid; 2 layers, hidden 64) and a Llama
language model (2 layers, hidden 64, 4 heads). It learns the task in well under a minute
on two CPU cores. The one ``ShapeTraining()`` gives ships with the package, any other is
trained on first use and cached; either folder holds its processor (a word-level tokenizer
and CLIP's image processor, pixels in [0, 1]), so that ``captum-attention explain --model
<folder> --image ...`` takes it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .default_model import load_checkpoint, measured, trained_model_folder
from .shapes import IMAGE, PATCH, ShapeTraining, shape_images, train_on_images

WORDS = ("<pad>", "<s>", "</s>", "<image>", "what", "colour", "is", "the", "square", "?", "red", "green", "blue")
"""The vocabulary: ids are positions."""
IMAGE_TOKEN = WORDS.index("<image>")
ANSWERS = (WORDS.index("red"), WORDS.index("green"), WORDS.index("blue"))
"""The answer's token id of each colour label."""
QUESTION = "what colour is the square ?"
GRID = IMAGE // PATCH
MODEL_NAME = "coloured-squares-vlm-v1"
HELDOUT_SEED = 12


def colour_images(count: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(images (B, 3, 32, 32) in [0, 1], answer ids (B,), squares (B, 8, 8) bool)``: the
    patches each square covers; the same for the same seed."""
    images, labels, squares = shape_images(count, seed, colours=3)
    return images, torch.tensor(ANSWERS)[labels], squares


def prompt_ids(batch: int = 1) -> Tensor:
    """``(batch, 1 + 64 + 6)``: BOS, the image's tokens, the question."""
    question = [WORDS.index(word) for word in QUESTION.split()]
    return torch.tensor([WORDS.index("<s>")] + [IMAGE_TOKEN] * GRID**2 + question).expand(batch, -1)


def new_colour_vlm(seed: int = 0) -> Any:
    """The untrained ``LlavaForConditionalGeneration``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=PATCH
    )
    text = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=-1)
    return LlavaForConditionalGeneration(config)


def answer_log_probs(model: Any, images: Tensor) -> Tensor:
    """``(B, colours)``: the log-probability of each colour's word after the question."""
    logits = model(input_ids=prompt_ids(len(images)), pixel_values=images).logits[:, -1]
    return logits.float().log_softmax(dim=-1)[:, list(ANSWERS)]


def train_colour_vlm(training: ShapeTraining = ShapeTraining()) -> tuple[Any, float]:
    """The model trained on :func:`colour_images` (the answer word's cross-entropy), in
    eval mode, and the seconds it took."""
    images, answers, _ = colour_images(training.train_size, seed=training.seed + 1)
    labels = torch.tensor([ANSWERS.index(int(a)) for a in answers])

    def loss(model: Any, batch: Tensor, targets: Tensor) -> Tensor:
        return torch.nn.functional.nll_loss(answer_log_probs(model, batch), targets)

    return train_on_images(new_colour_vlm(training.seed), images, labels, loss, training)


def colour_accuracy(model: Any, images: Tensor, answers: Tensor) -> float:
    """Fraction of ``images`` whose colour the model's next word names among the vocabulary."""
    with torch.no_grad():
        logits = model(input_ids=prompt_ids(len(images)), pixel_values=images).logits[:, -1]
    return float((logits.argmax(-1) == answers).float().mean())


def colour_processor() -> Any:
    """The ``LlavaProcessor``: the word-level tokenizer (BOS first; ``<image>`` expanded
    to the image's 64 tokens) and CLIP's image processor at 32 × 32, pixels in [0, 1]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", extra_special_tokens={"image_token": "<image>"}
    )
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}, image_mean=[0.0] * 3, image_std=[1.0] * 3
    )
    return LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        image_token="<image>", num_additional_image_tokens=1,
    )


def load_colour_vlm(
    cache_dir: str | os.PathLike[str] | None = None,
    training: ShapeTraining = ShapeTraining(),
    progress: bool = True,
    trained_here: bool = False,
) -> Any:
    """The trained coloured-squares vision-language model (eval mode): the shipped one
    (:data:`~captum_attention.demo.default_model.SHIPPED`) for ``ShapeTraining()``, else
    trained on first use and cached with its processor (the folder: :func:`colour_vlm_path`).

    Args:
        cache_dir (path, optional): cache root, for a model trained here. Default: None.
        training (ShapeTraining, optional): how to train it (the ViT's settings). Default: ``ShapeTraining()``.
        progress (bool, optional): print the accuracy when training. Default: True.
        trained_here (bool, optional): train (and cache) the model on this machine even
            where the shipped one is the one asked for. Default: False.

    Returns:
        ``LlavaForConditionalGeneration``.
    """
    from transformers import LlavaForConditionalGeneration

    return load_checkpoint(Path(colour_vlm_path(cache_dir, training, progress, trained_here)), LlavaForConditionalGeneration)


def colour_vlm_path(
    cache_dir: str | os.PathLike[str] | None = None,
    training: ShapeTraining = ShapeTraining(),
    progress: bool = False,
    trained_here: bool = False,
) -> str:
    """The model's folder, with its processor (a checkpoint the command line takes): the
    shipped one, or the cached one, trained first if needed (arguments as
    :func:`load_colour_vlm`'s)."""
    return str(
        trained_model_folder(
            MODEL_NAME,
            training,
            lambda: measured(
                "coloured squares VLM", lambda: train_colour_vlm(training),
                lambda model: colour_accuracy(model, *colour_images(500, HELDOUT_SEED)[:2]), progress,
            ),
            cache_dir,
            progress,
            tokenizer=colour_processor(),
            trained_here=trained_here,
        )
    )
