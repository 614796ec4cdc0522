"""Metrics layer: faithfulness scores and the perturbations Captum's metrics need."""

from .erasure import ErasureResult, FlipResult, attention_erasure, decision_flip_fraction
from .permutation import PermutationResult, attention_permutation, permutation_accuracy
from .perturbations import token_replacement_perturbation, token_substitution_perturbation
from .rankings import attention_ranking, gradient_attention_ranking, gradient_ranking, random_ranking

__all__ = [
    "ErasureResult",
    "FlipResult",
    "PermutationResult",
    "attention_erasure",
    "attention_permutation",
    "attention_ranking",
    "decision_flip_fraction",
    "gradient_attention_ranking",
    "gradient_ranking",
    "permutation_accuracy",
    "random_ranking",
    "token_replacement_perturbation",
    "token_substitution_perturbation",
]
