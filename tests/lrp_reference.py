"""AttnLRP re-implemented from the weights of tiny models, for the tests: BERT, DistilBERT,
GPT-2, Llama and Qwen2, DBRX, LLaVA, Mllama and BLIP, T5, BART and Florence-2, ViT and DeiT, a ViT before a GPT-2, Swin,
SegFormer and PVTv2.

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
from types import SimpleNamespace

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
    gamma: float = 0.0  # the linear layers' generalised γ-rule (0: the ε-rule, ε → 0)

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
    return _affine(x, linear.weight.detach(), linear.bias, terms)


def _conv1d(x: Tensor, conv, terms: Terms) -> Tensor:
    """GPT-2's ``Conv1D``: ``x @ W + b`` with ``W`` stored ``(in, out)``."""
    return _affine(x, conv.weight.detach().t(), conv.bias, terms)


def _affine(x: Tensor, weight: Tensor, bias: Tensor | None, terms: Terms) -> Tensor:
    """``x Wᵀ + b``; under the γ-rule the output keeps its value ``y`` and takes the
    gradient of ``z' · (y / z').detach()``, ``z'`` the sum of the contributions favoured
    by the output's sign (x⁺ and x⁻ through ``W + γW^±``, the bias ``b + γb^±``), so that
    it shares ``y·g`` over them (Montavon et al., 2019; zennit's ``Gamma``; the same 10⁻⁶
    stabiliser)."""
    out = x @ weight.t()
    if terms.gamma == 0:
        return out if bias is None else out + terms.leaf(bias.expand_as(out))
    y = (out if bias is None else out + bias).detach()
    positive, negative = weight + terms.gamma * weight.clamp(min=0), weight + terms.gamma * weight.clamp(max=0)
    x_positive, x_negative = x.clamp(min=0), x.clamp(max=0)
    z_up = x_positive @ positive.t() + x_negative @ negative.t()
    z_down = x_positive @ negative.t() + x_negative @ positive.t()
    if bias is not None:
        bias = bias.detach()
        z_up, z_down = z_up + bias + terms.gamma * bias.clamp(min=0), z_down + bias + terms.gamma * bias.clamp(max=0)
    z = torch.where(y > 0, z_up, z_down)
    stabilised = z + 1e-6 * torch.where(z >= 0, 1.0, -1.0)
    return y + (z - z.detach()) * torch.where(y == 0, 0.0, y / stabilised).detach()


def _heads(x: Tensor, heads: int) -> Tensor:
    batch, length, hidden = x.shape
    return x.view(batch, length, heads, hidden // heads).transpose(1, 2)


def bert_relevance(
    model, input_ids: Tensor, attention_mask: Tensor, target: Tensor, gamma: float = 0.0, log_presence: Tensor | None = None
) -> Decomposition:
    """AttnLRP of a ``BertForSequenceClassification`` (absolute positions, GELU);
    ``log_presence`` ``(B, T)``: added to every call's scores of each key."""
    bert, config = model.bert, model.config
    embeddings = bert.embeddings
    terms = Terms(embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_(), gamma=gamma)
    length = input_ids.shape[1]
    hidden = terms.tokens + terms.leaf(embeddings.position_embeddings.weight[:length][None].expand(len(input_ids), -1, -1))
    hidden = hidden + terms.leaf(embeddings.token_type_embeddings.weight[0].expand_as(terms.tokens))
    hidden = _layer_norm(hidden, embeddings.LayerNorm, terms)
    heads = config.num_attention_heads
    mask = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min + _key_bias(log_presence)
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


def _key_bias(log_presence: Tensor | None) -> Tensor | float:
    """``(B, 1, 1, T)`` added to the scores of each key, or 0."""
    return 0.0 if log_presence is None else log_presence.float()[:, None, None, :]


def _rms_norm(x: Tensor, norm) -> Tensor:
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon).detach()
    return x * scale * norm.weight.detach()


def llama_relevance(
    model, input_ids: Tensor, attention_mask: Tensor, target: Tensor | None, span: Tensor | None = None, gamma: float = 0.0,
    embeddings: Tensor | None = None, positions: Tensor | None = None, log_presence: Tensor | None = None,
) -> Decomposition:
    """AttnLRP of a ``LlamaForCausalLM`` or a ``Qwen2ForCausalLM`` (grouped-query attention,
    rotary positions, SiLU gates; Qwen2's biased Q, K, V), explaining the logit of
    ``target`` at the last position (prompts padded left); or, with ``span`` ``(B, K)``
    (the last K tokens of ``input_ids``), their summed log-probabilities
    Σ_k log softmax(z at length - K - 1 + k)[span_k]. ``embeddings``: what the model reads
    in place of the ids' embeddings (a vision-language model's merged inputs);
    ``positions``: its position ids (default 0, 1, ...); ``log_presence`` ``(B, T)``: added
    to every call's scores of each key."""
    tokens = model.model.embed_tokens.weight.detach()[input_ids] if embeddings is None else embeddings.detach()
    terms = Terms(tokens.clone().requires_grad_(), gamma=gamma)
    return decompose(terms, llama_explained(model, terms, terms.tokens, attention_mask, target, span, positions, log_presence))


def llama_explained(
    model, terms: Terms, hidden: Tensor, attention_mask: Tensor, target: Tensor | None, span: Tensor | None,
    positions: Tensor | None = None, log_presence: Tensor | None = None,
) -> Tensor:
    """The explained value ``(B,)`` of :func:`llama_relevance`, computed under the rules
    from the embeddings ``hidden`` ``(B, T, d)``."""
    llama, config = model.model, model.config
    batch, length = hidden.shape[:2]
    positions = torch.arange(length)[None].expand(batch, -1) if positions is None else positions
    cos, sin = llama.rotary_emb(hidden, positions)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    visible = torch.ones(length, length).tril().bool()[None, None] & attention_mask[:, None, None, :].bool()
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min) + _key_bias(log_presence)
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
        return logits.gather(1, target[:, None])[:, 0]
    read = torch.arange(length - span.shape[1] - 1, length - 1)
    log_probs = _linear(normed[:, read], model.lm_head, terms).log_softmax(dim=-1)
    return log_probs.gather(2, span[..., None])[..., 0].sum(dim=1)


def _bias_free_layer_norm(x: Tensor, norm: torch.nn.LayerNorm) -> Tensor:
    centred = x - x.mean(dim=-1, keepdim=True)
    scale = torch.rsqrt(x.var(dim=-1, unbiased=False, keepdim=True) + norm.eps).detach()
    return centred * scale * norm.weight.detach()


def dbrx_relevance(model, input_ids: Tensor, target: Tensor) -> Decomposition:
    """AttnLRP of a ``DbrxForCausalLM`` (unpadded prompts), explaining the logit of
    ``target`` at the last position: layer norms without bias; Q, K and V from one
    projection, clipped; rotary positions, grouped-query attention; a mixture of SiLU-gated
    experts, each token's output times its routing weight (a product of two activations)."""
    from transformers.models.dbrx.modeling_dbrx import apply_rotary_pos_emb as dbrx_rotary

    dbrx, config = model.transformer, model.config
    terms = Terms(dbrx.wte.weight.detach()[input_ids].clone().requires_grad_())
    hidden, (batch, length) = terms.tokens, input_ids.shape
    cos, sin = dbrx.rotary_emb(hidden, torch.arange(length)[None].expand(batch, -1))
    heads, kv_heads = config.n_heads, config.attn_config.kv_n_heads
    head_dim = config.d_model // heads
    mask = torch.zeros(length, length).masked_fill(~torch.ones(length, length).tril().bool(), torch.finfo(torch.float32).min)
    for block in dbrx.blocks:
        around, attention = block.norm_attn_norm, block.norm_attn_norm.attn
        qkv = _linear(_bias_free_layer_norm(hidden, around.norm_1), attention.Wqkv, terms)
        q, k, v = qkv.clamp(-attention.clip_qkv, attention.clip_qkv).split([config.d_model, kv_heads * head_dim, kv_heads * head_dim], dim=2)
        q, k = dbrx_rotary(_heads(q, heads), _heads(k, kv_heads), cos, sin)
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, _heads(v, kv_heads)))
        scores = half(q) @ half(k).transpose(-1, -2) * head_dim**-0.5 + mask
        context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(hidden.shape)
        hidden = hidden + _linear(context, attention.out_proj, terms)
        hidden = hidden + _dbrx_experts(block.ffn, _bias_free_layer_norm(hidden, around.norm_2)).view_as(hidden)
    logits = _linear(_bias_free_layer_norm(hidden, dbrx.norm_f)[:, -1], model.lm_head, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def _dbrx_experts(ffn, normed: Tensor) -> Tensor:
    """``(B·T, d)`` DBRX's mixture: each token's top experts' SiLU-gated outputs, each times
    its normalised routing weight."""
    flat = normed.reshape(-1, normed.shape[-1])
    weights, chosen = ffn.router.layer(flat).softmax(dim=1).topk(ffn.top_k, dim=-1)
    weights = weights / weights.norm(p=ffn.moe_normalize_expert_weights, dim=-1, keepdim=True)
    glu, out = ffn.experts.mlp, torch.zeros_like(flat)
    shape = (-1, ffn.experts.ffn_hidden_size, flat.shape[-1])
    for expert in range(ffn.experts.num_experts):
        rows, slot = torch.where(chosen == expert)
        x = flat[rows]
        gate = identity(F.silu, x @ glu.w1.view(shape)[expert].detach().t())
        y = (half(gate) * half(x @ glu.v1.view(shape)[expert].detach().t())) @ glu.w2.view(shape)[expert].detach()
        out = out.index_add(0, rows, half(y) * half(weights[rows, slot, None]))
    return out


def llava_pixel_relevance(
    model, input_ids: Tensor, attention_mask: Tensor, pixel_values: Tensor, span: Tensor, baseline: float
) -> tuple[Tensor, Tensor]:
    """AttnLRP of a LLaVA (CLIP vision tower, two-layer projector, Llama) carried through
    the tower to the pixels: ``(token relevance (B, T), pixel relevance (x - baseline)·g
    shaped as pixel_values)`` for the answer ``span`` (the last tokens of ``input_ids``,
    padded left). The tower's layers up to ``vision_feature_layer``; CLIP's class token
    dropped under the "default" feature selection."""
    config, tower = model.config, model.model.vision_tower
    pixels = pixel_values.detach().clone().requires_grad_()
    tokens = model.model.language_model.embed_tokens.weight.detach()[input_ids]
    terms = Terms(tokens.clone().requires_grad_())
    hidden = _clip_tower(tower, pixels, tower.encoder.layers[: len(tower.encoder.layers) + 1 + config.vision_feature_layer], terms)
    features = hidden[:, 1:] if config.vision_feature_select_strategy == "default" else hidden
    projector = model.model.multi_modal_projector
    features = _linear(identity(F.gelu, _linear(features, projector.linear_1, terms)), projector.linear_2, terms)
    image = (input_ids == config.image_token_id)[..., None]
    merged = terms.tokens.masked_scatter(image, features.reshape(-1, features.shape[-1]))
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    language_model = SimpleNamespace(model=model.model.language_model, config=config.text_config, lm_head=model.lm_head)
    explained = llama_explained(language_model, terms, merged, attention_mask, None, span, positions)
    token_grad, pixel_grad = torch.autograd.grad(explained.sum(), [terms.tokens, pixels])
    return (terms.tokens.detach() * token_grad).sum(dim=-1), (pixel_values - baseline) * pixel_grad


def _clip_tower(tower, pixels: Tensor, layers, terms: Terms) -> Tensor:
    """A CLIP vision transformer's states after ``layers`` of its encoder, from the patch
    convolution's outputs of the ``pixels`` leaf (class token, positions, pre-norm, QuickGELU)."""
    patches = _tokens(F.conv2d(pixels, tower.embeddings.patch_embedding.weight.detach(), stride=tower.config.patch_size))
    batch = len(pixels)
    hidden = torch.cat([terms.leaf(tower.embeddings.class_embedding.expand(batch, 1, -1)), patches], dim=1)
    hidden = _layer_norm(hidden + terms.leaf(tower.embeddings.position_embedding.weight.expand(batch, -1, -1)), tower.pre_layrnorm, terms)
    heads = tower.config.num_attention_heads
    for layer in layers:
        attention, normed = layer.self_attn, _layer_norm(hidden, layer.layer_norm1, terms)
        q, k, v = (_heads(_linear(normed, getattr(attention, n), terms), heads) for n in ("q_proj", "k_proj", "v_proj"))
        hidden = hidden + _linear(_attend(q, k, v, q.shape[-1] ** -0.5, torch.zeros(()), terms), attention.out_proj, terms)
        normed = _layer_norm(hidden, layer.layer_norm2, terms)
        inner = identity(lambda x: x * torch.sigmoid(1.702 * x), _linear(normed, layer.mlp.fc1, terms))
        hidden = hidden + _linear(inner, layer.mlp.fc2, terms)
    return hidden


def mllama_relevance(
    model, input_ids: Tensor, attention_mask: Tensor, states: Tensor, cross_attention_mask: Tensor, span: Tensor
) -> tuple[Tensor, Tensor]:
    """AttnLRP of an Mllama's text model for the answer ``span`` (the last tokens of
    ``input_ids``, padded left): ``(token relevance (B, T), state relevance (B, S))``, the
    states being the image features ``(B, S, d)`` its cross-attention layers read. A
    cross-attention layer: RMS-normed heads of Q and K, the uniform rule on QKᵀ and A·V, its
    output and its MLP's scaled by their tanh gates (constants), the MLP zeroed on rows that
    see no image."""
    from transformers.models.mllama.modeling_mllama import _prepare_cross_attention_mask

    text, config = model.model.language_model, model.config.text_config
    tokens = text.embed_tokens.weight.detach()[input_ids]
    terms = Terms(tokens.clone().requires_grad_())
    leaf = states.detach().clone().requires_grad_()
    batch, length = input_ids.shape
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cos, sin = text.rotary_emb(tokens, positions)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    per_tile = leaf.shape[1] // (cross_attention_mask.shape[2] * cross_attention_mask.shape[3])
    cross_bias, row_seen = _prepare_cross_attention_mask(cross_attention_mask, per_tile, torch.float32)
    hidden = terms.tokens
    for index, layer in enumerate(text.layers):
        normed = _rms_norm(hidden, layer.input_layernorm)
        if index in config.cross_attention_layers:
            attention = layer.cross_attn
            q = _rms_norm(_heads(_linear(normed, attention.q_proj, terms), heads), attention.q_norm)
            k = _rms_norm(_heads(_linear(leaf, attention.k_proj, terms), kv_heads), attention.k_norm)
            v = _heads(_linear(leaf, attention.v_proj, terms), kv_heads)
            bias = cross_bias
        else:
            attention = layer.self_attn
            q, k = _heads(_linear(normed, attention.q_proj, terms), heads), _heads(_linear(normed, attention.k_proj, terms), kv_heads)
            v = _heads(_linear(normed, attention.v_proj, terms), kv_heads)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            bias = _causal_mask(attention_mask)
        k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
        update = _linear(_attend(q, k, v, q.shape[-1] ** -0.5, bias, terms), attention.o_proj, terms)
        cross = index in config.cross_attention_layers
        hidden = hidden + (layer.cross_attn_attn_gate.detach().tanh() * update if cross else update)
        mlp, normed = layer.mlp, _rms_norm(hidden, layer.post_attention_layernorm)
        gate = identity(F.silu, _linear(normed, mlp.gate_proj, terms))
        update = _linear(half(gate) * half(_linear(normed, mlp.up_proj, terms)), mlp.down_proj, terms)
        hidden = hidden + (layer.cross_attn_mlp_gate.detach().tanh() * row_seen[:, 0] * update if cross else update)
    normed = _rms_norm(hidden, text.norm)
    read = torch.arange(length - span.shape[1] - 1, length - 1)
    log_probs = _linear(normed[:, read], model.lm_head, terms).log_softmax(dim=-1)
    explained = log_probs.gather(2, span[..., None])[..., 0].sum()
    token_grad, state_grad = torch.autograd.grad(explained, [terms.tokens, leaf])
    return (terms.tokens.detach() * token_grad).sum(dim=-1), (leaf.detach() * state_grad).sum(dim=-1)


def _windows(x: Tensor, window: int) -> Tensor:
    """``(B, rows, columns, C)`` → ``(B·windows, window², C)``, windows and their tokens row-major."""
    batch, rows, columns, channels = x.shape
    x = x.view(batch, rows // window, window, columns // window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, channels)


def _unwindows(x: Tensor, window: int, batch: int, rows: int, columns: int) -> Tensor:
    channels = x.shape[-1]
    x = x.view(batch, rows // window, columns // window, window, window, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows, columns, channels)


@dataclass
class _SwinParts:
    """A shifted-window block's projections, relative position bias and feed-forward, as
    Swin (``q_proj``, ..., ``mlp``) and Donut-Swin (``self.query``, ..., ``intermediate``)
    name them."""

    projections: tuple  # query, key, value, output
    bias: Tensor  # (heads, w², w²)
    scaling: float
    heads: int
    feed_forward: tuple  # in, out


def _swin_parts(block) -> _SwinParts:
    attention = block.attention
    projections = tuple(getattr(attention, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    bias = attention.relative_position_bias()
    return _SwinParts(projections, bias, attention.scaling, attention.num_attention_heads, (block.mlp.fc1, block.mlp.fc2))


def _donut_swin_parts(block) -> _SwinParts:
    attention = block.attention.self
    projections = (attention.query, attention.key, attention.value, block.attention.output.dense)
    side = attention.window_size[0] * attention.window_size[1]
    bias = attention.relative_position_bias_table[attention.relative_position_index.view(-1)].view(side, side, -1).permute(2, 0, 1)
    scaling = attention.attention_head_size**-0.5
    return _SwinParts(projections, bias, scaling, attention.num_attention_heads, (block.intermediate.dense, block.output.dense))


def _swin_block(block, hidden: Tensor, stage: tuple[int, int], terms: Terms, parts=_swin_parts) -> Tensor:
    (rows, columns), named = stage, parts(block)
    window, shift = int(block.window_size), int(block.shift_size)
    batch, _, channels = hidden.shape
    x = _layer_norm(hidden, block.layernorm_before, terms).view(batch, rows, columns, channels)
    x = F.pad(x, (0, 0, 0, -columns % window, 0, -rows % window))
    padded_rows, padded_columns = x.shape[1:3]
    x = _windows(torch.roll(x, shifts=(-shift, -shift), dims=(1, 2)), window)
    heads, (query, key, value, output) = named.heads, named.projections
    q, k, v = (_heads(_linear(x, projection, terms), heads) for projection in (query, key, value))
    scores = half(q) @ half(k).transpose(-1, -2) * named.scaling
    scores = scores + terms.leaf(named.bias.expand_as(scores))
    mask = block.get_attn_mask(padded_rows, padded_columns, dtype=x.dtype, device=x.device)
    if mask is not None:  # the shifted windows' -100 between regions that are not neighbours
        scores = scores + terms.leaf(mask[None, :, None].expand(batch, -1, heads, -1, -1).reshape(scores.shape))
    context = half(terms.attention(scores) @ v).transpose(1, 2).reshape(x.shape)
    out = _unwindows(_linear(context, output, terms), window, batch, padded_rows, padded_columns)
    out = torch.roll(out, shifts=(shift, shift), dims=(1, 2))[:, :rows, :columns].reshape(batch, rows * columns, channels)
    hidden = hidden + out
    inner = identity(F.gelu, _linear(_layer_norm(hidden, block.layernorm_after, terms), named.feed_forward[0], terms))
    return hidden + _linear(inner, named.feed_forward[1], terms)


def _swin_merge(merge, hidden: Tensor, stage: tuple[int, int], terms: Terms) -> Tensor:
    batch, _, channels = hidden.shape
    x = hidden.view(batch, *stage, channels)
    x = torch.cat([x[:, row::2, column::2] for column in range(2) for row in range(2)], dim=-1)
    return _linear(_layer_norm(x.reshape(batch, -1, 4 * channels), merge.norm, terms), merge.reduction, terms)


def _swin_stages(swin, hidden: Tensor, stage: tuple[int, int], terms: Terms, parts=_swin_parts) -> Tensor:
    """A Swin encoder's stages over the normed patch embeddings ``hidden``: blocks, then a
    merge of 2 × 2 tokens after every stage but the last."""
    for layer in swin.encoder.layers:
        for block in layer.blocks:
            hidden = _swin_block(block, hidden, stage, terms, parts)
        if layer.downsample is not None:
            hidden = _swin_merge(layer.downsample, hidden, stage, terms)
            stage = (stage[0] // 2, stage[1] // 2)
    return hidden


def swin_relevance(model, pixel_values: Tensor, target: Tensor) -> Decomposition:
    """AttnLRP of a ``SwinForImageClassification`` (relative position bias, shifted windows,
    patch merging, mean pooling); the tokens are the patch embeddings' outputs."""
    swin = model.swin
    tokens, stage = swin.embeddings.patch_embeddings(pixel_values)
    terms = Terms(tokens.detach().clone().requires_grad_())
    hidden = _swin_stages(swin, _layer_norm(terms.tokens, swin.embeddings.norm, terms), stage, terms)
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


def _causal_mask(attention_mask: Tensor) -> Tensor:
    """``(B, 1, T, T)`` additive: later keys and padding at the float32 minimum."""
    length = attention_mask.shape[1]
    visible = torch.ones(length, length).tril().bool()[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


def _padding_mask(attention_mask: Tensor) -> Tensor:
    return (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


def _attend(q: Tensor, k: Tensor, v: Tensor, scale: float, bias: Tensor, terms: Terms) -> Tensor:
    """``(B, T, H·d)``: the uniform rule on QKᵀ and on A·V, ``bias`` added to the scores."""
    scores = half(q) @ half(k).transpose(-1, -2) * scale + bias
    context = half(terms.attention(scores) @ v).transpose(1, 2)
    return context.reshape(*context.shape[:2], -1)


def gpt2_relevance(
    model, input_ids: Tensor, attention_mask: Tensor, target: Tensor, gamma: float = 0.0, log_presence: Tensor | None = None
) -> Decomposition:
    """AttnLRP of a ``GPT2LMHeadModel`` (``Conv1D`` projections, the tanh GELU, learned
    positions counted from each prompt's first real token), explaining the logit of
    ``target`` at the last position (prompts padded left); ``log_presence`` ``(B, T)``:
    added to every call's scores of each key."""
    gpt2, config = model.transformer, model.config
    terms = Terms(gpt2.wte.weight.detach()[input_ids].clone().requires_grad_(), gamma=gamma)
    positions = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # left padding: each prompt's first token at 0
    hidden = terms.tokens + terms.leaf(gpt2.wpe.weight[positions])
    heads, mask = config.n_head, _causal_mask(attention_mask) + _key_bias(log_presence)
    for block in gpt2.h:
        q, k, v = _conv1d(_layer_norm(hidden, block.ln_1, terms), block.attn.c_attn, terms).split(config.n_embd, dim=-1)
        q, k, v = (_heads(x, heads) for x in (q, k, v))
        hidden = hidden + _conv1d(_attend(q, k, v, q.shape[-1] ** -0.5, mask, terms), block.attn.c_proj, terms)
        inner = _conv1d(_layer_norm(hidden, block.ln_2, terms), block.mlp.c_fc, terms)
        hidden = hidden + _conv1d(identity(lambda x: F.gelu(x, approximate="tanh"), inner), block.mlp.c_proj, terms)
    logits = _linear(_layer_norm(hidden, gpt2.ln_f, terms)[:, -1], model.lm_head, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def distilbert_relevance(model, input_ids: Tensor, attention_mask: Tensor, target: Tensor, gamma: float = 0.0) -> Decomposition:
    """AttnLRP of a ``DistilBertForSequenceClassification`` (post-norm layers, GELU, a ReLU
    before the classifier)."""
    bert = model.distilbert
    terms = Terms(bert.embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_(), gamma=gamma)
    length = input_ids.shape[1]
    hidden = terms.tokens + terms.leaf(bert.embeddings.position_embeddings.weight[:length][None].expand_as(terms.tokens))
    hidden = _layer_norm(hidden, bert.embeddings.LayerNorm, terms)
    mask = _padding_mask(attention_mask)
    for layer in bert.transformer.layer:
        attention, heads = layer.attention, layer.attention.n_heads
        q, k, v = (_heads(_linear(hidden, getattr(attention, n), terms), heads) for n in ("q_lin", "k_lin", "v_lin"))
        context = _attend(q, k, v, q.shape[-1] ** -0.5, mask, terms)
        hidden = _layer_norm(_linear(context, attention.out_lin, terms) + hidden, layer.sa_layer_norm, terms)
        inner = identity(F.gelu, _linear(hidden, layer.ffn.lin1, terms))
        hidden = _layer_norm(_linear(inner, layer.ffn.lin2, terms) + hidden, layer.output_layer_norm, terms)
    pooled = identity(F.relu, _linear(hidden[:, 0], model.pre_classifier, terms))
    logits = _linear(pooled, model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def _vit_layers(encoder_model, hidden: Tensor, terms: Terms) -> Tensor:
    """A ViT's (or DeiT's) pre-norm layers over ``hidden``, then its final norm."""
    heads = encoder_model.config.num_attention_heads
    for layer in encoder_model.layers:
        attention = layer.attention
        normed = _layer_norm(hidden, layer.layernorm_before, terms)
        q, k, v = (_heads(_linear(normed, getattr(attention, n), terms), heads) for n in ("q_proj", "k_proj", "v_proj"))
        hidden = hidden + _linear(_attend(q, k, v, q.shape[-1] ** -0.5, torch.zeros(()), terms), attention.o_proj, terms)
        inner = identity(F.gelu, _linear(_layer_norm(hidden, layer.layernorm_after, terms), layer.mlp.fc1, terms))
        hidden = hidden + _linear(inner, layer.mlp.fc2, terms)
    return _layer_norm(hidden, encoder_model.layernorm, terms)


def vit_relevance(model, pixel_values: Tensor, target: Tensor, gamma: float = 0.0) -> Decomposition:
    """AttnLRP of a ``ViTForImageClassification`` or a ``DeiTForImageClassificationWithTeacher``
    (a class token, DeiT's distillation token, learned positions, pre-norm layers; DeiT's
    logits the mean of its two heads); the tokens are the patch convolution's outputs."""
    deit = hasattr(model, "deit")
    encoder_model = model.deit if deit else model.vit
    embeddings = encoder_model.embeddings
    patches = embeddings.patch_embeddings.projection(pixel_values)  # (B, d, rows, columns), bias included
    terms = Terms(_tokens(patches).detach().clone().requires_grad_(), gamma=gamma)
    batch = pixel_values.shape[0]
    special = [embeddings.cls_token] + ([embeddings.distillation_token] if deit else [])
    hidden = torch.cat([*(terms.leaf(t.expand(batch, -1, -1)) for t in special), terms.tokens], dim=1)
    hidden = _vit_layers(encoder_model, hidden + terms.leaf(embeddings.position_embeddings.expand(batch, -1, -1)), terms)
    if deit:
        logits = (_linear(hidden[:, 0], model.cls_classifier, terms) + _linear(hidden[:, 1], model.distillation_classifier, terms)) / 2
    else:
        logits = _linear(hidden[:, 0], model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


def siglip2_relevance(model, pixel_values: Tensor, pixel_attention_mask: Tensor, spatial_shapes: Tensor, target: Tensor) -> Decomposition:
    """AttnLRP of a ``Siglip2ForImageClassification`` on flattened patches at their native
    sizes: the learned positions resized to each image's grid (a term), pre-norm layers
    attending over the real patches, the final norm, the mean of the real patches, the
    classifier; the tokens are the patch embedding's outputs, bias included."""
    vision = model.vision_model
    embeddings = vision.embeddings
    terms = Terms(embeddings.patch_embedding(pixel_values).detach().clone().requires_grad_())
    side = embeddings.position_embedding_size
    grid = embeddings.position_embedding.weight.reshape(side, side, -1)
    positions = embeddings.resize_positional_embeddings(grid, spatial_shapes, pixel_values.shape[1])
    hidden = terms.tokens + terms.leaf(positions)
    padding, heads = _padding_mask(pixel_attention_mask), vision.config.num_attention_heads
    for layer in vision.encoder.layers:
        attention, normed = layer.self_attn, _layer_norm(hidden, layer.layer_norm1, terms)
        q, k, v = (_heads(_linear(normed, getattr(attention, n), terms), heads) for n in ("q_proj", "k_proj", "v_proj"))
        hidden = hidden + _linear(_attend(q, k, v, attention.scale, padding, terms), attention.out_proj, terms)
        inner = identity(layer.mlp.activation_fn, _linear(_layer_norm(hidden, layer.layer_norm2, terms), layer.mlp.fc1, terms))
        hidden = hidden + _linear(inner, layer.mlp.fc2, terms)
    real = pixel_attention_mask[..., None].float()
    pooled = (_layer_norm(hidden, vision.post_layernorm, terms) * real).sum(dim=1) / real.sum(dim=1)
    logits = _linear(pooled, model.classifier, terms)
    return decompose(terms, logits.gather(1, target[:, None])[:, 0])


@dataclass
class Pair:
    """The source's and the target's relevance of an encoder-decoder, ``(B, S)`` and ``(B, T)``."""

    source: Tensor
    target: Tensor


def _pair(source_tokens: Tensor, target_tokens: Tensor, explained: Tensor) -> Pair:
    source_grad, target_grad = torch.autograd.grad(explained.sum(), [source_tokens, target_tokens])
    return Pair((source_tokens.detach() * source_grad).sum(-1), (target_tokens.detach() * target_grad).sum(-1))


def _projected_attention(
    module, names: tuple[str, str, str, str], x: Tensor, memory: Tensor, bias: Tensor, heads: int, scale: float, terms: Terms
) -> Tensor:
    """An encoder-decoder's attention module: queries from ``x``, keys and values from
    ``memory`` (``x`` itself for self-attention), projected in and out by ``names``."""
    q, k, v = (_heads(_linear(y, getattr(module, name), terms), heads) for name, y in zip(names, (x, memory, memory)))
    return _linear(_attend(q, k, v, scale, bias, terms), getattr(module, names[3]), terms)


def _last_real(hidden: Tensor, mask: Tensor) -> Tensor:
    """``(B, d)``: each example's hidden state at its last real token (targets padded right)."""
    return hidden[torch.arange(len(hidden)), mask.sum(dim=1) - 1]


def _t5_norm(x: Tensor, norm) -> Tensor:
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + norm.variance_epsilon).detach()
    return x * scale * norm.weight.detach()


def t5_relevance(
    model, source: Tensor, target_ids: Tensor, source_mask: Tensor, target_mask: Tensor, target: Tensor, gamma: float = 0.0
) -> Pair:
    """AttnLRP of a ``T5ForConditionalGeneration`` (relative position biases, RMS norms
    without a mean, ReLU feed-forward, unscaled scores, the tied head's d^-½), explaining
    the logit of ``target`` at the last real decoder position."""
    config, shared = model.config, model.shared.weight.detach()
    source_tokens = shared[source].clone().requires_grad_()
    target_tokens = shared[target_ids].clone().requires_grad_()
    terms = Terms(source_tokens, gamma=gamma)

    def attend(module, x: Tensor, memory: Tensor, bias: Tensor) -> Tensor:
        return _projected_attention(module, ("q", "k", "v", "o"), x, memory, bias, config.num_heads, 1.0, terms)

    def stack(stack_module, hidden: Tensor, self_bias: Tensor, memory: Tensor | None = None, cross_bias: Tensor | None = None) -> Tensor:
        for block in stack_module.block:
            layers = list(block.layer)
            normed = _t5_norm(hidden, layers[0].layer_norm)
            hidden = hidden + attend(layers[0].SelfAttention, normed, normed, self_bias)
            if memory is not None:
                hidden = hidden + attend(layers[1].EncDecAttention, _t5_norm(hidden, layers[1].layer_norm), memory, cross_bias)
            ff = layers[-1]
            inner = identity(F.relu, _linear(_t5_norm(hidden, ff.layer_norm), ff.DenseReluDense.wi, terms))
            hidden = hidden + _linear(inner, ff.DenseReluDense.wo, terms)
        return _t5_norm(hidden, stack_module.final_layer_norm)

    def position_bias(stack_module, queries: int, keys: int) -> Tensor:
        bias = stack_module.block[0].layer[0].SelfAttention.compute_bias(queries, keys).detach()
        return terms.leaf(bias.expand(len(source), -1, -1, -1))

    encoder, decoder = model.encoder, model.decoder
    memory = stack(encoder, source_tokens, position_bias(encoder, source.shape[1], source.shape[1]) + _padding_mask(source_mask))
    self_bias = position_bias(decoder, target_ids.shape[1], target_ids.shape[1]) + _causal_mask(target_mask)
    hidden = stack(decoder, target_tokens, self_bias, memory, _padding_mask(source_mask))
    if config.tie_word_embeddings:
        hidden = hidden * config.d_model**-0.5
    logits = _linear(_last_real(hidden, target_mask), model.lm_head, terms)
    return _pair(source_tokens, target_tokens, logits.gather(1, target[:, None])[:, 0])


def bart_relevance(
    model, source: Tensor, target_ids: Tensor, source_mask: Tensor, target_mask: Tensor, target: Tensor, gamma: float = 0.0,
    source_embeddings: Tensor | None = None,
) -> Pair:
    """AttnLRP of a ``BartForConditionalGeneration`` (learned positions offset by 2, an
    embedding norm, post-norm layers, GELU, scaled queries, the final logits bias),
    explaining the logit of ``target`` at the last real decoder position. With
    ``source_embeddings``, the encoder reads them as they are, in place of the ``source``
    tokens' (Florence-2's: its tokens' embeddings with the image's features at its image
    tokens, its language model a BART without a final logits bias)."""
    bart = getattr(model.model, "language_model", model.model)
    config = bart.config
    shared = bart.shared.weight.detach()
    source_tokens = (shared[source] if source_embeddings is None else source_embeddings.detach()).clone().requires_grad_()
    target_tokens = shared[target_ids].clone().requires_grad_()
    terms = Terms(source_tokens, gamma=gamma)
    head_dim = config.d_model // config.encoder_attention_heads

    def attend(module, x: Tensor, memory: Tensor, bias: Tensor) -> Tensor:
        names = ("q_proj", "k_proj", "v_proj", "out_proj")
        return _projected_attention(module, names, x, memory, bias, config.encoder_attention_heads, head_dim**-0.5, terms)

    def embedded(stack_module, tokens: Tensor, scaled: bool = False) -> Tensor:
        scale = 1.0 if scaled else getattr(stack_module.embed_tokens, "embed_scale", 1.0)
        positions = stack_module.embed_positions.weight[torch.arange(tokens.shape[1]) + 2]
        hidden = tokens * scale + terms.leaf(positions[None].expand_as(tokens))
        return _layer_norm(hidden, stack_module.layernorm_embedding, terms)

    def feed_forward(layer, hidden: Tensor) -> Tensor:
        inner = identity(F.gelu, _linear(hidden, layer.fc1, terms))
        return _layer_norm(hidden + _linear(inner, layer.fc2, terms), layer.final_layer_norm, terms)

    memory, padding = embedded(bart.encoder, source_tokens, source_embeddings is not None), _padding_mask(source_mask)
    for layer in bart.encoder.layers:
        memory = _layer_norm(memory + attend(layer.self_attn, memory, memory, padding), layer.self_attn_layer_norm, terms)
        memory = feed_forward(layer, memory)
    hidden, causal = embedded(bart.decoder, target_tokens), _causal_mask(target_mask)
    for layer in bart.decoder.layers:
        hidden = _layer_norm(hidden + attend(layer.self_attn, hidden, hidden, causal), layer.self_attn_layer_norm, terms)
        hidden = _layer_norm(hidden + attend(layer.encoder_attn, hidden, memory, padding), layer.encoder_attn_layer_norm, terms)
        hidden = feed_forward(layer, hidden)
    logits = _linear(_last_real(hidden, target_mask), model.lm_head, terms)
    if hasattr(model, "final_logits_bias"):
        logits = logits + terms.leaf(model.final_logits_bias.expand(len(source), -1))
    return _pair(source_tokens, target_tokens, logits.gather(1, target[:, None])[:, 0])


def blip_relevance(model, input_ids: Tensor, states: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """AttnLRP of a BLIP captioner's text decoder for the answer ``span`` (the last tokens
    of ``input_ids``, unpadded): ``(token relevance (B, T), state relevance (B, S))``, the
    states being the vision tower's outputs ``(B, S, d)`` that every layer cross-attends
    to. A BERT layer (absolute positions, post-norm, GELU) with a cross-attention block
    after its causal self-attention; the language-model head's transform (dense, GELU,
    norm) before the vocabulary."""
    text = model.text_decoder
    embeddings, heads = text.bert.embeddings, text.config.num_attention_heads
    terms = Terms(embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_())
    leaf = states.detach().clone().requires_grad_()
    length = input_ids.shape[1]
    hidden = terms.tokens + terms.leaf(embeddings.position_embeddings.weight[:length][None].expand(len(input_ids), -1, -1))
    hidden = _layer_norm(hidden, embeddings.LayerNorm, terms)
    causal = _causal_mask(torch.ones_like(input_ids))

    def block(attention, queries: Tensor, memory: Tensor, bias: Tensor | float) -> Tensor:
        q = _heads(_linear(queries, attention.self.query, terms), heads)
        k, v = (_heads(_linear(memory, getattr(attention.self, n), terms), heads) for n in ("key", "value"))
        context = _attend(q, k, v, q.shape[-1] ** -0.5, bias, terms)
        return _layer_norm(_linear(context, attention.output.dense, terms) + queries, attention.output.LayerNorm, terms)

    for layer in text.bert.encoder.layer:
        hidden = block(layer.crossattention, block(layer.attention, hidden, hidden, causal), leaf, 0.0)
        inner = identity(F.gelu, _linear(hidden, layer.intermediate.dense, terms))
        hidden = _layer_norm(_linear(inner, layer.output.dense, terms) + hidden, layer.output.LayerNorm, terms)
    transform = text.cls.predictions.transform
    read = torch.arange(length - span.shape[1] - 1, length - 1)
    hidden = _layer_norm(identity(F.gelu, _linear(hidden[:, read], transform.dense, terms)), transform.LayerNorm, terms)
    log_probs = _linear(hidden, text.cls.predictions.decoder, terms).log_softmax(dim=-1)
    explained = log_probs.gather(2, span[..., None])[..., 0].sum()
    token_grad, state_grad = torch.autograd.grad(explained, [terms.tokens, leaf])
    return (terms.tokens.detach() * token_grad).sum(dim=-1), (leaf.detach() * state_grad).sum(dim=-1)


def _captioner_source(model, pixel_values: Tensor, decoder_tokens: Tensor) -> tuple[Tensor, Terms, Tensor]:
    """A ``VisionEncoderDecoderModel``'s ViT: the patch convolution's outputs (a leaf), the
    terms with the decoder's token embeddings ``decoder_tokens``, and the states its
    decoder cross-attends to (one width: no projection between them)."""
    vit = model.encoder
    embeddings = vit.embeddings
    patches = _tokens(embeddings.patch_embeddings.projection(pixel_values)).detach().clone().requires_grad_()
    terms = Terms(decoder_tokens.detach().clone().requires_grad_())
    batch = pixel_values.shape[0]
    hidden = torch.cat([terms.leaf(embeddings.cls_token.expand(batch, -1, -1)), patches], dim=1)
    return patches, terms, _vit_layers(vit, hidden + terms.leaf(embeddings.position_embeddings.expand(batch, -1, -1)), terms)


def _caption_relevance(patches: Tensor, terms: Terms, log_probs: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """``(patch relevance (B, P), decoder token relevance (B, T))`` of the answer ``span``'s
    summed log-probability."""
    explained = log_probs.gather(2, span[..., None])[..., 0].sum()
    patch_grad, token_grad = torch.autograd.grad(explained, [patches, terms.tokens])
    return (patches.detach() * patch_grad).sum(dim=-1), (terms.tokens.detach() * token_grad).sum(dim=-1)


def vit_gpt2_relevance(model, pixel_values: Tensor, decoder_ids: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """AttnLRP of a ``VisionEncoderDecoderModel`` of a ViT and a GPT-2 that cross-attends to
    its states, for the decoder's answer ``span`` (each decoder position predicting the
    next token): ``(patch relevance (B, P), decoder token relevance (B, T))``, the patches'
    taken at the patch convolution's outputs."""
    gpt2 = model.decoder.transformer
    patches, terms, states = _captioner_source(model, pixel_values, gpt2.wte.weight[decoder_ids])
    config, (batch, length) = model.decoder.config, decoder_ids.shape
    hidden = terms.tokens + terms.leaf(gpt2.wpe.weight[:length][None].expand(batch, -1, -1))
    causal, width = _causal_mask(torch.ones_like(decoder_ids)), config.n_embd
    for block in gpt2.h:
        q, k, v = _conv1d(_layer_norm(hidden, block.ln_1, terms), block.attn.c_attn, terms).split(width, dim=-1)
        hidden = hidden + _conv1d(_attend(*(_heads(x, config.n_head) for x in (q, k, v)), (width // config.n_head) ** -0.5, causal, terms), block.attn.c_proj, terms)
        cross = block.crossattention
        q = _heads(_conv1d(_layer_norm(hidden, block.ln_cross_attn, terms), cross.q_attn, terms), config.n_head)
        k, v = (_heads(x, config.n_head) for x in _conv1d(states, cross.c_attn, terms).split(width, dim=-1))
        hidden = hidden + _conv1d(_attend(q, k, v, q.shape[-1] ** -0.5, torch.zeros(()), terms), cross.c_proj, terms)
        inner = _conv1d(_layer_norm(hidden, block.ln_2, terms), block.mlp.c_fc, terms)
        hidden = hidden + _conv1d(identity(lambda x: F.gelu(x, approximate="tanh"), inner), block.mlp.c_proj, terms)
    log_probs = _linear(_layer_norm(hidden, gpt2.ln_f, terms), model.decoder.lm_head, terms).log_softmax(dim=-1)
    return _caption_relevance(patches, terms, log_probs, span)


def _decoder_attention(config, terms: Terms):
    """A BART-style decoder's attention module (``q_proj``, ``k_proj``, ``v_proj``,
    ``out_proj``) run on queries ``x`` and keys and values ``memory`` under the rules."""
    heads = config.decoder_attention_heads

    def attend(module, x: Tensor, memory: Tensor, bias: Tensor) -> Tensor:
        names = ("q_proj", "k_proj", "v_proj", "out_proj")
        return _projected_attention(module, names, x, memory, bias, heads, (config.d_model // heads) ** -0.5, terms)

    return attend


def vit_trocr_relevance(model, pixel_values: Tensor, decoder_ids: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """As :func:`vit_gpt2_relevance`, for a ViT before TrOCR's decoder (BART's layers:
    scaled token embeddings, its own positions, an embedding norm, post-norm layers,
    GELU, the output projection), whose attention is written out by hand (``bmm``,
    ``softmax``) instead of through an attention function."""
    decoder = model.decoder.model.decoder
    patches, terms, states = _captioner_source(model, pixel_values, decoder.embed_tokens.weight[decoder_ids])
    attend = _decoder_attention(model.decoder.config, terms)
    hidden = terms.tokens * decoder.embed_tokens.embed_scale + terms.leaf(decoder.embed_positions(decoder_ids))
    if decoder.layernorm_embedding is not None:
        hidden = _layer_norm(hidden, decoder.layernorm_embedding, terms)
    causal = _causal_mask(torch.ones_like(decoder_ids))
    for layer in decoder.layers:
        hidden = _layer_norm(hidden + attend(layer.self_attn, hidden, hidden, causal), layer.self_attn_layer_norm, terms)
        hidden = _layer_norm(hidden + attend(layer.encoder_attn, hidden, states, torch.zeros(())), layer.encoder_attn_layer_norm, terms)
        inner = identity(F.gelu, _linear(hidden, layer.fc1, terms))
        hidden = _layer_norm(hidden + _linear(inner, layer.fc2, terms), layer.final_layer_norm, terms)
    log_probs = _linear(hidden, model.decoder.output_projection, terms).log_softmax(dim=-1)
    return _caption_relevance(patches, terms, log_probs, span)


def donut_relevance(model, pixel_values: Tensor, decoder_ids: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """AttnLRP of Donut: a ``VisionEncoderDecoderModel`` of a Donut-Swin (no final norm)
    and an MBart decoder (scaled token embeddings, learned positions offset by 2, an
    embedding norm, pre-norm layers, a final norm), for the decoder's answer ``span``:
    ``(patch relevance (B, P), decoder token relevance (B, T))``, the patches' taken at the
    patch embeddings' outputs."""
    swin, decoder = model.encoder, model.decoder.model.decoder
    tokens, stage = swin.embeddings.patch_embeddings(pixel_values)
    patches = tokens.detach().clone().requires_grad_()
    terms = Terms(decoder.embed_tokens.weight[decoder_ids].detach().clone().requires_grad_())
    states = _swin_stages(swin, _layer_norm(patches, swin.embeddings.norm, terms), stage, terms, _donut_swin_parts)
    attend = _decoder_attention(model.decoder.config, terms)
    positions = decoder.embed_positions.weight[torch.arange(decoder_ids.shape[1]) + 2]
    hidden = terms.tokens * decoder.embed_tokens.embed_scale + terms.leaf(positions[None].expand_as(terms.tokens))
    hidden = _layer_norm(hidden, decoder.layernorm_embedding, terms)
    causal = _causal_mask(torch.ones_like(decoder_ids))
    for layer in decoder.layers:
        normed = _layer_norm(hidden, layer.self_attn_layer_norm, terms)
        hidden = hidden + attend(layer.self_attn, normed, normed, causal)
        hidden = hidden + attend(layer.encoder_attn, _layer_norm(hidden, layer.encoder_attn_layer_norm, terms), states, torch.zeros(()))
        inner = identity(F.gelu, _linear(_layer_norm(hidden, layer.final_layer_norm, terms), layer.fc1, terms))
        hidden = hidden + _linear(inner, layer.fc2, terms)
    log_probs = _linear(_layer_norm(hidden, decoder.layer_norm, terms), model.decoder.lm_head, terms).log_softmax(dim=-1)
    return _caption_relevance(patches, terms, log_probs, span)



def git_relevance(model, input_ids: Tensor, features: Tensor, span: Tensor) -> tuple[Tensor, Tensor]:
    """AttnLRP of a GIT's text model for the answer ``span`` (the last tokens of
    ``input_ids``, unpadded): ``(image feature relevance (B, F), token relevance (B, T))``,
    the features being the visual projection's outputs ``(B, F, d)``."""
    terms = Terms(model.git.embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_())
    leaf = features.detach().clone().requires_grad_()
    feature_grad, token_grad = torch.autograd.grad(_git_explained(model, terms, leaf, input_ids, span), [leaf, terms.tokens])
    return (leaf.detach() * feature_grad).sum(dim=-1), (terms.tokens.detach() * token_grad).sum(dim=-1)


def git_pixel_relevance(model, input_ids: Tensor, pixel_values: Tensor, span: Tensor, baseline: float) -> tuple[Tensor, Tensor]:
    """:func:`git_relevance` carried through GIT's image encoder (a CLIP vision
    transformer, its post-norm) and its visual projection (linear, norm) to the pixels:
    ``(token relevance (B, T), pixel relevance (x - baseline)·g shaped as pixel_values)``."""
    terms = Terms(model.git.embeddings.word_embeddings.weight.detach()[input_ids].clone().requires_grad_())
    pixels = pixel_values.detach().clone().requires_grad_()
    vision, projection = model.git.image_encoder.vision_model, model.git.visual_projection.visual_projection
    hidden = _layer_norm(_clip_tower(vision, pixels, vision.encoder.layers, terms), vision.post_layernorm, terms)
    features = _layer_norm(_linear(hidden, projection[0], terms), projection[1], terms)
    token_grad, pixel_grad = torch.autograd.grad(_git_explained(model, terms, features, input_ids, span), [terms.tokens, pixels])
    return (terms.tokens.detach() * token_grad).sum(dim=-1), (pixel_values - baseline) * pixel_grad


def _git_explained(model, terms: Terms, features: Tensor, input_ids: Tensor, span: Tensor) -> Tensor:
    """The summed log-probability of ``span`` under the rules: the image's ``features``
    first, then the tokens' embeddings (``terms.tokens`` with their positions, normed);
    the image's positions see each other both ways and no token, each token sees them and
    the tokens up to it; BERT layers (post-norm, GELU), then the output head."""
    git, heads = model.git, model.config.num_attention_heads
    images, length = features.shape[1], input_ids.shape[1]
    positions = terms.leaf(git.embeddings.position_embeddings.weight[:length][None].expand(len(input_ids), -1, -1))
    hidden = torch.cat([features, _layer_norm(terms.tokens + positions, git.embeddings.LayerNorm, terms)], dim=1)
    total = images + length
    visible = torch.zeros(total, total, dtype=torch.bool)
    visible[:, :images] = True
    visible[images:, images:] = torch.ones(length, length).tril().bool()
    bias = torch.zeros(total, total).masked_fill(~visible, torch.finfo(torch.float32).min)
    for layer in git.encoder.layer:
        attention = layer.attention
        q, k, v = (_heads(_linear(hidden, getattr(attention.self, n), terms), heads) for n in ("query", "key", "value"))
        context = _attend(q, k, v, q.shape[-1] ** -0.5, bias, terms)
        hidden = _layer_norm(_linear(context, attention.output.dense, terms) + hidden, attention.output.LayerNorm, terms)
        inner = identity(F.gelu, _linear(hidden, layer.intermediate.dense, terms))
        hidden = _layer_norm(_linear(inner, layer.output.dense, terms) + hidden, layer.output.LayerNorm, terms)
    read = torch.arange(total - span.shape[1] - 1, total - 1)
    log_probs = _linear(hidden[:, read], model.output, terms).log_softmax(dim=-1)
    return log_probs.gather(2, span[..., None])[..., 0].sum()
