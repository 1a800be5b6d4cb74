"""Repeated layers: nodes at the same place in identical layers share one planning variable.

A model's repeated blocks (`model.layers.0` ... `model.layers.31`) export as repeated runs
of nodes. Layers whose runs match node for node (same op, shapes, strategies and wiring
inside the layer) form a class; the k-th node of every layer in a class is then one group,
which the solver gives one strategy. That is the plan a person writes (every layer alike),
and it makes the problem as small as one layer of each class.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch.fx import Node

from ..ir import Strategy, output_values, tensor_inputs
from ..modules import layer_of, module_path

def tie_groups(nodes: list[Node], strategies: list[list[Strategy]], params: dict[str, str]) -> np.ndarray:
    """Group id per node: tied nodes of repeated layers share one, every other node has its own."""
    runs: dict[tuple[str, int], list[int]] = defaultdict(list)
    outside = []
    for i, node in enumerate(nodes):
        path = module_path(node, params)
        layer = layer_of(path) if path else None
        if layer is not None:
            runs[layer].append(i)
        elif node.op == "call_function":
            outside.append(i)
    _absorb_between(runs, outside)
    group = np.arange(len(nodes))
    classes: dict[tuple, list[list[int]]] = defaultdict(list)
    for (prefix, _), run in runs.items():
        classes[(prefix, _signature(run, nodes, strategies))].append(run)
    for members in classes.values():
        first = members[0]
        for run in members[1:]:
            group[run] = first
    _, compact = np.unique(group, return_inverse=True)
    return compact.ravel()


def _absorb_between(runs: dict[tuple[str, int], list[int]], outside: list[int]) -> None:
    """Nodes of no layer between layers k and k+1 (`x = relu(block(x))`) open layer k+1's run.
    Runs may interleave: a layer whose compute export dropped (an auxiliary head's, unused without
    labels) keeps only its parameters, which come before the previous layer's compute."""
    ordered = sorted(runs, key=lambda key: min(runs[key]))
    for before, after in zip(ordered, ordered[1:]):
        last = max(runs[before])
        later = [i for i in runs[after] if i > last]
        if before[0] != after[0] or not later:
            continue
        between = [i for i in outside if last < i < min(later)]
        runs[after] = sorted(between + runs[after])


def _signature(run: list[int], nodes: list[Node], strategies: list[list[Strategy]]) -> tuple:
    position = {nodes[i]: p for p, i in enumerate(run)}
    sig = []
    for i in run:
        node = nodes[i]
        shapes = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                       for v in output_values(node))
        wiring = tuple((position.get(src), o) for src, o in tensor_inputs(node))
        target = str(node.target) if node.op == "call_function" else node.op
        sig.append((target, shapes, wiring, tuple(strategies[i])))
    return tuple(sig)
