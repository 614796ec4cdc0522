"""Which model a result or a fit belongs to: a digest of its weights, read in milliseconds
on any device, so that a model trained again into the same folder is not taken for the one
before (an ``evaluate`` run resumed, head weights fitted to it)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .._compat import uncompiled


WEIGHT_SAMPLES = 64
"""How many values of each of a model's tensors :func:`weights_digest` reads."""


def weights_digest(model: Any, values: bool = True) -> str:
    """The SHA-256 of each tensor's name, dtype and shape in the model's ``state_dict``
    (its parameters and the buffers it saves; not those it computes at construction, which
    a model may leave uninitialised) and the bytes of :data:`WEIGHT_SAMPLES` of its values,
    evenly spaced: the same on any device (bytes, no arithmetic), read in a few
    milliseconds whatever the model's size, and different for weights trained again or
    cast. A tensor left on the meta device (offloaded) gives its name, dtype and shape
    only; every tensor does with ``values=False`` (the model's layout). A ``torch.compile``-d
    model has the digest of the model it wraps."""
    digest = hashlib.sha256()
    for name, tensor in uncompiled(model).state_dict(keep_vars=True).items():
        digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}\n".encode("utf-8"))
        if values and tensor.device.type != "meta" and tensor.numel():
            flat = tensor.detach().reshape(-1)
            count = min(flat.numel(), WEIGHT_SAMPLES)
            places = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            digest.update(flat[places].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def is_offloaded(model: Any) -> bool:
    """Whether some of the model's tensors wait on the meta device (offloaded by
    Accelerate): :func:`weights_digest` cannot read their values."""
    return any(t.device.type == "meta" for t in model.state_dict(keep_vars=True).values())


def fitted_model(model: Any) -> dict[str, Any]:
    """What a fit to ``model`` records of it: :func:`weights_digest`, the digest of its
    layout alone (``values=False``), whether some of its tensors are offloaded
    (:func:`is_offloaded`) and the dtype of its first floating-point parameter."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return {"weights": weights_digest(model), "layout": weights_digest(model, values=False), "offloaded": is_offloaded(model),
            "dtype": str(dtype)}


def check_fitted_model(recorded: dict[str, Any] | None, model: Any, fitted: str, refit: str) -> None:
    """Refuse ``fitted`` (what was fitted; ``refit``: how to fit it again) where ``recorded``
    (:func:`fitted_model` at the fit) names another model: the same dtype, other weights;
    where the weights were offloaded at the fit or are now, their values cannot be
    compared, and another layout (other tensors' names or shapes) is refused. A fit
    recorded in another dtype (the same model cast, most likely) or with no record is taken
    as it is."""
    if not recorded:
        return
    current = fitted_model(model)
    if recorded.get("dtype") != current["dtype"]:
        return
    if recorded.get("offloaded") or current["offloaded"]:
        if recorded.get("layout") != current["layout"]:
            raise ValueError(
                f"{fitted} were fitted to another model: its tensors' layout {str(recorded.get('layout'))[:16]}, this "
                f"model's {current['layout'][:16]} (other names or shapes; offloaded weights are not compared): {refit}."
            )
    elif recorded.get("weights") != current["weights"]:
        raise ValueError(
            f"{fitted} were fitted to another model: its weights' digest {str(recorded.get('weights'))[:16]}, this "
            f"model's {current['weights'][:16]} (trained again since?): {refit}."
        )
