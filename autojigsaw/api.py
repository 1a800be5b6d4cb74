"""The recipe: capture, strategies, costs, solve -> Plan; then rewrite, shard and compile."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from .capture import Captured, capture
from .cost_model.devices import device_spec
from .cost_model.estimate import CostContext, needs_grad
from .mesh import MeshSpec
from .passes.comm_accounting import traffic_by_origin
from .passes.rewrite import RankView, rewrite
from .passes.strategies import annotate
from .placements import Placements, normalize
from .plan import Plan
from .planner import build_problem, solve
from .planner.assemble import assemble
from .planner.errors import infeasible_error


def plan(model: torch.nn.Module, example_inputs: Sequence, mesh, *, device: str = "h100",
         training: bool = True, memory_budget: int | None = None,
         input_placements: Sequence[Placements | None] | None = None,
         output_placements: Sequence[Placements] | None = None,
         example_kwargs: Mapping | None = None) -> Plan:
    """Plan `model` on `mesh` (a DeviceMesh or e.g. {"domain": 8, "tensor": 8}); runs nothing.

    No process group is needed and the model may live on the meta device.
    """
    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}))
    return plan_captured(captured, MeshSpec.of(mesh), device=device, training=training,
                         memory_budget=memory_budget, input_placements=input_placements,
                         output_placements=output_placements)


def plan_captured(captured: Captured, mesh: MeshSpec, *, device, training: bool,
                  memory_budget: int | None, input_placements=None, output_placements=None) -> Plan:
    """The four planning stages on an already captured graph."""
    spec = device_spec(device)
    budget = int(memory_budget if memory_budget is not None else 0.9 * spec.memory_bytes)
    fixed = _fixed_inputs(captured, mesh, input_placements)
    outputs = _output_placements(captured, mesh, output_placements)
    annotate(captured.gm, mesh, fixed, outputs)
    params = set(captured.params)
    problem = build_problem(captured.gm, CostContext(mesh, spec, training), params,
                            needs_grad(captured.gm, params, set()))
    choice = solve(problem, budget)
    if not choice:
        raise infeasible_error(captured, problem, mesh, budget)
    return with_traffic(assemble(captured, problem, choice, mesh, spec.name, training, budget), captured)


def with_traffic(plan: Plan, captured: Captured) -> Plan:
    """The plan with exact bytes per node, read off the graph the plan rewrites into."""
    rank = RankView.planning(plan.mesh)
    gm = rewrite(captured, plan, rank, training=plan.training)
    traffic = traffic_by_origin(gm, rank, set(captured.params), plan.training)
    nodes = tuple(replace(n, comm_bytes=traffic.get(n.name, 0)) for n in plan.nodes)
    return replace(plan, nodes=nodes, comm_bytes=sum(traffic.values()))


def _fixed_inputs(captured: Captured, mesh: MeshSpec, placements) -> dict[str, Placements]:
    if placements is None:
        return {}
    names = captured.inputs
    if len(placements) != len(names):
        raise ValueError(f"input_placements has {len(placements)} entries but the model takes "
                         f"{len(names)} inputs ({names}); give one per input, None to let autojigsaw choose")
    shapes = captured.input_shapes
    fixed = {}
    for name, pl, shape in zip(names, placements, shapes):
        if pl is None:
            continue
        fixed[name] = _checked(pl, mesh, shape, f"input {name!r}")
    return fixed


def _output_placements(captured: Captured, mesh: MeshSpec, placements):
    if placements is None:
        return None
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    vals = [a.meta["val"] for a in out.args[0] if isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor)]
    if len(placements) != len(vals):
        raise ValueError(f"output_placements has {len(placements)} entries but the model returns "
                         f"{len(vals)} tensors; give one per output tensor")
    return [_checked(pl, mesh, v.shape, f"output {i}") for i, (pl, v) in enumerate(zip(placements, vals))]


def _checked(pl: Placements, mesh: MeshSpec, shape, what: str) -> Placements:
    pl = tuple(pl)
    if len(pl) != mesh.ndim:
        raise ValueError(f"{what}: {len(pl)} placements for a mesh of {mesh.ndim} axes "
                         f"({mesh.describe()}); give one placement per mesh axis")
    for p, axis in zip(pl, mesh.axis_names):
        if getattr(p, "dim", None) is not None and not -len(shape) <= p.dim < len(shape):
            raise ValueError(f"{what}: {p} on axis {axis!r} names a dim the tensor of shape "
                             f"{tuple(shape)} does not have")
    return normalize(pl, len(shape))
