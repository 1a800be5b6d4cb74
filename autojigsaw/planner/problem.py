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
from ..cost_model.memory import is_view
from ..cost_model.step_memory import build_memory
from ..ir import STRATEGIES, Strategy, output_values, tensor_inputs
from ..modules import data_sums, fsdp_shards
from ..training import splits_data
from .layers import tie_groups


@dataclass(frozen=True)
class Edge:
    """Producer output -> consumer input `input`; costs[s, t] for producer s, consumer t."""

    src: int
    dst: int
    input: int
    costs: EdgeCosts


@dataclass(frozen=True)
class DataTraffic:
    """FSDP's traffic per weight and strategy (seconds, not in Problem.time), and what of it a step exposes:
    each of `layers` layers' gathers is prefetched during the layer before, so the first layer's is exposed,
    and all that outlasts the compute it hides behind (`compute`: the nodes whose time that is, all but the
    weights'); the hidden rest slows that compute by `slowdown` (the device's overlap_slowdown)."""

    time: dict[int, np.ndarray]  # weight node -> seconds per strategy
    compute: np.ndarray  # node indices
    layers: int
    slowdown: float

    def seconds(self, traffic: float, compute: float) -> float:
        """What `traffic` seconds of it add to a step of `compute` seconds."""
        exposed = max(traffic / self.layers, traffic - compute)
        return exposed + self.slowdown * (traffic - exposed)


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
    data: DataTraffic | None = None  # FSDP's traffic, where the problem prices what a step exposes

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

    def data_time(self, choice) -> float:
        """What FSDP's traffic adds to the step (DataTraffic)."""
        if self.data is None:
            return 0.0
        traffic = sum(float(t[choice[n]]) for n, t in self.data.time.items())
        return self.data.seconds(traffic, float(sum(self.time[n][choice[n]] for n in self.data.compute)))

    def objective(self, choice) -> float:
        """Predicted step time of one choice of strategy per node."""
        return self.compute_time(choice) + self.comm_time(choice) + self.data_time(choice)

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
    times, kernel_saved, data_s = [], {}, {}
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
        if costs.data_s is not None and costs.data_s.any():
            data_s[i] = costs.data_s
    edges = []
    weights = _weights(nodes, params)
    for node in nodes:
        for k, (src, o) in enumerate(tensor_inputs(node)):
            weight = weights.get(src)
            key = (id(strategies[index[src]]), o, id(strategies[index[node]]), k, grad[src.name],
                   tuple(output_values(src)[o].shape), output_values(src)[o].dtype,
                   weight is not None, weight is not None and fsdp_shards(weight))
            if key not in cache:
                cache[key] = _edge(src, o, strategies[index[src]], node, k, strategies[index[node]], ctx,
                                   grad[src.name], weight)
            edges.append(Edge(index[src], index[node], k, cache[key]))
    memory = build_memory(nodes, strategies, ctx.mesh.sizes, training=ctx.training, grad=grad,
                          persistent=persistent, optimizer=ctx.optimizer, kernel_saved=kernel_saved,
                          param_memory=ctx.param_memory, params=params, batch_slices=ctx.regime.batch_slices,
                          whole_inputs=ctx.regime.whole_inputs, input_widen=ctx.regime.precision.input_widen)
    if tie_layers is None:
        tie_layers = sum(len(s) for s in strategies) > TIE_ABOVE
    group = tie_groups(nodes, strategies, params) if tie_layers else np.arange(len(nodes))
    data = None
    if data_s:
        compute = np.array([i for i, n in enumerate(nodes) if n.name not in params], dtype=np.int64)
        data = DataTraffic(data_s, compute, ctx.fsdp_layers, ctx.device.overlap_slowdown)
    return Problem([n.name for n in nodes], strategies, times, edges, memory, group, grad, data)


def _without(partial: tuple[bool, ...], axis: int | None) -> tuple[bool, ...]:
    return partial if axis is None else tuple(p and a != axis for a, p in enumerate(partial))


def _weights(nodes: list[Node], params: dict[str, str]) -> dict[Node, Node]:
    """Node -> the parameter placeholder it is, or views (a transposed read of a weight)."""
    weights: dict[Node, Node] = {}
    for node in nodes:
        if node.name in params:
            weights[node] = node
        elif is_view(node) and tensor_inputs(node) and tensor_inputs(node)[0][0] in weights:
            weights[node] = weights[tensor_inputs(node)[0][0]]
    return weights


def _edge(src: Node, o: int, produced: list[Strategy], node: Node, k: int, consumed: list[Strategy],
          ctx: CostContext, grad: bool, weight: Node | None) -> EdgeCosts:
    """Costs of output `o` of `src` read as input `k` of `node`. The data axis sums a weight's gradient outside
    the graph (`weight`: the parameter `src` is or views; not a scalar's under FSDP, nor a weight's the
    producer's strategy splits over the data axis: routed experts dispatched there), so the consumer's
    partial sum over that axis costs nothing here."""
    val = output_values(src)[o]
    outputs = _outputs(produced, o)

    def costs(split: bool) -> EdgeCosts:
        sums = weight is not None and data_sums(weight, fsdp=ctx.regime.fsdp, split=split)
        summed = ctx.summed_axis if sums else None
        return edge_costs(val, outputs, tuple(s.inputs[k] for s in consumed),
                          tuple(_without(consumer_partial_axes(s, k), summed) for s in consumed), grad, ctx)

    split = np.array([weight is not None and p is not None and splits_data(p, ctx.mesh) for p in outputs])
    if not split.any():
        return costs(False)
    if split.all():
        return costs(True)
    whole, apart = costs(False), costs(True)
    return EdgeCosts(np.where(split[:, None], apart.time, whole.time),
                     np.where(split[:, None], apart.bytes, whole.bytes))


def _outputs(strategies: list[Strategy], o: int) -> tuple:
    return tuple(s.outputs[o] for s in strategies)


def _shapes(node: Node) -> tuple:
    def shape(v):
        return (tuple(v.shape), v.dtype) if v is not None else None

    ins = tuple(shape(output_values(src)[o]) for src, o in tensor_inputs(node))
    return ins, tuple(shape(v) for v in output_values(node))
