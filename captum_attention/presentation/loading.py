"""Loading a local sequence-classification checkpoint safely, with errors a user can act on."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be explained: missing, unreadable or not a classifier."""


def load_classifier(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local Hugging Face sequence-classification checkpoint.

    Loading never runs code from the checkpoint (``trust_remote_code=False``), reads
    weights through safetensors or ``torch.load(weights_only=True)`` only, and never
    contacts a model hub (``local_files_only=True``).

    Raises:
        CheckpointError: the folder is missing, has no config, or is not a sequence
            classifier.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    options = dict(local_files_only=True, trust_remote_code=False)
    try:
        config = AutoConfig.from_pretrained(folder, **options)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder} is not a Hugging Face checkpoint (no readable config.json): {error}") from error
    architectures = config.architectures or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise CheckpointError(
            f"{folder} holds a {', '.join(architectures) or config.model_type} checkpoint, not a "
            "sequence classifier (its config.json names no *ForSequenceClassification architecture)."
        )
    try:
        model = AutoModelForSequenceClassification.from_pretrained(folder, weights_only=True, **options)
        tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: {error}") from error
    return model.eval(), tokenizer
