"""The attribution methods compared by the faithfulness benchmark, one call each.

Every method returns one score per token ``(B, T)`` for text, per patch ``(B, rows,
columns)`` for images, for the model's predicted class. Captum's gradient methods
attribute the word embeddings (text) or the pixels (images); pixel scores are summed
over channels and over each patch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from captum.attr import InputXGradient, IntegratedGradients, LayerIntegratedGradients, NoiseTunnel, Saliency
from tasks import MASK, Task
from torch import Tensor

from captum_attention import ALTI, METHODS, DecompX, NormAttention, ValueZeroing
from captum_attention.metrics import random_ranking
from captum_attention.presentation.shap_text import shap_token_values

IG_STEPS = 50
SMOOTHGRAD_SAMPLES = 10
SHAP_EVALS = 300
PATCH = 4

Explainer = Callable[[Task, Tensor], Tensor]


def _ours(cls: type, **options: object) -> Explainer:
    def explain(task: Task, target: Tensor) -> Tensor:
        args = None if task.is_image else (task.attention_mask,)
        return cls(task.model).attribute(task.inputs, target=target, additional_forward_args=args, **options)

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
        f"Integrated Gradients ({IG_STEPS} steps)": integrated_gradients,
        f"SmoothGrad ({SMOOTHGRAD_SAMPLES} samples)": smoothgrad,
        "Gradient × Input": gradient_x_input,
        f"SHAP Partition ({SHAP_EVALS} evals)": shap_partition,
        "Random": random_baseline,
    }
