"""captum-attention: attention-based attributions for transformers, as Captum attributions."""

from .attr import (
    ALTI,
    METHODS,
    ALTILogit,
    AttentionFlow,
    AttentionRollout,
    AttnLRP,
    GradSAM,
    DecompX,
    KnockoutGradient,
    KnockoutLRP,
    LearnedAttention,
    LLMAttentionAttribution,
    NormAttention,
    RawAttention,
    TransformerAttribution,
    ValueZeroing,
    image_scores,
    pixel_scores,
    upsample_to_image,
)
from .capture import (
    AttentionAdapter,
    AttentionCapture,
    HuggingFaceAdapter,
    ModuleAdapter,
    MultiheadAttentionAdapter,
    UnsupportedModelError,
)
from .demo import load_default_model
from .metrics.head_weights import HeadWeights
from .presentation.display import readable_tokens, scores_for_display, special_tokens, token_heatmap

__version__ = "0.1.0"

__all__ = [
    "ALTI",
    "ALTILogit",
    "METHODS",
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionFlow",
    "AttentionRollout",
    "AttnLRP",
    "GradSAM",
    "HeadWeights",
    "HuggingFaceAdapter",
    "DecompX",
    "KnockoutGradient",
    "KnockoutLRP",
    "LLMAttentionAttribution",
    "LearnedAttention",
    "ModuleAdapter",
    "MultiheadAttentionAdapter",
    "NormAttention",
    "RawAttention",
    "TransformerAttribution",
    "UnsupportedModelError",
    "ValueZeroing",
    "__version__",
    "image_scores",
    "load_default_model",
    "pixel_scores",
    "readable_tokens",
    "scores_for_display",
    "special_tokens",
    "token_heatmap",
    "upsample_to_image",
]
