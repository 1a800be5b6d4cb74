"""One step's allocations in the order they run, replayed through torch's CUDA caching allocator.

The liveness model (liveness.py) says which tensors are live at each program point; the
allocator (allocator.py) decides where each goes, and so how many bytes it reserves beyond them:
rounding, cached blocks that fit no later request, pools per stream. This module turns the
model's items, at the plan's strategies, into allocations and frees in program order and
replays them, twice (the second step runs on the first one's cache, as training does), with
the parameters and optimizer states allocated once before.

What the replay adds to the items, and how eager and compiled steps differ:

- A cross-entropy's backward holds, beside its input's gradient, one more tensor of that size:
  aten.cross_entropy_loss is log_softmax and nll_loss to autograd, and nll_loss's backward makes a
  dense gradient of the log-probabilities; autojigsaw's cross-entropy kernels compute
  exp(x - lse) before scaling it into the gradient. The replay adds it at the loss's backward
  (outside the compiled layers, where a loss is).
- Compiled, the repeated layers run as compiled regions (torchtitan compiles each block; under FSDP
  autojigsaw compiles each layer's piece): an elementwise op whose readers in the layer are all
  elementwise ops or reductions is fused into them, so neither its output nor its gradient is ever
  allocated, unless a reader saves it for backward. Outside the layers (embedding, head, loss) the
  step is priced as eager: a model compiled whole fuses more, which this over-counts.
- FSDP2 allocates each unit's flat all-gather buffer on its all-gather copy-in stream and the
  sharded gradients on its reduce-scatter stream: their blocks are cached for those streams only.

A storage that the liveness model splits at a program point (an activation, then the copy a reader
saves of it) is one block: an allocation that starts just after another of the same bytes and
stream ended continues it.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.fx import Node

from ..ir import tensor_inputs
from .allocator import Allocator
from .liveness import MemoryModel
from .memory import is_view, saved_for_backward

DEFAULT, ALL_GATHER, REDUCE_SCATTER = "default", "fsdp all-gather", "fsdp reduce-scatter"
_POINTWISE_EXTRA = {torch.ops.aten._to_copy.default}  # casts: pointwise, though not tagged so
_LOSSES = {torch.ops.aten.cross_entropy_loss.default}
_STEPS = 2


@dataclass(frozen=True)
class StepFacts:
    """What the replay needs of the graph: node indices in the planner's order."""

    n: int  # nodes
    params: frozenset[int]  # trained or frozen parameter placeholders
    fused: frozenset[int]  # elementwise nodes a compiled layer keeps in registers (output and gradient)
    losses: tuple[tuple[int, int], ...]  # (cross-entropy, the node whose storage its input is) outside the layers


@dataclass(frozen=True)
class Lifetime:
    """One allocation: bytes live from program point `start` to `end` (freed after it), on `stream`."""

    start: int
    end: int
    nbytes: int
    stream: str = DEFAULT
    carried: bool = False  # allocated in the first microbatch, held through the next (accumulated gradients)


@dataclass(frozen=True)
class Footprint:
    """A step's peak memory as the allocator holds it (torch.cuda.max_memory_reserved) and hands it out
    (max_memory_allocated), and the program point where the reserved peak is first reached. On a device of
    given capacity: `retries`, how often the allocator gave its cache back to make room in the replayed
    steps, and `shortfall`, the most bytes a request lacked even then (0: the steps fit)."""

    reserved: int
    allocated: int
    point: int
    retries: int = 0
    shortfall: int = 0


def step_facts(nodes: list[Node], params: dict[str, str], grad: dict[str, bool],
               layer_nodes: list[tuple[int, ...]], *, training: bool = True) -> StepFacts:
    """The facts of a captured graph (`nodes` in the planner's order; `layer_nodes`: each repeated
    layer's node indices; `grad`: which nodes need a gradient when `training`)."""
    grad = grad if training else {}
    index = {node: i for i, node in enumerate(nodes)}
    layer_of = {i: j for j, members in enumerate(layer_nodes) for i in members}
    losses = tuple((i, _root(node.args[0], index)) for i, node in enumerate(nodes)
                   if node.op == "call_function" and node.target in _LOSSES and i not in layer_of)
    fused = frozenset(i for i, node in enumerate(nodes) if i in layer_of and _pointwise(node)
                      and _fused_into_readers(node, index, layer_of, grad))
    return StepFacts(len(nodes), frozenset(i for i, node in enumerate(nodes) if node.name in params), fused, losses)


def _root(node: Node, index: dict) -> int:
    """The node whose storage `node`'s output is (through views)."""
    while is_view(node) and node.target is not operator.getitem and tensor_inputs(node):
        node = tensor_inputs(node)[0][0]
    return index[node]


def _pointwise(node: Node) -> bool:
    """An elementwise op (ATen's pointwise tag, or a cast), which Inductor fuses into its neighbours."""
    target = node.target
    tags = getattr(target, "tags", ())
    return node.op == "call_function" and (target in _POINTWISE_EXTRA or torch.Tag.pointwise in tags)


def _fusable_reader(node: Node) -> bool:
    """A reader Inductor fuses an elementwise producer into: an elementwise op or a reduction."""
    return _pointwise(node) or torch.Tag.reduction in getattr(node.target, "tags", ())


def _fused_into_readers(node: Node, index: dict, layer_of: dict, grad: dict[str, bool]) -> bool:
    """Is every reader of `node` (through views) an elementwise op or reduction of its layer, and does no
    node (itself included) save it for backward?"""
    def saves(reader: Node, of: set[Node]) -> bool:
        if not grad.get(reader.name, False):
            return False
        saved = saved_for_backward(reader, lambda arg: grad.get(arg.name, False))
        return bool(saved.outputs and reader in of) or any(
            src in of for j, (src, _) in enumerate(tensor_inputs(reader)) if j in saved.inputs)

    aliases, readers, todo = {node}, [], list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and is_view(user) and user.target is not operator.getitem:
            aliases.add(user)
            todo.extend(user.users)
        else:
            readers.append(user)
    layer = layer_of[index[node]]
    return bool(readers) and not saves(node, aliases) and all(
        layer_of.get(index.get(reader, -1)) == layer and _fusable_reader(reader) and not saves(reader, aliases)
        for reader in readers)


def lifetimes(model: MemoryModel, choice: np.ndarray, facts: StepFacts, *, compiled: bool) -> list[Lifetime]:
    """The model's items at `choice` as allocations, in the model's order, with what the replay adds
    (a cross-entropy's backward temporary) and drops (what a compiled layer fuses)."""
    n, out = facts.n, []
    param_spans = defaultdict(list)  # parameter node -> its items' (start, end)
    for item in model.lin:
        if item.node in facts.params:
            param_spans[item.node].append((item.start, item.end))
    loss_inputs = {(root, 2 * n - 1 - loss) for loss, root in facts.losses} if model.training else set()
    for item in model.lin:
        i = item.node
        nbytes = int(model.vectors[item.vec][choice[i]] * item.scale)
        if nbytes <= 0 or (compiled and i in facts.fused and _own_activation(item, n)):
            continue
        if item.carried_from >= 0:
            item = item._replace(start=item.carried_from)
        stream = _stream(item, param_spans[i], model.n_points - 1) if i in facts.params else DEFAULT
        out.append(Lifetime(item.start, item.end, nbytes, stream, item.carried_from >= 0))
        if (i, item.start) in loss_inputs and item.end == 2 * n - 1 - i:  # the gradient of a loss's input
            out.append(Lifetime(item.start, item.start, nbytes))  # and the loss's backward temporary beside it
    for m in model.maxes:
        out.append(Lifetime(m.start, m.end, int(max(model.vectors[v][choice[i]] * s for i, v, s in m.members))))
    for p in model.pairs:
        out.append(Lifetime(p.start, p.end, int(model.pair_bytes(p, choice[p.src], choice[p.dst]))))
    return [t for t in out if t.nbytes > 0]


def _own_activation(item, n: int) -> bool:
    """A node's output in the forward (start at the node, end before the backward) or its gradient."""
    return (item.start == item.node and item.end < n) or (item.start >= n and item.end == 2 * n - 1 - item.node)


def _stream(item, spans: list[tuple[int, int]], last: int) -> str:
    """The stream FSDP2 allocates a parameter's item on. FSDP's parameters are those with one-point
    items (liveness.build_memory): the unit's flat all-gather buffer where the gathered copy starts
    (all-gather copy-in stream), the flat reduce-scatter input elsewhere (the default stream); their
    sharded gradients, from the backward to the step, are the reduce-scatter's output."""
    if item.start == item.end:
        gathered = any(s == item.start and e > s for s, e in spans)
        return ALL_GATHER if gathered else DEFAULT
    if item.end == last and item.start > 0 and any(s == e for s, e in spans):
        return REDUCE_SCATTER
    return DEFAULT


def replay(spans: list[Lifetime], n_points: int, *, expandable_segments: bool, capacity: int | None = None,
           steps: int = _STEPS) -> Footprint:
    """The peaks of `steps` steps of `spans` through the caching allocator (the step's persistent
    items, from its first point to its last, allocated once before), on a device of `capacity` bytes.
    Under gradient accumulation the steps are microbatches: a carried span is allocated in the first
    and freed at the last one's end."""
    alloc = Allocator(expandable_segments=expandable_segments, capacity=capacity)
    last = n_points - 1
    # inference: outputs live past the last point (to the caller)
    spans = [replace(t, end=min(t.end, last)) for t in spans if t.start <= min(t.end, last)]
    persistent = [t for t in spans if t.start == 0 and t.end == last and not t.carried]
    for t in persistent:
        alloc.malloc(t.nbytes, t.stream)
    begins, ends = defaultdict(list), defaultdict(list)
    spans = _chained([t for t in spans if not (t.start == 0 and t.end == last) and not t.carried]) + \
        [t for t in spans if t.carried]
    for k, t in enumerate(spans):
        begins[t.start].append((k, t))
        ends[t.end].append((k, t))
    peak, peak_point = alloc.reserved, 0
    handles = {}
    for step in range(steps):
        for point in range(n_points):
            for k, t in begins[point]:
                if not (t.carried and step > 0):
                    handles[k] = alloc.malloc(t.nbytes, t.stream)
            if alloc.reserved > peak:
                peak, peak_point = alloc.reserved, point
            for k, t in ends[point]:
                if not (t.carried and step < steps - 1):
                    alloc.free(handles.pop(k))
    return Footprint(alloc.peak_reserved, alloc.peak_allocated, peak_point, alloc.retries, alloc.shortfall)


def _chained(spans: list[Lifetime]) -> list[Lifetime]:
    """Each allocation that starts just after one of the same bytes and stream ended, joined to it."""
    out: list[Lifetime] = []
    open_at: dict[tuple, list[int]] = defaultdict(list)  # (stream, bytes, end) -> indices into out
    for t in sorted(spans, key=lambda t: t.start):
        before = open_at.get((t.stream, t.nbytes, t.start - 1))
        if before:
            k = before.pop()
            out[k] = Lifetime(out[k].start, t.end, t.nbytes, t.stream)
        else:
            k = len(out)
            out.append(t)
        open_at[(t.stream, t.nbytes, out[k].end)].append(k)
    return out
