"""One planning run of the command line, the verdict on its plan, and the smallest changes that make one fit."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import autojigsaw
from autojigsaw.cost_model.devices import DeviceSpec, GiB, device_spec
from autojigsaw.planner.errors import PlanDoesNotFit

from .models import Workload

HALVINGS = 6  # a smaller batch is searched down to batch / 2**HALVINGS
DOUBLINGS = 3  # a bigger mesh up to 2**DOUBLINGS times an axis (or the GPU count)


@dataclass(frozen=True)
class Run:
    """What is planned: `batch` sequences per data-parallel replica, on `mesh` (axis -> size) or on `gpus`
    (the mesh searched), with `options` (autojigsaw.Options' fields)."""

    batch: int
    mesh: tuple[tuple[str, int], ...] | None
    gpus: int | None
    gpus_per_node: int | None
    options: tuple[tuple[str, object], ...]

    @property
    def world(self) -> int:
        return self.gpus if self.gpus is not None else math.prod(size for _, size in self.mesh)

    @property
    def global_batch(self) -> int:
        """Sequences per step: batch x the data axis (with --gpus, x the GPUs: the same work whatever the mesh)."""
        if self.gpus is not None:
            return self.batch * self.gpus
        return self.batch * math.prod(size for axis, size in self.mesh if axis in ("data", "dp"))

    def describe(self) -> str:
        where = f"{self.gpus} GPUs" if self.gpus is not None else ",".join(f"{a}={n}" for a, n in self.mesh)
        return f"batch {self.batch} per replica on {where}"


def plan(run: Run, workload_of: Callable[[int], Workload]) -> tuple[autojigsaw.Plan, Workload]:
    """The plan of `run` and the workload it planned (a model built for its global batch)."""
    work = workload_of(run.global_batch)
    options = dict(run.options)
    if run.gpus is not None:
        plan_ = autojigsaw.plan(work.model, work.inputs, run.gpus, example_kwargs=work.kwargs,
                                gpus_per_node=run.gpus_per_node, **options)
    else:
        plan_ = autojigsaw.plan(work.model, work.inputs, dict(run.mesh), example_kwargs=work.kwargs, **options)
    return plan_, work


def verdict(plan_: autojigsaw.Plan, work: Workload, run: Run) -> str:
    """"fits: 64.3 of 72.0 GiB per GPU; predicted 8,086 tokens/s per GPU, 47 % MFU"."""
    per = "GPU" if not plan_.device.startswith("cpu") else "rank"
    unit, scale = ("GiB", GiB) if max(plan_.memory_budget or 0, plan_.memory_per_rank) >= GiB else ("MiB", 2**20)
    budget = f" of {plan_.memory_budget / scale:,.1f}" if plan_.memory_budget else ""
    text = f"fits: {plan_.memory_per_rank / scale:,.1f}{budget} {unit} per {per}; predicted "
    if work.tokens is None:
        return text + f"{1 / plan_.step_time:,.2f} steps/s ({plan_.step_time * 1e3:,.1f} ms per step)"
    tokens = work.tokens / plan_.step_time / plan_.mesh.world_size
    text += f"{tokens:,.0f} tokens/s per {per}"
    options = dict(run.options)
    mfu = model_flops_utilization(tokens, work, device_spec(options.get("device") or "h100"), options.get("mp_policy"))
    return text + (f", {100 * mfu:.0f} % MFU" if mfu is not None else "")


def model_flops_utilization(tokens_per_s: float, work: Workload, device: DeviceSpec, mp_policy) -> float | None:
    """tokens/s x (6 N + 12 L d s) / peak (PaLM, arXiv 2204.02311, appendix B): N the parameters in matmuls
    (the input embedding left out unless tied), L layers, d width, s tokens per sequence."""
    config = work.config
    layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not (layers and width and len(work.inputs) and work.inputs[0].ndim == 2):
        return None
    model = work.model
    n = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embed is not None and (head is None or head.weight is not embed):
        n -= embed.numel()
    flops = 6 * n + 12 * layers * width * work.inputs[0].shape[1]
    dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype else next(model.parameters()).dtype
    return tokens_per_s * flops / device.peak_flops(dtype)


@dataclass(frozen=True)
class Change:
    """A change to the run that fits, with its plan's verdict."""

    flag: str  # the command line's words for it: "--recompute auto"
    run: Run
    plan: autojigsaw.Plan
    verdict: str
    tokens_per_s: float


def changes_that_fit(run: Run, workload_of: Callable[[int], Workload], say: Callable[[str], None]) -> list[Change]:
    """The smallest change of each kind that fits, found by planning: recomputation, a smaller batch, a bigger
    mesh (each axis doubled, or the GPU count); fastest first."""
    found = []
    options = dict(run.options)
    if options.get("activation_checkpointing", "none") not in ("auto", "full"):
        found += _first_fit([("--recompute auto", replace(run, options=_with(run, activation_checkpointing="auto")))],
                            workload_of, say)
    found += _first_fit([(f"--batch {run.batch >> k}", replace(run, batch=run.batch >> k))
                         for k in range(1, HALVINGS + 1) if run.batch >> k >= 1], workload_of, say)
    if run.gpus is not None:
        found += _first_fit([(f"--gpus {run.gpus << k}", replace(run, gpus=run.gpus << k))
                             for k in range(1, DOUBLINGS + 1)], workload_of, say)
    else:
        for a, (axis, size) in enumerate(run.mesh):
            meshes = [run.mesh[:a] + ((axis, size << k),) + run.mesh[a + 1:] for k in range(1, DOUBLINGS + 1)]
            found += _first_fit([("--mesh " + ",".join(f"{x}={n}" for x, n in mesh), replace(run, mesh=mesh))
                                 for mesh in meshes], workload_of, say)
    return sorted(found, key=lambda c: -c.tokens_per_s)


def _with(run: Run, **changes) -> tuple:
    return tuple({**dict(run.options), **changes}.items())


def _first_fit(tries: list[tuple[str, Run]], workload_of, say) -> list[Change]:
    """The first of `tries` (smallest change first) whose plan fits, as a one-item list; [] if none does."""
    for flag, candidate in tries:
        say(f"trying {flag} ...")
        try:
            plan_, work = plan(candidate, workload_of)
        except PlanDoesNotFit:
            continue
        except ValueError as e:  # a change the run cannot take (a batch the data axis cannot split)
            say(f"  {flag}: {str(e).splitlines()[0][:160]}")
            continue
        tokens = (work.tokens or 0) / plan_.step_time / plan_.mesh.world_size
        return [Change(flag, candidate, plan_, verdict(plan_, work, candidate), tokens or 1 / plan_.step_time)]
    return []


