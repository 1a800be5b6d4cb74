"""The planning stages on a captured graph: strategies, costs, solve -> Plan, and its exact traffic.

`plan_captured` is the recipe every plan goes through (a whole model, a pipeline stage, a shape planned
again with its parameters in place); `capture_for` captures a model as its training regime runs it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from torch.distributed.tensor import Replicate

from ..capture import Captured, capture
from ..capture.lowering import lower
from ..cost_model.estimate import CostContext
from ..cost_model.in_flight import with_in_flight
from ..cost_model.regime import fsdp_layers, with_data_traffic, with_regime
from ..cost_model.memory import optimizer_spec
from ..ir import grads_by_name
from ..mesh import MeshSpec, RankView
from ..options import Options
from ..placements import Placement, Placements, normalize
from ..plan import Plan, PlanStats
from ..planner import build_problem, solve
from ..planner.assemble import assemble
from ..planner.errors import infeasible_error
from ..planner.recompute import solve_with_recompute
from ..planner.reserved import Fitted, allocator_facts, footprint, solve_reserved
from ..rewrite.every_rank import checking_every_rank, lint_every_rank
from ..rewrite.rewrite import rewrite
from ..rewrite.traffic import traffic_by_origin
from ..strategies.annotate import annotate
from ..strategies.constraints import constrain
from ..strategies.data_pins import data_pins
from ..strategies.rules.routed_experts_cost import IMBALANCE
from ..training import Regime

log = logging.getLogger("autojigsaw")


def capture_for(model: torch.nn.Module, args: tuple, kwargs: dict, regime: Regime, lower=lower) -> Captured:
    """The model's graph as the regime runs it (floating parameters and inputs in param_dtype); `lower`: as
    `capture`'s."""
    precision = regime.precision
    return capture(model, args, kwargs, param_dtype=precision.param_dtype if precision.mixed else None, lower=lower)


def _symbolic(model: torch.nn.Module, args: tuple, kwargs: dict, regime: Regime) -> Captured | None:
    """The model captured with symbolic input sizes (dynamic=True), or None, logged, where export
    keeps no size symbolic or cannot capture the model so."""
    precision = regime.precision
    try:
        symbolic = capture(model, args, kwargs, param_dtype=precision.param_dtype if precision.mixed else None,
                           dynamic=True)
    except ValueError as e:
        log.info("autojigsaw: dynamic=True: %s; planning once per input shape instead", str(e).splitlines()[0])
        return None
    if not symbolic.shapes.symbolic:
        log.info("autojigsaw: dynamic=True: torch.export fixed every input size of %s (its code depends on "
                 "them); planning once per input shape instead", type(model).__name__)
        return None
    log.info("autojigsaw: dynamic=True: one plan for inputs %s", symbolic.shapes)
    return symbolic


def plan_captured(captured: Captured, mesh: MeshSpec, options: Options = Options(),
                  pinned: dict[str, Placements] | None = None, *, in_flight: int = 1, stage: bool = False) -> Plan:
    """The planning stages on an already captured graph: strategies, costs, solve, Plan.

    `options`: an autojigsaw.Options (its `dynamic` is the capture's, not read here);
    `pinned`: placeholder name -> placements every strategy must keep (parameters already sharded).
    `in_flight`: microbatches whose saved activations are held at once; `stage`: the graph is a pipeline
    stage's (FSDP gathers its weights once per step and keeps them, training.Regime.fsdp_once).

        plan = plan_captured(capture(model, (x,)), MeshSpec.of({"tensor": 2}), Options(device="cpu"))
    """
    device, regime = options.device_spec(), options.regime(mesh)
    slices = 1 if stage else options.microbatches or 1
    regime = replace(regime, fsdp_once=stage and regime.fsdp, accumulates=stage or slices > 1, batch_slices=slices,
                     whole_inputs=options.input_placements is None)
    budget = options.budget()
    t0 = time.perf_counter()
    fixed = {**_fixed_inputs(captured, mesh, options.input_placements), **(pinned or {})}
    annotate(captured.gm, mesh, data_pins(captured, mesh, fixed),
             _output_placements(captured, mesh, options.output_placements, options.training))
    constrain(captured, mesh, options.constraints, options.constraints_axis, stage=stage)
    t1 = time.perf_counter()
    ctx = CostContext(mesh, device, options.training, optimizer_spec(options.optimizer), regime, options.moe_imbalance,
                      fsdp_layers(captured, regime))
    problem = _problem(captured, ctx, options.tie_layers)
    t2 = time.perf_counter()
    policy = regime.recompute if options.training else "none"
    held = _in_flight(problem, captured, in_flight)
    fitted = _solve_fitting(captured, problem, options, ctx, held, policy, budget)
    chosen = fitted.chosen
    problem, solution = held(chosen.problem), chosen.solution
    if solution is None:
        raise infeasible_error(captured, problem, mesh, budget, recompute=policy, reserved=fitted.footprint,
                               whole_inputs=regime.whole_inputs)
    t3 = time.perf_counter()
    planned = with_regime(assemble(captured, problem, solution, ctx, budget, fitted.footprint), ctx, chosen.layers)
    planned = replace(planned, moe_imbalance=options.moe_imbalance, whole_inputs=regime.whole_inputs)
    planned = with_data_traffic(with_traffic(planned, captured), captured, ctx, problem.grad)
    stats = PlanStats(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, problem.n_nodes, problem.n_groups,
                      problem.n_binaries, solution.solves, len(solution.cuts), solution.gap)
    return replace(planned, gap=solution.gap, stats=stats)


def _solve_fitting(captured: Captured, problem, options: Options, ctx: CostContext, held, policy: str,
                   budget: int) -> Fitted:
    """The fastest plan (recomputation chosen with it) that fits `budget`: as bytes live, and on a device
    with torch's CUDA caching allocator as it reserves them (planner/reserved.py)."""
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    nodes = [by_name[name] for name in problem.names]
    solver = options.solver or solve
    facts = allocator_facts(nodes, captured.params, problem.grad, ctx.device, training=options.training)

    def solve_under(bound: float):
        return solve_with_recompute(problem, nodes, captured.params, policy, bound,
                                    lambda p, b, **kw: solver(held(p), b, mip_gap=options.mip_gap, **kw))

    return solve_reserved(solve_under, budget,
                          lambda c: footprint(held(c.problem), c.solution.choice, facts, ctx.device, budget))


def with_traffic(plan: Plan, captured: Captured) -> Plan:
    """The plan with exact bytes per node, read off the graph the plan rewrites into (rank 0's; every
    rank's graph is also linted under AUTOJIGSAW_CHECK_RANKS=1, rewrite/every_rank.py)."""
    rank = RankView.planning(plan.mesh)
    gm = rewrite(captured, plan, rank, training=plan.training)
    if checking_every_rank():
        lint_every_rank(captured, plan)
    gm.meta[IMBALANCE] = plan.moe_imbalance  # the routing routed experts' all-to-alls are counted at
    traffic = traffic_by_origin(gm, rank, captured.trained_params, plan.training)
    nodes = tuple(replace(n, comm_bytes=traffic.get(n.name, 0)) for n in plan.nodes)
    return replace(plan, nodes=nodes, comm_bytes=sum(traffic.values()))


def _in_flight(problem, captured: Captured, in_flight: int):
    """The problem with the activations `in_flight` microbatches save held at once (a pipeline stage's):
    applied to each recomputation variant, whose saved activations differ."""
    if in_flight == 1:
        return lambda p: p
    persistent = {i for i, name in enumerate(problem.names) if name in captured.params or name in captured.buffers}
    return lambda p: replace(p, memory=with_in_flight(p.memory, in_flight, persistent))


def _problem(captured: Captured, ctx: CostContext, tie_layers: bool | None):
    """The costs of every strategy of the annotated graph; parameters and buffers live throughout."""
    grad = grads_by_name(captured.gm, captured.trained_params)
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


def _output_placements(captured: Captured, mesh: MeshSpec, placements, training: bool = True):
    """The placements the outputs must come back in. By default whole, except beside a returned loss
    (a training step reads the loss alone): the others (logits) stay as planned, returned as DTensors."""
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    vals = [a.meta["val"] for a in out.args[0] if isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor)]
    if placements is None:
        if not (training and any(v.ndim == 0 and v.is_floating_point() for v in vals)):
            return None
        k = len(captured.mutated_buffers)  # buffers' new values come back whole, into the buffers
        return [tuple(Replicate() for _ in mesh.sizes) if v.ndim == 0 or i < k else None for i, v in enumerate(vals)]
    if len(placements) != len(vals):
        raise ValueError(f"output_placements has {len(placements)} entries but the model returns "
                         f"{len(vals)} tensors; give one per output tensor")
    return [None if pl is None else _checked(pl, mesh, v.shape, f"output {i}")
            for i, (pl, v) in enumerate(zip(placements, vals))]


def _checked(pl: Placements, mesh: MeshSpec, shape, what: str) -> Placements:
    if isinstance(pl, (str, Placement)):
        raise ValueError(f"{what}: {pl!r} is not a tuple of placements; give one DTensor placement per mesh axis "
                         f"({mesh.describe()}), e.g. {tuple(Replicate() for _ in mesh.sizes)}")
    pl = tuple(pl)
    if len(pl) != mesh.ndim:
        raise ValueError(f"{what}: {len(pl)} placements for a mesh of {mesh.ndim} axes "
                         f"({mesh.describe()}); give one placement per mesh axis")
    for p, axis in zip(pl, mesh.axis_names):
        if not isinstance(p, Placement):
            raise ValueError(f"{what}: {p!r} on axis {axis!r} is not a DTensor placement; give Shard(dim), "
                             "Replicate() or Partial() from torch.distributed.tensor")
        if getattr(p, "dim", None) is not None and not -len(shape) <= p.dim < len(shape):
            raise ValueError(f"{what}: {p} on axis {axis!r} names a dim the tensor of shape "
                             f"{tuple(shape)} does not have")
    return normalize(pl, len(shape))
