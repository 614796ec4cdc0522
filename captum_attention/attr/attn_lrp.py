"""AttnLRP as a Captum attribution."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from captum.attr import GradientAttribution
from torch import Tensor, nn

from .._compat import TargetType
from ..capture.inputs import QueryIndex, resolve_targets
from ..capture.record import ForwardRecord, record_forward, resolve_adapter
from ..capture import AttentionAdapter, HuggingFaceAdapter
from ..maps import lrp
from ..maps.lrp import token_relevance
from ._base import AttentionAttributionBase, CaptureMode, Scores, attribute_method


class AttnLRP(AttentionAttributionBase, GradientAttribution):
    r"""AttnLRP: attention-aware layer-wise relevance propagation.

    Achtibat, Hatefi, Dreyer, Jain, Wiegand, Lapuschkin & Samek, "AttnLRP:
    Attention-Aware Layer-Wise Relevance Propagation for Transformers", ICML 2024
    (https://arxiv.org/abs/2402.05602).

    The explained logit S is propagated back to the input embeddings :math:`e_t` by the
    paper's rules, written as modified gradients :math:`\tilde g` (each rule with its
    equation in :mod:`captum_attention.maps.lrp`): the ordinary gradient through linear
    layers (ε-rule, ε → 0; or the γ-rule, ``gamma``) and through the softmax
    (Proposition 3.1); half of it to each
    factor of :math:`Q K^\top`, :math:`A V` and of a product of two activations (uniform
    rule); :math:`\tilde g_x = \tilde g_y \odot y / x` through element-wise activations
    (identity rule); the normalisation scale held constant in LayerNorm and RMSNorm. The
    relevance of token t is

    .. math::

        R_t = \sum_d e_{td} \, \tilde g_{td}, \qquad \tilde g = \tilde\nabla_e S,

    signed, and :math:`\sum_t R_t = S` up to what biases (linear layers, norms, position
    embeddings, masks) and the softmax absorb. The rules act only during the call,
    through the capture layer (the attention kernel's inputs and output, forward hooks on
    the activation and norm modules, a thread-local ``TorchFunctionMode``); in streaming
    mode the model's own kernel runs, so the cost is one forward and one backward,
    batched, at the kernel's memory. The input embeddings are read from
    ``get_input_embeddings()`` (a vision transformer's patch embedding, so image scores
    are per patch), or are the inputs themselves when embeddings are given (e.g. under
    ``NoiseTunnel``).

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``; a Hugging Face
            model (its ``.logits`` is used) or any function of
            ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module holding the attention layers. Default:
            ``forward_func`` when it is a module.
        adapter (AttentionAdapter, optional): how to find the attention and the input
            embeddings. Default: the Hugging Face adapter.
        capture (str, optional): ``"streaming"``: the rules act on the inputs and output
            of the model's own attention kernel; ``"eager"``: on the explicit products
            of eager attention (same relevance, the memory of the full maps); ``"auto"``:
            streaming wherever possible. Default: ``"auto"``.
        block_memory (int, optional): as for the other methods (unused by the rules).
            Default: None.
        gamma (float, optional): 0: the ε-rule (ε → 0) in every linear layer; γ > 0: the
            generalised γ-rule there (as zennit's ``Gamma``), which the paper uses for
            vision transformers (a value to tune, e.g. 0.25). Default: 0.

    Example::

        >>> model = BertForSequenceClassification(config).eval()
        >>> explainer = AttnLRP(model)
        >>> relevance = explainer.attribute(input_ids, target=1,
        ...                                 additional_forward_args=(attention_mask,))
        >>> relevance.shape  # (batch, seq_len); padding tokens score 0
    """

    method_name = "attn_lrp"
    readable_name = "AttnLRP"
    streams_encoder_decoder = True
    signed = True

    def __init__(
        self,
        forward_func: Callable[..., Any],
        model: nn.Module | None = None,
        adapter: AttentionAdapter | None = None,
        capture: CaptureMode = "auto",
        block_memory: int | None = None,
        gamma: float = 0.0,
    ) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be 0 (the ε-rule) or positive, got {gamma}.")
        super().__init__(forward_func, model, adapter, capture, block_memory)
        self.rules = lrp.AttnLRPRules(gamma)

    @classmethod
    def uses_backward(cls) -> bool:
        return True

    @attribute_method
    def attribute(
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        query_index: QueryIndex = None,
        return_maps: bool = False,
    ) -> Scores:
        r"""AttnLRP relevance of each token for the explained logit.

        Args:
            $inputs
            $target
            $additional_forward_args
            query_index (int or sequence/Tensor of int, optional): for a language model,
                the position whose logits are explained (one for all examples or one per
                example). Default: None, the last real token.
            return_maps (bool, optional): AttnLRP has no attention maps; True is an
                error. Default: False.

        $returns
        """
        if return_maps:
            raise ValueError("AttnLRP propagates relevance to the tokens and has no attention maps: leave return_maps=False.")
        return self._explain(inputs, target, additional_forward_args, query_index, False)

    def _forward(
        self,
        inputs: tuple[Tensor, ...],
        additional_forward_args: Any,
        query_index: QueryIndex,
        streaming: bool,
        effective: bool = False,
    ) -> ForwardRecord:
        """One forward under the rules; given text embeddings are where relevance is read."""
        adapter = resolve_adapter(self.model, self.adapter)
        if not isinstance(adapter, HuggingFaceAdapter):
            raise ValueError(
                f"AttnLRP's rules cover transformers' attention (the Hugging Face families, "
                f"HuggingFaceAdapter); {type(adapter).__name__} models are not supported."
            )
        given = tuple(t.detach().requires_grad_() if t.is_floating_point() and t.dim() == 3 else t for t in inputs)
        record = record_forward(
            self.forward_func, self.model, given, additional_forward_args, self.adapter, query_index=query_index,
            streaming=streaming, block_memory=self.block_memory, relevance_rules=self.rules,
        )
        embeddings = [t for t in given if t.requires_grad] + list(record.embeddings or [])
        if not embeddings:
            raise ValueError(
                f"No input embeddings of {type(self.model).__name__} were seen: its adapter names none "
                "(input_embeddings), or the forward did not call them. Pass embeddings as inputs instead."
            )
        return replace(record, embeddings=embeddings)

    def _explained(self, record: ForwardRecord, target: TargetType, retain_graph: bool = False) -> ForwardRecord:
        """The record with the relevance of each embedded sequence for ``target``."""
        assert record.embeddings is not None
        logits = record.explained_logits()
        targets = resolve_targets(logits, target)
        with torch.enable_grad():
            score = logits.gather(1, targets[:, None]).sum()
            grads = torch.autograd.grad(score, record.embeddings, retain_graph=retain_graph, allow_unused=True)
        relevance = [
            token_relevance(e, torch.zeros_like(e) if g is None else g) for e, g in zip(record.embeddings, grads)
        ]
        return replace(record, relevance=relevance)

    def _relevance_scores(self, record: ForwardRecord) -> Scores:
        """The relevance per token, aligned right with the tokens the attention sees (a
        vision transformer's class and distillation tokens, which have no input
        embedding, get 0); an encoder-decoder's ``(source, target)``."""
        assert record.relevance is not None
        if record.is_encoder_decoder:
            assert record.source_real is not None
            return _aligned(record.relevance[0], record.source_real), _aligned(record.relevance[-1], record.target_real)
        return _aligned(record.relevance[0], record.target_real)

    def _streamed_scores(self, record: ForwardRecord) -> Scores:
        return self._relevance_scores(record)

    def _scores(self, record: ForwardRecord) -> tuple[Tensor, list[Tensor]]:
        return cast(Tensor, self._relevance_scores(record)), []

    def _encoder_decoder_scores(self, record: ForwardRecord) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        return cast(tuple[Tensor, Tensor], self._relevance_scores(record)), {}


def _aligned(relevance: Tensor, real: Tensor) -> Tensor:
    """``(B, T')`` relevance padded on the left to the ``T`` tokens of ``real``."""
    return F.pad(relevance, (real.shape[1] - relevance.shape[1], 0))
