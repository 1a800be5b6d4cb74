"""Every rank's rewritten graph of many plans, linted: random models, inputs pinned, budgets tight.

Run: python -m benchmarks.rewrite_sweep [--examples 200] [--seed 0]

Planning rewrites a plan for rank 0 only (its traffic); each rank runs its own graph, and with
uneven shards the graphs differ. Here random models of tests/fuzz_models.py are planned on
{"tensor": 2}, {"domain": 2}, {"domain": 2, "tensor": 2} and {"domain": 4}, each input pinned
to a random legal placement (split along a random dim on some axes), under a budget drawn
between 0.3 and 1.0 of the model's one-rank memory; every plan is rewritten for every mesh
coordinate and each graph linted (`Graph.lint`: every value defined before it is used), as
planning does under AUTOJIGSAW_CHECK_RANKS=1 (autojigsaw/rewrite/every_rank.py). It
prints a line per failure and a count of plans, refusals (a ValueError from the planner: no
plan fits, or a pin it cannot keep) and failures by exception type; failures exit 1.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import traceback
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from torch.distributed.tensor import Replicate, Shard

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import autojigsaw  # noqa: E402
from autojigsaw.rewrite.every_rank import CHECK_ENV  # noqa: E402
from tests.fuzz_models import build, model_specs  # noqa: E402

MESHES = ({"tensor": 2}, {"domain": 2}, {"domain": 2, "tensor": 2}, {"domain": 4})


def pinned(inputs: tuple, mesh: dict[str, int], rng: random.Random) -> list:
    """Per input, a random placement per mesh axis: whole, or split along a random dim."""
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.ndim == 0 or rng.random() < 0.3:
            out.append(None)
            continue
        out.append(tuple(Shard(rng.randrange(x.ndim)) if rng.random() < 0.6 else Replicate() for _ in mesh))
    return out


def check(spec, mesh: dict[str, int], rng: random.Random, outcomes: collections.Counter) -> None:
    model, inputs = build(spec)
    whole = autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu").memory_per_rank
    placements = pinned(inputs, mesh, rng)
    try:
        autojigsaw.plan(model, inputs, mesh, device="cpu", input_placements=placements,
                        memory_budget=int(rng.uniform(0.3, 1.0) * whole))  # every rank linted: CHECK_ENV
        outcomes["linted"] += 1
    except ValueError:
        outcomes["refused"] += 1
    except Exception as e:  # noqa: BLE001 -- counted and printed: the sweep's finding
        outcomes[type(e).__name__] += 1
        print(f"FAIL {type(e).__name__} on {mesh}, inputs {placements}: {str(e).splitlines()[0][:200]}\n{spec}\n"
              + "".join(traceback.format_exception(e)[-3:]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, outcomes = random.Random(args.seed), collections.Counter()
    os.environ[CHECK_ENV] = "1"

    @settings(max_examples=args.examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spec=model_specs())
    def sweep(spec):
        for mesh in MESHES:
            check(spec, mesh, rng, outcomes)
        print(dict(outcomes), flush=True)

    sweep()
    print(f"plans rewritten on every rank and linted: {outcomes['linted']}; refused by the planner: "
          f"{outcomes['refused']}; failures: {sum(v for k, v in outcomes.items() if k not in ('linted', 'refused'))} "
          f"{ {k: v for k, v in outcomes.items() if k not in ('linted', 'refused')} }")
    raise SystemExit(1 if set(outcomes) - {"linted", "refused"} else 0)


if __name__ == "__main__":
    main()
