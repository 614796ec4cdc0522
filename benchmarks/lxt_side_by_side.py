"""AttnLRP here against lxt's (the authors' library), on the same weights and inputs.

    LXT_PYTHON=/path/to/lxt-env/bin/python python benchmarks/lxt_side_by_side.py

lxt (``lxt.efficient``) replaces transformers' model classes for the whole process and
pins an older transformers, so it runs in its own environment::

    python3 -m venv lxt-env
    lxt-env/bin/pip install torch==2.13.0 transformers==4.51.3 tabulate
    lxt-env/bin/pip install --no-deps lxt==2.1 zennit   # their other requirements serve other models
    lxt-env/bin/pip install pillow

This script saves three models with their inputs: a tiny BERT classifier (random biases,
so that they absorb relevance), a tiny Llama language model (grouped-query attention,
left padding) and the default sentiment model (MiniLM) on eight sentences. The lxt environment runs this file as a worker (``--worker DIR``): it patches
``modeling_bert`` and ``modeling_llama`` with ``lxt.efficient.monkey_patch``, loads the
weights into transformers' classes of its version and computes
``(inputs_embeds * grad).sum(-1)``. Here :class:`~captum_attention.AttnLRP` explains
the same logits. Printed per model: the largest difference relative to the largest
relevance, and the rank correlation of the two relevance vectors per example; then the
γ-rule of one linear layer against zennit's ``Gamma`` (the rule lxt applies in vision
transformers), where zennit is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

TINY_BERT = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
    max_position_embeddings=64, num_labels=3, initializer_range=0.3,
)
TINY_LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=64, pad_token_id=0,
)
SENTENCES = [
    "the plot was dull but the acting was superb",
    "a wonderful, moving film",
    "i hated every minute of it",
    "not bad at all, rather charming",
    "the soundtrack is forgettable and the pacing drags",
    "an instant classic with a brilliant cast",
    "boring, predictable and far too long",
    "surprisingly funny and warm",
]


def worker(directory: Path) -> None:
    """Runs in the lxt environment: lxt's AttnLRP of every saved case."""
    import transformers.models.bert.modeling_bert as modeling_bert
    import transformers.models.llama.modeling_llama as modeling_llama

    _torchvision_stand_in()  # after transformers has checked which packages it has
    from lxt.efficient import monkey_patch

    monkey_patch(modeling_bert)
    monkey_patch(modeling_llama)
    from transformers import AutoModelForSequenceClassification, BertConfig, LlamaConfig

    results = {}
    for case in json.loads((directory / "cases.json").read_text()):
        inputs = torch.load(directory / f"{case['name']}.inputs.pt")
        if case["kind"] == "pretrained":
            model = AutoModelForSequenceClassification.from_pretrained(case["path"]).eval()
        else:
            config = (BertConfig if case["kind"] == "bert" else LlamaConfig)(**case["config"])
            model = (modeling_bert.BertForSequenceClassification if case["kind"] == "bert" else modeling_llama.LlamaForCausalLM)(config)
            missing, unexpected = model.load_state_dict(torch.load(directory / f"{case['name']}.weights.pt"), strict=False)
            assert not [k for k in missing if not k.endswith("position_ids")] and not unexpected, (missing, unexpected)
            model.eval()
        embeds = model.get_input_embeddings()(inputs["ids"]).detach().requires_grad_()
        logits = model(inputs_embeds=embeds, attention_mask=inputs["mask"]).logits
        logits = logits[:, -1] if logits.dim() == 3 else logits
        logits.gather(1, inputs["target"][:, None]).sum().backward()
        results[case["name"]] = (embeds * embeds.grad).sum(-1).detach().tolist()
    results["gamma"] = _zennit_gamma()
    (directory / "lxt.json").write_text(json.dumps(results))


def _gamma_case() -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    """A float64 linear layer with signed inputs and bias, and the relevance of its outputs."""
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(7, 5).double()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(5, 7, generator=generator, dtype=torch.float64))
        layer.bias.copy_(torch.randn(5, generator=generator, dtype=torch.float64))
    return torch.randn(4, 7, generator=generator, dtype=torch.float64), layer, torch.randn(4, 5, generator=generator, dtype=torch.float64)


def _zennit_gamma() -> dict[str, list] | None:
    """zennit's ``Gamma`` rule (which lxt applies to vision transformers) on
    :func:`_gamma_case`, per γ; None where zennit is not installed."""
    try:
        from zennit.rules import Gamma
    except ImportError:
        return None
    x, layer, relevance = _gamma_case()
    results = {}
    for gamma in GAMMAS:
        handles = Gamma(gamma=gamma, stabilizer=1e-6).register(layer)
        inputs = x.clone().requires_grad_()
        layer(inputs).backward(relevance)
        handles.remove()
        results[str(gamma)] = inputs.grad.tolist()
    return results


GAMMAS = (0.25, 1.0)


def _torchvision_stand_in() -> None:
    """lxt imports ``torchvision.models.vision_transformer`` for its torchvision-ViT rules
    (reading only its ``nn``) and zennit two ResNet block classes; PyPI's torchvision
    wheels are built against CUDA torch and fail to load beside the CPU one, so where it
    does not import, stand-in modules answer (nothing here uses them)."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        vision_transformer = types.ModuleType("torchvision.models.vision_transformer")
        vision_transformer.nn = torch.nn  # type: ignore[attr-defined]
        resnet = types.ModuleType("torchvision.models.resnet")  # zennit imports two ResNet blocks
        resnet.Bottleneck = resnet.BasicBlock = type("Block", (torch.nn.Module,), {})  # type: ignore[attr-defined]
        models = types.ModuleType("torchvision.models")
        models.vision_transformer = vision_transformer  # type: ignore[attr-defined]
        models.resnet = resnet  # type: ignore[attr-defined]
        package = types.ModuleType("torchvision")
        package.models = models  # type: ignore[attr-defined]
        sys.modules.update({
            "torchvision": package, "torchvision.models": models,
            "torchvision.models.vision_transformer": vision_transformer, "torchvision.models.resnet": resnet,
        })


def cases(directory: Path) -> list[dict]:
    """Save the models and inputs; return their descriptions."""
    import transformers as tf

    saved = []
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    bert = tf.BertForSequenceClassification(tf.BertConfig(**TINY_BERT)).eval()
    with torch.no_grad():
        for name, parameter in bert.named_parameters():
            if name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    ids = torch.randint(3, 64, (3, 9), generator=generator)
    mask = (torch.arange(9)[None] < torch.tensor([[9], [6], [4]])).long()
    saved.append(("tiny BERT", "bert", bert, dict(ids=ids * mask, mask=mask, target=torch.tensor([1, 0, 2])), TINY_BERT))
    torch.manual_seed(0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY_LLAMA)).eval()
    mask = (torch.arange(7)[None] >= torch.tensor([[0], [2], [4]])).long()
    ids = torch.randint(3, 64, (3, 7), generator=generator) * mask
    with torch.no_grad():
        target = llama(ids, attention_mask=mask).logits[:, -1].argmax(-1)
    saved.append(("tiny Llama", "llama", llama, dict(ids=ids, mask=mask, target=target), TINY_LLAMA))
    described = []
    for name, kind, model, inputs, config in saved:
        key = name.replace(" ", "_")
        torch.save(model.state_dict(), directory / f"{key}.weights.pt")
        torch.save(inputs, directory / f"{key}.inputs.pt")
        described.append(dict(name=key, kind=kind, config=config, model=model))
    from captum_attention.demo.default_model import default_model_path
    from captum_attention.loading import load_classifier

    path = default_model_path(progress=False)  # trained on first use, about a minute
    model, tokenizer = load_classifier(path)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        target = model(**batch).logits.argmax(-1)
    torch.save(dict(ids=batch.input_ids, mask=batch.attention_mask, target=target), directory / "sentiment_MiniLM.inputs.pt")
    described.append(dict(name="sentiment_MiniLM", kind="pretrained", path=str(path), model=model))
    return described


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ranks = [x.argsort().argsort().float() for x in (a, b)]
    return float(torch.corrcoef(torch.stack(ranks))[0, 1])


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return
    from captum_attention import AttnLRP

    lxt_python = os.environ.get("LXT_PYTHON")
    if not lxt_python:
        sys.exit("Set LXT_PYTHON to the python of an environment with lxt (see this file's docstring).")
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        described = cases(directory)
        (directory / "cases.json").write_text(json.dumps([{k: v for k, v in c.items() if k != "model"} for c in described]))
        subprocess.run([lxt_python, __file__, "--worker", str(directory)], check=True)
        theirs = json.loads((directory / "lxt.json").read_text())
        print("| model | examples | max |ours − lxt| / max |R| | Spearman ρ per example (min) |")
        print("|---|---|---|---|")
        for case in described:
            inputs = torch.load(directory / f"{case['name']}.inputs.pt")
            ours = AttnLRP(case["model"]).attribute(inputs["ids"], target=inputs["target"], additional_forward_args=(inputs["mask"],))
            lxt = torch.tensor(theirs[case["name"]]) * inputs["mask"]
            gap = float((ours - lxt).abs().max() / lxt.abs().max())
            rho = min(_spearman(o[m.bool()], t[m.bool()]) for o, t, m in zip(ours, lxt, inputs["mask"]))
            print(f"| {case['name'].replace('_', ' ')} | {len(ours)} | {gap:.2e} | {rho:.4f} |")
        if theirs["gamma"] is not None:
            from captum_attention.maps.lrp import linear_rule

            x, layer, relevance = _gamma_case()
            print("\nγ-rule of one linear layer against zennit's Gamma (float64):")
            for gamma in GAMMAS:
                inputs = x.clone().requires_grad_()
                output = linear_rule(inputs, layer.weight, layer.bias, gamma)
                (grad,) = torch.autograd.grad(output, inputs, relevance / output.detach())
                zennit = torch.tensor(theirs["gamma"][str(gamma)], dtype=torch.float64)
                print(f"  γ = {gamma}: max |ours − zennit| / max |R| = {float((x * grad - zennit).abs().max() / zennit.abs().max()):.1e}")


if __name__ == "__main__":
    main()
