"""dynamic=True: one plan serves every batch size and sequence length torch.export keeps symbolic.

The plan is made once, in the test process, at the largest shape; the ranks must run the other
shapes with it (uneven shards included), never plan, and give the single-device numbers.
"""

import copy
import logging
import time

import torch

import autojigsaw
import autojigsaw.api
from autojigsaw import Plan
from autojigsaw.testing.local_ranks import get_mesh

from .hf_models import hf_model
from .models import MLP
from .side_by_side import loss_of

SHAPES = {"mlp": ((4, 8, 16), (3, 8, 16), (4, 5, 16), (2, 7, 16)), "llama": ((4, 16), (3, 16), (4, 12), (3, 16))}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return (MLP() if name == "mlp" else hf_model(name)[0]).double()


def _inputs(name: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if name == "mlp":
        return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in SHAPES[name]]
    return [torch.randint(0, 128, shape, generator=gen) for shape in SHAPES[name]]


def _plan_json(name: str) -> str:
    """The plan at the first (largest) shape, under 60 % of the replicated bytes: weights sharded."""
    model, example = _model(name), _inputs(name)[0]
    whole = autojigsaw.plan(model, (example,), {"tensor": 1}, device="cpu").memory_per_rank
    return autojigsaw.plan(model, (example,), {"tensor": 2}, device="cpu", memory_budget=int(0.6 * whole),
                           dynamic=True).to_json()


def _dynamic_run(name: str, plan_json: str) -> dict:
    ref = _model(name)
    batches = _inputs(name)
    plans = []
    planned = autojigsaw.api.plan_captured
    autojigsaw.api.plan_captured = lambda *a, **k: plans.append(1) or planned(*a, **k)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("autojigsaw")
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (batches[0],),
                                        compile=False, plan=Plan.from_json(plan_json), dynamic=True)
        opt, ref_opt = torch.optim.Adam(pmodel.parameters(), lr=1e-3), torch.optim.Adam(ref.parameters(), lr=1e-3)
        errors = []
        for x in batches:
            out, ref_out = pmodel(x), ref(x)
            out, ref_out = getattr(out, "logits", out), getattr(ref_out, "logits", ref_out)
            loss_of(out).backward()
            loss_of(ref_out).backward()
            scale = max(q.grad.abs().max().item() for q in ref.parameters())
            grad = max((p.grad.full_tensor() - q.grad).abs().max().item()
                       for p, q in zip(pmodel.parameters(), ref.parameters()))
            errors.append(((out - ref_out).abs().max().item() / ref_out.abs().max().item(), grad / scale))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
    finally:
        autojigsaw.api.plan_captured = planned
        logger.removeHandler(handler)
    step = max((p.full_tensor() - q).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return {"errors": errors, "step": step, "plans": len(plans), "programs": len(pmodel._programs),
            "reused": sum("run with the plan of" in r for r in records),
            "decisions": {p.plan.fingerprint() for p in pmodel._programs.values()}, "planned": Plan.from_json(plan_json).fingerprint(),
            "sharded": sum(any(not pl.is_replicate() for pl in p.placements) for p in pmodel.parameters())}


def _check(name: str, results: list[dict], tolerance: float) -> None:
    shapes = len(set(SHAPES[name]))
    for r in results:
        assert r["sharded"] > 0, r
        assert r["plans"] == 0 and r["programs"] == shapes and r["reused"] == shapes - 1, r  # one plan for all
        assert r["decisions"] == {r["planned"]}, "every shape must run the plan's decisions"
        for out_err, grad_err in r["errors"]:
            assert out_err <= tolerance and grad_err <= tolerance, r
        assert r["step"] <= 1e-6, r  # Adam's first steps move every weight by about lr


def test_one_plan_serves_every_batch_and_length_of_the_mlp(ranks2):
    _check("mlp", ranks2.run(_dynamic_run, "mlp", _plan_json("mlp")), 64 * 2.0**-52)


def test_one_plan_serves_every_batch_and_length_of_llama(ranks2):
    _check("llama", ranks2.run(_dynamic_run, "llama", _plan_json("llama")), 64 * 2.0**-24)  # RMSNorm, RoPE in fp32
