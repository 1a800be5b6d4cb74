"""Planning inside a hand-written layout, given to the planner as `constraints=`.

What a published run *ran* is priced by planning with its layout imposed (torchtitan's and
Megatron's tensor parallelism: every matrix weight stays split over the tensor axis), beside the
plan autojigsaw would choose; axis_roles.py imposes the roles axis names suggest the same way.
"""

from __future__ import annotations

import torch


def tensor_parallel(model: torch.nn.Module) -> dict[str, str]:
    """Megatron's and torchtitan's tensor parallelism, as constraints on the tensor axis: every matrix weight
    (and its casts and views) is read split over that axis, never gathered there (column- or row-wise,
    embeddings and the output head by vocabulary, as the planner finds cheapest); the rest --
    sequence-parallel norms, the loss over split logits -- as the planner finds cheapest."""
    return {name: "split" for name, p in model.named_parameters() if p.ndim >= 2}
