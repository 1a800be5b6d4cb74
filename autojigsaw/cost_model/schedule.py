"""Pipeline schedules priced: PyTorch's own order of work per rank, replayed with each stage's times.

A schedule of `torch.distributed.pipelining` fixes, for every pipe rank, the order in which it runs
the forward (F) and backward (B; or, split for zero-bubble schedules, input gradient I then weight
gradient W) of each microbatch on each of its stages. The order is read off PyTorch's schedule
class itself; `simulate` replays it: an action starts when its rank is free and its inputs exist
(a forward after the previous stage's forward of that microbatch, a backward after the next
stage's), a hop between ranks costing the stage's send time. It returns the step's length, each
rank's busy time (the rest is the bubble) and the activations each rank holds at most: a
microbatch's saved activations live on a stage from its forward until its backward (W, when split).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import schedules as pp

# The names `plan(pipeline_schedule=...)` takes; virtual stages per rank each needs (None: any).
SCHEDULES: dict[str, type] = {
    "gpipe": pp.ScheduleGPipe, "1F1B": pp.Schedule1F1B, "interleaved": pp.ScheduleInterleaved1F1B,
    "zero-bubble": pp.ScheduleZBVZeroBubble, "interleaved-zero-bubble": pp.ScheduleInterleavedZeroBubble,
    "looped-bfs": pp.ScheduleLoopedBFS,
}
SINGLE = {"gpipe", "1F1B"}  # one stage per rank
V_SHAPED = {"zero-bubble"}  # two stages per rank, the second running back down the ranks


def schedule_name(schedule) -> str:
    """The name of a schedule given by name (any case) or as one of PyTorch's schedule classes."""
    if isinstance(schedule, type):
        for name, cls in SCHEDULES.items():
            if schedule is cls:
                return name
        raise ValueError(f"pipeline_schedule={schedule.__name__} is not one autojigsaw prices: give one of "
                         f"{[c.__name__ for c in SCHEDULES.values()]} or a name in {list(SCHEDULES)}")
    by_lower = {name.lower(): name for name in SCHEDULES}
    if not isinstance(schedule, str) or schedule.lower() not in by_lower:
        raise ValueError(f"pipeline_schedule={schedule!r}: give one of {list(SCHEDULES)} (or PyTorch's schedule "
                         "class), or None to let the planner choose")
    return by_lower[schedule.lower()]


def stage_ranks(schedule: str, ranks: int, virtual: int) -> list[int]:
    """The pipe rank of each stage: round robin (stage s on rank s % ranks), or a V for zero-bubble."""
    stages = ranks * virtual
    if schedule in V_SHAPED:
        return [s if s < ranks else stages - 1 - s for s in range(stages)]
    return [s % ranks for s in range(stages)]


@dataclass(frozen=True)
class StageTimes:
    """One stage's seconds per microbatch: forward, backward (both gradients), the weight gradient's
    share of backward, and sending its output to the next stage (its gradient comes back as long)."""

    forward: float
    backward: float
    weight: float = 0.0
    send: float = 0.0


@dataclass(frozen=True)
class Simulated:
    """A schedule replayed: step seconds, each rank's busy seconds, and each rank's peak of activations
    held (bytes, from the stages' saved bytes per microbatch) with the microbatches behind it."""

    step_time: float
    busy: tuple[float, ...]
    activation_peak: tuple[float, ...]
    in_flight: tuple[int, ...]  # per stage: the most microbatches whose activations it holds at once

    @property
    def bubble(self) -> float:
        """The share of the step the busiest rank waits."""
        return 1.0 - max(self.busy) / self.step_time if self.step_time else 0.0


@functools.lru_cache(maxsize=256)
def rank_orders(schedule: str, ranks: int, virtual: int, microbatches: int) -> tuple[tuple[tuple, ...], ...]:
    """Per pipe rank, its compute actions in order: (kind "F" | "B" | "I" | "W", stage, microbatch)."""
    if schedule in SINGLE:
        return tuple(_single_order(schedule, r, ranks, microbatches) for r in range(ranks))
    stages = stage_ranks(schedule, ranks, virtual)
    mine = [_OrderOnly(s, len(stages), ranks, 0) for s, owner in enumerate(stages) if owner == 0]
    order = SCHEDULES[schedule](mine, n_microbatches=microbatches, loss_fn=_no_loss).pipeline_order  # every rank's
    return tuple(tuple((a.computation_type.value, a.stage_index, a.microbatch_index) for a in order[r]
                       if a is not None and a.computation_type.value in ("F", "B", "I", "W")) for r in range(ranks))


def _single_order(schedule: str, rank: int, ranks: int, microbatches: int) -> tuple[tuple, ...]:
    """GPipe: every forward, then every backward; 1F1B: as PyTorch's Schedule1F1B runs it (stage s warms
    up with ranks - s forwards, then alternates a backward and a forward, then drains)."""
    fwd = [("F", rank, mb) for mb in range(microbatches)]
    bwd = [("B", rank, mb) for mb in range(microbatches)]
    if schedule == "gpipe":
        return tuple(fwd + bwd)
    warmup = min(microbatches, ranks - rank)
    order = fwd[:warmup]
    for k in range(microbatches - warmup):
        order += [bwd[k], fwd[warmup + k]]
    return tuple(order + bwd[microbatches - warmup:])


def simulate(schedule: str, ranks: int, virtual: int, microbatches: int, times: Sequence[StageTimes],
             saved: Sequence[float] | None = None) -> Simulated:
    """Replay `schedule` over `ranks` x `virtual` stages (`times`, `saved`: per stage, per microbatch)."""
    orders = rank_orders(schedule, ranks, virtual, microbatches)
    owner = stage_ranks(schedule, ranks, virtual)
    last = len(owner) - 1
    saved = list(saved) if saved is not None else [0.0] * len(owner)
    done: dict[tuple, float] = {}
    free, busy, nxt = [0.0] * ranks, [0.0] * ranks, [0] * ranks
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for r in range(ranks):
            while nxt[r] < len(orders[r]):
                kind, stage, mb = orders[r][nxt[r]]
                ready = _ready(kind, stage, mb, done, owner, times, last)
                if ready is None:
                    break
                seconds = _seconds(kind, times[stage])
                start = max(free[r], ready)
                free[r] = start + seconds
                busy[r] += seconds
                done[(kind, stage, mb)] = free[r]
                nxt[r] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise AssertionError(f"schedule {schedule} deadlocks in replay: ranks wait at {nxt}")
    peaks, in_flight = _held(orders, owner, saved)
    return Simulated(max(free), tuple(busy), tuple(peaks), tuple(in_flight))


@functools.lru_cache(maxsize=256)
def in_flight(schedule: str, ranks: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose activations it holds at once under `schedule` (its order alone)."""
    orders = rank_orders(schedule, ranks, virtual, microbatches)
    return tuple(_held(orders, stage_ranks(schedule, ranks, virtual), [0.0] * ranks * virtual)[1])


def _seconds(kind: str, t: StageTimes) -> float:
    return {"F": t.forward, "B": t.backward, "I": t.backward - t.weight, "W": t.weight}[kind]


def _ready(kind: str, stage: int, mb: int, done: dict, owner: list[int], times: Sequence[StageTimes],
           last: int) -> float | None:
    """When the inputs of an action exist (None: not yet computed), a hop between ranks included."""
    if kind == "F":
        if stage == 0:
            return 0.0
        prev = done.get(("F", stage - 1, mb))
        hop = times[stage - 1].send if owner[stage - 1] != owner[stage] else 0.0
        return None if prev is None else prev + hop
    if kind == "W":
        return done.get(("I", stage, mb))
    own = done.get(("F", stage, mb))
    if own is None or stage == last:
        return own
    after = done.get(("B", stage + 1, mb), done.get(("I", stage + 1, mb)))
    hop = times[stage].send if owner[stage + 1] != owner[stage] else 0.0
    return None if after is None else max(own, after + hop)


def _held(orders, owner: list[int], saved: list[float]) -> tuple[list[float], list[int]]:
    """Per rank, the most activation bytes its stages hold at once; per stage, the most microbatches."""
    peaks, most = [], [0] * len(owner)
    for order in orders:
        live, held, peak = {}, 0.0, 0.0
        split = {st for k, st, _ in order if k == "W"}  # stages whose weight gradients run apart free at W
        freed_by = {st: "W" if st in split else "B" for _, st, _ in order}
        for kind, stage, _ in order:
            if kind == "F":
                live[stage] = live.get(stage, 0) + 1
                held += saved[stage]
                most[stage] = max(most[stage], live[stage])
                peak = max(peak, held)
            elif kind == freed_by[stage]:
                live[stage] -= 1
                held -= saved[stage]
        peaks.append(peak)
    return peaks, most


class _OrderOnly:
    """The attributes a PyTorch schedule reads of its stages to lay out its order: no module, no group."""

    def __init__(self, index: int, stages: int, ranks: int, rank: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, rank
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = torch.nn.Module()


def _no_loss(output, target):
    return output
