"""Attributions layer: the public Captum classes.

Every module of this package is imported here, so an attribution class that declares a
named ``spec`` (:class:`MethodSpec`) in its own file is registered without further edits:
in :data:`REGISTRY`, and in :data:`METHODS` where ``spec.in_reports``.
"""

import importlib
import pkgutil

from ._base import AttentionAttributionBase, attribute_method
from ._images import image_scores, pixel_scores, upsample_to_image
from ._registry import FLAG, FRACTION, LAYER, METHODS, REGISTRY, MethodSpec, Option, one_of
# The order of these imports is the order of METHODS (and of the command line's report).
from .grad_sam import GradSAM  # isort: skip
from .attention_rollout import AttentionRollout  # isort: skip
from .transformer_attribution import TransformerAttribution  # isort: skip
from .raw_attention import RawAttention  # isort: skip
from .attention_flow import AttentionFlow  # isort: skip  (registered, not in reports: see its cost)
from .attn_lrp import AttnLRP  # isort: skip
from .norm_attention import NormAttention  # isort: skip  (registered, not in reports yet)
from .value_zeroing import ValueZeroing  # isort: skip  (registered, not in reports yet)
from .alti import ALTI  # isort: skip  (registered, not in reports yet)
from .alti_logit import ALTILogit  # isort: skip  (registered, not in reports yet)
from .learned_attention import LearnedAttention  # isort: skip  (registered, not in reports)
from .knockout_gradient import KnockoutGradient  # isort: skip  (registered, not in reports)
from .knockout_lrp import KnockoutLRP  # isort: skip  (registered, not in reports)
from .decompx import DecompX  # isort: skip  (registered, not in reports: see its cost)
from .llm import LLMAttentionAttribution

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "ALTI", "ALTILogit", "FLAG", "FRACTION", "LAYER", "METHODS", "REGISTRY", "AttentionAttributionBase", "DecompX", "MethodSpec", "Option", "one_of", "attribute_method", "AttentionFlow", "AttentionRollout", "AttnLRP", "GradSAM", "KnockoutGradient", "KnockoutLRP", "LLMAttentionAttribution", "LearnedAttention", "NormAttention", "RawAttention", "TransformerAttribution", "ValueZeroing", "image_scores", "pixel_scores", "upsample_to_image",
]
