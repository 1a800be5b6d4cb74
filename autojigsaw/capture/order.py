"""One order of a traced program for every rank: the same ops traced in another order take the first's.

A model that loops over a set of strings (ModernBERT builds one rotary embedding per attention kind)
traces the same ops in an order that depends on the process' string hash seed, which torchrun leaves
random per rank, and names them in that order. Each node gets a key from what it computes (its op,
constants and its inputs' keys) and where its value goes (its users' keys), never from its name, so
that a rank whose keys are another rank's in another order can take that rank's order and names. A
program that differs in what it computes keeps its own, and the ranks' agreement check names the
difference.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import torch
from torch.fx import Graph, GraphModule, Node

Order = list[tuple[str, str]]  # (what a node computes, its name), in program order

_DEVICE_INDEX = re.compile(r"(device\(type='\w+'), index=\d+\)")


def without_device_indices(text: str) -> str:
    """`text` (a graph's code, a node's arguments) with each device's index dropped: ranks differ there alone."""
    return _DEVICE_INDEX.sub(r"\1)", text)


def program_order(graph: Graph) -> Order:
    """Each node's key and name, in program order. A key is what the node computes (from its inputs' keys)
    and where its value goes (its users' keys): two tables built alike and scaled apart get two keys."""
    computes: dict[Node, str] = {}
    for node in graph.nodes:
        computes[node] = _digest(node.name if node.op == "placeholder" else _content(node, computes))
    keys: dict[Node, str] = {}
    for node in reversed(graph.nodes):
        uses = sorted(f"{keys[user]}@{user.all_input_nodes.index(node)}" for user in node.users)
        keys[node] = _digest(f"{computes[node]} -> {uses}")
    return [(keys[node], node.name) for node in graph.nodes]


def in_order(gm: GraphModule, order: Order) -> GraphModule:
    """gm with its nodes in `order` and named as there, where it computes the same nodes; else gm."""
    mine = program_order(gm.graph)
    if mine == order or Counter(k for k, _ in mine) != Counter(k for k, _ in order):
        return gm
    alike: dict[str, list[Node]] = {}  # nodes that compute the same value for the same users
    for (key, _), node in zip(mine, gm.graph.nodes):
        alike.setdefault(key, []).append(node)
    graph, env = Graph(), {}
    for key, name in order:
        node = next((n for n in alike[key] if n not in env and all(i in env for i in n.all_input_nodes)), None)
        if node is None:  # no topological match: the ranks' agreement check names the difference
            return gm
        env[node] = graph.create_node(node.op, node.target, torch.fx.map_arg(node.args, env.__getitem__),
                                      torch.fx.map_arg(node.kwargs, env.__getitem__), name=name, type_expr=node.type)
        env[node].meta = dict(node.meta)
    graph.lint()
    return GraphModule(gm, graph)


def _content(node: Node, keys: dict[Node, str]) -> str:
    """What a node computes, by its inputs' keys: its op, target and constants (device indices dropped)."""
    args = torch.fx.map_arg((node.args, node.kwargs), lambda n: _Key(keys[n]))
    return without_device_indices(f"{node.op} {node.target} {args!r}")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class _Key(str):
    """A node's key standing in for the node in its users' contents."""

    def __repr__(self) -> str:
        return f"<{str(self)}>"
