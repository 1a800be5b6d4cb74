"""Planning from a model: `plan` (any mesh, no process group) and `evaluate` (a given plan priced).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numbers

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..cost_model.devices import DeviceSpec, device_spec
from ..cost_model.estimate import CostContext
from ..cost_model.recompute import repeated_layers
from ..cost_model.regime import fsdp_layers, with_data_traffic, with_regime
from ..cost_model.memory import Optimizer, OptimizerName, optimizer_spec
from ..mesh import MeshSpec
from ..options import Options, check_imbalance
from ..plan import Plan
from ..planner.assemble import assemble, fixed_solution
from ..planner.recompute import with_layers_recomputed
from ..planner.reserved import allocator_facts, footprint
from ..strategies.annotate import annotate
from ..strategies.data_pins import data_pins
from ..training import Precision, Regime, data_axes

from .meshes import plan_on_gpus
from .pipelines import plan_model
from .recipe import capture_for, with_traffic, _problem

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
    args, kwargs = _positional(example_inputs), dict(example_kwargs or {})
    if isinstance(mesh, numbers.Integral) and not isinstance(mesh, bool):
        return plan_on_gpus(model, args, kwargs, int(mesh), options)
    return plan_model(model, args, kwargs, MeshSpec.of(mesh), options)


def best_mesh(model: torch.nn.Module, example_inputs: Sequence, world_size: int, *,
              example_kwargs: Mapping | None = None, **options) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh `plan(model, example_inputs, world_size, example_kwargs=..., **options)` chooses for
    `world_size` GPUs, as init_device_mesh takes it: (sizes, names).

        sizes, names = autojigsaw.best_mesh(model, (x,), 512, device="a100", gpus_per_node=8)
        mesh = init_device_mesh("cuda", sizes, mesh_dim_names=names)
    """
    chosen = plan(model, example_inputs, world_size, example_kwargs=example_kwargs, **options).mesh
    return chosen.sizes, chosen.axis_names


def _data_axis_pins(captured, plan: Plan) -> dict:
    """The plan's input placements on its data axes, pinned as the planner pins them there (data_pins); its
    other axes free, as they were to the planner, so that every strategy it could choose is offered again (an
    input pinned whole offers no reader the slice of it the plan reads)."""
    axes = set(data_axes(plan.mesh))
    pins = {name: tuple(p if a in axes else None for a, p in enumerate(placements))
            for name, placements in zip(captured.inputs, plan.input_placements) if placements is not None}
    return data_pins(captured, plan.mesh, pins)


def evaluate(plan: Plan, model: torch.nn.Module, example_inputs: Sequence, *, device: str | DeviceSpec,
             optimizer: OptimizerName | Optimizer = "adam", example_kwargs: Mapping | None = None,
             mp_policy: MixedPrecisionPolicy | None = None, moe_imbalance: float | None = None) -> Plan:
    """`plan` (planned, loaded or edited) with its costs predicted on `device`, to compare plans.

    `model`, `example_inputs` and `example_kwargs` are those the plan was made for. `device`
    (required here), `optimizer`, `mp_policy` and `moe_imbalance` (None: the plan's): see
    autojigsaw.Options. The plan's other decisions, its recomputed layers (`plan.recompute`,
    editable) and data-parallel mode included, are priced as given. Returns the plan with new
    step_time (seconds), memory_per_rank and comm_bytes (bytes).

        on_a100 = autojigsaw.evaluate(plan, model, (x,), device="a100")
        print(on_a100.step_time, on_a100.memory_per_rank)
    """
    regime = Regime(Precision.of(mp_policy), "none", plan.data_parallel, whole_inputs=plan.whole_inputs)
    captured = capture_for(model, _positional(example_inputs), dict(example_kwargs or {}), regime)
    annotate(captured.gm, plan.mesh, _data_axis_pins(captured, plan), plan.output_placements)
    imbalance = plan.moe_imbalance if moe_imbalance is None else moe_imbalance
    check_imbalance(imbalance)
    device = device_spec(device)
    ctx = CostContext(plan.mesh, device, plan.training, optimizer_spec(optimizer), regime, imbalance,
                      fsdp_layers(captured, regime))
    problem = _problem(captured, ctx, tie_layers=False)
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    nodes = [by_name[name] for name in problem.names]
    problem = with_layers_recomputed(problem, nodes, repeated_layers(nodes, captured.params), plan.recompute)
    solution = fixed_solution(problem, plan)
    facts = allocator_facts(nodes, captured.params, problem.grad, ctx.device, training=plan.training)
    held = footprint(problem, solution.choice, facts, ctx.device, plan.memory_budget or ctx.device.memory_bytes)
    evaluated = with_regime(assemble(captured, problem, solution, ctx, plan.memory_budget, held), ctx, plan.recompute)
    evaluated = replace(evaluated, moe_imbalance=imbalance, whole_inputs=plan.whole_inputs)
    return with_data_traffic(with_traffic(evaluated, captured), captured, ctx, problem.grad)
