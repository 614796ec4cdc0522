"""Hand-written attention models: nn.MultiheadAttention, a textbook Head/MultiHeadAttention, a
module calling F.scaled_dot_product_attention, and attention pooling (an RNN's additive attention, a transformer's learned-query readout)."""

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


class SdpaAttention(nn.Module):
    """Multi-head attention through ``F.scaled_dot_product_attention``, as timm's, DINOv2's
    and nanoGPT's modules are written: 4 query heads over 2 key-value heads
    (``enable_gqa``), the padding masked by a boolean mask. ``saved`` (the test's
    reference only) runs the same attention written out, keeping its probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key_value, self.proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.saved: list[torch.Tensor] | None = None
        self.dropout = 0.0  # passed in eval mode too, as some hand-written modules do (tests set it)
        self.causal = False  # tests set it: a causal decoder's additive float mask, padding included

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        head_dim = DIM // HEADS
        q = self.query(x).view(batch, seq_len, HEADS, head_dim).transpose(1, 2)
        k, v = self.key_value(x).view(batch, seq_len, 2, HEADS // 2, head_dim).permute(2, 0, 3, 1, 4)
        mask = (attention_mask != 0)[:, None, None, :]
        if self.causal:
            mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).tril()
            mask = torch.zeros(mask.shape, device=x.device).masked_fill(~mask, float("-inf"))
        if self.saved is None:
            mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, enable_gqa=True)
        else:
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
            probs = (scores + mask if self.causal else scores.masked_fill(~mask, float("-inf"))).softmax(-1)
            self.saved.append(probs)
            mixed = probs @ v
        return self.proj(mixed.transpose(1, 2).reshape(batch, seq_len, DIM))


class SdpaClassifier(TextbookClassifier):
    """The textbook classifier with :class:`SdpaAttention` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SdpaAttention() for _ in range(LAYERS))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = x + block(x, attention_mask)
        # token 0, or as a causal decoder its last real token (the padding on the right)
        read = attention_mask.sum(dim=1) - 1 if self.blocks[0].causal else torch.zeros_like(attention_mask[:, 0])
        return self.classifier(torch.tanh(x[torch.arange(len(x)), read]))

    def reference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Logits and, per block, its ``(B, H, T, T)`` probabilities, written out."""
        for block in self.blocks:
            block.saved = []
        try:
            logits = self(input_ids, attention_mask)
            return logits, [[block.saved[0]] for block in self.blocks]
        finally:
            for block in self.blocks:
                block.saved = None


class AdditiveAttention(nn.Module):
    """Bahdanau-style additive attention pooling: score_t = v·tanh(W h_t); returns the
    context vector and the ``(B, 1, T)`` weights (one query, which is not a token)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.project = nn.Linear(dim, dim)
        self.score = nn.Linear(dim, 1, bias=False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(torch.tanh(self.project(hidden))).transpose(1, 2)
        weights = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf")).softmax(dim=-1)
        return (weights @ hidden).squeeze(1), weights


class RNNClassifier(nn.Module):
    """The model family of the attention debate: a bidirectional GRU read out by additive attention."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rnn = nn.GRU(DIM, DIM // 2, batch_first=True, bidirectional=True)
        self.attention = AdditiveAttention(DIM)
        self.classifier = nn.Linear(DIM, NUM_LABELS)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        context, _ = self.attention(hidden, attention_mask)
        return self.classifier(context)

    def reference(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, erased: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Logits and the ``(B, 1, T)`` weights, written out; ``erased`` keys get zero
        weight and the rest are renormalised (Serrano & Smith's erasure)."""
        hidden, _ = self.rnn(self.embed(input_ids))
        _, weights = self.attention(hidden, attention_mask)
        if erased is not None:
            weights = weights.masked_fill(erased[:, None, :], 0.0)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.classifier((weights @ hidden).squeeze(1)), [[weights]]


class AttentionPooling(nn.Module):
    """Multi-head attention pooling with one learned query; returns the pooled vector and
    the ``(B, H, 1, T)`` probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(HEADS, 1, DIM // HEADS))
        self.key, self.value = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq_len, _ = x.shape
        split = lambda t: t.view(batch, seq_len, HEADS, DIM // HEADS).transpose(1, 2)  # noqa: E731
        scores = self.query @ split(self.key(x)).transpose(-1, -2) / math.sqrt(DIM // HEADS)
        probs = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf")).softmax(dim=-1)
        return (probs @ split(self.value(x))).reshape(batch, DIM), probs


class PooledTextbookClassifier(TextbookClassifier):
    """The textbook transformer read out by attention pooling instead of token 0."""

    def __init__(self) -> None:
        super().__init__()
        self.pooling = AttentionPooling()

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids) + self.position[: input_ids.shape[1]]
        for block in self.blocks:
            x = x + block(x, attention_mask)
        return self.pooling(x, attention_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooled(input_ids, attention_mask)[0]))

    def reference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Logits and, per block, each head's ``(B, T, T)`` softmax, then the pooling's ``(B, H, 1, T)``."""
        heads = [head for block in self.blocks for head in block.heads]
        for head in heads:
            head.saved = []
        try:
            pooled, probs = self.pooled(input_ids, attention_mask)
            blocks = [[h.saved[0] for h in block.heads] for block in self.blocks]
            return self.classifier(torch.tanh(pooled)), blocks + [[probs]]
        finally:
            for head in heads:
                head.saved = None


def make_plain(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    models = {
        "mha": MHAClassifier,
        "mha_seq_first": lambda: MHAClassifier(batch_first=False),
        "textbook": TextbookClassifier,
        "sdpa": SdpaClassifier,
        "rnn": RNNClassifier,
        "pooled_textbook": PooledTextbookClassifier,
    }
    return models[kind]().eval()
