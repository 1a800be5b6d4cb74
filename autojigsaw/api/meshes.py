"""The mesh chosen with the plan: `plan(model, inputs, 512, gpus_per_node=8)` for 512 GPUs.

Every factoring of the GPUs into pipe x data x tensor (planner/mesh_search.py) is pruned by the
memory its weights and optimizer state need at least, then estimated from one whole-model plan per
tensor size, captured once at one sample; the most promising few are planned exactly, and the
fastest that fits is the plan, its runners-up in `plan.alternatives`.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ..capture.stages import layer_stack
from ..cost_model.schedule import schedule_name
from ..mesh import MeshSpec
from ..options import Options
from ..plan import MeshChoice, Plan
from ..planner.mesh_search import estimate_mesh, factorings, lower_bound_memory
from ..planner.layer_costs import layer_costs
from ..planner.pipeline import NO_BUDGET, PipelineChoice
from ..runtime.pipeline import batch_size
from ..training import data_axes, pipe_axis
from .pipelines import microbatch_of, plan_model
from .recipe import capture_for, plan_captured

EXACT_MESHES = 2  # the estimates planned exactly, best first


def plan_on_gpus(model: torch.nn.Module, args: tuple, kwargs: dict, world: int, options: Options) -> Plan:
    """The fastest plan of `model` on `world` GPUs over the mesh it chooses; the meshes it beat in
    `plan.alternatives`."""
    if world < 1:
        raise ValueError(f"a mesh of {world} GPUs: give a positive number of GPUs, or a mesh")
    device = options.device_spec()
    budget = options.budget()
    batch = batch_size(args, kwargs)
    alone = MeshSpec(("tensor",), (1,))
    one = capture_for(model, *microbatch_of(args, kwargs, batch), _on(alone, options).regime(alone))
    meshes = factorings(world, device.devices_per_node, len(layer_stack(one)) or 1, batch)
    schedule = None if options.pipeline_schedule is None else schedule_name(options.pipeline_schedule)
    choice = PipelineChoice(schedule, options.microbatches, options.virtual_stages)
    base = _base_costs(one, options)
    estimates, pruned = [], []
    for mesh in meshes:
        regime = _on(mesh, options).regime(mesh)
        floor = lower_bound_memory(0, float(base(1).held.sum()), mesh, regime.fsdp)
        if floor > budget:
            pruned.append(MeshChoice(mesh, None, floor, False, "weights and optimizer state alone exceed the budget"))
            continue
        est = estimate_mesh(lambda rows, t=_tensor(mesh): base(t).scaled(rows), mesh, regime, choice, budget=budget,
                            batch=batch, device=device)
        if est is not None:
            estimates.append(est)
    if not estimates:
        raise ValueError(f"no mesh of {world} GPUs fits the budget of {budget / 2**30:.1f} GiB per GPU even with every "
                         "weight sharded over every rank: give more GPUs, recomputation (activation_checkpointing="
                         "'full'), mixed precision, or a smaller batch")
    estimates.sort(key=lambda e: (not e.fits, e.step_time))
    return _best_exact(model, args, kwargs, options, estimates, pruned)


def _base_costs(one, options: Options):
    """Layer costs of the whole model on a tensor axis alone, at one sample, per tensor size (no budget)."""
    free = replace(options, data_parallel=None, memory_budget=NO_BUDGET, pipeline_schedule=None, microbatches=None,
                   virtual_stages=None)

    @functools.lru_cache(maxsize=None)
    def base(tensor: int):
        return layer_costs(plan_captured(one, MeshSpec(("tensor",), (tensor,)), free), one)

    return base


def _on(mesh: MeshSpec, options: Options) -> Options:
    """The options for one candidate mesh: `data_parallel` (FSDP or DDP) only where it has a data axis, an
    imposed schedule and virtual stages only where it has a pipe axis."""
    if not data_axes(mesh):
        options = replace(options, data_parallel=None)
    if pipe_axis(mesh) is None:
        options = replace(options, pipeline_schedule=None, virtual_stages=None)
    return options


def _tensor(mesh: MeshSpec) -> int:
    return mesh.size("tensor") if "tensor" in mesh.axis_names else 1


def _best_exact(model, args: tuple, kwargs: dict, options: Options, estimates: list, pruned: list) -> Plan:
    """The best of the first EXACT_MESHES estimates planned exactly (the next if one does not fit), with the
    rest as alternatives."""
    exact, errors = [], []
    for est in estimates:
        if len(exact) == EXACT_MESHES:
            break
        try:
            exact.append(plan_model(model, args, kwargs, est.mesh, _on(est.mesh, options)))
        except ValueError as e:  # the estimate fitted where the plan does not: the next one
            errors.append(MeshChoice(est.mesh, est.step_time, est.memory, False, str(e).splitlines()[0][:120]))
    if not exact:
        raise ValueError(f"no mesh that was estimated to fit could be planned: {errors[0].note}")
    exact.sort(key=lambda p: p.step_time)
    planned = {p.mesh for p in exact}
    others = ([MeshChoice(p.mesh, p.step_time, p.memory_per_rank, True, "planned") for p in exact[1:]]
              + [MeshChoice(e.mesh, e.step_time, e.memory, False, "estimated" if e.fits else "estimated: over budget")
                 for e in estimates if e.mesh not in planned] + errors + pruned)
    return replace(exact[0], alternatives=tuple(others))
