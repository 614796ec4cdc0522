"""Attributions layer: the public Captum classes."""

from ._images import upsample_to_image
from .attention_rollout import AttentionRollout
from .grad_sam import GradSAM
from .raw_attention import RawAttention
from .transformer_attribution import TransformerAttribution

__all__ = ["AttentionRollout", "GradSAM", "RawAttention", "TransformerAttribution", "upsample_to_image"]
