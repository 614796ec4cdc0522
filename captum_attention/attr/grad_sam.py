"""Grad-SAM as a Captum attribution."""

from __future__ import annotations

from typing import Any

from captum._utils.typing import TargetType
from captum.attr import GradientAttribution
from captum.log import log_usage
from torch import Tensor

from ..maps import grad_sam_layer_maps, grad_sam_scores
from ._base import AttentionAttributionBase, format_inputs, format_scores


class GradSAM(AttentionAttributionBase, GradientAttribution):
    r"""Grad-SAM: gradient self-attention maps.

    Barkan, Hauon, Caciularu, Katz, Malkiel, Armstrong & Koenigstein, "Grad-SAM:
    Explaining Transformers via Gradient Self-Attention Maps", CIKM 2021
    (https://arxiv.org/abs/2204.11073).

    With A^{lm} the post-softmax attention of layer l and head m and G^{lm} = dS/dA^{lm}
    the gradient of the explained logit S:

    .. math::

        H^{lm} = A^{lm} \odot \mathrm{ReLU}(G^{lm}), \qquad
        r_i = \frac{1}{L \cdot M \cdot N} \sum_l \sum_m \sum_j H^{lm}_{ij}

    where N is the number of real tokens of the sample and the sum over j runs along the
    row of token i's query. One forward and one ``torch.autograd.grad``; the model's
    parameters' ``.grad`` are never written.

    Args:
        forward_func (Callable): returns logits ``(batch, num_classes)``; a Hugging Face
            model (its ``.logits`` is used) or any function of
            ``(inputs, *additional_forward_args)``.
        model (nn.Module, optional): the module holding the attention layers. Default:
            ``forward_func`` when it is a module.
        adapter (AttentionAdapter, optional): how to find the attention. Default: the
            Hugging Face adapter.

    Example::

        >>> model = BertForSequenceClassification(config).eval()
        >>> explainer = GradSAM(model)
        >>> scores = explainer.attribute(input_ids, target=1,
        ...                              additional_forward_args=(attention_mask,))
        >>> scores.shape  # (batch, seq_len); padding tokens score 0
    """

    needs_gradients = True
    readable_name = "Grad-SAM"

    @log_usage(part_of_slo=True)
    def attribute(  # type: ignore[override]
        self,
        inputs: Tensor | tuple[Tensor, ...],
        target: TargetType = None,
        additional_forward_args: Any = None,
        return_maps: bool = False,
    ) -> Any:
        r"""Grad-SAM scores of each token.

        Args:
            inputs (Tensor or 1-tuple of Tensor): token ids ``(batch, seq_len)`` or
                embeddings ``(batch, seq_len, hidden)``, passed to ``forward_func`` first.
            target (int, list, Tensor or None, optional): the class whose logit is
                explained, in Captum's convention: one int for all examples or one per
                example. Default: None, each example's predicted class.
            additional_forward_args (Any, optional): further arguments of
                ``forward_func``, e.g. ``(attention_mask,)``. The padding mask is read from
                the model's own ``attention_mask`` argument. Default: None.
            return_maps (bool, optional): also return the per-layer head-mean maps
                mean_m(H^{lm}), ``(batch, layers, seq_len, seq_len)``. Default: False.

        Returns:
            Tensor (or 1-tuple, like ``inputs``) of float32 scores ``(batch, seq_len)``,
            0 at padding; with ``return_maps``, a pair ``(scores, maps)``.
        """
        is_tuple, tensor = format_inputs(inputs)
        captured = self._capture(tensor, target, additional_forward_args)
        assert captured.attn_grads is not None
        maps = grad_sam_layer_maps(captured.attn_probs, captured.attn_grads, captured.real)
        heads = [probs.shape[1] for probs in captured.attn_probs]
        scores = grad_sam_scores(maps, heads, captured.real)
        return format_scores(is_tuple, scores, maps, return_maps)
