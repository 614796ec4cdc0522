"""A needle in a long context, with a known answer: which method points at it, and at what cost?

    python benchmarks/needle.py [--lengths 512 2048 4096 8192 16384] [--examples 16]
        [--peer-examples 4] [--budget 300] [--methods ...] [--calibrated 8] [--presence 0.05] [--estimated 2]
        [--estimated-prior attn_lrp] [--half-contexts 8] [--half-contexts-method attn_lrp]
        [--estimated-shares] [--trained-here]
        [--json out.json]

The task and the model are :mod:`captum_attention.demo.needle`'s: a context of filler
words holding 8 key-value pairs (``k3=v7``, one token each), then ``?`` and a key; the
answer is that key's value, so the needle, the asked key's pair, is known. A 2-layer
Llama without position encoding, trained on contexts of 16 to 2,048 tokens: the weights
shipped with the package, the same on every machine (``--trained-here``: trained on this
one and cached, as before they shipped; the model, and its figures, can differ from one
kind of CPU to another).

Per length, on the examples the model answers correctly: each method's pointing accuracy
(its top segment is the needle), both over all of them and over those where the needle
decides the answer (without it the model no longer answers so: in a few contexts it gives
the same answer with the needle removed, and there no segment is decisive), top-1 and
top-3 log-probability drop and LDS (:mod:`captum_attention.metrics.context`; segments:
each pair, each run of up to 32 filler words), and its time per example (memory:
``llm_answers.py`` and ``scaling.py``). ``--calibrated A`` adds
``metrics.calibrated_scores`` over AttnLRP on A ablations (seed 1); ``--presence P`` adds
AttnLRP with the context's segments at presence P (its ``presence`` option);
``--half-contexts A`` adds ``metrics.context_averaged_scores``: AttnLRP
(``--half-contexts-method``) in A random half contexts of the segments (seed 1), beside
its scores on the whole prompt; ``--estimated K`` adds
``metrics.leave_one_out_estimates`` (KnockoutGradient's first-order effects, the K segments
AttnLRP ranks highest by magnitude deleted exactly; ``--estimated-prior METHOD``: those
another registered method ranks highest, such as ``knockout_lrp``; ``--estimated-shares``:
highest by that magnitude over one minus the segment's ``metrics.attention_shares``). The peers, on the first
``--peer-examples`` of them and the same metrics: Captum's ``LLMAttribution(FeatureAblation)``
over the segments (a ``TextTemplateInput``, removed segments deleted),
``LLMGradientAttribution(LayerIntegratedGradients)`` over the tokens (50 steps), and
ContextCite's algorithm (64 random ablations keeping each segment with probability 1/2, a
Lasso surrogate with ``alpha=0.01`` on standardised masks), reimplemented from the paper
(Cohen-Wang et al., NeurIPS 2024) because the ``context-cite`` package partitions text into
sentences and needs spaCy. Its ablations are drawn with seed 1, apart from the LDS's own
(seed 0), so that its LDS is out of sample like every other method's; and ``shap``'s
KernelExplainer over the segments (300 coalitions, as the real-text benchmark's SHAP;
the question alone as the background). inseq's ``attention``
(``--peers inseq_attention``) runs in an environment of its own, since inseq is not among
this project's requirements::

    python -m venv .venv-inseq && .venv-inseq/bin/pip install torch==2.13.0 inseq scikit-learn -e .
    .venv-inseq/bin/python benchmarks/needle.py --methods raw --peers inseq_attention

A method or peer expected to pass ``--budget`` seconds per example at the next length
(its cost taken to grow with the square of the length) is stopped there, and the table
says so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers as tf
from common import context_cite_weights, device_description
from explainers import SHAP_EVALS

from captum_attention import METHODS
from captum_attention.attr import REGISTRY
from captum_attention.demo.needle import WORDS, NeedleExample, load_needle_model, needle_example, needle_tokenizer
from captum_attention.metrics import (
    ablated_log_probs,
    attention_shares,
    calibrated_scores,
    context_averaged_scores,
    leave_one_out_estimates,
    linear_datamodeling_score,
    random_ablations,
    top_k_log_prob_drop,
)

Attribution = Callable[[NeedleExample], torch.Tensor]
"""``attribute(example) -> (length,)`` token scores whose segment sums rank the segments."""


def our_method(model: tf.LlamaForCausalLM, name: str, options: dict[str, Any] | None = None) -> Attribution:
    explainer = REGISTRY[name](model, capture="streaming")

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt = e.input_ids[None]
        answer = torch.tensor([[e.answer]])
        return explainer.attribute_span(prompt, answer, additional_forward_args=(torch.ones_like(prompt),), **(options or {}))[0, :-1]

    return attribute


def at_presence(model: tf.LlamaForCausalLM, value: float) -> Attribution:
    """AttnLRP with the context's segments at presence ``value`` in every attention call,
    the question and the answer at 1."""
    explainer = REGISTRY["attn_lrp"](model, capture="streaming")

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt, answer = e.input_ids[None], torch.tensor([[e.answer]])
        presence = torch.ones(1, prompt.shape[1] + 1)
        presence[0, :-1] = torch.where(e.segments >= 0, value, 1.0)
        args = (torch.ones_like(prompt),)
        return explainer.attribute_span(prompt, answer, additional_forward_args=args, presence=presence)[0, :-1]

    return attribute


def calibrated(model: tf.LlamaForCausalLM, forwards: int) -> Attribution:
    """``metrics.calibrated_scores`` with AttnLRP's span scores as the prior, on ``forwards``
    ablations of seed 1 (apart from the LDS's)."""
    prior = our_method(model, "attn_lrp")

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt = e.input_ids[None]
        return calibrated_scores(model, prompt, torch.ones_like(prompt), torch.tensor([[e.answer]]), prior(e)[None],
                                 e.segments[None], num_ablations=forwards, seed=1)[0]

    return attribute


def in_half_contexts(model: tf.LlamaForCausalLM, contexts: int, method: str = "attn_lrp") -> Attribution:
    """``metrics.context_averaged_scores``: ``method``'s span scores in ``contexts`` random
    half contexts of the segments (seed 1, apart from the LDS's), beside its scores on the
    whole prompt as the prior."""
    explainer = REGISTRY[method](model, capture="streaming")

    def attribute(e: NeedleExample) -> torch.Tensor:
        answer = torch.tensor([[e.answer]])

        def explain(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return explainer.attribute_span(ids, answer, additional_forward_args=(mask,))[:, : ids.shape[1]]

        prompt, mask = e.input_ids[None], torch.ones_like(e.input_ids[None])
        return context_averaged_scores(model, explain, prompt, mask, answer, explain(prompt, mask), e.segments[None],
                                       num_contexts=contexts, seed=1)[0]

    return attribute


def estimated(model: tf.LlamaForCausalLM, exact: int, prior_method: str = "attn_lrp", shares: bool = False) -> Attribution:
    """``metrics.leave_one_out_estimates``: KnockoutGradient's first-order effects, the
    ``exact`` segments that ``prior_method`` (a registered method) ranks highest by
    magnitude deleted exactly; with ``shares``, highest by magnitude over one minus their
    ``metrics.attention_shares``."""
    first_order = our_method(model, "knockout_gradient")
    prior = first_order if prior_method == "knockout_gradient" else our_method(model, prior_method)

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt, answer, segments = e.input_ids[None], torch.tensor([[e.answer]]), e.segments[None]
        mask = torch.ones_like(prompt)
        slopes = first_order(e)[None]
        prior_scores = slopes if prior is first_order else prior(e)[None]
        share = attention_shares(model, prompt, mask, answer, segments, capture="streaming") if shares else None
        return leave_one_out_estimates(model, prompt, mask, answer, slopes, prior_scores, segments, exact=exact, shares=share)[0]

    return attribute


def answered_contexts(model: tf.LlamaForCausalLM, length: int, count: int) -> list[NeedleExample]:
    """Of ``count`` contexts of ``length`` tokens (seeded by the length), those the model
    answers correctly."""
    generator = torch.Generator().manual_seed(length)
    candidates = [needle_example(length, generator) for _ in range(count)]
    with torch.no_grad():
        return [e for e in candidates if int(model(e.input_ids[None]).logits[0, -1].argmax()) == e.answer]


def needle_decides(model: tf.LlamaForCausalLM, e: NeedleExample) -> bool:
    """Whether the model stops giving its answer once the needle's segment is removed."""
    with torch.no_grad():
        logits = model(e.input_ids[e.segments != e.needle][None]).logits[0, -1]
    return int(logits.argmax()) != e.answer


def _segment_texts(e: NeedleExample) -> tuple[str, list[str]]:
    """The template (``{}`` per segment, then ``? key``) and each segment's text."""
    words = [WORDS[int(i)] for i in e.input_ids]
    count = int(e.segments.max()) + 1
    values = [" ".join(w for w, s in zip(words, e.segments.tolist()) if s == index) for index in range(count)]
    return " ".join(["{}"] * count) + f" ? {words[-1]}", values


def _on_first_tokens(e: NeedleExample, segment_scores: torch.Tensor) -> torch.Tensor:
    """Token scores that sum to ``segment_scores`` per segment (each on its first token)."""
    scores = torch.zeros(len(e.input_ids))
    for index, value in enumerate(segment_scores.tolist()):
        scores[int((e.segments == index).nonzero()[0])] = value
    return scores


def feature_ablation(model: tf.LlamaForCausalLM) -> Attribution:
    from captum.attr import FeatureAblation, LLMAttribution, TextTemplateInput

    llm = LLMAttribution(FeatureAblation(model), needle_tokenizer())

    def attribute(e: NeedleExample) -> torch.Tensor:
        template, values = _segment_texts(e)
        # use_cached_outputs=False: with the cache, Captum 0.9 on transformers 5.24 reads every answer
        # token's log-probability after the first wrong (docs/language_models.rst)
        result = llm.attribute(TextTemplateInput(template, values), target=torch.tensor([e.answer]), use_cached_outputs=False)
        return _on_first_tokens(e, result.seq_attr.float())

    return attribute


def integrated_gradients(model: tf.LlamaForCausalLM) -> Attribution:
    from captum.attr import LayerIntegratedGradients, LLMGradientAttribution, TextTokenInput

    llm = LLMGradientAttribution(LayerIntegratedGradients(model, model.get_input_embeddings()), needle_tokenizer())
    text_of = needle_tokenizer()

    def attribute(e: NeedleExample) -> torch.Tensor:
        text = " ".join(WORDS[int(i)] for i in e.input_ids[1:])
        result = llm.attribute(TextTokenInput(text, text_of), target=torch.tensor([e.answer]), n_steps=50, internal_batch_size=5)
        return result.seq_attr.float()

    return attribute


def context_cite(model: tf.LlamaForCausalLM, ablations: int = 64, alpha: float = 0.01, seed: int = 1) -> Attribution:
    """ContextCite's surrogate: Lasso on standardised keep-masks of ``ablations`` random
    ablations against the answer's logit-probability (reimplemented from the paper).
    ``seed`` 0 would draw the same masks as the LDS it is scored by (its first 32 ablations
    the LDS's), an in-sample LDS."""

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt = e.input_ids[None]
        kept, log_p, _ = random_ablations(model, prompt, torch.ones_like(prompt), torch.tensor([[e.answer]]), e.segments[None],
                                          ablations, seed, max_batch_size=16)
        log_p = log_p[0].double()
        logit_p = log_p - torch.log1p(-log_p.exp().clamp(max=1 - 1e-12))
        return _on_first_tokens(e, context_cite_weights(kept[0], logit_p, alpha))

    return attribute


def kernel_shap(model: tf.LlamaForCausalLM, evaluations: int = SHAP_EVALS, seed: int = 1) -> Attribution:
    """``shap``'s KernelExplainer over the segments: ``evaluations`` coalitions per example
    (seeded), a removed segment deleted, the empty context (the question alone) as the
    background, the answer's log-probability as the output, and AIC-selected features
    (``l1_reg="aic"``: the default, ten features, would leave most segments at 0)."""
    import numpy as np
    import shap

    def attribute(e: NeedleExample) -> torch.Tensor:
        prompt, count = e.input_ids[None], int(e.segments.max()) + 1
        answer, segments = torch.tensor([[e.answer]]), e.segments[None]

        def log_probs(coalitions: np.ndarray) -> np.ndarray:
            kept = torch.from_numpy(coalitions != 0)[None]
            return ablated_log_probs(model, prompt, torch.ones_like(prompt), answer, kept, segments, 16)[0].double().numpy()

        np.random.seed(seed)
        explainer = shap.KernelExplainer(log_probs, np.zeros((1, count)))
        values = explainer.shap_values(np.ones((1, count)), nsamples=evaluations, l1_reg="aic", silent=True)
        return _on_first_tokens(e, torch.as_tensor(np.asarray(values)).flatten().float())

    return attribute


def inseq_attention(model: tf.LlamaForCausalLM) -> Attribution:
    """inseq's ``attention`` method (its own environment: see the module docstring), on an
    eager copy of the model, averaged over layers and heads as inseq aggregates it."""
    import copy

    import inseq

    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")  # what inseq asks for when it loads a checkpoint itself
    explainer = inseq.load_model(eager, "attention", tokenizer=needle_tokenizer())

    def attribute(e: NeedleExample) -> torch.Tensor:
        text = " ".join(WORDS[int(i)] for i in e.input_ids[1:])
        output = explainer.attribute(text, generated_texts=f"{text} {WORDS[e.answer]}", show_progress=False, skip_special_tokens=False)
        maps = output.sequence_attributions[0].target_attributions  # (prompt + answer, answer, layers, heads)
        return maps[: len(e.input_ids), 0].float().mean(dim=(-1, -2))

    return attribute


def evaluate(
    model: tf.LlamaForCausalLM, attribute: Attribution, examples: list[NeedleExample], decides: list[bool] | None = None
) -> dict[str, float]:
    """Pointing accuracy (over all ``examples``, and over those where the needle decides the
    answer; ``decides``: :func:`needle_decides` of each, computed once per length by the
    caller), top-1/top-3 drop, LDS and seconds per example; ``each`` holds the values per example."""
    found, drops, lds, seconds = [], [], [], []
    decides = [needle_decides(model, e) for e in examples] if decides is None else decides[: len(examples)]
    for e in examples:
        started = time.perf_counter()
        scores = attribute(e)
        seconds.append(time.perf_counter() - started)
        prompt, answer, segments = e.input_ids[None], torch.tensor([[e.answer]]), e.segments[None]
        mask = torch.ones_like(prompt)
        segment_scores = torch.zeros(int(e.segments.max()) + 1).index_add_(0, e.segments.clamp(min=0), scores * (e.segments >= 0))
        found.append(float(int(segment_scores.argmax()) == e.needle))
        drops.append(top_k_log_prob_drop(model, prompt, mask, answer, scores[None], ks=(1, 3), segments=segments)[0])
        lds.append(float(linear_datamodeling_score(model, prompt, mask, answer, scores[None], segments)[0]))
    drop = torch.stack(drops).mean(dim=0)
    decisive = [f for f, d in zip(found, decides) if d]
    each = {"points": found, "decides": decides, "top1_drop": [float(d[0]) for d in drops], "lds": lds}
    return {
        "pointing": sum(found) / len(found), "pointing_decisive": sum(decisive) / max(len(decisive), 1),
        "decisive": len(decisive), "examples": len(found), "each": each, "top1_drop": float(drop[0]), "top3_drop": float(drop[1]),
        "lds": float(torch.tensor(lds).nanmean()), "seconds": sum(seconds) / len(seconds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192, 16384])
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--peer-examples", type=int, default=4)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per example a method or peer may take")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="registered methods (also those not in reports, "
                        "e.g. norm_attention)")
    parser.add_argument("--calibrated", type=int, nargs="*", default=[], help="ablations of calibrated AttnLRP rows")
    parser.add_argument("--presence", type=float, nargs="*", default=[], help="presences of the context's segments of "
                        "AttnLRP rows (AttnLRP's presence option)")
    parser.add_argument("--half-contexts", type=int, nargs="*", default=[], help="contexts (even) of rows in random half "
                        "contexts (metrics.context_averaged_scores)")
    parser.add_argument("--half-contexts-method", default="attn_lrp", choices=list(REGISTRY),
                        help="the registered method run in the half contexts and on the whole prompt (the prior)")
    parser.add_argument("--estimated", type=int, nargs="*", default=[], help="exact deletions of leave-one-out estimate rows")
    parser.add_argument("--estimated-prior", default="attn_lrp", choices=list(REGISTRY),
                        help="the registered method whose scores choose the segments deleted exactly")
    parser.add_argument("--estimated-shares", action="store_true", help="choose them by the prior's magnitude over one "
                        "minus the segment's attention share (metrics.attention_shares)")
    parser.add_argument("--peers", nargs="*", default=["feature_ablation", "integrated_gradients", "context_cite", "kernel_shap"])
    parser.add_argument("--options", type=json.loads, default={},
                        help='method options as JSON, e.g. \'{"norm_attention": {"layer": 0}}\'')
    parser.add_argument("--trained-here", action="store_true", help="train the needle model on this machine instead of "
                        "loading the shipped weights")
    parser.add_argument("--json", type=Path)
    options = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = load_needle_model(trained_here=options.trained_here)
    weights = "trained here" if options.trained_here else "shipped"
    peers = {
        "feature_ablation": feature_ablation, "integrated_gradients": integrated_gradients, "context_cite": context_cite,
        "kernel_shap": kernel_shap, "inseq_attention": inseq_attention,
    }
    stopped: dict[str, str] = {}
    last: dict[str, tuple[int, float]] = {}
    results = []
    for length in options.lengths:
        correct = answered_contexts(model, length, options.examples)
        row: dict[str, Any] = {"length": length, "accuracy": len(correct) / options.examples, "methods": {}}
        print(f"length {length}: the model answers {len(correct)} of {options.examples}", flush=True)
        runs: list[tuple[str, Callable[[], Attribution], list[NeedleExample]]] = [
            (name + "".join(f" {key}={value}" for key, value in options.options.get(name, {}).items()),
             lambda name=name: our_method(model, name, options.options.get(name)), correct)
            for name in options.methods
        ]
        runs += [(f"calibrated AttnLRP, {a} ablations", lambda a=a: calibrated(model, a), correct) for a in options.calibrated]
        runs += [(f"AttnLRP at presence {p}", lambda p=p: at_presence(model, p), correct) for p in options.presence]
        runs += [(f"{options.half_contexts_method} in {a} half contexts",
                  lambda a=a: in_half_contexts(model, a, options.half_contexts_method), correct) for a in options.half_contexts]
        by = "" if options.estimated_prior == "attn_lrp" and not options.estimated_shares else f" by {options.estimated_prior}"
        by += " / (1 - share)" if options.estimated_shares else ""
        runs += [(f"leave-one-out estimates, {k} exact{by}",
                  lambda k=k: estimated(model, k, options.estimated_prior, options.estimated_shares), correct)
                 for k in options.estimated]
        runs += [(name, lambda name=name: peers[name](model), correct[: options.peer_examples]) for name in options.peers]
        decides = [needle_decides(model, e) for e in correct]
        for label, make, examples in runs if correct else []:
            if label in last and label not in stopped:  # a method's cost grows at most quadratically in the length
                shorter, seconds = last[label]
                if seconds * (length / shorter) ** 2 > options.budget:
                    stopped[label] = f"stopped: {seconds:.3g} s per example at {shorter} tokens, over {options.budget:.0f} s expected"
            if label in stopped:
                row["methods"][label] = {"stopped": stopped[label]}
                continue
            row["methods"][label] = evaluate(model, make(), examples, decides)
            last[label] = (length, row["methods"][label]["seconds"])
            print(f"  {label}: { {k: v for k, v in row['methods'][label].items() if k != 'each'} }", flush=True)
        results.append(row)
        if options.json:
            options.json.write_text(json.dumps(
                {"device": device_description(), "weights": weights, "results": results}, indent=1
            ))
    print(table(results))


def table(results: list[dict]) -> str:
    lines = [
        "| tokens | model correct | method | points at the needle | where it decides | top-1 drop | top-3 drop | LDS | s / example |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results:
        for name, values in row["methods"].items():
            if "stopped" in values:
                lines.append(f"| {row['length']} | {row['accuracy']:.0%} | {name} | {values['stopped']} | | | | | |")
                continue
            lines.append(
                f"| {row['length']} | {row['accuracy']:.0%} | {name} | {values['pointing']:.0%} "
                f"| {values['pointing_decisive']:.0%} of {values['decisive']} | {values['top1_drop']:.2f} "
                f"| {values['top3_drop']:.2f} | {values['lds']:.2f} | {values['seconds']:.2f} |"
            )
    return "\n".join(lines + ["", same_contexts(results)])


def same_contexts(results: list[dict]) -> str:
    """Each method's LDS on the contexts the peers ran on (the first ones of each length)."""
    lines = ["| tokens | contexts | method | LDS on the peers' contexts |", "|---|---|---|---|"]
    for row in results:
        runs = {name: values["each"]["lds"] for name, values in row["methods"].items() if "each" in values}
        shared = min(map(len, runs.values()), default=0)
        for name, lds in runs.items():
            finite = [value for value in lds[:shared] if value == value]  # an LDS is NaN where the scores are constant
            lines.append(f"| {row['length']} | {shared} | {name} | {sum(finite) / max(len(finite), 1):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
