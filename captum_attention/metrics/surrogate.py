"""The calibrated surrogate: ContextCite's linear surrogate with a one-pass attribution as
its prior, fitted on a few ablations; :func:`~captum_attention.metrics.calibrated_scores`
fits it to a language model's answer, :func:`~captum_attention.metrics.calibrated_attribution`
to a classifier's prediction."""

from __future__ import annotations

import torch
from torch import Tensor

CALIBRATION_RIDGE = 0.2
"""The default penalty per squared segment (feature) of the calibrated surrogates: on 8 ablations,
AttnLRP calibrated scores an LDS within 0.004 of AttnLRP's alone on the needle task at
512 to 16,384 tokens and 0.002-0.015 above it on the four ground-truth tasks
(``benchmarks/needle.py --calibrated 8``, ``benchmarks/faithfulness.py``)."""


def calibrated_surrogate(kept: Tensor, outcomes: Tensor, prior: Tensor, ridge: float = CALIBRATION_RIDGE) -> Tensor:
    r"""One example's calibrated scores: ContextCite's linear surrogate with a prior (a
    one-pass attribution's scores :math:`p`) in place of its sparsity.

    Over :math:`A` ablations :math:`m_a` of the example's :math:`S` features (tokens or
    segments), fits the outcomes as :math:`y_a = b + \alpha\, m_a^\top p + m_a^\top
    \delta` by least squares with the penalty :math:`\lambda S^2 \lVert \delta \rVert^2`,
    and 1e-9 of it on :math:`b` and :math:`\alpha`: nearly free, yet fixed where the
    ablations cannot fix them (a single one). Few ablations then rescale the prior and move
    only the features they are sure of, the less the more features share them.

    Args:
        kept (Tensor): ``(A, S)`` 0/1, the features each ablation keeps.
        outcomes (Tensor): ``(A,)`` the explained output under each ablation (a
            log-probability, a logit-probability).
        prior (Tensor): ``(S,)`` the prior's scores.
        ridge (float, optional): :math:`\lambda`. Default: :data:`CALIBRATION_RIDGE`.

    Returns:
        ``(S,)`` :math:`\alpha p + \delta`, in ``kept``'s dtype; ``prior`` itself where
        :math:`\alpha \le 0`: there the few ablations contradict the prior's direction,
        which one-pass attributions that rank well get right far more often than a few
        ablations do (reversing the prior there fell far below it: an LDS of 0.32 against
        AttnLRP's 0.83 on one ablation per needle context).
    """
    design = torch.cat([torch.ones_like(outcomes)[:, None], (kept @ prior)[:, None], kept], dim=1)
    penalty = torch.full((design.shape[1],), ridge * kept.shape[1] ** 2, dtype=design.dtype)
    penalty[:2] *= 1e-9
    coefficients = torch.linalg.solve(design.T @ design + torch.diag(penalty), design.T @ outcomes)
    if coefficients[1] <= 0:
        return prior.clone()
    return coefficients[1] * prior + coefficients[2:]
