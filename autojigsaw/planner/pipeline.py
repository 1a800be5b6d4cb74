"""Pipeline stages chosen with the sharding: where to cut, how many microbatches, which schedule.

Over a pipe axis of p ranks the program is cut into p x v stages (v virtual stages per rank) at
repeated-layer boundaries (capture/stages.py), each stage sharded over the other axes as any
program is. The choices are searched in two passes. First, the model captured at its finest microbatch is
planned whole on the other axes: that plan gives each layer's costs (planner/layer_costs.py,
scaled to the other microbatch sizes) and the placement of every value crossing a layer boundary.
Every schedule, v and m is then estimated from those numbers: stages cut where the slowest stage is fastest
(embeddings with the first, head and loss with the last; a stage whose weights and in-flight
activations miss the budget is not cut), PyTorch's own order of work replayed
(cost_model/schedule.py). Second, the fastest estimates are planned exactly: each distinct
stage once (the middle stages alike share one plan, moved to each stage's own node names),
its boundary values pinned to those placements and its saved activations counted once per
microbatch in flight; the stages' times are replayed again. The first candidate whose every
rank fits its budget is the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..capture import Captured
from ..capture.stages import NO_LAYERS, StageProgram, cut
from .layer_costs import LayerCosts, balanced_starts, layer_costs, sent_bytes, stage_work
from ..cost_model.comm import collective_time
from ..cost_model.devices import DeviceSpec
from ..cost_model.schedule import SINGLE, V_SHAPED, StageTimes, in_flight, rank_orders, simulate, stage_ranks
from ..mesh import MeshSpec
from ..modules import module_path
from ..pipeline import Pipeline, StagePlan
from ..plan import Plan
from ..plan_text import span_name
from ..training import data_axes, pipe_axis, stage_mesh

NO_BUDGET = 2**62
EXACT_CANDIDATES = 3  # estimates planned exactly, fastest first, until one fits
DEFAULT_SCHEDULES = ("1F1B", "interleaved", "zero-bubble", "gpipe")


@dataclass(frozen=True)
class PipelineChoice:
    """What the user imposed on the pipeline (None: the planner chooses)."""

    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None


# A stage planner: (stage program's captured graph, stage mesh, input placements, output placements,
# budget in bytes, microbatches in flight, pinned weights: placeholder -> placements) -> its Plan.
PlanStage = Callable[[Captured, MeshSpec, list | None, list | None, int, int, dict], Plan]


@dataclass(frozen=True)
class Candidate:
    """A schedule estimated from layer costs: the estimate, microbatches, schedule and virtual stages."""

    estimate: Estimate
    microbatches: int
    schedule: str
    virtual: int


def estimated(costs_at: Callable[[int], LayerCosts], mesh: MeshSpec, choice: PipelineChoice, *, budget: int,
              batch: int, device: DeviceSpec) -> list[Candidate]:
    """Every schedule, virtual stages and microbatches `choice` allows on `mesh`, estimated from `costs_at(m)`
    (the layers' costs at one microbatch of m): those that fit first, fastest first."""
    axis = pipe_axis(mesh)
    ranks = mesh.sizes[axis]
    link = device.axis_link(mesh.sizes, axis, mesh.axis_names[axis])
    out = []
    for m in microbatch_choices(choice, batch, _data_replicas(mesh), ranks):
        costs = costs_at(m)
        if not costs.layers:
            raise ValueError(NO_LAYERS)
        for schedule, virtual in schedule_choices(choice, ranks, len(costs.layers), m):
            est = estimate(costs, schedule, ranks, virtual, m, budget, link)
            if est is not None:
                out.append(Candidate(est, m, schedule, virtual))
    return sorted(out, key=lambda c: (not c.estimate.fits, c.estimate.step_time))


def plan_pipeline(whole_at: Callable[[int], tuple[Captured, Plan]], plan_stage: PlanStage, mesh: MeshSpec,
                  choice: PipelineChoice, *, budget: int, batch: int, device: DeviceSpec,
                  user_inputs: list | None = None) -> Plan:
    """The fastest pipelined plan of the model on `mesh` (which has a pipe axis) that fits `budget` per rank.

    `whole_at(m)`: the model captured at one microbatch of `m` and planned whole on the stage mesh (the
    finest microbatch's costs estimate the others); `batch`: the example's batch (dim 0), split over the
    data axis and then into microbatches.
    """
    finest = max(microbatch_choices(choice, batch, _data_replicas(mesh), mesh.sizes[pipe_axis(mesh)]))
    measured = layer_costs(*reversed(whole_at(finest)))  # one capture: the others scaled from it
    candidates = estimated(lambda m: measured.scaled(finest / m), mesh, choice, budget=budget, batch=batch,
                           device=device)
    if not candidates:
        raise ValueError(_nothing_fits(mesh, choice, budget))
    errors = []
    for c in candidates[:EXACT_CANDIDATES]:
        captured, whole = whole_at(c.microbatches)
        try:
            return exact_pipeline(captured, whole, plan_stage, mesh, c.schedule, c.virtual, c.microbatches,
                                  c.estimate.starts, budget, device, user_inputs)
        except ValueError as e:  # a stage that does not fit: the next candidate may
            errors.append(e)
    raise errors[0]


def _data_replicas(mesh: MeshSpec) -> int:
    return math.prod(mesh.sizes[a] for a in data_axes(mesh))


def microbatch_choices(choice: PipelineChoice, batch: int, replicas: int, ranks: int) -> list[int]:
    """The numbers of microbatches per data replica to try: the imposed one, else up to three divisors of
    the replica's batch, the smallest microbatches first, at least one per stage where the batch allows."""
    if batch % replicas:
        raise ValueError(f"the batch of {batch} does not split over {replicas} data replicas: give a batch that "
                         "the data axis divides")
    per_replica = batch // replicas
    if choice.microbatches is not None:
        m = choice.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or per_replica % m:
            raise ValueError(f"microbatches={m!r} does not divide the batch of {per_replica} rows per data replica "
                             f"(batch {batch} over {replicas} replica(s)): give a divisor of {per_replica}")
        return [m]
    divisors = [d for d in range(per_replica, 0, -1) if per_replica % d == 0]
    enough = [d for d in divisors if d >= ranks] or divisors[:1]
    return enough[:3]


def schedule_choices(choice: PipelineChoice, ranks: int, layers: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages per rank) pairs to try; an imposed one that cannot run is a ValueError."""
    imposed = choice.schedule is not None
    out = []
    for name in [choice.schedule] if imposed else DEFAULT_SCHEDULES:
        for virtual in _virtual_choices(name, choice.virtual_stages, ranks, layers, imposed_schedule=imposed):
            try:
                rank_orders(name, ranks, virtual, microbatches)
            except ValueError as e:
                if imposed and choice.microbatches is not None:
                    raise ValueError(f"pipeline_schedule={name!r} cannot run {microbatches} microbatches on "
                                     f"{ranks} pipe ranks x {virtual} virtual stages ({e}); give more "
                                     "microbatches, or another schedule") from None
                continue
            out.append((name, virtual))
    if not out and imposed:
        raise ValueError(f"pipeline_schedule={choice.schedule!r} with {ranks} pipe ranks cannot run any "
                         f"microbatch count tried: give microbatches= (at least {ranks}) or another schedule")
    return out


def _virtual_choices(schedule: str, imposed: int | None, ranks: int, layers: int, *, imposed_schedule: bool = False
                     ) -> list[int]:
    """Virtual stages per rank a schedule takes (one for GPipe and 1F1B, two for the V of zero-bubble); a schedule
    the user imposed that needs more stages than the model has layers is a ValueError."""
    fixed = 1 if schedule in SINGLE else 2 if schedule in V_SHAPED else None
    least = fixed or 2
    if imposed is None and imposed_schedule and ranks <= layers < ranks * least:
        raise ValueError(f"pipeline_schedule={schedule!r} runs {least}{'' if fixed else ' or more'} stages per pipe "
                         f"rank, {ranks * least} stages on {ranks} pipe ranks, but the model has {layers} repeated "
                         "layers to cut between: choose '1F1B' or 'gpipe', or a smaller pipe axis")
    if imposed is not None:
        if isinstance(imposed, bool) or not isinstance(imposed, int) or imposed < 1:
            raise ValueError(f"virtual_stages={imposed!r}: give a positive number of stages per pipe rank")
        if fixed is not None and imposed != fixed:
            raise ValueError(f"pipeline_schedule={schedule!r} runs {fixed} stage(s) per pipe rank, not "
                             f"virtual_stages={imposed}: drop virtual_stages, or choose 'interleaved'")
        if ranks * imposed > layers:
            raise ValueError(f"{ranks} pipe ranks x virtual_stages={imposed} = {ranks * imposed} stages, but the model "
                             f"has {layers} repeated layers to cut between: give fewer stages")
        return [imposed]
    if ranks > layers:
        raise ValueError(f"the pipe axis has {ranks} ranks but the model has {layers} repeated layers: a stage holds "
                         "at least one layer; give a pipe axis of at most that size")
    if fixed is not None:
        return [fixed] if ranks * fixed <= layers else []
    return [v for v in (2, 3, 4) if ranks * v <= layers]


@dataclass(frozen=True)
class Estimate:
    """A candidate's step time and per-rank memory from layer costs, and where it cuts."""

    step_time: float
    memory: float
    fits: bool
    starts: tuple[int, ...]


def estimate(costs: LayerCosts, schedule: str, ranks: int, virtual: int, microbatches: int, budget: int,
             link) -> Estimate | None:
    """The step and memory of a schedule from the whole plan's layer costs, cut where the slowest stage
    is fastest among the cuts whose every stage fits its share of the budget (None: fewer layers than stages)."""
    stages = ranks * virtual
    if stages > len(costs.layers):
        return None
    owner = stage_ranks(schedule, ranks, virtual)
    held = in_flight(schedule, ranks, virtual, microbatches)
    starts = balanced_starts(costs, held, budget // virtual) or balanced_starts(costs, held, None)
    send = _hop_seconds(costs.send, link)
    parts = [costs.stage(a, b, s == 0, s == stages - 1) for s, (a, b) in enumerate(_spans(starts, len(costs.layers)))]
    times = [StageTimes(f, b, w, send) for f, b, w, *_ in parts]
    sim = simulate(schedule, ranks, virtual, microbatches, times, [p[3] for p in parts])
    memory = [sum(parts[s][4] for s in range(stages) if owner[s] == r) + sim.activation_peak[r] for r in range(ranks)]
    per_step = max(sum(parts[s][5] for s in range(stages) if owner[s] == r) for r in range(ranks))
    return Estimate(sim.step_time + per_step, max(memory), max(memory) <= budget, starts)


def _spans(starts: Sequence[int], layers: int) -> list[tuple[int, int]]:
    return list(zip(starts, list(starts[1:]) + [layers]))


def _hop_seconds(nbytes: float, link) -> float:
    return float(collective_time("send_recv", nbytes, 2, link.latency_s, link.bandwidth)) if nbytes else 0.0


def exact_pipeline(captured: Captured, whole: Plan, plan_stage: PlanStage, mesh: MeshSpec, schedule: str,
                   virtual: int, microbatches: int, starts: Sequence[int], budget: int, device: DeviceSpec,
                   user_inputs) -> Plan:
    """The stages of one candidate planned exactly (each distinct stage once), replayed, checked against
    `budget` per rank; a ValueError names the stage or rank that does not fit."""
    axis = pipe_axis(mesh)
    ranks, sub = mesh.sizes[axis], stage_mesh(mesh)
    programs = cut(captured, list(starts))
    owner = stage_ranks(schedule, ranks, virtual)
    held = in_flight(schedule, ranks, virtual, microbatches)
    plans = _stage_plans(programs, whole, plan_stage, sub, schedule, held, budget // virtual, user_inputs)
    link = device.axis_link(mesh.sizes, axis, mesh.axis_names[axis])
    stages = []
    for s, (prog, plan) in enumerate(zip(programs, plans)):
        forward, backward, weight, _ = stage_work(plan, prog.captured)
        stages.append(StagePlan(s, owner[s], prog.layers, plan, forward, backward, weight,
                                sent_bytes(plan, prog.captured, prog.sends), held[s]))
    times = [StageTimes(st.forward_s, st.backward_s, st.weight_s, _hop_seconds(st.send_bytes, link)) for st in stages]
    sim = simulate(schedule, ranks, virtual, microbatches, times)
    memory = [sum(st.plan.memory_per_rank for st in stages if st.rank == r) for r in range(ranks)]
    worst = int(np.argmax(memory))
    if memory[worst] > budget:
        held = [st for st in stages if st.rank == worst]
        raise ValueError(f"pipe rank {worst} (stages {[st.index for st in held]}) needs {memory[worst] / 2**30:.2f} "
                         f"GiB with {microbatches} microbatches under {schedule}, over the budget of "
                         f"{budget / 2**30:.2f} "
                         "GiB: give fewer virtual stages, another schedule, recomputation, or a larger budget")
    pipeline = Pipeline(mesh.axis_names[axis], schedule, microbatches, virtual, tuple(stages), sim.bubble,
                        "once per step" if whole.data_parallel == "fsdp" else "")
    per_step = [sum(stage_work(st.plan, programs[st.index].captured)[3] for st in stages if st.rank == r)
                for r in range(ranks)]
    return pipelined(mesh, pipeline, sim.step_time + max(per_step), memory, budget, whole)


def _stage_plans(programs: list[StageProgram], whole: Plan, plan_stage: PlanStage, sub: MeshSpec, schedule: str,
                 in_flight: Sequence[int], budget: int, user_inputs) -> list[Plan]:
    """A plan per stage: each distinct stage (layer count, first, last) planned once with the most
    microbatches any of its kind holds, its values between stages placed as in `whole`; the others
    are its plan on their own nodes."""
    last = len(programs) - 1
    placed = {name: whole.node(name).outputs[0] for prog in programs for name in prog.sends}
    kinds = [(len(p.layers), s == 0, s == last) for s, p in enumerate(programs)]
    first_of = {}
    for s, kind in enumerate(kinds):
        first_of.setdefault(kind, s)
    planned, weights = {}, {}  # weights: FQN -> placements, so that a weight two stages read (tied) is placed alike
    for kind, s in first_of.items():
        prog, k = programs[s], max(f for f, other in zip(in_flight, kinds) if other == kind)
        ins = user_inputs if s == 0 else [placed[n] for n in prog.captured.inputs]
        outs = [placed[n] for n in prog.sends] if s < last else None
        pinned = {ph: weights[fqn] for ph, fqn in prog.captured.params.items() if fqn in weights}
        try:
            planned[s] = plan_stage(prog.captured, sub, ins, outs, budget, k, pinned)
            weights.update(planned[s].param_placements)
        except ValueError as e:
            raise ValueError(f"pipeline stage {s} of {last + 1} ({span_name(prog.layers)}, {k} microbatch(es) in "
                             f"flight under {schedule}): {e}") from None
    return [planned[s] if first_of[kind] == s else transplant(planned[first_of[kind]], programs[first_of[kind]], prog)
            for s, (kind, prog) in enumerate(zip(kinds, programs))]


def transplant(plan: Plan, source: StageProgram, target: StageProgram) -> Plan:
    """`plan` of `source` moved onto `target`, a stage of the same program on other layers: node by node."""
    pairs = list(zip(source.captured.gm.graph.nodes, target.captured.gm.graph.nodes))
    assert len(source.captured.gm.graph.nodes) == len(target.captured.gm.graph.nodes) and all(
        a.op == b.op and (a.op != "call_function" or a.target == b.target) for a, b in pairs), \
        "stages of one kind differ in their programs"
    names = {a.name: b for a, b in pairs}
    fqns = {source.captured.params[a.name]: target.captured.params[b.name] for a, b in pairs
            if a.name in source.captured.params}
    layers = dict(zip(source.layers, target.layers))
    nodes = tuple(replace(ns, name=names[ns.name].name, module=_module(names[ns.name], target, ns.module))
                  for ns in plan.nodes)
    return replace(plan, nodes=nodes, param_placements={fqns[k]: v for k, v in plan.param_placements.items()},
                   recompute=tuple((layers[layer], policy) for layer, policy in plan.recompute), explainer=None,
                   peak_at="")


def _module(node, program: StageProgram, fallback: str) -> str:
    return module_path(node, program.captured.params) or fallback


def pipelined(mesh: MeshSpec, pipeline: Pipeline, step_time: float, memory: list[int], budget: int,
              whole: Plan) -> Plan:
    """The plan of a pipeline: its stages' nodes and placements, first stage's inputs, last stage's outputs;
    predicted step time, the busiest rank's memory and bytes sent per step."""
    stages = pipeline.stages
    nodes, seen = [], set()
    for st in stages:
        for ns in st.plan.nodes:
            if ns.name not in seen:
                seen.add(ns.name)
                nodes.append(ns)
    m = pipeline.microbatches
    sent = [sum(m * (st.plan.comm_bytes + 2 * st.send_bytes) for st in stages if st.rank == r)
            for r in range(pipeline.ranks)]
    params = {k: v for st in stages for k, v in st.plan.param_placements.items()}
    worst = int(np.argmax(memory))
    allocated = None if any(st.plan.memory_allocated is None for st in stages) else max(
        sum(st.plan.memory_allocated for st in stages if st.rank == r) for r in range(pipeline.ranks))
    gaps = [st.plan.gap for st in stages]
    return replace(whole, mesh=mesh, nodes=tuple(nodes), param_placements=params,
                   memory_allocated=allocated, gap=None if None in gaps else max(gaps),
                   input_placements=stages[0].plan.input_placements,
                   output_placements=stages[-1].plan.output_placements,
                   memory_per_rank=max(memory), comm_bytes=max(sent), step_time=step_time, memory_budget=budget,
                   peak_at=f"pipe rank {worst}", recompute=tuple(r for st in stages for r in st.plan.recompute),
                   stats=None, explainer=None, pipeline=pipeline, microbatches=m)


def _nothing_fits(mesh: MeshSpec, choice: PipelineChoice, budget: int) -> str:
    return (f"no pipeline schedule fits mesh {mesh.describe()} ({choice}): give microbatches=, "
            f"pipeline_schedule= or virtual_stages= that the batch and layers allow")
