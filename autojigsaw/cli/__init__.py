"""`autojigsaw plan` (also `python -m autojigsaw plan`): will a model fit, and how fast will it run, before any
GPU is rented. Plans on the meta device; prints the plan's table and a verdict, exits 0 when it fits and 1
when it does not, naming the smallest changes that do (found by planning).

    autojigsaw plan --hf llama --layers 32 --hidden 4096 --ffn 14336 --heads 32 --kv-heads 8 --vocab 128256 \\
        --batch 2 --seq 8192 --mesh data=8 --device h100 --mp bf16 --recompute selective --budget 92GB
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import autojigsaw
from autojigsaw.planner.errors import PlanDoesNotFit

from . import models
from .args import parser, run_of
from .runs import changes_that_fit, plan, verdict

log = logging.getLogger("autojigsaw")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0: it fits, 1: it does not, 2: a usage error)."""
    args = parser().parse_args(argv)
    with _progress_shown():
        try:
            run = run_of(args)
            return _plan(args, run)
        except (ValueError, ImportError) as e:
            print(f"autojigsaw plan: error: {e}", file=sys.stderr)
            return 2


def _plan(args: argparse.Namespace, run) -> int:
    workload_of = lambda global_batch: models.from_args(args, global_batch)  # noqa: E731
    try:
        planned, work = plan(run, workload_of)
    except PlanDoesNotFit as e:
        return _does_not_fit(e, run, workload_of)
    print(planned.table(wide=args.wide))
    print()
    if planned.alternatives:  # --gpus: the meshes the chosen one beat
        print(planned.alternatives_table())
        print()
    print(verdict(planned, work, run))
    _save(planned, args)
    return 0


def _does_not_fit(error: PlanDoesNotFit, run, workload_of) -> int:
    """Exit status 1, after the reason and the smallest change of each kind that fits."""
    print(f"does not fit: {run.describe()}: {error}")
    changes = changes_that_fit(run, workload_of, lambda text: print(text, file=sys.stderr, flush=True))
    if not changes:
        print("no change tried fits: recomputation, a batch down to 1/64, each mesh axis up to 8x")
        return 1
    print("fits with (fastest first):")
    for change in changes:
        print(f"  {change.flag}: {change.verdict}")
    print(f"smallest change: {changes[0].flag}")
    return 1


def _save(planned: autojigsaw.Plan, args: argparse.Namespace) -> None:
    if args.json:
        Path(args.json).write_text(planned.to_json())
        print(f"plan written to {args.json} (autojigsaw.Plan.from_json; parallelize(..., plan=...))")
    if args.plot:
        from .plot import draw

        draw(planned, args.plot)
        print(f"picture written to {args.plot}")


@contextlib.contextmanager
def _progress_shown() -> Iterator[None]:
    """autojigsaw's log lines (a long solve's progress among them) on stderr while the command runs."""
    if log.handlers:  # the caller (a program calling main) already shows them
        yield
        return
    handler, level = logging.StreamHandler(sys.stderr), log.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler), log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler), log.setLevel(level)


__all__ = ["main"]
