"""Activation recomputation: the memory a policy frees and the time it adds, per repeated layer.

A recomputed layer keeps its input and drops what its nodes saved for backward at the end of
its forward; at the start of its backward it runs its forward again, so those activations
come back for the layer's backward only. "full" recomputes every node of the layer (its
collectives too); "selective" keeps matmul and attention outputs and recomputes the rest
(convolutions too: the runtime's save list is torchtitan's), and keeps the outputs of collectives;
"selective-op" is torchtitan's op-level policy itself: as "selective", but every second matrix
product of a layer (the 2nd, 4th, ... aten.mm/addmm in its forward: a Llama layer's k, o and up
projections) is recomputed too. Selective checkpointing's cache holds the kept outputs until the
layer's backward even where no reader saves them (a collective's too: it runs in the layer, before
its reader), and recomputes what a kept op makes inside itself (an attention's float copy of its
boolean mask).
Items are split or extended, not re-derived: the memory model stays the one the solver already trusts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
from torch.fx import Node

from ..modules import layer_of, module_path
from .compute import ATTENTION, CONVS, MATMULS, TRANSPOSED_CONVS, aten, backward_factor
from .liveness import LinearItem, MaxItem, MemoryModel, PairItem

# rewrite/recompute.py's SAVED_OPS, as captured (an einsum dispatches the bmm or mm it is)
SELECTIVE_KEEPS = (MATMULS - CONVS - TRANSPOSED_CONVS) | ATTENTION | {aten.einsum.default}
PRODUCTS = {aten.mm.default, aten.addmm.default}  # what torchtitan's op-level policy counts, as dispatched


@dataclass(frozen=True)
class Layer:
    """One repeated layer: its nodes (indices into the planner's node list), in order."""

    name: str
    nodes: tuple[int, ...]
    boundary: frozenset[int]  # nodes whose output is read after the layer: kept, never recomputed

    @property
    def first(self) -> int:
        return self.nodes[0]

    @property
    def last(self) -> int:
        return self.nodes[-1]


def repeated_layers(nodes: list[Node], params: dict[str, str]) -> list[Layer]:
    """The layers of the model's longest stack of numbered modules (model.layers.0 ... .31)."""
    runs: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        path = module_path(node, params)
        layer = layer_of(path) if path else None
        if layer is not None:
            runs[layer].append(i)
    by_stack: dict[str, list[tuple[int, list[int]]]] = defaultdict(list)
    for (prefix, idx), run in runs.items():
        by_stack[prefix].append((idx, run))
    if not by_stack:
        return []
    prefix, members = max(by_stack.items(), key=lambda kv: len(kv[1]))
    index = {node: i for i, node in enumerate(nodes)}
    layers = []
    for idx, run in sorted(members):
        inside = set(run)
        boundary = frozenset(i for i in run if any(index.get(u, -1) > run[-1] for u in nodes[i].users))
        layers.append(Layer(f"{prefix}.{idx}", tuple(sorted(inside)), boundary))
    return layers


def recomputed_nodes(layer: Layer, nodes: list[Node], policy: str) -> frozenset[int]:
    """The nodes of `layer` whose activations `policy` drops and recomputes."""
    if policy == "none":
        return frozenset()
    keep = set(layer.boundary)
    if policy in ("selective", "selective-op"):
        keep |= {i for i in layer.nodes if nodes[i].target in SELECTIVE_KEEPS}
    if policy == "selective-op":  # torchtitan's count: the 2nd, 4th, ... product of the layer's forward
        products = [i for i in layer.nodes if dispatches_product(nodes[i])]
        keep -= set(products[1::2]) - layer.boundary
    return frozenset(i for i in layer.nodes if i not in keep)


def dispatches_product(node: Node) -> bool:
    """Whether a captured node runs as one 2-D matrix product (aten.mm, or addmm with a bias):
    a linear, or a matmul whose second operand is a matrix (a batched one runs bmm)."""
    if node.target in PRODUCTS or node.target == aten.linear.default:
        return True
    if node.target == aten.matmul.default:
        a, b = (arg.meta.get("val") if isinstance(arg, Node) else None for arg in node.args[:2])
        return a is not None and b is not None and a.dim() >= 2 and b.dim() == 2
    return False


def with_recompute(memory: MemoryModel, layers: list[Layer], dropped: list[frozenset[int]],
                   resaved: frozenset[int]) -> MemoryModel:
    """The memory model with each layer's dropped activations freed between its forward and backward.

    `dropped[j]`: the nodes of layers[j] recomputed; `resaved`: those whose gathered inputs are
    gathered again (full recomputation) rather than kept.
    """
    n = len(memory.names)
    owner_layer = {i: j for j, d in enumerate(dropped) for i in d}
    # copies a kept node makes inside itself (a float mask) are remade with its recomputed layer
    remade = {k: j for k, i in memory.remade_lin.items() for j, d in enumerate(dropped) if d and i in layers[j].nodes}
    gap = {j: (layers[j].last, 2 * n - 1 - layers[j].last) for j in range(len(layers))}

    def split(item, owner: int | None, j: int | None = None):
        j = owner_layer.get(owner) if j is None and owner is not None else j
        if j is None:
            return [item]
        end_fwd, start_bwd = gap[j]
        # a value the layer's last node reads last is saved from just after the layer: dropped whole
        if not (item.start <= end_fwd + 1 and item.end >= start_bwd):
            return [item]
        # checkpoint saves nothing in the layer's forward: a saved value is gone after its last read (its
        # own item), a copy an op makes to save (starting at that op's point) once the op returns
        made = isinstance(item, LinearItem) and item.start == item.node
        return [x for x in (replace_span(item, item.start, item.start if made else item.start - 1),
                            replace_span(item, start_bwd, item.end)) if x.start <= x.end]

    # selective checkpointing caches the outputs of the ops it keeps until the layer's backward
    # recomputes it (and takes them back), whether or not a reader saves them (a saved one is held
    # that long already); recomputation stops once the last tensor saved is back, so the outputs
    # of kept ops from the layer's last saving node on are never taken: the cache holds them
    # through the layer's backward; so are the outputs of collectives, run just before their reader
    savers = {item.node for k, item in enumerate(memory.lin) if k in memory.kept_lin}
    savers |= {m.node for k, item in enumerate(memory.maxes) if k in memory.kept_maxes for m in item.members}
    cached, moves_cached = {}, {}
    for j, d in enumerate(dropped):
        if d and not d <= resaved:
            last_saver = max((i for i in layers[j].nodes if i in savers), default=layers[j].last)
            for i in layers[j].nodes:
                if i not in d:
                    cached[i] = 2 * n - 1 - layers[j].first if i >= last_saver else gap[j][1] - 1
                moves_cached[i] = 2 * n - 1 - layers[j].first if i > last_saver else gap[j][1] - 1

    def held(item, node: int | None):
        end = cached.get(node) if node is not None else None
        return item if end is None else item._replace(end=max(item.end, end))

    lin = [piece for k, item in enumerate(memory.lin)
           for piece in split(held(item, memory.unsaved_lin.get(k)), memory.kept_lin.get(k), remade.get(k))]
    maxes = [piece for k, item in enumerate(memory.maxes) for piece in split(item, memory.kept_maxes.get(k))]
    pairs = [piece for k, item in enumerate(memory.pairs)
             for piece in (split(item, memory.kept_pairs.get(k)) if memory.kept_pairs.get(k) in resaved else [item])]
    # a move that sends nothing (a slice of a whole value: recomputed, not cached) is counted too, as no
    # item tells it from a collective (64 KiB in the Llama of test_training_regime on 100 us links,
    # which slices its embedding for layer 0's residual add)
    pairs += [replace(item, end=moves_cached[item.dst]) for item in memory.unsaved_moves if item.dst in moves_cached]
    # the split model is final: it keeps no record of what could be recomputed again
    return MemoryModel(memory.names, memory.training, memory.vectors, lin, maxes, pairs, _ids=memory._ids)


def replace_span(item, start: int, end: int):
    """The same item over another interval of program points."""
    if isinstance(item, LinearItem):
        return item._replace(start=start, end=end)
    assert isinstance(item, (MaxItem, PairItem))
    return replace(item, start=start, end=end)


def recompute_time(times: list[np.ndarray], nodes: list[Node], dropped: frozenset[int]) -> dict[int, np.ndarray]:
    """The forward time each recomputed node adds, per strategy (a node's time includes its backward)."""
    return {i: times[i] / (1.0 + backward_factor(nodes[i].target)) for i in dropped}
