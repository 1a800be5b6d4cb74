"""From the solver's choice to a Plan: placements, per-node costs (exact traffic comes later)."""

from __future__ import annotations

import numpy as np
import torch
from torch.fx import Node

from ..capture import Captured
from ..capture.routed_experts import OP as ROUTED_EXPERTS
from ..cost_model.compute import ATTENTION, MATMULS, NORMS, SOFTMAX
from ..cost_model.allocations import Footprint
from ..cost_model.estimate import CostContext
from ..cost_model.symbolic import name_sizes
from ..ir import output_values, tensor_inputs
from ..modules import module_path
from ..plan import NodeSharding, Plan
from .explain import Explainer
from .milp import Solution
from .problem import Problem

aten = torch.ops.aten
_EMBEDDING = {aten.embedding.default}


def node_kind(node: Node, captured: Captured) -> str:
    """The row class of a node in the plan table."""
    if node.op == "placeholder":
        return "param" if node.name in captured.params else "input"
    if node.op == "output":
        return "output"
    target = node.target
    if target is ROUTED_EXPERTS:  # grouped GEMMs behind a dispatch
        return "matmul"
    for kind, ops in (("matmul", MATMULS), ("attention", ATTENTION), ("softmax", SOFTMAX),
                      ("norm", NORMS), ("embedding", _EMBEDDING)):
        if target in ops:
            return kind
    return "other"


def op_name(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    name = str(node.target)
    return name.removesuffix(".default")


def fixed_solution(problem: Problem, plan: Plan) -> Solution:
    """The costs of the strategies a plan (planned, loaded or edited) names, as if solved."""
    choice = _choice_of(problem, plan)
    peak, point = problem.memory.peak(choice)
    return Solution(choice, problem.objective(choice), peak, point, (), 0, 0.0)


def _choice_of(problem: Problem, plan: Plan) -> np.ndarray:
    by_name = {n.name: n for n in plan.nodes}
    choice = []
    for name, strategies in zip(problem.names, problem.strategies):
        n = by_name.get(name)
        if n is None:
            raise ValueError(f"the plan has no entry for node {name!r}: it was made for another model")
        t = next((t for t, s in enumerate(strategies)
                  if s.inputs == n.inputs and s.outputs == n.outputs and s.kernel == n.kernel), None)
        if t is None:
            raise ValueError(f"node {name!r}: the plan runs it as {n.kernel} with inputs {n.inputs} and outputs "
                             f"{n.outputs}, which no sharding rule offers on this mesh; plan it again")
        choice.append(t)
    return np.array(choice, dtype=np.int64)


def assemble(captured: Captured, problem: Problem, solution: Solution, ctx: CostContext, budget: int | None,
             footprint: Footprint | None = None) -> Plan:
    """A Plan with the chosen strategies, their predicted costs (traffic filled in later) and
    an explainer (Plan.explain) holding the planner's data. `footprint`: the plan's peaks as the
    device's caching allocator holds them (planner/reserved.py), None on a device without one."""
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    choice = solution.choice
    comm_in = np.zeros(len(problem.names))
    for e in problem.edges:
        comm_in[e.dst] += e.costs.time[choice[e.src], choice[e.dst]]
    own = problem.memory.own_bytes([len(s) for s in problem.strategies])
    shardings = []
    for i, name in enumerate(problem.names):
        node, s = nodes[name], problem.strategies[i][choice[i]]
        first = output_values(node)[0] if node.op != "output" else None
        shardings.append(NodeSharding(
            name=name, op=op_name(node), kind=node_kind(node, captured),
            shape=tuple(first.shape) if first is not None else (),
            inputs=s.inputs, outputs=s.outputs, kernel=s.kernel, fallback=s.fallback, note=s.note,
            compute_s=float(problem.time[i][choice[i]]), memory_bytes=int(own[i][choice[i]]),
            comm_s=float(comm_in[i]),
            input_shapes=tuple(tuple(output_values(src)[o].shape) for src, o in tensor_inputs(node)),
            module=module_path(node, captured.params) or "",
        ))
    by_name = {s.name: s for s in shardings}
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    nodes_in_order = [nodes[name] for name in problem.names]
    sizes = name_sizes(captured.input_values, [nodes[ph].meta["val"] for ph in captured.params], ctx.mesh)
    return Plan(
        mesh=ctx.mesh, device=ctx.device.name, training=ctx.training, nodes=tuple(shardings),
        param_placements={fqn: by_name[ph].output for ph, fqn in captured.params.items()},
        input_placements=tuple(by_name[ph].output for ph in captured.inputs),
        output_placements=by_name[out_node.name].inputs,
        memory_per_rank=footprint.reserved if footprint else int(round(solution.peak_memory)), comm_bytes=0,
        step_time=float(solution.objective), memory_budget=budget,
        peak_at=problem.memory.describe(footprint.point if footprint else solution.peak_point),
        memory_allocated=footprint.allocated if footprint else None,
        explainer=Explainer(nodes_in_order, problem, solution, ctx, sizes, budget, problem.grad),
    )
