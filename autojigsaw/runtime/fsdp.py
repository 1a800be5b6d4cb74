"""FSDP2 on the data axis, one unit per repeated layer: `parallelize` shards the weights over it when the
regime says "fsdp".

The rewritten program is one graph that takes every weight as an input, so FSDP cannot wrap the
model's own modules. Each repeated layer whose weights only it reads (modules.layer_units) gets a
holder module of those weights, `fully_shard`ed; the program's stretch of nodes for that layer
runs through it, so FSDP gathers the layer's weights before it runs, frees them after, gathers
them again for its backward and reduce-scatters their gradients when it is done, as torchtitan's
per-block wrapping does. A root holder, the units' parent, keeps every other weight (embeddings,
a tied head, final norms) gathered for the whole forward and the whole backward. The model's
modules are pointed at the sharded parameters, which the optimizer and checkpoints see. A scalar
parameter (CLIP's logit_scale) has no dim for FSDP to shard: it stays parallelize's whole DTensor, and the
program sums its gradient over the data axis, as under DDP. Weights the plan splits over the data axis
itself (routed experts it dispatches tokens to there) stay its DTensors too.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.fx import GraphModule

from ..capture import Captured
from ..mesh import MeshSpec
from ..modules import fsdp_shards, layer_units
from ..plan import Plan
from ..training import Regime, data_axes


class WeightHolder(nn.Module):
    """A module holding weights under their graph placeholders' names (an FSDP unit, or a pipeline stage)."""

    def hold(self, params: dict[str, nn.Parameter]) -> None:
        for name, p in params.items():
            self.register_parameter(name, p)

    def local(self, placeholder: str) -> torch.Tensor:
        """This rank's tensor of a weight (gathered while FSDP runs this unit)."""
        p = getattr(self, placeholder)
        return p.to_local() if isinstance(p, DTensor) else p


class _Holder(WeightHolder):
    """The weights of one FSDP unit; it runs the piece that reads them."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        self.hold(params)

    def forward(self, run: Callable, slots: dict[int, str], *args):
        """run(*args) with args[k] this rank's gathered weight `slots[k]`."""
        args = list(args)
        for k, name in slots.items():
            args[k] = self.local(name)
        return run(*args)


class _InUnit(nn.Module):
    """A layer's piece of the program, run through its FSDP unit."""

    def __init__(self, unit: _Holder, piece: nn.Module, slots: dict[int, str]):
        super().__init__()
        self.piece, self.slots = piece, slots
        object.__setattr__(self, "unit", unit)  # not a submodule: one unit serves the program of every input shape

    def forward(self, *args):
        with warnings.catch_warnings():
            # FSDP warns of an in-place op on a returned view; the program's graph makes none
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            return self.unit(self.piece, self.slots, *args)


@dataclasses.dataclass(frozen=True)
class FsdpUnits:
    """The FSDP units of a model's weights: placeholder -> layer for the layers' own, the root for the rest."""

    root: WeightHolder
    layer_of: dict[str, str]
    units: dict[str, _Holder]

    def feed(self, placeholder: str, whole: torch.Tensor) -> torch.Tensor | None:
        """A weight as the program reads it now (within `run`): a root weight as gathered, None for a layer's
        (its unit gives it to its piece), `whole` (this rank's tensor) for one FSDP leaves whole (a scalar)."""
        if placeholder in self.layer_of:
            return None
        return self.root.local(placeholder) if placeholder in self.root._parameters else whole

    def run(self, program: Callable[[], object]):
        """program() within the root unit: its weights gathered, the layers' units inside it (a pipeline stage,
        the root itself, runs its program in its own forward instead)."""
        return self.root(program, {})

    def wrap(self, split: GraphModule, pieces: dict[str, str], runs: dict[str, nn.Module]) -> None:
        """Every piece of `split` replaced by its run (`runs`: compiled, FSDP's hooks outside torch.compile),
        each layer's piece (`pieces`: submodule name -> layer) through its unit."""
        seen = set()
        for name, piece in list(split.named_children()):
            run = runs[name]
            layer = pieces.get(name)
            if layer not in self.units:
                setattr(split, name, run)
                continue
            if layer in seen:
                raise RuntimeError(f"autojigsaw: layer {layer!r} runs in two stretches of the rewritten program, "
                                   "so its FSDP unit would gather its weights twice; please report it")
            seen.add(layer)
            inner = getattr(piece, "module", piece)  # under checkpoint: the layer's own graph
            placeholders = [n.name for n in inner.graph.nodes if n.op == "placeholder"]
            slots = {k: ph for k, ph in enumerate(placeholders) if self.layer_of.get(ph) == layer}
            setattr(split, name, _InUnit(self.units[layer], run, slots))
        for node in split.graph.nodes:  # a layer's weight exists only while its unit runs
            if node.op == "placeholder" and node.name in self.layer_of:
                outside = [u.name for u in node.users if pieces.get(u.target) != self.layer_of[node.name]]
                if outside:
                    raise RuntimeError(f"autojigsaw: weight {node.name!r} of FSDP unit {self.layer_of[node.name]!r} "
                                       f"is read outside its layer, by {outside}; please report it")


def shard_in_units(model: nn.Module, captured: Captured, plan: Plan, device_mesh, regime: Regime, *,
                   stage: WeightHolder | None = None) -> FsdpUnits | None:
    """`fully_shard` the model's weights over the data axis in per-layer units with the run's mixed precision;
    None without FSDP or a data axis. Call it once, after the weights are placed and before the optimizer is made.

    `stage`: a pipeline stage's module, made the root unit (PyTorch's PipelineStage then keeps its weights
    gathered and their gradients unsharded until its last microbatch, and reduce-scatters once); its units
    keep their weights gathered after forward (reshard_after_forward=False, as torchtitan does under pipelining).
    The model holds only this stage's weights (and other stages' that FSDP units hold already)."""
    axes = data_axes(MeshSpec.of(device_mesh))
    if not regime.fsdp or not axes or device_mesh.mesh.shape[axes[0]] == 1:
        return None
    axis = device_mesh.mesh_dim_names[axes[0]]
    _check_one_dtype(model, axis)
    split = plan.split_over_data(captured.params)
    layer_of = layer_units(list(captured.gm.graph.nodes), captured.params, split)
    by_unit, whole = _unit_params(model, captured, layer_of, split, rest=stage is None)
    units = {layer: _Holder(params) for layer, params in by_unit.items() if layer is not None}
    root = _Holder(by_unit[None]) if stage is None else stage
    if stage is not None:
        stage.hold({**by_unit[None], **whole})  # FSDP leaves the whole ones (scalars) to the graph's sums
    root.units = nn.ModuleList(units.values())
    precision = regime.precision
    policy = MixedPrecisionPolicy(param_dtype=precision.param_dtype if precision.mixed else None,
                                  reduce_dtype=precision.reduce_dtype if precision.mixed else None,
                                  cast_forward_inputs=False)
    old = {id(p): (holder, name) for holder in (root, *units.values()) for name, p in holder._parameters.items()
           if name not in whole}
    with torch.inference_mode(False):  # shards made under inference_mode could never train
        for holder in (*units.values(), root):  # children first: the root keeps what they leave
            fully_shard(holder, mesh=device_mesh, dp_mesh_dims=DataParallelMeshDims(shard=axis),
                        reshard_after_forward=stage is None, mp_policy=policy,
                        ignored_params=set(whole.values()) if holder is root else None)
            # FSDP2 makes its gathered weights' buffers at the first gather: in a first forward under
            # inference_mode (a check before training) they would be inference tensors, and every later
            # step fails. One gather now (as much memory as the unit's weights) makes them normal ones.
            holder.unshard()
            holder.reshard()
            holder.set_gradient_divide_factor(1.0)
            holder.set_force_sum_reduction_for_comms(True)
    for module in model.modules():  # the model's modules (and so the optimizer) hold the shards
        for name, p in module._parameters.items():
            if p is not None and id(p) in old:
                holder, key = old[id(p)]
                module._parameters[name] = holder._parameters[key]
    return FsdpUnits(root, layer_of, units)


def _unit_params(model: nn.Module, captured: Captured, layer_of: dict[str, str], split: frozenset[str], *,
                 rest: bool) -> tuple[dict, dict]:
    """The weights FSDP shards, by unit (a layer, None: the root's) and named by placeholder, and those it
    leaves whole (scalars, and `split`: those the plan splits over the data axis, routed experts dispatched
    there); `rest`: the model's weights the program does not read join the root."""
    by_unit: dict[str | None, dict[str, nn.Parameter]] = {None: {}}
    whole: dict[str, nn.Parameter] = {}
    placed = set()
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    for placeholder, fqn in captured.params.items():
        p = model.get_parameter(fqn)
        placed.add(id(p))
        if fsdp_shards(nodes[placeholder], split=placeholder in split):
            by_unit.setdefault(layer_of.get(placeholder), {})[placeholder] = p
        else:
            whole[placeholder] = p
    if rest:
        by_unit[None].update({f"unused_{k}": p for k, (fqn, p) in enumerate(model.named_parameters())
                              if id(p) not in placed and fsdp_shards(p)})
    return by_unit, whole


def _check_one_dtype(module: torch.nn.Module, axis: str) -> None:
    """FSDP2 shards a module's parameters as one flat group of one dtype (else a bare AssertionError)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, p in module.named_parameters():
        if fsdp_shards(p):
            by_dtype.setdefault(p.dtype, []).append(name)
    if len(by_dtype) > 1:
        dtype, names = min(by_dtype.items(), key=lambda kv: len(kv[1]))
        raise ValueError(
            f"data_parallel='fsdp' on mesh axis {axis!r} shards the parameters as one group of one dtype, but they "
            f"have dtypes {sorted(str(d) for d in by_dtype)} ({names[0]!r} is {dtype}). "
            "Give every parameter one dtype (a complex weight as a real one of shape [..., 2], "
            "torch.view_as_complex in the forward), or use data_parallel='ddp'")
