"""The capture layer: what it finds, what it records, and that it always cleans up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, make_batch, make_model, model_state
from torch import nn

from captum_attention import AttentionCapture, GradSAM, ModuleAdapter, RawAttention, TransformerAttribution
from captum_attention.capture import AttentionNotFoundError


def test_records_one_map_per_layer_and_the_mask(family):
    model = make_model(family)
    batch = make_batch(model)
    with AttentionCapture(model) as capture:
        model(batch.input_ids, attention_mask=batch.attention_mask)
    assert len(capture.attn_probs) == 3
    assert all(p.shape == (3, 4, 9, 9) for p in capture.attn_probs)
    assert torch.equal(capture.attention_mask, batch.attention_mask)
    assert model.config._attn_implementation == "sdpa"


def test_does_not_install_transformers_persistent_hooks():
    model = make_model("bert")
    batch = make_batch(model)
    GradSAM(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert not getattr(model, "_output_capturing_hooks_installed", False)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_capture_entered_twice_at_once_is_refused_and_the_model_left_clean():
    """The same capture nested in itself installed its hooks a second time over the first:
    the first's were never removed. Entered again after its exit, it records afresh."""
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    capture = AttentionCapture(model)
    with capture:
        with pytest.raises(RuntimeError, match=r"^This AttentionCapture is already open: nest another one"):
            with capture:
                pass
        model(batch.input_ids, attention_mask=batch.attention_mask)
    assert len(capture.attn_probs) == 3
    assert_same_state(before, model_state(model))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with capture:
        model(batch.input_ids, attention_mask=batch.attention_mask)
    assert len(capture.attn_probs) == 3 and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("cls", [GradSAM, TransformerAttribution])
def test_everything_restored_when_forward_raises_midway(family, cls):
    model = make_model(family)
    batch = make_batch(model)
    for param in list(model.parameters())[::2]:
        param.grad = torch.ones_like(param)

    def explode(module, args, output):
        raise Boom("the second layer failed")

    layers = [m for m in model.modules() if type(m).__name__.endswith(("Layer", "TransformerBlock"))]
    user_hook = layers[min(1, len(layers) - 1)].register_forward_hook(explode)
    before = model_state(model)
    with pytest.raises(Boom):
        cls(model).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    assert_same_state(before, model_state(model))
    user_hook.remove()


def test_everything_restored_when_backward_target_is_bad():
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    with pytest.raises(ValueError, match="out of range"):
        GradSAM(model).attribute(batch.input_ids, target=7, additional_forward_args=(batch.attention_mask,))
    assert_same_state(before, model_state(model))


def test_model_without_attention_gets_a_clear_error():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).eval()
    with pytest.raises(AttentionNotFoundError, match="ModuleAdapter"):
        GradSAM(model).attribute(torch.zeros(2, 3, dtype=torch.long), target=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class Softmax(nn.Module):
    """A named softmax, so its output (the probabilities) can be captured."""

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return F.softmax(scores, dim=-1)


class TinyAttentionClassifier(nn.Module):
    """A textbook single-head attention model, written inline."""

    def __init__(self, vocab: int = 20, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.softmax = nn.ModuleList(Softmax() for _ in range(layers))
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(ids)
        for qkv, softmax in zip(self.qkv, self.softmax):
            q, k, v = qkv(hidden).chunk(3, dim=-1)
            scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
            if attention_mask is not None:
                scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
            hidden = hidden + softmax(scores) @ v
        return self.head(hidden[:, 0])


def test_module_adapter_on_a_hand_written_model():
    torch.manual_seed(0)
    model = TinyAttentionClassifier().eval()
    adapter = ModuleAdapter(list(model.softmax), mask_module=model)
    ids = torch.randint(0, 20, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    explainer = TransformerAttribution(model, adapter=adapter)
    scores = explainer.attribute(ids, target=1, additional_forward_args=(mask,))

    probs = []
    hooks = [m.register_forward_hook(lambda m, a, o: probs.append(o)) for m in model.softmax]
    logits = model(ids, mask)
    for hook in hooks:
        hook.remove()
    grads = torch.autograd.grad(logits[:, 1].sum(), probs)
    for b, n in enumerate([6, 4]):
        relevance = torch.eye(n)
        for a, g in zip(probs, grads):
            relevance = relevance + (a[b, :n, :n] * g[b, :n, :n]).clamp(min=0) @ relevance
        torch.testing.assert_close(scores[b, :n], relevance[0])
        assert (scores[b, n:] == 0).all()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("capture", ["eager", "streaming"])
def test_the_tensors_a_forward_keeps_in_the_model_are_put_back(capture):
    """RecurrentGemma keeps its recurrent and convolution states as module attributes,
    which a forward in the autograd graph leaves tied to the call's graph (the model then
    no longer deep-copies); a module that keeps its last output adds one. After a call
    they hold what the forward gave them, cut from the graph, as a forward without
    gradients leaves them, and the model copies."""
    import copy

    import transformers as tf

    torch.manual_seed(0)
    config = tf.RecurrentGemmaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=36, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, lru_width=32, block_types=["recurrent", "attention"], attention_window_size=16,
    )
    model = tf.RecurrentGemmaForCausalLM(config).eval()
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)  # the states it keeps between calls, as a user's earlier call leaves them
    attention = model.model.layers[1].temporal_block
    keeping = attention.forward

    def kept(*args, **kwargs):
        out = keeping(*args, **kwargs)
        attention.last_output = out[0] if isinstance(out, tuple) else out
        return out

    attention.forward = kept
    before = model_state(model)
    GradSAM(model, capture=capture).attribute(ids, additional_forward_args=(torch.ones_like(ids),))
    assert_same_state(before, model_state(model))
    with torch.no_grad():
        model(ids)
    expected = {(name, key): value for name, module in model.named_modules() for key, value in vars(module).items()
                if isinstance(value, torch.Tensor)}
    GradSAM(model, capture=capture).attribute(ids, additional_forward_args=(torch.ones_like(ids),))
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                assert value.grad_fn is None, (name, key)
                torch.testing.assert_close(value, expected[name, key], rtol=0, atol=1e-6)
    copy.deepcopy(model)


def test_a_dynamic_rotary_embedding_is_left_as_found_with_the_length_it_was_built_for():
    """A dynamic rotary embedding grows its frequencies (a buffer) and the length they were
    built for (an attribute) on a long input: both stay as the forward left them, so the
    model reads a short input afterwards exactly as before (putting back only the length
    once left the grown frequencies in place, and the short input read at them)."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    model = tf.LlamaForCausalLM(config).eval()
    short, long = torch.randint(3, 100, (1, 8)), torch.randint(3, 100, (1, 40))
    with torch.no_grad():
        before = model(short).logits
    GradSAM(model).attribute(long)
    with torch.no_grad():
        torch.testing.assert_close(model(short).logits, before, rtol=0, atol=0)


def test_adapters_keep_no_state_between_calls():
    from captum_attention.capture import HuggingFaceAdapter

    model = make_model("bert")
    batch = make_batch(model)
    adapter = HuggingFaceAdapter()
    before = dict(vars(adapter))
    GradSAM(model, adapter=adapter).attribute(batch.input_ids, target=0, additional_forward_args=(batch.attention_mask,))
    RawAttention(model, adapter=adapter, capture="eager").attribute(batch.input_ids, additional_forward_args=(batch.attention_mask,))
    assert vars(adapter) == before


def test_layers_and_projections_follow_a_changed_tree_and_keep_no_model_alive():
    """Each attention's layer and output projection, found from a map of the model's tree
    kept per model: a layer replaced, or two layers' attentions swapped, after a first call
    are found where they are now, and the map keeps neither the model nor its modules alive."""
    import copy
    import gc
    import weakref

    from captum_attention.capture import default_adapter
    from captum_attention.capture.probes import layer_blocks

    model = make_model("bert")
    adapter = default_adapter(model)
    layers = model.bert.encoder.layer
    assert layer_blocks(model, adapter) == list(layers)
    layers[1] = copy.deepcopy(layers[1])
    assert layer_blocks(model, adapter) == list(layers)
    layers[0].attention, layers[1].attention = layers[1].attention, layers[0].attention
    assert layer_blocks(model, adapter) == list(layers)
    assert adapter.output_projection(model, layers[1].attention.self) is layers[1].attention.output.dense.weight
    gone = weakref.ref(model)
    del model, layers, adapter
    gc.collect()
    assert gone() is None
