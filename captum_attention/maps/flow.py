"""Attention Flow (Abnar & Zuidema, ACL 2020, https://arxiv.org/abs/2005.00928).

The layers' rollout matrices Â^l (0.5·fuse_m(Aˡᵐ) + 0.5·I, rows renormalised) are the
capacities of a layered graph: node (l, i) is token i after layer l, and the edge from
(l−1, j) to (l, i) has capacity Â^lᵢⱼ. The flow score of input token j is the maximum
flow from (0, j) to the explained position (L, q), or, for a model read out by attention
pooling, to a sink fed by (L, k) with the pooling row's weight on k. Where rollout
multiplies weights along paths, flow is limited by each path's narrowest edge.

Solved exactly with ``networkx``'s maximum flow, one flow problem per token per example:
the cost grows like T flows over a graph of L·T² edges, practical up to a few dozen
tokens (``benchmarks/flow_cost.py``: 0.18 s per example at 16 tokens, 15 s at 64).
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import Tensor

_SINK = "sink"


def _flow_graph(
    layer_maps: list[Tensor], tokens: list[int], readout: list[float] | None, query: int | None
) -> tuple[nx.DiGraph, object]:
    """The layered graph of one example's real ``tokens`` and its sink node: the top
    layer's ``query``, or a node ``readout`` feeds."""
    graph = nx.DiGraph()
    for layer, layer_map in enumerate(layer_maps, start=1):
        capacities = layer_map[tokens][:, tokens].tolist()
        for row, i in enumerate(tokens):
            for column, j in enumerate(tokens):
                if capacities[row][column] > 0:
                    graph.add_edge((layer - 1, j), (layer, i), capacity=capacities[row][column])
    top = len(layer_maps)
    if readout is None:
        return graph, (top, query)
    for column, k in enumerate(tokens):
        if readout[column] > 0:
            graph.add_edge((top, k), _SINK, capacity=readout[column])
    return graph, _SINK


def attention_flow_scores(
    layer_maps: list[Tensor], real: Tensor, query_index: Tensor, readout: Tensor | None = None
) -> Tensor:
    """Max-flow score of every real input token, ``(B, T)``.

    Args:
        layer_maps: per-layer ``(B, T, T)`` capacities Â^1 .. Â^L in forward order
            (:func:`~captum_attention.maps.rollout_layer_maps`).
        real: ``(B, T)`` bool, the tokens of each example's graph.
        query_index: ``(B,)``, the explained position (the sink at the top layer);
            unused with ``readout``.
        readout: ``(B, T)`` pooling row over the top layer's tokens, used as the
            capacities into the sink instead of the query position; optional.

    Returns:
        ``(B, T)`` float32, 0 outside ``real``.
    """
    scores = torch.zeros(real.shape, dtype=torch.float32)
    maps = [m.detach().double().cpu() for m in layer_maps]
    for b in range(real.shape[0]):
        tokens = real[b].nonzero().flatten().tolist()
        example_readout = None if readout is None else readout[b, tokens].tolist()
        query = int(query_index[b]) if example_readout is None else None
        graph, sink = _flow_graph([m[b] for m in maps], tokens, example_readout, query)
        for j in tokens:
            source = (0, j)
            if source in graph and sink in graph:
                scores[b, j] = nx.maximum_flow_value(graph, source, sink)
    return scores.to(real.device)
