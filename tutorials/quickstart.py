"""Quickstart: the four attention attributions next to Captum's Integrated Gradients.

    python tutorials/quickstart.py

Builds a small BERT classifier from a config (no download), explains a padded batch with
each method, smooths Grad-SAM with NoiseTunnel over the embeddings and scores the
explanations with Captum's infidelity, using the token-id perturbation of this package.
"""

from __future__ import annotations

import torch
import transformers as tf
from captum.attr import LayerIntegratedGradients, NoiseTunnel
from captum.metrics import infidelity

from captum_attention import AttentionRollout, GradSAM, RawAttention, TransformerAttribution
from captum_attention.metrics import token_replacement_perturbation

PAD, CLS, SEP, MASK = 0, 1, 2, 3


def main() -> None:
    torch.manual_seed(0)
    config = tf.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, num_labels=2, initializer_range=0.2,
    )
    model = tf.BertForSequenceClassification(config).eval()
    input_ids = torch.tensor([[CLS, 17, 42, 8, 99, SEP, PAD, PAD], [CLS, 5, 63, 21, 34, 12, 77, SEP]])
    attention_mask = (input_ids != PAD).long()
    forward = lambda ids, mask: model(ids, attention_mask=mask).logits  # noqa: E731
    args = dict(target=1, additional_forward_args=(attention_mask,))

    explanations = {
        cls.get_name(): cls(forward, model=model).attribute(input_ids, **args)
        for cls in (GradSAM, AttentionRollout, TransformerAttribution, RawAttention)
    }
    lig = LayerIntegratedGradients(forward, model.bert.embeddings)
    explanations["Integrated Gradients"] = lig.attribute(input_ids, n_steps=50, **args).sum(-1)

    embed = lambda ids: model.get_input_embeddings()(ids).detach()  # noqa: E731
    smooth = NoiseTunnel(GradSAM(lambda e, m: model(inputs_embeds=e, attention_mask=m).logits, model=model))
    explanations["SmoothGrad-SAM"] = smooth.attribute(
        embed(input_ids), nt_type="smoothgrad", nt_samples=8, stdevs=0.02, **args
    )

    perturb = token_replacement_perturbation(MASK, probability=0.3, protected_ids=[PAD, CLS, SEP], seed=0)
    print(f"{'method':24} infidelity  scores of example 0 (padding scores 0)")
    for name, scores in explanations.items():
        score = infidelity(forward, perturb, input_ids, scores, n_perturb_samples=16, **args)
        print(f"{name:24} {score[0].item():10.3e}  " + " ".join(f"{s:+.3f}" for s in scores[0].tolist()))


if __name__ == "__main__":
    main()
