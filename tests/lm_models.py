"""Tiny decoder, encoder-decoder and vision models built from configs (fixed seeds)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from constants import VOCAB
from torch import nn

DECODERS = ("gpt2", "llama", "qwen2")
ENCODER_DECODERS = ("t5", "bart")
VISION = ("vit", "deit")


def make_decoder(name: str, seed: int = 0) -> nn.Module:
    """A tiny causal LM; Llama and Qwen2 use grouped-query attention (4 heads, 2 KV heads)."""
    torch.manual_seed(seed)
    gqa = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    configs = {
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            )
        ),
        "gptj": lambda: tf.GPTJForCausalLM(  # attention beside the feed-forward, both reading one norm
            tf.GPTJConfig(
                vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=64,
                initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            )
        ),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**gqa)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**gqa)),
        "arcee": lambda: tf.ArceeForCausalLM(tf.ArceeConfig(**gqa)),  # no bias, a feed-forward without a gate (ReLU²)
        # a logit softcap small enough to bend the logits, and a window shorter than the prompts
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**gqa, head_dim=8, attn_logit_softcapping=0.5, sliding_window=4)),
        # each layer's output times its own number (no per-layer input's branch, no key-value sharing)
        "gemma4": lambda: _with_layer_scalars(tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
            **gqa, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=0, sliding_window=4,
        ))),
        "gpt_oss": lambda: _with_sinks(tf.GptOssForCausalLM(tf.GptOssConfig(
            **gqa, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ))),
    }
    return configs[name]().eval()


def make_learned_position_decoder(family: str) -> nn.Module:
    """A tiny causal LM whose positions are learned: BART's decoder and XLM count them
    from the first column whatever the position ids, Whisper's decoder reads the position
    ids, RoBERTa counts them from the ids past the padding."""
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    models = {
        "bart": lambda: tf.BartForCausalLM(tf.BartConfig(
            **small, d_model=16, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=32, max_position_embeddings=64,
        )),
        "xlm": lambda: tf.XLMWithLMHeadModel(tf.XLMConfig(
            **small, emb_dim=16, n_layers=2, n_heads=2, causal=True, max_position_embeddings=64,
        )),
        "whisper": lambda: tf.WhisperForCausalLM(tf.WhisperConfig(
            **small, d_model=16, decoder_layers=2, decoder_attention_heads=2, decoder_ffn_dim=32, encoder_layers=1,
            encoder_attention_heads=2, encoder_ffn_dim=32, max_target_positions=64, decoder_start_token_id=1,
        )),
        "roberta": lambda: tf.RobertaForCausalLM(tf.RobertaConfig(
            **small, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=72, is_decoder=True,
        )),
    }
    return models[family]().eval()


EXPLICIT_DECODERS = ("gemma2", "gpt_oss")
"""Decoders whose attention sdpa cannot compute: Gemma-2's logit softcap, gpt-oss's sinks."""


def _with_layer_scalars(model: nn.Module) -> nn.Module:
    """Gemma-4 with each layer's ``layer_scalar`` (one at initialisation) away from one."""
    with torch.no_grad():
        for layer, scalar in zip(model.model.layers, (0.6, 1.7, 0.8)):
            layer.layer_scalar.fill_(scalar)
    return model


def _with_sinks(model: nn.Module) -> nn.Module:
    """gpt-oss with sink logits of either sign, large enough to take a visible share of rows."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), nn.Parameter):
                module.sinks.copy_(torch.randn(module.sinks.shape, generator=generator) * 2)
    return model


WORDS = [
    "<pad>", "<s>", "</s>", "the", "a", "cat", "dog", "bird", "fish", "sat", "ran", "flew", "swam", "on", "in",
    "under", "over", "mat", "tree", "river", "sky", "red", "blue", "green", "big", "small", "is", "was", "and",
    "but", "key", "value", "door", "opens", "with", "code", "secret", "answer", "question", "what", "where",
    "who", "when", "why", "how", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "zero", "yes", "no", "maybe", "here", "there", "now", "then", ".", "?",
]
"""The tiny decoders' vocabulary as words (ids 0, 1, 2: padding, BOS, EOS)."""


def make_word_tokenizer(bos: bool = True) -> tf.PreTrainedTokenizerFast:
    """A whitespace word-level fast tokenizer over :data:`WORDS` that prepends BOS (with
    ``bos=False`` none, as GPT-2's and Qwen's add none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tf.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def make_translation_tokenizer() -> tf.NllbTokenizer:
    """NLLB's tokenizer over :data:`WORDS` (each word one token, after its space mark),
    with NLLB's language codes as its special tokens: the source is written
    ``<src_lang> words </s>``."""
    words = [w for w in WORDS[3:] if w.isalpha()]
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "\u2581": 4}
    merges = []
    for word in words:
        for length in range(1, len(word) + 1):
            piece = "\u2581" + word[:length]
            if piece not in vocab:
                vocab[piece] = len(vocab)
                merges.append(("\u2581" + word[: length - 1], word[length - 1]))
            vocab.setdefault(word[length - 1], len(vocab))
    return tf.NllbTokenizer(vocab=vocab, merges=merges)


def make_translation_model(vocab_size: int, seed: int = 0) -> nn.Module:
    """A tiny M2M100 (NLLB's architecture) for :func:`make_translation_tokenizer`'s ids."""
    torch.manual_seed(seed)
    config = tf.M2M100Config(
        vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
        init_std=0.3, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    return tf.M2M100ForConditionalGeneration(config).eval()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}question {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}answer{% endif %}"
)
"""A chat template in :data:`WORDS`: "<s>question MESSAGE answer", its BOS written as
Llama's, Gemma's and Mistral's templates write theirs."""


def make_byte_level_tokenizer(text: str, trim_offsets: bool = False) -> tf.PreTrainedTokenizerFast:
    """A byte-level BPE fast tokenizer trained on ``text``, as GPT-2's, Llama-3's and
    Qwen2's are: its tokens carry their space as a mark ("Ġthe"), and (unless
    ``trim_offsets``) a token's offsets start at that space."""
    from tokenizers import processors

    core = _byte_level_core(text, ["<|endoftext|>"])
    core.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    return tf.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def make_roberta_tokenizer(text: str) -> tf.RobertaTokenizerFast:
    """RoBERTa's kind of tokenizer trained on ``text``: byte-level BPE ("Ġthe"), a pair
    read as ``<s> A </s></s> B </s>``, no token types, ``<mask>`` its mask."""
    from tokenizers import processors

    core = _byte_level_core(text, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    core.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True, add_prefix_space=False)
    return tf.RobertaTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
        pad_token="<pad>", mask_token="<mask>",
    )


def make_sentencepiece_tokenizer(text: str) -> tf.XLMRobertaTokenizerFast:
    """XLM-R's kind of tokenizer trained on ``text``: a SentencePiece unigram model whose
    tokens carry their space as a mark ("▁the", a lone "▁"), whose offsets hold that
    space, and whose decoded ids re-encode otherwise where a text is cut mid-word; ``<s>
    A </s>``, ``<mask>`` its mask."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    core = Tokenizer(models.Unigram())
    core.pre_tokenizer, core.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=60, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>")
    core.train_from_iterator([text] * 20, trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                        special_tokens=[("<s>", 0), ("</s>", 2)])
    return tf.XLMRobertaTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
        pad_token="<pad>", mask_token="<mask>",
    )


def _byte_level_core(text: str, special_tokens: list[str]) -> Any:
    """A byte-level BPE model trained on ``text`` (300 tokens), ``special_tokens`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([text] * 20, trainer)
    return core


def make_encoder_decoder(name: str, seed: int = 0, classifier: bool = False, vocab_size: int = VOCAB) -> nn.Module:
    """A tiny T5 or BART, a language model; with ``classifier``, the same stacks as a
    sequence classifier of 3 classes (its decoder reads the input ids shifted right)."""
    torch.manual_seed(seed)
    head = dict(num_labels=3) if classifier else {}
    if name == "t5":
        config = tf.T5Config(
            vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
            num_heads=4, initializer_factor=3.0, pad_token_id=0, eos_token_id=2,
            decoder_start_token_id=0, **head,
        )
        return (tf.T5ForSequenceClassification if classifier else tf.T5ForConditionalGeneration)(config).eval()
    config = tf.BartConfig(
        vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=64, init_std=0.3, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, **head,
    )
    return (tf.BartForSequenceClassification if classifier else tf.BartForConditionalGeneration)(config).eval()


def make_vision(name: str, seed: int = 0) -> nn.Module:
    """A tiny ViT/DeiT classifier on 16×16 images with 4×4 patches (a 4×4 grid)."""
    torch.manual_seed(seed)
    common = dict(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=48, initializer_range=0.3, num_labels=3,
    )
    if name == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(**common)).eval()
    model = tf.DeiTForImageClassificationWithTeacher(tf.DeiTConfig(**common)).eval()
    embeddings = model.deit.embeddings
    with torch.no_grad():  # built at zero, the class and distillation tokens would be one token twice
        for parameter in (embeddings.cls_token, embeddings.distillation_token, embeddings.position_embeddings):
            parameter.normal_(std=0.3)
    return model


@dataclass
class Prompts:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def real(self) -> torch.Tensor:
        return self.attention_mask.bool()


def make_prompts(lengths: tuple[int, ...] = (7, 5, 3), side: str = "left", seed: int = 1) -> Prompts:
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), seq_len), generator=generator)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        span = slice(seq_len - length, seq_len) if side == "left" else slice(0, length)
        mask[row, span] = 1
    return Prompts(ids.masked_fill(mask == 0, 0), mask)


@dataclass
class LMReference:
    attentions: list[torch.Tensor]
    grads: list[torch.Tensor]
    targets: torch.Tensor


def lm_reference(model: nn.Module, prompts: Prompts, positions: torch.Tensor, target: torch.Tensor | None = None) -> LMReference:
    """Attention and d logit[b, positions[b], target[b]] / dA from output_attentions."""
    def score(all_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = all_logits[torch.arange(len(positions)), positions]
        targets = logits.argmax(-1) if target is None else target
        return logits.gather(1, targets[:, None]).sum(), targets

    return _reference(model, prompts, score)


def lm_span_reference(model: nn.Module, prompts: Prompts, span: torch.Tensor) -> LMReference:
    """Attention and dS/dA from output_attentions for S = Σ_b Σ_k log p(span[b, k]), the
    span being the last K tokens of the prompts (read at positions T - K - 1 + k)."""
    def score(all_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length, k = all_logits.shape[1], span.shape[1]
        log_probs = all_logits[:, length - k - 1 : length - 1].log_softmax(dim=-1)
        return log_probs.gather(2, span[..., None]).sum(), span

    return _reference(model, prompts, score)


def _reference(model: nn.Module, prompts: Prompts, score) -> LMReference:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    position_ids = (prompts.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = ref(
        input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
        position_ids=position_ids, output_attentions=True,
    )
    explained, targets = score(out.logits)
    grads = torch.autograd.grad(explained, out.attentions)
    return LMReference([a.detach() for a in out.attentions], list(grads), targets)


def one_stack_case(family: str):
    """``(model, ids, mask, query)`` for the single-stack method tests: the test suite's BERT
    or ALBERT with its right-padded batch (query: the first position), or a tiny decoder with
    left-padded prompts (query: the last position); biases and norm weights drawn at
    random."""
    from conftest import make_batch, make_model, with_random_biases

    if family in ("bert", "albert"):
        model = with_random_biases(make_model(family), scale=0.3)
        batch = make_batch(model)
        return model, batch.input_ids, batch.attention_mask, 0
    prompts = make_prompts(side="left")
    return with_random_biases(make_decoder(family), scale=0.3), prompts.input_ids, prompts.attention_mask, prompts.input_ids.shape[1] - 1


def explains_through_the_llm_interface(explainer) -> None:
    """``LLMAttentionAttribution`` takes the explainer: one non-negative score per prompt
    token of a word-level prompt (BOS included)."""
    from captum.attr import TextTokenInput

    from captum_attention import LLMAttentionAttribution

    tokenizer = make_word_tokenizer()
    result = LLMAttentionAttribution(explainer, tokenizer).attribute(TextTokenInput("the secret code is", tokenizer), target="seven")
    assert result.seq_attr.shape == (5,) and bool((result.seq_attr >= 0).all())


def answer_rows(explainer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An answer of two tokens to the left-padded prompts, explained by ``explainer``: the
    span is checked to sum the rows; returns the rows ``(B, 2, T)`` and the ids and mask of
    the prompts with the answer's first token (where the second row explains)."""
    prompts = make_prompts(side="left")
    answer = torch.tensor([[5, 9], [7, 3], [11, 4]])
    args = (prompts.attention_mask,)
    span = explainer.attribute_span(prompts.input_ids, answer, additional_forward_args=args)
    rows = explainer.attribute_continuation(prompts.input_ids, answer, additional_forward_args=args)
    torch.testing.assert_close(span, rows.sum(dim=1))
    ids = torch.cat([prompts.input_ids, answer[:, :1]], dim=1)
    return rows, ids, torch.cat([prompts.attention_mask, torch.ones_like(answer[:, :1])], dim=1)
