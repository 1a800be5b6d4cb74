"""The ecosystem's tensor-parallel styles as parameter placements on one mesh axis.

transformers' tp plans name a style per module or parameter (`config.base_model_tp_plan`:
"colwise", "rowwise", ...; transformers.distributed.tensor_parallel says what each does), and
torch's `parallelize_module` takes ParallelStyle objects (ColwiseParallel(), RowwiseParallel(),
SequenceParallel()). Each places a module's parameters on the tensor axis the same way whatever
its input and output layouts; those are activations, which the planner chooses. "split" is
autojigsaw's own: split over the axis on whichever dim the planner finds cheapest.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement

SPLIT = "split"  # any Shard over the axis, never gathered there: the dim is the planner's
# (parameter name in its module, its ndim) -> its placement on the axis, or SPLIT
ByParam = Callable[[str, int], Placement | str]


def _colwise(name: str, ndim: int) -> Placement:
    """transformers' ColwiseParallel: every parameter Shard(ndim - 2) (a 1-D bias: its only dim)."""
    return Shard(max(ndim - 2, 0))


def _rowwise(name: str, ndim: int) -> Placement:
    """transformers' RowwiseParallel: the bias whole (added after the sum), the rest Shard(-1)."""
    return Replicate() if name == "bias" else Shard(ndim - 1)


def _whole(name: str, ndim: int) -> Placement:
    return Replicate()


# transformers' styles (ALL_PARALLEL_STYLES) that autojigsaw places exactly; the _rep, _gather_output and
# _split_input variants differ only in their activations' layout
HF_STYLES: dict[str, ByParam] = {
    "colwise": _colwise, "colwise_rep": _colwise, "colwise_gather_output": _colwise,
    "rowwise": _rowwise, "rowwise_rep": _rowwise, "rowwise_split_input": _rowwise,
    "embedding_rowwise": lambda name, ndim: Shard(0), "embedding_colwise": lambda name, ndim: Shard(1),
    "sequence_parallel": _whole, "replicate": _whole, "replicated_with_grad_allreduce": _whole,
    SPLIT: lambda name, ndim: SPLIT,
}
# transformers' styles refused, and why (any other name is unknown)
HF_REFUSED = {
    "packed_colwise": "it splits a fused weight in strided pieces (DTensor's _StridedShard)",
    "packed_rowwise": "it splits a fused weight in strided pieces (DTensor's _StridedShard)",
    "local_packed_rowwise": "it splits a fused weight in strided pieces (DTensor's _StridedShard)",
    "unit_colwise": "it replicates attention heads over part of the axis (a second mesh of its own)",
    "unit_rowwise": "it replicates attention heads over part of the axis (a second mesh of its own)",
    "mla_kv_a_proj": "it splits one projection's output in two parts with different gradients",
    "all_reduce": "it changes no parameter, only sums a module's output",
    "moe_tp_experts": "it shards MoE experts by hand (autojigsaw plans expert parallelism itself)",
    "local_params": "it runs a module on local tensors and places no parameter",
    "local_colwise": "it runs the module on local tensors, outside DTensor (colwise places the same weights)",
    "local_rowwise": "it runs the module on local tensors, outside DTensor (rowwise places the same weights)",
    "local": "it runs the module on local tensors and places no parameter",
    "gather": "it only gathers a module's output",
    "isolated": "it moves a module to a mesh of its own",
}


def hf_style(style: str) -> ByParam:
    """The placement rule of transformers' style `style`; a ValueError names a style refused or unknown."""
    if style in HF_STYLES:
        return HF_STYLES[style]
    supported = sorted(HF_STYLES)
    if style in HF_REFUSED:
        raise ValueError(f"transformers' style {style!r} is not supported: {HF_REFUSED[style]}; supported: "
                         f"{supported}")
    raise ValueError(f"unknown style {style!r}: give one of transformers' styles {supported}, a torch ParallelStyle "
                     "(ColwiseParallel(), RowwiseParallel(), SequenceParallel()), or placements, one per mesh axis")


def torch_style(style: ParallelStyle, module_type: str) -> ByParam:
    """The placement rule of torch's ParallelStyle on a module of type `module_type` (its qualified name)."""
    kind = module_type.rsplit(".", 1)[-1]
    if isinstance(style, SequenceParallel):
        return _whole
    if isinstance(style, (ColwiseParallel, RowwiseParallel)) and kind in ("Linear", "Embedding"):
        colwise = isinstance(style, ColwiseParallel)
        if kind == "Embedding":  # torch: colwise splits the embedding dim, rowwise the vocabulary
            return lambda name, ndim: Shard(1 if colwise else 0)
        return _colwise if colwise else _rowwise
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        raise ValueError(f"torch's {type(style).__name__} shards nn.Linear and nn.Embedding, and this module is a "
                         f"{module_type}: pin its parameters with placements, one per mesh axis, instead")
    raise ValueError(f"torch's {type(style).__name__} is not supported: it places no parameter (give "
                     "ColwiseParallel(), RowwiseParallel() or SequenceParallel(), or leave the module to the planner)")


def style_text(value) -> str:
    """A style as text: its name, or the ParallelStyle's class name."""
    return value if isinstance(value, str) else type(value).__name__
