"""captum-attention: explain sentences with every method, in the terminal and as HTML.

    captum-attention explain "the plot was dull but the acting was superb" --html report.html
    captum-attention train            # build (or rebuild) the cached default model
"""

from __future__ import annotations

import argparse
import os
import sys
import unicodedata
from pathlib import Path
from typing import Sequence

from .explain import method_names


class UsageError(ValueError):
    """Bad command-line input; reported as one line on stderr."""


CACHE_HELP = (
    "cache folder for the default model (default: $CAPTUM_ATTENTION_CACHE, else "
    "$XDG_CACHE_HOME/captum-attention, else ~/.cache/captum-attention)"
)


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="captum-attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('captum-attention')}")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="explain sentences with every method")
    explain.add_argument("sentences", nargs="*", help="sentences to explain (batched together)")
    explain.add_argument("--file", type=Path, help="a file with one sentence per line")
    explain.add_argument("--model", type=Path, help="a local sequence-classification checkpoint folder "
                         "(default: the embedded sentiment model, trained on first use)")
    explain.add_argument("--target", help="class to explain, index or label name (default: predicted)")
    explain.add_argument("--html", type=Path, help="also write a self-contained HTML report here")
    explain.add_argument("--methods", help="comma-separated methods to run (default: all): "
                         + ", ".join(method_names()))
    explain.add_argument("--ig-steps", type=int, default=50, help="Integrated Gradients steps (default: 50)")
    explain.add_argument("--batch-size", type=int, default=16,
                         help="sentences explained together; lower it to use less memory (default: 16)")
    explain.add_argument("--ig-batch-size", type=int,
                         help="Integrated Gradients' internal batch size: steps x sentences evaluated "
                         "per forward (default: all at once)")
    explain.add_argument("--raw", action="store_true",
                         help="print the methods' scores themselves instead of each method's share of the words")
    explain.add_argument("--cache-dir", type=Path, help=CACHE_HELP)
    train = commands.add_parser("train", help="train the default model into the cache now")
    train.add_argument("--cache-dir", type=Path, help=CACHE_HELP)
    return parser


def _visible(text: str) -> bool:
    """Whether ``text`` has a character that is not a space, control or format character
    (zero-width and bidi controls are format characters)."""
    return any(unicodedata.category(char)[0] not in "CZ" for char in text)


def _sentences(arguments: argparse.Namespace) -> list[str]:
    sentences = list(arguments.sentences)
    for position, sentence in enumerate(sentences, start=1):
        if not sentence.strip():
            raise UsageError(f"sentence {position} is empty: give text to explain")
        if not _visible(sentence):
            raise UsageError(f"sentence {position} has no visible character (only spaces, control or zero-width characters)")
    if arguments.file is not None:
        try:
            lines = arguments.file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise UsageError(f"cannot read --file {arguments.file}: {reason}") from error
        sentences += [line for line in lines if _visible(line)]
    if not sentences:
        raise UsageError("no sentence to explain: pass sentences as arguments or --file")
    return sentences


def _check_html(path: Path | None) -> None:
    """Before any work: ``--html`` names a file that can be written."""
    if path is None:
        return
    if path.is_dir():
        raise UsageError(f"--html {path} is a folder: name the report file, e.g. {path / 'report.html'}")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"--html {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--html {path}: not writable")


def _check_cache_dir(path: Path | None) -> None:
    """Before any work: ``--cache-dir`` is (or can become) a writable folder."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise UsageError(f"--cache-dir {path} is a file, not a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"--cache-dir {path}: cannot create or write {existing}")


def _methods(arguments: argparse.Namespace) -> list[str]:
    if arguments.methods is None:
        return method_names()
    chosen = [name.strip() for name in arguments.methods.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in method_names()]
    if unknown or not chosen:
        named = ", ".join(map(repr, unknown)) or "nothing"
        raise UsageError(f"--methods: {named} is not a method; choose from {', '.join(method_names())}")
    return chosen


def _explain(arguments: argparse.Namespace) -> None:
    from .explain import explain, resolve_target
    from .html import render_html
    from .loading import load_classifier
    from .text import render_text

    sentences = _sentences(arguments)
    methods = _methods(arguments)
    for name in ("ig_steps", "batch_size", "ig_batch_size"):
        value = getattr(arguments, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    _check_html(arguments.html)
    _check_cache_dir(arguments.cache_dir)
    folder = arguments.model
    if folder is None:
        from ..demo.default_model import default_model_path

        folder = default_model_path(arguments.cache_dir)
    model, tokenizer = load_classifier(folder)
    target = resolve_target(arguments.target, model.config.id2label)
    explanations = explain(
        model, tokenizer, sentences, target, arguments.ig_steps, methods=methods,
        batch_size=arguments.batch_size, ig_batch_size=arguments.ig_batch_size,
    )
    print(render_text(explanations, raw=arguments.raw))
    if arguments.html is not None:
        arguments.html.write_text(render_html(explanations, str(folder)), encoding="utf-8")
        print(f"HTML report written to {arguments.html}")


def _train(arguments: argparse.Namespace) -> None:
    from ..demo.default_model import default_model_path, read_metadata

    _check_cache_dir(arguments.cache_dir)
    folder = default_model_path(arguments.cache_dir, force=True)
    metadata = read_metadata(folder) or {}
    print(f"default model written to {folder} (held-out accuracy {metadata.get('heldout_accuracy', 0):.1%})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    arguments = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from .loading import CheckpointError

    try:
        if arguments.command == "explain":
            _explain(arguments)
        else:
            _train(arguments)
    except (UsageError, CheckpointError, ValueError, RuntimeError) as error:
        print(f"captum-attention: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # the file system said no: a path, a permission, a full disk
        where = f": {error.filename}" if error.filename else ""
        print(f"captum-attention: error: {error.strerror or error}{where}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
