"""Hand-written attention models: nn.MultiheadAttention and a textbook Head/MultiHeadAttention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from constants import NUM_LABELS, VOCAB
from torch import nn

DIM, HEADS, LAYERS = 32, 4, 2


class MHAClassifier(nn.Module):
    """Embeddings, ``nn.MultiheadAttention`` blocks with residuals, a classifier on token 0."""

    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.need_weights = False  # what the model asks its attention for (tests vary it)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(16, DIM))
        self.blocks = nn.ModuleList(nn.MultiheadAttention(DIM, HEADS, batch_first=batch_first) for _ in range(LAYERS))
        self.classifier = nn.Linear(DIM, NUM_LABELS)

    def embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) + self.position[: input_ids.shape[1]]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids)
        padding = None if attention_mask is None else attention_mask == 0
        for block in self.blocks:
            h = x if self.batch_first else x.transpose(0, 1)
            out, _ = block(h, h, h, key_padding_mask=padding, need_weights=self.need_weights)
            x = x + (out if self.batch_first else out.transpose(0, 1))
        return self.classifier(torch.tanh(x[:, 0]))

    def reference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """The same computation written out: logits and, per block, the ``(B, H, T, T)`` probabilities."""
        x = self.embeddings(input_ids)
        probs = []
        for block in self.blocks:
            batch, seq_len, _ = x.shape
            q, k, v = F.linear(x, block.in_proj_weight, block.in_proj_bias).chunk(3, dim=-1)
            split = lambda t: t.view(batch, seq_len, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
            scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(DIM // HEADS)
            attn = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf")).softmax(-1)
            probs.append([attn])
            mixed = (attn @ split(v)).transpose(1, 2).reshape(batch, seq_len, DIM)
            x = x + block.out_proj(mixed)
        return self.classifier(torch.tanh(x[:, 0])), probs


class PatchClassifier(MHAClassifier):
    """A ViT written by hand: 4×4 patch embedding, a class token, ``nn.MultiheadAttention``
    blocks; no Hugging Face config, so only an adapter knows its patch grid."""

    PATCH = 4

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, DIM, kernel_size=self.PATCH, stride=self.PATCH)
        self.class_token = nn.Parameter(torch.randn(1, 1, DIM))

    def embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tokens = self.patches(pixel_values).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.class_token.expand(len(tokens), -1, -1), tokens], dim=1)
        return tokens + self.position[: tokens.shape[1]]


class Head(nn.Module):
    """One attention head, as in a from-scratch transformer tutorial."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(DIM, head_dim) for _ in range(3))
        self.saved: list[torch.Tensor] | None = None  # only the test's reference sets this

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-1])
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        weights = F.softmax(scores, dim=-1)
        if self.saved is not None:
            self.saved.append(weights)
        return weights @ v


class MultiHeadAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(Head(DIM // HEADS) for _ in range(HEADS))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([head(x, attention_mask) for head in self.heads], dim=-1))


class TextbookClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(torch.randn(16, DIM))
        self.blocks = nn.ModuleList(MultiHeadAttention() for _ in range(LAYERS))
        self.classifier = nn.Linear(DIM, NUM_LABELS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = x + block(x, attention_mask)
        return self.classifier(torch.tanh(x[:, 0]))

    def reference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Logits and, per block, each head's saved ``(B, T, T)`` softmax output."""
        heads = [head for block in self.blocks for head in block.heads]
        for head in heads:
            head.saved = []
        try:
            logits = self(input_ids, attention_mask)
            return logits, [[h.saved[0] for h in block.heads] for block in self.blocks]
        finally:
            for head in heads:
                head.saved = None


def make_plain(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    models = {"mha": MHAClassifier, "mha_seq_first": lambda: MHAClassifier(batch_first=False), "textbook": TextbookClassifier}
    return models[kind]().eval()
