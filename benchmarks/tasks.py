"""Ground-truth tasks for the faithfulness benchmark: the decisive tokens/patches are known.

- ``planted``: a small BERT trained from scratch on filler-token sequences holding at most
  one class token at a random position: A → class 0, B → class 1, neither → class 2 (so
  that the model must find B, not just miss A); evaluated on sequences with A or B;
  decisive: that token.
- ``order``: every sequence holds X and Y at random positions; class 1 iff X comes first;
  decisive: both.
- ``shape``: a small ViT (32×32 images, 4×4 patches) trained from scratch on noisy grey
  images with one 8×8 square at a random place, red (class 0) or green (class 1), or no
  square (class 2); evaluated on images with a square; decisive: the patches it covers.
- ``sentiment``: the embedded default model on held-out sentences of the generated
  corpus; decisive: the corpus's rationale words. With another ``model_seed``, the same
  fine-tuning from another seed (its corpus draw, head and batch order), cached apart
  from the default model.

Each task is built and trained in seconds to a minute on 2 CPU cores with fixed seeds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import transformers as tf
from torch import Tensor, nn

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]
FILLERS = [f"w{i}" for i in range(26)]
MARKERS = ["A", "B", "X", "Y"]
VOCAB = SPECIALS + FILLERS + MARKERS
PAD, CLS, SEP, MASK = range(4)
TOKEN = {name: index for index, name in enumerate(VOCAB)}


@dataclass
class Task:
    """One benchmark task: a trained model, evaluation inputs and the decisive features."""

    name: str
    model: nn.Module
    inputs: Tensor  # token ids (B, T), or images (B, 3, 32, 32)
    attention_mask: Tensor | None  # (B, T) for text
    labels: Tensor
    rationale: Tensor  # (B, T) bool tokens, or (B, rows, columns) bool patches
    keep: Tensor | None  # (B, T) bool tokens never removed ([CLS], [SEP])
    accuracy: float = 0.0
    train_seconds: float = 0.0
    tokenizer: Any = None  # for SHAP's text masker
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_image(self) -> bool:
        return self.inputs.dim() == 4

    def logits(self, inputs: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if self.is_image:
            return self.model(pixel_values=inputs).logits
        if inputs.is_floating_point():
            return self.model(inputs_embeds=inputs, attention_mask=attention_mask).logits
        return self.model(input_ids=inputs, attention_mask=attention_mask).logits


def _sequences(kind: str, count: int, generator: torch.Generator, with_none: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lengths = torch.randint(10, 23, (count,), generator=generator)
    seq_len = int(lengths.max()) + 2
    ids = torch.full((count, seq_len), PAD)
    rationale = torch.zeros(count, seq_len, dtype=torch.bool)
    labels = torch.randint(0, 3 if kind == "planted" and with_none else 2, (count,), generator=generator)
    for row, length in enumerate(lengths.tolist()):
        body = torch.randint(0, len(FILLERS), (length,), generator=generator) + len(SPECIALS)
        spots = torch.randperm(length, generator=generator)[:2]
        if kind == "planted" and labels[row] < 2:
            body[spots[0]] = TOKEN["A"] if labels[row] == 0 else TOKEN["B"]
            rationale[row, 1 + spots[0]] = True
        elif kind == "planted":
            pass  # class 2: no class token
        else:
            first, second = sorted(spots.tolist())
            x_first = bool(labels[row] == 1)
            body[first], body[second] = (TOKEN["X"], TOKEN["Y"]) if x_first else (TOKEN["Y"], TOKEN["X"])
            rationale[row, 1 + first] = rationale[row, 1 + second] = True
        ids[row, : length + 2] = torch.cat([torch.tensor([CLS]), body, torch.tensor([SEP])])
    mask = (ids != PAD).long()
    return ids, mask, labels, rationale


def _train(model: nn.Module, batches: Callable[[torch.Generator], list[tuple]], epochs: int, lr: float) -> float:
    start = time.perf_counter()
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for *inputs, labels in batches(generator):
            loss = nn.functional.cross_entropy(model(*inputs).logits, labels)
            grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
            for param, grad in zip([p for p in model.parameters() if p.requires_grad], grads):
                param.grad = grad
            optimiser.step()
            optimiser.zero_grad(set_to_none=True)
    model.eval()
    return time.perf_counter() - start


def _word_tokenizer() -> tf.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over the synthetic vocabulary (for SHAP's masker)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="[MASK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
    )
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )


def text_task(kind: str, train_size: int = 4000, eval_size: int = 64, epochs: int = 6, lr: float = 5e-4) -> Task:
    """``planted`` or ``order``: a 2-layer BERT trained from scratch."""
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, num_labels=3 if kind == "planted" else 2, pad_token_id=PAD,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = tf.BertForSequenceClassification(config)
    model.set_attn_implementation("eager")
    ids, mask, labels, _ = _sequences(kind, train_size, torch.Generator().manual_seed(1), with_none=True)

    def batches(generator: torch.Generator) -> list[tuple]:
        order = torch.randperm(train_size, generator=generator)
        return [(ids[i], mask[i], labels[i]) for i in order.split(64)]

    seconds = _train(model, batches, epochs, lr)
    ids, mask, labels, rationale = _sequences(kind, eval_size, torch.Generator().manual_seed(2), with_none=False)
    with torch.no_grad():
        accuracy = (model(ids, mask).logits.argmax(-1) == labels).float().mean().item()
    keep = torch.isin(ids, torch.tensor([CLS, SEP]))
    texts = [" ".join(VOCAB[i] for i in row.tolist() if i >= len(SPECIALS)) for row in ids]
    return Task(kind, model, ids, mask, labels, rationale, keep, accuracy, seconds, _word_tokenizer(), {"texts": texts})


def image_task(train_size: int = 3000, eval_size: int = 32, epochs: int = 3) -> Task:
    """``shape``: the coloured-squares ViT of :mod:`captum_attention.demo.shapes`, trained
    here (not cached) so that its training time is measured."""
    from captum_attention.demo.shapes import ShapeTraining, shape_accuracy, shape_images, train_shape_vit

    model, seconds = train_shape_vit(ShapeTraining(train_size=train_size, epochs=epochs))
    images, labels, rationale = shape_images(eval_size, seed=2)
    return Task("shape", model, images, None, labels, rationale, None, shape_accuracy(model, images, labels), seconds)


def sentiment_task(eval_size: int = 64, seed: int = 1, model_seed: int = 0) -> Task:
    """``sentiment``: the default model (trained and cached on first use) on held-out
    sentences (``seed``: which ones); ``model_seed`` other than 0: the default model's
    fine-tuning from that seed, cached under its own folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from captum_attention.demo import default_model_path, generate, token_rationales
    from captum_attention.demo.default_model import TrainingBudget, cache_root

    start = time.perf_counter()
    if model_seed:
        folder = default_model_path(cache_root() / f"sentiment-model-seed-{model_seed}", TrainingBudget(seed=model_seed))
    else:
        folder = default_model_path()
    seconds = time.perf_counter() - start
    model = tf.AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    examples = generate("heldout", eval_size, seed=seed)
    encoded = tokenizer([e.text for e in examples], padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    labels = torch.tensor([e.label for e in examples])
    rationale = token_rationales(encoded, examples)
    keep = torch.isin(ids, torch.tensor(tokenizer.all_special_ids))
    with torch.no_grad():
        accuracy = (model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).float().mean().item()
    texts = [e.text for e in examples]
    return Task("sentiment", model, ids, mask, labels, rationale, keep, accuracy, seconds, tokenizer, {"texts": texts})


def build(name: str, **sizes: Any) -> Task:
    if name in ("planted", "order"):
        return text_task(name, **sizes)
    if name == "shape":
        return image_task(**sizes)
    if name == "sentiment":
        return sentiment_task(**sizes)
    raise ValueError(f"unknown task {name!r}: planted, order, shape or sentiment.")
