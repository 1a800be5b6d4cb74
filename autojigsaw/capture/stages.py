"""Pipeline stages: the captured program cut at repeated-layer boundaries into one program per stage.

The layers are the model's longest stack of numbered modules (`model.layers.0` ... `.31`). Stage k
runs layers `starts[k]` up to the next start; what runs before the first layer (embeddings, masks,
rotary tables) joins the first stage that reads it, what runs after the last (final norm, head,
loss) the last stage. Every value a later stage reads -- an activation, a mask, a user input such
as the labels -- is an output of each stage before it and an input of each stage after it, in the
captured graph's order, so stage k's outputs are stage k+1's inputs. A stage keeps the weights,
buffers and constants it reads under their captured names; a weight two stages read (GPT-2's tied
embedding and head) is in both. Node names stay the captured ones, so one plan names its nodes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils import _pytree as pytree

from ..modules import layer_of, module_path
from .graph import Captured


NO_LAYERS = ("a pipe axis cuts the model between its repeated layers (a stack of numbered modules such as "
             "model.layers.0, .1, ...), and this model has none: drop the pipe axis, or give the model its layers "
             "as an nn.ModuleList")


def layer_stack(captured: Captured) -> list[str]:
    """The model's longest stack of numbered modules, in order: ["model.layers.0", ..., "model.layers.31"]."""
    by_prefix: dict[str, set[int]] = defaultdict(set)
    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            found = layer_of(module_path(node, captured.params) or "")
            if found is not None:
                by_prefix[found[0]].add(found[1])
    if not by_prefix:
        return []
    prefix, indices = max(by_prefix.items(), key=lambda kv: len(kv[1]))
    return [f"{prefix}.{i}" for i in sorted(indices)]


@dataclass(frozen=True)
class StageProgram:
    """One stage's program: its captured graph (inputs: the user's for the first stage, else the values
    the stage before sends, in order), the layers it runs, and the values it sends on."""

    index: int
    captured: Captured
    layers: tuple[str, ...]
    sends: tuple[str, ...]  # captured node names of its outputs (the last stage: the model's outputs)


def cut(captured: Captured, starts: list[int]) -> list[StageProgram]:
    """`captured` as one program per stage; `starts[k]`: the index in `layer_stack` of stage k's first layer."""
    layers = layer_stack(captured)
    if not layers:
        raise ValueError(NO_LAYERS)
    if starts[0] != 0 or list(starts) != sorted(set(starts)) or starts[-1] >= len(layers):
        raise ValueError(f"stage starts {starts} must begin at 0 and rise within the {len(layers)} layers")
    if captured.mutated_buffers:
        raise ValueError(f"the model writes its buffers {captured.mutated_buffers[:3]} in the forward (BatchNorm's "
                         "running statistics): a pipe axis cannot return them from a stage; drop the pipe axis, or "
                         "use a norm without running statistics")
    nodes = list(captured.gm.graph.nodes)
    replayed = _replayable(nodes, captured)
    stage = _stage_of_nodes(captured, nodes, replayed, {name: k for k, name in enumerate(layers)}, starts)
    last = len(starts) - 1
    members = [_members(nodes, stage, replayed, k, last) for k in range(last + 1)]
    sends = _boundaries(nodes, members, captured)
    programs = []
    for k in range(last + 1):
        inputs = list(captured.inputs) if k == 0 else list(sends[k - 1])
        outputs = None if k == last else sends[k]
        gm = _stage_graph(captured, members[k], inputs, outputs)
        stop = starts[k + 1] if k < last else len(layers)
        programs.append(StageProgram(k, _stage_captured(captured, gm, inputs, k == 0, outputs is None),
                                     tuple(layers[starts[k]:stop]), tuple(outputs or ())))
    return programs


def _replayable(nodes: list[Node], captured: Captured) -> set[Node]:
    """Nodes computed from the inputs, buffers and constants alone, drawing no random numbers (masks, rotary
    tables, positions): every stage that reads one computes it again rather than receive it."""
    out: set[Node] = set()
    for node in nodes:
        if node.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        if all(a in out or (a.op == "placeholder" and a.name not in captured.params) for a in node.all_input_nodes):
            out.add(node)
    return out


def _stage_of_nodes(captured: Captured, nodes: list[Node], replayed: set[Node], layer_index: dict[str, int],
                    starts: list[int]) -> dict[Node, int]:
    """Each computing node's stage (replayable ones aside): its layer's, else the earliest stage that reads it
    (the last for the model's outputs), never earlier than a stage whose value it reads."""
    last = len(starts) - 1
    stage: dict[Node, int] = {}
    for node in reversed(nodes):
        if node.op != "call_function" or node in replayed:
            continue
        found = layer_of(module_path(node, captured.params) or "")
        path = f"{found[0]}.{found[1]}" if found else None
        if path in layer_index:
            stage[node] = bisect.bisect_right(starts, layer_index[path]) - 1
        else:
            stage[node] = min((stage.get(u, last) for u in node.users), default=last)
    for node in nodes:  # a value exists only from its stage on
        if node in stage:
            stage[node] = max([stage[node]] + [stage[a] for a in node.all_input_nodes if a in stage])
    return stage


def _members(nodes: list[Node], stage: dict[Node, int], replayed: set[Node], k: int, last: int) -> list[Node]:
    """Stage k's nodes in graph order: its own, and the replayable ones they (or, last, the outputs) read."""
    own = {n for n in nodes if stage.get(n) == k}
    wanted = set(own) | ({nodes[-1]} if k == last else set())
    for node in reversed(nodes):
        if node in wanted:
            wanted |= {a for a in node.all_input_nodes if a in replayed}
    return [n for n in nodes if n in wanted and n.op == "call_function"]


def _boundaries(nodes: list[Node], members: list[list[Node]], captured: Captured) -> list[list[str]]:
    """Per boundary k -> k+1, the names of the values made up to stage k (or given by the user) that a stage
    after k reads, in graph order."""
    made = {n: k for k, group in enumerate(members) for n in group}
    read_last: dict[Node, int] = {}
    for k, group in enumerate(members):
        for node in group + ([nodes[-1]] if k == len(members) - 1 else []):
            for a in node.all_input_nodes:
                if made.get(a) != k:
                    read_last[a] = max(read_last.get(a, -1), k)
    user_inputs = set(captured.inputs)
    return [[n.name for n in nodes if read_last.get(n, -1) > k
             and (n.name in user_inputs and n.op == "placeholder" or made.get(n, k + 1) <= k)]
            for k in range(len(members) - 1)]


def _stage_graph(captured: Captured, members: list[Node], inputs: list[str], outputs: list[str] | None) -> GraphModule:
    """A graph of `members` (in order) reading `inputs` and the weights and constants they use; returning
    `outputs`, or the model's outputs when None."""
    by_name = {n.name: n for n in captured.gm.graph.nodes}
    graph, env = Graph(), {}
    used = {a for n in members for a in n.all_input_nodes}
    if outputs is None:
        used |= set(captured.gm.graph.output_node().all_input_nodes)
    for name in inputs:
        env[by_name[name]] = _placeholder(graph, by_name[name])
    for node in captured.gm.graph.nodes:  # weights, buffers and constants this stage reads, in captured order
        if node.op == "placeholder" and node not in env and node in used:
            env[node] = _placeholder(graph, node)
    for node in members:
        env[node] = graph.node_copy(node, lambda n: env[n])
    if outputs is None:
        out = captured.gm.graph.output_node()
        graph.output(pytree.tree_map_only(Node, lambda n: env[n], out.args[0]))
        graph.output_node().meta = dict(out.meta)
    else:
        graph.output(tuple(env[by_name[name]] for name in outputs))
    graph.lint()
    return GraphModule(captured.gm, graph)


def _placeholder(graph: Graph, source: Node) -> Node:
    """A placeholder standing for `source`'s value, under its name."""
    node = graph.placeholder(source.name)
    node.name = source.name  # FX renames what shadows a builtin; passes find inputs by captured name
    node.meta = {k: v for k, v in source.meta.items() if k in ("val", "tensor_meta")}
    return node


def _stage_captured(captured: Captured, gm: GraphModule, inputs: list[str], first: bool, last: bool) -> Captured:
    """The Captured of a stage graph: the weights, buffers and constants it keeps, its inputs and specs."""
    names = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    outputs = len(gm.graph.output_node().args[0])
    return replace(
        captured, gm=gm, params={k: v for k, v in captured.params.items() if k in names},
        buffers={k: v for k, v in captured.buffers.items() if k in names},
        constants={k: v for k, v in captured.constants.items() if k in names}, inputs=inputs,
        in_spec=captured.in_spec if first else pytree.tree_flatten((tuple(range(len(inputs))), {}))[1],
        out_spec=captured.out_spec if last else pytree.tree_flatten(tuple(range(outputs)))[1],
        needs_grad_inputs=captured.needs_grad_inputs if first else None,
        frozen_params=frozenset(k for k in captured.frozen_params if k in names))

