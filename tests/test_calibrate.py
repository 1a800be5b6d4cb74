"""Calibration on the live gloo group, and predicted step times that rank plans as measured."""

import statistics
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.cost_model.devices import DeviceSpec, LinkSpec
from autojigsaw.testing.local_ranks import get_mesh

from .models import build

SIZES = dict(d=512, hidden=2048, depth=2, out=16)  # compute outweighs Megatron's all-reduces
SHAPE = (4, 64, 512)  # a batch whose compute keeps the sharded plan >= 1.25x faster under calibration noise


def _calibrate() -> DeviceSpec:
    return autojigsaw.calibrate(get_mesh((2,), ("tensor",)), max_bytes=1 << 20, repeats=5)


def test_calibrate_measures_every_axis_and_every_rank_agrees(ranks2):
    start = time.perf_counter()
    specs = ranks2.run(_calibrate)
    assert time.perf_counter() - start < 30
    spec = specs[0]
    assert specs[1] == spec and spec.name == "cpu-gloo-calibrated" and not spec.tree_all_reduce
    link = dict(spec.axis_links)["tensor"]
    assert 0 < link.latency_s < 0.1 and 1e7 < link.bandwidth < 1e12
    assert all(v > 1e8 for _, v in spec.flops) and spec.memory_bandwidth > 1e8
    assert spec.axis_link((2,), 0, "tensor") == link
    assert "axis 'tensor'" in spec.table()


def _step_times(plans: list[str], repeats: int) -> list[float]:
    """Median seconds of a training step per plan, the plans interleaved (the machine is shared)."""
    mesh = get_mesh((2,), ("tensor",))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))  # the same on every rank
    runs = []
    for text in plans:
        model = autojigsaw.parallelize(build("stack", torch.float32, **SIZES), mesh, (x,), compile=False,
                                       plan=Plan.from_json(text))
        runs.append((model, torch.optim.SGD(model.parameters(), lr=1e-4)))
    times = [[] for _ in plans]
    for rep in range(repeats + 1):
        for i, (model, opt) in enumerate(runs):
            dist.barrier()
            start = time.perf_counter()
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if rep:  # the first round warms up
                times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _resharded(plan: Plan, dims: dict[str, int]) -> Plan:
    """`plan` with the ops named in `dims` run sharded on that dim: about the same compute, and
    a redistribution into and out of each of them."""
    problem = plan.explainer.problem

    def shard(node):
        op = node.op.removeprefix("aten.").split(".")[0]
        if op not in dims:
            return node
        strategies = problem.strategies[problem.names.index(node.name)]
        s = next(s for s in strategies if s.inputs[0] == (Shard(dims[op]),))
        return replace(node, inputs=s.inputs, outputs=s.outputs, kernel=s.kernel)

    return replace(plan, nodes=tuple(shard(n) for n in plan.nodes))


@pytest.mark.timed  # timings are only comparable with no other test sharing the cores
def test_predicted_step_times_rank_plans_as_measured(ranks2):
    spec = ranks2.run(_calibrate)[0]
    model, x = build("stack", torch.float32, **SIZES), (torch.randn(SHAPE),)
    best = autojigsaw.plan(model, x, {"tensor": 2}, device=spec, optimizer="sgd")
    no_links = replace(spec, axis_links=(("tensor", LinkSpec("unusable", 1.0, 1e3)),))
    replicated = autojigsaw.plan(model, x, {"tensor": 2}, device=no_links, optimizer="sgd")
    assert not replicated.comm_bytes and best.comm_bytes
    plans = [best, replicated, _resharded(replicated, {"gelu": 0, "add": 1, "relu": 2})]
    predicted = [autojigsaw.evaluate(p, model, x, device=spec, optimizer="sgd").step_time for p in plans]
    assert predicted[0] * 1.25 < predicted[1] and predicted[1] * 1.1 < predicted[2], predicted
    measured = [max(t) for t in zip(*ranks2.run(_step_times, [p.to_json() for p in plans], 7))]
    assert sorted(range(3), key=measured.__getitem__) == [0, 1, 2], (predicted, measured)
