"""dynamic=True: one plan serves every batch size and sequence length torch.export keeps symbolic.

Rank 0 plans once, at the first shape, for every rank; the other shapes must run with that plan (uneven shards
included), never planned again, and give the single-device numbers.
"""

import copy
import logging

import torch

import autojigsaw
from autojigsaw.planner import solve
from autojigsaw.testing.local_ranks import get_mesh

from .models import MLP
from .side_by_side import build, loss_of, replicated_bytes

# The first shape is the example the plan is priced at; the others reuse it (uneven shards included).
SHAPES = {"mlp": ((4, 8, 16), (3, 8, 16), (4, 5, 16), (3, 8, 16)), "llama": ((2, 16), (3, 12))}


def _model(name: str) -> torch.nn.Module:
    if name == "mlp":
        torch.manual_seed(0)
        return MLP().double()
    return build(name)[0]


def _inputs(name: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if name == "mlp":
        return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in SHAPES[name]]
    return [torch.randint(0, 128, shape, generator=gen) for shape in SHAPES[name]]


def _dynamic_run(name: str, budget: int) -> dict:
    """Parallelize with dynamic=True under `budget` bytes per rank, then train a step at every shape."""
    ref = _model(name)
    batches = _inputs(name)
    plans = []  # the solves of this rank: one per plan made (no recomputation)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("autojigsaw")
    level = logger.level
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    try:
        pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), (batches[0],),
                                        compile=False, memory_budget=budget, dynamic=True,
                                        solver=lambda *a, **k: plans.append(1) or solve(*a, **k))
        start = [q.detach().clone() for q in ref.parameters()]
        opt, ref_opt = torch.optim.SGD(pmodel.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
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
        logger.removeHandler(handler), logger.setLevel(level)
    moved = max((q - q0).abs().max().item() for q, q0 in zip(ref.parameters(), start))
    step = max((p.full_tensor() - q).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters())) / moved
    return {"errors": errors, "step": step, "plans": len(plans), "programs": len(pmodel.programs),
            "reused": sum("run with the plan of" in r for r in records),
            "decisions": len({p.plan.fingerprint() for p in pmodel.programs}),
            "sharded": sum(any(not pl.is_replicate() for pl in p.placements) for p in pmodel.parameters())}


def _check(name: str, results: list[dict], tolerance: float) -> None:
    shapes = len(set(SHAPES[name]))
    for rank, r in enumerate(results):
        assert r["sharded"] > 0, r
        assert r["plans"] == (rank == 0) and r["programs"] == shapes and r["reused"] == shapes - 1, r  # one plan for all
        assert r["decisions"] == 1, "every shape must run the plan's decisions"
        for out_err, grad_err in r["errors"]:
            assert out_err <= tolerance and grad_err <= tolerance, r
        assert r["step"] <= tolerance, r  # the steps' difference, relative to the largest step


def test_one_plan_serves_every_batch_and_length_of_the_mlp(ranks2):
    replicated = autojigsaw.plan(_model("mlp"), (_inputs("mlp")[0],), {"tensor": 1}, device="cpu").memory_per_rank
    _check("mlp", ranks2.run(_dynamic_run, "mlp", int(0.6 * replicated)), 64 * 2.0**-52)


def test_one_plan_serves_every_batch_and_length_of_llama(ranks2):
    budget = int(0.6 * replicated_bytes("llama"))  # the first shape is side_by_side's example, cached
    _check("llama", ranks2.run(_dynamic_run, "llama", budget), 64 * 2.0**-24)  # RMSNorm, RoPE in fp32
