"""Learned head weights (AT2's idea, Cohen-Wang et al. 2025, on any architecture):
``LearnedAttention`` against Σ_lh θ_lh Σ_q w_q A^lh_qj from the eager model's
``output_attentions``; ``HeadWeights.fit`` against the ridge fit written out from the
definition (ablated prompts built and scored by hand, features from ``output_attentions``);
a fit interrupted and resumed equals one run through; the weights round-trip through
safetensors."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import SwallowsCtrlC, assert_same_state, model_state
from lm_models import answer_rows, explains_through_the_llm_interface, make_decoder, one_stack_case

from captum_attention import HeadWeights, LearnedAttention
from captum_attention.attr import METHODS, REGISTRY
from captum_attention.capture.identity import fitted_model
from captum_attention.metrics import head_weights as fitting


def _attentions(model, family: str, ids, mask) -> torch.Tensor:
    """``(L, B, H, T, T)`` from an eager copy's ``output_attentions``."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    positions = {} if family == "bert" else {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    with torch.no_grad():
        return torch.stack(eager(ids, attention_mask=mask, output_attentions=True, **positions).attentions).double()


@pytest.mark.parametrize("family", ["bert", "llama", "gpt2"])
def test_learned_attention_weighs_every_heads_row(family, capture_mode):
    model, ids, mask, query = one_stack_case(family)
    attentions = _attentions(model, family, ids, mask)
    theta = torch.randn(attentions.shape[0], attentions.shape[2], generator=torch.Generator().manual_seed(3))
    before = model_state(model)
    scores = LearnedAttention(model, weights=HeadWeights(theta)).attribute(ids, additional_forward_args=(mask,))
    assert_same_state(before, model_state(model))
    expected = torch.zeros(ids.shape, dtype=torch.float64)
    for layer in range(attentions.shape[0]):
        for head in range(attentions.shape[2]):
            expected += theta[layer, head].double() * attentions[layer, :, head, query]
    expected = (expected * mask).float()
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_without_weights_it_is_the_mean_over_layers_and_heads_and_spans_sum_rows():
    model = make_decoder("llama")
    explainer = LearnedAttention(model)
    rows, ids, mask = answer_rows(explainer)
    mean = _attentions(model, "llama", ids, mask)[:, :, :, -1].mean(dim=(0, 2)).float() * mask
    torch.testing.assert_close(rows[:, 1, : ids.shape[1]], mean, rtol=1e-5, atol=1e-6)
    explains_through_the_llm_interface(explainer)


def test_registered_out_of_reports_and_weights_of_another_model_are_refused():
    assert REGISTRY["learned_attention"] is LearnedAttention and "learned_attention" not in METHODS
    model, ids, mask, _ = one_stack_case("bert")
    with pytest.raises(ValueError, match=r"head weights are \(2, 2\) \(layers, heads\) but the model's attention has") as refused:
        LearnedAttention(model, weights=HeadWeights(torch.ones(2, 2))).attribute(ids, additional_forward_args=(mask,))
    assert "\n" not in str(refused.value)
    for bad in (float("nan"), float("inf")):  # refused as the model's non-finite gradient before
        with pytest.raises(ValueError, match=r"^The head weights hold NaN or ±inf, which would make every score so: fit them"):
            LearnedAttention(model, weights=torch.full((2, 2), bad))
    for positional in (HeadWeights(torch.ones(2, 2)), torch.ones(2, 2)):  # Captum's second argument is the model
        with pytest.raises(TypeError, match=r"^LearnedAttention's second argument is the model, .*LearnedAttention\(model, weights=\.\.\.\)\.$"):
            LearnedAttention(model, positional)


def _examples(count: int = 4):
    generator = torch.Generator().manual_seed(11)
    examples = []
    for index in range(count):
        prompt = torch.randint(5, 60, (6 + index % 3,), generator=generator)
        answer = torch.randint(5, 60, (2,), generator=generator)
        segments = torch.tensor([-1] + [s // 2 for s in range(len(prompt) - 1)])  # BOS kept, pairs of tokens
        examples.append((prompt, answer, segments))
    return examples


def _log_prob(model, prompt: torch.Tensor, answer: torch.Tensor) -> float:
    ids = torch.cat([prompt, answer])[None]
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].double().log_softmax(-1)
    return float(sum(logits[len(prompt) - 1 + k, answer[k]] for k in range(len(answer))))


def reference_fit(model, examples, num_ablations: int, seed: int, ridge: float) -> torch.Tensor:
    rows, targets = [], []
    for index, (prompt, answer, segments) in enumerate(examples):
        count = int(segments.max()) + 1
        kept = torch.rand(1, num_ablations, count, generator=torch.Generator().manual_seed(seed + index)) < 0.5
        outcomes = torch.tensor([_log_prob(model, prompt[(segments < 0) | mask[segments.clamp(min=0)]], answer) for mask in kept[0]], dtype=torch.float64)
        ids = torch.cat([prompt, answer])[None]
        attentions = _attentions(model, "llama", ids, torch.ones_like(ids))[:, 0]  # (L, H, T, T)
        answer_rows = attentions[:, :, len(prompt) - 1 : len(prompt) + len(answer) - 1, : len(prompt)].sum(dim=2)  # (L, H, N)
        features = torch.stack([answer_rows[..., segments == s].sum(-1) for s in range(count)], dim=-1).flatten(0, 1)
        design = kept[0].double() @ features.T
        rows.append(design - design.mean(dim=0))
        targets.append(outcomes - outcomes.mean())
    x, y = torch.cat(rows), torch.cat(targets)
    gram = x.T @ x
    theta = torch.linalg.solve(gram + ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=torch.float64), x.T @ y)
    return theta.view(attentions.shape[0], attentions.shape[1]).float()


def test_the_fit_is_the_ridge_solution_of_contextcites_objective():
    model, examples = make_decoder("llama"), _examples()
    weights = HeadWeights.fit(model, examples, num_ablations=6, seed=4, ridge=1e-2, progress=False)
    expected = reference_fit(model, examples, 6, 4, 1e-2)
    torch.testing.assert_close(weights.weights, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert weights.settings == {
        "examples": 4, "examples_sha256": fitting._examples_digest(examples), "num_ablations": 6, "seed": 4, "ridge": 1e-2,
        "model": fitted_model(model), "fit": "ridge",
    }


def test_a_fit_is_refused_for_the_model_trained_again_and_taken_for_it_cast():
    model, examples = make_decoder("llama"), _examples()
    weights = HeadWeights.fit(model, examples, num_ablations=4, progress=False)
    LearnedAttention(model, weights=weights)
    trained_again = copy.deepcopy(model)
    with torch.no_grad():
        trained_again.model.layers[0].mlp.down_proj.weight.mul_(1.001)
    with pytest.raises(ValueError, match="fitted to another model.*trained again since.*fit-head-weights") as refused:
        LearnedAttention(trained_again, weights=weights)
    assert "\n" not in str(refused.value)
    LearnedAttention(copy.deepcopy(model).to(torch.bfloat16), weights=weights)  # another dtype: taken as it is
    LearnedAttention(trained_again, weights=weights.weights)  # a bare tensor records no model
    LearnedAttention(trained_again, weights=HeadWeights(weights.weights, {"fit": "ridge"}))  # nor a fit without it


def test_offloaded_weights_are_compared_by_their_layout():
    """A model whose weights wait on the meta device (offloaded by Accelerate) has no
    values to compare: its fit is taken where the tensors' names and shapes match, at the
    fit or now, and refused where they do not."""
    model, examples = make_decoder("llama"), _examples()
    weights = HeadWeights.fit(model, examples, num_ablations=4, progress=False)
    offloaded = copy.deepcopy(model)
    down_proj = offloaded.model.layers[0].mlp.down_proj
    down_proj.weight = torch.nn.Parameter(torch.empty_like(down_proj.weight, device="meta"))
    assert fitted_model(offloaded)["offloaded"] and fitted_model(offloaded)["weights"] != fitted_model(model)["weights"]
    LearnedAttention(offloaded, weights=weights)  # fitted whole, explained offloaded
    LearnedAttention(model, weights=HeadWeights(weights.weights, {**weights.settings, "model": fitted_model(offloaded)}))
    other = copy.deepcopy(offloaded)
    other.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    with pytest.raises(ValueError, match="another model.*layout.*offloaded weights are not compared.*fit-head-weights"):
        LearnedAttention(other, weights=weights)


def _ctrl_c() -> None:
    raise KeyboardInterrupt


INTERRUPTS = {"raised in the third example": (3, _ctrl_c), "swallowed in the second": (2, SwallowsCtrlC)}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("interrupt", list(INTERRUPTS))
def test_an_interrupted_fit_resumes_to_the_same_weights_and_they_round_trip(interrupt, tmp_path, monkeypatch):
    """Ctrl-C stops the fit in the example it lands in; one whose KeyboardInterrupt Python
    swallowed (in a finaliser) stops it after that example: the checkpoint holds two
    examples either way."""
    model, examples = make_decoder("llama"), _examples()
    whole = HeadWeights.fit(model, examples, num_ablations=4, progress=False)
    checkpoint = tmp_path / "fit.safetensors"
    statistics, calls = fitting._example_statistics, []
    at, interrupting = INTERRUPTS[interrupt]

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            interrupting()
        return statistics(*args, **kwargs)

    monkeypatch.setattr(fitting, "_example_statistics", interrupted)
    with pytest.raises(KeyboardInterrupt):
        HeadWeights.fit(model, examples, num_ablations=4, progress=False, checkpoint=checkpoint)
    settings = {
        "examples": 4, "examples_sha256": fitting._examples_digest(examples), "num_ablations": 4, "seed": 0, "ridge": 1e-3,
        "model": fitted_model(model),
    }
    assert len(calls) == at and fitting._resume(checkpoint, settings)[0] == 2
    monkeypatch.setattr(fitting, "_example_statistics", statistics)
    resumed = HeadWeights.fit(model, examples, num_ablations=4, progress=False, checkpoint=checkpoint)
    assert torch.equal(resumed.weights, whole.weights)
    with pytest.raises(ValueError, match="give another checkpoint path, or the same settings"):
        HeadWeights.fit(model, examples, num_ablations=5, progress=False, checkpoint=checkpoint)
    other_examples = [(prompt.flip(0), answer, segments) for prompt, answer, segments in examples]  # as many
    assert fitting._examples_digest([(prompt, answer[0]) for prompt, answer, _ in examples])  # a one-token answer as a 0-d id
    with pytest.raises(ValueError, match="give another checkpoint path, or the same settings"):
        HeadWeights.fit(model, other_examples, num_ablations=4, progress=False, checkpoint=checkpoint)
    saved = resumed.save(tmp_path)
    assert saved.name == "head_weights.safetensors"
    assert resumed.save(tmp_path / "new" / "folder") == tmp_path / "new" / "folder" / "head_weights.safetensors"  # made
    loaded = HeadWeights.load(tmp_path)
    assert torch.equal(loaded.weights, resumed.weights) and loaded.settings == resumed.settings


def test_a_save_interrupted_mid_write_leaves_the_previous_weights_whole(tmp_path, monkeypatch):
    import safetensors.torch

    first = HeadWeights(torch.ones(2, 4), {"fit": "first"})
    first.save(tmp_path)
    write = safetensors.torch.save_file

    def cut_short(tensors, path, metadata=None):
        write(tensors, path, metadata=metadata)
        with open(path, "r+b") as written:
            written.truncate(10)  # what Ctrl-C during the write leaves
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", cut_short)
    with pytest.raises(KeyboardInterrupt):
        HeadWeights(torch.zeros(2, 4), {"fit": "second"}).save(tmp_path)
    loaded = HeadWeights.load(tmp_path)
    assert torch.equal(loaded.weights, first.weights) and loaded.settings == {"fit": "first"}
