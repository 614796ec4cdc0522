"""Metrics layer: faithfulness scores and the perturbations Captum's metrics need."""

from .adversarial import AdversarialAttentionResult, AdversarialKeysResult, adversarial_attention, adversarial_keys
from .agreement import kendall_tau, spearman
from .context import (
    ablated_log_probs,
    attention_shares,
    calibrated_scores,
    context_averaged_scores,
    leave_one_out_estimates,
    leave_one_out_agreement,
    linear_datamodeling_score,
    random_ablations,
    top_k_log_prob_drop,
)
from .head_weights import HeadWeights, fit_head_weights
from .patches import PatchRemoval, patch_datamodeling_score, patch_leave_one_out_agreement, top_k_patch_log_prob_drop
from .identifiability import IdentifiabilityResult, identifiability
from .image_patches import ImagePatches, box_patches, image_patches
from .erasure import ErasureResult, FlipResult, attention_erasure, decision_flip_fraction
from .permutation import PermutationResult, attention_permutation, permutation_accuracy
from .perturbations import token_replacement_perturbation, token_substitution_perturbation
from .plausibility import auprc, iou_f1, pointing_game, token_f1
from .rankings import attention_ranking, gradient_attention_ranking, gradient_ranking, random_ranking
from .registry import METRICS, MetricContext, MetricSpec, register_metric

from .token_removal import (
    CurveResult,
    ablated_probs,
    aopc,
    calibrated_attribution,
    context_averaged_attribution,
    comprehensiveness,
    datamodeling_score,
    greedy_deletion,
    leave_one_out,
    pair_token_types,
    perturbation_curve,
    sufficiency,
)

__all__ = [
    "METRICS",
    "MetricContext",
    "MetricSpec",
    "register_metric",
    "AdversarialAttentionResult",
    "AdversarialKeysResult",
    "adversarial_attention",
    "adversarial_keys",
    "ablated_log_probs",
    "attention_shares",
    "ablated_probs",
    "CurveResult",
    "aopc",
    "auprc",
    "comprehensiveness",
    "datamodeling_score",
    "greedy_deletion",
    "iou_f1",
    "kendall_tau",
    "leave_one_out",
    "leave_one_out_agreement",
    "linear_datamodeling_score",
    "pair_token_types",
    "perturbation_curve",
    "pointing_game",
    "spearman",
    "sufficiency",
    "token_f1",
    "top_k_log_prob_drop",
    "top_k_patch_log_prob_drop",
    "PatchRemoval",
    "ImagePatches",
    "image_patches",
    "box_patches",
    "patch_datamodeling_score",
    "patch_leave_one_out_agreement",
    "ErasureResult",
    "FlipResult",
    "IdentifiabilityResult",
    "PermutationResult",
    "attention_erasure",
    "attention_permutation",
    "attention_ranking",
    "calibrated_scores",
    "calibrated_attribution",
    "context_averaged_attribution",
    "context_averaged_scores",
    "leave_one_out_estimates",
    "HeadWeights",
    "decision_flip_fraction",
    "fit_head_weights",
    "gradient_attention_ranking",
    "gradient_ranking",
    "identifiability",
    "permutation_accuracy",
    "random_ablations",
    "random_ranking",
    "token_replacement_perturbation",
    "token_substitution_perturbation",
]
