"""captum-attention: explain sentences with every method, in the terminal and as HTML.

    captum-attention explain "the plot was dull but the acting was superb" --html report.html
    captum-attention explain --model my-llm/ "Where is the key? ..." --per-token   # a language model's answer
    captum-attention explain --model my-vlm/ --image photo.png "What colour is the square?"
    captum-attention explain --model my-squad-bert/ --question "Where did the cat sit?" "The cat sat on the mat."
    captum-attention explain --model my-ner-bert/ "Ada Lovelace lived in London."   # each entity's label
    captum-attention explain --model bert-base/ "Paris is the [MASK] of France."    # the mask's token
    captum-attention evaluate data.jsonl --output results/   # every method and metric over a data set
    captum-attention train            # build (or rebuild) the cached default model
"""

from __future__ import annotations

import argparse
import os
import sys
import unicodedata
from pathlib import Path
from typing import Any, Sequence

from ..attr import METHODS
from ..capture.adapters.huggingface import reads_decoder_ids
from .evaluate import ONE_STACK_METRICS, AnswerOptions, answer_metric_names, evaluation_methods, metric_names, rationale_metrics
from .explain import (
    CLASSIFIERS_ONLY, ESTIMATES_OF_ANSWERS, INTEGRATED_GRADIENTS, PRESENCE, check_methods, check_names, default_method_names,
    answer_too_long, length_limit, method_names,
)
from .position_evaluation import POSITION_METRICS
from .text import count as _count, has_surrogates, terminal_safe


class UsageError(ValueError):
    """Bad command-line input; reported as one line on stderr."""


CACHE_HELP = (
    "cache folder for the default model (default: $CAPTUM_ATTENTION_CACHE, else "
    "$XDG_CACHE_HOME/captum-attention, else ~/.cache/captum-attention)"
)
CHAT_HELP = (
    "put each prompt in the tokenizer's chat template as the user's message, with the generation prompt, as an "
    "instruct model reads it"
)
PRESENCE_HELP = (
    f"{PRESENCE}: each token's presence in every attention call, the special tokens (and an answer) at 1 "
    "(default: 0.05)"
)


SOURCE_LANGUAGE_HELP = (
    "translation models (NLLB, M2M100, mBART-50): the source's language code, which the tokenizer puts before it "
    "(its src_lang; e.g. fra_Latn, fr_XX; default: the tokenizer's own)"
)
TARGET_LANGUAGE_HELP = (
    "translation models: the answer's language code, the token generate forces first (forced_bos_token_id), as "
    "the model cards pass it; read, not explained (e.g. deu_Latn; default: the generation config's)"
)


def _add_language_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source-language", metavar="CODE", help=SOURCE_LANGUAGE_HELP)
    parser.add_argument("--target-language", metavar="CODE", help=TARGET_LANGUAGE_HELP)


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="captum-attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('captum-attention')}")
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser("explain", help="explain sentences with every method")
    explain.add_argument("sentences", nargs="*", help="sentences to explain (batched together); for a language "
                         "model, the prompt; for a question answerer, the context; for a token classifier or a masked "
                         "language model, the text")
    explain.add_argument("--file", type=Path, help="a file with one sentence per line; for a language model, "
                         "the whole file is the prompt (a question answerer's context, a token classifier's or masked "
                         "language model's text)")
    explain.add_argument("--model", type=Path, help="a local sequence-classification, token-classification, "
                         "question-answering, image-classification, causal, masked, sequence-to-sequence, vision-language or "
                         "image-captioning checkpoint folder, or a PEFT adapter's; nothing is "
                         "downloaded (default: the embedded sentiment model, trained on first use)")
    explain.add_argument("--pair-separator", metavar="SEP",
                         help="classifiers of text pairs (NLI, paraphrase): each sentence holds the two texts the model "
                         "reads together, split at its first SEP (e.g. --pair-separator '|||'), and tokenized as a pair")
    explain.add_argument("--image", type=Path, help="vision-language models (--model): the image the prompt asks "
                         "about; its tokens are explained on their patch grid. An image captioner (an image encoder "
                         "before a text decoder) and an image classifier (ViT, DeiT, Swin, ...) take the image alone, no prompt")
    explain.add_argument("--question", help="an extractive question answerer (a *ForQuestionAnswering checkpoint): "
                         "the question, asked about the text given (the context, one argument or --file)")
    explain.add_argument("--target", help="class to explain, index or label name (default: predicted); for a "
                          "language model, the answer's text (default: the model's greedy answer); for a question "
                          "answerer, an answer as the context spells it (default: the predicted span); for a token "
                          "classifier, a word of the text whose label to explain (default: every word labelled "
                          "other than O); for a masked language model, the token to explain at each mask (default: "
                          "the most probable)")
    explain.add_argument("--max-new-tokens", type=int, default=20,
                         help="language models: tokens to generate when no --target is given (default: 20)")
    explain.add_argument("--chat", action="store_true", help="language models: " + CHAT_HELP)
    _add_language_options(explain)
    explain.add_argument("--per-token", action="store_true",
                         help="language models: also explain each answer token (one backward each)")
    explain.add_argument("--skip", metavar="REGEX",
                         help="language models: leave the prompt tokens this regular expression matches in full, "
                         "as the report shows them (without the space marks of GPT-2's tokens), out of the "
                         "explanation, as Captum's skip_tokens does (e.g. '[?.,]|the')")
    explain.add_argument("--html", type=Path, help="also write a self-contained HTML report here")
    explain.add_argument("--json", type=Path, help="also write the tokens, every method's scores and wall times "
                         "as JSON here")
    explain.add_argument("--methods", help="comma-separated methods to run (default: the methods of reports, and "
                         "integrated_gradients for classifiers): " + ", ".join(default_method_names())
                         + "; also " + ", ".join(_more_methods()) + " (attn_lrp_presence: not for a vision-language "
                         "model; attn_lrp_presence_calibrated, the presence calibrated on 8 removals of the words, "
                         "and attn_lrp_half_contexts, the presence beside AttnLRP in 8 random half contexts of the "
                         "words: classifiers only; leave_one_out_estimates, first-order leave-one-out effects with AttnLRP's "
                         "top 2 tokens deleted exactly, and leave_one_out_estimates_by_share, with the 7 tokens of "
                         "largest effect over one minus their attention share deleted: a causal language model's "
                         "answer only)")
    explain.add_argument("--ig-steps", type=int, default=50, help="Integrated Gradients steps (default: 50)")
    explain.add_argument("--batch-size", type=int, default=16,
                         help="sentences explained together; lower it to use less memory (default: 16)")
    explain.add_argument("--ig-batch-size", type=int,
                         help="Integrated Gradients' internal batch size: steps x sentences evaluated "
                         "per forward (default: all at once)")
    explain.add_argument("--presence", type=float, default=0.05, help=PRESENCE_HELP)
    explain.add_argument("--raw", action="store_true",
                         help="print the methods' scores themselves instead of each method's share of the words")
    explain.add_argument("--cache-dir", type=Path, help=CACHE_HELP)
    evaluate = commands.add_parser(
        "evaluate", help="explain and score a data set (resumable; several processes under accelerate launch)"
    )
    evaluate.add_argument("data", type=Path, help="a .jsonl or .csv file: text, optional text_pair (the second text of a pair: an "
                          "NLI model's hypothesis), optional label, optional rationale; "
                          "for a causal language model a .jsonl file: prompt (or segments), optional answer (and "
                          "image, for a vision-language model); for an image captioner (and BLIP's or GIT's captions, rows "
                          "without a prompt): image, optional answer; for an image classifier: image, optional label, "
                          "optional box ([x0, y0, x1, y1] in the image's pixels, for the pointing game); for a question "
                          "answerer: question, context, optional answer (or SQuAD's answers); for a token classifier: text "
                          "(or CoNLL-2003's tokens, a list of words), optional word; for a masked language model: text with its mask token, optional target")
    evaluate.add_argument("--output", type=Path,
                          help="folder for the shards, results.jsonl and the summary (default: DATA_evaluation in "
                          "the current folder, DATA the data file's name without its suffix); rerun to resume")
    evaluate.add_argument("--model", type=Path, help="a local sequence-classification, image-classification, causal, "
                          "sequence-to-sequence, vision-language, image-captioning, question-answering, token-classification or "
                          "masked-LM checkpoint folder, or a PEFT adapter's; nothing is "
                          "downloaded (default: the embedded sentiment model)")
    evaluate.add_argument("--methods", help="comma-separated methods (default: the methods of reports); also "
                          + ", ".join(name for name in evaluation_methods() if name not in METHODS)
                          + "; for a "
                          "language model's answers, every registered method, leave_one_out_estimates, "
                          "leave_one_out_estimates_by_share and attn_lrp_presence")
    evaluate.add_argument("--metrics", help="comma-separated metrics (default: all that the data allows): "
                          + ", ".join(metric_names()) + "; for a language model's answers: " + ", ".join(answer_metric_names())
                          + "; for a question answerer, a token classifier or a masked language model: "
                          + ", ".join(POSITION_METRICS) + " (removed tokens replaced by the mask token)")
    evaluate.add_argument("--max-new-tokens", type=int, default=20,
                          help="for a language model: the longest answer generated for a row without one (default: 20)")
    evaluate.add_argument("--chat", action="store_true", help="for a language model: " + CHAT_HELP)
    _add_language_options(evaluate)
    evaluate.add_argument("--batch-size", type=int, default=16,
                          help="examples per batch (default: 16); a language model's or captioner's, a question answerer's, a token "
                          "classifier's and a masked language model's rows run one at a time")
    evaluate.add_argument("--ig-steps", type=int, default=50, help="Integrated Gradients steps (default: 50)")
    evaluate.add_argument("--shap-evals", type=int, default=300, help="SHAP model evaluations per text (default: 300)")
    evaluate.add_argument("--presence", type=float, default=0.05, help=PRESENCE_HELP)
    evaluate.add_argument("--regions", type=int,
                          help="for an image's patches (an image captioner's captions, a vision-language model's answers): "
                          "the context metrics pool a grid of more patches a side into this many regions a side, each "
                          f"region one feature (default: {AnswerOptions.regions})")
    evaluate.add_argument("--skip-malformed", action="store_true", help="skip malformed rows instead of stopping")
    evaluate.add_argument("--cache-dir", type=Path, help=CACHE_HELP)
    fit = commands.add_parser(
        "fit-head-weights", help="fit learned_attention's head weights on a file of answers and save them beside the model"
    )
    fit.add_argument("data", type=Path, help="a .jsonl file as evaluate takes for a language model: prompt (or "
                     "segments), optional answer")
    fit.add_argument("--model", type=Path, required=True, help="a local causal language model checkpoint folder; the "
                     "weights are saved into it (head_weights.safetensors), where explain and evaluate read them")
    fit.add_argument("--ablations", type=int, default=32, help="random ablations per answer, one forward each (default: 32)")
    fit.add_argument("--seed", type=int, default=0, help="seed of the ablations (default: 0)")
    fit.add_argument("--ridge", type=float, default=1e-3, help="ridge penalty, relative to the mean diagonal of the "
                     "normal equations (default: 0.001)")
    fit.add_argument("--max-new-tokens", type=int, default=20,
                     help="the longest answer generated for a row without one (default: 20)")
    fit.add_argument("--chat", action="store_true", help=CHAT_HELP)
    fit.add_argument("--skip-malformed", action="store_true", help="skip malformed rows instead of stopping")
    train = commands.add_parser("train", help="train the default model into the cache now")
    train.add_argument("--cache-dir", type=Path, help=CACHE_HELP)
    return parser


def _more_methods() -> list[str]:
    """What ``--methods`` takes beyond the defaults."""
    return [name for name in method_names() if name not in default_method_names()]


def _visible(text: str) -> bool:
    """Whether ``text`` has a character that is not a space, control or format character
    (zero-width and bidi controls are format characters)."""
    return any(unicodedata.category(char)[0] not in "CZ" for char in text)


def _sentences(arguments: argparse.Namespace) -> list[str]:
    sentences = list(arguments.sentences)
    for position, sentence in enumerate(sentences, start=1):
        if has_surrogates(sentence):
            raise UsageError(f"sentence {position} is not valid UTF-8: {terminal_safe(sentence)}")
        if not sentence.strip():
            raise UsageError(f"sentence {position} is empty: give text to explain")
        if not _visible(sentence):
            raise UsageError(f"sentence {position} has no visible character (only spaces, control or zero-width characters)")
    if arguments.file is not None:
        lines = _file_text(arguments.file).splitlines()
        sentences += [line for line in lines if _visible(line)]
    if not sentences:
        raise UsageError("no sentence to explain: pass sentences as arguments or --file")
    return sentences


def _pairs(sentences: list[str], separator: str | None) -> list[str | tuple[str, str]]:
    """Each sentence split at its first ``separator`` into the pair of texts a classifier
    reads together (``--pair-separator``); the sentences as they are without one."""
    if separator is None:
        return list(sentences)
    if not separator.strip():
        raise UsageError("--pair-separator is empty or blank: give the characters that part the two texts, e.g. '|||'")
    pairs: list[str | tuple[str, str]] = []
    for position, sentence in enumerate(sentences, start=1):
        first, found, second = sentence.partition(separator)
        if not found or not first.strip() or not second.strip():
            raise UsageError(
                f"sentence {position} is not two texts parted by {separator!r}: {terminal_safe(sentence)}"
            )
        pairs.append((first.strip(), second.strip()))
    return pairs


def _check_outputs(arguments: argparse.Namespace) -> None:
    """Before any work: ``--html`` and ``--json`` name files that can be written."""
    for option, example in (("html", "report.html"), ("json", "explanation.json")):
        path = getattr(arguments, option)
        if path is None:
            continue
        if path.is_dir():
            raise UsageError(f"--{option} {path} is a folder: name the file, e.g. {path / example}")
        folder = path.parent
        if not folder.is_dir():
            raise UsageError(f"--{option} {path}: the folder {folder} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise UsageError(f"--{option} {path}: not writable")


def _write_json(path: Path | None, explanation: Any) -> None:
    """The explanation (a dataclass of tokens, scores and times) as JSON at ``path``."""
    if path is None:
        return
    import dataclasses
    import json

    path.write_text(json.dumps(dataclasses.asdict(explanation), ensure_ascii=False, indent=1), encoding="utf-8")
    print(terminal_safe(f"JSON written to {path}"))


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
    chosen = _listed(arguments.methods, "methods")
    if chosen is None:
        return default_method_names()
    check_names("method", chosen, method_names())
    return chosen


def _explain(arguments: argparse.Namespace) -> None:
    from .explain import explain, resolve_target
    from .html import render_html
    from ..loading import TASK_KINDS, checkpoint_task, load_classifier
    from .text import render_text

    task = None if arguments.model is None else checkpoint_task(arguments.model)
    if arguments.pair_separator is not None and task not in (None, "classification"):
        raise UsageError(f"--pair-separator is for a classifier of text pairs; {arguments.model} holds {TASK_KINDS[task]}")
    if arguments.chat and task not in ("generation", "seq2seq", "image-text-to-text"):
        raise UsageError("--chat is for a language model's prompt (a causal, sequence-to-sequence or vision-language checkpoint)")
    _check_languages(arguments, task)
    if arguments.question is not None and task != "question-answering":
        raise UsageError(f"--question is for an extractive question answerer (a *ForQuestionAnswering checkpoint); "
                         f"{arguments.model or 'the default model'} is not one")
    if task == "image-text-to-text":
        _explain_image_answer(arguments)
        return
    if task == "image-to-text":
        _explain_caption(arguments)
        return
    if task == "image-classification":
        _explain_image_class(arguments)
        return
    if arguments.image is not None:
        raise UsageError(f"--image is for an image classifier or a vision-language model; {arguments.model or 'the default model'} "
                         "is neither")
    if task == "question-answering":
        _explain_question(arguments)
        return
    if task in ("token-classification", "fill-mask"):
        _explain_at_tokens(arguments, task)
        return
    if task in ("generation", "seq2seq"):
        _explain_answer(arguments)
        return
    sentences = _pairs(_sentences(arguments), arguments.pair_separator)
    methods = _methods(arguments)
    check_methods(methods, answers=False)
    _check_presence(arguments)
    _check_counts(arguments, "ig_steps", "batch_size", "ig_batch_size")
    if arguments.skip is not None:
        raise UsageError("--skip is for a language model's prompt; a classifier's report shows every token")
    _check_outputs(arguments)
    _check_cache_dir(arguments.cache_dir)
    folder = arguments.model
    if folder is None:
        from ..demo.default_model import default_model_path

        folder = default_model_path(arguments.cache_dir)
    model, tokenizer = load_classifier(folder)
    _note_uniform_head_weights(model, methods)
    target = resolve_target(arguments.target, model.config.id2label)
    explanations = explain(
        model, tokenizer, sentences, target, arguments.ig_steps, methods=methods,
        batch_size=arguments.batch_size, ig_batch_size=arguments.ig_batch_size, presence=arguments.presence,
    )
    print(render_text(explanations, raw=arguments.raw))
    if arguments.html is not None:
        arguments.html.write_text(render_html(explanations, str(folder)), encoding="utf-8")
        print(terminal_safe(f"HTML report written to {arguments.html}"))
    _write_json(arguments.json, explanations)


def _prompt(arguments: argparse.Namespace, named: str = "prompt", model: str = "a language model") -> str:
    """A language model's one prompt (or what ``model`` reads, ``named`` so): the one
    sentence given, or the whole ``--file``."""
    if arguments.file is not None and arguments.sentences:
        raise UsageError(f"give the {named} as one argument or as --file, not both")
    if arguments.file is None:
        if len(arguments.sentences) != 1:
            raise UsageError(f"{model} explains one {named} at a time; got {len(arguments.sentences)} "
                             f"(quote the {named}, or pass --file)")
        return _sentences(arguments)[0]
    prompt = _file_text(arguments.file)
    if not _visible(prompt):
        raise UsageError(f"--file {arguments.file} holds no visible text")
    return prompt.strip()


def _check_languages(arguments: argparse.Namespace, task: str | None) -> None:
    """``--source-language`` and ``--target-language`` for a sequence-to-sequence model only."""
    given = [option for option in ("source_language", "target_language") if getattr(arguments, option) is not None]
    if given and task != "seq2seq":
        named = " and ".join("--" + option.replace("_", "-") for option in given)
        model = arguments.model or "the default model"
        raise UsageError(f"{named} {'is' if len(given) == 1 else 'are'} for a translation model (a sequence-to-sequence "
                         f"checkpoint); {model} is not one")


def _check_counts(arguments: argparse.Namespace, *options: str) -> None:
    """A one-line error where one of ``options`` (a number of steps, tokens or rows; None:
    not given) is below 1."""
    for option in options:
        value = getattr(arguments, option)
        if value is not None and value < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {value}")


def _explain_answer(arguments: argparse.Namespace) -> None:
    """``explain`` for a causal or sequence-to-sequence language model: the answer, and
    each method's prompt (source) tokens."""
    from ..loading import load_causal_lm, set_languages
    from .answer import chat_prompt, explain_answer, without_added_bos

    message = _prompt(arguments)
    if arguments.target is not None and has_surrogates(arguments.target):
        raise UsageError(f"--target is not valid UTF-8: {terminal_safe(arguments.target)}")
    _check_counts(arguments, "max_new_tokens", "ig_steps")
    methods = list(METHODS) if arguments.methods is None else _methods(arguments)
    check_methods(methods, answers=True)
    _check_presence(arguments)
    skip = _skip_pattern(arguments.skip)
    _check_outputs(arguments)
    model, tokenizer = load_causal_lm(arguments.model, seq2seq=True)
    set_languages(model, tokenizer, arguments.source_language, arguments.target_language)
    prompt = chat_prompt(tokenizer, message) if arguments.chat else without_added_bos(tokenizer, message)
    _note_uniform_head_weights(model, methods)
    prompt_tokens = len(tokenizer(prompt)["input_ids"])
    too_long = answer_too_long(model, tokenizer, prompt_tokens, arguments.target, arguments.max_new_tokens, "--target")
    if too_long is not None:
        raise UsageError(too_long)
    explanation = explain_answer(
        model, tokenizer, prompt, arguments.target, arguments.max_new_tokens, methods, arguments.per_token,
        arguments.ig_steps, skip, arguments.presence, message if arguments.chat else None,
    )
    _report_answer(arguments, explanation)


def _explain_image_answer(arguments: argparse.Namespace) -> None:
    """``explain`` for a vision-language model: the answer about ``--image``, each method's
    prompt tokens (the image's as one) and the image's grid."""
    from ..attr import REGISTRY
    from ..capture.adapters.images import image_outside_prompt
    from ..loading import load_vision_language_model
    from .answer import explain_image_answer

    prompt = _prompt(arguments) if arguments.sentences or arguments.file is not None else None
    if arguments.image is None:
        raise UsageError(f"{arguments.model} holds a vision-language model: give the image with --image")
    if not arguments.image.is_file():
        raise UsageError(f"--image {arguments.image}: no such file")
    if arguments.skip is not None:
        raise UsageError("--skip is not available with --image yet")
    _check_counts(arguments, "max_new_tokens", "ig_steps")
    methods = list(METHODS) if arguments.methods is None else _methods(arguments)
    for unavailable in (PRESENCE, *CLASSIFIERS_ONLY):
        if unavailable in methods:
            raise UsageError(f"{unavailable} is not available for vision-language models; choose --methods among "
                             + ", ".join([*(name for name, cls in REGISTRY.items() if cls.spec.spans), *ESTIMATES_OF_ANSWERS,
                                          INTEGRATED_GRADIENTS]))
    _check_outputs(arguments)
    model, processor = load_vision_language_model(arguments.model)
    if prompt is None and not image_outside_prompt(model):
        raise UsageError(f"{arguments.model} answers a prompt about the image: give the prompt (quoted), or --file")
    prompt = prompt or ""  # a caption: GIT's and BLIP's after their start token alone
    _note_uniform_head_weights(model, methods)
    try:
        explanation = explain_image_answer(
            model, processor, prompt, str(arguments.image), arguments.target, arguments.max_new_tokens, methods,
            arguments.per_token, arguments.chat, arguments.ig_steps,
        )
    except OSError as error:  # PIL cannot read it
        raise UsageError(f"--image {arguments.image}: {error}") from error
    _report_answer(arguments, explanation)


def _check_image_alone(arguments: argparse.Namespace, kind: str, unread: str, target: str) -> None:
    """A one-line error where a model of ``kind`` that reads an image alone (no ``unread``)
    is given text, or no ``--image`` file; ``target``: what ``--target`` explains then."""
    if arguments.sentences or arguments.file is not None:
        raise UsageError(f"{arguments.model} holds {kind}, which reads no {unread}: give only --image (and --target to "
                         f"explain {target})")
    if arguments.image is None:
        raise UsageError(f"{arguments.model} holds {kind}: give the image with --image")
    if not arguments.image.is_file():
        raise UsageError(f"--image {arguments.image}: no such file")


def _explain_caption(arguments: argparse.Namespace) -> None:
    """``explain`` for an image captioner (an image encoder before a text decoder): the
    caption of ``--image``, each method's scores of the image's patches, summed and on
    their grid."""
    from ..loading import load_captioner
    from .answer import explain_caption

    _check_image_alone(arguments, "an image captioner", "prompt", "a caption of your own")
    if arguments.skip is not None or arguments.chat:
        raise UsageError("--skip and --chat are for a prompt; an image captioner reads none")
    _check_counts(arguments, "max_new_tokens", "ig_steps")
    methods = list(METHODS) if arguments.methods is None else _methods(arguments)
    _check_caption_methods(methods)
    _check_outputs(arguments)
    model, tokenizer, image_processor = load_captioner(arguments.model)
    try:
        explanation = explain_caption(
            model, tokenizer, image_processor, str(arguments.image), arguments.target, arguments.max_new_tokens, methods,
            arguments.per_token, arguments.ig_steps,
        )
    except OSError as error:  # PIL cannot read it
        raise UsageError(f"--image {arguments.image}: {error}") from error
    _report_answer(arguments, explanation)


def _explain_image_class(arguments: argparse.Namespace) -> None:
    """``explain`` for an image classifier: the class of ``--image``, each method's scores
    of the image's patches on their grid."""
    from ..loading import load_image_classifier
    from .explain import resolve_target
    from .image_class import check_image_class_methods, explain_image_class

    _check_image_alone(arguments, "an image classifier", "text", "another class")
    textual = [f"--{option.replace('_', '-')}" for option in ("per_token", "skip") if getattr(arguments, option)]
    if textual:
        raise UsageError(f"{', '.join(textual)}: for text; an image classifier reads an image alone")
    _check_counts(arguments, "ig_steps")
    methods = default_method_names() if arguments.methods is None else _methods(arguments)
    check_image_class_methods(methods)
    _check_outputs(arguments)
    model, processor = load_image_classifier(arguments.model)
    _note_uniform_head_weights(model, methods)
    target = resolve_target(arguments.target, model.config.id2label)
    try:
        explanation = explain_image_class(model, processor, str(arguments.image), target, methods, arguments.ig_steps)
    except OSError as error:  # PIL cannot read it
        raise UsageError(f"--image {arguments.image}: {error}") from error
    _report_answer(arguments, explanation)


def _explain_question(arguments: argparse.Namespace) -> None:
    """``explain`` for an extractive question answerer: the answer to ``--question`` in the
    context (the one text given, or ``--file``), its start and end logits each explained by
    every method."""
    from ..loading import load_question_answerer
    from .question_answering import explain_question

    if arguments.question is None or not _visible(arguments.question):
        raise UsageError(f"{arguments.model} holds an extractive question answerer: give the question as --question TEXT "
                         "and the context it is answered from as the text (or --file)")
    context = _prompt(arguments, "context", "a question answerer")
    for option, value in (("question", arguments.question), ("target", arguments.target)):
        if value is not None and has_surrogates(value):
            raise UsageError(f"--{option} is not valid UTF-8: {terminal_safe(value)}")
    methods = _position_request(arguments, "a question answerer", "an answer's start and end")
    model, tokenizer = load_question_answerer(arguments.model)
    _note_uniform_head_weights(model, methods)
    explanation = explain_question(
        model, tokenizer, arguments.question, context, arguments.target, methods, arguments.ig_steps, arguments.ig_batch_size,
        arguments.presence,
    )
    _report_answer(arguments, explanation)


def _explain_at_tokens(arguments: argparse.Namespace, task: str) -> None:
    """``explain`` for a model read at chosen tokens of one text (the one text given, or
    ``--file``): a token classifier's labelled words (or ``--target``'s), a masked language
    model's masks (with ``--target``'s token), each explained by every method at its
    token."""
    from ..loading import TASK_KINDS, load_masked_lm, load_token_classifier
    from .token_class import explain_masks, explain_token_labels

    kind = TASK_KINDS[task]
    text = _prompt(arguments, "text", kind)
    if arguments.target is not None and has_surrogates(arguments.target):
        raise UsageError(f"--target is not valid UTF-8: {terminal_safe(arguments.target)}")
    masked = task == "fill-mask"
    methods = _position_request(arguments, kind, "the mask whose prediction is read" if masked else "the word whose label is read")
    model, tokenizer = (load_masked_lm if masked else load_token_classifier)(arguments.model)
    _note_uniform_head_weights(model, methods)
    explanation = (explain_masks if masked else explain_token_labels)(
        model, tokenizer, text, arguments.target, methods, arguments.ig_steps, arguments.ig_batch_size, arguments.presence
    )
    _report_answer(arguments, explanation)


def _position_request(arguments: argparse.Namespace, kind: str, explained: str) -> list[str]:
    """Before any work, for a model of ``kind`` whose logits are read at a token: the
    options for a prompt refused, the counts, the presence and the output paths checked;
    the chosen methods, those that cannot explain the logit at a token (``explained``)
    refused."""
    from .positions import check_position_methods

    unread = [f"--{option.replace('_', '-')}" for option in ("per_token", "skip") if getattr(arguments, option)]
    if unread:
        raise UsageError(f"{', '.join(unread)}: for a language model's prompt; {kind}'s report shows every token")
    _check_counts(arguments, "ig_steps", "ig_batch_size")
    methods = _methods(arguments)
    check_position_methods(methods, explained)
    _check_presence(arguments)
    _check_outputs(arguments)
    return methods


def _report_answer(arguments: argparse.Namespace, explanation: Any) -> None:
    """An answer's (or an image classifier's prediction's) explanation: its warnings, the
    terminal report, and the HTML and JSON files asked for."""
    from .html import render_answer_html, render_image_class_html, render_question_html, render_token_class_html
    from .image_class import ImageClassExplanation
    from .question_answering import QuestionAnswerExplanation
    from .text import render_answer_text, render_image_class_text, render_question_text, render_token_class_text
    from .token_class import TokenClassExplanation

    render_text, render_html = (
        (render_image_class_text, render_image_class_html) if isinstance(explanation, ImageClassExplanation)
        else (render_question_text, render_question_html) if isinstance(explanation, QuestionAnswerExplanation)
        else (render_token_class_text, render_token_class_html) if isinstance(explanation, TokenClassExplanation)
        else (render_answer_text, render_answer_html)
    )
    for warning in explanation.warnings:
        print(terminal_safe(f"captum-attention: warning: {warning}"), file=sys.stderr)
    print(render_text(explanation, raw=arguments.raw))
    if arguments.html is not None:
        arguments.html.write_text(render_html(explanation, str(arguments.model)), encoding="utf-8")
        print(terminal_safe(f"HTML report written to {arguments.html}"))
    _write_json(arguments.json, explanation)


def _note_uniform_head_weights(model: Any, methods: list[str]) -> None:
    """A note where learned_attention runs without head weights saved beside the model."""
    from .explain import saved_head_weights

    if "learned_attention" in methods and saved_head_weights(model) is None:
        print("captum-attention: note: no head weights beside the model (head_weights.safetensors): learned_attention "
              "weighs every layer and head alike; fit them with captum-attention fit-head-weights ANSWERS --model DIR",
              file=sys.stderr)


def _file_text(path: Path) -> str:
    """``--file``'s text, without the byte-order mark some editors write first; one line
    where it cannot be read."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise UsageError(f"cannot read --file {path}: {reason}") from error


def _skip_pattern(pattern: str | None) -> str | None:
    """``--skip`` checked as a regular expression."""
    if pattern is None:
        return None
    import re

    try:
        re.compile(pattern)
    except re.error as error:
        raise UsageError(f"--skip {pattern!r} is not a regular expression: {error}") from error
    return pattern


def _listed(value: str | None, option: str) -> list[str] | None:
    if value is None:
        return None
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    if not chosen:
        raise UsageError(f"--{option} is empty")
    return chosen


def _evaluate(arguments: argparse.Namespace) -> None:
    from .dataset import holds_prompts
    from .evaluate import Options, check_request, evaluate, read_dataset
    from ..loading import captions_alone, checkpoint_task, load_classifier

    task = None if arguments.model is None else checkpoint_task(arguments.model)
    _check_languages(arguments, task)
    if task in ("question-answering", "token-classification", "fill-mask"):
        _evaluate_positions(arguments, task)
        return
    if task == "image-classification":
        _evaluate_images(arguments)
        return
    if task == "image-to-text" or (task == "image-text-to-text" and captions_alone(arguments.model) and not holds_prompts(arguments.data)):
        _evaluate_captions(arguments)
        return
    if arguments.regions is not None and task != "image-text-to-text":
        raise UsageError("--regions is for an image's patches; this model reads no image")
    if task in ("generation", "seq2seq", "image-text-to-text"):
        _evaluate_answers(arguments, vision=task == "image-text-to-text")
        return
    if arguments.chat:
        raise UsageError("--chat is for a language model's prompts; a classifier reads each text as it is")
    if min(arguments.batch_size, arguments.ig_steps, arguments.shap_evals) < 1:
        raise UsageError("--batch-size, --ig-steps and --shap-evals must be at least 1")
    _check_presence(arguments)
    examples, skipped = read_dataset(arguments.data, arguments.skip_malformed)
    _report_skipped(arguments, skipped)
    methods = _listed(arguments.methods, "methods") or list(METHODS)
    has_rationales = all(e.rationale is not None for e in examples)
    metrics = _listed(arguments.metrics, "metrics") or [m for m in metric_names() if has_rationales or m not in rationale_metrics()]
    check_request(methods, metrics, examples)
    state = _evaluation_state(arguments)
    folder = arguments.model
    if folder is None:
        from ..demo.default_model import default_model_path

        folder = default_model_path(arguments.cache_dir, progress=state.is_main_process)
    model, tokenizer = load_classifier(folder)
    if arguments.metrics is None and reads_decoder_ids(model):  # BART's: the defaults that erase one stack's attention go
        metrics = [m for m in metrics if m not in ONE_STACK_METRICS]
    if state.is_main_process:
        _note_uniform_head_weights(model, methods)
    model.to(state.device)
    examples = _labelled(examples, model.config.id2label, arguments)
    examples = _rankable(examples, tokenizer, length_limit(model, tokenizer), arguments)
    options = Options(
        batch_size=arguments.batch_size, ig_steps=arguments.ig_steps, shap_evals=arguments.shap_evals, presence=arguments.presence
    )
    evaluate(
        model, tokenizer, examples, methods, metrics, arguments.output, options, state.process_index,
        state.num_processes, _progress(state, "batches", "batch"), _resuming(state, arguments, "batches"),
    )
    if state.is_main_process:
        _report_cut(examples, tokenizer, length_limit(model, tokenizer), arguments)
    _merged(state, arguments, examples, metrics, options)


def _evaluate_positions(arguments: argparse.Namespace, task: str) -> None:
    """``evaluate`` for a question answerer, a token classifier or a masked language
    model: each row's answer, labelled words or masks explained as ``explain`` explains
    them, and scored by the token-removal metrics with the removed tokens replaced."""
    from ..loading import TASK_KINDS, load_masked_lm, load_question_answerer, load_token_classifier
    from .dataset import read_positions
    from .evaluate import Options
    from .position_evaluation import check_position_request, evaluate_positions, position_row_problem

    if arguments.chat or arguments.regions is not None:
        raise UsageError(f"--chat and --regions are for a language model's prompts and answers; {TASK_KINDS[task]} reads a text")
    _check_counts(arguments, "ig_steps")
    _check_presence(arguments)
    methods = _listed(arguments.methods, "methods") or list(METHODS)
    metrics = _listed(arguments.metrics, "metrics") or list(POSITION_METRICS)
    check_position_request(task, methods, metrics)  # before the model loads
    examples, skipped = read_positions(arguments.data, task, arguments.skip_malformed)
    _report_skipped(arguments, skipped)
    state = _evaluation_state(arguments)
    load = {"question-answering": load_question_answerer, "token-classification": load_token_classifier, "fill-mask": load_masked_lm}
    model, tokenizer = load[task](arguments.model)
    model.to(state.device)  # the rows' check runs a forward each: on the device the run uses
    examples = _kept_rows([(example, position_row_problem(model, tokenizer, task, example)) for example in examples], arguments,
                          "no row the model can explain")
    if state.is_main_process:
        _note_uniform_head_weights(model, methods)
    options = Options(ig_steps=arguments.ig_steps, presence=arguments.presence)
    evaluate_positions(
        model, tokenizer, task, examples, methods, metrics, arguments.output, options, state.process_index,
        state.num_processes, _progress(state, "examples", "example"), _resuming(state, arguments, "examples"),
    )
    _merged(state, arguments, examples, metrics, options)


def _evaluate_images(arguments: argparse.Namespace) -> None:
    """``evaluate`` for an image classifier: each row's image explained for its predicted
    class over the patches, and scored by the removal metrics with its patches greyed."""
    from ..loading import load_image_classifier
    from .evaluate import Options, check_image_request, evaluate_images, image_class_metric_choices, read_images

    if arguments.chat or arguments.regions is not None:
        raise UsageError("--chat and --regions are for a language model's prompts and answers; an image classifier reads an image")
    _check_counts(arguments, "batch_size", "ig_steps")
    examples, skipped = read_images(arguments.data, arguments.skip_malformed)
    _report_skipped(arguments, skipped)
    methods = _listed(arguments.methods, "methods") or list(METHODS)
    metrics = _listed(arguments.metrics, "metrics") or image_class_metric_choices(examples)
    check_image_request(methods, metrics, examples)
    state = _evaluation_state(arguments)
    model, processor = load_image_classifier(arguments.model)
    if state.is_main_process:
        _note_uniform_head_weights(model, methods)
    model.to(state.device)
    examples = _labelled(examples, model.config.id2label, arguments)
    options = Options(batch_size=arguments.batch_size, ig_steps=arguments.ig_steps)
    evaluate_images(
        model, processor, examples, methods, metrics, arguments.output, options, state.process_index, state.num_processes,
        _progress(state, "batches", "batch"), _resuming(state, arguments, "batches"),
    )
    _merged(state, arguments, examples, metrics, options)


def _evaluate_answers(arguments: argparse.Namespace, vision: bool = False) -> None:
    """``evaluate`` for a causal or sequence-to-sequence language model: each row's answer
    explained over its prompt (the source) and scored by the context metrics; for a
    vision-language model (``vision``), over its prompt about the row's image."""
    from ..loading import load_causal_lm, load_vision_language_model, set_languages
    from .evaluate import evaluate_answers, image_metric_names, image_row_problem, read_answers

    _check_counts(arguments, "max_new_tokens", "ig_steps", "regions")
    _check_presence(arguments)
    examples, skipped = read_answers(arguments.data, arguments.skip_malformed)
    _report_skipped(arguments, skipped)
    methods = _listed(arguments.methods, "methods") or list(METHODS)
    metrics = _listed(arguments.metrics, "metrics") or answer_metric_names()
    _check_image_rows(examples, arguments, vision)
    state = _evaluation_state(arguments)
    processor = None
    if vision:
        model, processor = load_vision_language_model(arguments.model)
        tokenizer = processor.tokenizer
        if arguments.chat:
            examples = _kept_rows([_in_image_chat_template(example, processor) for example in examples], arguments,
                                  "no row the chat template keeps whole")
        checked = [(example, image_row_problem(model, processor, example, arguments.max_new_tokens)) for example in examples]
        examples = _kept_rows(checked, arguments, "no row the model takes whole")
    else:
        model, tokenizer = load_causal_lm(arguments.model, seq2seq=True)
        set_languages(model, tokenizer, arguments.source_language, arguments.target_language)
        examples = _answers_that_fit(examples, model, tokenizer, arguments)
    if state.is_main_process:
        _note_uniform_head_weights(model, methods)
        _note_prompts(examples, model, tokenizer, arguments)
    model.to(state.device)
    options = AnswerOptions(max_new_tokens=arguments.max_new_tokens, presence=arguments.presence, ig_steps=arguments.ig_steps,
                            regions=arguments.regions or AnswerOptions.regions)
    evaluate_answers(
        model, tokenizer, examples, methods, metrics, arguments.output, options, state.process_index,
        state.num_processes, _progress(state, "answers", "answer"), _resuming(state, arguments, "answers"), processor,
    )
    _merged(state, arguments, examples, [*metrics, *(image_metric_names(metrics) if vision else [])], options)


def _evaluate_captions(arguments: argparse.Namespace) -> None:
    """``evaluate`` for an image captioner: each row's caption of its image explained over
    the image's patches and scored by the context metrics, patches greyed."""
    from ..loading import load_captioner
    from .answer import caption_prompt
    from .evaluate import caption_metric_names, check_caption_metrics, evaluate_captions, read_answers

    _check_counts(arguments, "max_new_tokens", "ig_steps", "regions")
    if arguments.chat:
        raise UsageError("--chat is for a prompt; an image captioner reads none")
    examples, skipped = read_answers(arguments.data, arguments.skip_malformed, captions=True)
    _report_skipped(arguments, skipped)
    methods = _listed(arguments.methods, "methods") or list(METHODS)
    _check_caption_methods(methods)
    metrics = _listed(arguments.metrics, "metrics") or caption_metric_names()
    check_caption_metrics(metrics)  # before the model loads
    state = _evaluation_state(arguments)
    model, tokenizer, image_processor = load_captioner(arguments.model)
    prompt = caption_prompt(model, tokenizer)
    read = 0 if prompt is None else prompt.shape[1]
    checked = [(example, answer_too_long(model, tokenizer, read, example.answer, arguments.max_new_tokens, "the answer"))
               for example in examples]
    examples = _kept_rows(checked, arguments, "no row the model takes whole")
    model.to(state.device)
    options = AnswerOptions(max_new_tokens=arguments.max_new_tokens, ig_steps=arguments.ig_steps,
                            regions=arguments.regions or AnswerOptions.regions)
    evaluate_captions(
        model, tokenizer, image_processor, examples, methods, metrics, arguments.output, options, state.process_index,
        state.num_processes, _progress(state, "captions", "caption"), _resuming(state, arguments, "captions"),
    )
    _merged(state, arguments, examples, metrics, options)


def _check_caption_methods(methods: list[str]) -> None:
    """A one-line error for a method that cannot explain an image captioner's caption."""
    from .evaluate import caption_method_names

    available = caption_method_names()
    unavailable = [name for name in methods if name not in available]
    if unavailable:
        raise UsageError(f"{unavailable[0]} is not available for an image captioner; choose --methods among {', '.join(available)}")


def _check_image_rows(examples: list[Any], arguments: argparse.Namespace, vision: bool) -> None:
    """A one-line error where the rows' images do not suit the model: a vision-language
    model's rows each need an ``image``, another model's none."""
    with_image = [e.line for e in examples if e.image is not None]
    if not vision:
        if with_image:
            raise UsageError(f"rows name an 'image' (line {with_image[0]}), but {arguments.model} holds no vision-language model")
        return
    without = [e.line for e in examples if e.image is None]
    if without:
        raise UsageError(f"{arguments.model} holds a vision-language model: every row needs an 'image' (line {without[0]} has none)")


def _answers_that_fit(examples: list[Any], model: Any, tokenizer: Any, arguments: argparse.Namespace) -> list[Any]:
    """The rows whose prompt and answer the model takes (:func:`_kept_rows`), each prompt
    read with one BOS (:func:`_with_one_bos`), in the chat template with ``--chat``
    (:func:`_in_chat_template`: a row whose message the template changes is refused too)."""

    template = _chat_template_around(tokenizer) if arguments.chat else None

    def checked(example: Any) -> tuple[Any, str | None]:
        example = _with_one_bos(example, tokenizer)
        if template is not None:
            example, changed = _in_chat_template(example, tokenizer, template)
            if changed is not None:
                return example, changed
        prompt_tokens = len(tokenizer(example.text)["input_ids"])
        return example, answer_too_long(model, tokenizer, prompt_tokens, example.answer, arguments.max_new_tokens, "the answer")

    return _kept_rows([checked(example) for example in examples], arguments, "no row the model takes whole")


def _with_one_bos(example: Any, tokenizer: Any) -> Any:
    """The answer row without the BOS token's text its prompt (and so its segments) begins
    with where the tokenizer adds that token itself
    (:func:`~captum_attention.presentation.answer.without_added_bos`)."""
    import dataclasses

    from .answer import without_added_bos

    prompt = without_added_bos(tokenizer, example.text)
    if prompt == example.text or example.segments is None:
        return dataclasses.replace(example, text=prompt)
    cut, segments = len(example.text) - len(prompt), []
    for segment in example.segments:
        dropped = min(cut, len(segment))
        cut -= dropped
        segments += [segment[dropped:]] if segment[dropped:] else []
    return dataclasses.replace(example, text=prompt, segments=tuple(segments))


_MESSAGE = "\ue000"
"""A private-use character: the message whose place in the chat template marks where a
row's prompt goes."""


def _chat_template_around(tokenizer: Any) -> tuple[str, str]:
    """The text the tokenizer's chat template puts before and after a user's message
    (:func:`~captum_attention.presentation.answer.chat_prompt`), or ``("", "")`` where it
    does not hold the message as given."""
    from .answer import chat_prompt

    before, marked, after = chat_prompt(tokenizer, _MESSAGE).partition(_MESSAGE)
    return (before, after) if marked else ("", "")


def _in_chat_template(example: Any, tokenizer: Any, around: tuple[str, str]) -> tuple[Any, str | None]:
    """The answer row with its prompt as the user's message in the tokenizer's chat
    template, which puts ``around`` (:func:`_chat_template_around`) before and after it,
    the message's characters marked (the template around them is never removed; the
    segments make up the message), and None; where the template changes the message's
    text, the row as it is and what is wrong."""
    import dataclasses

    from .answer import chat_prompt

    before, after = around
    templated = chat_prompt(tokenizer, example.text)
    if templated != before + example.text + after:
        return example, (
            "the chat template changes the prompt's text (it trims or rewrites it), so its segments and removals cannot be "
            "placed in it; put the prompt in the template in the file, without --chat"
        )
    return dataclasses.replace(example, text=templated, message=(len(before), len(before) + len(example.text))), None


def _in_image_chat_template(example: Any, processor: Any) -> tuple[Any, str | None]:
    """A vision-language model's answer row with its image and prompt as the user's turn in
    the processor's chat template, the prompt's characters marked as the message (the
    template's tokens are never removed), and None; where the template does not hold the
    prompt's text as given, the row as it is and what is wrong."""
    import dataclasses

    from .answer import chat_prompt

    try:
        templated = chat_prompt(processor.tokenizer, [{"type": "image"}, {"type": "text", "text": example.text}], processor)
    except ValueError as error:  # no chat template: every row alike
        raise UsageError(str(error)) from None
    start = templated.rfind(example.text)
    if start < 0:
        return example, "the chat template changes the prompt's text (it trims or rewrites it); put the prompt in the template in the file, without --chat"
    return dataclasses.replace(example, text=templated, message=(start, start + len(example.text))), None


def _note_prompts(examples: list[Any], model: Any, tokenizer: Any, arguments: argparse.Namespace) -> None:
    """One line each where prompts hold words the tokenizer reads as its unknown token or
    its padding (:func:`~captum_attention.presentation.answer.unknown_words`), and where
    given answers are read glued to their prompt's last word
    (:func:`~captum_attention.presentation.answer.glued_answer`); each prompt tokenized once."""
    from .answer import glued_answer, unknown_words

    glued, unknown = [], []
    for example in examples:
        prompt_ids = tokenizer(example.text)["input_ids"]
        if example.answer is not None and glued_answer(
            model, tokenizer, prompt_ids, example.answer, tokenizer(example.answer, add_special_tokens=False)["input_ids"]
        ):
            glued.append(example.line)
        if unknown_words(tokenizer, example.text, prompt_ids):
            unknown.append(example.line)
    _warn_of_rows(arguments, glued, "answer", "read glued to the prompt's last word (no space between them): begin each "
                  "with a space if the model writes one there")
    _warn_of_rows(arguments, unknown, "prompt", "with words the tokenizer reads as its unknown token or its padding, which "
                  "the model reads alike and the reports leave out as special tokens")


def _warn_of_rows(arguments: argparse.Namespace, lines: list[int], counted: str, says: str) -> None:
    """One warning naming how many rows (the first by its line) of what is ``counted``
    ``says`` holds of; nothing where there are none."""
    if lines:
        where = f"line {lines[0]}" + (f" and {len(lines) - 1} more" if len(lines) > 1 else "")
        print(terminal_safe(f"captum-attention: warning: {arguments.data}: {_count(len(lines), counted)} ({where}) {says}"),
              file=sys.stderr)


def _check_presence(arguments: argparse.Namespace) -> None:
    if not 0 < arguments.presence <= 1:
        raise UsageError(f"--presence must lie in (0, 1] (1: each token as it is), got {arguments.presence}")


def _report_skipped(arguments: argparse.Namespace, skipped: list[str]) -> None:
    for problem in skipped:
        print(terminal_safe(f"captum-attention: skipped {arguments.data}, {problem}"), file=sys.stderr)


def _evaluation_state(arguments: argparse.Namespace) -> Any:
    """The output folder checked (named after the data by default) and this process's state,
    with a warning where a launcher started fewer processes than asked."""
    if arguments.output is None:
        arguments.output = Path(f"{arguments.data.stem}_evaluation")
    if arguments.output.exists() and not arguments.output.is_dir():
        raise UsageError(f"--output {arguments.output} is a file: name a folder")
    _check_cache_dir(arguments.cache_dir)
    state = _process_state()
    asked = _launcher_processes()
    if asked is not None and asked > state.num_processes and state.is_main_process:
        print(
            f"captum-attention: warning: accelerate launch was asked for {asked} processes but started "
            f"{state.num_processes}: add --multi_gpu (Accelerate's torchrun launcher, for CPU processes too)",
            file=sys.stderr,
        )
    return state


def _progress(state: Any, units: str, unit: str) -> Any:
    """A progress bar over the main process's work."""
    if not state.is_main_process:
        return None
    from tqdm.auto import tqdm

    return lambda todo: tqdm(todo, desc=units, unit=unit)


def _resuming(state: Any, arguments: argparse.Namespace, unit: str) -> Any:
    def resuming(done: int, total: int) -> None:
        if state.is_main_process:
            print(terminal_safe(f"resuming: {done} of {total} {unit} already done in {arguments.output}"), flush=True)

    return resuming


def _merged(state: Any, arguments: argparse.Namespace, examples: Sequence[Any], metrics: list[str], options: Any) -> None:
    """Once every process is done, the main process merges the shards and prints the summary."""
    from .evaluate import merge, summary_markdown

    state.wait_for_everyone()
    if state.is_main_process:
        summary = merge(arguments.output, examples, metrics, options.bootstrap, options.seed)
        print(summary_markdown(summary, metrics))
        print(terminal_safe(
            f"rows in {arguments.output / 'results.jsonl'}, summary in {arguments.output / 'summary.md'} and .csv, "
            f"report in {arguments.output / 'report.html'}"
        ))


def _kept_rows(checked: list[tuple[Any, str | None]], arguments: argparse.Namespace, none_left: str) -> list[Any]:
    """The examples of ``checked`` (each with what is wrong with it, or None) with nothing
    wrong; the first other refused before any work with its line, or with
    ``--skip-malformed`` each skipped and reported; ``none_left`` says what the data set
    lacks where none is kept."""
    wrong = [(example, problem) for example, problem in checked if problem is not None]
    if wrong and not arguments.skip_malformed:
        example, problem = wrong[0]
        more = f" ({len(wrong)} rows in all)" if len(wrong) > 1 else ""
        raise UsageError(
            f"{arguments.data}, line {example.line}: {problem}{more}: fix or remove such rows, or pass "
            "--skip-malformed to skip them"
        )
    for example, problem in wrong:
        print(terminal_safe(f"captum-attention: skipped {arguments.data}, line {example.line}: {problem}"), file=sys.stderr)
    kept = [example for example, problem in checked if problem is None]
    if not kept:
        raise UsageError(f"{arguments.data} has {none_left}")
    return kept


def _rankable(examples: list[Any], tokenizer: Any, max_length: int, arguments: argparse.Namespace) -> list[Any]:
    """The examples a metric can rank (:func:`_kept_rows`)."""
    from .dataset import unrankable

    unranked = unrankable(examples, tokenizer, max_length)
    problem = "no token to rank (every token is special or unknown to the tokenizer)"
    return _kept_rows([(e, problem if e in unranked else None) for e in examples], arguments, "no row with a token to rank")


def _labelled(examples: list[Any], id2label: dict[int, str], arguments: argparse.Namespace) -> list[Any]:
    """The examples with each label as the model's class index, a label's name mapped by
    the model's labels; those whose label is none of the model's refused or skipped
    (:func:`_kept_rows`)."""
    import dataclasses

    from .explain import resolve_target

    def checked(example: Any) -> tuple[Any, str | None]:
        try:
            label = None if example.label is None else resolve_target(str(example.label), id2label, "'label'")
        except ValueError as error:
            return example, str(error)
        return dataclasses.replace(example, label=label), None

    return _kept_rows([checked(example) for example in examples], arguments, "no row whose label is one of the model's")


def _report_cut(examples: list[Any], tokenizer: Any, max_length: int, arguments: argparse.Namespace) -> None:
    """One line where texts are longer than the model takes: they are explained and scored
    cut there, as ``explain`` cuts a sentence."""
    from ..loading import quiet_transformers

    with quiet_transformers():  # its note on sequences longer than the model takes: said here, once
        lengths = [len(ids) for ids in tokenizer([e.inputs for e in examples])["input_ids"]]
    cut = [example.line for example, length in zip(examples, lengths) if length > max_length]
    _warn_of_rows(arguments, cut, "text", f"longer than the {max_length} tokens the model takes, explained and scored cut there")


class _SingleProcess:
    process_index, num_processes, is_main_process, device = 0, 1, True, "cpu"

    def wait_for_everyone(self) -> None:
        return None


def _process_state() -> Any:
    """Accelerate's process state when it is installed (one process, or each of the
    processes ``accelerate launch`` or ``torchrun`` started; on a machine without CUDA
    they join over gloo), else one process on the CPU."""
    try:
        from accelerate import PartialState
    except ImportError:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UsageError("several processes need Hugging Face Accelerate: pip install accelerate") from None
        return _SingleProcess()
    import torch

    return PartialState(cpu=not torch.cuda.is_available())


def _launcher_processes() -> int | None:
    """How many processes ``accelerate launch`` was asked for (its ``--num_processes``)
    when it started this one itself, its simple launcher; else None. Read from the
    launcher's command line (Linux ``/proc``), the only place that number is kept."""
    if "ACCELERATE_USE_CPU" not in os.environ or "WORLD_SIZE" in os.environ:
        return None
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for index, word in enumerate(words):
        value = words[index + 1] if word == "--num_processes" and index + 1 < len(words) else None
        value = word.split("=", 1)[1] if word.startswith("--num_processes=") else value
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def _fit_head_weights(arguments: argparse.Namespace) -> None:
    """``fit-head-weights``: Learned Attention's head weights fitted on a file of answers,
    saved into the model's folder; a rerun of an interrupted fit resumes it."""
    from ..loading import TASK_KINDS, checkpoint_task, load_causal_lm
    from .dataset import read_answers
    from .fit import FitOptions, fit_beside_model

    task = checkpoint_task(arguments.model)
    if task != "generation":
        raise UsageError(f"fit-head-weights takes a decoder-only language model (learned_attention explains one "
                         f"self-attention stack); {arguments.model} holds {TASK_KINDS[task]}")
    if arguments.ablations < 2:
        raise UsageError(f"--ablations must be at least 2 (each answer's mean is removed), got {arguments.ablations}")
    _check_counts(arguments, "max_new_tokens")
    if not arguments.ridge >= 0:
        raise UsageError(f"--ridge must be 0 or more, got {arguments.ridge}")
    if not os.access(arguments.model, os.W_OK):
        raise UsageError(f"cannot write the head weights into {arguments.model}: the folder is not writable")
    examples, skipped = read_answers(arguments.data, arguments.skip_malformed)
    _report_skipped(arguments, skipped)
    _check_image_rows(examples, arguments, False)
    model, tokenizer = load_causal_lm(arguments.model)
    examples = _answers_that_fit(examples, model, tokenizer, arguments)
    _note_prompts(examples, model, tokenizer, arguments)
    options = FitOptions(arguments.ablations, arguments.seed, arguments.ridge, arguments.max_new_tokens)
    weights, path = fit_beside_model(model, tokenizer, examples, arguments.model, options)
    layers, heads = weights.weights.shape
    print(terminal_safe(f"head weights ({layers} layers × {heads} heads, fitted on {_count(len(examples), 'answer')}, "
                        f"{arguments.ablations} ablations each) written to {path}"))


def _train(arguments: argparse.Namespace) -> None:
    from ..demo.default_model import default_model_path, read_metadata

    _check_cache_dir(arguments.cache_dir)
    folder = default_model_path(arguments.cache_dir, force=True)
    metadata = read_metadata(folder) or {}
    print(terminal_safe(f"default model written to {folder} (held-out accuracy {metadata.get('heldout_accuracy', 0):.1%})"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    arguments = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from ..capture import AttentionNotFoundError
    from ..loading import CheckpointError

    try:
        if arguments.command == "explain":
            _explain(arguments)
        elif arguments.command == "evaluate":
            _evaluate(arguments)
        elif arguments.command == "fit-head-weights":
            _fit_head_weights(arguments)
        else:
            _train(arguments)
    except (UsageError, CheckpointError, ValueError, RuntimeError) as error:
        hint = " From the command line, --methods integrated_gradients explains it without attention." if isinstance(
            error, AttentionNotFoundError) else ""
        print(terminal_safe(f"captum-attention: error: {error}{hint}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line, no traceback
        from .evaluate import ResumableInterrupt

        print(f"captum-attention: {interrupt if isinstance(interrupt, ResumableInterrupt) else 'interrupted'}", file=sys.stderr)
        return 130
    except OSError as error:  # the file system said no: a path, a permission, a full disk
        where = f": {error.filename}" if error.filename else ""
        print(terminal_safe(f"captum-attention: error: {error.strerror or error}{where}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
