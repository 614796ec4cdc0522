"""The attribution methods compared by the faithfulness benchmark, one call each.

Every method returns one score per token ``(B, T)`` for text, per patch ``(B, rows,
columns)`` for images, for the model's predicted class. Captum's gradient methods
attribute the word embeddings (text) or the pixels (images); pixel scores are summed
over channels and over each patch.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from captum.attr import InputXGradient, IntegratedGradients, LayerIntegratedGradients, NoiseTunnel, Saliency
from common import context_cite_weights
from tasks import MASK, Task
from torch import Tensor

from captum_attention import ALTI, METHODS, DecompX, KnockoutGradient, KnockoutLRP, NormAttention, ValueZeroing
from captum_attention.metrics import (
    ablated_probs,
    calibrated_attribution,
    context_averaged_attribution,
    greedy_deletion,
    image_patches,
    leave_one_out,
    random_ranking,
)
from captum_attention.metrics.token_removal import random_halves
from captum_attention.presentation.shap_text import shap_token_values

IG_STEPS = 50
SMOOTHGRAD_SAMPLES = 10
SHAP_EVALS = 300
CONTEXT_CITE_ABLATIONS = 64
CALIBRATED_ABLATIONS = 8
GREEDY_CANDIDATES = (5, 3)
PRESENCES = (0.1, 0.05)
PATCH = 4

Explainer = Callable[[Task, Tensor], Tensor]


def _ours(cls: type, **options: object) -> Explainer:
    def explain(task: Task, target: Tensor) -> Tensor:
        args = None if task.is_image else (task.attention_mask,)
        return cls(task.model).attribute(task.inputs, target=target, additional_forward_args=args, **options)

    return explain


def presence(task: Task, value: float) -> Tensor:
    """Each token's presence: ``value`` for the removable ones (the tokens, the patches),
    1 for [CLS], [SEP] and padding."""
    if task.is_image:
        rows, columns = task.rationale.shape[1:]
        weights = torch.full((len(task.inputs), 1 + rows * columns), value)
        weights[:, 0] = 1.0
        return weights
    removable = (task.attention_mask != 0) & ~task.keep
    return torch.where(removable, value, 1.0)


def attn_lrp_at_presence(value: float) -> Explainer:
    """AttnLRP with the removable tokens (patches) at presence ``value`` in every attention call."""

    def explain(task: Task, target: Tensor) -> Tensor:
        return _ours(METHODS["attn_lrp"], presence=presence(task, value))(task, target)

    return explain


def _patches(pixel_scores: Tensor) -> Tensor:
    """``(B, 3, H, W)`` pixel scores summed over channels and 4×4 patches: ``(B, H/4, W/4)``."""
    summed = pixel_scores.sum(dim=1)
    batch, height, width = summed.shape
    return summed.view(batch, height // PATCH, PATCH, width // PATCH, PATCH).sum(dim=(2, 4))


def _embeddings(task: Task) -> Tensor:
    return task.model.get_input_embeddings()(task.inputs).detach()


def integrated_gradients(task: Task, target: Tensor) -> Tensor:
    if task.is_image:
        ig = IntegratedGradients(task.logits)
        baseline = torch.full_like(task.inputs, 0.5)
        return _patches(ig.attribute(task.inputs, baseline, target=target, n_steps=IG_STEPS))
    baseline = task.inputs.masked_fill(~task.keep & (task.attention_mask != 0), MASK if task.tokenizer is None else task.tokenizer.pad_token_id)
    lig = LayerIntegratedGradients(task.logits, task.model.get_input_embeddings())
    scores = lig.attribute(task.inputs, baseline, target=target, additional_forward_args=(task.attention_mask,), n_steps=IG_STEPS)
    return scores.sum(dim=-1)


def smoothgrad(task: Task, target: Tensor) -> Tensor:
    inputs = task.inputs if task.is_image else _embeddings(task)
    args = None if task.is_image else (task.attention_mask,)
    tunnel = NoiseTunnel(Saliency(task.logits))
    scores = tunnel.attribute(
        inputs, nt_type="smoothgrad", nt_samples=SMOOTHGRAD_SAMPLES, stdevs=0.1 * float(inputs.std()),
        target=target, additional_forward_args=args,
    )
    return _patches(scores) if task.is_image else scores.sum(dim=-1)


def saliency(task: Task, target: Tensor) -> Tensor:
    """Captum's ``Saliency``: the gradient's absolute values, summed per token (patch)."""
    inputs = task.inputs if task.is_image else _embeddings(task)
    args = None if task.is_image else (task.attention_mask,)
    scores = Saliency(task.logits).attribute(inputs, target=target, additional_forward_args=args)
    return _patches(scores) if task.is_image else scores.sum(dim=-1)


def gradient_x_input(task: Task, target: Tensor) -> Tensor:
    inputs = task.inputs if task.is_image else _embeddings(task)
    args = None if task.is_image else (task.attention_mask,)
    scores = InputXGradient(task.logits).attribute(inputs, target=target, additional_forward_args=args)
    return _patches(scores) if task.is_image else scores.sum(dim=-1)


def shap_partition(task: Task, target: Tensor) -> Tensor:
    """SHAP's Partition explainer with ``SHAP_EVALS`` model evaluations per example."""
    import shap

    if task.is_image:
        images = task.inputs.permute(0, 2, 3, 1).numpy()

        def predict(batch: np.ndarray) -> np.ndarray:
            pixels = torch.from_numpy(np.ascontiguousarray(batch)).float().permute(0, 3, 1, 2)
            with torch.no_grad():
                return task.logits(pixels).softmax(-1).numpy()

        masker = shap.maskers.Image(np.full(images.shape[1:], 0.5, dtype=np.float32), images.shape[1:])
        explanation = shap.Explainer(predict, masker, algorithm="partition")(images, max_evals=SHAP_EVALS, silent=True)
        values = torch.from_numpy(explanation.values).float()  # (B, H, W, 3, classes)
        chosen = values[torch.arange(len(target)), ..., target].permute(0, 3, 1, 2)
        return _patches(chosen)
    return shap_token_values(task.logits, task.tokenizer, task.extra["texts"], target, SHAP_EVALS)


def removal(task: Task) -> tuple[Callable[..., Tensor], Tensor, Tensor, dict[str, Any]]:
    """How the ERASER metrics remove features: ``forward(ids, mask)``, the ids, the mask and
    the removal arguments. Text: tokens deleted, [CLS]/[SEP] kept. Images: each patch a
    feature (``metrics.image_patches``), a removed one grey."""
    if not task.is_image:
        return task.logits, task.inputs, task.attention_mask, dict(removal="delete", keep=task.keep)
    patches = image_patches(task.logits, task.inputs, torch.full_like(task.inputs[:1], 0.5), task.rationale.shape[1:])
    return patches.forward_func, patches.input_ids, patches.attention_mask, patches.removal


def _as_features(task: Task, scores: Tensor) -> Tensor:
    """``(B, F)`` scores of the removable features as the task's: per token, or per patch on the grid."""
    return scores.reshape(task.rationale.shape if task.is_image else task.inputs.shape)


def leave_one_out_deletion(task: Task, target: Tensor) -> Tensor:
    """Each token's (patch's) leave-one-out drop in the explained probability, removed as
    the ERASER metrics remove it: one forward per feature."""
    forward, ids, mask, how = removal(task)
    return _as_features(task, leave_one_out(forward, ids, mask, target, **how))


def context_cite(task: Task, target: Tensor, ablations: int = CONTEXT_CITE_ABLATIONS, seed: int = 1) -> Tensor:
    """ContextCite's algorithm with tokens (patches) as its sources: ``ablations``
    random ablations (each removable feature kept with probability 1/2, of ``seed``) and the
    Lasso surrogate of :func:`common.context_cite_weights` on the explained class's
    logit-probability after each, per example over its removable features."""
    forward, ids, mask, how = removal(task)
    removable = (mask != 0) & ~how.get("keep", torch.zeros_like(ids, dtype=torch.bool))
    kept = random_halves(removable, ablations, seed=seed)
    probs = ablated_probs(forward, ids, mask, kept, target, **how).double().clamp(1e-12, 1 - 1e-12)
    outcomes = probs.log() - (-probs).log1p()
    scores = torch.zeros(removable.shape)
    for b, sources in enumerate(removable):
        scores[b, sources] = context_cite_weights(kept[b][:, sources], outcomes[b]).float()
    return _as_features(task, scores)


def calibrated_over(prior: Explainer, ablations: int = CALIBRATED_ABLATIONS, seed: int = 1) -> Explainer:
    """:func:`captum_attention.metrics.calibrated_attribution` over ``prior``'s scores: its
    surrogate fitted on ``ablations`` random ablations (of ``seed``, each example's drawn
    alone), the features removed as the ERASER columns remove them."""

    def explain(task: Task, target: Tensor) -> Tensor:
        forward, ids, mask, how = removal(task)
        scores = prior(task, target).reshape(ids.shape)
        return _as_features(task, calibrated_attribution(forward, ids, mask, scores, target, ablations, seed=seed, **how))

    return explain


def context_averaged_over(prior: Explainer, contexts: int = CALIBRATED_ABLATIONS, seed: int = 1) -> Explainer:
    """:func:`captum_attention.metrics.context_averaged_attribution`: AttnLRP in ``contexts``
    random half contexts (complementary pairs of ``seed``, each example's drawn alone),
    the other features removed as the ERASER columns remove them, with ``prior``'s scores."""

    def explain(task: Task, target: Tensor) -> Tensor:
        lrp = METHODS["attn_lrp"](task.model)

        def in_context(ids: Tensor, mask: Tensor) -> Tensor:
            if task.is_image:
                return lrp.attribute(forward.pixels(ids), target=target).reshape(ids.shape)
            return lrp.attribute(ids, target=target, additional_forward_args=(mask,))

        forward, ids, mask, how = removal(task)
        scores = prior(task, target).reshape(ids.shape)
        return _as_features(task, context_averaged_attribution(in_context, ids, mask, scores, contexts, seed, **how))

    return explain


def greedy_over(prior: Explainer) -> Explainer:
    """:func:`captum_attention.metrics.greedy_deletion` over ``prior``'s scores, with the
    candidates of ``GREEDY_CANDIDATES`` removed as the ERASER columns remove them."""

    def explain(task: Task, target: Tensor) -> Tensor:
        forward, ids, mask, how = removal(task)
        scores = prior(task, target).reshape(ids.shape)
        return _as_features(task, greedy_deletion(forward, ids, mask, scores, target, GREEDY_CANDIDATES, **how))

    return explain


def random_baseline(task: Task, target: Tensor) -> Tensor:
    shape = task.rationale.shape if task.is_image else task.inputs.shape
    return random_ranking(shape, seed=0)


def methods() -> dict[str, Explainer]:
    """The compared methods by display name (the budgets as currently set in this module)."""
    return {
        **{cls.get_name(): _ours(cls) for cls in METHODS.values()},
        "Grad-SAM (key axis)": _ours(METHODS["grad_sam"], axis="key"),
        "Norm-based Attention": _ours(NormAttention),  # registered, not in METHODS: compared here all the same
        "Norm-based Attention (residual)": _ours(NormAttention, residual=True),
        "ALTI": _ours(ALTI),
        "Value Zeroing": _ours(ValueZeroing),
        "DecompX": _ours(DecompX),
        "DecompX (sensitivity)": _ours(partial(DecompX, multiply_by_inputs=False)),  # type: ignore[arg-type]
        KnockoutGradient.get_name(): _ours(KnockoutGradient),
        KnockoutLRP.get_name(): _ours(KnockoutLRP),
        f"Integrated Gradients ({IG_STEPS} steps)": integrated_gradients,
        f"SmoothGrad ({SMOOTHGRAD_SAMPLES} samples)": smoothgrad,
        "Saliency": saliency,
        "Gradient × Input": gradient_x_input,
        f"SHAP Partition ({SHAP_EVALS} evals)": shap_partition,
        "Leave-one-out": leave_one_out_deletion,
        f"ContextCite ({CONTEXT_CITE_ABLATIONS} ablations)": context_cite,
        f"AttnLRP calibrated ({CALIBRATED_ABLATIONS} ablations)": calibrated_over(_ours(METHODS["attn_lrp"])),
        f"Grad-SAM (key axis), greedy ({sum(GREEDY_CANDIDATES)} removals)": greedy_over(_ours(METHODS["grad_sam"], axis="key")),
        f"AttnLRP, greedy ({sum(GREEDY_CANDIDATES)} removals)": greedy_over(_ours(METHODS["attn_lrp"])),
        **{f"AttnLRP at presence {value}": attn_lrp_at_presence(value) for value in PRESENCES},
        f"AttnLRP at presence {PRESENCES[-1]}, greedy ({sum(GREEDY_CANDIDATES)} removals)": greedy_over(attn_lrp_at_presence(PRESENCES[-1])),
        f"AttnLRP at presence {PRESENCES[-1]}, calibrated ({CALIBRATED_ABLATIONS} ablations)": calibrated_over(
            attn_lrp_at_presence(PRESENCES[-1])
        ),
        f"AttnLRP at presence {PRESENCES[-1]}, in half contexts ({CALIBRATED_ABLATIONS})": context_averaged_over(
            attn_lrp_at_presence(PRESENCES[-1])
        ),
        "Random": random_baseline,
    }
