"""``captum-attention``: explain sentences with every method, in the terminal and as HTML.

    captum-attention explain "the plot was dull but the acting was superb" --html report.html
    captum-attention train            # build (or rebuild) the cached default model
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from .explain import method_names


class UsageError(ValueError):
    """Bad command-line input; reported as one line on stderr."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captum-attention", description=__doc__.split("\n\n")[0])
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
    explain.add_argument("--cache-dir", type=Path, help="cache folder for the default model "
                         "(default: $CAPTUM_ATTENTION_CACHE or $XDG_CACHE_HOME/captum-attention)")
    train = commands.add_parser("train", help="train the default model into the cache now")
    train.add_argument("--cache-dir", type=Path, help="cache folder (as for explain)")
    return parser


def _sentences(arguments: argparse.Namespace) -> list[str]:
    sentences = list(arguments.sentences)
    for position, sentence in enumerate(sentences, start=1):
        if not sentence.strip():
            raise UsageError(f"sentence {position} is empty: give text to explain")
    if arguments.file is not None:
        try:
            lines = arguments.file.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise UsageError(f"cannot read --file {arguments.file}: {error.strerror}") from error
        sentences += [line for line in lines if line.strip()]
    if not sentences:
        raise UsageError("no sentence to explain: pass sentences as arguments or --file")
    return sentences


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
    if arguments.ig_steps < 1:
        raise UsageError(f"--ig-steps must be at least 1, got {arguments.ig_steps}")
    folder = arguments.model
    if folder is None:
        from ..demo.default_model import default_model_path

        folder = default_model_path(arguments.cache_dir)
    model, tokenizer = load_classifier(folder)
    target = resolve_target(arguments.target, model.config.id2label)
    explanations = explain(model, tokenizer, sentences, target, arguments.ig_steps, methods=methods)
    print(render_text(explanations))
    if arguments.html is not None:
        arguments.html.write_text(render_html(explanations, str(folder)), encoding="utf-8")
        print(f"HTML report written to {arguments.html}")


def _train(arguments: argparse.Namespace) -> None:
    from ..demo.default_model import default_model_path, read_metadata

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
