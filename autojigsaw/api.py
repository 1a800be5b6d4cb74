"""The recipe: capture, strategies, costs, solve -> Plan; then rewrite, shard and compile."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from .capture import Captured, capture
from .cost_model.devices import DeviceSpec, device_spec
from .cost_model.estimate import CostContext
from .cost_model.recompute import repeated_layers
from .passes.grad_kinds import grads_by_name
from .cost_model.memory import Optimizer, optimizer_spec
from .mesh import MeshSpec
from .passes.comm_accounting import traffic_by_origin
from .passes.rewrite import RankView, rewrite
from .passes.strategies import annotate
from .placements import Placements, local_shape, normalize
from .plan import Plan, PlanStats
from .training import Precision, Regime
from .planner import build_problem, solve
from .planner.assemble import assemble, fixed_solution
from .planner.errors import infeasible_error
from .planner.recompute import solve_with_recompute, with_layers_recomputed
from .runtime.data_parallel import data_pins


def plan(model: torch.nn.Module, example_inputs: Sequence, mesh, *, device: str | DeviceSpec = "h100",
         training: bool = True, memory_budget: int | None = None, optimizer: str | Optimizer = "adam",
         input_placements: Sequence[Placements | None] | None = None,
         output_placements: Sequence[Placements] | None = None,
         example_kwargs: Mapping | None = None, tie_layers: bool | None = None,
         mp_policy=None, activation_checkpointing: str = "none", data_parallel: str | None = None) -> Plan:
    """Plan `model` on `mesh` (a DeviceMesh or e.g. {"domain": 8, "tensor": 8}); runs nothing.

    No process group is needed and the model may live on the meta device. `device` names a
    spec ("h100", "cpu", ...) or is one (autojigsaw.calibrate); the budget defaults to 90 % of
    its memory. `tie_layers` gives repeated layers one shared strategy per node (None: for
    big problems only; smaller ones get the exact optimum over every node's choice).
    `mp_policy`: torch.distributed.fsdp.MixedPrecisionPolicy (compute in param_dtype, fp32
    masters, gradient sums in reduce_dtype); `activation_checkpointing`: "none", "selective",
    "full" or "auto" (the planner chooses per layer); `data_parallel`: "fsdp" or "ddp" on a
    mesh axis named "data"/"dp" (default "fsdp" when there is one).
    """
    mesh = MeshSpec.of(mesh)
    regime = Regime.of(mesh, mp_policy=mp_policy, activation_checkpointing=activation_checkpointing,
                       data_parallel=data_parallel)
    spec = device_spec(device)
    _check_precision(regime, spec)
    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}),
                       param_dtype=regime.precision.param_dtype if regime.precision.mixed else None)
    return plan_captured(captured, mesh, device=spec, training=training,
                         memory_budget=memory_budget, optimizer=optimizer, input_placements=input_placements,
                         output_placements=output_placements, tie_layers=tie_layers, regime=regime)


def plan_captured(captured: Captured, mesh: MeshSpec, *, device, training: bool, memory_budget: int | None,
                  optimizer: str | Optimizer = "adam", input_placements=None, output_placements=None,
                  tie_layers: bool | None = None, regime: Regime = Regime()) -> Plan:
    """The planning stages on an already captured graph: strategies, costs, solve, Plan."""
    spec = device_spec(device)
    budget = int(memory_budget if memory_budget is not None else 0.9 * spec.memory_bytes)
    t0 = time.perf_counter()
    annotate(captured.gm, mesh, data_pins(captured, mesh, _fixed_inputs(captured, mesh, input_placements)),
             _output_placements(captured, mesh, output_placements))
    t1 = time.perf_counter()
    ctx = CostContext(mesh, spec, training, optimizer_spec(optimizer), regime)
    problem = _problem(captured, ctx, tie_layers)
    t2 = time.perf_counter()
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    policy = regime.recompute if training else "none"
    chosen = solve_with_recompute(problem, [nodes[name] for name in problem.names], captured.params, policy,
                                  budget, solve)
    problem, solution = chosen.problem, chosen.solution
    if solution is None:
        raise infeasible_error(captured, problem, mesh, budget, recompute=policy)
    t3 = time.perf_counter()
    planned = with_traffic(assemble(captured, problem, solution, ctx, budget), captured)
    planned = with_regime(planned, captured, ctx, chosen.layers)
    return replace(planned, stats=PlanStats(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, problem.n_nodes,
                                            problem.n_groups, problem.n_binaries, solution.solves,
                                            len(solution.cuts), solution.gap))


def with_regime(plan: Plan, captured: Captured, ctx: CostContext, recomputed) -> Plan:
    """The plan with its training regime, and FSDP's traffic: its bytes, and its time less what
    compute hides (a layer's gathers are prefetched during the layer before; the first is not)."""
    values = {n.name: n.meta["val"] for n in captured.gm.graph.nodes if n.name in captured.params}
    fsdp_s, fsdp_bytes = 0.0, 0
    for name in captured.params:
        local = local_shape(tuple(values[name].shape), plan.node(name).output, ctx.mesh.sizes, ctx.coord0)
        s, b = ctx.fsdp_comm(math.prod(local) * values[name].dtype.itemsize, values[name].dtype.itemsize)
        fsdp_s, fsdp_bytes = fsdp_s + float(s), fsdp_bytes + int(b)
    step = plan.step_time
    if fsdp_s:
        compute = sum(n.compute_s for n in plan.nodes if n.kind != "param")
        layers = max(len(repeated_layers(list(captured.gm.graph.nodes), captured.params)), 1)
        step = step - fsdp_s + max(fsdp_s - compute, fsdp_s / layers)
    return replace(plan, step_time=step, comm_bytes=plan.comm_bytes + fsdp_bytes,
                   precision=ctx.regime.precision.describe(), recompute=tuple(recomputed),
                   data_parallel=ctx.regime.data_parallel)


def _check_precision(regime: Regime, spec: DeviceSpec) -> None:
    dtype = regime.precision.param_dtype
    if regime.precision.mixed and str(dtype).removeprefix("torch.") not in dict(spec.flops):
        raise ValueError(f"mp_policy.param_dtype={dtype} cannot be computed in on device {spec.name!r}, whose "
                         f"peak table lists {[name for name, _ in spec.flops]}: choose one of those dtypes")


def evaluate(plan: Plan, model: torch.nn.Module, example_inputs: Sequence, *, device: str | DeviceSpec,
             optimizer: str | Optimizer = "adam", example_kwargs: Mapping | None = None, mp_policy=None) -> Plan:
    """`plan` (planned, loaded or edited) with its costs predicted on `device`, to compare plans.

    The plan's recomputed layers (`plan.recompute`, editable) and data-parallel mode are priced
    as given; `mp_policy` as in `plan`.
    """
    regime = Regime(Precision.of(mp_policy), "none", plan.data_parallel)
    captured = capture(model, tuple(example_inputs), dict(example_kwargs or {}),
                       param_dtype=regime.precision.param_dtype if regime.precision.mixed else None)
    fixed = {name: pl for name, pl in zip(captured.inputs, plan.input_placements) if pl is not None}
    annotate(captured.gm, plan.mesh, fixed, plan.output_placements)
    ctx = CostContext(plan.mesh, device_spec(device), plan.training, optimizer_spec(optimizer), regime)
    problem = _problem(captured, ctx, tie_layers=False)
    nodes = [next(n for n in captured.gm.graph.nodes if n.name == name) for name in problem.names]
    problem = with_layers_recomputed(problem, nodes, repeated_layers(nodes, captured.params), plan.recompute)
    evaluated = with_traffic(assemble(captured, problem, fixed_solution(problem, plan), ctx, plan.memory_budget),
                             captured)
    return with_regime(evaluated, captured, ctx, plan.recompute)


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
