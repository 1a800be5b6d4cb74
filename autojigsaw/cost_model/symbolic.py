"""The cost formulas of one node or edge in the model's sizes, for Plan.explain.

The model's sizes become sympy symbols (batch, seq, hidden: named from the inputs and the
parameters), each mesh axis a symbol of its name, and a local dim is the global one over
the axes that shard it (torch.chunk rounds up: the numbers the planner used are exact, the
printed dims are the even-split formula). The expressions are the ones compute.py and
comm.py compile, with these dims put in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import sympy
import torch
from torch.distributed.tensor import Shard
from torch.fx import Node

from ..ir import Strategy, output_values, tensor_inputs
from ..mesh import MeshSpec
from ..placements import Placements
from .comm import RING, TREE_ALL_REDUCE
from .compute import kind_name, op_kind, roofline_time
from .devices import DeviceSpec
from .einsum import einsum_flops, spelled_letters

aten = torch.ops.aten


@dataclass(frozen=True)
class Sizes:
    """Names for the model's sizes (value -> name) and the mesh axes, as sympy symbols."""

    names: tuple[tuple[int, str], ...]
    mesh: MeshSpec

    def dim(self, size: int) -> sympy.Expr:
        name = dict(self.names).get(size)
        return sympy.Symbol(name, positive=True) if name else sympy.Integer(size)

    def axis(self, a: int) -> sympy.Symbol:
        return sympy.Symbol(self.mesh.axis_names[a], positive=True)

    @property
    def symbol_names(self) -> set[str]:
        return {n for _, n in self.names} | set(self.mesh.axis_names)

    def legend(self) -> str:
        return ", ".join(f"{n}={v}" for v, n in self.names) + ", " + self.mesh.describe()


def name_sizes(inputs: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], mesh: MeshSpec) -> Sizes:
    """batch/seq/... from the first tensor input's dims, hidden from the commonest parameter dim."""
    names: dict[int, str] = {}
    first = next((v for v in inputs if isinstance(v, torch.Tensor) and v.ndim), None)
    if first is not None:
        if first.ndim == 4:
            labels = ("batch", "channels", "height", "width")
        elif first.is_floating_point():
            labels = ("batch", "seq", "hidden")[:first.ndim - 1] + ("hidden",)
        else:
            labels = ("batch", "seq", "pos")
        for size, label in zip(first.shape, labels):
            if size > 1 and size not in names and label not in names.values():
                names[int(size)] = label
    common = Counter(int(d) for p in params for d in p.shape if d > 1)
    if common and "hidden" not in names.values():
        size = common.most_common(1)[0][0]
        names.setdefault(size, "hidden")
    return Sizes(tuple(sorted(names.items(), key=lambda kv: kv[1])), mesh)


def local_dims(shape: Sequence[int], placements: Placements | None, sizes: Sizes) -> list[sympy.Expr]:
    """Each dim of a local shard: the global size over the mesh axes sharding it."""
    dims = [sizes.dim(int(d)) for d in shape]
    for a, p in enumerate(placements or ()):
        if isinstance(p, Shard) and sizes.mesh.sizes[a] > 1:
            dims[p.dim] = dims[p.dim] / sizes.axis(a)
    return dims


@dataclass(frozen=True)
class NodeFormula:
    """The compute cost of one node under one strategy, symbolically and the scaling."""

    kind: str
    flops: sympy.Expr
    bytes: sympy.Expr
    time: sympy.Expr  # with the device's numbers put in
    backward: float  # 0 when no backward pass


def node_formula(node: Node, strategy: Strategy, sizes: Sizes, device: DeviceSpec, backward: bool) -> NodeFormula:
    """FLOPs, bytes moved and roofline time of `node` under `strategy`, in the model's sizes."""
    ins, nbytes = [], sympy.Integer(0)
    for (src, o), pl in zip(tensor_inputs(node), strategy.inputs):
        val = output_values(src)[o]
        dims = local_dims(val.shape, pl, sizes)
        ins.append(dims)
        nbytes += math.prod(dims) * val.dtype.itemsize
    outs = []
    for val, pl in zip(output_values(node), strategy.outputs):
        if val is not None:
            dims = local_dims(val.shape, pl, sizes)
            outs.append(dims)
            nbytes += math.prod(dims) * val.dtype.itemsize
    letters = spelled_letters(node.args[0], [len(d) for d in ins]) if node.target == aten.einsum.default else None
    if letters:  # priced as the matmul it is (its rule's cost)
        kind = op_kind(aten.mm.default)
        flops, name = sympy.simplify(einsum_flops(*letters, [*ins, *outs])), kind.name
    else:
        kind = op_kind(node.target)
        flops = sympy.simplify(kind.flops.expr.subs(dict(zip(kind.flops.args, kind.dims(ins, outs)))))
        name = kind_name(node.target, [tuple(output_values(s)[o].shape) for s, o in tensor_inputs(node)],
                         [tuple(v.shape) for v in output_values(node) if v is not None])
    dtype = next((v.dtype for v in output_values(node) if v is not None), torch.float32)
    time = roofline_time(flops, nbytes, dtype, device, name)
    return NodeFormula(name, flops, sympy.simplify(nbytes), time, kind.backward if backward else 0.0)


def collective_formula(kind: str, input_bytes: sympy.Expr, axis: int, sizes: Sizes, device: DeviceSpec) -> sympy.Expr:
    """Alpha-beta time of one collective on mesh axis `axis`, in the model's sizes."""
    link = device.axis_link(sizes.mesh.sizes, axis, sizes.mesh.axis_names[axis])
    values = {"B": input_bytes, "n": sizes.axis(axis), "alpha": link.latency_s, "beta": link.bandwidth}
    ring = RING[kind].subs(values)
    if kind == "all_reduce" and device.tree_all_reduce and sizes.mesh.sizes[axis] > 2:
        return sympy.Min(ring, TREE_ALL_REDUCE.subs(values))
    return ring
