"""Pipeline stages at run time: each pipe rank runs its stages' programs under PyTorch's own schedule.

Every stage this rank runs is a Program (its cut of the captured program, rewritten for its plan on
the other axes), wrapped in a `StageModule` and a `PipelineStage` of torch.distributed.pipelining
that is told the local shapes of what the stage receives and sends (static metadata: a stage never
runs on made-up inputs). `PipelineRun.step` steps PyTorch's schedule class: it splits the whole
batch into microbatches and keeps the last stage's losses, each divided by the number of microbatches
(so that the gradients sum to the whole batch's mean, as gradient accumulation does), whose sum goes
to every rank of the pipe axis. A weight that stages on two pipe ranks read (a tied
embedding and head) has its gradient summed over the pipe axis after the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..mesh import MeshSpec
from ..placements import local_shape
from ..plan import Pipeline
from ..training import Regime, data_axes, pipe_axis
from .fsdp import WeightHolder


class _ContiguousGradient(torch.autograd.Function):
    """Identity; its gradient made contiguous (gloo sends only contiguous tensors to the stage before)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class StageModule(WeightHolder):
    """One stage's program as a PipelineStage runs it: it takes what the stage before sends (the first stage: the
    model's whole inputs) and returns what it sends on, contiguous. It holds the weights the stage reads, under
    their placeholders' names (zero-bubble schedules run their gradients apart); under FSDP it is the stage's root
    unit, its layers' units its children. `call(flat)`, set once the program is built, runs it."""

    def __init__(self, *, first: bool):
        super().__init__()
        self.first = first
        self.call: Callable[[list], tuple] | None = None

    def forward(self, *args, **kwargs):
        flat = pytree.tree_leaves((args, kwargs)) if self.first else list(args)
        flat = [_ContiguousGradient.apply(x) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in flat]
        return tuple(o.contiguous() if isinstance(o, torch.Tensor) else o for o in self.call(flat))


def meta_like(values: Sequence[torch.Tensor], placements, mesh_sizes, coord, *, grad: bool) -> tuple:
    """Meta tensors of this rank's shards of `values` (what a stage receives or sends), floating ones needing
    a gradient when `grad`."""
    out = []
    for v, pl in zip(values, placements):
        shape = local_shape(tuple(v.shape), pl, mesh_sizes, coord) if pl is not None else tuple(v.shape)
        out.append(torch.empty(shape, dtype=v.dtype, device="meta", requires_grad=grad and v.is_floating_point()))
    return tuple(out)


@dataclass
class PipelineRun:
    """This rank's stages under a schedule: `step` runs one training step of every microbatch."""

    pipeline: Pipeline
    schedule: object
    stage_indices: tuple[int, ...]
    group: dist.ProcessGroup
    model: nn.Module
    # per weight read on several pipe ranks: its name here (None: this rank holds none), local shape and dtype
    tied: tuple[tuple[str | None, tuple[int, ...], torch.dtype], ...] = ()
    programs: tuple = ()  # this rank's stages' Programs
    loss_dtype: torch.dtype = torch.float32  # of the mean loss every rank returns (the model's, at least fp32)
    input_shapes: tuple = ()  # of the example's tensor inputs, whole: the stages' shapes are fixed at build
    stages: tuple = ()  # this rank's PipelineStages
    data_group: dist.ProcessGroup | None = None  # DDP's data axis, whose gradient sum runs after the schedule

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return len(self.pipeline.stages) - 1 in self.stage_indices

    def step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """Forward and backward of every microbatch; the mean loss, on every rank."""
        m = self.pipeline.microbatches
        self._check_inputs(args, kwargs)
        losses: list[torch.Tensor] = []
        target = torch.zeros(m) if self.has_last else None  # one per microbatch: the loss is the model's own
        if self.has_first:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        loss = (torch.stack([x.detach().to(self.loss_dtype) for x in losses]).sum() if losses
                else torch.zeros((), dtype=self.loss_dtype))
        last = self.pipeline.stages[-1].rank
        dist.broadcast(loss, src=dist.get_global_rank(self.group, last), group=self.group)
        self._sum_tied_gradients()
        if self.data_group is not None:
            sum_gradients([p for p in self.model.parameters()], self.data_group)
        return loss

    def _check_inputs(self, args: tuple, kwargs: dict) -> None:
        """Inputs shaped as the example's, checked on every rank before any stage runs (a stage that refused them
        alone would leave the others waiting for what it sends)."""
        m = self.pipeline.microbatches
        if batch_size(args, kwargs) % m:
            split_microbatches(args, kwargs, m)  # its ValueError names the batch and the microbatches
        shapes = tensor_shapes(args, kwargs)
        if shapes != self.input_shapes:
            raise ValueError(f"the pipeline's stages were built for inputs of shapes {list(self.input_shapes)} "
                             f"({m} microbatches of {self.input_shapes[0][0] // m} rows), got {list(shapes)}: pass "
                             "inputs shaped like the example inputs, or parallelize again with example inputs of "
                             "these shapes")

    def _sum_tied_gradients(self) -> None:
        """A weight read on several pipe ranks: each holds a copy whose gradient is its stages' share; sum them
        over the pipe axis (ranks without the weight add zeros) so that every copy steps alike."""
        for fqn, shape, dtype in self.tied:
            grad = self.model.get_parameter(fqn).grad if fqn is not None else None
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            dist.all_reduce(local if local is not None else torch.zeros(shape, dtype=dtype), group=self.group)


_STAGE_MESHES: dict = {}  # DeviceMesh -> its stage mesh, one object (FSDP and DTensor's caches compare meshes by identity)


def stage_device_mesh(device_mesh, mesh: MeshSpec):
    """The DeviceMesh a stage's weights are DTensors on: the mesh without its pipe axis; a 1-rank mesh (the pipe
    axis split off as a size-1 'tensor' axis, made by every rank) when there is no other axis. One per mesh."""
    if device_mesh in _STAGE_MESHES:
        return _STAGE_MESHES[device_mesh]
    axis = pipe_axis(mesh)
    names = tuple(n for a, n in enumerate(mesh.axis_names) if a != axis)
    if names:
        stage = device_mesh[names if len(names) > 1 else names[0]]
    else:
        flat = device_mesh.mesh.reshape(-1, 1)
        stage = DeviceMesh(device_mesh.device_type, flat, mesh_dim_names=(mesh.axis_names[axis], "tensor"))["tensor"]
    return _STAGE_MESHES.setdefault(device_mesh, stage)


def refuse_fsdp_in_two_stages(pipeline: Pipeline, stage_weights: Sequence[set[str]], regime: Regime,
                              sub: MeshSpec) -> None:
    """FSDP shards a weight in one unit: a weight that two stages of one pipe rank read (a tied embedding and head
    at the two ends of zero-bubble's V) cannot be in both stages' units. `stage_weights`: the FQNs each stage
    reads. Checked for every rank, on every rank (all refuse alike)."""
    axes = data_axes(sub)
    if not regime.fsdp or not axes or sub.sizes[axes[0]] == 1:
        return
    for r in range(pipeline.ranks):
        readers: dict[str, list[int]] = {}
        for st in pipeline.stages_of(r):
            for fqn in stage_weights[st.index]:
                readers.setdefault(fqn, []).append(st.index)
        shared = sorted((fqn, idx) for fqn, idx in readers.items() if len(idx) > 1)
        if shared:
            fqn, idx = shared[0]
            raise ValueError(f"weight {fqn!r} is read by stages {idx}, which pipe rank {r} both runs under "
                             f"{pipeline.schedule!r}, and FSDP (data_parallel='fsdp' on axis "
                             f"{sub.axis_names[axes[0]]!r}) shards a weight in one stage's units only: choose a "
                             "schedule that puts those stages on different pipe ranks ('1F1B', 'gpipe' or "
                             "'interleaved'), or data_parallel='ddp'")


def _split_over(p: nn.Parameter, group: dist.ProcessGroup) -> bool:
    """Whether DTensor `p` is sharded over the mesh axis whose process group is `group`."""
    if not isinstance(p, DTensor):
        return False
    mesh = p.device_mesh
    return any(pl.is_shard() and mesh.get_group(d).group_name == group.group_name
               for d, pl in enumerate(p.placements))


def drop_parameters(model: nn.Module, keep: set[str]) -> None:
    """Every parameter of `model` not in `keep` (FQNs) removed: another pipe rank's stages hold it."""
    kept = {id(model.get_parameter(fqn)) for fqn in keep}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in kept:
                module._parameters[name] = None


def make_stage(module: StageModule, index: int, count: int, device: torch.device, group, inputs: tuple,
               outputs: tuple) -> PipelineStage:
    """PyTorch's PipelineStage of one stage, its received and sent shapes given up front."""
    return PipelineStage(module, index, count, device, input_args=inputs, output_args=outputs, group=group)


def loss_reader(out_spec, microbatches: int) -> Callable[[tuple, object], torch.Tensor]:
    """The schedule's loss_fn: the model's own loss, read off the last stage's outputs, over `microbatches`: the
    gradients sum to the whole batch's mean (the schedule scales none; a weight that two stages of a rank read
    would be scaled twice)."""

    def loss_fn(output, target):
        return loss_of(pytree.tree_unflatten(list(output), out_spec)) / microbatches

    return loss_fn


def loss_dtype(captured) -> torch.dtype:
    """The dtype a step's mean loss comes back in: the loss's own, at least fp32; a ValueError, on every rank,
    when the model returns no loss."""
    outputs = [a.meta["val"] if hasattr(a, "meta") else a for a in captured.gm.graph.output_node().args[0]]
    loss = loss_of(pytree.tree_unflatten(outputs[len(captured.mutated_buffers):], captured.out_spec))
    return torch.promote_types(loss.dtype, torch.float32)


def loss_of(output) -> torch.Tensor:
    """The loss a model returns: a scalar, or a Hugging Face output's `.loss` (or its first element)."""
    if isinstance(output, torch.Tensor) and output.ndim == 0:
        return output
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if loss is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) \
            and output[0].ndim == 0:
        loss = output[0]
    if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
        raise ValueError("train_step needs a model that returns its loss: a scalar tensor, or an output with a scalar "
                         "`.loss` (a Hugging Face model given labels=); wrap the model in a Module whose forward "
                         "returns the loss")
    return loss


def batch_size(args: tuple, kwargs: dict) -> int:
    """The batch: dim 0 of the first tensor input (what microbatches split)."""
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor) and x.ndim > 0:
            return x.shape[0]
    raise ValueError("microbatches split the inputs along their first dim, and the model takes no tensor with one")


def tensor_shapes(args: tuple, kwargs: dict) -> tuple[tuple[int, ...], ...]:
    """The shapes of the tensor inputs, in order."""
    return tuple(tuple(x.shape) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))


def split_microbatches(args: tuple, kwargs: dict, microbatches: int) -> list[tuple[tuple, dict]]:
    """`microbatches` equal slices of every tensor input along dim 0 (others as they are)."""
    batch = batch_size(args, kwargs)
    if batch % microbatches:
        raise ValueError(f"microbatches={microbatches} does not divide the batch of {batch} (dim 0 of the inputs): "
                         "give a number of microbatches that divides the batch, or a batch it divides")
    rows = batch // microbatches
    return [pytree.tree_map(lambda x, k=k: x[k * rows:(k + 1) * rows] if isinstance(x, torch.Tensor) and x.ndim > 0
                            else x, (args, kwargs)) for k in range(microbatches)]


def sum_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Every weight's gradient summed over `group` (the data axis under DDP, once its microbatches have
    accumulated), one all-reduce per dtype on a flat copy; a weight with no gradient adds zeros. A weight
    split over that axis (routed experts' over the data axis) has its ranks' own gradients: left alone."""
    grads = []
    for p in params:
        if _split_over(p, group):
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
