"""Loading a local checkpoint (a sequence classifier, a causal, sequence-to-sequence or
vision-language model) safely, with errors a user can act on."""

from __future__ import annotations

import difflib
import hashlib
import json
import pickle
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from safetensors import SafetensorError

from ._compat import error_line


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
    "chat_template.json", "adapter_config.json",
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
IMAGE_CLASSIFIER_SUFFIXES = ("ForImageClassification", "ForImageClassificationWithTeacher")
"""The architectures of image classifiers (ViT, DeiT's with its distillation head, Swin, BEiT, ...)."""
"""How transformers names causal language models' architectures."""


def checkpoint_task(path: str | Path) -> str:
    """``"classification"``, ``"image-classification"``, ``"question-answering"``,
    ``"token-classification"``, ``"generation"``, ``"seq2seq"``, ``"image-to-text"``,
    ``"image-text-to-text"`` or ``"fill-mask"``: what the local checkpoint's config.json
    names (a ``*ForSequenceClassification``, a ``*ForImageClassification``, the extractive
    ``*ForQuestionAnswering`` or the ``*ForTokenClassification`` transformers registers for
    its model type, a ``*ForCausalLM``/``*LMHeadModel`` architecture, an
    image encoder before a text decoder (``VisionEncoderDecoderModel``: ViT-GPT-2
    captioners, TrOCR, Donut), the sequence-to-sequence or vision-language model transformers
    registers for its model type: T5, BART, Marian, ...; LLaVA, Qwen2-VL, ..., or an
    encoder's masked language model: BERT's, RoBERTa's, ...).

    A folder that holds a PEFT adapter alone (``adapter_config.json``, no model weights)
    has its adapter's task (``task_type``), else its base model's.

    Raises:
        CheckpointError: the folder is missing, has no readable config, needs custom
            code, or names neither kind of architecture; or it holds a PEFT adapter whose
            base model is not here (see :func:`peft_adapter`).
    """
    adapter = peft_adapter(path)
    return _config_task(_folder(path)) if adapter is None else adapter.task


def captions_alone(path: str | Path) -> bool:
    """Whether the local checkpoint captions an image with no prompt: an image encoder
    before a text decoder, or a vision-language model that reads its image apart from its
    prompt (:data:`~captum_attention.capture.adapters.images.IMAGE_APART_FROM_PROMPT`:
    BLIP's, GIT's), which captions after its start token alone.

    Raises:
        CheckpointError: as :func:`checkpoint_task`.
    """
    from .capture.adapters.images import IMAGE_APART_FROM_PROMPT

    task = checkpoint_task(path)
    if task != "image-text-to-text":
        return task == "image-to-text"
    adapter = peft_adapter(path)
    return _config(_folder(path) if adapter is None else adapter.base).model_type in IMAGE_APART_FROM_PROMPT


def _config(folder: Path) -> Any:
    """The config.json of the checkpoint in ``folder``."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, **_OPTIONS)
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"{folder} is not a Hugging Face checkpoint (no readable config.json): {error_line(error)}"
        ) from error


def _config_task(folder: Path) -> str:
    """The task of the checkpoint in ``folder`` by its config.json (see :func:`checkpoint_task`)."""
    config = _config(folder)
    architectures = config.architectures or []
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT

    from .capture.adapters.images import IMAGE_FEATURES_FIRST

    if any(name.endswith("ForSequenceClassification") for name in architectures):
        return "classification"
    if any(name.endswith(IMAGE_CLASSIFIER_SUFFIXES) for name in architectures):
        return "image-classification"
    from transformers.models.auto.modeling_auto import MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES as QUESTION_ANSWERING

    if QUESTION_ANSWERING.get(config.model_type) in architectures:
        return "question-answering"
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES as TOKEN_CLASSIFICATION

    if TOKEN_CLASSIFICATION.get(config.model_type) in architectures:
        return "token-classification"
    if config.model_type in IMAGE_FEATURES_FIRST and IMAGE_TEXT.get(config.model_type) in architectures:
        return "image-text-to-text"  # GIT's causal LM reads an image
    if any(name.endswith(CAUSAL_LM_SUFFIXES) for name in architectures):
        return "generation"
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ

    if SEQ2SEQ.get(config.model_type) in architectures:
        return "seq2seq"
    if config.model_type == CAPTIONER_TYPE:
        return "image-to-text"
    if IMAGE_TEXT.get(config.model_type) in architectures:
        return "image-text-to-text"
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED_LM

    if MASKED_LM.get(config.model_type) in architectures and not getattr(config, "is_encoder_decoder", False):
        return "fill-mask"
    raise CheckpointError(
        f"{folder} holds a {', '.join(architectures) or config.model_type} checkpoint, neither a sequence, token or image "
        "classifier, a question answerer nor a language model (its config.json names no *ForSequenceClassification, "
        "*ForTokenClassification, *ForImageClassification, *ForQuestionAnswering, *ForCausalLM, *LMHeadModel, *ForMaskedLM "
        "or sequence-to-sequence architecture)."
    )


TASK_KINDS = {
    "classification": "a sequence classifier", "generation": "a causal language model", "seq2seq": "a sequence-to-sequence model",
    "image-to-text": "an image captioner", "image-text-to-text": "a vision-language model",
    "image-classification": "an image classifier", "question-answering": "an extractive question answerer",
    "token-classification": "a token classifier", "fill-mask": "a masked language model",
}
"""What a user calls the model of each :func:`checkpoint_task`."""

CAPTIONER_TYPE = "vision-encoder-decoder"
"""The model type of an image encoder before a text decoder, which reads no prompt."""


_PEFT_TASKS = {
    "SEQ_CLS": "classification", "SEQ_2_SEQ_LM": "seq2seq", "QUESTION_ANS": "question-answering", "TOKEN_CLS": "token-classification",
}
"""The PEFT task types that decide the task whatever the base model's config names (a
classifier is often trained from a pretrained encoder whose config names its masked-LM head)."""

_LABELLED = ("SEQ_CLS", "TOKEN_CLS")
"""The PEFT task types whose saved head decides the number of labels."""
_VIRTUAL_TOKENS = ("PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "ADAPTION_PROMPT", "CPT")
"""PEFT methods that learn tokens or states no input token stands for, and cannot be merged."""


_MODEL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The files that hold a whole model's weights (a folder with an adapter beside them is the model)."""


@dataclass(frozen=True)
class PeftAdapter:
    """A folder that holds a PEFT adapter alone, and the checkpoint of its base model.

    Attributes:
        folder: the adapter's folder (``adapter_config.json`` and its weights).
        base: the base model's checkpoint folder (``base_model_name_or_path``: a folder,
            or a model in the local Hugging Face cache).
        task: what :func:`checkpoint_task` says of the merged model.
        task_type: the adapter's ``task_type`` (``"SEQ_CLS"``, ``"CAUSAL_LM"``, ...), or None.
    """

    folder: Path
    base: Path
    task: str
    task_type: str | None


def peft_adapter(path: str | Path) -> PeftAdapter | None:
    """The PEFT adapter saved alone in ``path`` (``adapter_config.json``, no model weights;
    a config.json beside it is the base's, as some trainers save it), or None for any
    other folder.

    Raises:
        CheckpointError: the adapter learns virtual tokens (prompt or prefix tuning),
            which cannot be merged, or its base model is neither a folder nor in the local
            Hugging Face cache.
    """
    folder = _folder(path)
    if not (folder / "adapter_config.json").is_file() or any((folder / name).is_file() for name in _MODEL_WEIGHTS):
        return None
    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{folder}/adapter_config.json is unreadable: {error_line(error)}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{folder}/adapter_config.json holds no object of settings.")
    method = str(config.get("peft_type"))
    if method in _VIRTUAL_TOKENS:
        raise CheckpointError(
            f"{folder} holds a {method} adapter, whose learned virtual tokens no input token stands for and "
            "which cannot be merged into its base model: explain a LoRA-like adapter, or the base model."
        )
    base = _adapter_base(folder, config.get("base_model_name_or_path"), config.get("revision"))
    task_type = config.get("task_type")
    task = _PEFT_TASKS.get(str(task_type)) or _config_task(base)
    return PeftAdapter(folder, base, task, task_type)


def _adapter_base(folder: Path, name: Any, revision: Any) -> Path:
    """The checkpoint folder of an adapter's base model: ``name`` as a folder, else as a
    model in the local Hugging Face cache (never downloaded)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{folder}/adapter_config.json names no base_model_name_or_path: set it to the base model's folder.")
    if Path(name).expanduser().is_dir():
        return _folder(Path(name).expanduser())
    from huggingface_hub import snapshot_download

    try:
        cached = snapshot_download(name, revision=revision or None, local_files_only=True)
    except Exception as error:  # huggingface_hub's errors for an id not cached, or not an id
        raise CheckpointError(
            f"{folder} holds a PEFT adapter of {name!r}, which is neither a folder nor a model in the local "
            "Hugging Face cache (nothing is downloaded): set base_model_name_or_path in its adapter_config.json "
            "to the base model's folder."
        ) from error
    return _folder(cached)


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

    task = checkpoint_task(path)
    if task != "classification":
        raise CheckpointError(
            f"{path} holds {TASK_KINDS[task]}, not a sequence classifier (its config.json names no "
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
        hint = " (explain it with --image)" if task.startswith("image") else ""
        raise CheckpointError(f"{path} holds {TASK_KINDS[task]}{hint}, not a causal language model.")
    return _load(Path(path), AutoModelForCausalLM)


def set_languages(model: Any, tokenizer: Any, source: str | None = None, target: str | None = None) -> None:
    """A translation model's languages, as NLLB's, M2M100's and mBART-50's model cards set
    them: ``source`` the code the tokenizer puts before the source (its ``src_lang``),
    ``target`` the answer's, the token the model's ``generate`` forces first
    (``generation_config.forced_bos_token_id``, which the answer's scores then read and do
    not explain). None leaves the model's or tokenizer's own.

    Raises:
        CheckpointError: for a model that is not an encoder-decoder, a tokenizer without
            a source language, or a code that is not one of the tokenizer's.
    """
    if source is None and target is None:
        return
    if not getattr(model.config, "is_encoder_decoder", False):
        raise CheckpointError(
            f"--source-language and --target-language are for a translation model (an encoder-decoder); "
            f"{getattr(model.config, '_name_or_path', 'the model')} is a {model.config.model_type} decoder"
        )
    if source is not None:
        if not hasattr(tokenizer, "src_lang"):
            raise CheckpointError(
                f"--source-language: the model's {type(tokenizer).__name__} takes no source language (it has no "
                "src_lang, as NLLB's, M2M100's and mBART-50's tokenizers do)"
            )
        _language_token(tokenizer, source, "--source-language")
        tokenizer.src_lang = source
    if target is not None:
        model.generation_config.forced_bos_token_id = _language_token(tokenizer, target, "--target-language")


def _language_token(tokenizer: Any, code: str, option: str) -> int:
    """The id of the token that stands for the language ``code`` (M2M100's ``"fr"`` is
    ``"__fr__"``), or a one-line error where the tokenizer has none."""
    token = tokenizer.get_lang_token(code) if hasattr(tokenizer, "get_lang_token") else code
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id or token not in tokenizer.all_special_tokens:
        codes = list(getattr(tokenizer, "lang_code_to_id", None) or getattr(tokenizer, "lang_code_to_token", None) or [])
        if not codes and hasattr(tokenizer, "src_lang"):  # NLLB's codes are its extra special tokens
            codes = [str(token) for token in getattr(tokenizer, "extra_special_tokens", None) or []]
        close = difflib.get_close_matches(code, codes, n=3)
        known = (
            f" (the closest of its {len(codes)}: {', '.join(close)})" if close
            else f" (its {len(codes)} codes begin {', '.join(codes[:4])}, ...)" if codes else ""
        )
        raise CheckpointError(f"{option} {code!r} is not a language code of the model's {type(tokenizer).__name__}{known}")
    return int(token_id)


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


def load_image_classifier(path: str | Path) -> tuple[Any, Any]:
    """``(model, image processor)`` from a local image-classification checkpoint (ViT,
    DeiT, BEiT, Swin, ...: a ``*ForImageClassification`` architecture), loaded as safely as
    :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    return _load_task(
        path, "image-classification", AutoModelForImageClassification, "an image classifier (a *ForImageClassification architecture)",
        AutoImageProcessor,
    )


def load_question_answerer(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local extractive question-answering checkpoint (BERT,
    RoBERTa, DistilBERT, ...: the ``*ForQuestionAnswering`` architecture transformers
    registers for its model type), loaded as safely as :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoModelForQuestionAnswering

    return _load_task(
        path, "question-answering", AutoModelForQuestionAnswering, "an extractive question answerer (a *ForQuestionAnswering architecture)"
    )


def load_token_classifier(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local token-classification checkpoint (a named-entity
    or part-of-speech tagger: the ``*ForTokenClassification`` architecture transformers
    registers for its model type), loaded as safely as :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoModelForTokenClassification

    return _load_task(
        path, "token-classification", AutoModelForTokenClassification, "a token classifier (a *ForTokenClassification architecture)"
    )


def load_masked_lm(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local masked language model checkpoint (BERT's,
    RoBERTa's, ...: the ``*ForMaskedLM`` transformers registers for its model type),
    loaded as safely as :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoModelForMaskedLM

    return _load_task(path, "fill-mask", AutoModelForMaskedLM, "a masked language model (a *ForMaskedLM architecture)")


def _load_task(path: str | Path, task: str, auto_class: Any, kind: str, preprocessor_class: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` (or ``preprocessor_class``'s preprocessor) of the checkpoint
    at ``path`` through ``auto_class`` where it holds ``task`` (:func:`checkpoint_task`);
    else a one-line error saying it is not ``kind``."""
    found = checkpoint_task(path)
    if found != task:
        raise CheckpointError(f"{path} holds {TASK_KINDS[found]}, not {kind}.")
    return _load(Path(path), auto_class, preprocessor_class)


def load_captioner(path: str | Path) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, image processor)`` from a local checkpoint of a model that
    captions an image with no prompt (:func:`captions_alone`): an image encoder before a
    text decoder (``VisionEncoderDecoderModel``: a ViT-GPT-2 captioner, TrOCR, Donut), or
    BLIP's or GIT's vision-language model (its processor's tokenizer and image processor),
    loaded as safely as :func:`load_classifier`.

    Raises:
        CheckpointError: as :func:`load_classifier`, for a checkpoint of another kind.
    """
    from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

    if not captions_alone(path):
        raise CheckpointError(f"{path} holds no image captioner (an image encoder before a text decoder, BLIP or GIT).")
    if checkpoint_task(path) == "image-text-to-text":
        model, processor = load_vision_language_model(path)
        return model, processor.tokenizer, processor.image_processor
    model, image_processor = _load(Path(path), VisionEncoderDecoderModel, AutoImageProcessor)
    with _loading_errors(Path(path)):
        tokenizer = _preprocessor(AutoTokenizer, Path(path))
    return model, tokenizer, image_processor


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if folder.is_file():
        raise CheckpointError(f"--model {folder} is a file: give the checkpoint's folder (with config.json)")
    if not folder.is_dir():
        hub = (
            f" (--model takes a local folder and nothing is downloaded: for the Hub's {path}, run "
            f"hf download {path} --local-dir {folder.name} first)" if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(path)) else ""
        )
        raise CheckpointError(f"model folder not found: {folder}{hub}")
    _refuse_custom_code(folder)
    return folder


def _load(folder: Path, auto_class: Any, preprocessor_class: Any = None) -> tuple[Any, Any]:
    """The model (weights through safetensors or ``weights_only`` only) and its tokenizer
    (or ``preprocessor_class``'s preprocessor: a vision-language model's processor); a
    PEFT adapter's base model with the adapter merged into it. Refused where a weight
    of the model is in no file: it would be random."""
    from transformers import AutoTokenizer

    adapter = peft_adapter(folder)
    weights = folder if adapter is None else adapter.base
    preprocessor = adapter.base if adapter is not None and not _has_preprocessor(folder) else folder
    with _loading_errors(weights):
        model, info = auto_class.from_pretrained(weights, weights_only=True, output_loading_info=True, **_OPTIONS)
        labels = None if adapter is None or adapter.task_type not in _LABELLED else _saved_label_count(model, adapter.folder)
        if labels not in (None, model.config.num_labels):  # the base's own head, if any, is of other labels
            model, info = auto_class.from_pretrained(
                weights, weights_only=True, output_loading_info=True, num_labels=labels, ignore_mismatched_sizes=True, **_OPTIONS
            )
        tokenizer = _preprocessor(preprocessor_class or AutoTokenizer, preprocessor)
    missing = set(info["missing_keys"]) | {mismatched[0] for mismatched in info.get("mismatched_keys", ())}
    if adapter is not None:
        model = _merged(model, adapter)
        missing -= set(_saved_shapes(adapter.folder))
    if missing:
        shown = ", ".join(sorted(missing)[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        cause = (
            "in none of its files" if adapter is None else
            f"neither in its base model {adapter.base} nor in the adapter (name them in modules_to_save when "
            "training it, or merge it and save the whole model)"
        )
        verb, pronoun = ("is", "it") if len(missing) == 1 else ("are", "they")
        raise CheckpointError(f"{folder}: the model's {shown} {verb} {cause}, so {pronoun} would be random.")
    return model.eval(), tokenizer


def _preprocessor(preprocessor_class: Any, folder: Path) -> Any:
    """``preprocessor_class``'s tokenizer or processor from ``folder``, or a one-line error
    that says to save one there where the folder holds none (a model saved alone): where
    transformers fails for want of the files, and where it builds a tokenizer of special
    tokens alone (BERT's), which reads every word as its unknown token."""
    images = preprocessor_class.__name__ == "AutoImageProcessor"
    try:
        preprocessor = preprocessor_class.from_pretrained(folder, **_OPTIONS)
    except (OSError, ValueError) as error:
        if (folder / IMAGE_PROCESSOR_FILE).is_file() if images else _has_preprocessor(folder):
            raise
        raise CheckpointError(_no_image_processor(folder) if images else _no_tokenizer(folder)) from error
    if _special_tokens_alone(getattr(preprocessor, "tokenizer", preprocessor)):
        raise CheckpointError(_no_tokenizer(folder))
    return preprocessor


def _special_tokens_alone(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (or an image processor) has a vocabulary of special tokens alone."""
    try:
        return set(tokenizer.get_vocab()) <= set(tokenizer.all_special_tokens)
    except (AttributeError, NotImplementedError):  # an image processor; a tokenizer that lists no vocabulary
        return False


IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
"""The file transformers saves an image processor in."""


def _no_image_processor(folder: Path) -> str:
    return (
        f"{folder} holds no image processor (no {IMAGE_PROCESSOR_FILE}): save the model's image processor beside it "
        f"(image_processor.save_pretrained({str(folder)!r}))."
    )


def _no_tokenizer(folder: Path) -> str:
    return (
        f"{folder} holds no tokenizer (no tokenizer.json, tokenizer_config.json or vocabulary file): save the "
        f"model's tokenizer, or its processor, beside it (tokenizer.save_pretrained({str(folder)!r}))."
    )


@contextmanager
def _loading_errors(folder: Path) -> Iterator[None]:
    """transformers' and PEFT's loading errors as one :class:`CheckpointError` line, their
    logs and warnings off."""
    try:
        with quiet_transformers(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the error says it all
            yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"could not load the checkpoint in {folder}: its pickled weights hold objects other than "
            "tensors, which are refused (unpickling them can run code); use a safetensors copy from a "
            "source you trust."
        ) from error
    except SafetensorError as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: its safetensors file is truncated or corrupt ({error}).") from error
    except (OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"could not load the checkpoint in {folder}: {error_line(error)}") from error


_PREPROCESSOR_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece", "special_tokens", "preprocessor", "processor")
_PREPROCESSOR_SUFFIXES = (".model", ".spm", ".tiktoken", ".tokenizer")
"""How the files of a tokenizer or processor that transformers saves begin, or end."""


def _has_preprocessor(folder: Path) -> bool:
    """Whether ``folder`` holds files of a tokenizer or processor (an adapter saved with
    one; a model saved without)."""
    return any(
        path.is_file() and (path.name.startswith(_PREPROCESSOR_PREFIXES) or path.suffix in _PREPROCESSOR_SUFFIXES)
        for path in folder.iterdir()
    )


def _saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The names (without PEFT's ``base_model.model.``) and shapes of the tensors an
    adapter saved: its own and its ``modules_to_save``."""
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    with _loading_errors(folder):
        if safetensors.is_file():
            from safetensors import safe_open

            with safe_open(str(safetensors), framework="pt") as saved:
                shapes = {key: tuple(saved.get_slice(key).get_shape()) for key in saved.keys()}
        elif pickled.is_file():
            import torch

            shapes = {key: tuple(t.shape) for key, t in torch.load(pickled, map_location="cpu", weights_only=True).items()}
        else:
            raise CheckpointError(f"{folder} holds no adapter weights (adapter_model.safetensors or adapter_model.bin).")
    return {key.removeprefix("base_model.model."): shape for key, shape in shapes.items()}


def _saved_label_count(model: Any, folder: Path) -> int | None:
    """The number of labels of the classifier head an adapter saved (its output layer:
    the linear layer of the base classifier with one output per label), or None."""
    from torch import nn

    shapes = _saved_shapes(folder)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.out_features == model.config.num_labels and f"{name}.weight" in shapes:
            return shapes[f"{name}.weight"][0]
    return None


def _merged(model: Any, adapter: PeftAdapter) -> Any:
    """``model`` with ``adapter`` merged into its weights, named after the adapter's folder
    (where the learned head weights and an evaluation's identity are read)."""
    try:
        from peft import PeftModel
    except ImportError as error:
        raise CheckpointError(f"{adapter.folder} holds a PEFT adapter, which needs the peft package: pip install peft") from error
    with _loading_errors(adapter.folder):
        merged = PeftModel.from_pretrained(model, adapter.folder).merge_and_unload()
    merged.name_or_path = merged.config._name_or_path = str(adapter.folder)
    return merged


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
