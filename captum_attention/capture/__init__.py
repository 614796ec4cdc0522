"""Capture layer: find attention in a model and record it for one call (hooks, adapters)."""

from .adapters import (
    AttentionAdapter,
    AttentionNotFoundError,
    HuggingFaceAdapter,
    ModuleAdapter,
    default_adapter,
)
from .recorder import AttentionCapture

__all__ = [
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionNotFoundError",
    "HuggingFaceAdapter",
    "ModuleAdapter",
    "default_adapter",
]
