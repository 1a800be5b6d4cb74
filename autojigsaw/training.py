"""How a model is trained, as the planner prices it: mixed precision, recomputation, data parallelism.

Plain, checked data shared by every stage: `Precision` reads torch's own FSDP2
`MixedPrecisionPolicy`; `Regime.recompute` speaks torchtitan's vocabulary ("selective" keeps
matmul and attention outputs and recomputes the rest, convolutions included; "selective-op" is
torchtitan's op-level policy, which recomputes every second matrix product too; "full" keeps only
a layer's input); `Regime.data_parallel` says what a mesh axis named "data"/"dp" does with the
weights ("fsdp" shards them, parameters, gradients and optimizer state, "ddp" keeps them whole and
all-reduces gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch.distributed.tensor import Shard

from .mesh import MeshSpec

RecomputePolicy = Literal["auto", "none", "selective", "selective-op", "full"]
DataParallel = Literal["fsdp", "ddp"]
RECOMPUTE_CHOICES = get_args(RecomputePolicy)
DATA_PARALLEL_CHOICES = get_args(DataParallel)
DATA_AXIS_NAMES = ("data", "dp")


@dataclass(frozen=True)
class Precision:
    """Parameter dtypes: `param_dtype` to compute in (None: the model's own), fp32 masters, sums in `reduce_dtype`."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, policy) -> Precision:
        """From None, a Precision, or torch.distributed.fsdp.MixedPrecisionPolicy (same field names)."""
        if policy is None:
            return cls()
        if isinstance(policy, Precision):
            return policy
        try:
            out = cls(policy.param_dtype, policy.reduce_dtype, getattr(policy, "output_dtype", None))
        except AttributeError:
            raise ValueError(f"mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., "
                             f"reduce_dtype=...) or None, got {policy!r}") from None
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(out, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"mp_policy.{name} must be a floating torch.dtype or None, got {dtype!r}")
        return out

    @property
    def mixed(self) -> bool:
        """Whether the parameters compute in another dtype than the fp32 masters the optimizer keeps."""
        return self.param_dtype is not None and self.param_dtype != torch.float32

    @property
    def input_widen(self) -> float:
        """A floating input's bytes as the caller passes it (fp32) per byte the graph computes it in."""
        return 4 / self.param_dtype.itemsize if self.mixed else 1.0

    def reduce_itemsize(self, itemsize: int) -> int:
        """Bytes per element of a gradient sum for a parameter of `itemsize`-byte elements."""
        if not self.mixed:
            return itemsize
        return (self.reduce_dtype or self.param_dtype).itemsize

    def describe(self) -> str:
        if not self.mixed:
            return "model dtype"
        reduce = self.reduce_dtype or self.param_dtype
        return f"{_short(self.param_dtype)} compute, fp32 masters, {_short(reduce)} gradient sums"


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Regime:
    """The training regime a plan is made for: precision, recomputation policy, data parallelism."""

    precision: Precision = Precision()
    recompute: RecomputePolicy = "none"
    data_parallel: DataParallel | None = None  # on the mesh's data axis; None: no data axis
    # FSDP gathers the weights once per step and keeps them (and their unsharded gradients) to its end, as a
    # pipeline stage does under PyTorch's schedules; else each layer's for its forward and again its backward
    fsdp_once: bool = False
    # gradients accumulate over microbatches: they live all step (the earlier microbatches' are kept), and DDP
    # sums them over the data axis once, after the last, out of the graph (FSDP reduce-scatters each one's)
    accumulates: bool = False
    # train_step's microbatches without a pipe axis: one runs at a time, sliced from a batch held whole
    batch_slices: int = 1
    # the caller passes each input whole and every rank slices its shard, a view: the whole input lives all step
    # (False: input_placements, the caller passes its shards)
    whole_inputs: bool = True

    def __post_init__(self):
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"activation_checkpointing={self.recompute!r} is not a policy; choose one of "
                             f"{RECOMPUTE_CHOICES} ('auto' lets the planner choose per layer)")
        _check_data_parallel(self.data_parallel)

    @classmethod
    def of(cls, mesh: MeshSpec, *, mp_policy=None, activation_checkpointing: RecomputePolicy = "none",
           data_parallel: DataParallel | None = None) -> Regime:
        """The regime for `mesh`, checked: data_parallel defaults to "fsdp" when the mesh has a data axis."""
        _check_data_parallel(data_parallel)  # before the mesh's axes, which a wrong value would be blamed on
        axes = data_axes(mesh)
        if data_parallel is None and axes:
            data_parallel = "fsdp"
        if data_parallel is not None and not axes:
            raise ValueError(f"data_parallel={data_parallel!r} needs a mesh axis named one of {DATA_AXIS_NAMES}, "
                             f"but the mesh's axes are {mesh.axis_names}: rename the batch axis, or leave "
                             "data_parallel=None")
        return cls(Precision.of(mp_policy), activation_checkpointing, data_parallel)

    @property
    def fsdp(self) -> bool:
        return self.data_parallel == "fsdp"

    @property
    def data_sums_once(self) -> bool:
        """Whether the weights' gradients are summed over the data axis outside the graph (FSDP always does,
        each microbatch's; DDP does where gradients accumulate over microbatches, once per step)."""
        return self.fsdp or (self.data_parallel == "ddp" and self.accumulates)


def _check_data_parallel(value) -> None:
    if value not in (None, *DATA_PARALLEL_CHOICES):
        raise ValueError(f"data_parallel={value!r}: choose one of {DATA_PARALLEL_CHOICES}, "
                         "or None when the mesh has no data axis")


def data_axes(mesh: MeshSpec) -> tuple[int, ...]:
    """The positions of the mesh's data-parallel axes (FSDP shards over the first)."""
    return tuple(a for a, name in enumerate(mesh.axis_names) if name in DATA_AXIS_NAMES)


def splits_data(placements, mesh: MeshSpec) -> bool:
    """Whether `placements` split a weight over a data axis: the plan's own split (routed experts dispatched
    over it), which FSDP and DDP leave, the graph computing each rank's gradients of its own slices."""
    return any(isinstance(placements[a], Shard) for a in data_axes(mesh) if mesh.sizes[a] > 1)


PIPE_AXIS_NAMES = ("pipe", "pp")


def pipe_axis(mesh: MeshSpec) -> int | None:
    """The position of the mesh's pipe axis (pipeline stages), or None."""
    axes = [a for a, name in enumerate(mesh.axis_names) if name in PIPE_AXIS_NAMES]
    if len(axes) > 1:
        raise ValueError(f"the mesh has {len(axes)} pipe axes ({[mesh.axis_names[a] for a in axes]}); name one "
                         f"axis {PIPE_AXIS_NAMES[0]!r} and give the others labels such as 'tensor' or 'domain'")
    return axes[0] if axes else None


def stage_mesh(mesh: MeshSpec) -> MeshSpec:
    """The mesh one pipeline stage is sharded over: every axis but the pipe axis (a 1-rank 'tensor' axis
    when there is no other)."""
    axis = pipe_axis(mesh)
    keep = [a for a in range(mesh.ndim) if a != axis]
    if not keep:
        return MeshSpec(("tensor",), (1,))
    return MeshSpec(tuple(mesh.axis_names[a] for a in keep), tuple(mesh.sizes[a] for a in keep))
