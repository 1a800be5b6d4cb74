"""Mixture of experts: a tiny Mixtral's grouped expert matmuls run on sharded expert weights.

Its experts run transformers' grouped matmuls behind routing code that capture/expert_region.py
does not recognise (tests/moe_models.py: offsets by a binary search), so they are planned one by
one, and the plan says why they are not behind a token dispatch (tests/test_moe_dispatch.py
covers transformers' own experts).

Its default experts (transformers' grouped_mm) are captured as torch._grouped_mm in bf16 and as
transformers.grouped_mm_fallback in fp32 (transformers lets export trace _grouped_mm in bf16 only),
both over the stacked weights [E, K, N]; strategies/rules/moe.py shards them by experts, columns
or rows. The planner chooses under a memory budget; edited plans split the experts over the ranks
(expert parallelism) or every expert's rows (its contraction). In both dtypes they train like the
single-device model in the same dtype (eager transformers runs torch._grouped_mm, which has no fp64
CPU kernel): outputs, every gradient and every parameter after an SGD step, each relative to its
own tensor's scale.
"""

import dataclasses
import functools
import logging

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (defines transformers.grouped_mm_fallback)
from torch.distributed.tensor import Partial, Replicate, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.capture import capture
from autojigsaw.dtypes import reduce_dtype
from autojigsaw.strategies.rules.moe import GROUPED_MM, expert_rows_mm

from .cost_checks import CPU_100US
from .hf_models import hf_model
from .side_by_side import build, replicated_bytes, train

MESH = {"tensor": 2}
MODEL = "mixtral-custom-routing"
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}  # unit roundoff
# fp32: the reference runs torch._grouped_mm, the captured graph transformers' loop of mm (other
# accumulation orders); bf16: both run _grouped_mm and differ by one rounding per sharded matmul
# on the path, at most one per matmul of the model (2 layers x 7 + lm_head = 15).
TOL = {torch.float32: 40 * torch.finfo(torch.float32).eps, torch.bfloat16: 15 * UNIT[torch.bfloat16]}
OP = {torch.float32: GROUPED_MM, torch.bfloat16: "aten._grouped_mm.default"}  # what export records
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
FP64_TOL = 8 * torch.finfo(torch.float64).eps


def grouped_nodes(plan: Plan, dtype: torch.dtype):
    found = [n for n in plan.nodes if "grouped_mm" in n.op]
    assert found and all(n.op == OP[dtype].removesuffix(".default") for n in found), [n.op for n in found]
    assert all("no token dispatch: its offsets are not the cumulative histogram" in n.note for n in found), found
    return found


def check(results, dtype):
    """Outputs and every gradient to TOL of their own scale; every parameter after one SGD step.

    The step is SGD with each tensor's lr its scale over its gradient's (side_by_side.train), so
    every tensor moves by about its own scale, and a parameter may differ by lr times its
    gradient's tolerance plus one rounding of the new value in each model: an error in units of
    the tensor's roundoff, where Adam (dividing by |g| + eps) magnifies the rounding of gradients
    that are themselves of rounding size (an expert few tokens reach) by up to lr / eps.
    """
    tol, unit = TOL[dtype], UNIT[dtype]
    for r in results:
        assert r["output"] <= tol * r["scale"], ("output", r["output"], r["scale"], r["table"])
        for name, t in r["tensors"].items():
            assert t["lr"] > 0, (name, t)
            assert t["grad"] <= tol * t["grad_scale"], (name, t, r["table"])
            assert t["param"] <= t["lr"] * tol * t["grad_scale"] + 2 * unit * t["param_scale"], (name, t, r["table"])


@pytest.mark.parametrize("op, dtype, tol", [
    (torch.ops.transformers.grouped_mm_fallback.default, torch.float64, FP64_TOL),
    (torch.ops.aten._grouped_mm.default, torch.float32, 8 * torch.finfo(torch.float32).eps),
    (torch.ops.aten._grouped_mm.default, torch.bfloat16, 8 * UNIT[torch.bfloat16]),
], ids=["fallback-fp64", "_grouped_mm-fp32", "_grouped_mm-bf16"])
@pytest.mark.parametrize("counts, split", [([3, 0, 5, 2], [2, 2]), ([4, 1, 3], [2, 1])],
                         ids=["an expert without rows", "uneven experts"])
def test_expert_rows_of_every_rank_sum_to_the_grouped_matmul(counts, split, op, dtype, tol):
    """Also for _grouped_mm, which leaves the rows past its last offset (and their gradient) unset."""
    torch.full((1 << 20,), float("nan"), dtype=dtype)  # freed memory full of NaN: unset rows show
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 16, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), 16, 8, dtype=dtype, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    g = torch.randn(sum(counts), 8, dtype=dtype)
    whole = op(x, w, offs)
    grads = torch.autograd.grad(whole, (x, w), g)
    firsts = [sum(split[:r]) for r in range(len(split))]
    parts = [expert_rows_mm(op, x, w_r, offs, first=f) for w_r, f in zip(w.split(split), firsts)]
    summed = sum(p.to(reduce_dtype(dtype, "sum")) for p in parts).to(dtype)  # as Partial sums travel
    summed_grads = torch.autograd.grad(summed, (x, w), g)
    for a, b in zip((summed, *summed_grads), (whole, *grads)):
        assert (a - b).abs().max() <= tol * b.abs().max()


@functools.cache
def planned(dtype: torch.dtype) -> str:
    """Under 0.7 of the replicated bytes, priced on 100 us links: on this tiny model gloo's ~0.5 ms
    rounds (the "cpu" spec) make gathering the expert weights cheaper than any sharded matmul."""
    model, inputs = build(MODEL, dtype=dtype)
    budget = int(0.7 * replicated_bytes(MODEL, dtype))
    return autojigsaw.plan(model, inputs, MESH, device=CPU_100US, memory_budget=budget).to_json()


def run(ranks, plan: str, dtype: torch.dtype):
    return ranks.run(train, MODEL, tuple(MESH.values()), tuple(MESH), plan, steps=1, dtype=dtype,
                     optimizer="sgd")


@DTYPES
def test_planner_shards_the_expert_weights_and_trains_like_single_device(ranks2, dtype):
    plan = Plan.from_json(planned(dtype))
    sharded = [n for n in grouped_nodes(plan, dtype) if any(p != Replicate() for p in n.inputs[1])]
    assert sharded, plan.table(every_node=True)
    check(run(ranks2, planned(dtype), dtype), dtype)


EDITS = {  # strategies the planner does not pick on this model, forced on every grouped matmul
    "experts": {"inputs": ((Replicate(),), (Shard(0),), (Replicate(),)), "outputs": ((Partial(),),),
                "kernel": "grouped_mm", "note": "tensor: experts"},
    "rows": {"inputs": ((Shard(1),), (Shard(1),), (Replicate(),)), "outputs": ((Partial(),),),
             "kernel": "grouped_mm", "note": "tensor: rows"},
}


@DTYPES
@pytest.mark.parametrize("edit", EDITS)
def test_experts_split_over_the_ranks_or_rows_train_like_single_device(ranks2, dtype, edit):
    plan = Plan.from_json(planned(dtype))
    grouped = grouped_nodes(plan, dtype)
    plan = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, **EDITS[edit]) if n in grouped else n
                                                 for n in plan.nodes))
    check(run(ranks2, plan.to_json(), dtype), dtype)


def test_batched_grouped_mm_runs_replicated_and_says_why():
    class Batched(torch.nn.Module):
        def forward(self, a, b):
            return torch._grouped_mm(a, b)

    a, b = torch.randn(4, 16, 32, dtype=torch.bfloat16), torch.randn(4, 32, 16, dtype=torch.bfloat16)
    [node] = [n for n in autojigsaw.plan(Batched(), (a, b), MESH, device="cpu").nodes if "grouped_mm" in n.op]
    assert node.fallback and "3-D x 3-D without offs" in node.note, node
    assert all(p == (Replicate(),) for p in node.inputs), node


def test_eager_experts_fail_capture_with_the_fix_and_no_graph_dump(capsys, caplog):
    model, inputs = hf_model("mixtral")
    model.config._experts_implementation = "eager"  # a Python loop over the experts hit
    with caplog.at_level(logging.DEBUG, logger="autojigsaw"), pytest.raises(ValueError) as err:
        capture(model, inputs)
    message = str(err.value)
    assert "data-dependent" in message and "for expert_idx in expert_hit" in message, message
    assert "default experts implementation (grouped_mm)" in message, message
    out, printed = capsys.readouterr()
    assert len(out) + len(printed) < 1000, printed[:2000]
    assert "def forward" in caplog.text  # the partial graph, for who asks for it
