"""captum-attention: attention-based attributions for transformers, as Captum attributions."""

from .attr import AttentionRollout, GradSAM, RawAttention, TransformerAttribution
from .capture import AttentionAdapter, AttentionCapture, HuggingFaceAdapter, ModuleAdapter

__version__ = "0.1.0"

__all__ = [
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionRollout",
    "GradSAM",
    "HuggingFaceAdapter",
    "ModuleAdapter",
    "RawAttention",
    "TransformerAttribution",
    "__version__",
]
