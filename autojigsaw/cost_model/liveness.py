"""Peak memory per rank over one step's schedule: what is live at every program point.

The schedule runs the forward nodes in graph order, then (training) their backward in reverse,
then the optimizer step: point i is node i's forward, 2N-1-i its backward, 2N the step. Every
tensor is an item live over an interval of points, whose bytes depend on the strategy of one node
(linear items), the largest of several (max items: one storage saved by several readers), or a
producer/consumer pair (pair items: a buffer that exists only when a redistribution moves the
value). The peak is the max over points, not a sum.

Items: parameters and optimizer state (whole step); parameter gradients (first backward use to
the step); activations from their producer to their last reader (views extend what they alias),
then until the backward of a reader that saves them; extra saved tensors (statistics, masks);
activation gradients, from their first contribution; collective buffers (a moved copy of an input
and the collective's working copies, kernels/collectives.py), forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class ParamMemory:
    """What a parameter keeps, per byte of the local shard the graph computes with.

    Plain training: the weight, its gradient and the optimizer states, all in the model's dtype
    (every scale 1). Mixed precision adds fp32 masters (the optimizer's) beside the low-precision
    copy, and fp32 gradients and states. FSDP over `d` ranks keeps masters, gradients and
    states sharded (1/d), gathers the compute copy only while its unit runs, and reduce-scatters the
    gradient from a flat copy in the reduce dtype; `kept_gathered` (a pipeline stage's), the compute
    copy and the unsharded gradient all step. `accumulated`: the step runs several microbatches, so the
    gradient the earlier ones left lives from the step's start.
    """

    resident: float = 1.0  # bytes kept all step (the weight; or masters + compute copy)
    grad: float = 1.0  # the gradient, from its first contribution to the optimizer step
    state: float = 1.0  # each optimizer state tensor
    gathered: bool = False  # FSDP: the compute copy lives only in its unit's forward and backward
    scatter: float = 0.0  # FSDP: the gradient's copy in the flat reduce-scatter input
    accumulated: bool = False  # the gradient lives all step (else from its first contribution)

    @classmethod
    def of(cls, itemsize: int, *, mixed: bool, fsdp_ranks: int, reduce_itemsize: int | None = None,
           kept_gathered: bool = False, accumulated: bool = False) -> ParamMemory:
        master = 4 / itemsize if mixed else 1.0  # fp32 masters per compute byte
        if fsdp_ranks > 1 and kept_gathered:  # the compute copy and the unsharded gradient held all step
            shard = master / fsdp_ranks
            return cls(shard + 1.0, shard + (reduce_itemsize or itemsize) / itemsize, shard, False, 0.0, accumulated)
        if fsdp_ranks > 1:
            shard = master / fsdp_ranks
            return cls(shard, shard, shard, True, (reduce_itemsize or itemsize) / itemsize, accumulated)
        return cls(master + (1.0 if mixed else 0.0), master, master, False, 0.0, accumulated)


class LinearItem(NamedTuple):
    """`scale` x vectors[vec][strategy of node] bytes, live from point `start` to `end`; `carried_from` >= 0:
    a gradient accumulated over microbatches, allocated at that point of the first one and held since."""

    node: int
    vec: int
    start: int
    end: int
    scale: float
    carried_from: int = -1


class Member(NamedTuple):
    """One reader's copy in a MaxItem: `scale` x vectors[vec][strategy of node] bytes."""

    node: int
    vec: int
    scale: float


@dataclass(frozen=True)
class MaxItem:
    """Bytes of one storage saved by several readers: the largest of their views of it."""

    members: tuple[Member, ...]
    start: int
    end: int


@dataclass(frozen=True)
class PairItem:
    """Buffers that exist when the consumer reads a value in another placement than made:
    src_bytes[producer strategy] + dst_bytes[consumer strategy], nothing where they agree."""

    src: int  # producer node
    dst: int  # consumer node
    src_ids: int  # vector id: placement id of the value per producer strategy
    dst_ids: int  # vector id: placement id of the input per consumer strategy
    src_bytes: int  # vector id: bytes per producer strategy
    dst_bytes: int  # vector id: bytes per consumer strategy
    start: int
    end: int


@dataclass
class MemoryModel:
    """Every tensor of one step as an interval of program points; `profile` sums them."""

    names: list[str]
    training: bool
    vectors: list[np.ndarray] = field(default_factory=list)
    lin: list[LinearItem] = field(default_factory=list)
    maxes: list[MaxItem] = field(default_factory=list)
    pairs: list[PairItem] = field(default_factory=list)
    # Items that keep an activation from forward to backward, by the node whose storage it is
    # (what recomputation can free): index into lin / maxes / pairs -> node.
    kept_lin: dict[int, int] = field(default_factory=dict)
    kept_maxes: dict[int, int] = field(default_factory=dict)
    kept_pairs: dict[int, int] = field(default_factory=dict)
    # Activations no reader saves, from their producer to their last reader: index into lin -> node
    # (what a selective policy's cache holds until the layer's backward).
    unsaved_lin: dict[int, int] = field(default_factory=dict)
    # Copies an op makes and saves (a boolean mask made float, a matmul's contiguous copy of a transposed
    # operand), by the node: index into lin -> node (what a selective policy recomputes even where it
    # keeps the node's outputs).
    remade_lin: dict[int, int] = field(default_factory=dict)
    # Each moved copy its consumer does not save, over no point yet (from just after the consumer):
    # what a selective policy's cache holds, as the output of a collective, until the layer's backward.
    unsaved_moves: list[PairItem] = field(default_factory=list)
    _ids: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def n_points(self) -> int:
        n = len(self.names)
        return 2 * n + 1 if self.training else n

    def vector(self, v: np.ndarray) -> int:
        """The id of a vector (vectors shared by tied nodes are stored once)."""
        key = id(v)
        if key not in self._ids:
            self._ids[key] = len(self.vectors)
            self.vectors.append(v)
        return self._ids[key]

    def describe(self, point: int) -> str:
        n = len(self.names)
        if point < n:
            return f"forward of {self.names[point]}"
        if point < 2 * n:
            return f"backward of {self.names[2 * n - 1 - point]}"
        return "optimizer step"

    def profile(self, choice: np.ndarray) -> np.ndarray:
        """Bytes live at every program point for one strategy index per node."""
        diff = np.zeros(self.n_points + 1)
        if self.lin:
            node, vec, start, end, scale, _ = (np.array(c) for c in zip(*self.lin))
            bytes_ = np.array([self.vectors[v][choice[i]] for v, i in zip(vec, node)]) * scale
            np.add.at(diff, start, bytes_)
            np.add.at(diff, end + 1, -bytes_)
        for m in self.maxes:
            b = max(self.vectors[v][choice[i]] * s for i, v, s in m.members)
            diff[m.start] += b
            diff[m.end + 1] -= b
        for p in self.pairs:
            b = self.pair_bytes(p, choice[p.src], choice[p.dst])
            diff[p.start] += b
            diff[p.end + 1] -= b
        return np.cumsum(diff)[:-1]

    def pair_bytes(self, p: PairItem, s: int, t: int) -> float:
        if self.vectors[p.src_ids][s] == self.vectors[p.dst_ids][t]:
            return 0.0
        return float(self.vectors[p.src_bytes][s] + self.vectors[p.dst_bytes][t])

    def peak_candidates(self) -> np.ndarray:
        """The points whose live items no other point's include: every plan's peak is at one of them
        (items are never negative), the last point before an item ends with one begun since."""
        last = self.n_points - 1  # (without training, outputs live past the last point)
        begins, ends = np.zeros(self.n_points, dtype=bool), np.zeros(self.n_points, dtype=bool)
        for items in (self.lin, self.maxes, self.pairs):
            for item in items:
                begins[min(item.start, last)] = ends[min(item.end, last)] = True
        candidates, begun = [], False
        for point in range(self.n_points):
            begun |= begins[point]
            if ends[point] and begun:
                candidates.append(point)
                begun = False
        return np.array(candidates, dtype=np.int64)

    def own_bytes(self, n_strategies: list[int]) -> list[np.ndarray]:
        """Per node and strategy: the bytes of the node's own (linear) items, each counted once."""
        own = [np.zeros(k) for k in n_strategies]
        for node, vec, _, _, scale, _ in self.lin:
            own[node] = own[node] + scale * self.vectors[vec]
        return own

    def peak(self, choice: np.ndarray) -> tuple[float, int]:
        """(peak bytes, the point where it happens)."""
        prof = self.profile(choice)
        point = int(np.argmax(prof))
        return float(prof[point]), point
