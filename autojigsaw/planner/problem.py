"""The planning problem as plain arrays: strategies, their costs, edges, memory, tied groups.

One entry per graph node (topological order). Costs are computed once per distinct
pattern (op, shapes, strategies), so repeated layers cost one layer's work; `group` maps
nodes of repeated layers onto shared variables (planner/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.fx import GraphModule, Node

from ..cost_model.estimate import CostContext, EdgeCosts, consumer_partial_axes, edge_costs, node_costs
from ..cost_model.liveness import MemoryModel
from ..cost_model.step_memory import build_memory
from ..ir import STRATEGIES, Strategy, output_values, tensor_inputs
from ..modules import data_sums
from .layers import tie_groups


@dataclass(frozen=True)
class Edge:
    """Producer output -> consumer input `input`; costs[s, t] for producer s, consumer t."""

    src: int
    dst: int
    input: int
    costs: EdgeCosts


@dataclass
class Problem:
    """Nodes with their strategies and per-strategy time, edges, the memory model and groups."""

    names: list[str]
    strategies: list[list[Strategy]]
    time: list[np.ndarray]  # seconds per strategy (compute; collectives inside kernels)
    edges: list[Edge]
    memory: MemoryModel
    group: np.ndarray  # node -> variable group; nodes of one group take the same strategy
    grad: dict[str, bool]  # node name -> whether its output receives a gradient

    @property
    def n_nodes(self) -> int:
        return len(self.names)

    @property
    def n_groups(self) -> int:
        return int(self.group.max()) + 1 if len(self.group) else 0

    @property
    def n_binaries(self) -> int:
        """Variables of the solve: the strategies of one node per group."""
        reps = np.unique(self.group, return_index=True)[1]
        return int(sum(len(self.strategies[r]) for r in reps))

    def expand(self, group_choice) -> np.ndarray:
        """One strategy index per node from one per group."""
        return np.asarray(group_choice, dtype=np.int64)[self.group]

    def compute_time(self, choice) -> float:
        return float(sum(self.time[n][s] for n, s in enumerate(choice)))

    def comm_time(self, choice) -> float:
        return float(sum(e.costs.time[choice[e.src], choice[e.dst]] for e in self.edges))

    def comm_bytes(self, choice) -> int:
        """Bytes each rank sends to reshard, by the planner's model (the plan's count is exact)."""
        return int(sum(e.costs.bytes[choice[e.src], choice[e.dst]] for e in self.edges))

    def objective(self, choice) -> float:
        """Predicted step time of one choice of strategy per node."""
        return self.compute_time(choice) + self.comm_time(choice)

    def peak_memory(self, choice) -> float:
        return self.memory.peak(np.asarray(choice))[0]


TIE_ABOVE = 4096  # binaries: smaller problems are solved exactly without tying layers


def build_problem(gm: GraphModule, ctx: CostContext, params: dict[str, str], grad: dict[str, bool], *,
                  persistent: set[str], tie_layers: bool | None = None) -> Problem:
    """Costs of every strategy of every node of an annotated graph (strategies.annotate).

    `params`: parameter placeholders -> FQN; `persistent`: placeholders live for the whole step
    (parameters and buffers); `tie_layers`: give repeated layers one shared strategy (None:
    when the problem has more than TIE_ABOVE binaries; smaller ones are solved node by node,
    which is exact even when a memory budget makes mixed layers pay).
    """
    nodes = [n for n in gm.graph.nodes if STRATEGIES in n.meta]
    index = {n: i for i, n in enumerate(nodes)}
    strategies = [n.meta[STRATEGIES] for n in nodes]
    times, kernel_saved = [], {}
    cache: dict[tuple, object] = {}
    for i, node in enumerate(nodes):
        operand_grads = tuple(grad.get(src.name, False) for src, _ in tensor_inputs(node))
        key = (id(strategies[i]), str(node.target), _shapes(node), grad[node.name], node.name in params, operand_grads)
        if key not in cache:
            cache[key] = node_costs(node, strategies[i], ctx, grad[node.name], node.name in params, operand_grads)
        costs = cache[key]
        times.append(costs.time)
        if costs.kernel_saved is not None:
            kernel_saved[i] = costs.kernel_saved
    edges = []
    for node in nodes:
        dst = strategies[index[node]]
        for k, (src, o) in enumerate(tensor_inputs(node)):
            val = output_values(src)[o]
            # the data axis sums these gradients outside the graph (not a scalar's under FSDP, nor routed experts')
            summed = ctx.summed_axis if src.name in params and data_sums(src, fsdp=ctx.regime.fsdp) else None
            key = (id(strategies[index[src]]), o, id(dst), k, grad[src.name], tuple(val.shape), val.dtype,
                   src.name in params, summed)
            if key not in cache:
                cache[key] = edge_costs(val, _outputs(strategies[index[src]], o),
                                        tuple(s.inputs[k] for s in dst),
                                        tuple(_without(consumer_partial_axes(s, k), summed) for s in dst),
                                        grad[src.name], ctx)
            edges.append(Edge(index[src], index[node], k, cache[key]))
    memory = build_memory(nodes, strategies, ctx.mesh.sizes, training=ctx.training, grad=grad,
                          persistent=persistent, optimizer=ctx.optimizer, kernel_saved=kernel_saved,
                          param_memory=ctx.param_memory, params=params)
    if tie_layers is None:
        tie_layers = sum(len(s) for s in strategies) > TIE_ABOVE
    group = tie_groups(nodes, strategies, params) if tie_layers else np.arange(len(nodes))
    return Problem([n.name for n in nodes], strategies, times, edges, memory, group, grad)


def _without(partial: tuple[bool, ...], axis: int | None) -> tuple[bool, ...]:
    return partial if axis is None else tuple(p and a != axis for a, p in enumerate(partial))


def _outputs(strategies: list[Strategy], o: int) -> tuple:
    return tuple(s.outputs[o] for s in strategies)


def _shapes(node: Node) -> tuple:
    def shape(v):
        return (tuple(v.shape), v.dtype) if v is not None else None

    ins = tuple(shape(output_values(src)[o]) for src, o in tensor_inputs(node))
    return ins, tuple(shape(v) for v in output_values(node))
