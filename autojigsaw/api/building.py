"""Building: what `parallelize` runs on each rank -- capture, plan (rank 0), materialize, rewrite, compile.

The result is a ParallelModule, which holds one Program per input shape and runs it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ..capture import Captured, at_sizes, refuse_backward_hooks
from ..capture.lowering import LoweringExchangeError
from ..dtypes import value_carries_grad
from ..mesh import MeshSpec, RankView
from ..options import Options
from ..placements import Placements
from ..plan import Plan
from ..planner.reuse import plan_at_shapes
from ..rewrite.recompute import split_layers
from ..rewrite.rewrite import rewrite
from ..runtime.checks import check_agreement, check_group, check_plan, default_budget, device_of, program_facts
from ..runtime.fsdp import FsdpUnits, shard_in_units
from ..runtime.materialize import materialize_model
from ..runtime.module import ParallelModule
from ..runtime.program import Program
from ..runtime.one_plan import planned_on_rank0
from ..runtime.one_program import follow_rank0_order
from ..runtime.regional import runnable
from ..runtime.same_values import check_same_values, values_to_agree
from ..runtime.shared_lowering import SharedLowering
from ..training import pipe_axis, data_axes

from .cached import planned_or_cached
from .planning import _check_model, _positional
from .pipelines import accumulated, accumulated_inputs, build_pipeline
from .recipe import _symbolic, capture_for

log = logging.getLogger("autojigsaw")


def parallelize(model: torch.nn.Module, mesh, example_inputs: Sequence | None = None, *, compile: bool | str = True,
                example_kwargs: Mapping | None = None, plan: Plan | None = None, **options) -> ParallelModule:
    """Shard `model` over `mesh` (a DeviceMesh with named axes) by a plan; returns the module to train.

    Every rank calls it with the same model and inputs. Parameters of the result are DTensors
    (optimizers, clip_grad_norm_ and torch.distributed.checkpoint work unchanged); it takes
    whole inputs and returns whole outputs unless told otherwise.

    - `example_inputs` / `example_kwargs`: one call's inputs, planned for now; None: planned
      at the first call, like torch.compile. A call with other input shapes is planned again
      with the parameters kept in place (one plan per shape, cached).
    - `compile`: torch.compile the rewritten graph (fullgraph); a string names the backend
      ("aot_eager": graph breaks and the traced backward checked, no kernels generated).
    - `plan`: apply this Plan (from `autojigsaw.plan` or `Plan.from_json`) instead of planning;
      its recomputation and data-parallel mode included.
    - `**options`: the fields of autojigsaw.Options as keywords (`device=`, `memory_budget=`,
      `activation_checkpointing=`, ...), each documented there: help(autojigsaw.Options).

        import autojigsaw, torch
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("domain", "tensor"))
        pmodel = autojigsaw.parallelize(model, mesh, (x,), memory_budget=60 * 2**30)
        opt = torch.optim.AdamW(pmodel.parameters())
        pmodel(x).square().mean().backward(); opt.step()
    """
    _check_model(model)
    options = _resolved(Options.from_keywords(options, "parallelize"), mesh, plan)
    mesh_spec = MeshSpec.of(mesh)
    regime = options.regime(mesh_spec)
    if options.memory_budget is None:
        options = replace(options, memory_budget=default_budget(mesh))
    if pipe_axis(mesh_spec) is not None:
        return _pipelined(model, mesh, example_inputs, example_kwargs, plan, options, compile)
    if options.dynamic and options.input_placements is not None:
        raise ValueError("dynamic=True serves a range of whole-input shapes, but input_placements makes the "
                         "caller pass local shards of one shape: drop one of the two")
    build = functools.partial(_program, device_mesh=mesh, plan=plan, options=options, compile=compile)
    module = ParallelModule(model, mesh, build, plan=plan, local_inputs=options.input_placements is not None,
                            local_outputs=options.output_placements is not None)
    if example_inputs is not None:
        args, kwargs = _positional(example_inputs), dict(example_kwargs or {})
        microbatches = (plan.microbatches if plan is not None else options.microbatches) or 1
        module.build(*accumulated_inputs(args, kwargs, mesh_spec, options, microbatches))
    elif regime.fsdp and mesh_spec.sizes[data_axes(mesh_spec)[0]] > 1:
        raise ValueError("data_parallel='fsdp' shards the weights when the module is built: pass example_inputs "
                         "to parallelize, or data_parallel='ddp' to plan at the first call")
    return module


def _pipelined(model: torch.nn.Module, mesh, example_inputs, example_kwargs, plan: Plan | None, options: Options,
               compile: bool | str) -> ParallelModule:
    """A model over a mesh with a pipe axis: its stages built now (the cut needs the example's shapes)."""
    if example_inputs is None:
        raise ValueError("a pipe axis cuts the model into stages as parallelize builds it: pass example_inputs (one "
                         "step's whole batch, which the schedule splits into microbatches)")
    args, kwargs = _positional(example_inputs), dict(example_kwargs or {})
    plan, run = build_pipeline(model, args, kwargs, device_mesh=mesh, plan=plan, options=options, compile=compile)
    module = ParallelModule(model, mesh, None, plan=plan)
    module.use_pipeline(run)
    return module


def _resolved(options: Options, device_mesh, plan: Plan | None) -> Options:
    """parallelize's options with its defaults filled in: the mesh's device, the given plan's data-parallel mode."""
    if options.device is None:
        options = replace(options, device=device_of(device_mesh))
    if plan is not None and options.data_parallel is None:
        options = replace(options, data_parallel=plan.data_parallel)
    return options


def _program(model: torch.nn.Module, args: tuple, kwargs: dict, *, device_mesh, plan: Plan | None,
             options: Options, compile: bool | str, pinned: dict[str, Placements] | None = None,
             reuse: Program | None = None, units: FsdpUnits | None = None) -> Program:
    """One rank's program: capture, plan (unless given), materialize its shards (and FSDP's units), rewrite,
    compile. `units`: the FSDP units the first program made, which later ones run through.

    `pinned` (parameter FQN -> placements): the model is sharded already and is planned again for
    new input shapes with its parameters where they are, so the optimizer's DTensors stay valid.
    `options.dynamic`: capture with symbolic sizes (Program.symbolic) so that the plan serves their range;
    `reuse`: such a program whose range holds these inputs: its plan, where legal at these sizes.
    """
    mesh = MeshSpec.of(device_mesh)
    check_group(device_mesh, mesh)
    regime = options.regime(mesh)
    captured, symbolic, failed = _captured(model, args, kwargs, regime, options, reuse)
    follow_rank0_order(captured)  # before any plan names its nodes
    try:
        if failed is None and reuse is not None:
            plan = _reused(captured, reuse.plan)
            symbolic = symbolic if plan is not None else None
        if failed is None and plan is not None:
            check_plan(plan, mesh, captured, regime)
    except Exception as e:  # noqa: BLE001 -- told to the other ranks first (none waits for this one), then raised
        failed = e
    if failed is not None:
        plan_fact = f"none: {(str(failed) or type(failed).__name__).splitlines()[0]}"
    else:
        plan_fact = "to be made on rank 0" if plan is None else plan.fingerprint()
    # every rank agrees on the model and on the plan, or on what rank 0 is to plan, before it is made
    facts = program_facts(captured) if captured is not None else {"model": f"not captured ({plan_fact})"}
    check_agreement({**facts, "plan": plan_fact, "options": options.describe()})
    if failed is not None:
        raise failed
    if plan is None:
        pins = {ph: pinned[fqn] for ph, fqn in captured.params.items()} if pinned else {}
        plan = planned_on_rank0(lambda: accumulated(planned_or_cached(captured, mesh, options, pins, regime),
                                                    options.microbatches or 1))
    check_same_values(values_to_agree(model, captured, args, kwargs, weights=pinned is None,
                                      whole_inputs=options.input_placements is None))
    rank = RankView.of(device_mesh, mesh)
    if pinned is None:
        materialize_model(model, plan.param_placements, device_mesh, rank.coord)
        units = shard_in_units(model, captured, plan, device_mesh, regime)
    # Inputs that do not require grad skip these gradient collectives at run time.
    differentiable = frozenset(n for n, v in zip(captured.inputs, captured.input_values) if value_carries_grad(v))
    gm = rewrite(captured, plan, rank, training=options.training, inputs_with_grad=differentiable)
    split, pieces = split_layers(gm, captured, plan, units.layer_of if units else None)
    return Program(captured, plan, rank, gm, runnable(split, pieces, units, compile), regime.precision, symbolic,
                   units)


def _captured(model: torch.nn.Module, args: tuple, kwargs: dict, regime, options: Options, reuse: Program | None
              ) -> tuple[Captured | None, Captured | None, Exception | None]:
    """(this rank's capture, its symbolic capture, why it failed): the lowering shared where the ranks traced
    one program, a failure kept to be told to the other ranks first (none waits for this one)."""
    captured, symbolic, failed, shared = None, None, None, SharedLowering()
    try:
        refuse_backward_hooks(model)  # the program's backward runs none of them
        if reuse is not None:
            symbolic = reuse.symbolic
        else:
            symbolic = _symbolic(model, args, kwargs, regime) if options.dynamic else None
        captured = at_sizes(symbolic, args, kwargs) if symbolic else capture_for(model, args, kwargs, regime, shared)
    except LoweringExchangeError:  # a rank stopped: no later exchange would complete either
        raise
    except Exception as e:  # noqa: BLE001 -- returned: told to the other ranks first, then raised
        failed = e
    shared.join()
    return captured, symbolic, failed


def _reused(captured: Captured, plan: Plan) -> Plan | None:
    """`plan` at the captured sizes, or None, logged, where a decision does not apply there."""
    try:
        return plan_at_shapes(captured, plan)
    except ValueError as e:
        log.info("autojigsaw: dynamic=True: the plan does not apply to input shapes %s (%s); planning them "
                 "with the parameters as placed", captured.input_shapes, e)
        return None
