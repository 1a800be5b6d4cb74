"""torch.compile(fullgraph=True) of a rewritten graph: no graph breaks, same results.

Compiling takes ~30 s per graph on these machines, so this is the one compiled case.
"""

import copy

import torch
import torch.distributed as dist

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .models import build


def _compiled_vs_eager():
    from torch._dynamo.utils import counters

    counters.clear()
    mesh = get_mesh((dist.get_world_size(),), ("tensor",))
    ref = build("mlp", torch.float32)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 16)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), mesh, (x,), compile=True, memory_budget=30_000)
    y = pmodel(x)
    y.square().sum().backward()
    ref(x).square().sum().backward()
    grads = max((p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "output": (y - ref(x)).abs().max().item(),
        "grad": grads,
        "sharded": any(not p.placements[0].is_replicate() for p in pmodel.parameters()),
    }


def test_compiled_model_has_no_graph_breaks_and_matches(ranks2):
    for r in ranks2.run(_compiled_vs_eager, timeout=600):
        assert r["breaks"] == 0 and r["graphs"] == 1, r
        assert r["sharded"], "the budget should force a sharded plan with collectives to compile"
        assert r["output"] < 1e-5 and r["grad"] < 1e-5, r
