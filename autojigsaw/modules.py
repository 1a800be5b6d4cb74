"""Module paths of captured nodes, and the repeated layers they belong to (torch.export's nn_module_stack)."""

from __future__ import annotations

import itertools
import re

from torch.fx import Node

_INDEX = re.compile(r"\[(\d+)\]")


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


def fsdp_shards(value) -> bool:
    """Whether FSDP2 shards a parameter, along its dim 0: a scalar (CLIP's logit_scale) has none, so it stays
    whole on the data axis and the graph sums its gradient over it, as under DDP."""
    return getattr(value, "ndim", 0) > 0


def layer_units(nodes: list[Node], params: dict[str, str]) -> dict[str, str]:
    """Parameter placeholder -> the repeated layer that alone reads it, where that layer's nodes run as one
    unbroken stretch of the graph: FSDP's units, each gathered only while its layer runs. Parameters
    read outside layers, by two layers, or by a layer run in two stretches are absent (the root unit's),
    and so are those FSDP leaves whole (`fsdp_shards`)."""
    layer = {n: layer_path(n, params) for n in nodes if n.op == "call_function"}
    stretches = [key for key, _ in itertools.groupby(layer.values())]
    whole = {key for key in stretches if key is not None and stretches.count(key) == 1}
    units = {}
    for node in nodes:
        if node.op == "placeholder" and node.name in params and node.users and fsdp_shards(node.meta.get("val")):
            readers = {layer.get(user) for user in node.users}
            if len(readers) == 1 and readers <= whole:
                units[node.name] = readers.pop()
    return units
