"""The recipe: capture -> strategies -> costs -> solve -> Plan; then rewrite -> materialize -> compile.

`plan` runs the first half on any mesh without a process group; `parallelize` runs all of it on
each rank (at the first call when no example inputs are given; rank 0 alone plans and sends the
plan) and hands the result to a ParallelModule, which only holds and runs it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate

from .capture import Captured, at_sizes, capture, refuse_backward_hooks
from .capture.order import without_device_indices
from .cost_model.devices import DeviceSpec, device_spec
from .cost_model.estimate import CostContext
from .cost_model.in_flight import with_in_flight
from .cost_model.recompute import repeated_layers
from .cost_model.regime import with_fsdp_traffic, with_regime
from .cost_model.memory import Optimizer, OptimizerName, optimizer_spec
from .dtypes import value_carries_grad
from .ir import grads_by_name
from .mesh import MeshSpec, RankView
from .options import Options
from .placements import Placement, Placements, normalize
from .plan import Plan, PlanStats
from .planner import build_problem, solve
from .planner.assemble import assemble, fixed_solution
from .planner.errors import infeasible_error
from .planner.recompute import solve_with_recompute, with_layers_recomputed
from .planner.reuse import plan_at_shapes
from .rewrite.recompute import split_layers
from .rewrite.rewrite import rewrite
from .rewrite.traffic import traffic_by_origin
from .runtime.checks import check_agreement, check_group, check_plan, default_budget, device_of
from .runtime.fsdp import FsdpUnits, shard_in_units
from .runtime.materialize import materialize_model
from .runtime.module import ParallelModule, Program
from .runtime.one_plan import planned_on_rank0
from .runtime.one_program import follow_rank0_order
from .runtime.regional import compile_pieces
from .runtime.same_values import check_same_values, values_to_agree
from .strategies.annotate import annotate
from .strategies.data_pins import data_pins
from .training import Precision, Regime, data_axes

log = logging.getLogger("autojigsaw")


def _check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"the model must be a torch.nn.Module, got {type(model).__name__}: wrap a function in a "
                         "Module whose forward calls it")


def _positional(example_inputs) -> tuple:
    """The example's positional inputs as a tuple; a lone tensor is the one input (tuple() of it would
    split its first dim into inputs, and plan for another shape)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (Mapping, str)) or not isinstance(example_inputs, Sequence):
        raise ValueError(f"example_inputs must be a tuple of the forward's positional inputs, got a "
                         f"{type(example_inputs).__name__}: pass (x,) for one input, and keyword inputs as "
                         "example_kwargs=")
    return tuple(example_inputs)


def capture_for(model: torch.nn.Module, args: tuple, kwargs: dict, regime: Regime) -> Captured:
    """The model's graph as the regime runs it (floating parameters and inputs in param_dtype)."""
    precision = regime.precision
    return capture(model, args, kwargs, param_dtype=precision.param_dtype if precision.mixed else None)


def plan(model: torch.nn.Module, example_inputs: Sequence, mesh, *, example_kwargs: Mapping | None = None,
         **options) -> Plan:
    """Plan `model` on `mesh` (a DeviceMesh or e.g. {"domain": 8, "tensor": 8}); runs nothing.

    No process group is needed and the model may live on the meta device. Returns a Plan:
    print it, save it (`to_json`), or pass it to `parallelize(plan=...)`.

    - `example_inputs`: the positional inputs of one call (tensors, may be `stand_in`s);
      `example_kwargs`: its keyword inputs. The plan is priced at their shapes.
    - `**options`: the fields of autojigsaw.Options as keywords (`device=`, `memory_budget=`,
      `activation_checkpointing=`, ...), each documented there: help(autojigsaw.Options).

        import autojigsaw, torch
        plan = autojigsaw.plan(model, (torch.randn(8, 1024, 512),), {"domain": 8, "tensor": 8},
                               device="h100", memory_budget=60 * 2**30)
        print(plan)  # the table, the predicted seconds per step, bytes per rank
    """
    _check_model(model)
    options = Options.from_keywords(options, "plan")
    mesh = MeshSpec.of(mesh)
    regime = options.regime(mesh)
    args, kwargs = _positional(example_inputs), dict(example_kwargs or {})
    symbolic = _symbolic(model, args, kwargs, regime) if options.dynamic else None
    captured = at_sizes(symbolic, args, kwargs) if symbolic else capture_for(model, args, kwargs, regime)
    return plan_captured(captured, mesh, options)


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
    if options.dynamic and options.input_placements is not None:
        raise ValueError("dynamic=True serves a range of whole-input shapes, but input_placements makes the "
                         "caller pass local shards of one shape: drop one of the two")
    build = functools.partial(_program, device_mesh=mesh, plan=plan, options=options, compile=compile)
    module = ParallelModule(model, mesh, build, plan=plan, local_inputs=options.input_placements is not None,
                            local_outputs=options.output_placements is not None)
    if example_inputs is not None:
        module.build(_positional(example_inputs), dict(example_kwargs or {}))
    elif regime.fsdp and mesh_spec.sizes[data_axes(mesh_spec)[0]] > 1:
        raise ValueError("data_parallel='fsdp' shards the weights when the module is built: pass example_inputs "
                         "to parallelize, or data_parallel='ddp' to plan at the first call")
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
    captured, symbolic, failed = None, None, None
    try:
        refuse_backward_hooks(model)  # the program's backward runs none of them
        if reuse is not None:
            symbolic = reuse.symbolic
        else:
            symbolic = _symbolic(model, args, kwargs, regime) if options.dynamic else None
        captured = at_sizes(symbolic, args, kwargs) if symbolic else capture_for(model, args, kwargs, regime)
    except Exception as e:  # noqa: BLE001 -- told to the other ranks first (none waits for this one), then raised
        failed = e
    follow_rank0_order(captured)  # before any plan names its nodes
    try:
        if failed is None and reuse is not None:
            plan = _reused(captured, reuse.plan)
            symbolic = symbolic if plan is not None else None
        if failed is None and plan is not None:
            check_plan(plan, mesh, captured, regime)
    except Exception as e:  # noqa: BLE001 -- as above
        failed = e
    if failed is not None:
        plan_fact = f"none: {(str(failed) or type(failed).__name__).splitlines()[0]}"
    else:
        plan_fact = "to be made on rank 0" if plan is None else plan.fingerprint()
    # every rank agrees on the model and on the plan, or on what rank 0 is to plan, before it is made
    facts = _facts(captured) if captured is not None else {"model": f"not captured ({plan_fact})"}
    check_agreement({**facts, "plan": plan_fact, "options": options.describe()})
    if failed is not None:
        raise failed
    if plan is None:
        pins = {ph: pinned[fqn] for ph, fqn in captured.params.items()} if pinned else {}
        plan = planned_on_rank0(lambda: plan_captured(captured, mesh, options, pins))
    check_same_values(values_to_agree(model, captured, args, kwargs, weights=pinned is None,
                                      whole_inputs=options.input_placements is None))
    rank = RankView.of(device_mesh, mesh)
    if pinned is None:
        materialize_model(model, plan.param_placements, device_mesh, rank.coord)
        units = shard_in_units(model, captured, device_mesh, regime)
    # Inputs that do not require grad skip these gradient collectives at run time.
    differentiable = frozenset(n for n, v in zip(captured.inputs, captured.input_values) if value_carries_grad(v))
    gm = rewrite(captured, plan, rank, training=options.training, inputs_with_grad=differentiable)
    split, pieces = split_layers(gm, captured, plan, units.layer_of if units else None)
    return Program(captured, plan, rank, gm, _runnable(split, pieces, units, compile), regime.precision, symbolic,
                   units)


def _runnable(split: torch.fx.GraphModule, pieces, units: FsdpUnits | None, compile: bool | str) -> torch.nn.Module:
    """What runs the rewritten graph (split in layers): compiled whole, or under FSDP's units, whose hooks
    run between the pieces, each piece compiled on its own."""
    if units is not None and pieces:
        units.wrap(split, pieces, compile_pieces(split, functools.partial(_compiled, compile=compile)))
        return split
    return _compiled(split, compile)


def _compiled(gm: torch.fx.GraphModule, compile: bool | str) -> torch.nn.Module:
    """gm under torch.compile (fullgraph), with the backend `compile` names; gm itself if False."""
    if not compile:
        return gm
    return torch.compile(gm, fullgraph=True, backend=compile if isinstance(compile, str) else "inductor")


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


def _reused(captured: Captured, plan: Plan) -> Plan | None:
    """`plan` at the captured sizes, or None, logged, where a decision does not apply there."""
    try:
        return plan_at_shapes(captured, plan)
    except ValueError as e:
        log.info("autojigsaw: dynamic=True: the plan does not apply to input shapes %s (%s); planning them "
                 "with the parameters as placed", captured.input_shapes, e)
        return None


def _facts(captured: Captured) -> dict[str, str]:
    """What every rank must agree on before the step: the model's parameters, the input shapes and the
    traced program (a constant or a branch that differs by rank changes it; device indices do not)."""
    values = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes if n.op == "placeholder"}
    model = hashlib.sha256(repr([(fqn, tuple(values[ph].shape), str(values[ph].dtype))
                                 for ph, fqn in sorted(captured.params.items(), key=lambda kv: kv[1])]).encode())
    inputs = [(tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else repr(v) for v in captured.input_values]
    program = hashlib.sha256(without_device_indices(captured.gm.code).encode())
    return {"model": model.hexdigest()[:16], "inputs": repr(inputs), "program": program.hexdigest()[:16]}


def plan_captured(captured: Captured, mesh: MeshSpec, options: Options = Options(),
                  pinned: dict[str, Placements] | None = None, *, in_flight: int = 1) -> Plan:
    """The planning stages on an already captured graph: strategies, costs, solve, Plan.

    `options`: an autojigsaw.Options (its `dynamic` is the capture's, not read here);
    `pinned`: placeholder name -> placements every strategy must keep (parameters already sharded).
    `in_flight`: microbatches whose saved activations are held at once (a pipeline stage's).

        plan = plan_captured(capture(model, (x,)), MeshSpec.of({"tensor": 2}), Options(device="cpu"))
    """
    device, regime = options.device_spec(), options.regime(mesh)
    budget = int(options.memory_budget if options.memory_budget is not None else 0.9 * device.memory_bytes)
    t0 = time.perf_counter()
    fixed = {**_fixed_inputs(captured, mesh, options.input_placements), **(pinned or {})}
    annotate(captured.gm, mesh, data_pins(captured, mesh, fixed),
             _output_placements(captured, mesh, options.output_placements, options.training))
    t1 = time.perf_counter()
    ctx = CostContext(mesh, device, options.training, optimizer_spec(options.optimizer), regime)
    problem = _problem(captured, ctx, options.tie_layers)
    t2 = time.perf_counter()
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    policy = regime.recompute if options.training else "none"
    persistent = {i for i, name in enumerate(problem.names) if name in captured.params or name in captured.buffers}
    solver = options.solver or solve

    def held(p):
        return replace(p, memory=with_in_flight(p.memory, in_flight, persistent))

    chosen = solve_with_recompute(problem, [nodes[name] for name in problem.names], captured.params, policy,
                                  budget, lambda p, b, **kw: solver(held(p), b, **kw))
    problem, solution = held(chosen.problem), chosen.solution
    if solution is None:
        raise infeasible_error(captured, problem, mesh, budget, recompute=policy)
    t3 = time.perf_counter()
    planned = with_regime(assemble(captured, problem, solution, ctx, budget), ctx, chosen.layers)
    planned = with_fsdp_traffic(with_traffic(planned, captured), captured, ctx, problem.grad)
    return replace(planned, stats=PlanStats(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, problem.n_nodes,
                                            problem.n_groups, problem.n_binaries, solution.solves,
                                            len(solution.cuts), solution.gap))


def evaluate(plan: Plan, model: torch.nn.Module, example_inputs: Sequence, *, device: str | DeviceSpec,
             optimizer: OptimizerName | Optimizer = "adam", example_kwargs: Mapping | None = None,
             mp_policy: MixedPrecisionPolicy | None = None) -> Plan:
    """`plan` (planned, loaded or edited) with its costs predicted on `device`, to compare plans.

    `model`, `example_inputs` and `example_kwargs` are those the plan was made for. `device`
    (required here), `optimizer` and `mp_policy`: see autojigsaw.Options. The plan's other
    decisions, its recomputed layers (`plan.recompute`, editable) and data-parallel mode
    included, are priced as given. Returns the plan with new step_time (seconds),
    memory_per_rank and comm_bytes (bytes).

        on_a100 = autojigsaw.evaluate(plan, model, (x,), device="a100")
        print(on_a100.step_time, on_a100.memory_per_rank)
    """
    regime = Regime(Precision.of(mp_policy), "none", plan.data_parallel)
    captured = capture_for(model, _positional(example_inputs), dict(example_kwargs or {}), regime)
    fixed = {name: pl for name, pl in zip(captured.inputs, plan.input_placements) if pl is not None}
    annotate(captured.gm, plan.mesh, fixed, plan.output_placements)
    ctx = CostContext(plan.mesh, device_spec(device), plan.training, optimizer_spec(optimizer), regime)
    problem = _problem(captured, ctx, tie_layers=False)
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    nodes = [by_name[name] for name in problem.names]
    problem = with_layers_recomputed(problem, nodes, repeated_layers(nodes, captured.params), plan.recompute)
    evaluated = with_regime(assemble(captured, problem, fixed_solution(problem, plan), ctx, plan.memory_budget),
                            ctx, plan.recompute)
    return with_fsdp_traffic(with_traffic(evaluated, captured), captured, ctx, problem.grad)


def with_traffic(plan: Plan, captured: Captured) -> Plan:
    """The plan with exact bytes per node, read off the graph the plan rewrites into."""
    rank = RankView.planning(plan.mesh)
    gm = rewrite(captured, plan, rank, training=plan.training)
    traffic = traffic_by_origin(gm, rank, captured.trained_params, plan.training)
    nodes = tuple(replace(n, comm_bytes=traffic.get(n.name, 0)) for n in plan.nodes)
    return replace(plan, nodes=nodes, comm_bytes=sum(traffic.values()))


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
