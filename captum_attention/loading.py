"""Loading a local sequence-classification checkpoint safely, with errors a user can act on."""

from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from safetensors import SafetensorError


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' progress bars and warnings off for the block (errors still shown),
    then as they were: loading a checkpoint prints nothing a user must act on."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


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
    if folder.is_file():
        raise CheckpointError(f"--model {folder} is a file: give the checkpoint's folder (with config.json)")
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
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the error says it all
            model = AutoModelForSequenceClassification.from_pretrained(folder, weights_only=True, **options)
            tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"could not load the checkpoint in {folder}: its pickled weights hold objects other than "
            "tensors, which are refused (unpickling them can run code); use a safetensors copy from a "
            "source you trust."
        ) from error
    except SafetensorError as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: its safetensors file is truncated or corrupt ({error}).") from error
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"could not load the checkpoint in {folder}: {reason}") from error
    return model.eval(), tokenizer
