"""parallelize() on MLPs and stacks of linears: equal to the single-device model, step by step."""

import pytest
import torch

from autojigsaw import Plan

from .models import compare_training

FP64 = dict(dtype=torch.float64, tol=1e-10)
FP32 = dict(dtype=torch.float32, tol=2e-5)

# Parameter memory of the models below (x4 for training with Adam) is 70-160 KiB, so these
# budgets rule out replicating every weight and force a sharded plan.
CASES = [
    ("mlp", (2, 5, 16), (2,), ("tensor",), 50_000, FP64),
    ("mlp", (2, 5, 16), (4,), ("tensor",), 30_000, FP32),
    ("stack", (3, 7, 16), (4,), ("tensor",), 100_000, FP64),
    ("stack", (3, 7, 16), (2, 2), ("domain", "tensor"), 80_000, FP32),
    ("stack", (3, 7, 16), (2,), ("tensor",), None, FP64),  # default budget: replicated is fastest
]


@pytest.mark.parametrize("model,shape,mesh,names,budget,prec", CASES)
def test_training_matches_single_device(ranks2, ranks4, model, shape, mesh, names, budget, prec):
    pool = ranks2 if len(mesh) == 1 and mesh[0] == 2 else ranks4
    results = pool.run(compare_training, model, shape, mesh, names, dtype=prec["dtype"],
                       budget=budget, steps=2, input_grad=True)
    for r in results:
        for key in ("output", "grad", "param", "input_grad"):
            assert r[key] <= prec["tol"], (key, r[key])
    plan = Plan.from_json(results[0]["plan"])
    sharded = any(any(not p.is_replicate() for p in pl) for pl in plan.param_placements.values())
    assert sharded == (budget is not None), plan.table()
