"""The planning problem as plain arrays: strategies, their costs, and edge resharding costs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.fx import GraphModule

from ..cost_model.estimate import CostContext, consumer_partial_axes, edge_cost, node_cost
from ..passes.meta import STRATEGIES
from ..passes.strategies import Strategy, output_values, tensor_inputs


@dataclass
class Edge:
    """Producer output -> consumer input; cost[s, t] for producer strategy s, consumer t."""

    src: int
    dst: int
    cost: np.ndarray


@dataclass
class Problem:
    """Nodes in topological order with their strategies and costs; edges between them."""

    names: list[str]
    strategies: list[list[Strategy]]
    time: list[np.ndarray]  # seconds per strategy
    memory: list[np.ndarray]  # bytes per rank per strategy
    edges: list[Edge]

    def objective(self, choice: list[int]) -> float:
        """Predicted step time of one choice of strategy per node."""
        t = sum(self.time[n][s] for n, s in enumerate(choice))
        return t + sum(e.cost[choice[e.src], choice[e.dst]] for e in self.edges)

    def peak_memory(self, choice: list[int]) -> float:
        return sum(self.memory[n][s] for n, s in enumerate(choice))


def build_problem(gm: GraphModule, ctx: CostContext, params: set[str], grad: dict[str, bool]) -> Problem:
    """Costs of every strategy of every node of an annotated graph (passes/strategies.annotate)."""
    nodes = [n for n in gm.graph.nodes if STRATEGIES in n.meta]
    index = {n.name: i for i, n in enumerate(nodes)}
    problem = Problem([n.name for n in nodes], [], [], [], [])
    for node in nodes:
        strategies = node.meta[STRATEGIES]
        costs = [node_cost(node, s, ctx, grad[node.name], node.name in params) for s in strategies]
        problem.strategies.append(strategies)
        problem.time.append(np.array([c[0] for c in costs], dtype=float))
        problem.memory.append(np.array([c[1] for c in costs], dtype=float))
        for k, (src, i) in enumerate(tensor_inputs(node)):
            val = output_values(src)[i]
            src_strategies = src.meta[STRATEGIES]
            cost = np.zeros((len(src_strategies), len(strategies)))
            for t, s_dst in enumerate(strategies):
                partial = consumer_partial_axes(s_dst, k)
                for s, s_src in enumerate(src_strategies):
                    cost[s, t] = edge_cost(val.shape, val.dtype, s_src.outputs[i], s_dst.inputs[k],
                                           partial, grad[src.name], ctx)
            problem.edges.append(Edge(index[src.name], index[node.name], cost))
    return problem
