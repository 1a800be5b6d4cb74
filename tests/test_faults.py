"""A peer rank that dies or stalls mid-step: the survivor raises, in time, naming the collective and node.

A dedicated pool of 2 ranks with a 5 s collective timeout (a hang fails the test, never CI).
The survivor's error is a CollectiveError (a RuntimeError) whose message names the collective,
the mesh axis and the graph node it served; gloo's own error stays chained as its cause.
"""

import json
import os
import time

import pytest
import torch

import autojigsaw
from autojigsaw.kernels.collectives import CollectiveError
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh

from .models import build

TIMEOUT = 5.0


def _fault_case(fault: str, report: str) -> dict:
    model = build("mlp", torch.float64)
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    whole = autojigsaw.plan(model, (x,), {"tensor": 1}, device="cpu").memory_per_rank
    pmodel = autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (x,), compile=False,
                                    memory_budget=int(0.7 * whole))  # sharded: collectives in the step
    rank = torch.distributed.get_rank()
    if rank == 1:
        if fault == "dies":
            os._exit(1)  # no cleanup: the process is gone, as if killed
        time.sleep(3 * TIMEOUT)  # stalls past the group's timeout, then goes away quietly
        return {}
    start = time.perf_counter()
    try:
        pmodel(x).sum().backward()
        out = {"raised": None}
    except CollectiveError as e:
        out = {"raised": str(e), "cause": type(e.__cause__).__name__ if e.__cause__ else None}
    out["seconds"] = time.perf_counter() - start
    with open(report, "w") as f:
        json.dump(out, f)
    return out


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_the_survivor_raises_in_time_naming_collective_and_node(tmp_path, fault):
    report = str(tmp_path / "rank0.json")
    with LocalRanks(2, collective_timeout=TIMEOUT) as pool:
        try:
            pool.run(_fault_case, fault, report, timeout=30)
        except (TimeoutError, RuntimeError):
            pass  # the dead rank never answers; rank 0 wrote its report
    got = json.load(open(report))
    assert got["raised"], got
    assert got["seconds"] <= 2 * TIMEOUT + 5, got  # within the group's timeout (and scheduling noise)
    msg = got["raised"]
    assert any(k in msg for k in ("all_gather", "all_reduce", "reduce_scatter")), msg
    assert "mesh axis 'tensor'" in msg and "graph node" in msg and " for " in msg, msg
    assert got["cause"] is not None, got
