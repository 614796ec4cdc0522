"""Capture layer: find attention in a model and record it for one call (hooks, adapters)."""

from .adapters import (
    AdapterBase,
    AttentionAdapter,
    AttentionNotFoundError,
    HuggingFaceAdapter,
    ModuleAdapter,
    MultiheadAttentionAdapter,
    Role,
    default_adapter,
)
from .recorder import AttentionCapture

__all__ = [
    "AdapterBase",
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionNotFoundError",
    "HuggingFaceAdapter",
    "ModuleAdapter",
    "MultiheadAttentionAdapter",
    "Role",
    "default_adapter",
]
