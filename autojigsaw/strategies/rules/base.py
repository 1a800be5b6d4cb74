"""The rule registry and the per-axis helpers every rule is written with.

A rule takes (node, mesh, candidates) -- candidates[i] lists the placements input i may
arrive in -- and returns the node's strategies. Most rules are written for one mesh axis
(`AxisOption`) and combined over the axes by `per_axis`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from ...ir import Strategy, draws_random_numbers
from ...mesh import MeshSpec
from ...placements import Placement, Placements, format_placements

_RULES: dict[object, Callable] = {}
DRAWS = "any other op that draws random numbers"  # the key of the rule for seeded ops with no rule of their own


def register(*ops):
    """Decorator: use this function as the rule for `ops` (OpOverloads, or the name of one that
    another library defines when imported, e.g. "transformers.grouped_mm_fallback.default");
    an op has one rule, whichever file is imported first."""

    def wrap(fn):
        for op in ops:
            if op in _RULES:
                raise ValueError(f"{op} has a rule already ({_RULES[op].__module__}.{_RULES[op].__name__}); "
                                 f"give {fn.__module__}.{fn.__name__} other ops, or merge the two")
            _RULES[op] = fn
        return fn

    return wrap


def registered_rules() -> dict[object, Callable]:
    """Every registered rule by its op (a copy)."""
    return dict(_RULES)


def strategies_for(node: Node, mesh: MeshSpec, candidates: Sequence[Sequence[Placements]]):
    """The node's strategies by autojigsaw's rule, or None when it has no rule for the op."""
    rule = _RULES.get(node.target) or _RULES.get(str(node.target))
    if rule is None and draws_random_numbers(node):
        rule = _RULES[DRAWS]
    return None if rule is None else rule(node, mesh, candidates)


@dataclass(frozen=True)
class AxisOption:
    """One way to run a node on a single mesh axis."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    kernel: str = "local"
    note: str = ""


def per_axis(mesh: MeshSpec, options: Callable[[int], list[AxisOption]]):
    """Strategies from every combination of per-axis options; `options(n)` for an axis of n ranks."""
    per = [options(n) for n in mesh.sizes]
    out = []
    for combo in itertools.product(*per):
        kernels = {o.kernel for o in combo} - {"local"}
        if len(kernels) > 1:
            continue
        inputs = tuple(tuple(o.inputs[i] for o in combo) for i in range(len(combo[0].inputs)))
        outputs = tuple(tuple(o.outputs[i] for o in combo) for i in range(len(combo[0].outputs)))
        notes = "; ".join(f"{axis}: {o.note}" for axis, o in zip(mesh.axis_names, combo) if o.note)
        out.append(Strategy(inputs, outputs, kernel=kernels.pop() if kernels else "local", note=notes))
    return out


def other_dims_split(shape: Sequence[int], whole: set[int], n_out: int = 1,
                     note: str = "") -> Callable[[int], list[AxisOption]]:
    """`per_axis` options of a one-input op that works along the dims in `whole` (a sort, an FFT):
    replicated, or split on any other dim, which it treats as a batch (each of `n_out` outputs alike)."""
    def options(n: int) -> list[AxisOption]:
        opts = [AxisOption((Replicate(),), (Replicate(),) * n_out)]
        if n > 1:
            opts += [AxisOption((Shard(d),), (Shard(d),) * n_out, note=note)
                     for d in range(len(shape)) if d not in whole and shape[d] >= n]
        return opts

    return options


def kernel_axis(node: Node, placements: Placements, dim: int, kernel: str) -> int:
    """The one mesh axis that shards `dim`: the axis a kernel reduces or rings over."""
    axes = [a for a, p in enumerate(placements) if p == Shard(dim)]
    if len(axes) != 1:
        raise ValueError(f"node {node.name!r}: {kernel} runs over one mesh axis, so its input must be "
                         f"Shard({dim}) on exactly one, but its placements are {format_placements(placements)}; "
                         "edit the plan or plan again")
    return axes[0]
