"""Microbatches: a pipeline over a pipe axis, and gradient accumulation without one.

`plan` with a pipe axis captures the model at each candidate microbatch (the first dim of its example
inputs split) and hands planner/pipeline.py a stage planner: `plan_captured` with the stage's values
between stages pinned and its microbatches in flight. `parallelize` agrees on the model as ever,
plans on rank 0, then each rank captures the chosen microbatch, cuts it at the plan's stages, keeps
only its stages' weights (sharded over the mesh without the pipe axis) and builds a Program per
stage, which runtime/pipeline.py runs under PyTorch's schedule. Without a pipe axis, `microbatches`
plans one microbatch and prices the step as that many, one after another, then one optimizer step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch
from torch.utils import _pytree as pytree

from ..capture import Captured, at_sizes, refuse_backward_hooks
from ..capture.stages import cut, layer_stack
from ..cost_model.schedule import SCHEDULES, SINGLE, schedule_name
from ..dtypes import value_carries_grad
from ..mesh import MeshSpec, RankView
from ..options import Options
from ..placements import local_shape
from ..plan import Pipeline, Plan
from ..planner.pipeline import NO_BUDGET, PipelineChoice, plan_pipeline
from ..rewrite.recompute import split_layers
from ..rewrite.rewrite import rewrite
from ..runtime.checks import check_agreement, check_group, program_facts
from ..runtime.feeds import program_feeds
from ..runtime.fsdp import shard_in_units
from ..runtime.materialize import materialize_model
from ..runtime.one_plan import planned_on_rank0
from ..runtime.one_program import follow_rank0_order
from ..runtime.pipeline import (PipelineRun, StageModule, batch_size, drop_parameters, loss_dtype, loss_reader,
                                make_stage, meta_like, refuse_fsdp_in_two_stages, split_microbatches,
                                stage_device_mesh, tensor_shapes)
from ..runtime.program import Program
from ..runtime.regional import runnable
from ..runtime.same_values import check_same_values, values_to_agree
from ..runtime.shared_lowering import SharedLowering
from ..strategies.constraints import check_constraints_match
from ..training import data_axes, pipe_axis, stage_mesh
from .recipe import _symbolic, capture_for, plan_captured


def microbatch_of(args: tuple, kwargs: dict, microbatches: int) -> tuple[tuple, dict]:
    """The first of `microbatches` equal slices of every tensor input along dim 0 (what a program is planned at)."""
    return split_microbatches(args, kwargs, microbatches)[0]


def plan_model(model: torch.nn.Module, args: tuple, kwargs: dict, mesh: MeshSpec, options: Options) -> Plan:
    """The plan of `model` on `mesh`: pipelined over a pipe axis, else one microbatch priced as many."""
    if pipe_axis(mesh) is not None:
        return plan_pipelined(model, args, kwargs, mesh, options)
    regime = options.regime(mesh)
    microbatches = options.microbatches or 1
    args, kwargs = accumulated_inputs(args, kwargs, mesh, options, microbatches)
    symbolic = _symbolic(model, args, kwargs, regime) if options.dynamic else None
    captured = at_sizes(symbolic, args, kwargs) if symbolic else capture_for(model, args, kwargs, regime)
    return accumulated(plan_captured(captured, mesh, options), microbatches)


def accumulated_inputs(args: tuple, kwargs: dict, mesh: MeshSpec, options: Options, microbatches: int
                       ) -> tuple[tuple, dict]:
    """Without a pipe axis: the inputs one program is planned at, the first of `microbatches` (gradient
    accumulation); options that only a pipe axis takes, and a batch that microbatches x data replicas do not
    divide, are ValueErrors."""
    for name in ("pipeline_schedule", "virtual_stages"):
        if getattr(options, name) is not None:
            raise ValueError(f"{name}={getattr(options, name)!r} schedules pipeline stages, and mesh "
                             f"{mesh.describe()} has no pipe axis: name a mesh axis 'pipe' (or 'pp'), or drop {name}")
    if microbatches == 1:
        return args, kwargs
    batch, axes = batch_size(args, kwargs), data_axes(mesh)
    replicas = math.prod(mesh.sizes[a] for a in axes)
    if batch % (microbatches * replicas):
        where = f" x {replicas} ranks of data axis {mesh.axis_names[axes[0]]!r}" if replicas > 1 else ""
        fits = ", ".join(str(m) for m in range(1, batch + 1) if batch % (m * replicas) == 0) or "none"
        raise ValueError(f"microbatches={microbatches}{where} does not divide the batch of {batch} (dim 0 of the "
                         f"inputs): give microbatches that do (here: {fits}), or a batch that "
                         f"{microbatches * replicas} divides")
    return microbatch_of(args, kwargs, microbatches)


def plan_pipelined(model: torch.nn.Module, args: tuple, kwargs: dict, mesh: MeshSpec, options: Options) -> Plan:
    """The plan of `model` over `mesh`'s pipe axis (stages, schedule, microbatches chosen or as imposed)."""
    if options.input_placements is not None or options.output_placements is not None:
        raise ValueError("input_placements and output_placements place a whole model's inputs and outputs; with a pipe "
                         "axis the first stage takes the inputs and the last returns the outputs: drop them")
    check_constraints_match(model, options.constraints)
    sub = stage_mesh(mesh)
    regime = options.regime(sub)
    device = options.device_spec()
    budget = options.budget()
    choice = PipelineChoice(None if options.pipeline_schedule is None else schedule_name(options.pipeline_schedule),
                            options.microbatches, options.virtual_stages)
    stage_options = replace(options, pipeline_schedule=None, microbatches=None, virtual_stages=None)

    def plan_stage(captured, stage_mesh_, ins, outs, stage_budget, in_flight, pinned):
        opts = replace(stage_options, input_placements=ins, output_placements=outs, memory_budget=stage_budget)
        return plan_captured(captured, stage_mesh_, opts, pinned, in_flight=in_flight, stage=True)

    @functools.lru_cache(maxsize=None)
    def whole_at(m: int) -> tuple[Captured, Plan]:
        """The model captured at one microbatch of m (as parallelize will), planned whole on the stage mesh
        with no budget."""
        captured = capture_for(model, *microbatch_of(args, kwargs, m), regime)
        return captured, plan_stage(captured, sub, None, None, NO_BUDGET, 1, {})

    return plan_pipeline(whole_at, plan_stage, mesh, choice, budget=budget, batch=batch_size(args, kwargs),
                         device=device)



def accumulated(plan: Plan, microbatches: int) -> Plan:
    """A plan of one microbatch priced as `microbatches` of them run one after another, FSDP's gathers and
    reduce-scatters with each, then one optimizer step and DDP's one sum (the weights' own time). Its memory
    was planned so already (training.Regime.accumulates, batch_slices)."""
    if microbatches == 1:
        return plan
    once = sum(ns.compute_s for ns in plan.nodes if ns.kind == "param")
    # DDP's one sum is the plan's bytes beyond its nodes' (sent once; FSDP's go with every microbatch)
    ddp_bytes = plan.comm_bytes - sum(ns.comm_bytes for ns in plan.nodes) if plan.data_parallel == "ddp" else 0
    return replace(plan, step_time=microbatches * (plan.step_time - once) + once, microbatches=microbatches,
                   comm_bytes=microbatches * (plan.comm_bytes - ddp_bytes) + ddp_bytes)


def starts_of(plan: Plan, captured: Captured) -> list[int]:
    """The first layer of each of the plan's stages, as positions in the model's layer stack."""
    index = {name: k for k, name in enumerate(layer_stack(captured))}
    try:
        return [index[st.layers[0]] for st in plan.pipeline.stages]
    except KeyError as e:
        raise ValueError(f"the plan's pipeline stages run layer {e}, which this model does not have: plan it "
                         "again with this model") from None


def build_pipeline(model: torch.nn.Module, args: tuple, kwargs: dict, *, device_mesh, plan: Plan | None,
                   options: Options, compile: bool | str) -> tuple[Plan, PipelineRun]:
    """This rank's part of a pipelined model: the plan (made on rank 0 unless given) and its stages, ready to step."""
    mesh = MeshSpec.of(device_mesh)
    check_group(device_mesh, mesh)
    refuse_backward_hooks(model)
    sub, regime = stage_mesh(mesh), options.regime(stage_mesh(mesh))
    # with a plan given, the one capture is its microbatch's; without, the whole batch's first, to agree on
    # before rank 0 plans
    captured = _capture_agreed(model, args, kwargs, regime, plan, options)
    if plan is None:
        plan = planned_on_rank0(lambda: plan_pipelined(model, args, kwargs, mesh, options))
    if plan.pipeline is None or plan.mesh != mesh:
        raise ValueError(f"the plan was made for mesh {plan.mesh.describe()} without this pipe axis: plan again for "
                         f"{mesh.describe()}")
    check_same_values(values_to_agree(model, captured, args, kwargs, weights=True, whole_inputs=True))
    pipeline = plan.pipeline
    if [x for x in captured.input_shapes if x is not None] != _microbatch_shapes(args, kwargs, pipeline.microbatches):
        captured = _capture_agreed(model, args, kwargs, regime, plan, options)
    programs = cut(captured, starts_of(plan, captured))
    stage_dm = stage_device_mesh(device_mesh, mesh)
    rank = RankView.of(stage_dm, sub)
    me = device_mesh.get_local_rank(pipeline.axis)
    mine = pipeline.stages_of(me)
    tied = _tied(model, pipeline, rank, me)
    refuse_fsdp_in_two_stages(pipeline, [set(p.captured.params.values()) for p in programs], regime, sub)
    weights = {fqn: pl for st in mine for fqn, pl in st.plan.param_placements.items()}
    materialize_model(model, weights, stage_dm, rank.coord)
    drop_parameters(model, keep=set(weights))
    built = [_stage_program(model, programs[st.index], st.plan, rank, stage_dm, regime, options, compile)
             for st in mine]
    group, device = device_mesh.get_group(pipeline.axis), torch.device(device_mesh.device_type)
    stages = [make_stage(module, st.index, len(pipeline.stages), device, group,
                         *_metas(p, st.index, args, pipeline.microbatches))
              for st, (module, p) in zip(mine, built)]
    cls = SCHEDULES[pipeline.schedule]
    schedule = cls(stages[0] if pipeline.schedule in SINGLE else stages, n_microbatches=pipeline.microbatches,
                   loss_fn=loss_reader(captured.out_spec, pipeline.microbatches), scale_grads=False)
    data = data_axes(sub)
    data_group = (stage_dm.get_group(sub.axis_names[data[0]])
                  if mine[0].plan.sums_once and mine[0].plan.data_parallel == "ddp" else None)
    run = PipelineRun(pipeline, schedule, tuple(st.index for st in mine), device_mesh.get_group(pipeline.axis), model,
                      tied, tuple(p for _, p in built), loss_dtype(captured), tensor_shapes(args, kwargs),
                      tuple(stages), data_group)
    return plan, run


def _capture_agreed(model: torch.nn.Module, args: tuple, kwargs: dict, regime, plan: Plan | None,
                    options: Options) -> Captured:
    """The model captured at the plan's microbatch (without a plan: at the whole batch), in rank 0's order, every
    rank agreeing on it, the plan and the options; a model that returns no loss is refused, on every rank alike."""
    inputs = (args, kwargs) if plan is None or plan.pipeline is None else \
        microbatch_of(args, kwargs, plan.pipeline.microbatches)
    shared = SharedLowering()
    try:
        captured = capture_for(model, *inputs, regime, shared)
    finally:
        shared.join()
    loss_dtype(captured)
    follow_rank0_order(captured)
    plan_fact = "to be made on rank 0" if plan is None else plan.fingerprint()
    check_agreement({**program_facts(captured), "plan": plan_fact, "options": options.describe()})
    return captured


def _microbatch_shapes(args: tuple, kwargs: dict, microbatches: int) -> list:
    return [tuple(x.shape) for x in pytree.tree_leaves(microbatch_of(args, kwargs, microbatches))
            if isinstance(x, torch.Tensor)]


def _call(model: torch.nn.Module, program: Program, received: bool, flat: list) -> tuple:
    """A stage program's outputs for the flat inputs the stage receives: the first stage's whole inputs, sliced
    here; the others' (`received`) shards, as the stage before sent them."""
    return program.run(*program_feeds(model, program, flat, local_inputs=received))


def _stage_program(model, program, plan: Plan, rank: RankView, stage_dm, regime, options: Options,
                   compile: bool | str) -> tuple[StageModule, Program]:
    """One stage on this rank: its module (holding its weights; under FSDP, the root of its units), and its
    Program (its rewritten graph, compiled, run through the units)."""
    captured = program.captured
    first = program.index == 0
    module = StageModule(first=first)
    units = shard_in_units(model, captured, plan, stage_dm, regime, stage=module)
    if units is None:
        module.hold({ph: model.get_parameter(fqn) for ph, fqn in captured.params.items()})
    differentiable = frozenset(n for n, v in zip(captured.inputs, captured.input_values)
                               if (value_carries_grad(v) if first else v.is_floating_point()))
    gm = rewrite(captured, plan, rank, training=options.training, inputs_with_grad=differentiable)
    split, pieces = split_layers(gm, captured, plan, units.layer_of if units else None)
    built = Program(captured, plan, rank, gm, runnable(split, pieces, units, compile), regime.precision, None, units)
    module.call = functools.partial(_call, model, built, not first)
    return module, built


def _metas(program: Program, index: int, args: tuple, microbatches: int) -> tuple[tuple, tuple]:
    """What a stage receives and sends, as meta tensors of this rank's shapes (its first stage: the whole
    microbatch of the positional inputs)."""
    captured, plan, rank = program.captured, program.plan, program.rank
    if index == 0:
        rows = batch_size(args, {}) // microbatches
        ins = tuple(torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device="meta") for x in args
                    if isinstance(x, torch.Tensor))
    else:
        ins = meta_like(captured.input_values, plan.input_placements, rank.mesh.sizes, rank.coord, grad=True)
    outputs = [a.meta["val"] for a in captured.gm.graph.output_node().args[0]]
    outs = meta_like(outputs, plan.output_placements, rank.mesh.sizes, rank.coord, grad=True)
    return ins, outs


def _tied(model: torch.nn.Module, pipeline: Pipeline, rank: RankView, me: int) -> tuple:
    """Per weight that stages on several pipe ranks read: this rank's copy (None: it holds none), its local
    shape and dtype (every rank of the pipe axis takes part in summing its gradient)."""
    ranks: dict[str, set[int]] = {}
    placed = {}
    for st in pipeline.stages:
        for fqn, pl in st.plan.param_placements.items():
            ranks.setdefault(fqn, set()).add(st.rank)
            placed[fqn] = pl
    out = []
    for fqn in sorted(f for f, r in ranks.items() if len(r) > 1):
        p = model.get_parameter(fqn)
        shape = local_shape(tuple(p.shape), placed[fqn], rank.mesh.sizes, rank.coord)
        out.append((fqn if me in ranks[fqn] else None, shape, p.dtype))
    return tuple(out)

