"""Tiny models built from configs with fixed seeds: nothing is downloaded."""

from __future__ import annotations

import os

# Triton reads this when it is first imported (torch's compiler imports it too): the kernels
# of maps.fused then run on CPU tensors, in Triton's interpreter (tests/test_fused_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import signal  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules.module import register_module_forward_pre_hook  # noqa: E402

from constants import NUM_LABELS, VOCAB  # noqa: E402

FAMILIES = ("bert", "roberta", "distilbert", "electra", "albert")


def _configs() -> dict[str, Callable[[], nn.Module]]:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        num_labels=NUM_LABELS,
        initializer_range=0.3,
    )
    return {
        "bert": lambda: tf.BertForSequenceClassification(tf.BertConfig(**common)),
        "roberta": lambda: tf.RobertaForSequenceClassification(
            tf.RobertaConfig(**common, pad_token_id=1)
        ),
        "electra": lambda: tf.ElectraForSequenceClassification(
            tf.ElectraConfig(**common, embedding_size=24)
        ),
        "albert": lambda: tf.AlbertForSequenceClassification(
            tf.AlbertConfig(**common, embedding_size=24)
        ),
        "deberta": lambda: tf.DebertaForSequenceClassification(  # its attention is read from what it returns
            tf.DebertaConfig(**common, pad_token_id=0)
        ),
        "bart": lambda: tf.BartForSequenceClassification(  # an encoder-decoder: its decoder reads the input ids shifted
            tf.BartConfig(
                vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
                num_labels=NUM_LABELS, pad_token_id=1, bos_token_id=0, eos_token_id=2, init_std=0.3,
            )
        ),
        "distilbert": lambda: tf.DistilBertForSequenceClassification(
            tf.DistilBertConfig(
                vocab_size=VOCAB,
                dim=32,
                n_layers=3,
                n_heads=4,
                hidden_dim=48,
                max_position_embeddings=64,
                num_labels=NUM_LABELS,
                initializer_range=0.3,
            )
        ),
    }


def make_model(family: str, seed: int = 0) -> nn.Module:
    """A tiny classifier of ``family``, in eval mode, with the default (sdpa) attention."""
    torch.manual_seed(seed)
    return _configs()[family]().eval()


def with_random_biases(model: nn.Module, scale: float = 0.05, seed: int = 3) -> nn.Module:
    """``model`` with its biases drawn around 0 and its norms' weights around 1 (standard
    deviation ``scale``), away from transformers' (zero, one) initialisation, under which
    a method's treatment of biases and norm scales would go untested."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                shift = 1.0 if name.endswith("weight") else 0.0
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale + shift)
    return model


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(dim=1).tolist()


def make_batch(model: nn.Module, lengths: tuple[int, ...] = (9, 6, 4), seed: int = 1) -> Batch:
    """Right-padded token ids (pad = the model's pad id) and their mask."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = max(lengths)
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", 0) or 0
    ids = torch.randint(3, VOCAB, (len(lengths), seq_len), generator=generator)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
        ids[row, length:] = pad_id
    return Batch(ids, mask)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@dataclass
class Reference:
    """Attention and dS/dA straight from transformers' ``output_attentions``."""

    attentions: list[torch.Tensor]
    grads: list[torch.Tensor]
    logits: torch.Tensor
    targets: torch.Tensor


def reference_attention(
    model: nn.Module, batch: Batch, target: int | None = None, queries: torch.Tensor | None = None
) -> Reference:
    """Recompute attention and its gradient independently of captum_attention (the
    logits at ``queries``, one position per example, of a model with logits at every
    position)."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    out = ref(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_attentions=True
    )
    logits = out.logits if queries is None else out.logits[torch.arange(len(queries)), queries]
    targets = logits.argmax(1) if target is None else torch.full((len(logits),), target)
    score = logits[torch.arange(len(logits)), targets].sum()
    grads = torch.autograd.grad(score, out.attentions)
    return Reference(
        [a.detach() for a in out.attentions], list(grads), logits.detach(), targets
    )


def assert_scores_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Close up to ``rel`` of the scores' scale (Grad-SAM scores can be tiny)."""
    scale = expected.abs().max().clamp(min=1e-30)
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rel, atol=rel * scale.item())


@contextmanager
def counted_calls(model: nn.Module) -> Iterator[list[int]]:
    """The calls of ``model`` itself in the block, counted by a global hook (one on the model
    would be the user's, which the left-padding check probes again)."""
    calls: list[int] = []
    handle = register_module_forward_pre_hook(lambda module, args: calls.append(1) if module is model else None)
    try:
        yield calls
    finally:
        handle.remove()


def model_state(model: nn.Module) -> dict:
    """Everything about ``model`` that an explanation must leave as it found it."""
    return {
        "hooks": [
            (
                name,
                tuple(module._forward_hooks),
                tuple(module._forward_pre_hooks),
                tuple(module._backward_hooks),
                tuple(getattr(module, "_backward_pre_hooks", {})),
            )
            for name, module in model.named_modules()
        ],
        "training": [module.training for module in model.modules()],
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "params": [_plain(p.detach()).clone() for p in model.parameters()],
        "own forwards": [(name, vars(module).get("forward")) for name, module in model.named_modules()],
        "graph-tied tensors": [
            (name, key) for name, module in model.named_modules()
            for key, value in (*vars(module).items(), *module._buffers.items())
            if isinstance(value, torch.Tensor) and value.grad_fn is not None
        ],
    }


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """A weight quantized as a tensor subclass (torchao's, optimum-quanto's) as the float
    matrix it stands for, which torch.equal compares; any other as it is."""
    return weight.dequantize() if type(weight) not in (torch.Tensor, nn.Parameter) else weight


def counted(function: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    """``function``, noting its name in ``calls`` at each call (to check a path is taken)."""

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(function.__name__)
        return function(*args, **kwargs)

    return counting


@pytest.fixture
def failing_compiler(monkeypatch: pytest.MonkeyPatch) -> str:
    """``torch.compile`` gives functions that raise, as on a machine without a C++
    compiler; returns the error's message."""
    message = "no C++ compiler found"

    def no_compiler(function: Callable[..., Any], **options: Any) -> Callable[..., Any]:
        def fails(*args: Any) -> Any:
            raise RuntimeError(message)
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    return message


def assert_same_state(before: dict, after: dict) -> None:
    for key in ("hooks", "training", "attn_implementation", "requires_grad"):
        assert before[key] == after[key], f"model {key} changed"
    for old, new in zip(before["grads"], after["grads"]):
        assert (old is None) == (new is None), "a parameter's .grad appeared or vanished"
        if old is not None:
            assert torch.equal(old, new), "a parameter's .grad changed"
    for old, new in zip(before["params"], after["params"]):
        assert torch.equal(old, new), "a parameter changed"
    assert before["graph-tied tensors"] == after["graph-tied tensors"], "a module kept a tensor tied to the call's graph"


def assert_refused_in_one_line(model: nn.Module, call: Callable[[], object], match: str) -> None:
    """``call()`` raises :class:`~captum_attention.UnsupportedModelError` matching ``match``
    in one line and leaves ``model`` as it found it."""
    from captum_attention import UnsupportedModelError

    before = model_state(model)
    with pytest.raises(UnsupportedModelError, match=match) as refused:
        call()
    assert "\n" not in str(refused.value)
    assert_same_state(before, model_state(model))


@pytest.fixture(params=["streaming", "eager"])
def capture_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once with the default capture (streaming wherever it is exact) and once
    with eager capture everywhere (Hugging Face models then never stream)."""
    from captum_attention.capture import HuggingFaceAdapter

    if request.param == "eager":
        monkeypatch.setattr(HuggingFaceAdapter, "streams", False)
    return request.param


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny Llama causal LM and its word-level tokenizer, saved as a local checkpoint."""
    from lm_models import make_decoder, make_word_tokenizer

    folder = tmp_path_factory.mktemp("llm") / "llama"
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny BART and the word-level tokenizer, saved as a local checkpoint."""
    from lm_models import make_encoder_decoder, make_word_tokenizer

    folder = tmp_path_factory.mktemp("seq2seq") / "bart"
    make_encoder_decoder("bart").save_pretrained(folder)
    make_word_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def translation(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny M2M100 and NLLB's tokenizer with its language codes, saved as a local checkpoint."""
    from lm_models import make_translation_model, make_translation_tokenizer

    folder = tmp_path_factory.mktemp("translation") / "nllb"
    tokenizer = make_translation_tokenizer()
    make_translation_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def killed_part_way(command: list[str], shards: Any, at_least: int, environment: dict[str, str]) -> int:
    """Start ``command``, SIGKILL it once ``shards`` holds ``at_least`` shard files; how
    many it had written."""
    import signal
    import subprocess
    import time

    process = subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(shards.glob("batch-*.jsonl"))) < at_least:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return len(list(shards.glob("batch-*.jsonl")))


class SwallowsCtrlC:
    """Ctrl-C inside a finaliser: Python can only report the KeyboardInterrupt there, not
    raise it, and the code that dropped the object goes on."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):  # its handler runs in here, at a loop's back edge
            pass
