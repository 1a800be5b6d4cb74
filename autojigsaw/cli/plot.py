"""The picture of a plan: memory over the step, stacked by kind, the budget and the peak marked; and where
the step time goes. Drawn with matplotlib (the optional extra autojigsaw[plot])."""

from __future__ import annotations

import numpy as np

import autojigsaw
from autojigsaw.cost_model.devices import GiB
from autojigsaw.cost_model.memory_kinds import KINDS, profile_by_kind
from autojigsaw.plan import format_seconds

INSTALL = "pip install 'autojigsaw[plot]' (or pip install matplotlib)"
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868", "activations": "#c44e52",
          "communication buffers": "#8172b3", "compute": "#4c72b0", "exposed communication": "#dd8452",
          "bubble": "#999999"}


def memory_by_kind(plan: autojigsaw.Plan) -> dict[str, np.ndarray]:
    """Bytes per rank at every program point of the step, per kind (cost_model/memory_kinds.py)."""
    if plan.explainer is None:
        raise ValueError("the plan carries no planner data (it was loaded or edited): plot the plan autojigsaw.plan "
                         "made")
    problem, choice = plan.explainer.problem, plan.explainer.solution.choice
    # parameters, and buffers and constants (torch.export names their placeholders b_ and c_)
    persistent = {n.name for n in plan.nodes if n.kind == "param" or (n.kind == "input" and n.name[:2] in ("b_", "c_"))}
    return profile_by_kind(problem.memory, choice, persistent)


def time_split(plan: autojigsaw.Plan) -> dict[str, float]:
    """Seconds of the predicted step, summing to it: communication not hidden behind compute (resharding, and
    FSDP's traffic where compute does not hide it), the pipeline's bubble, and compute (kernels' own
    collectives included) the rest."""
    bubble = plan.pipeline.bubble * plan.step_time if plan.pipeline is not None else 0.0
    resharding = sum(n.comm_s for n in plan.nodes)
    unattributed = plan.step_time - bubble - resharding - sum(n.compute_s for n in plan.nodes)
    exposed = resharding + max(unattributed, 0.0)
    return {"compute": plan.step_time - bubble - exposed, "exposed communication": exposed, "bubble": bubble}


def draw(plan: autojigsaw.Plan, path: str, title: str = "") -> None:
    """Save the picture of `plan` to `path` (.png, .svg, .pdf: matplotlib's formats)."""
    import matplotlib  # (run_of checked it is installed)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = memory_by_kind(plan)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), height_ratios=(4, 1), layout="constrained")
    _memory(top, plan, kinds)
    _time(bottom, time_split(plan))
    fig.suptitle(title or plan.summary_line().removeprefix("autojigsaw: "), fontsize=9, wrap=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _memory(ax, plan: autojigsaw.Plan, kinds: dict[str, np.ndarray]) -> None:
    points = np.arange(len(next(iter(kinds.values()))))
    total = sum(kinds.values())
    unit, scale = next((u, s) for u, s in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if total.max() >= s or s == 1)
    ax.stackplot(points, *[kinds[k] / scale for k in KINDS], labels=KINDS, colors=[COLORS[k] for k in KINDS],
                 alpha=0.85)
    peak = int(np.argmax(total))
    ax.plot([peak], [total[peak] / scale], "k*", markersize=12)
    reserved = "" if plan.memory_allocated is None else f" live, {plan.memory_per_rank / scale:.2f} reserved"
    ax.annotate(f"peak {total[peak] / scale:.2f} {unit}{reserved}\n{plan.peak_at}", (peak, total[peak] / scale),
                textcoords="offset points", xytext=(8, 8), fontsize=8)
    budget = plan.memory_budget
    top = max(total.max(), budget if budget and budget <= 2 * total.max() else 0) * 1.2 / scale
    if budget and budget / scale <= top:
        ax.axhline(budget / scale, color="red", linestyle="--", linewidth=1, label=f"budget {budget / scale:.1f} {unit}")
    elif budget:
        ax.text(0.99, 0.97, f"budget {budget / GiB:.1f} GiB (above the plot)", transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="red")
    ax.set_ylim(0, top)
    n = len(plan.nodes)
    if plan.training:
        for x, text in ((0, "forward"), (n, "backward"), (2 * n, "optimizer")):
            ax.axvline(x, color="grey", linewidth=0.5)
            ax.text(x, top, f" {text}", va="top", fontsize=8, color="grey")
    ax.set_xlabel("program point (nodes in the order they run)")
    ax.set_ylabel(f"{unit} per rank")
    ax.set_xlim(0, max(points[-1], 1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _time(ax, split: dict[str, float]) -> None:
    left = 0.0
    for part, seconds in split.items():
        ax.barh([0], [seconds * 1e3], left=left, color=COLORS[part],
                label=f"{part} {format_seconds(seconds) if seconds else '0'}")
        left += seconds * 1e3
    ax.set_yticks([])
    ax.set_xlabel("ms of the predicted step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6), ncol=3, fontsize=8, frameon=False)
