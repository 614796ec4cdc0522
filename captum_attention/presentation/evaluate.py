"""Explain and score a whole data set: every chosen method, every chosen metric, resumable.

:func:`evaluate` reads examples (:func:`read_dataset`), sorts them by length into batches
(length-sorted buckets waste little padding), explains each batch with every method and
scores each explanation with every metric. Each batch's rows are written to their own
shard file, atomically (a temporary file renamed into place), so an interrupted run
resumes where it stopped with no row lost or written twice: a shard that exists is done.
Under ``accelerate launch --num_processes K`` each process takes every K-th batch and
writes its own shards; the main process merges them into ``results.jsonl`` and the summary
(mean and 95% bootstrap confidence interval per method and metric) once all are done. A
batch is computed the same way whichever process runs it, so any number of processes gives
the same rows and numbers as one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from ..attr import METHODS
from ..capture.adapters import HuggingFaceAdapter
from ..capture.adapters.huggingface import reads_decoder_ids
from ..capture.adapters.images import image_outside_prompt, image_token_layout, prompt_as_generated
from ..capture.guard import ctrl_c_noticed
from ..capture.identity import is_offloaded, weights_digest
from ..capture.inputs import forced_first_token, output_logits
from ..loading import checkpoint_files_digest
from ..metrics import METRICS as METRIC_REGISTRY
from ..metrics import ImagePatches, MetricContext, PatchRemoval, box_patches, calibrated_attribution, greedy_deletion, image_patches
from ..metrics._checks import check_class_probabilities
from ..metrics.context import answer_log_probs, shared_ablations
from ..metrics.patches import caption_log_probs
from ..metrics.token_removal import example_seeds, pair_token_types, shared_removals
from .answer import grey_pixels, processed_pixels, shape_over_image
from .dataset import (
    BOX_FORMAT, AnswerExample, DatasetError, Example, ImageExample, batches, read_answers, read_dataset, read_images,
    write_atomically,
)
from .display import first_visible, outside_span, special_tokens
from .explain import (
    CALIBRATED, ESTIMATES, ESTIMATES_OF_ANSWERS, HALF_CONTEXTS, INTEGRATED_GRADIENTS, PRESENCE, ReportMethod, Text,
    answer_estimates, answer_integrated_gradients, answer_span, batch_padding_side,
    check_methods, check_names, class_outputs, classifier_forward, classifier_inputs,
    ig_baseline, in_half_contexts, length_limit, method_names, noted, once_per_batch, prompt_of, refined_method, registered_method,
    removable_segments, report_methods, saved_head_weights, span_presence, types_separator,
)
from .html import IMAGE_METRIC_PREFIX
from .image_class import check_image_class_methods, image_class_method_names, image_integrated_gradients
from .summary import merge, summarise, summary_markdown

__all__ = [
    "AnswerExample", "AnswerOptions", "DatasetError", "Example", "IMAGE_BOX_METRICS", "IMAGE_CLASS_METRICS", "ImageExample", "Options",
    "OtherRunError",
    "ROWS_VERSION", "answer_metric_names", "caption_method_names", "caption_metric_names", "check_caption_metrics",
    "image_class_metric_choices", "image_metric_names", "batches", "check_image_request", "check_request", "evaluate", "evaluate_answers",
    "evaluate_captions", "evaluate_images", "evaluation_methods", "merge", "read_answers", "read_images", "run_manifest",
    "metric_names", "rationale_metrics", "read_dataset", "summarise", "summary_markdown",
]


def metric_names() -> list[str]:
    """What ``metrics=`` accepts: the registered classification metrics
    (:data:`captum_attention.metrics.METRICS`), in registration order."""
    return [name for name, spec in METRIC_REGISTRY.items() if spec.task == "classification"]


def rationale_metrics() -> list[str]:
    """The registered metrics that need a rationale on every row."""
    return [name for name, spec in METRIC_REGISTRY.items() if spec.needs_rationale]


def check_request(methods: Sequence[str], metrics: Sequence[str], examples: Sequence[Example]) -> None:
    """A clear error for an unknown method or metric, a method that cannot explain a
    classifier (:func:`~captum_attention.presentation.explain.check_methods`), SHAP on text
    pairs, or plausibility without rationales."""
    check_names("method", methods, evaluation_methods())
    check_methods(methods, answers=False)
    check_names("metric", metrics, metric_names())
    pairs = [e.line for e in examples if e.text_pair is not None]
    if SHAP in methods and pairs:
        raise ValueError(
            f"shap masks one text and line {pairs[0]} holds a pair ('text_pair'): leave shap out of --methods for text pairs"
        )
    asked = [m for m in metrics if METRIC_REGISTRY[m].needs_rationale]
    missing = [e.line for e in examples if e.rationale is None]
    if asked and missing:
        raise ValueError(
            f"{', '.join(asked)} need a 'rationale' on every row; line {missing[0]} has none "
            f"({len(missing)} rows in all): add them, or leave these metrics out"
        )


SMOOTHGRAD, SHAP = "smoothgrad", "shap"
GREEDY = "attn_lrp_presence_greedy"
REFINED: dict[str, Callable[[Any], Callable[..., Tensor]]] = {
    CALIBRATED: lambda attn_lrp: calibrated_attribution,
    GREEDY: lambda attn_lrp: greedy_deletion,
    HALF_CONTEXTS: in_half_contexts,
}
"""The methods that refine :data:`PRESENCE`'s scores with a few removals of the words, and
how, given the model's AttnLRP: each refinement takes ``(forward, ids, mask, prior, target,
keep=...)``."""


def evaluation_methods() -> list[str]:
    """What ``methods=`` accepts: ``explain``'s for classifiers (:func:`~captum_attention.presentation.explain.method_names`:
    the registered methods, Integrated Gradients, AttnLRP at a presence, at
    ``options.presence``, that presence calibrated on 8 random removals of the words, and
    beside AttnLRP in 8 random half contexts of them),
    SmoothGrad, SHAP, and the presence's top tokens chosen by greedy deletion over 8
    removals (:data:`GREEDY`, :func:`~captum_attention.metrics.greedy_deletion`)."""
    return [*(name for name in method_names() if name not in ESTIMATES_OF_ANSWERS), SMOOTHGRAD, SHAP, GREEDY]


@dataclass
class Options:
    """How to evaluate: batch size, method budgets, the metrics' settings."""

    batch_size: int = 16
    ig_steps: int = 50
    smoothgrad_samples: int = 10
    shap_evals: int = 300
    presence: float = 0.05
    bootstrap: int = 1000
    seed: int = 0


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: Options | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> int:
    """Explain and score this process's batches into ``output/shards``; returns how many
    batches it computed. Batches whose shard is there are done: ``on_resume(done, total)``
    hears of them (all processes' batches) before the work starts. See :func:`merge`."""
    options = options or Options()
    check_request(methods, metrics, examples)
    check_class_probabilities(model, "; explain it with explain")
    check_two_stacks(model, methods, metrics)
    separator = types_separator(tokenizer, [e.inputs for e in examples])
    explainers = _explainers(model, tokenizer, methods, options, separator)
    return sharded(
        Path(output), run_manifest(model, examples, methods, metrics, options), batches(examples, tokenizer, options.batch_size),
        lambda batch: _evaluate_batch(model, tokenizer, batch, explainers, metrics, separator), process_index, num_processes,
        progress, on_resume,
    )


ONE_STACK_METRICS = ("decision_flip", "erasure_js")
"""The classifier metrics that erase attention in one self-attention stack's layers."""


def check_two_stacks(model: Any, methods: Sequence[str], metrics: Sequence[str]) -> None:
    """Where ``model`` is an encoder-decoder's classifier (BART's, reading the text in its
    encoder and again in its decoder), a one-line error for the methods and metrics that
    take one stack: those :func:`~captum_attention.presentation.explain.check_methods`
    refuses, SmoothGrad (such a classifier takes no input embeddings), the refinements of
    AttnLRP at a presence (:data:`REFINED`) and :data:`ONE_STACK_METRICS`."""
    if not reads_decoder_ids(model):
        return
    one_stack = (SMOOTHGRAD, *REFINED, *ONE_STACK_METRICS)
    check_methods([m for m in methods if m not in one_stack], answers=False, one_stack=False)
    refused = [name for name in (*methods, *metrics) if name in one_stack]
    if refused:
        raise ValueError(
            f"{', '.join(refused)} {'takes' if len(refused) == 1 else 'take'} one self-attention stack's embeddings or "
            "attention, and "
            f"{type(model).__name__} reads the text in its encoder and again in its decoder: leave "
            f"{'it' if len(refused) == 1 else 'them'} out"
        )


def sharded(
    output: Path, manifest: dict[str, Any], units: Sequence[Any], rows_of: Callable[[Any], list[dict[str, Any]]],
    process_index: int, num_processes: int, progress: Callable[[Iterable[Any]], Iterable[Any]] | None,
    on_resume: Callable[[int, int], None] | None,
) -> int:
    """The shard of unit k is ``rows_of(units[k])``, written by process ``k % num_processes``
    unless it is there already (``on_resume`` hears how many are); returns how many this
    process computed. Ctrl-C raises :class:`EvaluationInterrupted`."""
    shards = output / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    _check_same_run(output, manifest)
    done = sum(_shard(shards, k).exists() for k in range(len(units)))
    if done and on_resume is not None:
        on_resume(done, len(units))
    todo = [(k, unit) for k, unit in enumerate(units) if k % num_processes == process_index and not _shard(shards, k).exists()]
    try:
        with ctrl_c_noticed() as ctrl_c:
            for k, unit in progress(todo) if progress is not None else todo:
                write_atomically(_shard(shards, k), "".join(json.dumps(row) + "\n" for row in rows_of(unit)))
                if ctrl_c():  # its KeyboardInterrupt was swallowed on the way
                    raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        raise EvaluationInterrupted(sum(_shard(shards, k).exists() for k in range(len(units))), len(units)) from interrupt
    return len(todo)


class ResumableInterrupt(KeyboardInterrupt):
    """Ctrl-C during a run that the same command resumes; the message says so."""


class EvaluationInterrupted(ResumableInterrupt):
    """Ctrl-C during :func:`evaluate`: ``done`` of ``total`` batches have their shards
    written (all processes'); the same call resumes from there."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"interrupted after {done} of {total} batches; rerun the same command to resume")
        self.done, self.total = done, total


ROWS_VERSION = 4
"""How the rows are computed: raised whenever a method's scores or a metric's draws change
for the same example, so that a run is never resumed into rows of two kinds. 2: each
example's LDS removals and SmoothGrad noise drawn from its own seed; manifests written
before had no such entry. 3: a vision-language model's rows scored over the image's
patches too (:func:`image_metric_names`), and ranked by the prompt tokens' scores where it
reads its image apart. 4: the token-removal metrics run identical removals of an example
once, so that they tie exactly."""


def run_manifest(
    model: Any, examples: Sequence[Any], methods: Sequence[str], metrics: Sequence[str], options: Any, tokenizer: Any = None
) -> dict[str, Any]:
    """What makes two runs the same run (so that one may resume the other): the data's
    hash, the methods, the metrics, the model, the batch size, the methods' budgets, the
    head weights Learned Attention reads, the library's version and :data:`ROWS_VERSION`;
    with the ``tokenizer`` of answers, a translation model's languages too (its
    ``src_lang`` and the answer's forced first token), which set outside the checkpoint's
    files (``--source-language``, ``--target-language``) change what it reads and answers."""
    return {
        "data": data_digest(examples),
        "methods": list(methods),
        "metrics": list(metrics),
        "model": model_identity(model),
        "batch_size": getattr(options, "batch_size", 1),
        "budgets": _budgets(options),
        "head_weights": _head_weights_digest(model) if "learned_attention" in methods else None,
        "languages": None if tokenizer is None else [getattr(tokenizer, "src_lang", None), forced_first_token(model)],
        "version": _version(),
        "rows_version": ROWS_VERSION,
    }


def data_digest(examples: Sequence[Any]) -> str:
    """The SHA-256 of the rows, every field but their position; an image by its bytes'
    digest, wherever its file lies (a row without one, or without a box, as before images
    and boxes were read)."""
    rows = [
        [value for field, value in zip(dataclasses.fields(e), dataclasses.astuple(e))
         if field.name not in ("index", "image") and not (field.name in ("image_sha256", "box") and value is None)]
        for e in examples
    ]
    return hashlib.sha256(json.dumps(rows).encode("utf-8")).hexdigest()


def model_identity(model: Any) -> str:
    """The model's folder, its number of parameters and the first 16 hex digits of
    :func:`~captum_attention.capture.identity.weights_digest` and of
    :func:`~captum_attention.loading.checkpoint_files_digest` (its configuration, tokenizer
    and processor): a model trained again into the same folder, loaded in another dtype,
    or tokenized otherwise, is another model. So is the same model with other weights
    offloaded, whose values are not read: the identity says so, and a refused resume names
    the cause."""
    folder, size = getattr(model.config, "_name_or_path", ""), sum(p.numel() for p in model.parameters())
    files = checkpoint_files_digest(folder)[:16]
    weights = weights_digest(model)[:16] + (" (some offloaded, their values unread)" if is_offloaded(model) else "")
    return f"{folder} ({size} parameters, weights {weights}, files {files})"


def _head_weights_digest(model: Any) -> str:
    """The SHA-256 of the head weights saved beside ``model``, or ``"uniform"``."""
    path = saved_head_weights(model)
    return "uniform" if path is None else hashlib.sha256(path.read_bytes()).hexdigest()


def _budgets(options: Any) -> list[Any]:
    if isinstance(options, AnswerOptions):
        return [options.max_new_tokens, options.presence, options.ig_steps, options.regions, options.seed]
    return [options.ig_steps, options.smoothgrad_samples, options.shap_evals, options.presence, options.seed]


def _version() -> str:
    try:
        return importlib.metadata.version("captum-attention")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class OtherRunError(ValueError):
    """The output folder holds the results of another run (the message names the difference)."""


def _check_same_run(output: Path, manifest: dict[str, Any]) -> None:
    """Resume only the same run: refuse a folder whose manifest differs, or whose shards
    came from a run without one; write the manifest for a new run."""
    path = output / "manifest.json"
    if path.exists():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        changed = [key for key in manifest if recorded.get(key) != manifest[key]]
        if changed:
            key = changed[0]
            raise OtherRunError(
                f"{output} holds another run ({key}: {_shown(recorded.get(key))} there, {_shown(manifest[key])} "
                "now): name a new --output, or repeat that run's data and options to resume it"
            )
        return
    if any((output / "shards").glob("batch-*.jsonl")):
        raise OtherRunError(f"{output} holds results without a run manifest: name a new --output")
    write_atomically(path, json.dumps(manifest, indent=1) + "\n")


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    text = str(value)
    return text[:12] if len(text) == 64 else text  # a hash: its start


def _shard(folder: Path, batch: int) -> Path:
    return folder / f"batch-{batch:06d}.jsonl"


Explainer = Callable[[Tensor, Tensor, Tensor, list[Text]], Tensor]


def _explainers(
    model: Any, tokenizer: Any, names: Sequence[str], options: Options, separator: int | None = None
) -> dict[str, Explainer]:
    """Method name -> ``explain(ids, mask, targets, texts) -> (batch, seq_len)`` scores, of
    :func:`~captum_attention.presentation.explain.classifier_forward` with the text pairs'
    ``separator``."""
    refined = [n for n in names if n in REFINED]
    reported = [n for n in names if n in method_names() and n not in REFINED] + ([PRESENCE] if refined and PRESENCE not in names else [])
    chosen = report_methods(model, options.ig_steps, reported, None, tokenizer, options.presence, separator)

    def from_report(method: ReportMethod) -> Explainer:
        return lambda ids, mask, targets, texts: noted(method.run(ids, mask, targets, ig_baseline(ids, tokenizer))).scores.detach()

    explainers = {name: from_report(method) for name, method in chosen.items()}
    if SMOOTHGRAD in names:
        explainers[SMOOTHGRAD] = _smoothgrad(model, options.smoothgrad_samples, separator)
    if SHAP in names:
        explainers[SHAP] = _shap(model, tokenizer, options.shap_evals)
    if refined:
        explainers[PRESENCE] = once_per_batch(explainers[PRESENCE])
        forward = classifier_forward(model, separator)
        attn_lrp = METHODS["attn_lrp"](forward, model=model)
        for name in refined:
            explainers[name] = refined_method(explainers[PRESENCE], REFINED[name](attn_lrp), forward, tokenizer)
    return {name: explainers[name] for name in names}


def _smoothgrad(model: Any, samples: int, separator: int | None = None) -> Explainer:
    """SmoothGrad (Captum's ``NoiseTunnel`` over ``Saliency``) on the word embeddings,
    summed over the hidden dimension; each example alone, unpadded, with σ = 0.1 · its
    embeddings' standard deviation and noise from its own seed (:func:`example_seeds`):
    the same scores in any batch, under any padding and in any process. Given the text
    pairs' ``separator``, their token types as
    :func:`~captum_attention.metrics.pair_token_types` reads them."""
    from captum.attr import NoiseTunnel, Saliency

    def forward(embeddings: Tensor, mask: Tensor, types: Tensor | None) -> Tensor:
        return model(inputs_embeds=embeddings, attention_mask=mask, **({} if types is None else {"token_type_ids": types})).logits

    tunnel = NoiseTunnel(Saliency(forward))

    def explain(ids: Tensor, mask: Tensor, targets: Tensor, texts: list[Text]) -> Tensor:
        scores = torch.zeros(ids.shape, device=ids.device)
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):  # every device manual_seed seeds
            for row, own_seed in enumerate(example_seeds(ids, mask, 0).tolist()):
                real = mask[row] != 0
                row_ids, row_mask = ids[row, real][None], mask[row : row + 1, real]
                embeddings = model.get_input_embeddings()(row_ids).detach()
                types = None if separator is None else pair_token_types(row_ids, row_mask, separator)
                torch.manual_seed(own_seed)
                smoothed = tunnel.attribute(
                    embeddings, nt_type="smoothgrad", nt_samples=samples, stdevs=0.1 * float(embeddings.std()),
                    target=targets[row : row + 1], additional_forward_args=(row_mask, types),
                )
                scores[row, real] = smoothed[0].sum(dim=-1).detach()
        return scores

    return explain


def _shap(model: Any, tokenizer: Any, evals: int) -> Explainer:
    from .shap_text import shap_token_values

    def forward(ids: Tensor, mask: Tensor) -> Tensor:
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.cpu()

    def explain(ids: Tensor, mask: Tensor, targets: Tensor, texts: list[Text]) -> Tensor:
        singles = [text for text in texts if isinstance(text, str)]
        assert len(singles) == len(texts)  # check_request refuses SHAP on pairs
        side = batch_padding_side(model, tokenizer, singles)
        return shap_token_values(forward, tokenizer, singles, targets.cpu(), evals, side).to(ids.device)

    return explain


def _evaluate_batch(
    model: Any, tokenizer: Any, batch: list[Example], explainers: dict[str, Explainer], metrics: Sequence[str],
    separator: int | None = None,
) -> list[dict[str, Any]]:
    texts = [e.inputs for e in batch]
    encoded = classifier_inputs(model, tokenizer, texts, separator, truncation=True, max_length=length_limit(model, tokenizer))
    device = next(model.parameters()).device
    ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    forward = classifier_forward(model, separator)
    with torch.no_grad():
        logits = forward(ids, mask)
    probabilities, predicted = class_outputs(model.config, logits), logits.argmax(dim=-1)
    rationale = None
    if any(METRIC_REGISTRY[m].needs_rationale for m in metrics):
        rationale = _rationale_tokens(encoded, batch).to(device)
    context = MetricContext(model, special_tokens(ids, tokenizer), rationale)
    rows = []
    with shared_removals():  # the methods' metrics run each removal of the batch once
        for name, explain in explainers.items():
            scores = explain(ids, mask, predicted, texts).float().masked_fill(mask == 0, 0.0)
            values = {m: METRIC_REGISTRY[m].function(forward, ids, scores, (mask,), predicted, context) for m in metrics}
            rows += _class_rows(batch, name, predicted, probabilities, values)
    return rows


def _class_rows(
    batch: Sequence[Example | ImageExample], method: str, predicted: Tensor, probabilities: Tensor, values: dict[str, Tensor]
) -> list[dict[str, Any]]:
    """A classifier's rows of one method for a batch: each example's label, the predicted
    class and its probability, and each metric's ``values`` ``(batch,)``."""
    return [
        {
            "index": example.index, "line": example.line, "method": method, "label": example.label,
            "predicted": int(predicted[row]), "probability": float(probabilities[row, predicted[row]]),
            **{metric: _number(value[row]) for metric, value in values.items()},
        }
        for row, example in enumerate(batch)
    ]


IMAGE_CLASS_METRICS = ("comprehensiveness", "sufficiency", "datamodeling")
"""The classification metrics that score an image classifier's patches by removing them
(:func:`~captum_attention.metrics.image_patches`)."""
IMAGE_BOX_METRICS = ("token_f1", "auprc", "pointing_game")
"""The plausibility metrics an image classifier's patches take where each row gives the
object's box: the patches in it (:func:`~captum_attention.metrics.box_patches`) are the
rationale. The other metrics erase the attention paid to tokens."""


def image_class_metric_choices(examples: Sequence[ImageExample]) -> list[str]:
    """The metrics an image classifier's rows take: the removal metrics, and the box's
    where every row gives one."""
    boxed = bool(examples) and all(example.box is not None for example in examples)
    return [*IMAGE_CLASS_METRICS, *(IMAGE_BOX_METRICS if boxed else ())]


def check_image_request(methods: Sequence[str], metrics: Sequence[str], examples: Sequence[ImageExample]) -> None:
    """A clear error for a method or metric that cannot explain or score an image
    classifier's patches, or an unknown one; for a box's metric where a row gives no box."""
    check_image_class_methods(methods)
    check_names("method", methods, image_class_method_names())
    boxed = [m for m in metrics if m in IMAGE_BOX_METRICS]
    unboxed = [e.line for e in examples if e.box is None]
    if boxed and unboxed:
        raise ValueError(f"{', '.join(boxed)} compare with the object's box: give a 'box' ({BOX_FORMAT}) on every row (line "
                         f"{unboxed[0]} has none), or leave them out")
    allowed = [*IMAGE_CLASS_METRICS, *IMAGE_BOX_METRICS]
    unavailable = [m for m in metrics if m in METRIC_REGISTRY and m not in allowed]
    if unavailable:
        raise ValueError(f"{', '.join(unavailable)}: not over an image's patches (they erase the attention paid to tokens); "
                         f"choose --metrics among {', '.join(allowed)}")
    check_names("metric", metrics, allowed)


def evaluate_images(
    model: Any,
    image_processor: Any,
    examples: Sequence[ImageExample],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: Options | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> int:
    """:func:`evaluate` for an image classifier (ViT, DeiT, Swin, ...): each batch of
    ``options.batch_size`` rows' images explained for the predicted class by every method on
    the patch grid (``attribute(pixel_values, target=...)``; Integrated Gradients on the
    pixels, summed per patch) and scored by the metrics of :data:`IMAGE_CLASS_METRICS` over
    the patches, a removed patch's pixels taken from a uniform grey image through the same
    ``image_processor`` (:func:`~captum_attention.metrics.image_patches`), and by those of
    :data:`IMAGE_BOX_METRICS` against the patches in each row's box, where the processor
    keeps the whole image (else refused in one line). Rows, resuming and processes as
    :func:`evaluate`'s."""
    options = options or Options()
    check_image_request(methods, metrics, examples)
    check_class_probabilities(model, "; explain it with explain")
    if set(metrics) & set(IMAGE_BOX_METRICS):
        _check_boxes_on_the_grid(model, image_processor, examples)
    explainers = {name: registered_method(name, model) for name in methods if name != INTEGRATED_GRADIENTS}
    units = [list(examples[start : start + options.batch_size]) for start in range(0, len(examples), options.batch_size)]
    return sharded(
        Path(output), run_manifest(model, examples, methods, metrics, options), units,
        lambda batch: _evaluate_image_batch(model, image_processor, batch, methods, explainers, metrics, options),
        process_index, num_processes, progress, on_resume,
    )


def _evaluate_image_batch(
    model: Any, image_processor: Any, batch: list[ImageExample], methods: Sequence[str], explainers: dict[str, Any],
    metrics: Sequence[str], options: Options,
) -> list[dict[str, Any]]:
    from PIL import Image

    pictures = []
    for example in batch:
        with Image.open(example.image) as picture:
            pictures.append(picture.convert("RGB"))
    pixels = processed_pixels(model, image_processor, pictures)
    greys = torch.cat([grey_pixels(model, image_processor, picture.size) for picture in pictures])
    with torch.no_grad():
        logits = output_logits(model(pixel_values=pixels))
    probabilities, predicted = class_outputs(model.config, logits), logits.argmax(dim=-1)
    rows = []
    box_rationales: dict[tuple[int, int], Tensor] = {}
    patch_sets: dict[tuple[tuple[int, ...], tuple[int, int]], ImagePatches] = {}  # one per group and grid: the methods share its removals
    with shared_removals():
        for name in methods:
            if name == INTEGRATED_GRADIENTS:
                grids = image_integrated_gradients(model, pixels, greys, predicted, options.ig_steps)
            else:
                grids = explainers[name].attribute(pixels, target=predicted).detach()
            scores = grids.flatten(1).float()
            values = {metric: torch.full((len(batch),), math.nan) for metric in metrics}
            grid = (int(grids.shape[1]), int(grids.shape[2]))
            if set(metrics) & set(IMAGE_BOX_METRICS) and grid not in box_rationales:  # the methods share their grid
                box_rationales[grid] = _box_rationale(batch, pictures, image_processor, grid)
            boxes = box_rationales.get(grid)
            for group in _same_rows(greys):  # a removed patch takes its own image's grey
                picked = group.to(pixels.device)
                key = (tuple(group.tolist()), grid)
                if key not in patch_sets:
                    patch_sets[key] = image_patches(model, pixels[picked], greys[picked[:1]], grid)
                patches = patch_sets[key]
                rationale = None if boxes is None else boxes[group].to(pixels.device)
                context = MetricContext(
                    model, torch.zeros_like(patches.input_ids, dtype=torch.bool), rationale=rationale, removal=patches.removal
                )
                for metric in metrics:
                    values[metric][group] = METRIC_REGISTRY[metric].function(
                        patches.forward_func, patches.input_ids, scores[picked], (patches.attention_mask,), predicted[picked],
                        context,
                    ).float().cpu()
            rows += _class_rows(batch, name, predicted, probabilities, values)
    return rows


def _box_rationale(batch: list[ImageExample], pictures: list[Any], image_processor: Any, grid: tuple[int, int]) -> Tensor:
    """``(batch, rows * columns)`` bool: each row's patches in its box
    (:func:`~captum_attention.metrics.box_patches`); a one-line ``ValueError`` where the
    processor does not keep the whole image, whose grid then covers part of it."""
    rationale, checked = [], set()
    for example, picture in zip(batch, pictures):
        assert example.box is not None  # checked by check_image_request
        if picture.size not in checked:
            _check_grid_covers(grid, picture.size, image_processor, example.line)
            checked.add(picture.size)
        rationale.append(box_patches(example.box, picture.size, grid))
    return torch.stack(rationale)


def _check_boxes_on_the_grid(model: Any, image_processor: Any, examples: Sequence[ImageExample]) -> None:
    """Before any work, once per image size: the model's patch grid covers the whole image
    (:func:`_check_grid_covers`), where the model names its grid."""
    from PIL import Image

    lines: dict[tuple[int, int], int] = {}
    for example in examples:
        with Image.open(example.image) as picture:
            lines.setdefault(picture.size, example.line)
    for size, line in lines.items():
        grid = HuggingFaceAdapter().patch_grid(model, grey_pixels(model, image_processor, size))
        if grid is not None:
            _check_grid_covers(grid, size, image_processor, line)


def _check_grid_covers(grid: tuple[int, int], size: tuple[int, int], image_processor: Any, line: int) -> None:
    """A one-line ``ValueError`` where a grid of ``grid`` cells does not cover the whole
    image of ``size`` (:func:`~captum_attention.presentation.answer.shape_over_image`), on
    which a box is drawn."""
    if not shape_over_image(grid, size, image_processor):
        raise ValueError(f"the image processor crops or pads the {size[0]} × {size[1]} image of line {line}, so its patch grid "
                         f"does not cover the image its box is drawn on: leave the box's metrics ({', '.join(IMAGE_BOX_METRICS)}) out")


def _same_rows(images: Tensor) -> list[Tensor]:
    """The indices of ``images`` ``(B, ...)`` that are equal, grouped, in order of first
    appearance; on the CPU."""
    groups: list[list[int]] = []
    for index in range(len(images)):
        group = next((g for g in groups if torch.equal(images[g[0]], images[index])), None)
        if group is None:
            groups.append([index])
        else:
            group.append(index)
    return [torch.tensor(group) for group in groups]


def _rationale_tokens(encoded: Any, batch: list[Example]) -> Tensor:
    """``(batch, seq_len)`` bool: tokens of the words named in each example's rationale
    (compared case-insensitively, word by word as the tokenizer splits them), in either
    text of a pair."""
    marked = torch.zeros(encoded["input_ids"].shape, dtype=torch.bool)
    for row, example in enumerate(batch):
        wanted = {w.lower() for w in example.rationale or ()}
        for position, word in enumerate(encoded.word_ids(row)):
            if word is None:
                continue
            sequence = encoded.token_to_sequence(row, position)
            span = encoded.word_to_chars(row, word, sequence_index=sequence)
            text = example.text if sequence == 0 else str(example.text_pair)
            marked[row, position] = text[span.start : span.end].lower() in wanted
    return marked


def _number(value: Tensor) -> float | None:
    number = float(value)
    return None if math.isnan(number) else number


def answer_method_names() -> list[str]:
    """What ``methods=`` accepts for a language model's answers: every registered method,
    the leave-one-out estimates (:data:`~captum_attention.presentation.explain.ESTIMATES`,
    :data:`~captum_attention.presentation.explain.ESTIMATES_BY_SHARE`), :data:`PRESENCE` and
    Integrated Gradients (:func:`~captum_attention.presentation.explain.answer_integrated_gradients`)."""
    from ..attr import REGISTRY

    return [*REGISTRY, *ESTIMATES_OF_ANSWERS, PRESENCE, INTEGRATED_GRADIENTS]


def answer_metric_names() -> list[str]:
    """What ``metrics=`` accepts for a language model's answers: the registered metrics of
    ``task="generation"`` (:data:`captum_attention.metrics.METRICS`)."""
    return [name for name, spec in METRIC_REGISTRY.items() if spec.task == "generation"]


@dataclass
class AnswerOptions:
    """How to evaluate answers (and captions): the generation's length (for rows without an
    answer), the prompt's presence for :data:`PRESENCE`, Integrated Gradients' steps, into
    how many regions a side the context metrics pool an image's patch grid larger than
    that (each region one feature), and the summary's bootstrap."""

    max_new_tokens: int = 20
    presence: float = 0.05
    ig_steps: int = 50
    regions: int = 16
    bootstrap: int = 1000
    seed: int = 0


def evaluate_answers(
    model: Any,
    tokenizer: Any,
    examples: Sequence[AnswerExample],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: AnswerOptions | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
    processor: Any = None,
) -> int:
    """:func:`evaluate` for a language model's answers: each example's answer (given, or
    generated greedily) explained over its prompt by every method (``attribute_span``: the
    whole answer's log-probability; an encoder-decoder's over its source) and scored by
    every context metric over the example's segments (each prompt token its own without
    them; special tokens never removed). One example a shard, resumable, split over
    processes, merged by :func:`merge` as the classifier's are. With a vision-language
    model's ``processor``, each example's prompt is about its ``image``: the image's tokens
    are scored but never removed, and each row holds the metrics over the image's patches
    too (:func:`image_metric_names`: merge with them to summarise them), as
    :func:`evaluate_captions` scores captions; empty where they cannot be computed exactly
    (an encoder-decoder, image inputs other than one image's pixels, a grid that does not
    tile them; the estimates, which score no image), Integrated Gradients' image scores
    run again on the pixels against the grey image."""
    from .answer import several_stacks

    options = options or AnswerOptions()
    check_names("method", methods, answer_method_names())
    check_names("metric", metrics, answer_metric_names())
    check_methods(methods, answers=True, one_stack=not several_stacks(model))
    if processor is not None and PRESENCE in methods:
        raise ValueError(f"{PRESENCE} is not available for vision-language models; leave it out of the methods.")
    needed = {name for name in methods if name not in (*ESTIMATES_OF_ANSWERS, PRESENCE, INTEGRATED_GRADIENTS)}
    needed |= {"attn_lrp"} if PRESENCE in methods else set()
    needed |= {"knockout_gradient"} if set(ESTIMATES_OF_ANSWERS) & set(methods) else set()
    needed |= {"attn_lrp"} if ESTIMATES in methods else set()
    explainers = {name: registered_method(name, model) for name in needed}
    return sharded(
        Path(output), run_manifest(model, examples, methods, metrics, options, tokenizer), examples,
        lambda example: _evaluate_answer(model, tokenizer, example, methods, explainers, metrics, options, processor), process_index,
        num_processes, progress, on_resume,
    )


def _evaluate_answer(
    model: Any, tokenizer: Any, example: AnswerExample, methods: Sequence[str], explainers: dict[str, Any],
    metrics: Sequence[str], options: AnswerOptions, processor: Any = None,
) -> list[dict[str, Any]]:
    images = None
    if processor is None:
        ids, answer, keep, segments = answer_tensors(model, tokenizer, example, options.max_new_tokens)
    else:
        ids, answer, keep, segments, images = image_answer_tensors(model, processor, example, options.max_new_tokens)
    segments = removable_segments(keep, segments)
    mask = torch.ones_like(ids)
    args = (mask,) if images is None else (mask, images)
    context = MetricContext(model, keep, None, segments)
    removal = None if images is None else _image_removal(model, processor, example, ids, images)
    spans: dict[str, Any] = {}  # each method's answer_span (Integrated Gradients': its prompt scores)

    def span_of(name: str) -> Tensor:
        if name == INTEGRATED_GRADIENTS and name not in spans:
            spans[name] = answer_integrated_gradients(model, ids, answer, options.ig_steps, images)
        if name not in spans:
            extra = {"presence": span_presence(ids, answer.shape[1], tokenizer, options.presence)} if name == PRESENCE else {}
            spans[name] = answer_span(explainers["attn_lrp" if name == PRESENCE else name], ids, answer, images, **extra)
        return prompt_of(model, spans[name], ids.shape[1])

    rows = []
    with shared_ablations():  # the methods' metrics run each ablation of the row once
        log_prob = float(answer_log_probs(model, ids, mask, answer, images)[0])
        for name in methods:
            if name in ESTIMATES_OF_ANSWERS:
                scores = answer_estimates(model, ids, answer, segments, name != ESTIMATES, span_of, images)
            else:
                scores = span_of(name)
            values = {m: METRIC_REGISTRY[m].function(model, ids, scores, args, answer, context) for m in metrics}
            if images is not None:
                grid = None if removal is None else _image_grid(model, ids, images, answer, name, spans, removal, options.ig_steps)
                values |= _image_values(model, images, answer, grid, removal, metrics, options.regions)
            rows.append(_answer_row(example, name, tokenizer.decode(answer[0]), log_prob, values))
    return rows


def image_metric_names(metrics: Sequence[str]) -> list[str]:
    """The columns a vision-language model's rows add to ``metrics``: each metric that also
    scores an image's patches (``patches=True``) over the row's image, ``image_`` before its
    name (:func:`evaluate_answers`)."""
    return [f"{IMAGE_METRIC_PREFIX}{name}" for name in metrics if METRIC_REGISTRY[name].patches]


def _image_removal(model: Any, processor: Any, example: AnswerExample, ids: Tensor, images: dict[str, Any]) -> PatchRemoval | None:
    """How the image metrics grey the patches of a vision-language model's row (a grey
    image through its processor's image processor; the patches pooled into the image
    tokens' grid, on which every method is scored, :func:`_image_grid`; the prompt ``ids``
    read before the answer, with their per-token inputs, PaliGemma's token types); None
    where they cannot be computed exactly: no
    :func:`~captum_attention.presentation.answer.single_image_pixels`, or an image whose
    grid of tokens does not tile its pixels."""
    from PIL import Image

    from .answer import prompt_token_inputs, single_image_pixels

    pixels = single_image_pixels(model, images, ids.shape[1])
    if pixels is None:
        return None
    try:
        (layout,) = image_token_layout(model, ids, images)
    except ValueError:  # a family whose image tokens are not found so
        return None
    if len(layout) != 1 or layout[0].grid is None or pixels.shape[-2] % layout[0].grid[0] or pixels.shape[-1] % layout[0].grid[1]:
        return None
    assert example.image is not None  # a vision-language model's row names one
    with Image.open(example.image) as picture:
        grey = grey_pixels(model, processor.image_processor, picture.size)
    return PatchRemoval(grey, layout[0].grid, ids, prompt_token_inputs(images, ids.shape[1]) or None) if grey.shape == pixels.shape else None


def _image_grid(
    model: Any, ids: Tensor, images: dict[str, Any], answer: Tensor, name: str, spans: dict[str, Any], removal: PatchRemoval,
    ig_steps: int,
) -> Tensor | None:
    """``(1, rows, columns)`` method ``name``'s scores of the image's tokens, on their grid
    (``removal.regions``): a registered method's (its ``spans[name]``); Integrated
    Gradients' on the pixels against the removal's grey image, the prompt held, summed per
    patch of the vision tower
    (:func:`~captum_attention.presentation.answer.caption_integrated_gradients`) and over
    each token's patches (a model that pools its patches into fewer tokens, Gemma 3's), so
    that every method is scored over the same regions, None where they do not tile the
    token grid; None for the estimates, which score no image."""
    from .answer import caption_integrated_gradients, first_image_grid

    if name == INTEGRATED_GRADIENTS:
        patches = caption_integrated_gradients(
            model, images["pixel_values"], answer, removal.baseline_pixels, ig_steps, ids, removal.prompt_inputs
        )
        assert removal.regions is not None  # the image tokens' grid (_image_removal)
        return _summed_per_token(patches, removal.regions)
    if name in ESTIMATES_OF_ANSWERS:
        return None
    return first_image_grid(model, ids, spans[name], images)


def _summed_per_token(patch_scores: Tensor, tokens: Sequence[int]) -> Tensor | None:
    """``(1, rows, columns)`` a ``(1, patch rows, patch columns)`` grid of patch scores
    summed over each of the ``tokens`` ``(rows, columns)`` image tokens' blocks of patches;
    None where the tokens' grid does not divide the patches'."""
    rows, columns = tokens
    if patch_scores.shape[1] % rows or patch_scores.shape[2] % columns:
        return None
    return patch_scores.reshape(len(patch_scores), rows, patch_scores.shape[1] // rows, columns, -1).sum(dim=(2, 4))


def _image_values(
    model: Any, images: dict[str, Any], answer: Tensor, grid: Tensor | None, removal: PatchRemoval | None,
    metrics: Sequence[str], regions: int,
) -> dict[str, Tensor]:
    """The image metrics of one method's ``grid`` of patch scores (None: a method that
    scores no image); NaN where they cannot be computed (``removal`` None: :func:`_image_removal`)."""
    if removal is None or grid is None:
        return {name: torch.tensor([math.nan]) for name in image_metric_names(metrics)}
    kept = torch.zeros(1, 0, dtype=torch.bool, device=grid.device)
    context = MetricContext(model, kept, patches=dataclasses.replace(removal, regions=pooled_regions(grid.shape[1:], regions)))
    return {
        f"{IMAGE_METRIC_PREFIX}{name}": METRIC_REGISTRY[name].function(model, images["pixel_values"], grid, (), answer, context)
        for name in metrics if METRIC_REGISTRY[name].patches
    }


def pooled_regions(grid: Sequence[int], most: int) -> tuple[int, int] | None:
    """The regions a ``grid`` of patches is pooled into for the context metrics: at most
    ``most`` a side; None where the grid has no more (each patch its own)."""
    rows, columns = grid
    return None if max(rows, columns) <= most else (min(rows, most), min(columns, most))


def _answer_row(example: AnswerExample, method: str, answer: str, log_prob: float, values: dict[str, Tensor]) -> dict[str, Any]:
    """One row of ``results.jsonl`` for an answer (a caption): the example, the method, the
    answer's text, whether it was generated, its log-probability and each metric's value."""
    return {
        "index": example.index, "line": example.line, "method": method, "answer": answer, "generated": example.answer is None,
        "answer_log_prob": log_prob, **{metric: _number(value[0]) for metric, value in values.items()},
    }


def caption_metric_names() -> list[str]:
    """What ``metrics=`` accepts for an image captioner's captions: the registered metrics
    of ``task="generation"`` that also score a caption over its patches (``patches=True``)."""
    return [name for name, spec in METRIC_REGISTRY.items() if spec.task == "generation" and spec.patches]


def check_caption_metrics(metrics: Sequence[str]) -> None:
    """A one-line ``ValueError`` for a metric ``evaluate_captions`` cannot score: one
    registered for a prompt's segments only, or unknown."""
    for_prompts = [name for name in metrics if name in answer_metric_names() and name not in caption_metric_names()]
    if for_prompts:
        raise ValueError(
            f"metric {for_prompts[0]!r} removes a prompt's segments, and an image captioner reads none: choose among "
            f"{', '.join(caption_metric_names())}, or register it with patches=True to score captions over their patches"
        )
    check_names("metric", metrics, caption_metric_names())


def caption_method_names() -> list[str]:
    """What ``methods=`` accepts for an image captioner's captions: the registered methods
    that explain an encoder-decoder's answer over its source, and Integrated Gradients
    (:func:`~captum_attention.presentation.answer.caption_integrated_gradients`)."""
    from ..attr import REGISTRY

    return [*(name for name, cls in REGISTRY.items() if cls.spec.spans and cls.spec.encoder_decoder), INTEGRATED_GRADIENTS]


def evaluate_captions(
    model: Any,
    tokenizer: Any,
    image_processor: Any,
    examples: Sequence[AnswerExample],
    methods: Sequence[str],
    metrics: Sequence[str],
    output: str | Path,
    options: AnswerOptions | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    on_resume: Callable[[int, int], None] | None = None,
) -> int:
    """:func:`evaluate_answers` for an image captioner (an image encoder before a text
    decoder, ``VisionEncoderDecoderModel``; or BLIP's or GIT's vision-language model, which
    captions after its start token alone, :func:`~captum_attention.presentation.answer.caption_prompt`):
    each row's caption of its ``image`` (given as
    its ``answer``, or generated greedily) explained over the image's patches by every
    method, and scored by every context metric with the patches as the features, a removed
    patch's pixels taken from a uniform grey image through the same ``image_processor``
    (:mod:`~captum_attention.metrics.patches`), a grid of more patches a side than
    ``options.regions`` pooled into that many regions a side. Resumable and split over
    processes as :func:`evaluate_answers`."""
    options = options or AnswerOptions()
    check_names("method", methods, caption_method_names())
    check_caption_metrics(metrics)
    explainers = {name: registered_method(name, model) for name in methods if name != INTEGRATED_GRADIENTS}
    return sharded(
        Path(output), run_manifest(model, examples, methods, metrics, options), examples,
        lambda example: _evaluate_caption(model, tokenizer, image_processor, example, methods, explainers, metrics, options),
        process_index, num_processes, progress, on_resume,
    )


def _evaluate_caption(
    model: Any, tokenizer: Any, image_processor: Any, example: AnswerExample, methods: Sequence[str], explainers: dict[str, Any],
    metrics: Sequence[str], options: AnswerOptions,
) -> list[dict[str, Any]]:
    from PIL import Image

    from .answer import caption_ids, caption_integrated_gradients, caption_patch_scores, caption_pixels, caption_prompt

    assert example.image is not None  # read_answers(captions=True) requires one
    with Image.open(example.image) as picture:
        pixels, grey = caption_pixels(model, image_processor, picture.convert("RGB"))
    try:
        caption = caption_ids(model, tokenizer, pixels, example.answer, options.max_new_tokens, "the answer")[None]
    except ValueError as error:
        raise ValueError(f"line {example.line}: {error}") from None
    prompt = caption_prompt(model, tokenizer)
    keep = torch.zeros(1, 0, dtype=torch.bool, device=pixels.device)
    rows = []
    with shared_ablations():  # the methods' metrics grey each set of patches once
        log_prob = float(caption_log_probs(model, pixels, caption, prompt)[0])
        for name in methods:
            if name == INTEGRATED_GRADIENTS:
                scores = caption_integrated_gradients(model, pixels, caption, grey, options.ig_steps, prompt)
            else:
                scores = caption_patch_scores(explainers[name], pixels, caption, prompt)
            removal = PatchRemoval(grey, pooled_regions(scores.shape[1:], options.regions), prompt)
            context = MetricContext(model, keep, patches=removal)
            values = {m: METRIC_REGISTRY[m].function(model, pixels, scores, (), caption, context) for m in metrics}
            rows.append(_answer_row(example, name, tokenizer.decode(caption[0]), log_prob, values))
    return rows


def answer_tensors(
    model: Any, tokenizer: Any, example: AnswerExample, max_new_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """An answer row on the model's device: the prompt's ids ``(1, N)``, the answer's ``(1,
    n)`` (given, or generated greedily; a ``ValueError`` naming the row's line where it has
    no tokens), which prompt tokens are never removed (the special tokens) ``(1, N)``, and
    the segment of each prompt token ``(1, N)`` (-1: never removed) where the row names
    segments, else None. A chat template's tokens around the row's message are kept as
    the special tokens are."""
    device = next(model.parameters()).device
    ids, keep, segments = _read_prompt(tokenizer, example)
    answer = _answer_ids(model, tokenizer, example, max_new_tokens).to(device)[None]
    _check_answer(answer, example)
    return ids.to(device)[None], answer, keep.to(device)[None], None if segments is None else segments.to(device)[None]


def _read_prompt(tokenizer: Any, example: AnswerExample) -> tuple[Tensor, Tensor, Tensor | None]:
    """The row's prompt as the tokenizer reads it: its ids ``(N,)``, the tokens never
    removed (the special tokens, and a chat template's around the row's message) and each
    token's segment where the row names segments (-1: never removed), else None."""
    offsets_needed = example.segments is not None or example.message is not None
    encoded = tokenizer(example.text, return_tensors="pt", return_offsets_mapping=offsets_needed)
    ids = encoded["input_ids"][0]
    special = set(tokenizer.all_special_ids)
    keep = torch.tensor([int(i) in special for i in ids.tolist()])
    if example.message is not None:
        keep |= outside_span(encoded["offset_mapping"][0], example.text, example.message)
    segments = None
    if example.segments is not None:
        offsets = encoded["offset_mapping"][0]
        if example.message is not None:  # the segments make up the message
            offsets = (offsets - example.message[0]).clamp(0, example.message[1] - example.message[0])
        segments = _token_segments(offsets, example.segments, keep)
    return ids, keep, segments


def _check_answer(answer: Tensor, example: AnswerExample) -> None:
    if answer.shape[1] == 0:
        raise ValueError(f"line {example.line}: the answer has no tokens (the model ended its answer at once): give the row an answer")


def image_answer_tensors(
    model: Any, processor: Any, example: AnswerExample, max_new_tokens: int
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, dict[str, Any]]:
    """A vision-language model's answer row on its device: the prompt's ids ``(1, N)`` as
    the processor expands them with the row's image (:func:`image_prompt_inputs`) and the
    model's ``generate`` reads them (BLIP's: [BOS] first, no [SEP]), the answer's ``(1, n)``
    (given, or generated greedily), the tokens never removed and the segments
    (:func:`_placed_on_image_prompt`), and the image inputs."""
    from .answer import image_answer_ids

    device = next(model.parameters()).device
    ids, mask, inputs = _image_prompt(model, processor, example)
    try:
        keep, segments = _placed_on_image_prompt(model, processor.tokenizer, example, ids[0])
    except ValueError as error:
        raise ValueError(f"line {example.line}: {error}") from None
    images = {name: value.to(device) if isinstance(value, Tensor) else value for name, value in inputs.items()}
    answer = image_answer_ids(model, processor.tokenizer, ids.to(device), mask.to(device), images, example.answer, max_new_tokens)
    answer = answer.to(device)[None]
    _check_answer(answer, example)
    ids, keep, *placed = prompt_as_generated(model, ids, keep, *([] if segments is None else [segments]))
    return ids.to(device), answer, keep.to(device)[None], placed[0].to(device)[None] if placed else None, images


def image_row_problem(model: Any, processor: Any, example: AnswerExample, max_new_tokens: int) -> str | None:
    """What keeps a vision-language model's row from being read, found before any work:
    its prompt, the image's tokens expanded, and its answer more tokens than the model
    takes (:func:`~captum_attention.presentation.answer.image_answer_too_long`), or its chat
    template's tokens or its segments not placeable on the processor's tokens
    (:func:`_placed_on_image_prompt`); else None."""
    from .answer import image_answer_too_long

    ids = _image_prompt(model, processor, example)[0][0]
    too_long = image_answer_too_long(model, processor.tokenizer, len(ids), example.answer, max_new_tokens, "the answer")
    if too_long is not None or (example.message is None and example.segments is None):
        return too_long
    try:
        _placed_on_image_prompt(model, processor.tokenizer, example, ids)
    except ValueError as error:
        return str(error)
    return None


def _image_prompt(model: Any, processor: Any, example: AnswerExample) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """The processor's ids ``(1, N)``, mask and image inputs of the row's prompt about its
    image (its image token put first where the model reads one)."""
    from PIL import Image

    from .answer import image_prompt_inputs

    if example.image is None:
        raise ValueError(f"line {example.line}: a vision-language model's row needs an 'image'")
    with Image.open(example.image) as picture:
        _, ids, mask, inputs = image_prompt_inputs(processor, example.text, picture.convert("RGB"), with_image_token=not image_outside_prompt(model))
    return ids, mask, inputs


def _placed_on_image_prompt(model: Any, tokenizer: Any, example: AnswerExample, ids: Tensor) -> tuple[Tensor, Tensor | None]:
    """The tokens never removed ``(N,)`` and the segments ``(N,)`` (or None) of the row as
    :func:`_read_prompt` reads them from its text, placed on the processor's ``ids``
    (:func:`~captum_attention.presentation.answer.on_expanded_tokens`: the image's tokens
    kept, of no segment). A ``ValueError`` where a processor that adds tokens of its own
    around the image leaves a chat template's tokens or the segments unplaceable; without
    either, the special tokens are kept."""
    from .answer import on_expanded_tokens

    plain, plain_keep, plain_segments = _read_prompt(tokenizer, example)
    keep = on_expanded_tokens(model, plain.tolist(), plain_keep.tolist(), ids, True)
    segments = None if plain_segments is None else on_expanded_tokens(model, plain.tolist(), plain_segments.tolist(), ids, -1)
    if keep is not None and (plain_segments is None or segments is not None):
        return torch.tensor(keep), None if segments is None else torch.tensor(segments)
    if example.message is not None or example.segments is not None:
        raise ValueError(
            "the processor adds tokens of its own around the image, so the chat template's tokens and the row's segments "
            "cannot be placed on the model's tokens: leave --chat and the segments out"
        )
    special = set(tokenizer.all_special_ids)
    return torch.tensor([int(i) in special for i in ids.tolist()]), None


def _answer_ids(model: Any, tokenizer: Any, example: AnswerExample, max_new_tokens: int) -> Tensor:
    """``(n,)``: the given answer tokenized without special tokens, or the greedy generation
    (Captum's own target handling: :meth:`~captum_attention.LLMAttentionAttribution.target_tokens`)."""
    from captum.attr import TextTokenInput

    from .answer import target_ids

    arguments = None if example.answer is not None else {"max_new_tokens": max_new_tokens, "do_sample": False}
    return target_ids(model, tokenizer, TextTokenInput(example.text, tokenizer), example.answer, arguments)


def _token_segments(offsets: Tensor, segments: Sequence[str], keep: Tensor) -> Tensor:
    """``(N,)`` long: the segment holding each token's first character other than a space
    (byte-level tokenizers that do not trim their offsets, GPT-2's, Llama-3's, Qwen2's,
    start a word's token at the space before it, which ends the segment before); -1 for the
    tokens never removed (special tokens, which hold no character)."""
    text = "".join(segments)
    ends = torch.tensor([len(s) for s in segments]).cumsum(0)
    starts = torch.tensor([first_visible(text, start, end) for start, end in offsets.tolist()], dtype=torch.long)
    found = torch.searchsorted(ends, starts, right=True).clamp(max=len(segments) - 1)
    return found.masked_fill(keep.cpu() | (offsets[:, 1] <= offsets[:, 0]), -1).to(keep.device)
