"""Perturbation functions on token ids for Captum's ``infidelity`` and ``sensitivity_max``.

Captum's default perturbations add Gaussian noise, which means nothing for integer token
ids. These replace a random subset of tokens instead; special tokens and padding (the
``protected_ids``) are never touched. Each factory takes a seed so a metric is
reproducible.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from ..maps.draws import DRAW_RANGE, hashed_draws, real_ranks
from .token_removal import example_seeds

Inputs = Tensor | tuple[Tensor, ...]


def _token_ids(inputs: Inputs) -> Tensor:
    ids = inputs[0] if isinstance(inputs, tuple) else inputs
    if ids.is_floating_point() or ids.dim() != 2:
        raise TypeError(
            f"token perturbations need integer token ids (batch, seq_len), got dtype {ids.dtype} "
            f"and shape {tuple(ids.shape)}."
        )
    return ids


def _like_inputs(inputs: Inputs, ids: Tensor) -> Inputs:
    return (ids, *inputs[1:]) if isinstance(inputs, tuple) else ids


class _TokenSampler:
    """Draws which tokens to perturb: each unprotected token with ``probability``.

    Each example's draws are hashed (:func:`~captum_attention.maps.draws.hashed_draws`)
    from ``seed`` with its unprotected tokens
    (:func:`~captum_attention.metrics.token_removal.example_seeds`), how many perturbations
    of it were drawn before (Captum asks for an example's ``n`` samples as ``n`` copies,
    possibly over several calls) and each token's place among its unprotected tokens: an
    example's perturbations are the same whatever batch, padding (protected) or
    ``max_examples_per_batch`` it comes in.
    """

    def __init__(self, probability: float, protected_ids: Sequence[int], seed: int | None) -> None:
        if not 0.0 < probability <= 1.0:
            raise ValueError(f"probability must be in (0, 1], got {probability}.")
        self.probability = probability
        self.protected_ids = torch.tensor(list(protected_ids), dtype=torch.long)
        self.seed = int(torch.randint(2**31, ())) if seed is None else seed
        self.drawn: dict[int, int] = {}  # an example's seed -> perturbations drawn for it so far

    def draws(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Which tokens of ``ids`` to perturb (bool, like ``ids``), and one more draw per
        token in ``[0, DRAW_RANGE)`` (for what replaces it)."""
        unprotected = ~torch.isin(ids, self.protected_ids.to(ids.device))
        seeds = example_seeds(ids, unprotected, self.seed)
        samples = []
        for seed in seeds.tolist():
            samples.append(self.drawn.get(seed, 0))
            self.drawn[seed] = samples[-1] + 1
        where = (seeds.to(ids.device)[:, None], torch.tensor(samples, device=ids.device)[:, None], real_ranks(unprotected))
        chosen = hashed_draws(*where, 0) < self.probability * DRAW_RANGE
        return chosen & unprotected, hashed_draws(*where, 1)


def token_replacement_perturbation(
    replacement_id: int,
    probability: float = 0.15,
    protected_ids: Sequence[int] = (),
    seed: int | None = None,
) -> Callable[[Inputs], tuple[Inputs, Inputs]]:
    r"""A ``perturb_func`` for :func:`captum.metrics.infidelity` on token ids.

    Each token not in ``protected_ids`` is replaced by ``replacement_id`` (e.g. [MASK] or
    [PAD]) with ``probability``. The perturbation returned with the perturbed ids is the
    0/1 indicator of replaced tokens, so infidelity measures
    E[(Σ_i attr_i·I_i − (f(x) − f(x̃)))²]: how well the attributions of the removed tokens
    add up to the change of the output.

    Args:
        replacement_id (int): the token id written in place of removed tokens.
        probability (float, optional): chance that each token is replaced. Default: 0.15.
        protected_ids (sequence of int, optional): ids never replaced (padding, [CLS],
            [SEP], ...). Default: ().
        seed (int, optional): seed of the draws, with each example's own tokens (None:
            a random one). Default: None.

    Returns:
        ``perturb_func(inputs) -> (indicator, perturbed_inputs)``, shaped like ``inputs``.

    Example::

        >>> perturb = token_replacement_perturbation(tok.mask_token_id,
        ...     protected_ids=tok.all_special_ids, seed=0)
        >>> infidelity(forward, perturb, input_ids, scores, target=1,
        ...            additional_forward_args=(mask,))
    """
    sampler = _TokenSampler(probability, protected_ids, seed)

    def perturb(inputs: Inputs) -> tuple[Inputs, Inputs]:
        ids = _token_ids(inputs)
        replaced, _ = sampler.draws(ids)
        perturbed = ids.masked_fill(replaced, replacement_id)
        indicator = replaced.float()
        return _like_inputs(inputs, indicator), _like_inputs(inputs, perturbed)

    return perturb


def token_substitution_perturbation(
    vocab_size: int,
    probability: float = 0.1,
    protected_ids: Sequence[int] = (),
    seed: int | None = None,
) -> Callable[[Inputs], Inputs]:
    r"""A ``perturb_func`` for :func:`captum.metrics.sensitivity_max` on token ids.

    Each token not in ``protected_ids`` is swapped, with ``probability``, for a token id
    drawn uniformly from ``[0, vocab_size)`` minus ``protected_ids``: the discrete
    analogue of Captum's small-ball noise.

    Args:
        vocab_size (int): number of token ids.
        probability (float, optional): chance that each token is swapped. Default: 0.1.
        protected_ids (sequence of int, optional): ids never swapped and never drawn.
            Default: ().
        seed (int, optional): seed of the draws, with each example's own tokens (None:
            a random one). Default: None.

    Returns:
        ``perturb_func(inputs) -> perturbed_inputs``, shaped like ``inputs``.

    Example::

        >>> perturb = token_substitution_perturbation(tok.vocab_size,
        ...     protected_ids=tok.all_special_ids, seed=0)
        >>> sensitivity_max(GradSAM(model).attribute, (input_ids,), perturb_func=perturb,
        ...                 target=1, additional_forward_args=(mask,))
    """
    sampler = _TokenSampler(probability, protected_ids, seed)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in set(protected_ids)])
    if len(allowed) == 0:
        raise ValueError("every token id is protected: nothing to substitute.")

    def perturb(inputs: Inputs) -> Inputs:
        ids = _token_ids(inputs)
        swapped, draws = sampler.draws(ids)
        substitutes = allowed.to(ids.device)[draws % len(allowed)]
        return _like_inputs(inputs, torch.where(swapped, substitutes, ids))

    return perturb
