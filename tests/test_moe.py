"""Mixture of experts: a tiny Mixtral's grouped expert matmuls run on sharded expert weights.

Its default experts (transformers' grouped_mm) are captured as transformers.grouped_mm_fallback
over the stacked weights [E, K, N]; strategies/rules/moe.py shards them by experts, columns or
rows. The planner chooses under a memory budget; an edited plan runs the experts split over the
ranks (expert parallelism). Both train like the single-device model in fp32 (eager transformers
runs torch._grouped_mm, which has no fp64 CPU kernel): outputs, every gradient and the
parameters after Adam steps.
"""

import dataclasses
import logging

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (defines transformers.grouped_mm_fallback)
from torch.distributed.tensor import Partial, Replicate, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.cost_model.devices import LinkSpec, device_spec
from autojigsaw.capture import capture
from autojigsaw.strategies.rules.moe import GROUPED_MM, expert_rows_mm

from .hf_models import hf_model
from .side_by_side import build, replicated_bytes, train

FP32_TOL = 40 * torch.finfo(torch.float32).eps  # relative to the largest value
FP64_TOL = 8 * torch.finfo(torch.float64).eps
MESH = {"tensor": 2}
STEPS, LR, ADAM_EPS = 1, 1e-2, 1e-8  # side_by_side.train's Adam: one step, so outputs compare before Adam acts


def grouped_nodes(plan: Plan):
    return [n for n in plan.nodes if n.op == GROUPED_MM.removesuffix(".default")]


def check(results):
    """Outputs and gradients to fp32 rounding; parameters to what Adam makes of it.

    The reference runs torch._grouped_mm, the captured graph transformers' loop of mm: their
    gradients differ by rounding, and an entry whose gradient is itself of rounding size (an
    expert weight few tokens reach) moves by up to LR * (that difference) / ADAM_EPS per step.
    """
    for r in results:
        grad_tol = FP32_TOL * r["grad_scale"]
        tols = {"output": FP32_TOL * max(r["scale"], 1.0), "grad": grad_tol,
                "param": FP32_TOL + STEPS * LR * grad_tol / ADAM_EPS}
        for key, tol in tols.items():
            assert r[key] <= tol, (key, r[key], tol, r["table"])


@pytest.mark.parametrize("counts, split", [([3, 0, 5, 2], [2, 2]), ([4, 1, 3], [2, 1])],
                         ids=["an expert without rows", "uneven experts"])
def test_expert_rows_of_every_rank_sum_to_the_grouped_matmul(counts, split):
    op = torch.ops.transformers.grouped_mm_fallback.default
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(counts), 6, 5, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    g = torch.randn(sum(counts), 5, dtype=torch.float64)
    whole = op(x, w, offs)
    grads = torch.autograd.grad(whole, (x, w), g)
    firsts = [sum(split[:r]) for r in range(len(split))]
    parts = [expert_rows_mm(op, x, w_r, offs, first=f) for w_r, f in zip(w.split(split), firsts)]
    summed = sum(parts)
    summed_grads = torch.autograd.grad(summed, (x, w), g)
    for a, b in zip((summed, *summed_grads), (whole, *grads)):
        assert (a - b).abs().max() <= FP64_TOL * b.abs().max()


@pytest.fixture(scope="module")
def planned():
    """Under 0.7 of the replicated bytes, priced on 100 us links: on this tiny model gloo's ~0.5 ms
    rounds (the "cpu" spec) make gathering the expert weights cheaper than any sharded matmul."""
    model, inputs = build("mixtral", dtype=torch.float32)
    links = device_spec("cpu").with_links(LinkSpec("100 us", 100e-6, 1e9))
    budget = int(0.7 * replicated_bytes("mixtral", torch.float32))
    return autojigsaw.plan(model, inputs, MESH, device=links, memory_budget=budget).to_json()


def test_planner_shards_the_expert_weights_and_trains_like_single_device(ranks2, planned):
    plan = Plan.from_json(planned)
    sharded = [n for n in grouped_nodes(plan) if any(p != Replicate() for p in n.inputs[1])]
    assert sharded, plan.table(every_node=True)
    check(ranks2.run(train, "mixtral", tuple(MESH.values()), tuple(MESH), planned, steps=STEPS, dtype=torch.float32))


def test_experts_split_over_the_ranks_train_like_single_device(ranks2, planned):
    plan = Plan.from_json(planned)
    grouped = grouped_nodes(plan)
    experts = {"inputs": ((Replicate(),), (Shard(0),), (Replicate(),)), "outputs": ((Partial(),),),
               "kernel": "grouped_mm", "note": "tensor: experts"}
    plan = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, **experts) if n in grouped else n
                                                 for n in plan.nodes))
    check(ranks2.run(train, "mixtral", tuple(MESH.values()), tuple(MESH), plan.to_json(), steps=STEPS,
                     dtype=torch.float32))


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
