"""Step time, communication and memory per rank: autojigsaw, PyTorch TP, Megatron, one device.

Every implementation trains the same MLPStack (same weights, same input) on the same gloo
mesh of local CPU ranks in one run. Their outputs, and their outputs after one SGD step
(which checks every gradient), must match the single-device model before anything is timed.
Repetitions are interleaved (A B C D A B C D ...) and the tables show medians. Traffic and
memory are measured in eager mode, on one step after warm-up.

Run: python -m benchmarks.step_time [--worlds 2 4] [--no-compile] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import autojigsaw
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh

from . import models, variants
from .common import Report, kib, mib, ratio
from .measure import comm_of, timed_step, peak_memory_of

TOLERANCE = 1e-4  # relative to the largest output of the single-device model (fp32)


def _quiet() -> None:
    """Silence warnings every rank would print on every step."""
    import logging
    import warnings

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message="Full backward hook")


def _full(y):
    return y.full_tensor() if hasattr(y, "full_tensor") else y


def _sgd_step(module, x, lr: float = 0.1) -> None:
    module(x).square().mean().backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
            p.grad = None


def _check(runs: dict, ref, x) -> dict:
    """Max relative difference from the single-device model: outputs, then after an SGD step."""
    scale = ref(x).abs().max().item()
    diffs = {label: (_full(v.module(x)) - ref(x)).abs().max().item() / scale for label, v in runs.items()}
    _sgd_step(ref, x)
    for label, v in runs.items():
        _sgd_step(v.module, x)
        diffs[label] = max(diffs[label], (_full(v.module(x)) - ref(x)).abs().max().item() / scale)
    bad = {k: d for k, d in diffs.items() if not d < TOLERANCE}
    if bad:
        raise AssertionError(f"rank {dist.get_rank()}: outputs differ from the single-device model "
                             f"by {bad} (relative, tolerance {TOLERANCE}); nothing was timed")
    return diffs


def run_rank(cfg: dict) -> dict:
    """On every rank: build, check, time (interleaved), then measure traffic and memory."""
    n = dist.get_world_size()
    mesh = get_mesh((n,), ("tensor",))
    ref = models.build(cfg["d"], cfg["hidden"], cfg["depth"])
    x = models.sample(cfg["batch"], cfg["seq"], cfg["d"])
    calibrated = autojigsaw.calibrate(mesh)
    runs = {(name, compiled): variants.build(name, ref, mesh, x, compile=compiled, memory_budget=cfg["budget"],
                                             calibrated=calibrated)
            for compiled in cfg["modes"] for name in variants.NAMES}
    diffs = _check(runs, models.build(cfg["d"], cfg["hidden"], cfg["depth"]), x)
    for v in runs.values():
        for _ in range(cfg["warmup"]):
            timed_step(v, x)
    times = {label: [] for label in runs}
    for _ in range(cfg["reps"]):
        for label, v in runs.items():
            times[label].append(timed_step(v, x))
    measured = {}
    for (name, compiled), v in runs.items():
        if not compiled:  # dispatch modes see eager execution only
            calls, sent = comm_of(lambda: v.step(x))
            memory = peak_memory_of(lambda: v.step(x), v.module, v.optimizer)
            plan = getattr(v.module, "plan", None)
            measured[name] = {"calls": calls, "bytes": sent, "memory": memory,
                              "plan": plan and (plan.comm_bytes, plan.memory_per_rank, plan.table())}
    return {"times": times, "measured": measured, "diffs": diffs}


def _time_rows(ranks: list[dict]) -> list:
    r0 = ranks[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    rows = []
    for (name, c), t in med.items():
        q1, _, q3 = statistics.quantiles(r0["times"][(name, c)], n=4)
        rows.append((name, "compiled" if c else "eager", f"{t * 1e3:.2f}", f"{(q3 - q1) * 1e3:.2f}",
                     ratio(t, med.get(("single", c), 0)), ratio(t, med.get(("pytorch", c), 0)),
                     f"{max(r['diffs'][(name, c)] for r in ranks):.1e}"))
    return rows


def _comm_memory_rows(ranks: list[dict]) -> list:
    rows = []
    for name, m in ranks[0]["measured"].items():
        per_rank = [r["measured"][name] for r in ranks]
        state = max(sum(p["memory"].get(k, 0) for k in ("Parameter", "Gradient", "Optstate")) for p in per_rank)
        plan = m["plan"]
        rows.append((name, m["calls"], kib(max(p["bytes"] for p in per_rank)),
                     kib(plan[0]) if plan else "", mib(max(p["memory"]["Total"] for p in per_rank)),
                     mib(state), mib(plan[1]) if plan else ""))
    return rows


def report(results: list[list[dict]], worlds: list[int], cfg: dict) -> Report:
    """Tables of step time, traffic and memory, one set per world size."""
    rep = Report("step_time", "Step time, communication and memory per rank (CPU, gloo)")
    budget = f"a memory budget of {mib(cfg['budget'])} MiB" if cfg["budget"] else "its default memory budget"
    rep.lines += [f"Model: MLPStack d={cfg['d']} hidden={cfg['hidden']} depth={cfg['depth']}, input "
                  f"{cfg['batch']}x{cfg['seq']}x{cfg['d']} fp32, AdamW; step = forward + backward + "
                  f"optimizer step; median of {cfg['reps']} interleaved repetitions after "
                  f"{cfg['warmup']} warm-up, one thread per rank; 'single' runs on rank 0 alone; "
                  f"autojigsaw plans by itself with {budget}, priced with the built-in 'cpu' spec, and "
                  f"again with the spec autojigsaw.calibrate(mesh) measured at the start of the run.", ""]
    for n, ranks in zip(worlds, results):
        rep.table(f"{n} ranks: step time", _time_rows(ranks),
                  ["implementation", "mode", "median ms", "IQR ms", "vs single", "vs pytorch", "max rel. diff"],
                  note="max rel. diff: largest difference from the single-device model (outputs, and outputs "
                       "after one SGD step), relative to the largest output, over all ranks.")
        rep.table(f"{n} ranks: communication and memory per rank per training step (eager)",
                  _comm_memory_rows(ranks),
                  ["implementation", "collectives", "KiB sent", "KiB predicted", "peak MiB",
                   "of which params+grads+optim", "MiB predicted"],
                  note="KiB sent: measured, ring-algorithm bytes each rank sends (the most loaded rank); "
                       "peak MiB: largest live tensor bytes on any rank during the step (MemTracker); "
                       "predicted: autojigsaw's plan.")
        for name, m in ranks[0]["measured"].items():
            if m["plan"]:
                rep.text(f"{n} ranks: the plan {name} chose", m["plan"][2])
    return rep


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--budget-mib", type=float, help="autojigsaw's memory budget per rank (default: the device's)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only (compiling takes minutes on CPU)")
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("d", "hidden", "depth", "batch", "seq", "reps", "warmup")}
    cfg["budget"] = int(args.budget_mib * 2**20) if args.budget_mib else None
    cfg["modes"] = [False] if args.no_compile else [False, True]
    results = []
    for n in args.worlds:
        with LocalRanks(n, timeout=3600, collective_timeout=900) as ranks:
            ranks.run(_quiet)
            results.append(ranks.run(run_rank, cfg))
    rep = report(results, args.worlds, cfg)
    rep.save()
    return rep


if __name__ == "__main__":
    main()
