"""``captum-attention evaluate`` against ferret's ``Benchmark``, same sentences, methods and metrics.

    python benchmarks/ferret_side_by_side.py --ferret-python /path/to/ferret-venv/bin/python [--examples 32]

ferret (``ferret-xai``) needs transformers 4.x and captum 0.7, which this project's
environment cannot hold (transformers 5), so it runs in its own virtual environment:

    python3 -m venv ferret-venv
    ferret-venv/bin/pip install torch==2.13.0 ferret-xai "pyarrow<19"

(ferret pins numpy < 2, which the newest pyarrow no longer supports.)

Both explain held-out sentences of the generated corpus with the default model (its
predicted class), with SHAP's Partition explainer (500 evaluations, ferret's default) and
Integrated Gradients (50 steps; ferret's multiplies by the input embeddings, ours is
Captum's ``LayerIntegratedGradients`` on them), then with Integrated Gradients alone, and score each explanation by ERASER
comprehensiveness and sufficiency (AOPC) and plausibility against the rationale words
(token F1, AUPRC). ferret goes one sentence at a time (``Benchmark.explain`` then
``Benchmark.evaluate_explanations``); ours batches. Each side is timed from the start of its
process to its last result (model loading included), one after the other on the same
machine, and the script prints the examples per second of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from captum_attention.demo import default_model_path, generate, write_jsonl

FERRET_SIDE = r'''
import json, sys, time
begin = time.perf_counter()
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from ferret import Benchmark, SHAPExplainer, IntegratedGradientExplainer
from ferret.evaluators.faithfulness_measures import AOPC_Comprehensiveness_Evaluation, AOPC_Sufficiency_Evaluation
from ferret.evaluators.plausibility_measures import AUPRC_PlausibilityEvaluation, Tokenf1_PlausibilityEvaluation

folder, data, with_shap = sys.argv[1], sys.argv[2], sys.argv[3] == "shap"
model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
tokenizer = AutoTokenizer.from_pretrained(folder)
explainers = [IntegratedGradientExplainer(model, tokenizer, multiply_by_inputs=True)]
explainers = [SHAPExplainer(model, tokenizer), *explainers] if with_shap else explainers
evaluators = [e(model, tokenizer) for e in (AOPC_Comprehensiveness_Evaluation, AOPC_Sufficiency_Evaluation,
                                            Tokenf1_PlausibilityEvaluation, AUPRC_PlausibilityEvaluation)]
bench = Benchmark(model, tokenizer, explainers=explainers, evaluators=evaluators)
rows = [json.loads(line) for line in open(data)]
for row in rows:
    encoded = tokenizer(row["text"], return_tensors="pt")
    with torch.no_grad():
        target = int(model(**encoded).logits.argmax(-1))
    words = set(row["rationale"])
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
    rationale = [int(token in words) for token in tokens[1:-1]]  # ferret adds [CLS] and [SEP] itself
    explanations = bench.explain(row["text"], target=target, show_progress=False)
    bench.evaluate_explanations(explanations, target=target, human_rationale=rationale, show_progress=False)
print(json.dumps({"seconds": time.perf_counter() - begin, "examples": len(rows)}))
'''


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ferret-python", default=os.environ.get("FERRET_PYTHON"),
                        help="the python of a virtual environment with ferret-xai (default: $FERRET_PYTHON)")
    parser.add_argument("--examples", type=int, default=32)
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: the cached default model)")
    options = parser.parse_args(argv)
    if not options.ferret_python:
        parser.error("give --ferret-python (see the module docstring for how to make its environment)")
    model = options.model or default_model_path()
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rates = {}
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "data.jsonl"
        write_jsonl(generate("heldout", options.examples, seed=11), data)
        script = Path(folder) / "ferret_side.py"
        script.write_text(FERRET_SIDE)
        for label, methods in (("SHAP + IG", "shap,integrated_gradients"), ("IG", "integrated_gradients")):
            ours = [sys.executable, "-m", "captum_attention", "evaluate", str(data), "--model", str(model),
                    "--output", str(Path(folder) / f"ours-{len(rates)}"), "--methods", methods, "--shap-evals", "500",
                    "--metrics", "comprehensiveness,sufficiency,token_f1,auprc"]
            begin = time.perf_counter()
            subprocess.run(ours, env=environment, check=True, capture_output=True)
            rates[f"captum-attention evaluate, {label}"] = options.examples / (time.perf_counter() - begin)
            shap = "shap" if "shap" in methods else "none"
            finished = subprocess.run([options.ferret_python, str(script), str(model), str(data), shap], env=environment,
                                      check=True, capture_output=True, text=True)
            result = json.loads(finished.stdout.strip().splitlines()[-1])
            rates[f"ferret Benchmark, {label}"] = result["examples"] / result["seconds"]
    for name, rate in rates.items():
        print(f"{name:37} {rate:6.2f} examples/s ({options.examples} sentences, 4 metrics)")
    return rates


if __name__ == "__main__":
    main()
