"""Loading a local checkpoint (a sequence classifier, a causal, sequence-to-sequence or
vision-language model) safely, with errors a user can act on."""

from __future__ import annotations

import hashlib
import json
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


CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "preprocessor_config.json", "processor_config.json", "chat_template.jinja",
    "chat_template.json",
)
"""The files of a checkpoint folder besides its weights that decide what the model computes
on a text or an image: its configuration, tokenizer and processor."""


def checkpoint_files_digest(folder: str | Path) -> str:
    """The SHA-256 of the names and contents of the :data:`CHECKPOINT_FILES` in ``folder``
    (no file: the digest of nothing): a tokenizer or configuration saved again into the
    folder changes it; a report or data file written there does not."""
    digest = hashlib.sha256()
    for path in [Path(folder) / name for name in CHECKPOINT_FILES] if folder else []:
        if path.is_file():
            digest.update(f"{path.name} {path.stat().st_size}\n".encode("utf-8"))
            digest.update(path.read_bytes())
    return digest.hexdigest()


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be explained: missing, unreadable, or neither a
    sequence classifier nor a causal or sequence-to-sequence language model."""


_OPTIONS: dict[str, Any] = dict(local_files_only=True, trust_remote_code=False)
"""Never a hub, never the checkpoint's own code."""

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
"""How transformers names causal language models' architectures."""


def checkpoint_task(path: str | Path) -> str:
    """``"classification"``, ``"generation"``, ``"seq2seq"`` or ``"image-text-to-text"``:
    what the local checkpoint's config.json names (a ``*ForSequenceClassification``, a
    ``*ForCausalLM``/``*LMHeadModel`` architecture, or the sequence-to-sequence or
    vision-language model transformers registers for its model type: T5, BART, Marian,
    ...; LLaVA, Qwen2-VL, ...).

    Raises:
        CheckpointError: the folder is missing, holds a PEFT adapter alone, has no
            readable config, needs custom code, or names neither kind of architecture.
    """
    from transformers import AutoConfig

    folder = _folder(path)
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{folder} holds a PEFT adapter, not a model: merge it into its base model and save that "
            "(PeftModel.from_pretrained(base_model, folder).merge_and_unload().save_pretrained(merged), the "
            "tokenizer beside it), then pass the merged folder."
        )
    try:
        config = AutoConfig.from_pretrained(folder, **_OPTIONS)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{folder} is not a Hugging Face checkpoint (no readable config.json): {_first_line(error)}"
        ) from error
    architectures = config.architectures or []
    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "classification"
    if any(name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures):
        return "generation"
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ

    if SEQ2SEQ.get(config.model_type) in architectures:
        return "seq2seq"
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT

    if IMAGE_TEXT.get(config.model_type) in architectures:
        return "image-text-to-text"
    raise CheckpointError(
        f"{folder} holds a {', '.join(architectures) or config.model_type} checkpoint, neither a sequence "
        "classifier nor a language model (its config.json names no *ForSequenceClassification, "
        "*ForCausalLM, *LMHeadModel or sequence-to-sequence architecture)."
    )


def load_classifier(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local Hugging Face sequence-classification checkpoint.

    Loading never runs code from the checkpoint (``trust_remote_code=False``), reads
    weights through safetensors or ``torch.load(weights_only=True)`` only, and never
    contacts a model hub (``local_files_only=True``).

    A tokenizer saved without a pad token (GPT-2's, often) pads with the model's own
    ``config.pad_token_id``: the id the classifier finds its last token by.

    Raises:
        CheckpointError: the folder is missing, has no config, or is not a sequence
            classifier; or neither its tokenizer nor its config names a padding token.
    """
    from transformers import AutoModelForSequenceClassification

    if checkpoint_task(path) != "classification":
        raise CheckpointError(
            f"{path} holds a language model, not a sequence classifier (its config.json names no "
            "*ForSequenceClassification architecture)."
        )
    model, tokenizer = _load(Path(path), AutoModelForSequenceClassification)
    return model, _padding_as_configured(model, tokenizer, path)


def _padding_as_configured(model: Any, tokenizer: Any, path: str | Path) -> Any:
    """``tokenizer``, padding with ``model.config.pad_token_id`` where it names no pad token
    itself; one line where neither names one (texts are padded in batches, and Integrated
    Gradients' baseline is the padding token)."""
    from .metrics.token_removal import configured_pad_id

    if tokenizer.pad_token_id is not None:
        return tokenizer
    pad_id = configured_pad_id(model)
    pad_token = None if pad_id is None else tokenizer.convert_ids_to_tokens(pad_id)
    if pad_token is None:
        raise CheckpointError(
            f"{path}: neither its tokenizer nor its config.json names a padding token, which batches and "
            "Integrated Gradients' baseline need: set \"pad_token_id\" in config.json to the id the model "
            "was trained to pad with (GPT-2's usual one: its end-of-text id)"
        )
    tokenizer.pad_token = pad_token
    return tokenizer


def load_causal_lm(path: str | Path, seq2seq: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local causal language model checkpoint (or, with
    ``seq2seq=True``, a sequence-to-sequence one too), loaded as safely as
    :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint that is not a
            language model of the kind asked.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    task = checkpoint_task(path)
    if task == "seq2seq" and seq2seq:
        return _load(Path(path), AutoModelForSeq2SeqLM)
    if task != "generation":
        kinds = {"classification": "a sequence classifier", "seq2seq": "a sequence-to-sequence model"}
        kind = kinds.get(task, "a vision-language model (explain it with --image)")
        raise CheckpointError(f"{path} holds {kind}, not a causal language model.")
    return _load(Path(path), AutoModelForCausalLM)


def load_vision_language_model(path: str | Path) -> tuple[Any, Any]:
    """``(model, processor)`` from a local vision-language model checkpoint (LLaVA,
    Qwen2-VL, PaliGemma, ...: an image-text-to-text architecture, with its processor),
    loaded as safely as :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    if checkpoint_task(path) != "image-text-to-text":
        raise CheckpointError(f"{path} holds no vision-language model (an image-text-to-text architecture): --image is for one.")
    return _load(Path(path), AutoModelForImageTextToText, AutoProcessor)


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if folder.is_file():
        raise CheckpointError(f"--model {folder} is a file: give the checkpoint's folder (with config.json)")
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    _refuse_custom_code(folder)
    return folder


def _load(folder: Path, auto_class: Any, preprocessor_class: Any = None) -> tuple[Any, Any]:
    """The model (weights through safetensors or ``weights_only`` only) and its tokenizer
    (or ``preprocessor_class``'s preprocessor: a vision-language model's processor)."""
    from transformers import AutoTokenizer

    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the error says it all
            model = auto_class.from_pretrained(folder, weights_only=True, **_OPTIONS)
            tokenizer = (preprocessor_class or AutoTokenizer).from_pretrained(folder, **_OPTIONS)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"could not load the checkpoint in {folder}: its pickled weights hold objects other than "
            "tensors, which are refused (unpickling them can run code); use a safetensors copy from a "
            "source you trust."
        ) from error
    except SafetensorError as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: its safetensors file is truncated or corrupt ({error}).") from error
    except (OSError, ValueError) as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: {_first_line(error)}") from error
    return model.eval(), tokenizer


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _refuse_custom_code(folder: Path) -> None:
    """One line for a checkpoint whose config names custom code (``auto_map``) for a model
    type transformers does not have: that code is never run."""
    from transformers import CONFIG_MAPPING

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # AutoConfig says what is wrong
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(config, dict) and "auto_map" in config and model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"{folder} needs custom code (model_type {model_type!r}, auto_map in config.json), which is never "
            "run: use a checkpoint of a built-in transformers architecture"
        )
