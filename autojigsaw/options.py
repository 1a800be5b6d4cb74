"""Options: the one documented configuration of `autojigsaw.plan` and `autojigsaw.parallelize`.

Each field is a keyword of both (`autojigsaw.plan(model, (x,), mesh, device="a100")`), checked
here; `api.plan_captured` takes the object itself. A new option is a field and its line in the
docstring (tests/test_docstrings.py fails on a field the docstring does not name).
"""

# (no `from __future__ import annotations`: the annotations are evaluated, so help(Options) shows each
# field's choices, the Literal's values, and not an alias's name)
import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.fsdp import MixedPrecisionPolicy

from .cost_model.devices import DeviceSpec, device_spec
from .cost_model.memory import Optimizer, OptimizerName
from .mesh import MeshSpec
from .placements import Placements
from .planner.milp import DEFAULT_MIP_GAP, Solution
from .strategies.constraints import check_constraints, describe_constraints
from .training import DataParallel, RecomputePolicy, Regime

DEFAULT_DEVICE = "h100"  # the spec a plan is priced on when `device` is None and no mesh says otherwise
# What the default budget leaves free (docs/predictions.md, "Memory as the caching allocator holds it"): the
# reserved peaks plans predict were up to 4.9 % under torchtitan's four published ones (and up to 3.8 % over);
# the other 5 % hold what the caching allocator never sees, NCCL's buffers (made at the first collective,
# after the budget is read) and CUDA's own workspaces.
HEADROOM = 0.10


@dataclass(frozen=True)
class Options:
    """The options of `autojigsaw.plan` and `autojigsaw.parallelize`, each one keyword of both.

    - `device`: the spec to price on: "h100", "h100-96gb", "h200", "a100", "a100-40gb", "cpu" (= "cpu-gloo"),
      "+compile" appended for a torch.compile'd step, "+expandable" for the caching allocator's expandable
      segments (PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), or a DeviceSpec (autojigsaw.calibrate);
      None: "h100" for `plan`, the mesh's device for `parallelize`.
    - `training`: price and run forward + backward + optimizer step (True) or forward only (False).
    - `memory_budget`: bytes per rank (on a GPU spec, what torch's caching allocator reserves:
      `plan.memory_per_rank`); None: all but HEADROOM (10 %) of the device's memory for `plan`, of this
      rank's free memory for `parallelize` (on CPU of the host's memory divided by its ranks).
    - `optimizer`: whose state and step are priced: "adam", "adamw" (torch's, fused or foreach),
      "decoupled_adamw" (Composer's, a kernel per op), "sgd", "momentum", "adagrad", "rmsprop", or an
      autojigsaw.cost_model.memory.Optimizer.
    - `input_placements`: per input tensor, DTensor placements with one per mesh axis (`(Shard(0),
      Replicate())`) or None to let autojigsaw choose; None: it chooses all. Given to `parallelize`, the
      caller passes this rank's shards; otherwise every rank is passed each input whole and holds it all
      step (`memory_per_rank` counts it), however the plan splits it.
    - `output_placements`: likewise per output tensor; `parallelize` then returns this rank's shards.
    - `tie_layers`: one shared strategy per node of repeated layers; None: for big problems only.
    - `mp_policy`: a torch.distributed.fsdp.MixedPrecisionPolicy (compute in param_dtype, fp32 masters,
      gradient sums in reduce_dtype); None: the model's dtype throughout.
    - `activation_checkpointing`: "none", "selective" (keep matmul and attention outputs), "selective-op"
      (torchtitan's: also recompute every second matmul), "full", or "auto" (chosen per layer, with the
      sharding, under the budget).
    - `data_parallel`: "fsdp" or "ddp" on a mesh axis named "data"/"dp"; None: "fsdp" there (the plan's
      mode under `parallelize(plan=...)`). No other axis name has a role.
    - `dynamic`: capture with symbolic sizes (torch.export `Dim.AUTO`): `parallelize` runs every size in
      their range with one plan, priced at the example's shape (give the largest); a size the plan cannot
      split, or a model export cannot capture so, is planned per shape (a log line says why).
      `plan(dynamic=True)` makes a plan for `parallelize(dynamic=True, plan=...)`.
    - `pipeline_schedule`: over a mesh axis named "pipe"/"pp" (pipeline stages), PyTorch's schedule:
      "gpipe", "1F1B", "interleaved", "zero-bubble" (ZBV), "interleaved-zero-bubble", "looped-bfs", or
      one of torch.distributed.pipelining's schedule classes; None: the planner chooses.
    - `microbatches`: per data replica and step: a pipeline's microbatches, or, without a pipe axis,
      gradient accumulation (`ParallelModule.train_step` runs them one after another); None: the
      planner chooses with a pipe axis, 1 without.
    - `virtual_stages`: pipeline stages per pipe rank (interleaved schedules); None: chosen.
    - `gpus_per_node`: ranks per node, which decide the links each mesh axis crosses (and, given a number
      of GPUs for the mesh, bound the tensor axis); None: the device spec's (8 for the GPU specs).
    - `constraints`: layouts the plan must keep, the rest the planner's: a dict of a module path or
      parameter name (a glob matched at the end of the name: "layers.*.mlp.down_proj") -> a style on
      `constraints_axis` -- transformers' ("colwise", "rowwise", "embedding_rowwise", "sequence_parallel",
      ...: `constraints=model.config.base_model_tp_plan` places every weight as transformers' tensor
      parallelism does), torch's ColwiseParallel(), RowwiseParallel(), SequenceParallel(), or "split"
      (split on a dim the planner chooses) -- or placements, one per mesh axis (None: the planner's). A
      weight pinned split is read split there, never gathered; activations stay the planner's. A node
      name (as plan.table(wide=True) shows it) -> a function of a candidate strategy (its inputs,
      outputs, kernel) keeps the node to those it accepts. An entry that matches nothing or cannot hold
      is a ValueError naming it.
    - `constraints_axis`: the mesh axis a style applies to; None: the one named "tensor" or "tp".
    - `mip_gap`: the solve ends at a plan proven within this relative gap of the fastest plan (0.01: within
      1 %, the cost model's own error is several times that; 0: proven optimal). `plan.gap` (a pipeline's:
      its stages' largest) and the summary line say what was proven ("optimal", "within 0.4 % of optimal").
    - `moe_imbalance`: the routing routed experts (mixture of experts) are priced at, as the busiest
      rank's routed tokens over the mean: 1.0 balanced; the expert group's size, every token to one
      rank's experts. Their all-to-alls and grouped GEMMs are priced, and their bytes stated, at that rank.
    - `solver`: called as `autojigsaw.planner.solve(problem, budget, **kw)` is, in its place (None: that,
      HiGHS with 300 s per solve), e.g. `functools.partial(autojigsaw.planner.solve, time_limit=60)`.

        import autojigsaw
        options = dict(device="a100", memory_budget=40 * 2**30, activation_checkpointing="auto")
        autojigsaw.Options(**options)  # checks them, as plan and parallelize do
        plan = autojigsaw.plan(model, (x,), {"domain": 2, "tensor": 4}, **options)
    """

    device: str | DeviceSpec | None = None
    training: bool = True
    memory_budget: int | None = None
    optimizer: OptimizerName | Optimizer = "adam"
    input_placements: Sequence[Placements | None] | None = None
    output_placements: Sequence[Placements | None] | None = None
    tie_layers: bool | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    activation_checkpointing: RecomputePolicy = "none"
    data_parallel: DataParallel | None = None
    dynamic: bool = False
    pipeline_schedule: str | type | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    gpus_per_node: int | None = None
    constraints: Mapping[str, Any] | None = None
    constraints_axis: str | None = None
    mip_gap: float = DEFAULT_MIP_GAP
    moe_imbalance: float = 1.0
    solver: Callable[..., Solution | None] | None = None

    def __post_init__(self):
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                                   or not 0 < budget < float("inf")):
            raise ValueError(f"memory_budget={budget!r} is not a budget: give bytes per rank as a positive number "
                             "(e.g. 40 * 2**30 for 40 GiB), or None for the default")
        if not isinstance(self.training, bool):
            raise ValueError(f"training={self.training!r}: give True (forward, backward and optimizer step) or False")
        for name in ("microbatches", "virtual_stages", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: give a positive int, or None to let the planner choose")
        check_constraints(self.constraints)
        gap = self.mip_gap
        if isinstance(gap, bool) or not isinstance(gap, numbers.Real) or not 0 <= gap < 1:
            raise ValueError(f"mip_gap={gap!r}: give the relative gap to the optimum a plan may be left at, from 0 "
                             "(proven optimal) up to below 1 (0.01: within 1 %)")
        check_imbalance(self.moe_imbalance)
        if self.tie_layers is not None and not isinstance(self.tie_layers, bool):
            raise ValueError(f"tie_layers={self.tie_layers!r}: give True, False or None (tie repeated layers only "
                             "in big problems)")

    @classmethod
    def from_keywords(cls, keywords: Mapping, caller: str) -> "Options":
        """The Options of `caller`'s keyword arguments; one that is no field is a TypeError naming the fields."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [name for name in keywords if name not in fields]
        if unknown:
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}; its options are the "
                            f"fields of autojigsaw.Options: {fields}")
        return cls(**keywords)

    def device_spec(self) -> DeviceSpec:
        """The DeviceSpec priced on: `device`'s, DEFAULT_DEVICE's when None, with `gpus_per_node` if given."""
        spec = device_spec(self.device if self.device is not None else DEFAULT_DEVICE)
        return spec if self.gpus_per_node is None else dataclasses.replace(spec, devices_per_node=self.gpus_per_node)

    def budget(self) -> int:
        """Bytes per rank to plan under: `memory_budget`, or all but HEADROOM of the device's memory."""
        if self.memory_budget is not None:
            return int(self.memory_budget)
        return int((1 - HEADROOM) * self.device_spec().memory_bytes)

    def regime(self, mesh: MeshSpec) -> Regime:
        """The checked training regime on `mesh`: an unknown policy, FSDP without a data axis, or a compute
        dtype the device has no peak for is a ValueError naming the choices."""
        regime = Regime.of(mesh, mp_policy=self.mp_policy, activation_checkpointing=self.activation_checkpointing,
                           data_parallel=self.data_parallel)
        device = self.device_spec()
        dtype = regime.precision.param_dtype
        if regime.precision.mixed and str(dtype).removeprefix("torch.") not in dict(device.flops):
            raise ValueError(f"mp_policy.param_dtype={dtype} cannot be computed in on device {device.name!r}, whose "
                             f"peak table lists {[name for name, _ in device.flops]}: choose one of those dtypes")
        return regime

    def describe(self) -> str:
        """The options as text two processes can compare: a DeviceSpec by its name, the solver by its
        qualified name (the text of a function names its address)."""
        solver = self.solver
        shown = {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                 "device": self.device.name if isinstance(self.device, DeviceSpec) else self.device,
                 "solver": None if solver is None else getattr(solver, "__qualname__", type(solver).__qualname__),
                 "constraints": describe_constraints(self.constraints)}
        return f"Options({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


def check_imbalance(value) -> None:
    """moe_imbalance is the busiest rank's routed tokens over the mean: a real number >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 1 <= value < float("inf"):
        raise ValueError(f"moe_imbalance={value!r}: give the busiest rank's routed tokens over the mean, a number "
                         ">= 1 (1.0: balanced routing; the expert group's size: every token to one rank's experts)")
