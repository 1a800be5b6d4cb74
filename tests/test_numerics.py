"""Numerics as on one device: inf and nan propagate to the same places; the same inputs give the same plan."""

import copy

import torch

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .models import build


def _nonfinite_run(plan_json: str) -> dict:
    ref = build("stack", torch.float64)
    x = torch.randn(4, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0, 1, 3], x[2, 4, 0] = float("inf"), float("nan")
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (x,), compile=False,
                                    plan=autojigsaw.Plan.from_json(plan_json))
    out, want = pmodel(x), ref(x)
    out.nan_to_num(0.0).sum().backward()
    want.nan_to_num(0.0).sum().backward()
    same = lambda a, b: bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()))
    grads = all(same(p.grad.full_tensor(), q.grad) for p, q in zip(pmodel.parameters(), ref.parameters()))
    finite = out.isfinite() & want.isfinite()
    return {"outputs": same(out, want), "grads": grads, "nonfinite": int((~want.isfinite()).sum()),
            "finite_err": (out[finite] - want[finite]).abs().max().item()}


def test_inf_and_nan_propagate_as_on_one_device(ranks2):
    model, x = build("stack", torch.float64), torch.randn(4, 6, 16, dtype=torch.float64)
    whole = autojigsaw.plan(model, (x,), {"tensor": 1}, device="cpu").memory_per_rank
    plan = autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu", memory_budget=int(0.6 * whole))
    assert any(not p.is_replicate() for pl in plan.param_placements.values() for p in pl), plan.table()
    for r in ranks2.run(_nonfinite_run, plan.to_json()):
        assert r["nonfinite"] > 0 and r["outputs"] and r["grads"], r
        assert r["finite_err"] <= 1e-12, r


def test_the_same_inputs_give_the_same_plan():
    model, x = build("stack", torch.float64), torch.randn(4, 6, 16, dtype=torch.float64)
    whole = autojigsaw.plan(model, (x,), {"tensor": 1}, device="cpu").memory_per_rank
    plans = [autojigsaw.plan(model, (x,), {"domain": 2, "tensor": 2}, device="cpu", memory_budget=int(0.6 * whole))
             for _ in range(2)]
    assert plans[0].to_json() == plans[1].to_json()
