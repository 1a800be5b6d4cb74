"""Run every benchmark, print its tables, and collect them in benchmarks/out/benchmarks.md.

Run from the repository root:
    python -m benchmarks.run_all            # the full run (minutes: compiles on CPU)
    python -m benchmarks.run_all --quick    # smaller sweeps, no compile
    python -m benchmarks.run_all --tiny     # seconds: what the smoke test runs
A benchmark that fails is reported at the end (exit status 1); the others still run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import traceback

from .common import OUT, machine

# name -> argv per size (None: not run); plan_speed belongs to its own author and has no tiny size.
RUNS = {
    "step_time": {"full": [], "quick": ["--no-compile", "--reps", "5"],
                  "tiny": ["--worlds", "2", "--no-compile", "--d", "32", "--hidden", "64", "--depth", "1",
                           "--batch", "2", "--seq", "8", "--reps", "2", "--warmup", "1"]},
    "plan_speed": {"full": [], "quick": ["--quick"], "tiny": None},
    "scaling": {"full": [], "quick": ["--families", "llama", "--gpus", "1", "4", "16", "64", "256"],
                "tiny": ["--tiny", "--gpus", "2", "--tolerance", "0.5"]},
    "gpu_overhead": {"full": [], "quick": [], "tiny": ["--cpu", "--tiny", "--no-compile"]},
    "published": {"full": [], "quick": ["--only", "torchtitan-8b-fsdp8"],  # tiny: FSDP, data x tensor, selective
                  "tiny": ["--tiny", "--only", "torchtitan-8b-fsdp8", "megatron-7.5b-tp4", "megatron-22b-tp8-selective"]},
    "jigsaw_runs": {"full": [], "quick": [], "tiny": ["--tiny"]},
    "relaxations": {"full": [], "quick": ["--only", "mixer"], "tiny": ["--tiny"]},
    "cnn_domain": {"full": [], "quick": [], "tiny": ["--tiny"]},
    # gloo on local ranks: minutes; the smoke test would not afford them
    "vs_transformers_tp": {"full": [], "quick": ["--reps", "3"], "tiny": None},
    "gloo_links": {"full": [], "quick": ["--worlds", "2", "--reps", "5"], "tiny": None},
    "fsdp_memory": {"full": [], "quick": [], "tiny": None},
    "recompute_memory": {"full": [], "quick": ["--models", "llama", "vit", "convnextv2"], "tiny": None},
}


def _call(name: str, argv: list[str]):
    """benchmarks.<name>.main, given argv if it takes one (sys.argv set alike)."""
    main = importlib.import_module(f"benchmarks.{name}").main
    saved, sys.argv = sys.argv, [f"benchmarks.{name}", *argv]
    try:
        return main(argv) if inspect.signature(main).parameters else main()
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--tiny", action="store_true")
    p.add_argument("--only", nargs="+", choices=list(RUNS), help="run these benchmarks only")
    args = p.parse_args(argv)
    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    failed, reports = [], []
    for name, sizes in RUNS.items():
        if args.only and name not in args.only:
            continue
        if importlib.util.find_spec(f"benchmarks.{name}") is None or sizes[size] is None:
            print(f"\n=== {name}: skipped ({'not written yet' if sizes[size] is not None else f'no {size} size'})")
            continue
        try:
            report = _call(name, sizes[size])
        except BaseException:  # noqa: BLE001 - report it, run the rest
            traceback.print_exc()
            failed.append(name)
            continue
        if getattr(report, "lines", None):
            reports.append("\n".join(report.lines))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "benchmarks.md").write_text(f"# Benchmarks ({size} run, {machine()})\n\n" + "\n\n".join(reports))
    print(f"\n(all tables: {OUT / 'benchmarks.md'})")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
