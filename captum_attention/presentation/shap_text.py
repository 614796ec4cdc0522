"""SHAP values of a text classifier as ``(batch, tokens)`` scores, next to the attributions.

``shap``'s text masker masks the tokenizer's own tokens, so with the model's tokenizer its
values line up one to one with the model's tokens (``[CLS]`` and ``[SEP]`` included). This
puts them in the ``(batch, seq_len)`` layout of the texts padded as the model reads them
(:func:`~captum_attention.presentation.explain.classifier_inputs`), which every metric of
:mod:`captum_attention.metrics` takes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..capture.inputs import class_probabilities


def shap_token_values(
    forward_func: Callable[[Tensor, Tensor], Tensor],
    tokenizer: Any,
    texts: Sequence[str],
    target: Tensor,
    max_evals: int = 300,
    padding_side: str = "right",
) -> Tensor:
    """SHAP's Partition explainer on each text, the values of each example's ``target`` class.

    Args:
        forward_func (Callable): ``forward_func(input_ids, attention_mask)`` returns logits.
        tokenizer: the model's (fast) tokenizer.
        texts (sequence of str): the inputs.
        target (Tensor): ``(batch,)`` the class explained per text.
        max_evals (int, optional): model evaluations per text. Default: 300.
        padding_side (str, optional): where the texts are padded, as the model reads them
            (:func:`~captum_attention.presentation.explain.classifier_padding_side`).
            Default: ``"right"``.

    Returns:
        ``(batch, seq_len)`` float32, aligned with the texts padded on ``padding_side``, 0 at
        padding.

    Raises:
        RuntimeError: SHAP's tokens do not line up with the tokenizer's (a tokenizer that
            is not the model's, or truncation).
    """
    import shap

    def probabilities(strings: Sequence[str]) -> np.ndarray:
        encoded = tokenizer(list(strings), padding=True, padding_side=padding_side, return_tensors="pt")
        with torch.no_grad():
            return class_probabilities(forward_func(encoded["input_ids"], encoded["attention_mask"])).numpy()

    encoded = tokenizer(list(texts), padding=True, padding_side=padding_side, return_tensors="pt")
    explainer = shap.Explainer(probabilities, shap.maskers.Text(tokenizer), algorithm="partition")
    explanation = explainer(list(texts), max_evals=max_evals, silent=True)
    scores = torch.zeros(encoded["input_ids"].shape)
    for row, values in enumerate(explanation.values):
        real = int(encoded["attention_mask"][row].sum())
        if values.shape[0] != real:
            raise RuntimeError(
                f"SHAP masked {values.shape[0]} tokens of text {row} but the tokenizer gives {real}: "
                "pass the model's own tokenizer, and texts it does not truncate."
            )
        columns = encoded["attention_mask"][row].nonzero().flatten()
        scores[row, columns] = torch.from_numpy(np.asarray(values[:, int(target[row])], dtype=np.float32))
    return scores
