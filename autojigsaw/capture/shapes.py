"""The input shapes one symbolic graph serves: each dim a fixed size or a symbol in a range."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class SymbolicSize:
    """An input size export kept symbolic: one value wherever `name` occurs, in [low, high]."""

    name: str
    low: int
    high: int | None  # None: unbounded

    def admits(self, size: int) -> bool:
        return self.low <= size and (self.high is None or size <= self.high)

    def __str__(self) -> str:
        return f"{self.name} in [{self.low}, {'inf)' if self.high is None else f'{self.high}]'}"


@dataclass(frozen=True)
class ShapeRange:
    """The input shapes one graph serves: per tensor input, each dim a fixed size or a SymbolicSize.

    Read off torch.export with every input dim `Dim.AUTO`: export keeps a dim symbolic when the
    model's code works for any size in its range, and fixes it otherwise.
    """

    structure: str  # the call's pytree structure, as a string
    dims: tuple[tuple[int | SymbolicSize, ...] | None, ...]  # per flat input; None: not a tensor
    dtypes: tuple[torch.dtype | None, ...]
    constants: tuple = ()  # per flat input that is no tensor, value_key(it): export baked it into the graph

    def admits(self, args: tuple, kwargs: dict) -> bool:
        """Whether inputs like these fit: same structure and dtypes, fixed sizes equal, each symbol
        one size everywhere and within its range."""
        flat, tree_spec = pytree.tree_flatten((args, kwargs))
        if str(tree_spec) != self.structure or len(flat) != len(self.dims):
            return False
        if constant_keys(flat) != self.constants:
            return False
        seen: dict[str, int] = {}
        for x, dims, dtype in zip(flat, self.dims, self.dtypes):
            if dims is None:
                continue
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.ndim != len(dims):
                return False
            for size, dim in zip(x.shape, dims):
                if isinstance(dim, int) and size != dim:
                    return False
                if isinstance(dim, SymbolicSize) and (seen.setdefault(dim.name, size) != size or not dim.admits(size)):
                    return False
        return True

    @property
    def symbolic(self) -> bool:
        return any(isinstance(d, SymbolicSize) for dims in self.dims if dims for d in dims)

    def __str__(self) -> str:
        """e.g. "(s0, s1) with s0 in [2, inf), s1 in [2, 512]" for the token ids of a BERT."""
        tensors = [dims for dims in self.dims if dims is not None]
        shapes = ", ".join("(" + ", ".join(str(getattr(d, "name", d)) for d in dims) + ")" for dims in tensors)
        symbols = {d.name: d for dims in tensors for d in dims if isinstance(d, SymbolicSize)}
        return f"{shapes} with {', '.join(map(str, symbols.values()))}" if symbols else shapes


def shape_range(input_values: list, args: tuple, kwargs: dict, ranges) -> ShapeRange:
    """The input sizes of a graph exported with `Dim.AUTO`: fixed, or a symbol and its range."""
    flat, tree_spec = pytree.tree_flatten((tuple(args), kwargs))
    dims = tuple(tuple(_size(n, ranges) for n in val.shape) if isinstance(val, torch.Tensor) else None
                 for val in input_values)
    return ShapeRange(str(tree_spec), dims, tuple(x.dtype if isinstance(x, torch.Tensor) else None for x in flat),
                      constant_keys(flat))


def constant_keys(flat: list) -> tuple:
    """value_key of each input that is no tensor, in order: what export baked into the graph."""
    return tuple(value_key(x) for x in flat if not isinstance(x, torch.Tensor))


def needs_grad(flat: list) -> tuple[bool, ...]:
    """Per tensor input, whether it needs a gradient."""
    return tuple(x.requires_grad for x in flat if isinstance(x, torch.Tensor))


def value_key(x) -> tuple:
    """A tensor input's shape and dtype, or any other input's type and value: torch.export bakes a
    float, bool or string argument into the graph, so each value needs a graph of its own."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    try:
        hash(x)
    except TypeError:
        return type(x).__name__, repr(x)
    return type(x).__name__, x


def every_dim_auto(x):
    return {d: torch.export.Dim.AUTO for d in range(x.ndim)} if isinstance(x, torch.Tensor) else None


def _size(size, ranges) -> int | SymbolicSize:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.is_symbol or expr not in ranges:  # a derived size (2 * s0): fixed at this value
        return int(size.node.hint)
    bound = ranges[expr]
    return SymbolicSize(str(expr), int(bound.lower), int(bound.upper) if bound.upper.is_Integer else None)
