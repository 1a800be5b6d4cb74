"""Bucketed collectives: fewer calls, the same gradients as one device, predicted bytes exact.

On 2 ranks: the tiny Llama of tests/hf_models.py planned with the "cpu" spec (replicated weights'
gradients all-reduced: one bucket), and the weather mixer on links of 1 us latency under 0.75 of
its replicated bytes (some weights gathered: a layer's gathers in one bucket).
A bucket that gathers another bucket's values runs after it.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autojigsaw
from autojigsaw.api import capture_for
from autojigsaw.cost_model.devices import LinkSpec, device_spec
from autojigsaw.kernels import bucketed
from autojigsaw.kernels import collectives as C
from autojigsaw.ir import GradKind
from autojigsaw.mesh import MeshAxis, MeshSpec, RankView
from autojigsaw.placements import chunk_sizes
from autojigsaw.rewrite import bucket
from autojigsaw.rewrite.rewrite import rewrite

from .cost_checks import measure_step
from .side_by_side import build, plan_json, replicated_bytes, train

MESH = {"tensor": 2}
FP32_TOL = 5e-6  # as tests/test_hf_models.py: Llama's RMSNorm computes in fp32 whatever the model's dtype
TOL = {"llama": FP32_TOL, "mixer": 64 * torch.finfo(torch.float64).eps}  # the mixer computes in float64
_COLLECTIVES = {C.all_gather, C.reduce_scatter, C.all_reduce, C.all_to_all, C.grad_all_reduce,
                bucketed.bucket_all_gather, bucketed.bucket_grad_all_reduce}


@pytest.fixture(scope="module")
def plans():
    """Per case, (model, plan): replicated llama on the "cpu" spec, the mixer on links of 1 us."""
    model, inputs = build("mixer")
    fast = LinkSpec("1 us", 1e-6, 1e12)
    return {"cpu": ("llama", plan_json("llama", MESH)),
            "fast": ("mixer", autojigsaw.plan(model, inputs, MESH, device=device_spec("cpu").with_links(fast, fast),
                                              memory_budget=int(0.75 * replicated_bytes("mixer"))).to_json())}


class _Scales(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.randn(8)) for _ in range(3))

    def forward(self, x):
        return ((x * self.c).sin() * self.a * self.b).sum()


def test_a_bucket_that_gathers_another_buckets_values_runs_after_it():
    """a, b, c stored split over domain, read whole; a and b read by rows split over tensor, so their
    gradients are summed over tensor (one bucket, at a's gather) before their gathers over domain,
    which c's gather, read first, would have taken into its bucket, ahead of the values it gathers
    (the weather mixer on 2 x 2 planned such a graph: "used before it has been defined")."""
    model, x = _Scales(), torch.randn(4, 8)
    mesh = MeshSpec.of({"domain": 2, "tensor": 2})
    R, S0 = Replicate(), Shard(0)
    edits = {"p_a": dict(outputs=((S0, R),)), "p_b": dict(outputs=((S0, R),)), "p_c": dict(outputs=((S0, R),)),
             "mul_1": dict(inputs=((R, S0), (R, R)), outputs=((R, S0),)),
             "mul_2": dict(inputs=((R, S0), (R, R)), outputs=((R, S0),)),
             "sum_1": dict(inputs=((R, S0),), outputs=((R, Partial()),))}
    whole = autojigsaw.plan(model, (x,), mesh, device="cpu")
    plan = dataclasses.replace(whole, nodes=tuple(dataclasses.replace(n, **edits.get(n.name, {}))
                                                  for n in whole.nodes))
    captured = capture_for(model, (x,), {}, autojigsaw.Options(device="cpu").regime(mesh))
    gm = rewrite(captured, plan, RankView.planning(mesh))  # lints the graph
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    (summed,) = (n for n in gm.graph.nodes if n.target is bucketed.bucket_grad_all_reduce)
    gathers = [n for n in gm.graph.nodes if n.target in (C.all_gather, bucketed.bucket_all_gather)]
    assert len(gathers) == 2 and order[summed] < max(order[g] for g in gathers), gm.code


def _collectives(name: str, plan_text: str) -> list:
    model, inputs = build(name)
    plan = autojigsaw.Plan.from_json(plan_text)
    mesh = MeshSpec.of(MESH)
    captured = capture_for(model, inputs, {}, autojigsaw.Options(device="cpu").regime(mesh))
    gm = rewrite(captured, plan, RankView.planning(mesh))
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in _COLLECTIVES]


@pytest.mark.parametrize("name,bucketed_fn", [("cpu", bucketed.bucket_grad_all_reduce),
                                               ("fast", bucketed.bucket_all_gather)])
def test_bucketing_drops_collectives(plans, monkeypatch, name, bucketed_fn):
    merged = _collectives(*plans[name])
    monkeypatch.setattr(bucket, "BUCKET_BYTES", 0)  # every collective its own call
    separate = _collectives(*plans[name])
    assert bucketed_fn in merged and bucketed_fn not in separate
    assert len(merged) < len(separate), (len(merged), len(separate))


def _bucketed_and_separate(name: str, plan: str) -> tuple[dict, dict]:
    """train()'s differences from one device, with buckets and with every collective its own call."""
    bucketed_run = train(name, (2,), ("tensor",), plan, steps=2)
    saved, bucket.BUCKET_BYTES = bucket.BUCKET_BYTES, 0
    try:
        return bucketed_run, train(name, (2,), ("tensor",), plan, steps=2)
    finally:
        bucket.BUCKET_BYTES = saved


@pytest.mark.parametrize("name", ["cpu", "fast"])
def test_bucketed_plans_train_like_single_device_and_send_the_predicted_bytes(ranks2, plans, name):
    model, plan = plans[name]
    for merged, separate in ranks2.run(_bucketed_and_separate, model, plan):
        tol = TOL[model] * max(merged["scale"], 1.0)
        assert merged["output"] <= tol and merged["grad"] <= tol, (merged, merged["table"])
        # After Adam steps the plan differs from one device by more than fp32 roundoff where a gradient
        # is near zero (Adam divides by its size), with or without buckets: buckets must change nothing.
        assert all(merged[k] == separate[k] for k in ("output", "grad", "param")), (merged, separate)
    sent = ranks2.run(measure_step, build, (model,), (2,), ("tensor",), plan=plan)
    for s in sent:
        assert s.sent_bytes == s.predicted_bytes > 0, (s.sent_bytes, s.predicted_bytes)


def _kernels_against_single_collectives():
    """Uneven chunks on several dims: a bucket's values and gradients equal one collective per value."""
    n, r = dist.get_world_size(), dist.get_rank()
    axis = MeshAxis("a", n, dist.group.WORLD.group_name, r)
    torch.manual_seed(r)
    shapes, dims = [(3, 7, 5), (5, 3), (2, 9)], (1, 0, 1)  # 7, 5 and 9 split unevenly
    sizes = tuple(chunk_sizes(s[d], n) for s, d in zip(shapes, dims))
    xs = [torch.randn(*s[:d], z[r], *s[d + 1:], dtype=torch.float64) for s, d, z in zip(shapes, dims, sizes)]
    gs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    out = {}
    for grad in (GradKind.R, GradKind.P):
        one = [x.clone().requires_grad_() for x in xs]
        ys = [C.all_gather(x, dim=d, sizes=z, axis=axis, grad=grad)
              for x, d, z in zip(one, dims, sizes)]
        torch.autograd.backward(ys, gs)
        many = [x.clone().requires_grad_() for x in xs]
        yb = bucketed.bucket_all_gather(*many, dims=dims, sizes=sizes, axis=axis, grad=grad)
        torch.autograd.backward(list(yb), gs)
        pairs = zip(ys + [x.grad for x in one], list(yb) + [x.grad for x in many])
        out[grad] = all(torch.equal(a, b) for a, b in pairs)
    one = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]  # replicated values
    torch.autograd.backward([C.grad_all_reduce(x, axis=axis) for x in one], gs)
    many = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    torch.autograd.backward(list(bucketed.bucket_grad_all_reduce(*many, axis=axis)), gs)
    out["grad_all_reduce"] = all(torch.equal(a.grad, b.grad) for a, b in zip(one, many))
    return out


def test_bucket_kernels_equal_one_collective_per_value(ranks2):
    for r in ranks2.run(_kernels_against_single_collectives):
        assert all(r.values()), r
