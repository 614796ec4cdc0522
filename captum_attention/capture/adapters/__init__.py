"""Adapters: everything the library knows about one model family.

:mod:`.protocol` holds what the capture layer asks (:class:`AttentionAdapter`) and the
defaults (:class:`AdapterBase`); each built-in family has its own module:
:mod:`.huggingface` (with :mod:`.grids`: Swin's windows and SegFormer's reduced keys
placed on the image's patches), :mod:`.module` (modules a user names), :mod:`.multihead`
(``torch.nn.MultiheadAttention``); :mod:`.mixing` reads what mixes the tokens besides the
attention.
"""

from __future__ import annotations

import torch
from torch import nn

from .huggingface import HuggingFaceAdapter
from .module import ModuleAdapter
from .multihead import MultiheadAttentionAdapter
from .protocol import AdapterBase, AttentionAdapter, AttentionNotFoundError, AttentionSite, ProbsSource, RelevanceSites, Role

__all__ = [
    "AdapterBase", "AttentionAdapter", "AttentionNotFoundError", "AttentionSite", "HuggingFaceAdapter",
    "ModuleAdapter", "MultiheadAttentionAdapter", "ProbsSource", "RelevanceSites", "Role", "default_adapter",
]


def default_adapter(model: nn.Module) -> AttentionAdapter:
    """The built-in adapter for ``model``: Hugging Face models, else ``nn.MultiheadAttention``."""
    from transformers import PreTrainedModel

    if any(isinstance(m, PreTrainedModel) for m in model.modules()):
        return HuggingFaceAdapter()
    if any(isinstance(m, nn.MultiheadAttention) for m in model.modules()):
        return MultiheadAttentionAdapter()
    if isinstance(model, torch.jit.ScriptModule):
        raise AttentionNotFoundError(
            f"{type(model).__name__} is a TorchScript module, whose forward runs no Python code that the attention "
            "could be found or captured in: explain the model it was scripted or traced from."
        )
    raise AttentionNotFoundError(
        f"{type(model).__name__} is neither a Hugging Face model nor has nn.MultiheadAttention "
        "modules, so its attention cannot be found automatically. Pass "
        "adapter=ModuleAdapter([...your attention modules...], probs=...) (probs='softmax' "
        "for modules that call F.softmax or F.scaled_dot_product_attention inside), or implement the "
        "AttentionAdapter protocol."
    )
