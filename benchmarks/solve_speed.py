"""How fast and how well the planner's MILP solves, tight memory budgets included.

Run: python benchmarks/solve_speed.py [--mip-gap G] [--time-limit S] [--only SUBSTRING]

Cases: a 2-layer Mistral (hidden 64) on domain=2 x tensor=2 under 0.8, 0.7 and 0.6 of its
1-rank plan's memory; the tests' Hugging Face models (tests/hf_models.py) under 0.7 and 0.6 on
tensor=2 and on domain=2 x tensor=2 (float64 on the cpu spec, as tests/side_by_side.py plans
them); T5 with its labels on tensor=2 under 0.7 and 0.6; the Llama-3-8B shape of
benchmarks/plan_speed.py on domain=8 x tensor=8 (h100) with activation_checkpointing="auto"; the
Jigsaw paper's WeatherMixer (benchmarks/families.py) at dim 29408 on domain=2 x tensor=2 and dim
44176 on domain=2 x tensor=4, A100-40GB, bf16 with fp32 masters and recomputation chosen, at the
edge of its 36 GiB budget (the hardest plans the scaling benchmark makes; a minute or two each).
Every call into HiGHS is recorded: the table shows the largest program's variables and
constraints, the number of HiGHS calls and their seconds, the worst status (optimal, gap:
stopped at the time limit with a plan, time limit: no plan), the planner's solve stage in seconds
and what it proved (optimal, or within X % of it: --mip-gap, 0.01 as plan's default, 0 to prove
optimality), and the predicted step time (the objective).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

import autojigsaw  # noqa: E402
import autojigsaw.planner.highs as highs_module  # noqa: E402
from autojigsaw import Options  # noqa: E402
from autojigsaw.api import plan_captured  # noqa: E402
from autojigsaw.capture import capture  # noqa: E402
from autojigsaw.mesh import MeshSpec  # noqa: E402
from autojigsaw.planner import solve  # noqa: E402
from benchmarks.families import WeatherMixerFamily  # noqa: E402
from benchmarks.plan_speed import BATCH, SEQ, llama  # noqa: E402
from benchmarks.scaling import MIXED  # noqa: E402
from tests.hf_models import hf_model  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
TWO, TWO_BY_TWO = {"tensor": 2}, {"domain": 2, "tensor": 2}


def mistral():
    """A 2-layer, 64-wide Mistral with seeded weights and a (2, 16) batch of ids."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, use_cache=False)
    return tf.MistralForCausalLM(cfg), (torch.randint(0, 128, (2, 16)),)


def small(name: str):
    """(model, inputs, keyword inputs) of a small case in float64, in training mode (T5 with its labels)."""
    model, inputs = mistral() if name == "mistral" else hf_model(name)
    model.train()
    kwargs = {"labels": inputs[0]} if name == "t5" else {}
    return model.double(), tuple(x.double() if x.is_floating_point() else x for x in inputs), kwargs


CASES = ([("mistral", TWO_BY_TWO, f) for f in (0.8, 0.7, 0.6)]
         + [(name, mesh, f) for name in ("gpt2", "llama", "bert", "vit") for mesh in (TWO, TWO_BY_TWO)
            for f in (0.7, 0.6)]
         + [("t5", TWO, f) for f in (0.7, 0.6)])


class Recorder:
    """Every HiGHS call the planner makes (LPs and MILPs): size, whether the time limit stopped it, gap, seconds."""

    def __init__(self):
        self.calls: list[tuple[int, int, bool, float, float]] = []
        self._solvers = {(highs_module, "solve_mip"): highs_module.solve_mip,
                         (highs_module.GrowingLp, "solve"): highs_module.GrowingLp.solve}

    def __enter__(self):
        (mip, lp), recorded = self._solvers.values(), self._recorded
        highs_module.solve_mip = functools.partial(recorded, mip)
        highs_module.GrowingLp.solve = lambda this, *args, **kwargs: recorded(functools.partial(lp, this), *args,
                                                                                **kwargs)
        self.calls.clear()
        return self

    def __exit__(self, *exc):
        for (owner, name), solver in self._solvers.items():
            setattr(owner, name, solver)

    def _recorded(self, solver, cost, matrix, *args, **kwargs):
        start = time.perf_counter()
        res = solver(cost, matrix, *args, **kwargs)
        self.calls.append((len(cost), matrix.shape[0], res.timed_out, res.gap if res.x is not None else 0.0,
                           time.perf_counter() - start))
        return res

    def row(self) -> tuple:
        status = "optimal"
        stopped = [g for _, _, timed_out, g, _ in self.calls if timed_out]
        if stopped:
            status = "time limit" if any(g == 0.0 for g in stopped) else f"gap {max(stopped):.2%}"
        return (max(c[0] for c in self.calls), max(c[1] for c in self.calls), len(self.calls),
                f"{sum(c[4] for c in self.calls):.2f}", status)


def one_rank_memory(name: str, solver=None) -> float:
    """Bytes per rank of a small case's plan on one rank: what its budgets are fractions of (proven optimal)."""
    model, inputs, kwargs = small(name)
    return autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu", example_kwargs=kwargs,
                           solver=solver, mip_gap=0).memory_per_rank


def _solved(plan) -> tuple[str, str]:
    """The planner's solve stage: seconds, and what it proved."""
    return f"{plan.stats.solve_s:.1f}", plan.stats.proof()


def run_small(name: str, mesh: dict[str, int], fraction: float, solver, mip_gap: float) -> tuple:
    budget = int(fraction * one_rank_memory(name, solver))
    model, inputs, kwargs = small(name)
    with Recorder() as rec:
        try:
            plan = autojigsaw.plan(model, inputs, mesh, device="cpu", memory_budget=budget, example_kwargs=kwargs,
                                   solver=solver, mip_gap=mip_gap)
            solved, objective = _solved(plan), f"{plan.step_time * 1e6:.3f} us"
        except ValueError as e:
            solved, objective = ("", ""), f"infeasible ({str(e).splitlines()[0][:40]}...)"
    return (f"{name} on {_mesh(mesh)} at {fraction}", *rec.row(), *solved, objective)


def run_llama(solver, mip_gap: float) -> tuple:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    captured = capture(llama(32, hf=False), (ids, ids), {})
    mesh = MeshSpec.of({"domain": 8, "tensor": 8})
    options = Options(device="h100", training=True, memory_budget=None, activation_checkpointing="auto",
                      solver=solver, mip_gap=mip_gap)
    with Recorder() as rec:
        plan = plan_captured(captured, mesh, options)
    recomputed = ", ".join(sorted({p for _, p in plan.recompute})) or "none"
    return ("Llama-3-8B on 8x8, auto", *rec.row(), *_solved(plan),
            f"{plan.step_time * 1e3:.3f} ms (recompute: {recomputed})")


# the scaling benchmark's edge plans (`--families mixer --device a100-40gb --tolerance 0.02`, 4 and 8 GPUs):
# (case, family size, mesh)
MIXERS = [("Jigsaw mixer dim 29408 on 2x2, mixed, auto", 1838, TWO_BY_TWO),
          ("Jigsaw mixer dim 44176 on 2x4, mixed, auto", 2761, {"domain": 2, "tensor": 4})]


def run_mixer(name: str, size: int, mesh: dict[str, int], solver, mip_gap: float) -> tuple:
    family = WeatherMixerFamily()
    model, inputs = family.build(size)
    with Recorder() as rec:
        plan = autojigsaw.plan(model, inputs, mesh, device="a100-40gb", mp_policy=MIXED,
                               activation_checkpointing="auto", solver=solver, mip_gap=mip_gap,
                               input_placements=family.input_placements)
    recomputed = ", ".join(sorted({p for _, p in plan.recompute})) or "none"
    return (name, *rec.row(), *_solved(plan), f"{plan.step_time * 1e3:.3f} ms (recompute: {recomputed})")


def _mesh(mesh: dict[str, int]) -> str:
    return "x".join(str(v) for v in mesh.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per MILP (the planner's: 300)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    parser.add_argument("--mip-gap", type=float, default=Options.mip_gap,
                        help="the proven gap a solve stops at (plan's default: 0.01; 0: proven optimal)")
    args = parser.parse_args()
    solver = functools.partial(solve, time_limit=args.time_limit)
    rows = []
    for name, mesh, fraction in CASES:
        if args.only in f"{name} on {_mesh(mesh)} at {fraction}":
            rows.append(run_small(name, mesh, fraction, solver, args.mip_gap))
            print(*rows[-1], sep=" | ", flush=True)
    if args.only in "Llama-3-8B on 8x8, auto":
        rows.append(run_llama(solver, args.mip_gap))
        print(*rows[-1], sep=" | ", flush=True)
    for name, size, mesh in MIXERS:
        if args.only in name:
            rows.append(run_mixer(name, size, mesh, solver, args.mip_gap))
            print(*rows[-1], sep=" | ", flush=True)
    print(f"\nMILP time limit {args.time_limit:.0f} s per solve, mip_gap {args.mip_gap}")
    print(tabulate(rows, headers=["case", "variables", "constraints", "HiGHS calls", "HiGHS s", "status", "solve s",
                                  "proven", "objective"], tablefmt="github"))


if __name__ == "__main__":
    main()
