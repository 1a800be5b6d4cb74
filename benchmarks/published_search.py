"""What the planner chooses for a pipelined published run when left free: on the run's own mesh (its
per-op sharding, schedule, microbatches and virtual stages chosen), and given only the run's GPU count
(the mesh searched too). Predicted tokens/s per GPU beside the run's own layout's prediction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import autojigsaw
from autojigsaw.cost_model.devices import GiB, device_spec

from .published_runs import PublishedRun

GPUS_PER_NODE = 8  # the A100 nodes of Megatron-LM's runs


@dataclass(frozen=True)
class Choice:
    """One free plan of a run: what it chose, its predicted tokens/s per GPU and memory, its planning time."""

    mesh: str
    pipeline: str
    tokens_per_s_per_gpu: float | None
    memory_gib: float | None
    plan_s: float
    error: str = ""


def pipeline_text(plan) -> str:
    """'1F1B, 64 microbatches, 1 virtual stage' (or 'none')."""
    p = plan.pipeline
    if p is None:
        return f"none, {plan.microbatches} microbatches" if plan.microbatches > 1 else "none"
    return f"{p.schedule}, {p.microbatches} microbatches, {p.virtual_stages} virtual"


def free_choice(run: PublishedRun, model: torch.nn.Module, options: dict, mesh) -> Choice:
    """Plan `model` with the run's precision, recomputation and data parallelism, nothing else imposed, on
    `mesh` (axis -> size, or a GPU count: searched)."""
    free = {k: v for k, v in options.items() if k not in ("pipeline_schedule", "virtual_stages", "microbatches",
                                                            "output_placements")}
    if isinstance(mesh, int):
        free["gpus_per_node"] = GPUS_PER_NODE
    ids = torch.zeros(run.global_batch, run.seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    try:
        plan = autojigsaw.plan(model, (ids,), mesh, device=device_spec(run.device), example_kwargs={"labels": ids},
                               memory_budget=run.memory_budget, **free)
    except ValueError as e:
        return Choice("-", "-", None, None, time.perf_counter() - start, str(e).splitlines()[0][:120])
    return Choice(plan.mesh.describe(), pipeline_text(plan), run.tokens_per_step / plan.step_time / run.gpus,
                  plan.memory_per_rank / GiB, time.perf_counter() - start)


def searched_rows(run: PublishedRun, model: torch.nn.Module, options: dict, own_tps: float | None) -> list[tuple]:
    """Rows of the run's free plan on its own mesh and on its GPU count, each against its own layout."""
    rows = []
    for what, mesh in (("own mesh, free", run.mesh), (f"{run.gpus} GPUs searched", run.gpus)):
        c = free_choice(run, model, options, mesh)
        gain = f"{c.tokens_per_s_per_gpu / own_tps:.2f}x" if c.tokens_per_s_per_gpu and own_tps else "-"
        rows.append((run.name, what, c.mesh, c.pipeline, _f(c.tokens_per_s_per_gpu, ",.0f"), gain,
                     _f(c.memory_gib, ".1f"), f"{c.plan_s:.0f}", c.error))
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


HEADERS = ["run", "planned", "mesh", "pipeline", "tok/s/GPU pred", "vs own layout", "GiB pred", "plan s", "error"]
