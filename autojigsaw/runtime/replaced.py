"""Parameters parallelize replaced: an optimizer that still holds one would step nothing the model uses.

`parallelize` swaps each planned parameter for a new DTensor parameter (its shards). An optimizer
made from the model before that keeps the old tensors, and its step changes nothing the model
runs: training goes on, silently, with the initial weights (FSDP2 has the same trap). A global
optimizer step pre-hook turns that into an error naming the parameter.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_replaced: dict[int, tuple[weakref.ref, str]] = {}  # id -> (the replaced parameter, its FQN)
_hook = None


def mark_replaced(param: torch.Tensor, fqn: str) -> None:
    """Remember that `param` (the model's parameter `fqn`) was replaced by its sharded twin."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_refuse_replaced)
    key = id(param)
    _replaced[key] = (weakref.ref(param, lambda _: _replaced.pop(key, None)), fqn)


def _refuse_replaced(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before any optimizer's step: a ValueError if it holds a parameter parallelize replaced."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                raise ValueError(
                    f"the optimizer holds parameter {entry[1]!r} as it was before autojigsaw.parallelize "
                    "replaced it by its DTensor shards, so its step would change nothing the model uses: "
                    "create the optimizer after parallelize, from the module it returns "
                    "(torch.optim.AdamW(pmodel.parameters())); without example_inputs, parallelize replaces "
                    "them at the first call: call pmodel once before, or pass example_inputs")
