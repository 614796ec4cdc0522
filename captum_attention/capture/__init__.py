"""Capture layer: find attention in a model and record one forward pass (hooks, adapters,
probes, the record)."""

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
from .inputs import LogProbTarget
from .._compat import StreamingUnsupported, UnsupportedModelError
from .probes import (
    AttendedValues,
    CallInfo,
    GradientReduction,
    GradMaps,
    GradMode,
    Intervention,
    KeysTransform,
    LayerBlocks,
    Probe,
    ProbsIntervention,
    RecordedBlocks,
    RecordedValues,
    ValueRecorder,
)
from .record import ForwardRecord, OutputGrads, record_forward
from .recorder import AttentionCapture

__all__ = [
    "AttendedValues",
    "AdapterBase",
    "AttentionAdapter",
    "AttentionCapture",
    "AttentionNotFoundError",
    "AttentionSite",
    "CallInfo",
    "ForwardRecord",
    "GradMaps",
    "GradientReduction",
    "GradMode",
    "HuggingFaceAdapter",
    "Intervention",
    "KeysTransform",
    "LayerBlocks",
    "LogProbTarget",
    "ModuleAdapter",
    "MultiheadAttentionAdapter",
    "OutputGrads",
    "Probe",
    "ProbsIntervention",
    "RecordedBlocks",
    "RecordedValues",
    "Role",
    "StreamingUnsupported",
    "UnsupportedModelError",
    "ValueRecorder",
    "default_adapter",
    "record_forward",
]
