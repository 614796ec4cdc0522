"""Metrics layer: faithfulness scores and the perturbations Captum's metrics need."""

from .perturbations import token_replacement_perturbation, token_substitution_perturbation

__all__ = ["token_replacement_perturbation", "token_substitution_perturbation"]
