"""Draw the README's figure: every method's scores of one sentence on the default model.

    python docs/readme_figure.py     # writes docs/_static/explanation.png
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from captum.attr import LayerIntegratedGradients  # noqa: E402

from captum_attention import METHODS, load_default_model, scores_for_display, special_tokens, token_heatmap  # noqa: E402

SENTENCE = "the soundtrack is great but the story is painfully boring"


def main() -> None:
    model, tokenizer = load_default_model()
    batch = tokenizer([SENTENCE], return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask
    predicted = model(ids, attention_mask=mask).logits.argmax(-1)
    args = dict(target=predicted, additional_forward_args=(mask,))
    special = special_tokens(ids, tokenizer)
    scores = {cls.get_name(): cls(model).attribute(ids, **args) for cls in METHODS.values()}
    logits = lambda input_ids, attention_mask: model(input_ids, attention_mask=attention_mask).logits  # noqa: E731
    baseline = ids.where(special, tokenizer.pad_token_id)
    ig = LayerIntegratedGradients(logits, model.get_input_embeddings())
    scores["Integrated Gradients"] = ig.attribute(ids, baselines=baseline, n_steps=50, **args).sum(-1)
    rows = {name: scores_for_display(values, special)[0] for name, values in scores.items()}
    label = model.config.id2label[int(predicted)]
    ax = token_heatmap(rows, tokenizer.convert_ids_to_tokens(ids[0]), title=f"{SENTENCE!r} → {label}")
    target = Path(__file__).parent / "_static" / "explanation.png"
    ax.figure.savefig(target, dpi=120)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
