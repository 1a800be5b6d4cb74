"""Module paths of captured nodes, and the repeated layers they belong to (torch.export's nn_module_stack)."""

from __future__ import annotations

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
