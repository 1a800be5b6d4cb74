"""The planner rediscovers Megatron's MLP: column- then row-sharded, one all-reduce each way.

A hand-written Megatron MLP (as in Megatron-LM: f = identity forward / all-reduce backward
before the column linear, g = all-reduce forward / identity backward after the row linear)
is the baseline: same placements, same outputs, same number of collectives.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .models import MLP, build


class _F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return funcol.wait_tensor(funcol.all_reduce(g, "sum", ctx.group)), None


class _G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, g):
        return g, None


class HandMegatronMLP(torch.nn.Module):
    """Megatron-LM's tensor-parallel MLP, written by hand from a single-device MLP."""

    def __init__(self, ref: MLP, group):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.w1 = torch.nn.Parameter(ref.fc1.weight.detach().chunk(n, 0)[r].clone())
        self.b1 = torch.nn.Parameter(ref.fc1.bias.detach().chunk(n, 0)[r].clone())
        self.w2 = torch.nn.Parameter(ref.fc2.weight.detach().chunk(n, 1)[r].clone())
        self.b2 = torch.nn.Parameter(ref.fc2.bias.detach().clone())

    def forward(self, x):
        h = F.gelu(F.linear(_F.apply(x, self.group), self.w1, self.b1))
        return x + _G.apply(F.linear(h, self.w2), self.group) + self.b2


def _counted(module, x):
    with CommDebugMode() as comm:
        module(x).square().sum().backward()
    return comm.get_total_counts()


def _megatron_side_by_side(input_grad: bool):
    n = dist.get_world_size()
    mesh = get_mesh((n,), ("tensor",))
    ref = build("mlp", torch.float64, d=16, hidden=64)
    hand = HandMegatronMLP(ref, mesh.get_group("tensor"))
    # Parameters with Adam take 68 KiB replicated: 50 KB forbids replicating them.
    auto = autojigsaw.parallelize(copy.deepcopy(ref), mesh, (torch.randn(4, 16, dtype=torch.float64),),
                                  compile=False, memory_budget=50_000)
    torch.manual_seed(3)
    x = torch.randn(4, 16, dtype=torch.float64)
    counts = {name: _counted(m, x.clone().requires_grad_(input_grad))
              for name, m in (("hand", hand), ("auto", auto))}
    return {
        "placements": auto.plan.param_placements,
        "counts": counts,
        "diff": (auto(x) - hand(x)).abs().max().item(),
        "ref_diff": (auto(x) - ref(x)).abs().max().item(),
    }


@pytest.mark.parametrize("input_grad", [False, True])
def test_matches_hand_written_megatron(ranks2, input_grad):
    for r in ranks2.run(_megatron_side_by_side, input_grad):
        assert r["placements"] == {
            "fc1.weight": (Shard(0),), "fc1.bias": (Shard(0),),
            "fc2.weight": (Shard(1),), "fc2.bias": (Replicate(),),
        }
        assert r["counts"]["auto"] == r["counts"]["hand"] == 1 + input_grad
        assert r["diff"] < 1e-12 and r["ref_diff"] < 1e-12


def test_plans_megatron_for_wide_mlp_with_few_tokens():
    with torch.device("meta"):
        model = MLP(d=1024, hidden=8192)
    plan = autojigsaw.plan(model, (torch.empty(8, 1024, device="meta"),), {"tensor": 4}, device="h100")
    assert plan.param_placements["fc1.weight"] == (Shard(0),)
    assert plan.param_placements["fc2.weight"] == (Shard(1),)
    # one all-reduce of the [8, 1024] fp32 output forward; the input needs no gradient
    assert plan.comm_bytes == 2 * 8 * 1024 * 4 * 3 // 4


class PreNormBlocks(torch.nn.Module):
    """x + fc2(gelu(fc1(norm(x)))), twice: the MLP half of two transformer blocks."""

    def __init__(self, d: int = 16, hidden: int = 64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(d), "fc1": torch.nn.Linear(d, hidden),
                                 "fc2": torch.nn.Linear(hidden, d)}) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + b["fc2"](F.gelu(b["fc1"](b["norm"](x))))
        return x


def _prenorm_side_by_side():
    from autojigsaw.kernels.collectives import count_comm

    mesh = get_mesh((2,), ("tensor",))
    torch.manual_seed(0)
    ref = PreNormBlocks(16, 256).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    # 300 KB fits no plan, 400 KB already another one (the step peaks at 650 KB replicated)
    auto = autojigsaw.parallelize(copy.deepcopy(ref), mesh, (x,), compile=False, memory_budget=350_000)
    with count_comm() as log:
        auto(x).square().sum().backward()
    ref(x).square().sum().backward()
    grads = max((p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(auto.parameters(), ref.parameters()))
    return {"calls": sorted(b for _, _, b in log.calls), "grad_diff": grads,
            "placements": auto.plan.param_placements}


def test_norm_gradients_are_summed_once_before_the_norm_as_megatron_does(ranks2):
    """The second norm's input gradient is all-reduced (Megatron's f), not its weight and bias
    gradients on top of the all-reduce after the first block; the first norm reads the input,
    which needs no gradient: its weight and bias are all-reduced (2 x 16 values, not 4 x 16), in one
    bucket (rewrite/bucket.py)."""
    act, vec = 4 * 16 * 8, 16 * 8  # bytes of one activation, of one norm weight (fp64)
    for r in ranks2.run(_prenorm_side_by_side):
        assert r["placements"]["blocks.1.fc1.weight"] == (Shard(0),), r["placements"]
        assert r["grad_diff"] < 1e-12
        assert r["calls"] == [2 * vec, act, act, act], r["calls"]
