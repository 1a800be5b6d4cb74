"""gloo's latency and bandwidth on this machine: the numbers behind the built-in "cpu-gloo" spec.

On 2 and 4 local gloo ranks (one thread each), all-gathers and all-reduces of 1 KiB .. 16 MiB
(the functional collectives the kernels run); every time is the median of `--reps` calls, the
slowest rank's. Then the ring model (rounds x latency + bytes sent / bandwidth, as
cost_model/comm.py prices a collective) fitted to them by least squares of the relative error
(a shared machine's noise is proportional to the time, and the small messages fix the latency).

Run: python -m benchmarks.gloo_links [--worlds 2 4] [--reps 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from autojigsaw.cost_model.comm import latency_steps
from autojigsaw.ir import bytes_sent
from autojigsaw.testing.local_ranks import LocalRanks

from .common import Report

SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
KINDS = ("all_gather", "all_reduce")
_c10d = torch.ops._c10d_functional


def _call(kind: str, x: torch.Tensor, n: int, group: str):
    if kind == "all_gather":
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, n, group))
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))


def _median_time(kind: str, x: torch.Tensor, n: int, group: str, reps: int) -> float:
    _call(kind, x, n, group)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        _call(kind, x, n, group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_rank(reps: int) -> list[list[float]]:
    """On every rank: the median time of each collective and size, the slowest rank's."""
    n = dist.get_world_size()
    group = dist.group.WORLD.group_name
    times = torch.tensor([[_median_time(kind, torch.ones(size // 4), n, group, reps) for size in SIZES]
                          for kind in KINDS], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def fit(times: list[list[float]], n: int) -> tuple[float, float]:
    """(latency per round, bandwidth) of the ring model, by least squares of the relative error."""
    rows = np.array([(latency_steps(k, n), bytes_sent(k, size, n)) for k in KINDS for size in SIZES], dtype=float)
    t = np.array(times, dtype=float).ravel()
    (latency, inverse_bw), _ = nnls(rows / t[:, None], np.ones_like(t))
    return float(latency), 1.0 / float(inverse_bw)


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    report = Report("gloo_links", "gloo collectives on local CPU ranks")
    for n in args.worlds:
        with LocalRanks(n, timeout=900) as pool:
            times = pool.run(run_rank, args.reps)[0]
        latency, bandwidth = fit(times, n)
        rows = []
        for size, *ts in zip(SIZES, *times):
            model = [latency_steps(k, n) * latency + bytes_sent(k, size, n) / bandwidth for k in KINDS]
            rows.append([f"{size // 1024} KiB"] + [f"{t * 1e3:.3f}" for t in ts] + [f"{t * 1e3:.3f}" for t in model])
        report.table(f"{n} ranks: ms per call (median of {args.reps}, slowest rank); fit: latency "
                     f"{latency * 1e6:.0f} us per round, {bandwidth / 1e9:.2f} GB/s",
                     rows, ["input"] + [f"{k} measured" for k in KINDS] + [f"{k} fit" for k in KINDS])
    return report


if __name__ == "__main__":
    main()
