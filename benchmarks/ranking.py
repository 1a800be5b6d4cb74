"""The planner's ranking of layouts against their measured step times, on local gloo ranks.

For each model and a "tensor" mesh over all ranks, the free plan (no constraints) and three
layouts imposed through `constraints=` (benchmarks/ranking_layouts.py: transformers' tp_plan,
data parallelism with every weight whole, sequence parallelism with every weight whole) are
planned once, priced with the built-in "cpu" spec (or, with --calibrate, the spec
autojigsaw.calibrate measures on the mesh first), then run by `parallelize(plan=...)` in eager mode:
forward with labels, backward, Adam step, one thread per rank. Every layout's first loss must
match the single-device model's; steps are timed between barriers, round-robin over the layouts
(each round starting at the next layout), and the table shows the median and the interquartile
range over the rounds, and in how many rounds the free plan's step was the faster of the two. The
predicted order (by plan.step_time) is compared with the measured one
(by median): Kendall's tau, and the inversions whose interquartile ranges do not overlap. The free plan
counts as fastest within noise when the layout measured fastest beat it in rounds no more often than
chance would (a one-sided sign test over the paired rounds, p >= 0.05).

Run: python benchmarks/ranking.py [--ranks 2|4] [--steps N] [--only MODEL] [--calibrate]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from scipy.stats import binomtest, kendalltau
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import autojigsaw  # noqa: E402
from autojigsaw.kernels.collectives import count_comm  # noqa: E402
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh  # noqa: E402
from benchmarks import ranking_layouts as layouts  # noqa: E402

TOLERANCE = 1e-4  # relative difference of the first loss from the single-device model's (fp32)


def _quiet() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def calibrate_rank(ranks: int):
    """On every rank: the DeviceSpec autojigsaw.calibrate measures on the tensor mesh."""
    _quiet()
    return autojigsaw.calibrate(get_mesh((ranks,), ("tensor",)))


def plan_all(name: str, ranks: int, device) -> dict:
    """Layout -> (plan as JSON, nodes the layout could not be kept at), planned with no process group."""
    model, args, kwargs = layouts.build(name)
    planned = {}
    for layout in layouts.LAYOUTS:
        constraints, unkept = layouts.constraints(layout, name, model, args, kwargs, ranks)
        t0 = time.perf_counter()
        plan = autojigsaw.plan(model, args, {"tensor": ranks}, example_kwargs=kwargs, device=device,
                               constraints=constraints)
        print(f"  {name} {layout}: predicted {plan.step_time * 1e3:.1f} ms, planned in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        planned[layout] = (plan.to_json(), unkept)
    return planned


class _Run:
    """One layout ready to train: the parallel module and its Adam."""

    def __init__(self, module):
        self.module = module
        self.optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)

    def step(self, args, kwargs) -> float:
        loss = self.module(*args, **kwargs).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def _timed(run: _Run, args, kwargs) -> float:
    dist.barrier()
    start = time.perf_counter()
    run.step(args, kwargs)
    dist.barrier()
    return time.perf_counter() - start


def run_rank(name: str, plans: dict, steps: int, warmup: int) -> dict:
    """On every rank: apply each plan, check its first loss, then time the layouts round-robin."""
    _quiet()
    n = dist.get_world_size()
    mesh = get_mesh((n,), ("tensor",))
    model, args, kwargs = layouts.build(name)
    with torch.no_grad():
        reference = float(model(*args, **kwargs).loss)
    runs, losses = {}, {}
    for layout, (plan_json, _) in plans.items():
        fresh, _, _ = layouts.build(name)
        runs[layout] = _Run(autojigsaw.parallelize(fresh, mesh, args, example_kwargs=kwargs, compile=False,
                                                   plan=autojigsaw.Plan.from_json(plan_json)))
        losses[layout] = runs[layout].step(args, kwargs)
    bad = {k: v for k, v in losses.items() if not abs(v - reference) <= TOLERANCE * abs(reference)}
    if bad:
        raise AssertionError(f"{name}: first losses {bad} differ from the single-device model's {reference}; "
                             "nothing was timed")
    collectives = {}
    for layout, run in runs.items():
        with count_comm() as log:
            _timed(run, args, kwargs)
        collectives[layout] = (len(log.calls), log.total_bytes)
        for _ in range(warmup):
            _timed(run, args, kwargs)
    names = list(runs)
    times = {layout: [] for layout in names}
    load = [os.getloadavg()[0]]
    for r in range(steps):
        for layout in names[r % len(names):] + names[:r % len(names)]:
            times[layout].append(_timed(runs[layout], args, kwargs))
    load.append(os.getloadavg()[0])
    return {"times": times, "load": load, "collectives": collectives}


def _inversions(predicted: dict, medians: dict, quartiles: dict) -> tuple[int, int]:
    """(pairs measured in the other order than predicted, of which with interquartile ranges apart)."""
    pairs = [(a, b) for a in predicted for b in predicted if predicted[a] < predicted[b]]
    flipped = [(a, b) for a, b in pairs if medians[a] > medians[b]]
    apart = [(a, b) for a, b in flipped if quartiles[b][1] < quartiles[a][0]]
    return len(flipped), len(apart)


def rows_of(name: str, plans: dict, result: dict) -> tuple[list, dict]:
    """Table rows (one per layout) and the model's verdict."""
    times = result["times"]
    predicted = {k: autojigsaw.Plan.from_json(p).step_time for k, (p, _) in plans.items()}
    medians = {k: statistics.median(v) for k, v in times.items()}
    quartiles = {k: tuple(statistics.quantiles(v, n=4)[::2]) for k, v in times.items()}
    by_prediction = sorted(predicted, key=predicted.get)
    by_measure = sorted(medians, key=medians.get)
    free_wins = {k: sum(f < t for f, t in zip(times["free"], v)) for k, v in times.items()}
    rows = []
    for layout in layouts.LAYOUTS:
        plan = autojigsaw.Plan.from_json(plans[layout][0])
        q1, q3 = quartiles[layout]
        comm_s = sum(node.comm_s for node in plan.nodes)
        calls, sent = result["collectives"][layout]
        rows.append((name, layout, f"{predicted[layout] * 1e3:.1f}", f"{comm_s * 1e3:.1f}",
                     by_prediction.index(layout) + 1, f"{plan.comm_bytes / 2**20:.2f}", calls,
                     f"{sent / 2**20:.2f}", f"{medians[layout] * 1e3:.1f}",
                     f"{q1 * 1e3:.1f}-{q3 * 1e3:.1f}", by_measure.index(layout) + 1,
                     "" if layout == "free" else f"{free_wins[layout]}/{len(times[layout])}", plans[layout][1]))
    tau = kendalltau([predicted[k] for k in layouts.LAYOUTS], [medians[k] for k in layouts.LAYOUTS]).statistic
    flipped, apart = _inversions(predicted, medians, quartiles)
    fastest = by_measure[0]
    rounds = len(times["free"])
    p_value = binomtest(free_wins[fastest], rounds, 0.5, alternative="less").pvalue if fastest != "free" else 1.0
    free_fastest = "yes" if fastest == "free" else "within noise" if p_value >= 0.05 else \
        f"no: {fastest}, free faster in {free_wins[fastest]}/{rounds} rounds (p={p_value:.0e})"
    verdict = {"model": name, "order": "same" if by_prediction == by_measure else "differs", "tau": f"{tau:.2f}",
               "inversions (IQRs apart)": f"{flipped} ({apart})", "free fastest": free_fastest,
               "load": "-".join(f"{x:.1f}" for x in result["load"])}
    return rows, verdict


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, choices=(2, 4))
    p.add_argument("--steps", type=int, default=15, help="timed rounds (one step of every layout each)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=layouts.MODELS, help="one model (default: all)")
    p.add_argument("--calibrate", action="store_true", help="price with autojigsaw.calibrate(mesh), not 'cpu'")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows, verdicts = [], []
    with LocalRanks(args.ranks, timeout=3600, collective_timeout=900) as pool:
        device = pool.run(calibrate_rank, args.ranks)[0] if args.calibrate else "cpu"
        if args.calibrate:
            print(f"calibrated: {dict(device.flops)} FLOP/s, links {dict(device.axis_links)}", file=sys.stderr)
        for name in [args.only] if args.only else layouts.MODELS:
            plans = plan_all(name, args.ranks, device)
            result = pool.run(run_rank, name, plans, args.steps, args.warmup)[0]
            model_rows, verdict = rows_of(name, plans, result)
            rows += model_rows
            verdicts.append(verdict)
            print(tabulate(model_rows, tablefmt="simple"), file=sys.stderr, flush=True)
    print(f"\n{args.ranks} ranks (tensor={args.ranks}), priced on "
          f"{'autojigsaw.calibrate(mesh)' if args.calibrate else 'cpu'}, {args.steps} rounds, median and IQR:")
    print(tabulate(rows, headers=["model", "layout", "predicted ms", "of which comm", "predicted rank",
                                  "predicted MiB sent", "collectives", "MiB sent", "measured ms", "IQR ms",
                                  "measured rank", "free faster in", "nodes unkept"], tablefmt="github"))
    print()
    print(tabulate(verdicts, headers="keys", tablefmt="github"))


if __name__ == "__main__":
    main()
