"""Simulated scaling: the largest model that fits per GPU count, planned on abstract meshes.

For each GPU count n (a balanced domain x tensor mesh), search the widest model of a family for
which `autojigsaw.plan` finds a plan within the device's memory budget (the model on the meta
device), trained with Adam in one of two regimes:
  mixed  bf16 compute, fp32 master weights and gradient sums (MixedPrecisionPolicy), recomputation
         chosen by the planner per layer (activation_checkpointing="auto");
  paper  as the Jigsaw paper trained WeatherMixer: fp32, TF32 matmuls ("+tf32" spec), no recomputation.
It reports the predicted step time and the model FLOP utilisation (analytic training FLOPs / (step
x n x the matmul peak); recomputed FLOPs do not count). The width steps from a guess until a plan
fails (or fits), then bisects. Defaults: the mixer on 1-8 A100-40GB, Llama on 1-1,024 H100.

Run: python -m benchmarks.scaling [--gpus 1 2 4 ... 1024] [--families mixer llama] [--device h100]
     python -m benchmarks.scaling --families mixer --regime paper --spatial-fraction 1 --gpus 4
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autojigsaw
from autojigsaw.cost_model.devices import device_spec

from .common import OUT, Report
from .families import LlamaFamily, WeatherMixerFamily

GROWTH = 1.5  # width factor per search step before bisecting
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Regime:
    """How a family trains: the device suffix, the plan options, the matmul dtype for MFU, in words."""

    suffix: str
    options: dict
    dtype: torch.dtype
    described: str


REGIMES = {"mixed": Regime("", dict(mp_policy=MIXED, activation_checkpointing="auto"), torch.bfloat16,
                           "bf16 compute with fp32 masters, recomputation chosen"),
           "paper": Regime("+tf32", dict(activation_checkpointing="none"), torch.float32,
                           "fp32 with TF32 matmuls, no recomputation (the paper's)")}
# The Jigsaw paper's largest WeatherMixers on A100-40GB (its artifact, cases/C4/node_1: the
# configs and the parameter counts their logs print; arXiv 2507.05753: 1.06 B and 2.57 B), and
# what the paper and its talk report beyond.
PAPER = {1: "1.06 B: dim 4320, tokens x 0.5", 2: "1.40 B: dim 8192, tokens x 0.5",
         4: "2.57 B: dim 10352, tokens x 1", 8: "~4 B (talk); 6.4x speed-up",
         256: "9-11 PFLOP/s, 23-28 % of TF32 peak (with data parallelism)"}
PAPER_PARAMS = {1: 1.06, 2: 1.40, 4: 2.57, 8: 4.0}  # billions, for the plot


@dataclass
class Point:
    """The largest model found for one GPU count, with its plan."""

    gpus: int
    mesh: dict
    k: int
    plan: autojigsaw.Plan | None
    params: int
    plans_made: int
    seconds: float
    error: str = ""  # planner failures, each counted as "does not fit"


def mesh_for(n: int) -> dict:
    """A balanced domain x tensor mesh of n ranks (the tensor axis is the larger one)."""
    domain = 2 ** (int(math.log2(n)) // 2)
    return {"domain": domain, "tensor": n // domain}


class Search:
    """Plans of one family on one device, counted and timed."""

    def __init__(self, family, device: str, budget: int | None, options: dict):
        self.family, self.device, self.budget, self.options = family, device, budget, options
        self.plans_made, self.seconds = 0, 0.0

    def plan(self, k: int, mesh: dict) -> autojigsaw.Plan | None:
        """The plan of width step k on `mesh`, or None when no plan fits the memory budget."""
        model, inputs = self.family.build(k)
        start = time.perf_counter()
        try:
            return autojigsaw.plan(model, inputs, mesh, device=self.device, memory_budget=self.budget,
                                   input_placements=self.family.input_placements, **self.options)
        except ValueError as e:
            if str(e).startswith("no plan fits"):  # autojigsaw's infeasibility error
                return None
            raise
        finally:
            self.plans_made += 1
            self.seconds += time.perf_counter() - start

    def largest(self, n: int, guess: int, tolerance: float) -> Point:
        """The widest model that fits on n GPUs: step from `guess` by GROWTH, then bisect."""
        mesh, made, spent = mesh_for(n), self.plans_made, self.seconds
        found, errors = {}, []  # width step -> its plan (None where nothing fits); planner failures

        def fits(k: int) -> bool:
            try:
                found[k] = self.plan(k, mesh)
            except Exception as e:  # noqa: BLE001 - a planner bug: counted as "does not fit", reported
                found[k] = None
                errors.append(f"{self.family.name}, width step {k} on {mesh}: {type(e).__name__}: {e}")
            return found[k] is not None

        lo = self._bracket_and_bisect(fits, guess, tolerance)
        params = sum(p.numel() for p in self.family.build(lo)[0].parameters()) if lo else 0
        return Point(n, mesh, lo, found.get(lo), params, self.plans_made - made, self.seconds - spent,
                     "\n".join(errors))

    @staticmethod
    def _bracket_and_bisect(fits, guess: int, tolerance: float) -> int:
        """Step by GROWTH from `guess` until fits() changes answer, then bisect; the widest fit."""
        lo, hi = 0, None  # the widest known to fit (0: none yet), the narrowest known not to
        if fits(guess):
            lo = guess
            while hi is None:
                k = max(lo + 1, round(lo * GROWTH))
                lo, hi = (k, None) if fits(k) else (lo, k)
        else:
            hi = guess
            while lo == 0 and hi > 1:
                k = min(hi - 1, max(1, round(hi / GROWTH)))
                lo, hi = (k, hi) if fits(k) else (0, k)
        while lo and hi - lo > max(1, tolerance * lo):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def sweep(family, gpus: list[int], device: str, budget: int | None, tolerance: float,
          options: dict) -> list[Point]:
    """The largest model for every GPU count; each search starts where the last one predicts.

    Parameters grow as width squared and memory with the GPU count, so the guess for n GPUs
    is the previous width times sqrt(n / previous n).
    """
    search, points = Search(family, device, budget, options), []
    for n in gpus:
        last = next((p for p in reversed(points) if p.k), None)
        guess = round(last.k * math.sqrt(n / last.gpus)) if last else family.first_guess
        point = search.largest(n, max(guess, 1), tolerance)
        points.append(point)
        print(f"  {family.name}: {n} GPUs -> width step {point.k} ({_count(point.params)} params), "
              f"{point.plans_made} plans in {point.seconds:.1f} s", flush=True)
    return points


def _rows(family, points: list[Point], device: str, with_paper: bool, dtype: torch.dtype) -> list:
    peak = device_spec(device).matmul_peak(dtype)
    rows = []
    for p in points:
        searched = f"{p.plans_made} / {p.seconds:.0f} s" + (" (planner error)" if p.error else "")
        paper = (PAPER.get(p.gpus, ""),) if with_paper else ()
        if p.plan is None:
            rows.append((p.gpus, _mesh(p.mesh), "nothing fits", "", "", "", "", "", searched) + paper)
            continue
        mfu = family.train_flops(p.k) / (p.plan.step_time * p.gpus * peak)
        rows.append((p.gpus, _mesh(p.mesh), family.describe(p.k), _count(p.params),
                     f"{p.plan.memory_per_rank / 2**30:.1f} GiB", _recomputed(p.plan),
                     f"{p.plan.step_time * 1e3:.1f} ms", f"{mfu:.0%}", searched) + paper)
    return rows


def _recomputed(plan: autojigsaw.Plan) -> str:
    """How many layers the plan recomputes, by policy ("none" if it keeps every activation)."""
    policies = [policy for _, policy in plan.recompute]
    return ", ".join(f"{policies.count(p)} {p}" for p in ("selective", "full") if p in policies) or "none"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _mesh(mesh: dict) -> str:
    return " x ".join(str(v) for v in mesh.values())


def _plot(results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in results.items():
        fit = [p for p in points if p.plan is not None]
        ax.plot([p.gpus for p in fit], [p.params / 1e9 for p in fit], marker="o", label=f"{name} (autojigsaw plan)")
    ax.plot(list(PAPER_PARAMS), list(PAPER_PARAMS.values()), marker="s", linestyle="--",
            label="WeatherMixer, Jigsaw paper (8 GPUs: talk)")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="largest model (B params)",
           title="Largest model that fits, one sample per step")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    OUT.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(OUT / "scaling.png", dpi=120)
    print(f"(saved {OUT / 'scaling.png'})")


def _families(args) -> dict:
    mixer = WeatherMixerFamily(spatial_fraction=args.spatial_fraction)
    llama = LlamaFamily(seq=args.seq, depth=args.llama_depth)
    if args.tiny:
        # guesses next to the widest that fit 2 GPUs (32 and 2): the smoke test makes 2 plans per family, not 7 and 3
        mixer = replace(mixer, fields=4, lat=16, lon=64, patch=8, unit=8, depth=1, first_guess=48)
        llama = replace(llama, seq=64, vocab=256, depth=1, first_guess=2)
    return {"mixer": mixer, "llama": llama}


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", help="GPU counts (default: the family's)")
    p.add_argument("--families", nargs="+", default=["mixer", "llama"], choices=["mixer", "llama"])
    p.add_argument("--device", help="device spec name (default: the family's)")
    p.add_argument("--regime", choices=list(REGIMES), default="mixed", help="see above")
    p.add_argument("--spatial-fraction", type=float, default=0.5, help="the mixer's token MLP hidden / tokens")
    p.add_argument("--llama-depth", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096, help="tokens per Llama sample")
    p.add_argument("--tolerance", type=float, default=0.1, help="relative width resolution of the search")
    p.add_argument("--budget-gib", type=float, help="memory budget per GPU (default: 90 %% of the device's)")
    p.add_argument("--tiny", action="store_true",
                   help="one-block models on a tiny sample, a 16 MiB budget (smoke test)")
    args = p.parse_args(argv)
    families = _families(args)
    regime = REGIMES[args.regime]
    budget = 16 * 2**20 if args.tiny else int(args.budget_gib * 2**30) if args.budget_gib else None
    rep = Report("scaling", "Simulated scaling: largest model per GPU count")
    results, errors = {}, []
    for key in args.families:
        family = families[key]
        device, gpus = (args.device or family.device) + regime.suffix, args.gpus or list(family.gpus)
        shown = (budget or 0.9 * device_spec(device).memory_bytes) / 2**30
        print(f"\n{family.name}: searching {gpus} GPUs ({device})", flush=True)
        results[family.name] = points = sweep(family, gpus, device, budget, args.tolerance, regime.options)
        errors += [p.error for p in points if p.error]
        sample = f"{family.sample_bytes() / 1e6:.3g} MB sample" if key == "mixer" else f"{family.seq}-token sample"
        headers = ["GPUs", "mesh d x t", "model", "params", "memory/GPU", "recomputed layers", "predicted step",
                   "MFU", "plans / time"] + (["Jigsaw paper (WeatherMixer)"] if key == "mixer" else [])
        rep.table(f"{family.name} on {device}, {sample}, {regime.described}, batch 1, {shown:.3g} GiB budget per GPU",
                  _rows(family, points, device, key == "mixer", regime.dtype), headers)
    rep.lines += ["Predicted by autojigsaw's cost model (plan.step_time), not measured. MFU = analytic "
                  "training FLOPs / (predicted step x GPUs x matmul peak). Depth is fixed and width grows so "
                  "that 1024-GPU plans stay fast. The weather mixer is the Jigsaw paper's, in its configuration "
                  "(benchmarks/families.py); only its width grows.", ""]
    if errors:
        rep.text("Planner errors (each counted as 'does not fit')", "\n".join(errors))
    _plot(results)
    rep.save()
    if errors:
        raise RuntimeError("the planner failed during the sweep:\n" + "\n".join(errors))
    return rep


if __name__ == "__main__":
    main()
