"""Capture layer: find attention in a model and record one forward pass (hooks, adapters, the record)."""

from .adapters import (
    AdapterBase,
    AttentionAdapter,
    AttentionNotFoundError,
    AttentionSite,
    HuggingFaceAdapter,
    ModuleAdapter,
    MultiheadAttentionAdapter,
    Role,
    default_adapter,
)
from .record import ForwardRecord, record_forward
from .recorder import AttentionCapture

__all__ = [
    "AdapterBase",
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionNotFoundError",
    "AttentionSite",
    "ForwardRecord",
    "HuggingFaceAdapter",
    "ModuleAdapter",
    "MultiheadAttentionAdapter",
    "Role",
    "default_adapter",
    "record_forward",
]
