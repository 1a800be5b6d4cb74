"""Small models the tests parallelize, and a worker that compares one with its single-device twin."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh


class MLP(nn.Module):
    """Linear -> GELU -> Linear with a residual: the Megatron block."""

    def __init__(self, d: int = 16, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class ConstantScale(nn.Module):
    """An output scale kept as a plain attribute: it becomes a constant of the traced program."""

    def __init__(self, scale: float):
        super().__init__()
        self.proj, self.scale = nn.Linear(16, 16, dtype=torch.float64), scale

    def forward(self, x):
        return self.proj(x) * self.scale


class LinearStack(nn.Module):
    """Several MLP blocks and a head: linears with bias, activations, residuals."""

    def __init__(self, d: int = 16, hidden: int = 48, depth: int = 3, out: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, out, bias=False)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def build(name: str, dtype: torch.dtype, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "stack": LinearStack}[name](**kwargs).to(dtype)


def compare_training(model_name: str, shape: tuple, mesh_shape: tuple, axis_names: tuple, *,
                     dtype=torch.float64, budget=None, steps: int = 1, compile: bool = False,
                     input_grad: bool = False, model_kwargs=None):
    """Train the parallel and the single-device model side by side; max abs differences."""
    ref = build(model_name, dtype, **(model_kwargs or {}))
    model = copy.deepcopy(ref)
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype)
    mesh = get_mesh(mesh_shape, axis_names)
    pmodel = autojigsaw.parallelize(model, mesh, (x,), compile=compile, memory_budget=budget)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    diffs = {"output": 0.0, "grad": 0.0, "param": 0.0, "input_grad": 0.0}
    for _ in range(steps):
        xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
        y, y_ref = pmodel(xa), ref(xb)
        diffs["output"] = max(diffs["output"], (y - y_ref).abs().max().item())
        (y * y).sum().backward()
        (y_ref * y_ref).sum().backward()
        if input_grad:
            diffs["input_grad"] = max(diffs["input_grad"], (xa.grad - xb.grad).abs().max().item())
        for (name, p), (_, q) in zip(pmodel.named_parameters(), ref.named_parameters()):
            diffs["grad"] = max(diffs["grad"], (p.grad.full_tensor() - q.grad).abs().max().item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), (_, q) in zip(pmodel.named_parameters(), ref.named_parameters()):
        diffs["param"] = max(diffs["param"], (p.full_tensor() - q).abs().max().item())
    diffs["plan"] = pmodel.plan.to_json() if dist.get_rank() == 0 else None
    return diffs
