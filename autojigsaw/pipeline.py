"""A plan's pipeline: the stages over its pipe axis, each with its own plan on the other axes, and the schedule.

Plain data, as plan.py's: a `Pipeline` holds PyTorch's schedule name, the microbatches per data replica
and step, the virtual stages per rank and a `StagePlan` per stage (its layers, the pipe rank that runs
it, its Plan and its per-microbatch seconds and bytes); `Plan.pipeline` is one, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

STAGE_FIELDS = ("index", "rank", "layers", "forward_s", "backward_s", "weight_s", "send_bytes", "in_flight")


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the layers it runs, the pipe rank that runs it, and its plan on the other axes.

    `plan` shards the stage's program over the mesh without the pipe axis and is priced per
    microbatch; `forward_s`, `backward_s` (both gradients) and `weight_s` (the weight gradient's share,
    which zero-bubble schedules run apart) are seconds per microbatch; `send_bytes` what it sends the
    next stage per microbatch (its gradient comes back as large); `in_flight` the most microbatches
    whose activations it holds at once under the schedule.
    """

    index: int
    rank: int
    layers: tuple[str, ...]
    plan: Plan
    forward_s: float
    backward_s: float
    weight_s: float = 0.0
    send_bytes: int = 0
    in_flight: int = 1


@dataclass(frozen=True)
class Pipeline:
    """How a plan runs over its pipe axis: PyTorch's schedule, microbatches per data replica and step,
    virtual stages per rank, the stages in order, and the share of the step the busiest rank waits."""

    axis: str
    schedule: str
    microbatches: int
    virtual_stages: int
    stages: tuple[StagePlan, ...]
    bubble: float = 0.0
    fsdp_gathers: str = ""  # "once per step" under FSDP (PyTorch's schedules keep a stage's weights gathered)

    @property
    def ranks(self) -> int:
        return len(self.stages) // self.virtual_stages

    def stages_of(self, rank: int) -> tuple[StagePlan, ...]:
        """The stages pipe rank `rank` runs, in stage order."""
        return tuple(s for s in self.stages if s.rank == rank)
