"""Training details: dropout, gradient clipping, bf16 mixed precision, eval mode, gradient accumulation and
parameters frozen after parallelize, against one device.

Dropout draws the single-device mask on every rank (kernels/random.py), so with the same seed
before each forward the parallel model matches bit for bit. clip_grad_norm_ works on the DTensor
gradients unchanged. In bf16 the parallel model rounds differently (partial sums of a sharded
contraction are rounded to bf16 before the fp32 reduction; the single device rounds once), so
it is compared with a tolerance derived from bf16's unit roundoff; the same plan in fp32 agrees
to fp32 rounding. Reductions of bf16 values send fp32 (kernels/collectives.py: reduce_dtype),
and the plan's traffic prediction counts exactly those bytes. model.eval() (and a frozen BatchNorm
inside a training model) runs a graph captured in that mode, planned with the parameters in place.
"""

import copy

import pytest
import torch

import autojigsaw
from autojigsaw import Plan
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.testing.local_ranks import get_mesh

from .side_by_side import build, loss_of, plan_json, train

BF16_U = 2.0**-8  # bf16 unit roundoff: 8 significant bits
FP32_U = 2.0**-24


@pytest.mark.parametrize("name,mesh", [("gpt2", {"tensor": 2}), ("bert", {"domain": 2})])
def test_dropout_matches_single_device_exactly(ranks2, name, mesh):
    plan = plan_json(name, mesh, dropout=0.1)
    for r in ranks2.run(train, name, tuple(mesh.values()), tuple(mesh), plan, steps=2, dropout=0.1):
        assert r["sharded"] > 0, r["table"]
        for key in ("output", "grad", "param"):
            assert r[key] <= 1e-10, (key, r[key], r["table"])


def test_gradient_clipping_matches_single_device(ranks4):
    mesh = {"domain": 2, "tensor": 2}
    plan = plan_json("mixer", mesh)
    for r in ranks4.run(train, "mixer", (2, 2), tuple(mesh), plan, steps=2, clip=0.05):
        assert r["sharded"] > 0, r["table"]
        for key in ("norm", "output", "grad", "param"):
            assert r[key] <= 1e-12, (key, r[key])


@pytest.mark.parametrize("dtype,unit", [(torch.bfloat16, BF16_U), (torch.float32, FP32_U)], ids=["bf16", "fp32"])
def test_mixed_precision_within_rounding_of_single_device(ranks2, dtype, unit):
    """One step of the mixer in bf16 (reductions in fp32) and in fp32, on a tensor=2 plan.

    A sharded contraction rounds its partial sums once more than the single device: at most
    one unit of roundoff per matmul, relative to the largest value, over the mixer's 9 matmuls.
    """
    mesh = {"tensor": 2}
    plan = plan_json("mixer", mesh, 0.715, dtype=dtype)
    for r in ranks2.run(train, "mixer", (2,), tuple(mesh), plan, steps=1, dtype=dtype):
        assert r["sharded"] > 0, r["table"]
        assert r["output"] <= 9 * unit * r["scale"], r
        assert r["grad"] <= 9 * unit * r["grad_scale"], r


def _traffic(plan: str, dtype: torch.dtype) -> tuple[int, dict[str, int]]:
    """(predicted bytes, bytes counted per collective) of one step on this rank."""
    model, inputs = build("mixer", dtype=dtype)
    pmodel = autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    plan=Plan.from_json(plan))
    with count_comm() as log:
        loss_of(pmodel(*inputs)).backward()
    by_kind: dict[str, int] = {}
    for kind, _, nbytes in log.calls:
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    # The prediction for this graph (the plan's own was made for its dtype): read off its collectives.
    predicted = traffic_by_origin(pmodel.program.graph, pmodel.program.rank, set(pmodel.program.captured.params), True)
    return sum(predicted.values()), by_kind


def test_bf16_reductions_send_fp32_and_the_plan_counts_them_exactly(ranks2):
    """One plan run in bf16 and fp32: sums send the same fp32 bytes, all predicted exactly."""
    plan = plan_json("mixer", {"tensor": 2}, 0.715, dtype=torch.float32)
    sent = {}
    for dtype in (torch.bfloat16, torch.float32):
        predicted, by_kind = ranks2.run(_traffic, plan, dtype)[0]
        assert predicted == sum(by_kind.values()) > 0, (dtype, predicted, by_kind)
        sent[dtype] = by_kind
    for kind in ("all_reduce", "reduce_scatter"):
        assert sent[torch.bfloat16].get(kind) == sent[torch.float32].get(kind), sent


class _DropoutBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop = torch.nn.Linear(32, 256), torch.nn.Dropout(0.3)
        self.bn, self.fc2 = torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.drop(self.fc1(x)))))


def _train_eval_and_frozen_batchnorm(plan: str) -> dict:
    """A training step, an evaluation (no dropout, BatchNorm's running statistics), then fine-tuning
    with BatchNorm frozen (model.train(); model.bn.eval()), each beside one device."""
    torch.manual_seed(0)
    ref = _DropoutBatchNorm().double()
    x = torch.randn(16, 32, dtype=torch.float64)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (x,), compile=False,
                                    plan=Plan.from_json(plan))
    diffs = {}

    def step(name: str, seed: int, backward: bool) -> None:
        outs = []
        for m in (pmodel, ref):
            torch.manual_seed(seed)
            y = m(x)
            if backward:
                y.square().sum().backward()
            outs.append(y.detach())
        diffs[name] = (outs[0] - outs[1]).abs().max().item()
        diffs[name + " running_mean"] = (pmodel.bn.running_mean - ref.bn.running_mean).abs().max().item()
        if backward:
            diffs[name + " grad"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                                        for p, q in zip(pmodel.parameters(), ref.parameters()))
            for m in (pmodel, ref):
                m.zero_grad()

    step("train", 1, backward=True)
    for m in (pmodel, ref):
        m.eval()
    with torch.no_grad():
        step("eval", 2, backward=False)
    for m in (pmodel, ref):
        m.train()
        m.bn.eval()
    step("frozen batchnorm", 3, backward=True)
    for m in (pmodel, ref):
        m.train()
    step("train again", 4, backward=True)
    diffs["programs"] = len(pmodel.programs)
    return diffs


def test_eval_mode_and_frozen_batchnorm_match_single_device(ranks2):
    # the graph captured in training mode ran for model.eval() too: dropout stayed on, BatchNorm used
    # the batch's statistics and updated its running ones (eval output off by 2.2, frozen-BN grads by 52)
    model = _DropoutBatchNorm().double()
    x = torch.randn(16, 32, dtype=torch.float64)
    whole = autojigsaw.plan(model, (x,), {"tensor": 1}, device="cpu").memory_per_rank
    plan = autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu", memory_budget=int(0.7 * whole))
    assert plan.param_placements["bn.weight"] != (torch.distributed.tensor.Replicate(),), plan
    for r in ranks2.run(_train_eval_and_frozen_batchnorm, plan.to_json()):
        programs = r.pop("programs")
        for key, value in r.items():
            assert value <= 1e-10, (key, value)
        assert programs == 3  # training, eval, mixed: each mode captured once


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 256), torch.nn.Linear(256, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _accumulate_then_freeze(axis: str, options: dict) -> dict:
    """Two micro-batches' gradients summed before one Adam step, then fc1 frozen after parallelize."""
    torch.manual_seed(0)
    ref = _TwoLayers().double()
    xs = [torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), (axis,)), (xs[0],), compile=False, **options)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pmodel, ref)]
    diffs = {}
    for m in (pmodel, ref):
        for x in xs[:2]:
            m(x).square().mean().backward()
    diffs["accumulated grad"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                                    for p, q in zip(pmodel.parameters(), ref.parameters()))
    for o in opts:
        o.step()
        o.zero_grad()
    for m in (pmodel, ref):
        m.fc1.requires_grad_(False)
        m(xs[2]).square().mean().backward()
    diffs["frozen fc1 has a grad"] = float(pmodel.fc1.weight.grad is not None)
    diffs["fc2 grad"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                            for p, q in zip(pmodel.fc2.parameters(), ref.fc2.parameters()))
    for o in opts:
        o.step()
    diffs["params"] = max((p.full_tensor() - q).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    diffs["fc1 sharded"] = float(pmodel.plan.param_placements["fc1.weight"] != (torch.distributed.tensor.Replicate(),))
    return diffs


@pytest.mark.parametrize("axis,options", [("tensor", {"memory_budget": 600_000}), ("data", {"data_parallel": "fsdp"})])
def test_gradient_accumulation_and_freezing_after_parallelize(ranks2, axis, options):
    for r in ranks2.run(_accumulate_then_freeze, axis, options):
        assert r.pop("fc1 sharded") == (axis == "tensor"), r
        assert r.pop("frozen fc1 has a grad") == 0.0, r
        for key, value in r.items():
            assert value <= 1e-10, (key, value)


def _built_under_inference_mode(axis: str, options: dict, lazy: bool) -> dict:
    """A check under torch.inference_mode first (parallelize, or the first call of a lazily planned
    module), then two training steps."""
    torch.manual_seed(0)
    ref = _TwoLayers().double()
    x = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(ref)  # outside: a copy made in inference mode could not train on one device either
    with torch.inference_mode():
        pmodel = autojigsaw.parallelize(model, get_mesh((2,), (axis,)), None if lazy else (x,), compile=False, **options)
        checked = (pmodel(x) - ref(x)).abs().max().item()
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (pmodel, ref)]
    for _ in range(2):
        for m, o in zip((pmodel, ref), opts):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    return {"check": checked,
            "params": max((p.full_tensor() - q).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))}


@pytest.mark.parametrize("axis,options,lazy", [("tensor", {"memory_budget": 600_000}, True),
                                               ("data", {"data_parallel": "fsdp"}, False)])
def test_a_first_call_under_inference_mode_still_trains(ranks2, axis, options, lazy):
    # the shards were made in inference mode: "Inference tensors cannot be saved for backward" at the first step
    for r in ranks2.run(_built_under_inference_mode, axis, options, lazy):
        assert r["check"] <= 1e-12 and r["params"] <= 1e-12, r
