"""Pinned layouts: the user's constraints on placements, as a filter on each node's strategies.

`constraints` maps a name to what it must be. A name is a glob over parameter names and module
paths, matched at the end of the name ("layers.*.mlp.down_proj" matches
"model.layers.0.mlp.down_proj", so a base model's tp plan applies to the model that wraps it), or
over the captured graph's node names (plan.table(wide=True) shows them). What it must be:

- placements, one per mesh axis (None: the planner's): a parameter's; on a data axis Replicate()
  (FSDP or DDP shard it there), or, for routed experts' weights, Shard(0) too (split by expert);
- a style on one mesh axis (the tensor axis by default): transformers' names ("colwise",
  "rowwise", ... tp_styles.HF_STYLES), torch's ColwiseParallel(), RowwiseParallel(),
  SequenceParallel(), or "split" (split on a dim of the planner's choosing), for a module's own
  parameters or one parameter; a parameter's own entry wins over its module's, as in transformers;
- a function of each candidate Strategy (its `inputs` and `outputs` placements and `kernel`)
  saying whether the node named may take it.

A parameter pinned split over an axis is also read split there, never gathered (the weight of a
column- or row-parallel matmul, its casts and views included); the rest is the planner's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.fx import GraphModule, Node

from ..capture import Captured
from ..ir import STRATEGIES, Strategy
from ..mesh import MeshSpec
from ..modules import EXPERT_WEIGHT
from ..placements import format_placements
from ..training import data_axes
from .constrained_reads import keep_reads_split
from .tp_styles import SPLIT, hf_style, style_text, torch_style

TENSOR_AXES = ("tensor", "tp")  # the axis a style applies to when constraints_axis is None


@dataclass(frozen=True)
class ParamPin:
    """What one constraint entry asks of a parameter: per mesh axis, the placements it may take (None: any)."""

    entry: str
    fqn: str
    allowed: tuple[frozenset | None, ...]


def check_constraints(constraints: Mapping | None) -> None:
    """A ValueError naming the first entry whose value is no constraint (before any model is seen)."""
    if constraints is None:
        return
    if not isinstance(constraints, Mapping):
        raise ValueError(f"constraints={type(constraints).__name__}: give a dict of module or parameter name -> "
                         "style or placements, e.g. {'model.layers.*.mlp.down_proj': 'rowwise'}")
    for key, value in constraints.items():
        if not isinstance(key, str):
            raise ValueError(f"constraints[{key!r}]: a key is a module path, parameter name or node name (a string)")
        if isinstance(value, str):
            _hf_rule(key, value)
        elif not (isinstance(value, ParallelStyle) or _is_placements(value) or callable(value)):
            raise ValueError(f"constraints[{key!r}] = {value!r}: give a style (transformers' 'colwise', 'rowwise', "
                             "...; torch's ColwiseParallel(), ...), placements (one per mesh axis), or a function of "
                             "a candidate strategy")


def describe_constraints(constraints: Mapping | None, function_text: Callable | None = None) -> str:
    """The constraints as text two processes can compare (a function by `function_text` of it, else its
    qualified name)."""
    if not constraints:
        return "none"

    def text(value) -> str:
        if isinstance(value, (str, ParallelStyle)):
            return style_text(value)
        if _is_placements(value):
            return ",".join("-" if p is None else format_placements((p,)) for p in value)
        if function_text is not None:
            return str(function_text(value))
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"

    return repr([(key, text(value)) for key, value in constraints.items()])


def constrain(captured: Captured, mesh: MeshSpec, constraints: Mapping | None, axis_name: str | None = None, *,
              stage: bool = False) -> None:
    """Filter the annotated graph's strategies (node.meta[STRATEGIES]) by `constraints`; a ValueError names
    an entry that matches nothing or cannot hold. `stage`: the graph is one pipeline stage's, where an entry
    that matches nothing places another stage's part (check_constraints_match checks the whole model)."""
    if not constraints:
        return
    gm = captured.gm
    pins = param_pins(captured, mesh, constraints, axis_name, stage=stage)
    by_name = {n.name: n for n in gm.graph.nodes}
    for placeholder, pin in pins.items():
        _keep(by_name[placeholder], lambda s, pin=pin: _pin_holds(pin, s.outputs[0]), pin.entry,
              f"{pin.fqn} in {_allowed_text(pin, mesh)}")
    keep_reads_split(gm, {by_name[ph]: pin for ph, pin in pins.items()}, mesh)
    for key, value in constraints.items():
        if _of_nodes(value):
            _filter_nodes(gm, by_name, key, value, stage)


def check_constraints_match(model: torch.nn.Module, constraints: Mapping | None) -> None:
    """A ValueError naming a module or parameter entry that matches nothing in `model` (whose stages are
    constrained apart, each by the entries that match it)."""
    fqns = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    for key, value in (constraints or {}).items():
        if not _of_nodes(value) and not _matches_any(key, fqns, modules):
            raise _unmatched(key, fqns)


def _unmatched(key: str, fqns) -> ValueError:
    return ValueError(f"constraints[{key!r}] matches no parameter or module of the model (e.g. "
                      f"{next(iter(fqns), '?')!r}); a key is a glob matched at the end of a name")


def param_pins(captured: Captured, mesh: MeshSpec, constraints: Mapping, axis_name: str | None, *,
               stage: bool = False) -> dict[str, ParamPin]:
    """Placeholder -> what the constraints ask of that parameter: module entries first, a parameter's own last."""
    modules = module_types(captured.gm)
    fqns = {fqn: ph for ph, fqn in captured.params.items()}
    shapes = {n.name: tuple(n.meta["val"].shape) for n in captured.gm.graph.nodes if n.name in captured.params}
    experts = {n.name for n in captured.gm.graph.nodes if n.meta.get(EXPERT_WEIGHT)}
    pins: dict[str, ParamPin] = {}
    for own in (False, True):  # module entries, then parameter entries (which win)
        settled: dict[str, ParamPin] = {}
        for key, value in constraints.items():
            if _of_nodes(value):
                continue
            for fqn, rule in _targets(key, value, fqns, modules, own):
                ph = fqns[fqn]
                pin = _pin(key, value, fqn, rule, shapes[ph], mesh, axis_name, ph in experts)
                if ph in settled and settled[ph].allowed != pin.allowed:
                    raise ValueError(f"constraints[{settled[ph].entry!r}] and constraints[{key!r}] both match "
                                     f"{fqn} and disagree: give it one entry of its own")
                settled[ph] = pin
        pins.update(settled)
    for key, value in constraints.items():
        if not (stage or _of_nodes(value) or _matches_any(key, fqns, modules)):
            raise _unmatched(key, fqns)
    return pins


def module_types(gm: GraphModule) -> dict[str, str]:
    """Every module path the captured ops ran in -> its type's qualified name."""
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        for path, kind in (node.meta.get("nn_module_stack") or {}).values():
            found.setdefault(path.replace("L['self'].", ""), kind if isinstance(kind, str) else kind.__qualname__)
    return found


def _targets(key: str, value, fqns: dict[str, str], modules: dict[str, str], own: bool):
    """(parameter FQN, the module type that rules it or None) for each parameter the entry places: its own
    entries (`own`), or those of the modules it matches."""
    if own:
        return [(fqn, modules.get(fqn.rpartition(".")[0], "")) for fqn in fqns if _matches(key, fqn)]
    if any(_matches(key, fqn) for fqn in fqns):
        return []  # a parameter's entry
    return [(fqn, kind) for path, kind in modules.items() if _matches(key, path) and path
            for fqn in fqns if fqn.rpartition(".")[0] == path]


def _pin(key: str, value, fqn: str, module_type: str, shape: tuple, mesh: MeshSpec, axis_name: str | None,
         experts: bool) -> ParamPin:
    """The allowed placements per axis of parameter `fqn` under entry key: value (`experts`: routed experts')."""
    if _is_placements(value):
        if len(value) != mesh.ndim:
            raise ValueError(f"constraints[{key!r}]: {len(value)} placements for a mesh of {mesh.ndim} axes "
                             f"({mesh.describe()}); give one per axis (None: the planner's)")
        allowed = tuple(None if p is None else frozenset({_normalized(p, len(shape))}) for p in value)
        return _checked(ParamPin(key, fqn, allowed), shape, mesh, experts)
    axis = style_axis(mesh, axis_name, key)
    rule = hf_style(value) if isinstance(value, str) else torch_style(value, module_type)
    placement = rule(fqn.rpartition(".")[2], len(shape))
    if placement == SPLIT:
        choice = frozenset(Shard(d) for d, size in enumerate(shape) if size >= mesh.sizes[axis])
        if not choice:
            raise ValueError(f"constraints[{key!r}]: {fqn} of shape {list(shape)} has no dim of at least "
                             f"{mesh.sizes[axis]} to split over {mesh.axis_names[axis]!r}")
    else:
        choice = frozenset({_normalized(placement, len(shape))})
    pin = ParamPin(key, fqn, tuple(choice if a == axis else None for a in range(mesh.ndim)))
    return _checked(pin, shape, mesh, experts)


def style_axis(mesh: MeshSpec, axis_name: str | None, key: str) -> int:
    """The mesh axis a style applies to: `axis_name`, else the one named "tensor" or "tp"."""
    names = mesh.axis_names
    if axis_name is not None and axis_name in names:
        return names.index(axis_name)
    found = [a for a in names if a in TENSOR_AXES]
    if axis_name is None and found:
        return names.index(found[0])
    raise ValueError(f"constraints[{key!r}] is a style on one mesh axis, and the mesh ({mesh.describe()}) has no "
                     f"axis {axis_name or 'named tensor or tp'!r}: give constraints_axis= one of {list(names)}")


def _checked(pin: ParamPin, shape: tuple, mesh: MeshSpec, experts: bool) -> ParamPin:
    """`pin`, if each placement splits a dim the axis can split, and leaves a data axis whole (routed experts'
    weights, `experts`, may be split there by expert: strategies/data_pins.py)."""
    data = set(data_axes(mesh))
    for a, allowed in enumerate(pin.allowed):
        for p in allowed or ():
            axis = f"{mesh.axis_names[a]!r} ({mesh.sizes[a]} ranks)"
            if a in data and mesh.sizes[a] > 1 and not (p.is_replicate() or (experts and p == Shard(0))):
                raise ValueError(f"constraints[{pin.entry!r}]: {pin.fqn} cannot be {p} on data axis {axis}: a data "
                                 "axis keeps weights whole (FSDP or DDP shard them there), and splits routed experts' "
                                 "only by expert (Shard(0)); give None or Replicate()")
            if isinstance(p, Shard) and not (p.dim < len(shape) and shape[p.dim] >= mesh.sizes[a]):
                size = shape[p.dim] if p.dim < len(shape) else "no such dim"
                raise ValueError(f"constraints[{pin.entry!r}]: {pin.fqn} of shape {list(shape)} cannot be split on "
                                 f"dim {p.dim} ({size}) over {axis}: pin another placement, or a smaller axis")
    return pin


def _pin_holds(pin: ParamPin, placements) -> bool:
    return placements is not None and all(ok is None or p in ok for ok, p in zip(pin.allowed, placements))


def _allowed_text(pin: ParamPin, mesh: MeshSpec) -> str:
    return ", ".join(f"{mesh.axis_names[a]}: {'/'.join(sorted(map(str, ok)))}"
                     for a, ok in enumerate(pin.allowed) if ok is not None)


def _filter_nodes(gm: GraphModule, by_name: dict[str, Node], key: str, keep: Callable[[Strategy], bool],
                  stage: bool) -> None:
    """The nodes whose name matches `key` keep the strategies `keep` accepts (in a stage, those it has)."""
    if any(c in key for c in "*?["):
        nodes = [n for n in gm.graph.nodes if fnmatchcase(n.name, key) and STRATEGIES in n.meta]
    else:
        nodes = [by_name[key]] if key in by_name and STRATEGIES in by_name[key].meta else []
    if not nodes and not stage:
        raise ValueError(f"constraints[{key!r}] is a function of a strategy and matches no node of the captured "
                         "graph: give a node name as plan.table(wide=True) shows it")
    for node in nodes:
        _keep(node, keep, key, "the function's choice")


def _keep(node: Node, keep: Callable[[Strategy], bool], entry: str, what: str) -> None:
    """Node keeps the strategies `keep` accepts; none left is a ValueError naming the entry and the node."""
    kept = [s for s in node.meta[STRATEGIES] if keep(s)]
    if not kept:
        offered = "; ".join(" ".join(format_placements(p) for p in (s.inputs or s.outputs) if p is not None)
                            for s in node.meta[STRATEGIES][:8])
        raise ValueError(f"constraints[{entry!r}] cannot hold at node {node.name} ({what}): none of its "
                         f"{len(node.meta[STRATEGIES])} strategies does (e.g. {offered}); pin another placement")
    node.meta[STRATEGIES] = kept


def _of_nodes(value) -> bool:
    """Whether an entry is a function of a node's strategies (keyed by node name), not a weight's layout."""
    return callable(value) and not isinstance(value, ParallelStyle)


def _matches(key: str, name: str) -> bool:
    """Whether glob `key` matches `name` whole or at its end, after a dot."""
    return fnmatchcase(name, key) or fnmatchcase(name, "*." + key)


def _matches_any(key: str, fqns, modules) -> bool:
    return any(_matches(key, name) for name in [*fqns, *(m for m in modules if m)])


def _is_placements(value) -> bool:
    return isinstance(value, tuple) and all(p is None or isinstance(p, Placement) for p in value) and bool(value)


def _normalized(p: Placement, ndim: int) -> Placement:
    return Shard(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 and ndim else p


def _hf_rule(key: str, value: str) -> None:
    try:
        hf_style(value)
    except ValueError as e:
        raise ValueError(f"constraints[{key!r}]: {e}") from None


__all__ = ["ParamPin", "check_constraints", "constrain", "describe_constraints", "module_types", "style_axis"]
