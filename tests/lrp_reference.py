"""AttnLRP re-implemented from the weights of a tiny BERT and a tiny Llama, for the tests.

An explicit forward written here (not the model's code), with each rule of Achtibat et
al. expressed by the classic detach tricks instead of the library's hooks and autograd
Functions: ``half(x) = ½x + ½x.detach()`` (the uniform rule on a product's factors),
``x · (f(x)/x).detach()`` (the identity rule), a norm's scale ``.detach()``ed. Every bias,
position embedding and the softmax's absorbed part are kept as separate terms, so that
the conservation of relevance can be checked term by term:

    S = Σ_t R_t (tokens) + Σ absorbed (biases, position and type embeddings, softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


def half(x: Tensor) -> Tensor:
    return 0.5 * x + 0.5 * x.detach()


def identity(function, x: Tensor) -> Tensor:
    ratio = torch.where(x == 0, 0.0, function(x) / x)
    return x * ratio.detach()


@dataclass
class Terms:
    """The leaves whose input × gradient make up the explained logit, and the softmax inputs
    and outputs whose relevance difference it absorbs."""

    tokens: Tensor
    leaves: list[Tensor] = field(default_factory=list)
    softmax: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def leaf(self, tensor: Tensor) -> Tensor:
        """A copy of ``tensor`` (batch first) whose input × gradient is one absorbed term."""
        leaf = tensor.detach().clone().requires_grad_()
        self.leaves.append(leaf)
        return leaf

    def attention(self, scores: Tensor) -> Tensor:
        probs = scores.softmax(dim=-1)
        self.softmax.append((scores, probs))
        return probs


@dataclass
class Decomposition:
    relevance: Tensor  # (B, T): the tokens' Σ_d e·g
    absorbed: Tensor  # (B,): biases, position/type embeddings and the softmax
    explained: Tensor  # (B,): the explained logits
    magnitude: Tensor  # (B,): Σ of the absolute values of every term


def decompose(terms: Terms, explained: Tensor) -> Decomposition:
    """The tokens' relevance and every absorbed term of ``explained.sum()`` ``(B,)``."""
    softmax_inputs = [s for s, _ in terms.softmax]
    softmax_outputs = [p for _, p in terms.softmax]
    grads = torch.autograd.grad(explained.sum(), [terms.tokens, *terms.leaves, *softmax_inputs, *softmax_outputs])
    token_grad, rest = grads[0], grads[1:]
    leaf_grads, rest = rest[: len(terms.leaves)], rest[len(terms.leaves):]
    input_grads, output_grads = rest[: len(softmax_inputs)], rest[len(softmax_inputs):]
    batch = explained.shape[0]

    def per_example(product: Tensor) -> Tensor:
        return product.reshape(batch, -1).sum(dim=1)

    parts = [per_example(leaf.detach() * g) for leaf, g in zip(terms.leaves, leaf_grads)]
    for (scores, probs), g_in, g_out in zip(terms.softmax, input_grads, output_grads):
        finite = scores.detach().clamp(min=torch.finfo(scores.dtype).min)
        parts.append(per_example(probs.detach() * g_out) - per_example(finite * g_in))
    relevance = (terms.tokens.detach() * token_grad).sum(dim=-1)
    absorbed = torch.stack(parts)
    magnitude = (terms.tokens.detach() * token_grad).abs().reshape(batch, -1).sum(dim=1) + absorbed.abs().sum(dim=0)
    return Decomposition(relevance, absorbed.sum(dim=0), explained.detach(), magnitude)


def _layer_norm(x: Tensor, norm: torch.nn.LayerNorm, terms: Terms) -> Tensor:
    centred = x - x.mean(dim=-1, keepdim=True)
    scale = torch.rsqrt(x.var(dim=-1, unbiased=False, keepdim=True) + norm.eps).detach()
    normed = centred * scale * norm.weight.detach()
    return normed + terms.leaf(norm.bias.expand_as(normed))


def _linear(x: Tensor, linear: torch.nn.Linear, terms: Terms) -> Tensor:
    out = x @ linear.weight.detach().t()
    return out if linear.bias is None else out + terms.leaf(linear.bias.expand_as(out))


def _heads(x: Tensor, heads: int) -> Tensor:
    batch, length, hidden = x.shape
    return x.view(batch, length, heads, hidden // heads).transpose(1, 2)


def bert_relevance(model, input_ids: Tensor, attention_mask: Tensor, target: Tensor) -> Decomposition:
    """AttnLRP of a ``BertForSequenceClassification`` (absolute positions, GELU)."""
    bert, config = model.bert, model.config
    embeddings = bert.embeddings
    terms = Terms(embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_())
    length = input_ids.shape[1]
    hidden = terms.tokens + terms.leaf(embeddings.position_embeddings.weight[:length][None].expand(len(input_ids), -1, -1))
    hidden = hidden + terms.leaf(embeddings.token_type_embeddings.weight[0].expand_as(terms.tokens))
    hidden = _layer_norm(hidden, embeddings.LayerNorm, terms)
    heads = config.num_attention_heads
    mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for layer in bert.encoder.layer:
        attention = layer.attention
        q, k, v = (_heads(_linear(hidden, getattr(attention.self, n), terms), heads) for n in ("query", "key", "value"))
        scores = half(q) @ half(k).transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
        context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(hidden.shape)
        hidden = _layer_norm(_linear(context, attention.output.dense, terms) + hidden, attention.output.LayerNorm, terms)
        inner = identity(F.gelu, _linear(hidden, layer.intermediate.dense, terms))
        hidden = _layer_norm(_linear(inner, layer.output.dense, terms) + hidden, layer.output.LayerNorm, terms)
    pooled = identity(torch.tanh, _linear(hidden[:, 0], bert.pooler.dense, terms))
    logits = _linear(pooled, model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def _rms_norm(x: Tensor, norm) -> Tensor:
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon).detach()
    return x * scale * norm.weight.detach()


def llama_relevance(model, input_ids: Tensor, attention_mask: Tensor, target: Tensor | None, span: Tensor | None = None) -> Decomposition:
    """AttnLRP of a ``LlamaForCausalLM`` (grouped-query attention, rotary positions, SiLU
    gates), explaining the logit of ``target`` at the last position (prompts padded left);
    or, with ``span`` ``(B, K)`` (the last K tokens of ``input_ids``), their summed
    log-probabilities Σ_k log softmax(z at length - K - 1 + k)[span_k]."""
    llama, config = model.model, model.config
    terms = Terms(llama.embed_tokens.weight.detach()[input_ids].clone().requires_grad_())
    batch, length = input_ids.shape
    positions = torch.arange(length)[None].expand(batch, -1)
    cos, sin = llama.rotary_emb(terms.tokens, positions)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    visible = torch.ones(length, length).tril().bool()[None, None] & attention_mask[:, None, None, :].bool()
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    hidden = terms.tokens
    for layer in llama.layers:
        attention, normed = layer.self_attn, _rms_norm(hidden, layer.input_layernorm)
        q = _heads(_linear(normed, attention.q_proj, terms), heads)
        k = _heads(_linear(normed, attention.k_proj, terms), kv_heads)
        v = _heads(_linear(normed, attention.v_proj, terms), kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        scores = half(q) @ half(k).transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
        context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(hidden.shape)
        hidden = hidden + _linear(context, attention.o_proj, terms)
        mlp, normed = layer.mlp, _rms_norm(hidden, layer.post_attention_layernorm)
        gate = identity(F.silu, _linear(normed, mlp.gate_proj, terms))
        hidden = hidden + _linear(half(gate) * half(_linear(normed, mlp.up_proj, terms)), mlp.down_proj, terms)
    normed = _rms_norm(hidden, llama.norm)
    if span is None:
        logits = _linear(normed[:, -1], model.lm_head, terms)
        return decompose(terms, logits.gather(1, target[:, None])[:, 0])
    read = torch.arange(length - span.shape[1] - 1, length - 1)
    log_probs = _linear(normed[:, read], model.lm_head, terms).log_softmax(dim=-1)
    return decompose(terms, log_probs.gather(2, span[..., None])[..., 0].sum(dim=1))


def _windows(x: Tensor, window: int) -> Tensor:
    """``(B, rows, columns, C)`` → ``(B·windows, window², C)``, windows and their tokens row-major."""
    batch, rows, columns, channels = x.shape
    x = x.view(batch, rows // window, window, columns // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, channels)


def _unwindows(x: Tensor, window: int, batch: int, rows: int, columns: int) -> Tensor:
    channels = x.shape[-1]
    x = x.view(batch, rows // window, columns // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows, columns, channels)


def _swin_block(block, hidden: Tensor, stage: tuple[int, int], terms: Terms) -> Tensor:
    attention, (rows, columns) = block.attention, stage
    window, shift = int(block.window_size), int(block.shift_size)
    batch, _, channels = hidden.shape
    x = _layer_norm(hidden, block.layernorm_before, terms).view(batch, rows, columns, channels)
    x = F.pad(x, (0, 0, 0, -columns % window, 0, -rows % window))
    padded_rows, padded_columns = x.shape[1:3]
    x = _windows(torch.roll(x, shifts=(-shift, -shift), dims=(1, 2)), window)
    heads = attention.num_attention_heads
    q, k, v = (_heads(_linear(x, getattr(attention, n), terms), heads) for n in ("q_proj", "k_proj", "v_proj"))
    scores = half(q) @ half(k).transpose(-1, -2) * attention.scaling
    scores = scores + terms.leaf(attention.relative_position_bias().expand_as(scores))
    mask = block.get_attn_mask(padded_rows, padded_columns, dtype=x.dtype, device=x.device)
    if mask is not None:  # the shifted windows' -100 between regions that are not neighbours
        scores = scores + terms.leaf(mask[None, :, None].expand(batch, -1, heads, -1, -1).reshape(scores.shape))
    context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(x.shape)
    out = _unwindows(_linear(context, attention.o_proj, terms), window, batch, padded_rows, padded_columns)
    out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))[:, :rows, :columns].reshape(batch, rows * columns, channels)
    hidden = hidden + out
    inner = identity(F.gelu, _linear(_layer_norm(hidden, block.layernorm_after, terms), block.mlp.fc1, terms))
    return hidden + _linear(inner, block.mlp.fc2, terms)


def _swin_merge(merge, hidden: Tensor, stage: tuple[int, int], terms: Terms) -> Tensor:
    batch, _, channels = hidden.shape
    x = hidden.view(batch, *stage, channels)
    x = torch.cat([x[:, row::2, column::2] for column in range(2) for row in range(2)], dim=-1)
    return _linear(_layer_norm(x.reshape(batch, -1, 4 * channels), merge.norm, terms), merge.reduction, terms)


def swin_relevance(model, pixel_values: Tensor, target: Tensor) -> Decomposition:
    """AttnLRP of a ``SwinForImageClassification`` (relative position bias, shifted windows,
    patch merging, mean pooling); the tokens are the patch embeddings' outputs."""
    swin = model.swin
    tokens, stage = swin.embeddings.patch_embeddings(pixel_values)
    terms = Terms(tokens.detach().clone().requires_grad_())
    hidden = _layer_norm(terms.tokens, swin.embeddings.norm, terms)
    for layer in swin.encoder.layers:
        for block in layer.blocks:
            hidden = _swin_block(block, hidden, stage, terms)
        if layer.downsample is not None:
            hidden = _swin_merge(layer.downsample, hidden, stage, terms)
            stage = (stage[0] // 2, stage[1] // 2)
    pooled = _layer_norm(hidden, swin.layernorm, terms).mean(dim=1)
    logits = _linear(pooled, model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def _conv(x: Tensor, conv: torch.nn.Conv2d, terms: Terms) -> Tensor:
    out = F.conv2d(x, conv.weight.detach(), None, conv.stride, conv.padding, conv.dilation, conv.groups)
    return out if conv.bias is None else out + terms.leaf(conv.bias[None, :, None, None].expand_as(out))


def _grid(x: Tensor, stage: tuple[int, int]) -> Tensor:
    """``(B, N, C)`` tokens as a ``(B, C, rows, columns)`` feature map."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *stage)


def _tokens(x: Tensor) -> Tensor:
    return x.flatten(2).transpose(1, 2)


SEGFORMER = dict(
    stages="segformer.stages", embed="patch_embeddings", norm_before="layernorm_before", norm_after="layernorm_after",
    q="attention.q_proj", k="attention.k_proj", v="attention.v_proj", out="attention.o_proj",
    reduction="attention.sequence_reduction_ratio", reduce="attention.sequence_reduction.sequence_reduction",
    reduce_norm="attention.sequence_reduction.layer_norm", fc1="mlp.fc1", dwconv="mlp.dwconv.dwconv", fc2="mlp.fc2",
    heads="attention.num_attention_heads",
)
PVT_V2 = dict(
    stages="pvt_v2.encoder.layers", embed="patch_embedding", norm_before="layer_norm_1", norm_after="layer_norm_2",
    q="attention.query", k="attention.key", v="attention.value", out="attention.proj",
    reduction="attention.spatial_reduction_ratio", reduce="attention.spatial_reduction", reduce_norm="attention.layer_norm",
    fc1="mlp.dense1", dwconv="mlp.dwconv.dwconv", fc2="mlp.dense2", heads="attention.num_attention_heads",
)
"""Where SegFormer and PVTv2 keep the same parts."""


def _part(module, path: str):
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _reduced_key_block(block, hidden: Tensor, stage: tuple[int, int], names: dict, terms: Terms) -> Tensor:
    def part(name: str):
        return _part(block, names[name])

    x = _layer_norm(hidden, part("norm_before"), terms)
    heads, kv = part("heads"), x
    if part("reduction") > 1:
        kv = _layer_norm(_tokens(_conv(_grid(x, stage), part("reduce"), terms)), part("reduce_norm"), terms)
    q = _heads(_linear(x, part("q"), terms), heads)
    k, v = (_heads(_linear(kv, part(n), terms), heads) for n in ("k", "v"))
    scores = half(q) @ half(k).transpose(-1, -2) / math.sqrt(q.shape[-1])
    context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(x.shape)
    hidden = hidden + _linear(context, part("out"), terms)
    inner = _linear(_layer_norm(hidden, part("norm_after"), terms), part("fc1"), terms)
    inner = _tokens(_conv(_grid(inner, stage), part("dwconv"), terms))
    return hidden + _linear(identity(F.gelu, inner), part("fc2"), terms)


def reduced_key_relevance(model, pixel_values: Tensor, target: Tensor, names: dict) -> Decomposition:
    """AttnLRP of a ``SegformerForImageClassification`` (``names=SEGFORMER``) or a
    ``PvtV2ForImageClassification`` (``PVT_V2``): overlapping patch embeddings, reduced
    keys, a feed-forward with a depthwise convolution, mean pooling; the tokens are the
    first patch embeddings' outputs (after their norm)."""
    stages = _part(model, names["stages"])
    tokens, rows, columns = getattr(stages[0], names["embed"])(pixel_values)
    terms = Terms(tokens.detach().clone().requires_grad_())
    hidden, stage = terms.tokens, (rows, columns)
    for index, stage_module in enumerate(stages):
        embed = getattr(stage_module, names["embed"])
        if index:
            embedding = _conv(_grid(hidden, stage), embed.proj, terms)
            stage = tuple(embedding.shape[-2:])
            hidden = _layer_norm(_tokens(embedding), embed.layer_norm, terms)
        for block in stage_module.blocks:
            hidden = _reduced_key_block(block, hidden, stage, names, terms)
        hidden = _layer_norm(hidden, stage_module.layer_norm, terms)
    logits = _linear(hidden.mean(dim=1), model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])
