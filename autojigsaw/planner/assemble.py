"""From the solver's choice to a Plan: placements, per-node costs, exact traffic."""

from __future__ import annotations

import torch
from torch.fx import Node

from ..capture import Captured
from ..cost_model.compute import ATTENTION, MATMULS
from ..mesh import MeshSpec
from ..passes.strategies import output_values
from ..plan import NodeSharding, Plan
from .problem import Problem

aten = torch.ops.aten
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
_NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default,
          aten._fused_rms_norm.default, aten.group_norm.default}
_EMBEDDING = {aten.embedding.default}


def node_kind(node: Node, captured: Captured) -> str:
    """The row class of a node in the plan table."""
    if node.op == "placeholder":
        return "param" if node.name in captured.params else "input"
    if node.op == "output":
        return "output"
    target = node.target
    for kind, ops in (("matmul", MATMULS), ("attention", ATTENTION), ("softmax", _SOFTMAX),
                      ("norm", _NORMS), ("embedding", _EMBEDDING)):
        if target in ops:
            return kind
    return "other"


def op_name(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    name = str(node.target)
    return name.removesuffix(".default")


def assemble(captured: Captured, problem: Problem, choice: list[int], mesh: MeshSpec, device: str,
             training: bool, budget: int | None) -> Plan:
    """A Plan with the chosen strategies and their predicted costs (traffic filled in later)."""
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    shardings = []
    for i, name in enumerate(problem.names):
        node, s = nodes[name], problem.strategies[i][choice[i]]
        first = output_values(node)[0] if node.op != "output" else None
        shardings.append(NodeSharding(
            name=name, op=op_name(node), kind=node_kind(node, captured),
            shape=tuple(first.shape) if first is not None else (),
            inputs=s.inputs, outputs=s.outputs, kernel=s.kernel, fallback=s.fallback, note=s.note,
            compute_s=float(problem.time[i][choice[i]]),
            memory_bytes=int(problem.memory[i][choice[i]]),
        ))
    by_name = {s.name: s for s in shardings}
    out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
    return Plan(
        mesh=mesh, device=device, training=training, nodes=tuple(shardings),
        param_placements={fqn: by_name[ph].output for ph, fqn in captured.params.items()},
        input_placements=tuple(by_name[ph].output for ph in captured.inputs),
        output_placements=by_name[out_node.name].inputs,
        memory_per_rank=int(problem.peak_memory(choice)), comm_bytes=0,
        step_time=float(problem.objective(choice)), memory_budget=budget,
    )

