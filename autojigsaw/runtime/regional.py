"""Regional compilation: each piece of a program split by layers compiled on its own, the repeated layers once.

Under FSDP the program runs layer by layer through the units' hooks (runtime/fsdp.py), so its pieces are
compiled apart (as torchtitan compiles each block); the pieces of the repeated layers compute alike -- the
same ops on their own inputs -- and one compiled module runs them all. Without FSDP the program is compiled
whole: measured on CI's CPUs, compiling it layer by layer saves first-step time only for deep models (16
layers: 51 s against 73 s; 4 layers: 68 s against 57 s; docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg
from torch.utils import _pytree as pytree

from .fsdp import FsdpUnits


def compile_pieces(split: GraphModule, compiled: Callable[[nn.Module], nn.Module]) -> dict[str, nn.Module]:
    """Each piece (child) of `split` by name, `compiled`; pieces that compute alike share one compiled module."""
    made: dict[tuple, nn.Module] = {}
    runs = {}
    for name, piece in split.named_children():
        key = computation(piece)
        if key is None:
            runs[name] = compiled(piece)
        elif key in made:
            runs[name] = made[key]
        else:
            runs[name] = made[key] = compiled(piece)
    return runs


def computation(piece: nn.Module) -> tuple | None:
    """What a piece of the program computes, its nodes' names aside: equal for the pieces of two layers that
    run the same ops on their own inputs, so one may run the other's. None for a piece that reads tensors or
    modules of its own (never shared)."""
    inner = getattr(piece, "module", piece)  # under checkpoint: the layer's own graph
    index: dict[Node, int] = {}
    rows: list = [getattr(piece, "policy", None)]  # a Checkpointed layer's recomputation
    for node in inner.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return None
        args = map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))
        if any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves(args)):
            return None
        index[node] = len(index)
        rows.append((node.op, None if node.op == "placeholder" else node.target, repr(args)))
    return tuple(rows)


class _Ref(int):
    """A node's place in its piece, as `computation` compares arguments."""

    def __repr__(self):
        return f"%{int(self)}"


def runnable(split: torch.fx.GraphModule, pieces, units: FsdpUnits | None, compile: bool | str) -> torch.nn.Module:
    """What runs the rewritten graph (split in layers): compiled whole, or under FSDP's units, whose hooks
    run between the pieces, each piece compiled on its own."""
    if units is not None and pieces:
        units.wrap(split, pieces, compile_pieces(split, functools.partial(compiled, compile=compile)))
        return split
    return compiled(split, compile)


def compiled(gm: torch.fx.GraphModule, compile: bool | str) -> torch.nn.Module:
    """gm under torch.compile (fullgraph), with the backend `compile` names; gm itself if False."""
    if not compile:
        return gm
    return torch.compile(gm, fullgraph=True, backend=compile if isinstance(compile, str) else "inductor")
