"""Planning inside a hand-written layout, given to the planner as `constraints=`.

What a published run *ran* is priced by planning with its layout imposed (torchtitan's and
Megatron's tensor parallelism: every matrix weight stays split over the tensor axis; Megatron-Core's
mixture of experts: the routed experts over expert x tensor as well), beside the plan autojigsaw
would choose; axis_roles.py imposes the roles axis names suggest the same way.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard


def tensor_parallel(model: torch.nn.Module) -> dict[str, str]:
    """Megatron's and torchtitan's tensor parallelism, as constraints on the tensor axis: every matrix weight
    (and its casts and views) is read split over that axis, never gathered there (column- or row-wise,
    embeddings and the output head by vocabulary, as the planner finds cheapest); the rest --
    sequence-parallel norms, the loss over split logits -- as the planner finds cheapest."""
    return {name: "split" for name, p in model.named_parameters() if p.ndim >= 2}


def megatron_moe(model: torch.nn.Module, axes: tuple[str, ...]) -> dict:
    """Megatron-Core's mixture-of-experts layout on a data x expert x tensor mesh (`axes`, in order): the
    routed experts' stacked weights ([experts, ...]) split by expert over expert x tensor (EP = expert x
    tensor, ETP 1) and kept whole over data, where FSDP shards them (EDP), every other matrix weight split
    over tensor (`tensor_parallel`); attention's tokens and heads as the planner finds cheapest around them."""
    expert, tensor, data = axes.index("expert"), axes.index("tensor"), axes.index("data")
    by_expert = tuple(Shard(0) if a in (expert, tensor) else Replicate() if a == data else None
                      for a in range(len(axes)))
    return {name: by_expert if p.ndim == 3 else "split" for name, p in model.named_parameters() if p.ndim >= 2}
