"""A peer rank that dies or stalls mid-step: the survivor raises, in time, naming the collective and node.

A dedicated pool of 2 ranks with a 5 s collective timeout (a hang fails the test, never CI).
The survivor's error is a CollectiveError (a RuntimeError) whose message names the collective,
the mesh axis and the graph node it served; gloo's own error stays chained as its cause. The
kernels that overlap their own collectives (fused linears, ring attention, zigzag) raise the same,
and a rank waiting for rank 0's plan, its traced program or the ranks' free memory (parallelize's
first exchanges) says why it stopped waiting.
"""

import json
import os
import time

import pytest
import torch

import autojigsaw
from autojigsaw.ir import GradKind
from autojigsaw.kernels.attention import ring_attention, to_zigzag
from autojigsaw.kernels.collectives import CollectiveError
from autojigsaw.kernels.matmul import all_gather_linear, linear_reduce_scatter, summa_linear
from autojigsaw.mesh import MeshAxis
from autojigsaw.runtime.checks import default_budget
from autojigsaw.runtime.one_plan import planned_on_rank0
from autojigsaw.runtime.one_program import follow_rank0_order
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh

from .models import build

TIMEOUT = 5.0


def _write(report: str, out: dict) -> dict:
    """The surviving rank's findings, written where the test reads them after the pool is gone."""
    with open(report, "w") as f:
        json.dump(out, f)
    return out


def _survivors_report(tmp_path, case, *args) -> tuple[dict, bool]:
    """`case(*args, report)` on a fresh pair of ranks, one of which dies or stalls: the report the
    other wrote, and whether the pool raised (the faulty rank never answers as asked)."""
    report = str(tmp_path / "survivor.json")
    with LocalRanks(2, collective_timeout=TIMEOUT) as pool:
        try:
            pool.run(case, *args, report, timeout=30)
            raised = False
        except (TimeoutError, RuntimeError):
            raised = True
    return json.load(open(report)), raised


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
        time.sleep(2 * TIMEOUT)  # stalls past the group's timeout, then goes away quietly
        return {}
    start = time.perf_counter()
    try:
        pmodel(x).sum().backward()
        out = {"raised": None}
    except CollectiveError as e:
        out = {"raised": str(e), "cause": type(e.__cause__).__name__ if e.__cause__ else None}
    out["seconds"] = time.perf_counter() - start
    return _write(report, out)


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_the_survivor_raises_in_time_naming_collective_and_node(tmp_path, fault):
    got, _ = _survivors_report(tmp_path, _fault_case, fault)
    assert got["raised"], got
    assert got["seconds"] <= 2 * TIMEOUT + 5, got  # within the group's timeout (and scheduling noise)
    msg = got["raised"]
    assert any(k in msg for k in ("all_gather", "all_reduce", "reduce_scatter")), msg
    assert "mesh axis 'tensor'" in msg and "graph node" in msg and " for " in msg, msg
    assert got["cause"] is not None, got


def _kernel_fault_case(report: str) -> dict:
    if torch.distributed.get_rank() == 1:
        os._exit(1)
    axis = MeshAxis("tensor", 2, torch.distributed.group.WORLD.group_name, 0)
    x, w, q = torch.randn(4, 3, 8), torch.randn(5, 8), torch.randn(1, 2, 3, 4)
    calls = {
        "all_gather_linear": lambda: all_gather_linear(x, w, dim=1, sizes=(3, 3), axis=axis, grad=GradKind.R),
        "linear_reduce_scatter": lambda: linear_reduce_scatter(torch.randn(4, 6, 8), w, dim=1, sizes=(3, 3),
                                                               op="sum", axis=axis),
        "summa_linear": lambda: summa_linear(x, torch.randn(3, 8), weight_sizes=(3, 2), out_sizes=(3, 2),
                                             domain=axis, tensor=axis),
        "ring_attention": lambda: ring_attention(q, q, q, seq_sizes=(3, 3), axis=axis),
        "to_zigzag": lambda: to_zigzag(q, dim=-2, seq_len=6, axis=axis),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except CollectiveError as e:
            out[name] = str(e)
        except Exception as e:  # noqa: BLE001 - the test reports which type it was
            out[name] = f"not a CollectiveError: {type(e).__name__}: {e}"
    return _write(report, out)


def test_a_dead_peer_in_any_kernel_raises_a_collective_error(tmp_path):
    got, _ = _survivors_report(tmp_path, _kernel_fault_case)
    assert len(got) == 5, got
    for name, msg in got.items():
        assert msg.split(" over mesh axis 'tensor'")[0] in ("all_gather", "reduce_scatter", "send_recv",
                                                           "all_to_all"), (name, msg)


def _rank0_gone_before_it_sends(exchange: str, report: str) -> dict:
    if torch.distributed.get_rank() == 0:
        os._exit(1)  # as a rank 0 that stopped, or planned past the group's timeout, seen from rank 1
    start = time.perf_counter()
    try:
        if exchange == "plan":
            planned_on_rank0(lambda: None)
        elif exchange == "program":  # parallelize's first exchange where a memory budget is given
            follow_rank0_order(None)
        else:  # its first where none is: the ranks' free memory
            default_budget(None)
        out = {"raised": None}
    except RuntimeError as e:
        out = {"raised": str(e)}
    out["seconds"] = time.perf_counter() - start
    return _write(report, out)


@pytest.mark.parametrize("exchange,says", [
    ("plan", ("rank 0's plan did not arrive", "timeout=", "pass plan= to parallelize")),
    ("program", ("rank 0's traced program did not arrive", "call parallelize alike on every rank")),
    ("budget", ("the ranks' free memory did not arrive", "call parallelize alike on every rank"))])
def test_a_rank_waiting_for_rank_0_raises_in_time_saying_why(tmp_path, exchange, says):
    got, pool_raised = _survivors_report(tmp_path, _rank0_gone_before_it_sends, exchange)
    assert pool_raised  # rank 0 is gone
    assert got["raised"] and got["seconds"] <= 2 * TIMEOUT + 5, got
    assert all(phrase in got["raised"] for phrase in says), got
