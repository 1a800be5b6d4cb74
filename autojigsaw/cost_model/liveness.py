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

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ..ir import Strategy, output_values, tensor_inputs
from ..modules import layer_path, layer_units
from ..placements import local_shape
from .compute import ATTENTION
from .memory import Optimizer, Saved, is_view, saved_for_backward


@dataclass(frozen=True)
class ParamMemory:
    """What a parameter keeps, per byte of the local shard the graph computes with.

    Plain training: the weight, its gradient and the optimizer states, all in the model's dtype
    (every scale 1). Mixed precision adds fp32 masters (the optimizer's) beside the low-precision
    copy, and fp32 gradients and states. FSDP over `d` ranks keeps masters, gradients and
    states sharded (1/d), gathers the compute copy only while its unit runs, and reduce-scatters the
    gradient from a flat copy in the reduce dtype.
    """

    resident: float = 1.0  # bytes kept all step (the weight; or masters + compute copy)
    grad: float = 1.0  # the gradient, from its first contribution to the optimizer step
    state: float = 1.0  # each optimizer state tensor
    gathered: bool = False  # FSDP: the compute copy lives only in its unit's forward and backward
    scatter: float = 0.0  # FSDP: the gradient's copy in the flat reduce-scatter input

    @classmethod
    def of(cls, itemsize: int, *, mixed: bool, fsdp_ranks: int, reduce_itemsize: int | None = None) -> ParamMemory:
        master = 4 / itemsize if mixed else 1.0  # fp32 masters per compute byte
        if fsdp_ranks > 1:
            shard = master / fsdp_ranks
            return cls(shard, shard, shard, True, (reduce_itemsize or itemsize) / itemsize)
        return cls(master + (1.0 if mixed else 0.0), master, master, False)


_LOSS_COPIES = 2.0  # tensors of output size a loss's backward makes besides the gradient (x.square().sum(): 2)


class LinearItem(NamedTuple):
    """`scale` x vectors[vec][strategy of node] bytes, live from point `start` to `end`."""

    node: int
    vec: int
    start: int
    end: int
    scale: float


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
            node, vec, start, end, scale = (np.array(c) for c in zip(*self.lin))
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
        for node, vec, _, _, scale in self.lin:
            own[node] = own[node] + scale * self.vectors[vec]
        return own

    def peak(self, choice: np.ndarray) -> tuple[float, int]:
        """(peak bytes, the point where it happens)."""
        prof = self.profile(choice)
        point = int(np.argmax(prof))
        return float(prof[point]), point


# ---------------------------------------------------------------- building the items


@lru_cache(maxsize=None)
def _bytes_of(shape: tuple[int, ...], itemsize: int, placements: tuple, sizes: tuple[int, ...]) -> np.ndarray:
    coord = (0,) * len(sizes)
    return np.array([math.prod(local_shape(shape, p, sizes, coord)) * itemsize if p is not None else 0
                     for p in placements], dtype=float)


@lru_cache(maxsize=None)
def _working_of(shape: tuple[int, ...], itemsize: int, placements: tuple, sizes: tuple[int, ...]) -> np.ndarray:
    """Working bytes of a collective that moves a value from each placement: a sharded value is
    copied once and gathered once (1 + n shards); a partial one is reduced in its own buffer."""
    local = _bytes_of(shape, itemsize, placements, sizes)
    shards = np.array([math.prod(n for p, n in zip(pl, sizes) if isinstance(p, Shard)) if pl is not None else 1
                       for pl in placements])
    return np.where(shards > 1, local * (1 + shards), 0.0)


@lru_cache(maxsize=None)
def _zeros(n: int) -> np.ndarray:
    return np.zeros(n)


class _Vectors:
    """Bytes of a node's outputs or inputs per strategy, each (shape, placements) pattern once."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sizes
        self._placement_ids: dict = {}
        self._ids: dict[tuple, np.ndarray] = {}

    def ids(self, placements: tuple) -> np.ndarray:
        """Placement ids per strategy: equal ids exactly for equal placements, numbered as this graph
        first shows them. (Numbered per process, they ordered the solver's columns, and so its pick
        among equally good plans, by whatever the process had planned before.)"""
        if placements not in self._ids:
            number = self._placement_ids
            self._ids[placements] = np.array([number.setdefault(self._moving(p), len(number)) for p in placements],
                                             dtype=np.int64)
        return self._ids[placements]

    def _moving(self, placements: tuple | None) -> tuple | None:
        """The placements with those of 1-rank axes as Replicate: nothing moves between them."""
        if placements is None:
            return None
        return tuple(Replicate() if n == 1 else p for p, n in zip(placements, self.sizes))

    def out_bytes(self, node: Node, strategies: list[Strategy]) -> np.ndarray:
        vals = output_values(node)
        total = np.zeros(len(strategies))
        for o, v in enumerate(vals):
            if v is not None:
                total = total + _bytes_of(tuple(v.shape), v.dtype.itemsize,
                                          tuple(s.outputs[o] for s in strategies), self.sizes)
        return total

    def in_bytes(self, val: torch.Tensor, strategies: list[Strategy], j: int) -> np.ndarray:
        """Bytes of `val` as input j of each strategy."""
        placements = tuple(s.inputs[j] for s in strategies)
        return _bytes_of(tuple(val.shape), val.dtype.itemsize, placements, self.sizes)

    def working(self, val: torch.Tensor, strategies: list[Strategy], *, output: int | None = None,
                input: int | None = None) -> np.ndarray:
        """Working bytes of moving `val` away from each strategy's output (or input) placement."""
        placements = tuple(s.outputs[output] if output is not None else s.inputs[input] for s in strategies)
        return _working_of(tuple(val.shape), val.dtype.itemsize, placements, self.sizes)


def build_memory(nodes: list[Node], strategies: list[list[Strategy]], sizes: tuple[int, ...], *,
                 training: bool, grad: dict[str, bool], persistent: set[str], optimizer: Optimizer,
                 kernel_saved: dict[int, np.ndarray] | None = None,
                 param_memory: Callable[[torch.Tensor], ParamMemory] | None = None,
                 params: dict[str, str] | None = None) -> MemoryModel:
    """The items of one step. `persistent`: parameter and buffer placeholders (live always);
    `kernel_saved[i]`: bytes node i saves per strategy by its kernel's cost function (NaN: default);
    `param_memory(value)`: what each of `params` (placeholder -> FQN) keeps (mixed precision, FSDP);
    None: plain training.
    """
    params = params or {}
    param_memory = param_memory or (lambda value: ParamMemory())
    model = MemoryModel([n.name for n in nodes], training)
    n = len(nodes)
    end = model.n_points - 1
    index = {node: i for i, node in enumerate(nodes)}
    vec = _Vectors(sizes)
    out_bytes = [vec.out_bytes(node, strategies[i]) for i, node in enumerate(nodes)]
    kernel_saved = kernel_saved or {}

    def fwd(i: int) -> int:
        return i

    def bwd(i: int) -> int:
        return 2 * n - 1 - i if training else i

    # Storage roots: a view lives in the storage of what it views.
    root = list(range(n))
    for i, node in enumerate(nodes):
        if is_view(node) and node.target is not operator.getitem and tensor_inputs(node):
            root[i] = root[index[tensor_inputs(node)[0][0]]]
    numel = [sum(math.prod(v.shape) for v in output_values(node) if v is not None) for node in nodes]

    last_read = {r: fwd(r) for r in range(n)}
    first_read: dict[int, int] = {}
    grad_from: dict[int, int] = {}  # autograd holds a gradient from its first contribution (the last reader's)
    for k, node in enumerate(nodes):
        for src, _ in tensor_inputs(node):
            r = root[index[src]]
            last_read[r] = max(last_read[r], fwd(k))
            first_read.setdefault(r, fwd(k))
            if grad.get(src.name, False) and (node.op == "output" or grad.get(node.name, False)):
                grad_from[r] = min(grad_from.get(r, bwd(k)), bwd(k))

    # FSDP's units (runtime/fsdp.py): a layer's own weights are gathered while its stretch of nodes runs,
    # the root's (every other weight) for the whole forward and the whole backward
    stretch: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.op == "call_function":
            stretch.setdefault(layer_path(node, params), []).append(i)
    gathered_span = {name: (min(stretch[layer]), max(stretch[layer]))
                     for name, layer in layer_units(nodes, params).items()}

    loss_returned = any(n.op == "output" and any(output_values(src)[o].ndim == 0 for src, o in tensor_inputs(n))
                        for n in nodes)
    savers: dict[int, list[Member]] = {}
    for k, node in enumerate(nodes):
        saved = _saved(node, training and grad.get(node.name, False), grad)
        is_output = node.op == "output"
        for j, (src, o) in enumerate(tensor_inputs(node)):
            i = index[src]
            r = root[i]
            val = output_values(src)[o]
            in_b = vec.in_bytes(val, strategies[k], j)
            keeps = j in saved.inputs or is_output
            if j in saved.converted:  # saved as a copy in the output's dtype, made by the op
                widen = output_values(node)[0].dtype.itemsize / val.dtype.itemsize
                copy = np.where(np.isnan(kernel_saved[k]), in_b, 0.0) if k in kernel_saved else in_b
                model.kept_lin[len(model.lin)] = model.remade_lin[len(model.lin)] = k
                model.lin.append(LinearItem(k, model.vector(copy), fwd(k), bwd(k), widen))
            if keeps and nodes[r].name not in persistent:
                # kernels that price themselves say what they save (kernel_saved), instead of this
                kept = np.where(np.isnan(kernel_saved[k]), in_b, 0.0) if k in kernel_saved else in_b
                savers.setdefault(r, []).append(Member(k, model.vector(kept), numel[r] / max(math.prod(val.shape), 1)))
            if is_output and training and (val.ndim == 0 or not loss_returned):
                # the loss: the output's gradient and a working copy (a model that returns its loss
                # gets gradients from it alone, not from the logits it returns beside it)
                model.lin.append(LinearItem(k, model.vector(in_b), bwd(k), bwd(k), _LOSS_COPIES))
            if is_output or (node.op == "call_function" and is_view(node)):
                continue
            ids = (model.vector(vec.ids(tuple(s.outputs[o] for s in strategies[i]))),
                   model.vector(vec.ids(tuple(s.inputs[j] for s in strategies[k]))))
            none_src = model.vector(_zeros(len(strategies[i])))
            moved = partial(PairItem, i, k, *ids)
            # forward: the moved copy and the collective's working copies; the copy lives on while
            # the value is read (a saved copy then lives in the saved item)
            model.pairs.append(moved(model.vector(vec.working(val, strategies[i], output=o)), model.vector(in_b),
                                     fwd(k), fwd(k)))
            persists = keeps and nodes[r].name not in persistent
            if persists:  # a saved activation: its saved item holds the moved copy from the value's last read
                if last_read[r] > fwd(k):
                    model.pairs.append(moved(none_src, model.vector(in_b), fwd(k) + 1, last_read[r]))
            elif keeps:  # a gathered parameter, saved for backward
                model.kept_pairs[len(model.pairs)] = k
                model.pairs.append(moved(none_src, model.vector(in_b), fwd(k) + 1, bwd(k)))
            else:
                model.unsaved_moves.append(moved(none_src, model.vector(in_b), fwd(k) + 1, fwd(k)))
            if training and grad.get(node.name, False) and grad.get(src.name, False):
                # backward: the input's gradient in this placement and the working copies moving it back
                back = in_b + vec.working(val, strategies[k], input=j)
                model.pairs.append(moved(none_src, model.vector(back), bwd(k), bwd(k)))
        if saved.outputs:
            savers.setdefault(root[k], []).append(Member(k, model.vector(out_bytes[k]), 1.0))
        extra = saved.extra * out_bytes[k] if saved.extra else None
        if k in kernel_saved:
            hooked = kernel_saved[k]
            extra = np.where(np.isnan(hooked), extra if extra is not None else 0.0, hooked)
        if extra is not None and np.any(extra):
            model.kept_lin[len(model.lin)] = k
            if node.target not in ATTENTION:  # copies the op makes to save (a matmul's contiguous operands)
                model.remade_lin[len(model.lin)] = k  # attention's log-sum-exp is its kernel's own output: cached
            model.lin.append(LinearItem(k, model.vector(extra), fwd(k), bwd(k), 1.0))

    for i, node in enumerate(nodes):
        if node.op == "output" or root[i] != i:
            continue
        v = model.vector(out_bytes[i])
        if node.name in persistent:
            pm = param_memory(output_values(node)[0]) if node.name in params else ParamMemory()
            model.lin.append(LinearItem(i, v, 0, end, pm.resident))
            first, last = gathered_span.get(node.name, (0, n - 1))
            if pm.gathered and i in first_read:  # FSDP: gathered while its unit runs, forward and backward;
                # at each gather the unit's flat all-gather buffer and the weights copied out of it both live
                model.lin.append(LinearItem(i, v, fwd(first), fwd(last), 1.0))
                model.lin.append(LinearItem(i, v, fwd(first), fwd(first), 1.0))
                if training:  # frozen too: a unit gathers all its weights for its backward
                    model.lin.append(LinearItem(i, v, bwd(last), bwd(first), 1.0))
                    model.lin.append(LinearItem(i, v, bwd(last), bwd(last), 1.0))
            if training and grad.get(node.name, False):
                model.lin.append(LinearItem(i, v, 0, end, optimizer.states * pm.state))
                if i in grad_from:
                    if pm.gathered:  # the unsharded gradient, until its unit's reduce-scatter copies it in
                        model.lin.append(LinearItem(i, v, grad_from[i], bwd(first), 1.0))
                        model.lin.append(LinearItem(i, v, bwd(first), bwd(first), pm.scatter))
                    model.lin.append(LinearItem(i, v, grad_from[i], end, pm.grad))
            continue
        saved_by = savers.get(i, [])
        if not saved_by:
            model.unsaved_lin[len(model.lin)] = i
        model.lin.append(LinearItem(i, v, fwd(i), last_read[i], 1.0))
        if saved_by:
            first = min(k for k, _, _ in saved_by)
            if len(saved_by) == 1:
                k, sv, scale = saved_by[0]
                model.kept_lin[len(model.lin)] = i
                model.lin.append(LinearItem(k, sv, last_read[i] + 1, bwd(first), scale))
            else:
                model.kept_maxes[len(model.maxes)] = i
                model.maxes.append(MaxItem(tuple(saved_by), last_read[i] + 1, bwd(first)))
        if training and grad.get(node.name, False) and i in grad_from:
            model.lin.append(LinearItem(i, v, grad_from[i], bwd(i), 1.0))
    if training and optimizer.temporaries:
        members = tuple(Member(i, model.vector(out_bytes[i]),
                               optimizer.temporaries * param_memory(output_values(node)[0]).state)
                        for i, node in enumerate(nodes) if node.name in persistent and grad.get(node.name, False))
        if members:  # one parameter at a time: the largest
            model.maxes.append(MaxItem(members, end, end))
    return model


def _saved(node: Node, backward: bool, grad: dict[str, bool]) -> Saved:
    if not backward or node.op != "call_function":
        return Saved()
    return saved_for_backward(node, lambda arg: grad.get(arg.name, False))
