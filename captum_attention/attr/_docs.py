"""The Args and Returns texts every ``attribute()`` shares, written once."""

from __future__ import annotations

import string
from typing import Any, Callable, TypeVar

# The Args and Returns texts every attribute() shares (continuation lines keep the
# docstring indentation they are pasted into).
_SHARED_ATTRIBUTE_DOCS = {
    "inputs": (
        'inputs (Tensor or tuple of Tensor): token ids ``(batch, seq_len)``,\n'
        '                embeddings ``(batch, seq_len, hidden)`` or images ``(batch, channels,\n'
        '                height, width)``, passed to ``forward_func`` first; for an encoder-decoder,\n'
        '                the pair ``(input_ids, decoder_input_ids)``.'
    ),
    "target": (
        'target (int, tuple, list, Tensor or None, optional): the class (or, for a language\n'
        '                model, the token id) whose logit is explained, one for all examples or\n'
        '                a list of one per example; for logits at every position, a tuple\n'
        "                ``(position, class)`` as Captum reads it (a list of them, one per example),\n"
        '                the position then the explained query. Default: None, the predicted one.'
    ),
    "target_ignored": (
        'target (Any, optional): accepted for a drop-in Captum call and ignored, but\n'
        "                for a ``(position, class)`` tuple's position, the explained query.\n"
        '                Default: None.'
    ),
    "additional_forward_args": (
        'additional_forward_args (Any, optional): further arguments of\n'
        '                ``forward_func``, e.g. ``(attention_mask,)``. Default: None.'
    ),
    "query_index": (
        'query_index (int, sequence/Tensor of int, or float Tensor, optional): the explained\n'
        '                position (the query row), one for all examples or one per example; for a\n'
        '                language model also where its logits are read. Default: None, the first\n'
        "                real token ([CLS], a ViT's class token) for bidirectional attention, the\n"
        '                last real token for decoders (causal attention) and encoder-decoders; for\n'
        '                a classifier that reads several rows (BEiT, CLIP, SigLIP, Swin, ModernBERT\n'
        '                with ``classifier_pooling="mean"``: their mean; DeiT with its teacher,\n'
        '                DINOv2) those rows, weighted as it reads them; none for a bidirectional\n'
        "                model with logits at every position (a masked language model's [MASK], a\n"
        "                token classifier's tag): pass it. Where another bidirectional model's\n"
        "                output reads several rows (a pooling in forward_func, a sentence\n"
        "                embedding's mean), the methods that read a row refuse the default.\n"
        '                A float ``(batch, seq_len)`` tensor weighs the rows instead: the methods that\n'
        '                read a query row read the weighted sum of rows (as a span does; Grad-SAM\n'
        "                reads no row; Attention Flow's sink is fed by them), e.g. mask /\n"
        "                mask.sum(dim=1, keepdim=True) for a mean, or a language model's image-token\n"
        '                scores carried into its vision tower (docs/families.rst).'
    ),
    "returns": (
        'Returns:\n'
        "            float32 scores shaped like Captum's output for ``inputs``: ``(batch, seq_len)``\n"
        '            for tokens, 0 at padding (and, for decoders, after the query); ``(batch, rows,\n'
        '            columns)`` on the patch grid for images (class/distillation tokens dropped);\n'
        '            for an encoder-decoder the pair ``(source scores (batch, source_len), target\n'
        '            scores (batch, target_len))``. With ``return_maps``, a pair ``(scores, maps)``:\n'
        '            ``(batch, layers, seq_len, seq_len)``, or a dict of those per role\n'
        '            (``"encoder"``, ``"decoder"``, ``"cross"``) for an encoder-decoder.'
    ),
}

_CONSTRUCTOR_DOCS = {
    "constructor_args": (
        'forward_func (Callable): returns logits ``(batch, num_classes)`` (a language\n'
        '            model\'s ``(batch, seq_len, vocab)``), or one score per example ``(batch,)``,\n'
        '            explained with ``target=None`` as in Captum; a Hugging Face model (its\n'
        '            ``.logits`` is used) or any function of ``(inputs, *additional_forward_args)``.\n'
        '        model (nn.Module, optional): the module holding the attention layers. Default:\n'
        '            ``forward_func`` when it is a module.\n'
        '        adapter (AttentionAdapter, optional): how to find the attention (and, for\n'
        '            AttnLRP, the input embeddings). Default: the built-in adapter of the model\'s\n'
        '            family (Hugging Face models, ``nn.MultiheadAttention``).\n'
        '        capture (str, optional): ``"streaming"``: the model keeps its own attention\n'
        '            kernel and the method recomputes the rows it needs block by block (no\n'
        '            ``(heads, N, N)`` tensor is alive); ``"eager"``: the model computes explicit\n'
        '            probabilities, which are read; ``"auto"``: streaming wherever it is exact,\n'
        '            else eager (``last_capture`` then says why). Default: ``"auto"``.\n'
        '        block_memory (int, optional): bytes one block of recomputed attention rows\n'
        '            may take under streaming capture. Default: None, sized from the call (16-64\n'
        '            MiB on a CPU, at least 256 MiB on a GPU).'
    ),
}
"""The constructor's Args every attribution class shares (``$constructor_args``)."""

AttributeMethod = TypeVar("AttributeMethod", bound=Callable[..., Any])


def shared_class_docs(doc: str | None) -> str:
    """A class docstring with its ``$constructor_args`` filled."""
    return string.Template(doc or "").safe_substitute(_CONSTRUCTOR_DOCS)


def shared_attribute_docs(method: AttributeMethod) -> AttributeMethod:
    """Fill the ``$inputs``, ``$target``, ``$target_ignored``, ``$additional_forward_args``,
    ``$query_index`` and ``$returns`` lines of an ``attribute`` docstring with the texts the
    four methods share, so that each is written once."""
    method.__doc__ = string.Template(method.__doc__ or "").substitute(_SHARED_ATTRIBUTE_DOCS)
    return method
