"""Module paths of captured nodes, and the repeated layers they belong to (torch.export's nn_module_stack)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Collection, Iterable

from torch.fx import Node

EXPERT_WEIGHT = "autojigsaw_expert_weight"  # placeholder meta: a parameter only routed experts read (their dim 0)

_INDEX = re.compile(r"\[(\d+)\]")
_DOT = re.compile(r"\.(?![^{}]*\})")  # a dot between names, not one inside a layer range ("{0..3}")
_LAYER_INDEX = re.compile(r"\d+|\{.*\}")  # "3", "{0..3}", "{i}"
ELLIPSIS = "\u2026"


def layer_of(path: str) -> tuple[str, int] | None:
    """("model.layers", 3) for "model.layers.3.mlp.up_proj" (the outermost numbered module)."""
    parts = _INDEX.sub(r".\1", path.replace("L['self'].", "")).split(".")
    for k, part in enumerate(parts):
        if part.isdigit() and k > 0:
            return ".".join(parts[:k]), int(part)
    return None


def module_path(node: Node, params: dict[str, str]) -> str | None:
    """The module a node runs in ("model.layers.3.mlp"), or a parameter placeholder's FQN."""
    if node.op == "placeholder":
        return params.get(node.name)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return _INDEX.sub(r".\1", list(stack.values())[-1][0].replace("L['self'].", ""))


def layer_path(node: Node, params: dict[str, str]) -> str | None:
    """The repeated layer a node runs in ("model.layers.3"), or None outside any."""
    layer = layer_of(module_path(node, params) or "")
    return f"{layer[0]}.{layer[1]}" if layer else None


def fsdp_shards(value, *, split: bool = False) -> bool:
    """Whether FSDP2 shards a parameter (its value, or its graph placeholder) along its dim 0: not a scalar
    (CLIP's logit_scale), which stays whole on the data axis, its gradient summed there by the graph as
    under DDP, nor one the plan splits over the data axis itself (`split`: training.splits_data)."""
    if isinstance(value, Node):
        value = value.meta.get("val")
    return not split and getattr(value, "ndim", 0) > 0


def data_sums(placeholder: Node, *, fsdp: bool, split: bool) -> bool:
    """Whether the data axis sums a parameter's gradient outside the graph when it sums once per step (FSDP's
    reduce-scatter; DDP's all-reduce after accumulated microbatches): not one the plan splits over it
    (`split`: each rank gets its own slices' gradients), nor, under FSDP, one it leaves whole (the graph's)."""
    return not split and (fsdp_shards(placeholder) or not fsdp)


def layer_units(nodes: list[Node], params: dict[str, str], split: Collection[str] = frozenset()) -> dict[str, str]:
    """Parameter placeholder -> the repeated layer that alone reads it, where that layer's nodes run as one
    unbroken stretch of the graph: FSDP's units, each gathered only while its layer runs. Parameters
    read outside layers, by two layers, or by a layer run in two stretches are absent (the root unit's),
    and so are those FSDP leaves whole (`fsdp_shards`; `split`: those the plan splits over the data axis)."""
    layer = {n: layer_path(n, params) for n in nodes if n.op == "call_function"}
    stretches = [key for key, _ in itertools.groupby(layer.values())]
    whole = {key for key in stretches if key is not None and stretches.count(key) == 1}
    units = {}
    for node in nodes:
        if (node.op == "placeholder" and node.name in params and node.users
                and fsdp_shards(node, split=node.name in split)):
            readers = {layer.get(user) for user in node.users}
            if len(readers) == 1 and readers <= whole:
                units[node.name] = readers.pop()
    return units


def cut_middle(text: str, width: int) -> str:
    """`text`, or its ends around an ellipsis when it is longer than `width` characters."""
    if len(text) <= width:
        return text
    head = width // 2
    return text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head):]


def short_paths(paths: Iterable[str], width: int) -> dict[str, str]:
    """Each module path from its repeated layer on, cut in the middle to fit `width` where it is longer,
    keeping its last names ("model.layers.{0..3}.self_attn.q_proj" -> "layers.{0..3}…q_proj"); no two alike."""
    forms = {p: _short_forms(p, width) for p in set(paths)}
    pick = dict.fromkeys(forms, 0)
    while True:
        holders: dict[str, list[str]] = {}
        for p, f in forms.items():
            holders.setdefault(f[pick[p]], []).append(p)
        clashes = [p for same in holders.values() if len(same) > 1 for p in same if pick[p] < len(forms[p]) - 1]
        if not clashes:
            return {p: f[pick[p]] for p, f in forms.items()}
        for p in clashes:
            pick[p] += 1


def _short_forms(path: str, width: int) -> list[str]:
    """`path`'s short forms: the one that fits `width` with the most trailing names first (or else the
    shortest), then longer ones, the whole path last. The names before the repeated layer ("model.") go
    first, then middle ones; a path of one name is cut in the middle."""
    names = _DOT.split(path)
    at = next((k for k, name in enumerate(names) if k > 0 and _LAYER_INDEX.fullmatch(name)), 0)
    if len(path) <= width and not at:
        return [path]
    merit = {}  # form -> (trailing names kept, fewer names before the layer)
    for start in range(max(at - 1, 0), -1, -1):  # the layer ("layers.{0..3}"), then its parents
        if at == len(names) - 1:
            merit[".".join(names[start:])] = (0, start)
        for tail in range(1, len(names) - at):
            head, rest = ".".join(names[start:at + 1]), ".".join(names[len(names) - tail:])
            form = head + ("." if at + tail == len(names) - 1 else ELLIPSIS) + rest
            merit[form] = max(merit.get(form, (tail, start)), (tail, start))
    merit.pop(path, None)
    fitting = [f for f in merit if len(f) <= width]
    first = (max(fitting, key=merit.__getitem__) if fitting else min(merit, key=len) if merit
             else cut_middle(path, width))
    return [first] + sorted((f for f in merit if len(f) > len(first)), key=len) + [path]
