"""ParallelModule: what `autojigsaw.parallelize` returns.

Its parameters are DTensors under the model's own names, so optimizers, clip_grad_norm_,
torch.distributed.checkpoint and `.full_tensor()` work unchanged. Its forward feeds the
local shards to the rewritten graph (compiled by default). By default it takes the whole
inputs, the same on every rank, and returns whole outputs.

A model built under `autojigsaw.meta_init()` gets its shards one parameter at a time. A mesh
axis named "data" (or "dp") is pure data parallelism (runtime/data_parallel.py); FSDP2's
`fully_shard(module, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="data"))` can then shard
the weights over it, on top of the graph's own all-reduce of their gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ..api import plan_captured
from ..capture import capture
from ..dtypes import value_carries_grad
from ..kernels.collectives import shard_slice
from ..mesh import MeshSpec
from ..passes.recompute import checkpoint_layers
from ..passes.rewrite import RankView, rewrite
from ..placements import local_shape
from ..plan import Plan
from ..training import Regime, data_axis
from .data_parallel import shard_over_data_axis
from .init import forget
from .materialize import local_view, materialize_buffers, shard_parameters


class ParallelModule(nn.Module):
    """A model sharded over a DeviceMesh by a Plan; call it like the original model."""

    def __init__(self, model: nn.Module, mesh, example_inputs=None, example_kwargs=None, *,
                 compile: bool = True, training: bool = True, memory_budget: int | None = None,
                 device=None, input_placements=None, output_placements=None,
                 plan: Plan | None = None, mp_policy=None, activation_checkpointing: str = "none",
                 data_parallel: str | None = None):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "_model", model)
        self.device_mesh = mesh
        self.mesh = MeshSpec.of(mesh)
        self.regime = Regime.of(self.mesh, mp_policy=mp_policy, activation_checkpointing=activation_checkpointing,
                                data_parallel=data_parallel if plan is None or data_parallel else plan.data_parallel)
        self._mp_policy = mp_policy
        self._options = dict(compile=compile, training=training, memory_budget=memory_budget,
                             device=device or _device_of(mesh), input_placements=input_placements,
                             output_placements=output_placements)
        self.plan = plan
        self._program = None
        if example_inputs is not None:
            self._build(tuple(example_inputs), dict(example_kwargs or {}))
            shard_over_data_axis(self, mesh, self.regime, mp_policy)
        elif self.regime.fsdp and self.mesh.sizes[data_axis(self.mesh)] > 1:
            raise ValueError("data_parallel='fsdp' shards the weights when the module is built: pass "
                             "example_inputs to parallelize, or data_parallel='ddp' to plan at the first call")

    # ------------------------------------------------------------ building

    def _build(self, args: tuple, kwargs: dict) -> None:
        _check_group(self.device_mesh, self.mesh)
        opts = self._options
        precision = self.regime.precision
        captured = capture(self._model, args, kwargs, param_dtype=precision.param_dtype if precision.mixed else None)
        if self.plan is None:
            self.plan = plan_captured(captured, self.mesh, device=opts["device"], training=opts["training"],
                                      memory_budget=opts["memory_budget"],
                                      input_placements=opts["input_placements"],
                                      output_placements=opts["output_placements"], regime=self.regime)
        elif self.plan.mesh != self.mesh:
            raise ValueError(f"the plan was made for mesh {self.plan.mesh.describe()} but the module "
                             f"runs on {self.mesh.describe()}: plan again for this mesh")
        _check_agreement(self.plan)
        coord = tuple(self.device_mesh.get_coordinate())
        groups = tuple(self.device_mesh.get_group(a).group_name for a in self.mesh.axis_names)
        self._rank = RankView(self.mesh, coord, groups)
        recorded = [t for t in (*self._model.parameters(), *self._model.buffers()) if t.is_meta]
        shard_parameters(self._model, self.plan.param_placements, self.device_mesh, coord)
        materialize_buffers(self._model)
        forget(recorded)
        self._parameters.update(self._model._parameters)  # the model's own, now sharded
        self._buffers.update(self._model._buffers)
        # Inputs that do not require grad skip these gradient collectives at run time.
        differentiable = frozenset(n for n, v in zip(captured.inputs, captured.input_values)
                                   if value_carries_grad(v))
        gm = rewrite(captured, self.plan, self._rank, training=opts["training"], inputs_with_grad=differentiable)
        gm = checkpoint_layers(gm, captured, self.plan)
        self._captured = captured
        self._graph = gm
        self._program = torch.compile(gm, fullgraph=True) if opts["compile"] else gm

    # ------------------------------------------------------------ running

    def forward(self, *args, **kwargs):
        if self._program is None:
            self._build(args, kwargs)
        captured, plan, rank = self._captured, self.plan, self._rank
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise ValueError(f"the module was planned for inputs structured as {captured.in_spec}, "
                             f"got {spec}; call it as in the example inputs")
        inputs = iter(self._local_inputs(flat))
        feeds = []
        for node in captured.gm.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in captured.params:
                feeds.append(self._compute_copy(self._model.get_parameter(captured.params[node.name]).to_local()))
            elif node.name in captured.buffers and _has_buffer(self._model, captured.buffers[node.name]):
                # The module's own buffer (made real from meta, or loaded) over export's copy of it.
                buf = self._model.get_buffer(captured.buffers[node.name])
                if captured.buffers[node.name] in captured.mutated_buffers:
                    buf = buf.clone()  # written back below, while autograd may still hold the old value
                feeds.append(local_view(buf, plan.node(node.name).output, self.mesh.sizes, rank.coord))
            elif node.name in captured.constants:
                feeds.append(captured.constants[node.name])
            else:
                feeds.append(next(inputs))
        outs = self._program(*feeds)
        # export returns a buffer's new value (BatchNorm's running statistics) before the outputs
        mutated, outs = outs[:len(captured.mutated_buffers)], outs[len(captured.mutated_buffers):]
        with torch.no_grad():
            for name, value in zip(captured.mutated_buffers, mutated):
                self._model.get_buffer(name).copy_(value)
        out_dtype = self.regime.precision.output_dtype
        if out_dtype is not None:
            outs = [o.to(out_dtype) if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in outs]
        return pytree.tree_unflatten(list(outs), captured.out_spec)

    def _compute_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A floating parameter or input in the dtype the graph computes in (mixed precision)."""
        precision = self.regime.precision
        if precision.mixed and t.is_floating_point():
            return t.to(precision.param_dtype)  # differentiable: the gradient comes back in t's dtype
        return t

    def _local_inputs(self, flat: list) -> list:
        """The user's inputs as the graph wants them: this rank's shards."""
        given_local = self._options["input_placements"] is not None
        out = []
        for x, name, pl, shape in zip(flat, self._captured.inputs, self.plan.input_placements,
                                      self._captured.input_shapes):
            if not isinstance(x, torch.Tensor) or pl is None:
                out.append(x)
                continue
            want = local_shape(shape, pl, self.mesh.sizes, self._rank.coord) if given_local else shape
            if tuple(x.shape) != tuple(want):
                what = "this rank's shard" if given_local else "the whole input"
                raise ValueError(f"input {name!r} has shape {tuple(x.shape)} but the plan expects "
                                 f"{what} of shape {tuple(want)}: pass inputs shaped like the example "
                                 "inputs, or parallelize again for the new shape")
            out.append(self._compute_copy(x if given_local else _slice(x, pl, self._rank)))
        return out


def _slice(x: torch.Tensor, placements, rank: RankView) -> torch.Tensor:
    """This rank's shard of a whole input, with a gradient path back to it."""
    if not x.requires_grad:
        return local_view(x, placements, rank.mesh.sizes, rank.coord)
    from torch.distributed.tensor import Shard

    from ..placements import chunk_sizes

    for a, p in enumerate(placements):
        if isinstance(p, Shard) and rank.mesh.sizes[a] > 1:
            sizes = chunk_sizes(x.shape[p.dim], rank.mesh.sizes[a])
            x = shard_slice(x, dim=p.dim, sizes=sizes, coord=rank.coord[a],
                            axis=rank.mesh.axis_names[a], group=rank.groups[a], grad="R")
    return x


def _has_buffer(model: nn.Module, fqn: str) -> bool:
    module, _, name = fqn.rpartition(".")
    try:
        return name in model.get_submodule(module)._buffers
    except AttributeError:
        return False


def _device_of(mesh) -> str:
    kind = getattr(mesh, "device_type", "cpu")
    if kind == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        return next((d for d in ("h200", "h100", "a100") if d in name), "h100")
    return "cpu"


def _check_group(device_mesh, mesh: MeshSpec) -> None:
    if not dist.is_initialized():
        raise ValueError("parallelize needs a process group: call torch.distributed.init_process_group "
                         "(or run under torchrun) and pass a DeviceMesh; autojigsaw.plan needs none")
    if not hasattr(device_mesh, "get_group"):
        raise ValueError("parallelize needs a torch DeviceMesh (init_device_mesh(..., mesh_dim_names=...)); "
                         "a mapping of axis sizes only works with autojigsaw.plan")
    if mesh.world_size != dist.get_world_size():
        raise ValueError(f"the mesh {mesh.describe()} has {mesh.world_size} ranks but the process group "
                         f"has {dist.get_world_size()}: make the mesh cover every rank")


def _check_agreement(plan: Plan) -> None:
    """Every rank must run the same plan, or collectives would not match up."""
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, plan.fingerprint())
    if len(set(prints)) != 1:
        raise ValueError(f"ranks planned differently (plan fingerprints {sorted(set(prints))}): give every "
                         "rank the same model, inputs and options, or plan once and pass plan=")
