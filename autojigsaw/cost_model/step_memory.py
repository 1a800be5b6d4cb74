"""build_memory: the items of one step's memory (cost_model/liveness.py), phase by phase.

Node by node, what each read keeps and moves (saved inputs, the loss's gradient, the buffers of a
redistribution, forward and backward); then storage by storage, what lives and how long (weights and
buffers all step, under FSDP gathered while their unit runs; activations until their last read, or,
saved, until their first saver's backward); then the optimizer step's temporaries.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from functools import lru_cache, partial

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ..ir import Strategy, output_values, tensor_inputs
from ..modules import layer_path, layer_units
from ..placements import Placements, local_shape
from .compute import ATTENTION
from .liveness import LinearItem, MaxItem, Member, MemoryModel, PairItem, ParamMemory
from .memory import Optimizer, Saved, is_view, saved_for_backward

# Tensors of output size a loss outside the graph holds in its backward, beside the gradient it passes on:
# x.square().mean() 3 (mean's gradient, then x.pow(1) and 2 * x.pow(1), which pow's backward holds to the end of
# its expression); .sum() and cross_entropy 2 (MemTracker). The largest, so that the peak is not under-predicted.
_LOSS_COPIES = 3.0


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
                 param_memory: Callable[[Node, Placements], ParamMemory] | None = None,
                 params: dict[str, str] | None = None, batch_slices: int = 1, whole_inputs: bool = False,
                 input_widen: float = 1.0) -> MemoryModel:
    """The items of one step. `persistent`: parameter and buffer placeholders (live always);
    `kernel_saved[i]`: bytes node i saves per strategy by its kernel's cost function (NaN: default);
    `param_memory(placeholder, placements)`: what each of `params` (placeholder -> FQN) keeps in a strategy's
    placements (mixed precision, FSDP);
    None: plain training. `batch_slices`: the graph runs one of that many microbatches, sliced from a
    batch whose inputs are held whole all step (train_step's gradient accumulation). `whole_inputs`: the caller
    passes each input whole and holds it all step, each rank reading its shard as a view (else the graph's
    inputs are the caller's shards); `input_widen`: a floating input's bytes as passed per byte the graph
    reads (mixed precision: fp32 inputs, their shards cast to the compute dtype, a copy).
    """
    step = _StepItems(nodes, strategies, sizes, training=training, grad=grad, persistent=persistent,
                      optimizer=optimizer, kernel_saved=kernel_saved or {},
                      param_memory=param_memory or (lambda placeholder, placements: ParamMemory()), params=params or {},
                      batch_slices=batch_slices, whole_inputs=whole_inputs, input_widen=input_widen)
    for k in range(len(nodes)):  # what each node reads: moved copies, saved inputs, the loss's gradient
        step.add_reads(k)
    for i in range(len(nodes)):  # each storage: a weight or buffer all step, an activation while it is needed
        step.add_storage(i)
    if training and optimizer.temporaries:
        step.add_optimizer_temporaries()
    return step.model


def _storage_roots(nodes: list[Node], index: dict[Node, int]) -> list[int]:
    """Per node, the node whose storage its output is: a view lives in the storage of what it views."""
    root = list(range(len(nodes)))
    for i, node in enumerate(nodes):
        if is_view(node) and node.target is not operator.getitem and tensor_inputs(node):
            root[i] = root[index[tensor_inputs(node)[0][0]]]
    return root


def _gathered_spans(nodes: list[Node], params: dict[str, str]) -> dict[str, tuple[int, int]]:
    """FSDP's units (runtime/fsdp.py): per placeholder of a layer's own weight, the first and last node of
    the stretch its layer runs as (gathered while it runs); the root's weights are gathered for the whole
    forward and the whole backward, and have none."""
    stretch: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.op == "call_function":
            stretch.setdefault(layer_path(node, params), []).append(i)
    return {name: (min(stretch[layer]), max(stretch[layer])) for name, layer in layer_units(nodes, params).items()}


def _returns_loss(nodes: list[Node]) -> bool:
    """Whether the graph returns a scalar (a loss) among its outputs."""
    return any(n.op == "output" and any(output_values(src)[o].ndim == 0 for src, o in tensor_inputs(n))
               for n in nodes)


class _StepItems:
    """build_memory's phases over one graph: the facts every phase reads (storage roots, reads, FSDP's
    spans), and the MemoryModel they fill, in schedule order."""

    def __init__(self, nodes: list[Node], strategies: list[list[Strategy]], sizes: tuple[int, ...], *,
                 training: bool, grad: dict[str, bool], persistent: set[str], optimizer: Optimizer,
                 kernel_saved: dict[int, np.ndarray], param_memory: Callable[[Node, Placements], ParamMemory],
                 params: dict[str, str], batch_slices: int, whole_inputs: bool, input_widen: float):
        self.nodes, self.strategies, self.training, self.grad = nodes, strategies, training, grad
        self.batch_slices, self.whole_inputs, self.input_widen = batch_slices, whole_inputs, input_widen
        self.persistent, self.optimizer, self.kernel_saved = persistent, optimizer, kernel_saved
        self.param_memory, self.params = param_memory, params
        self.model = MemoryModel([n.name for n in nodes], training)
        self.n = len(nodes)
        self.end = self.model.n_points - 1
        self.index = {node: i for i, node in enumerate(nodes)}
        self.vec = _Vectors(sizes)
        self.out_bytes = [self.vec.out_bytes(node, strategies[i]) for i, node in enumerate(nodes)]
        self.root = _storage_roots(nodes, self.index)
        self.numel = [sum(math.prod(v.shape) for v in output_values(node) if v is not None) for node in nodes]
        self.loss_returned = _returns_loss(nodes)
        self._find_reads()
        self.gathered_span = _gathered_spans(nodes, params)
        self.savers: dict[int, list[Member]] = {}  # storage root -> the readers that save it for backward
        self._ways: dict[int, list[tuple[ParamMemory, int]]] = {}  # parameter -> _param_ways

    def fwd(self, i: int) -> int:
        """Node i's forward point."""
        return i

    def bwd(self, i: int) -> int:
        """Node i's backward point (its forward point without training)."""
        return 2 * self.n - 1 - i if self.training else i

    def _find_reads(self) -> None:
        """Per storage root: its last forward read, its first, and the point autograd starts holding its
        gradient (its first contribution, the last reader's backward)."""
        self.last_read = {r: self.fwd(r) for r in range(self.n)}
        self.first_read: dict[int, int] = {}
        self.grad_from: dict[int, int] = {}
        for k, node in enumerate(self.nodes):
            for src, o in tensor_inputs(node):
                r = self.root[self.index[src]]
                self.last_read[r] = max(self.last_read[r], self.fwd(k))
                self.first_read.setdefault(r, self.fwd(k))
                if self.grad.get(src.name, False) and self._backpropagated(node, src, o):
                    self.grad_from[r] = min(self.grad_from.get(r, self.bwd(k)), self.bwd(k))

    def _backpropagated(self, node: Node, src: Node, o: int) -> bool:
        """Does autograd send a gradient through `node`'s read of output o of `src`? The output sends one
        to what it returns, but a model that returns its loss is backpropagated from the loss alone: the
        logits returned beside it get theirs from the loss's nodes that read them."""
        if node.op == "output":
            return not self.loss_returned or output_values(src)[o].ndim == 0
        return self.grad.get(node.name, False)

    # ------------------------------------------------------------ reads

    def add_reads(self, k: int) -> None:
        """The items of node k's reads, then what it saves of its own outputs and besides them."""
        node = self.nodes[k]
        saved = _saved(node, self.training and self.grad.get(node.name, False), self.grad)
        for j, (src, o) in enumerate(tensor_inputs(node)):
            self._add_read(k, saved, j, src, o)
        if saved.outputs:
            self.savers.setdefault(self.root[k], []).append(Member(k, self.model.vector(self.out_bytes[k]), 1.0))
        extra = saved.extra * self.out_bytes[k] if saved.extra else None
        if k in self.kernel_saved:
            hooked = self.kernel_saved[k]
            extra = np.where(np.isnan(hooked), extra if extra is not None else 0.0, hooked)
        if extra is not None and np.any(extra):
            model = self.model
            model.kept_lin[len(model.lin)] = k
            if node.target not in ATTENTION:  # copies the op makes to save (a matmul's contiguous operands)
                model.remade_lin[len(model.lin)] = k  # attention's log-sum-exp is its kernel's own output: cached
            model.lin.append(LinearItem(k, model.vector(extra), self.fwd(k), self.bwd(k), 1.0))

    def _add_read(self, k: int, saved: Saved, j: int, src: Node, o: int) -> None:
        """Node k reading output o of `src` as its input j: the copy it saves, the loss's gradient, and the
        buffers of moving the value into input j's placement."""
        node, model, fwd, bwd = self.nodes[k], self.model, self.fwd, self.bwd
        r = self.root[self.index[src]]
        val = output_values(src)[o]
        in_b = self.vec.in_bytes(val, self.strategies[k], j)
        is_output = node.op == "output"
        keeps = j in saved.inputs or is_output
        if j in saved.converted:  # saved as a copy in the output's dtype, made by the op
            widen = output_values(node)[0].dtype.itemsize / val.dtype.itemsize
            copy = np.where(np.isnan(self.kernel_saved[k]), in_b, 0.0) if k in self.kernel_saved else in_b
            model.kept_lin[len(model.lin)] = model.remade_lin[len(model.lin)] = k
            model.lin.append(LinearItem(k, model.vector(copy), fwd(k), bwd(k), widen))
        if keeps and self.nodes[r].name not in self.persistent:
            # kernels that price themselves say what they save (kernel_saved), instead of this
            kept = np.where(np.isnan(self.kernel_saved[k]), in_b, 0.0) if k in self.kernel_saved else in_b
            self.savers.setdefault(r, []).append(Member(k, model.vector(kept),
                                                        self.numel[r] / max(math.prod(val.shape), 1)))
        if is_output and self.training and (val.ndim == 0 or not self.loss_returned):
            # the loss outside the graph: its backward's copies beside the output's gradient (a model that
            # returns its loss gets gradients from it alone, not from the logits it returns beside it)
            model.lin.append(LinearItem(k, model.vector(in_b), bwd(k), bwd(k), _LOSS_COPIES))
        if is_output or (node.op == "call_function" and is_view(node)):
            return
        self._add_moves(k, keeps, j, src, o, in_b)

    def _add_moves(self, k: int, keeps: bool, j: int, src: Node, o: int, in_b: np.ndarray) -> None:
        """The buffers of moving output o of `src` into node k's input j placement (pair items: nothing
        where the placements agree), forward and, for the gradient, backward."""
        model, vec, fwd, bwd = self.model, self.vec, self.fwd, self.bwd
        i = self.index[src]
        r, val = self.root[i], output_values(src)[o]
        ids = (model.vector(vec.ids(tuple(s.outputs[o] for s in self.strategies[i]))),
               model.vector(vec.ids(tuple(s.inputs[j] for s in self.strategies[k]))))
        none_src = model.vector(_zeros(len(self.strategies[i])))
        moved = partial(PairItem, i, k, *ids)
        # forward: the moved copy and the collective's working copies; the copy lives on while
        # the value is read (a saved copy then lives in the saved item)
        model.pairs.append(moved(model.vector(vec.working(val, self.strategies[i], output=o)), model.vector(in_b),
                                 fwd(k), fwd(k)))
        persists = keeps and self.nodes[r].name not in self.persistent
        if persists:  # a saved activation: its saved item holds the moved copy from the value's last read
            if self.last_read[r] > fwd(k):
                model.pairs.append(moved(none_src, model.vector(in_b), fwd(k) + 1, self.last_read[r]))
        elif keeps:  # a gathered parameter, saved for backward
            model.kept_pairs[len(model.pairs)] = k
            model.pairs.append(moved(none_src, model.vector(in_b), fwd(k) + 1, bwd(k)))
        else:
            model.unsaved_moves.append(moved(none_src, model.vector(in_b), fwd(k) + 1, fwd(k)))
        if self.training and self.grad.get(self.nodes[k].name, False) and self.grad.get(src.name, False):
            # backward: the input's gradient in this placement and the working copies moving it back
            back = in_b + vec.working(val, self.strategies[k], input=j)
            model.pairs.append(moved(none_src, model.vector(back), bwd(k), bwd(k)))

    # ------------------------------------------------------------ storages

    def add_storage(self, i: int) -> None:
        """The items of the storage node i's output is the root of (none for views and the output)."""
        node = self.nodes[i]
        if node.op == "output" or self.root[i] != i:
            return
        v = self.model.vector(self.out_bytes[i])
        if node.name in self.persistent:
            self._add_resident(i, v)
        elif node.op == "placeholder" and self.whole_inputs and output_values(node)[0] is not None:
            self._add_whole_input(i, v)
        else:
            self._add_activation(i, v)
            if node.op == "placeholder" and self.batch_slices > 1:  # the batch's other slices of this input
                self.model.lin.append(LinearItem(i, v, 0, self.end, self.batch_slices - 1.0))

    def _add_whole_input(self, i: int, v: int) -> None:
        """An input the caller passes whole: held by the caller all step (every microbatch's slice of it), this
        rank's shard a view of it; under mixed precision a floating shard is cast, a copy that lives as an
        activation."""
        val = output_values(self.nodes[i])[0]
        cast = self.input_widen != 1.0 and val.dtype.is_floating_point
        whole = np.full(len(self.strategies[i]), float(math.prod(val.shape) * val.dtype.itemsize))
        scale = self.batch_slices * (self.input_widen if cast else 1.0)
        self.model.lin.append(LinearItem(i, self.model.vector(whole), 0, self.end, scale))
        if cast:
            self._add_activation(i, v)
        else:
            self._add_gradient(i, v)

    def _add_resident(self, i: int, v: int) -> None:
        """A parameter or buffer: resident all step (FSDP: gathered while its unit runs); a trained
        parameter's optimizer states and gradient too. A parameter kept differently in different
        strategies (FSDP's, or split over the data axis by the plan) gets each way's items, each
        counting the bytes of its own strategies."""
        for pm, vec in self._param_ways(i, v):
            self._add_kept(i, vec, pm)

    def _param_ways(self, i: int, v: int) -> list[tuple[ParamMemory, int]]:
        """(what node i keeps, the vector of its bytes in the strategies that keep it so) per way it is kept."""
        node = self.nodes[i]
        if node.name not in self.params:
            return [(ParamMemory(), v)]
        if i in self._ways:
            return self._ways[i]
        ways: dict[ParamMemory, list[int]] = {}
        for k, s in enumerate(self.strategies[i]):
            ways.setdefault(self.param_memory(node, s.outputs[0]), []).append(k)
        strategies = np.arange(len(self.strategies[i]))
        self._ways[i] = ([(next(iter(ways)), v)] if len(ways) == 1 else
                         [(pm, self.model.vector(self.out_bytes[i] * np.isin(strategies, ks)))
                          for pm, ks in ways.items()])
        return self._ways[i]

    def _add_kept(self, i: int, v: int, pm: ParamMemory) -> None:
        node, model, fwd, bwd, end = self.nodes[i], self.model, self.fwd, self.bwd, self.end
        model.lin.append(LinearItem(i, v, 0, end, pm.resident))
        first, last = self.gathered_span.get(node.name, (0, self.n - 1))
        if pm.gathered and i in self.first_read:  # FSDP: gathered while its unit runs, forward and backward;
            # at each gather the unit's flat all-gather buffer and the weights copied out of it both live
            model.lin.append(LinearItem(i, v, fwd(first), fwd(last), 1.0))
            model.lin.append(LinearItem(i, v, fwd(first), fwd(first), 1.0))
            if self.training:  # frozen too: a unit gathers all its weights for its backward
                model.lin.append(LinearItem(i, v, bwd(last), bwd(first), 1.0))
                model.lin.append(LinearItem(i, v, bwd(last), bwd(last), 1.0))
        if self.training and self.grad.get(node.name, False):
            model.lin.append(LinearItem(i, v, 0, end, self.optimizer.states * pm.state))
            if i in self.grad_from:
                if pm.gathered:  # the unsharded gradient, until its unit's reduce-scatter copies it in
                    model.lin.append(LinearItem(i, v, self.grad_from[i], bwd(first), 1.0))
                    model.lin.append(LinearItem(i, v, bwd(first), bwd(first), pm.scatter))
                elif pm.accumulated:  # this microbatch's gradient, until it is added into the earlier ones'
                    model.lin.append(LinearItem(i, v, self.grad_from[i], self.grad_from[i], pm.grad))
                if pm.accumulated:  # the earlier microbatches' gradient, made in the first one's backward
                    model.lin.append(LinearItem(i, v, 0, end, pm.grad, carried_from=self.grad_from[i]))
                else:
                    model.lin.append(LinearItem(i, v, self.grad_from[i], end, pm.grad))

    def _add_activation(self, i: int, v: int) -> None:
        """An activation: from its producer to its last reader, then, saved, until its first saver's
        backward (the largest of the savers' copies); its gradient during backward."""
        model, last_read = self.model, self.last_read[i]
        saved_by = self.savers.get(i, [])
        if not saved_by:
            model.unsaved_lin[len(model.lin)] = i
        model.lin.append(LinearItem(i, v, self.fwd(i), last_read, 1.0))
        if saved_by:
            first = min(k for k, _, _ in saved_by)
            if len(saved_by) == 1:
                k, sv, scale = saved_by[0]
                model.kept_lin[len(model.lin)] = i
                model.lin.append(LinearItem(k, sv, last_read + 1, self.bwd(first), scale))
            else:
                model.kept_maxes[len(model.maxes)] = i
                model.maxes.append(MaxItem(tuple(saved_by), last_read + 1, self.bwd(first)))
        self._add_gradient(i, v)

    def _add_gradient(self, i: int, v: int) -> None:
        """A value's gradient during backward, from its first contribution to its producer's backward."""
        if self.training and self.grad.get(self.nodes[i].name, False) and i in self.grad_from:
            self.model.lin.append(LinearItem(i, v, self.grad_from[i], self.bwd(i), 1.0))

    def add_optimizer_temporaries(self) -> None:
        """The optimizer step's temporaries, one parameter at a time: the largest parameter's."""
        members = tuple(Member(i, vec, self.optimizer.temporaries * pm.state)
                        for i, node in enumerate(self.nodes)
                        if node.name in self.persistent and self.grad.get(node.name, False)
                        for pm, vec in self._param_ways(i, self.model.vector(self.out_bytes[i])))
        if members:
            self.model.maxes.append(MaxItem(members, self.end, self.end))


def _saved(node: Node, backward: bool, grad: dict[str, bool]) -> Saved:
    if not backward or node.op != "call_function":
        return Saved()
    return saved_for_backward(node, lambda arg: grad.get(arg.name, False))
