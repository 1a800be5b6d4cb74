"""The implementations compared, each built from the same reference MLPStack on one mesh.

- single: the plain model (run on rank 0 alone while the others wait);
- pytorch: `parallelize_module` with PyTorch's own TP styles, as torchtitan writes them
  (SequenceParallel norms, ColwiseParallel fc1, RowwiseParallel fc2, DTensor parameters);
- megatron: the hand-written Megatron-LM module of benchmarks/megatron.py;
- autojigsaw: `autojigsaw.parallelize` on the unmodified model (its own plan, priced with the
  built-in "cpu" device spec);
- autojigsaw-calibrated: the same, planned with `autojigsaw.calibrate(mesh)`: the links and
  compute this machine measures now.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

import autojigsaw

from .megatron import MegatronStack
from .models import MLPStack

NAMES = ("single", "pytorch", "megatron", "autojigsaw", "autojigsaw-calibrated")


@dataclass
class Variant:
    """One implementation ready to train: its module, optimizer, and whether this rank runs it."""

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    active: bool = True

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """One training step (forward, backward, optimizer step); returns the loss."""
        loss = self.module(x).square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def pytorch_tp(model: MLPStack, mesh) -> nn.Module:
    """PyTorch's hand-written plan: sequence-parallel norms and residuals, Megatron linears."""
    plan = {"blocks": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.norm": SequenceParallel(),
                 f"blocks.{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
                 f"blocks.{i}.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    return parallelize_module(model, mesh, plan)


def build(name: str, ref: MLPStack, mesh, x: torch.Tensor, *, compile: bool,
          memory_budget: int | None, lr: float = 1e-3, calibrated=None) -> Variant:
    """The variant `name` of a copy of `ref` on `mesh` (a 1-D DeviceMesh); `calibrated`: the
    DeviceSpec autojigsaw.calibrate measured, for "autojigsaw-calibrated"."""
    model = copy.deepcopy(ref)
    if name == "single":
        module = model
    elif name == "pytorch":
        module = pytorch_tp(model, mesh)
    elif name == "megatron":
        module = MegatronStack(model, mesh.get_group())
    elif name == "autojigsaw":
        return Variant(name, *_autojigsaw(model, mesh, x, compile, memory_budget, lr, None))
    elif name == "autojigsaw-calibrated":
        return Variant(name, *_autojigsaw(model, mesh, x, compile, memory_budget, lr, calibrated))
    else:
        raise ValueError(f"unknown variant {name!r}; known: {NAMES}")
    if compile:
        module = torch.compile(module)
    active = name != "single" or mesh.get_rank() == 0
    return Variant(name, module, torch.optim.AdamW(module.parameters(), lr=lr), active)


def _autojigsaw(model, mesh, x, compile, memory_budget, lr, device):
    pmodel = autojigsaw.parallelize(model, mesh, (x,), compile=compile, memory_budget=memory_budget,
                                    device=device)
    return pmodel, torch.optim.AdamW(pmodel.parameters(), lr=lr)
