"""The recipe: capture -> strategies -> costs -> solve -> Plan; then rewrite -> materialize -> compile.

`plan` runs the first half on any mesh without a process group; `parallelize` runs all of it on
each rank (at the first call when no example inputs are given) and hands the result to a
ParallelModule, which only holds and runs it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from .capture import Captured, capture
from .cost_model.devices import DeviceSpec, device_spec
from .cost_model.estimate import CostContext
from .cost_model.memory import Optimizer, optimizer_spec
from .dtypes import value_carries_grad
from .ir import grads_by_name
from .mesh import MeshSpec, RankView
from .placements import Placements, normalize
from .plan import Plan, PlanStats
from .planner import build_problem, solve
from .planner.assemble import assemble, fixed_solution
from .planner.errors import infeasible_error
from .rewrite.rewrite import rewrite
from .rewrite.traffic import traffic_by_origin
from .runtime.checks import check_group, check_plan, device_of
from .runtime.materialize import materialize_model
from .runtime.module import ParallelModule, Program
from .strategies.annotate import annotate
from .strategies.data_pins import data_pins


@dataclass(frozen=True)
class Options:
    """The planning options `plan` and `parallelize` take, in one place."""

    device: str | DeviceSpec = "h100"  # a spec name ("h100", "cpu", ...) or a spec (autojigsaw.calibrate)
    training: bool = True
    memory_budget: int | None = None  # bytes per rank; None: 90 % of the device's memory
    optimizer: str | Optimizer = "adam"
    input_placements: Sequence[Placements | None] | None = None  # None: autojigsaw chooses
    output_placements: Sequence[Placements] | None = None
    tie_layers: bool | None = None  # one strategy per node of repeated layers; None: for big problems


def plan(model: torch.nn.Module, example_inputs: Sequence, mesh, *, device: str | DeviceSpec = "h100",
         training: bool = True, memory_budget: int | None = None, optimizer: str | Optimizer = "adam",
         input_placements: Sequence[Placements | None] | None = None,
         output_placements: Sequence[Placements] | None = None,
         example_kwargs: Mapping | None = None, tie_layers: bool | None = None) -> Plan:
    """Plan `model` on `mesh` (a DeviceMesh or e.g. {"domain": 8, "tensor": 8}); runs nothing.

    No process group is needed and the model may live on the meta device. `device` names a
    spec ("h100", "cpu", ...) or is one (autojigsaw.calibrate); the budget defaults to 90 % of
    its memory. `tie_layers` gives repeated layers one shared strategy per node (None: for
    big problems only; smaller ones get the exact optimum over every node's choice).
    """
    options = Options(device, training, memory_budget, optimizer, input_placements, output_placements, tie_layers)
    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}))
    return plan_captured(captured, MeshSpec.of(mesh), options)


def parallelize(model: torch.nn.Module, mesh, example_inputs: Sequence | None = None, *, compile: bool = True,
                training: bool = True, memory_budget: int | None = None, device: str | DeviceSpec | None = None,
                input_placements: Sequence[Placements | None] | None = None,
                output_placements: Sequence[Placements] | None = None, example_kwargs: Mapping | None = None,
                plan: Plan | None = None) -> ParallelModule:
    """Shard `model` over `mesh` (a named DeviceMesh) by a plan; returns the module to train.

    With example_inputs=None the model is planned at its first call, like torch.compile.
    """
    options = Options(device or device_of(mesh), training, memory_budget,
                      input_placements=input_placements, output_placements=output_placements)
    build = functools.partial(_program, device_mesh=mesh, plan=plan, options=options, compile=compile)
    module = ParallelModule(model, mesh, build, plan=plan, local_inputs=input_placements is not None)
    if example_inputs is not None:
        module.build(tuple(example_inputs), dict(example_kwargs or {}))
    return module


def _program(model: torch.nn.Module, args: tuple, kwargs: dict, *, device_mesh, plan: Plan | None,
             options: Options, compile: bool) -> Program:
    """One rank's program: capture, plan (unless given), materialize its shards, rewrite, compile."""
    mesh = MeshSpec.of(device_mesh)
    check_group(device_mesh, mesh)
    captured = capture(model, args, kwargs)
    plan = plan if plan is not None else plan_captured(captured, mesh, options)
    check_plan(plan, mesh)
    rank = RankView.of(device_mesh, mesh)
    materialize_model(model, plan.param_placements, device_mesh, rank.coord)
    # Inputs that do not require grad skip these gradient collectives at run time.
    differentiable = frozenset(n for n, v in zip(captured.inputs, captured.input_values) if value_carries_grad(v))
    gm = rewrite(captured, plan, rank, training=options.training, inputs_with_grad=differentiable)
    return Program(captured, plan, rank, gm, torch.compile(gm, fullgraph=True) if compile else gm)


def plan_captured(captured: Captured, mesh: MeshSpec, options: Options = Options()) -> Plan:
    """The planning stages on an already captured graph: strategies, costs, solve, Plan."""
    spec = device_spec(options.device)
    budget = int(options.memory_budget if options.memory_budget is not None else 0.9 * spec.memory_bytes)
    t0 = time.perf_counter()
    annotate(captured.gm, mesh, data_pins(captured, mesh, _fixed_inputs(captured, mesh, options.input_placements)),
             _output_placements(captured, mesh, options.output_placements))
    t1 = time.perf_counter()
    ctx = CostContext(mesh, spec, options.training, optimizer_spec(options.optimizer))
    problem = _problem(captured, ctx, options.tie_layers)
    t2 = time.perf_counter()
    solution = solve(problem, budget)
    if solution is None:
        raise infeasible_error(captured, problem, mesh, budget)
    t3 = time.perf_counter()
    planned = with_traffic(assemble(captured, problem, solution, ctx, budget), captured)
    return replace(planned, stats=PlanStats(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, problem.n_nodes,
                                            problem.n_groups, problem.n_binaries, solution.solves,
                                            len(solution.cuts), solution.gap))


def evaluate(plan: Plan, model: torch.nn.Module, example_inputs: Sequence, *, device: str | DeviceSpec,
             optimizer: str | Optimizer = "adam", example_kwargs: Mapping | None = None) -> Plan:
    """`plan` (planned, loaded or edited) with its costs predicted on `device`, to compare plans."""
    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}))
    fixed = {name: pl for name, pl in zip(captured.inputs, plan.input_placements) if pl is not None}
    annotate(captured.gm, plan.mesh, fixed, plan.output_placements)
    ctx = CostContext(plan.mesh, device_spec(device), plan.training, optimizer_spec(optimizer))
    problem = _problem(captured, ctx, tie_layers=False)
    return with_traffic(assemble(captured, problem, fixed_solution(problem, plan), ctx, plan.memory_budget),
                        captured)


def with_traffic(plan: Plan, captured: Captured) -> Plan:
    """The plan with exact bytes per node, read off the graph the plan rewrites into."""
    rank = RankView.planning(plan.mesh)
    gm = rewrite(captured, plan, rank, training=plan.training)
    traffic = traffic_by_origin(gm, rank, set(captured.params), plan.training)
    nodes = tuple(replace(n, comm_bytes=traffic.get(n.name, 0)) for n in plan.nodes)
    return replace(plan, nodes=nodes, comm_bytes=sum(traffic.values()))


def _problem(captured: Captured, ctx: CostContext, tie_layers: bool | None):
    """The costs of every strategy of the annotated graph; parameters and buffers live throughout."""
    grad = grads_by_name(captured.gm, set(captured.params))
    return build_problem(captured.gm, ctx, captured.params, grad, tie_layers=tie_layers,
                         persistent=set(captured.params) | set(captured.buffers))


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
