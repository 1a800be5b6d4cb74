"""A lowered ExportedProgram as bytes, and back: what ranks share instead of each lowering the same program.

A graph is written node by node with its metadata; a fake value is written as what it describes (shape,
stride, offset, dtype, device, requires_grad) and made again, in the receiving program's fake mode, where it is
read; an operator by its name; the program's state and constants are the receiver's own. A program holding
what cannot travel this way (symbolic sizes, higher-order operators and their submodules, a local class) is
not portable: `dumps` and `fingerprint` return None and each rank lowers its own.
"""

from __future__ import annotations

import hashlib
import io
import pickle

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

# Provenance that names objects of this process (graph ids) and counters of its autograd history: neither
# describes the program, and neither is read after capture.
_LOCAL_META = ("from_node", "seq_nr")


class _Unportable(Exception):
    """What the program holds cannot be written and read back as the same value."""


class _Writer(pickle.Pickler):
    """Writes fake values, operators and graph nodes by what they are, refusing what cannot travel."""

    def persistent_id(self, obj):
        if isinstance(obj, FakeTensor):
            if any(not isinstance(s, int) for s in (*obj.shape, *obj.stride(), obj.storage_offset())):
                raise _Unportable("symbolic sizes")
            return ("fake", tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype, obj.device,
                    obj.requires_grad)
        if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool, torch._ops.HigherOrderOperator)):
            raise _Unportable(type(obj).__name__)
        if isinstance(obj, OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        if isinstance(obj, Node):
            return ("node", obj.name)
        return None


class _Ref(str):
    """A node, by name, until the graph that holds it is built."""


class _Reader(pickle.Unpickler):
    """Reads what _Writer wrote: fake values in `mode`, nodes as _Ref."""

    def __init__(self, data: bytes, mode):
        super().__init__(io.BytesIO(data))
        self.mode = mode

    def persistent_load(self, pid):
        kind, *rest = pid
        if kind == "node":
            return _Ref(rest[0])
        if kind == "op":
            namespace, name = rest[0].split("::")
            return getattr(getattr(getattr(torch.ops, namespace), name), rest[1] or "default")
        shape, stride, offset, dtype, device, requires_grad = rest
        with self.mode:
            value = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if offset:
                value = torch.empty(offset + value.untyped_storage().nbytes() // value.element_size(), dtype=dtype,
                                    device=device).as_strided(shape, stride, offset)
        return value.requires_grad_(requires_grad)


def _nodes(gm: GraphModule, local: bool) -> list[tuple]:
    """Each node as (op, name, target, args, kwargs, meta); `local`: with this process' provenance."""
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes) or any(True for _ in gm.children()):
        raise _Unportable("submodules")
    if any(isinstance(v, Node) for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta)):
        raise _Unportable("a node in metadata")  # read back, it would be a name
    return [(n.op, n.name, n.target, n.args, n.kwargs,
             {k: v for k, v in n.meta.items() if local or k not in _LOCAL_META}) for n in gm.graph.nodes]


def _write(obj) -> bytes:
    out = io.BytesIO()
    _Writer(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def fingerprint(ep: ExportedProgram) -> str | None:
    """A digest of everything that decides `ep`'s lowering (graph, metadata, signature, the state's and the
    example inputs' shapes and aliasing), alike in every process; None where `ep` is not portable."""
    leaves = pytree.tree_leaves(ep.example_inputs)
    same = [next(i for i, y in enumerate(leaves) if y is x) for x in leaves]  # one tensor passed twice
    state = {k: (tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad) for k, v in ep.state_dict.items()}
    try:
        inputs = [(tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor)
                  else repr(x) for x in leaves]
        data = _write((torch.__version__, _nodes(ep.graph_module, local=False), ep.graph_signature, state, inputs,
                       same, ep.graph_module.meta))
    except (_Unportable, pickle.PicklingError, TypeError, AttributeError):
        return None
    return hashlib.sha256(data).hexdigest()


def dumps(ep: ExportedProgram) -> bytes | None:
    """The lowered `ep`'s graph, signature and new constants as bytes; None where it is not portable."""
    try:
        return _write((_nodes(ep.graph_module, local=True), ep.graph_signature, ep.graph_module.meta,
                       {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)}))
    except (_Unportable, pickle.PicklingError, TypeError, AttributeError):
        return None


def loads(data: bytes, like: ExportedProgram) -> ExportedProgram:
    """The program `dumps` wrote, with the state, constants and call signature of `like` (the same program
    before lowering, in this process) and its fake values in `like`'s fake mode."""
    mode = next(n.meta["val"].fake_mode for n in like.graph.nodes if isinstance(n.meta.get("val"), FakeTensor))
    rows, signature, gm_meta, constants = _Reader(data, mode).load()
    graph, nodes = torch.fx.Graph(), {}

    def resolved(a):
        return nodes[a] if isinstance(a, _Ref) else a

    for op, name, target, args, kwargs, meta in rows:
        args, kwargs = torch.fx.node.map_aggregate((args, kwargs), resolved)
        node = nodes[name] = graph.create_node(op, target, args, kwargs, name=name)
        node.name, node.meta = name, meta  # as export named it, a builtin's name ("input") too
    gm = GraphModule(torch.nn.Module(), graph)
    gm.meta.update(gm_meta)
    return ExportedProgram(gm, gm.graph, signature, like.state_dict, like.range_constraints, like.module_call_graph,
                           like.example_inputs, {**constants, **like.constants}, verifiers=like.verifiers)
