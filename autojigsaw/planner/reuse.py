"""One plan for another input shape: the same decisions, where the graph and its sharding rules allow them.

`parallelize(dynamic=True)` plans once and runs other sizes in the range torch.export keeps
symbolic with that plan. The rewrite works on concrete sizes (uneven chunks over an axis depend
on the size), so each shape is captured on its own and checked here: every node the plan names
must be in the graph, and every decision must still be a legal strategy at the new sizes (a dim
of 3 over 4 ranks leaves a rank empty, which some rules refuse).
"""

from __future__ import annotations

from dataclasses import replace

from ..capture import Captured
from ..ir import STRATEGIES, output_values, tensor_inputs
from ..plan import Plan
from ..strategies.annotate import annotate


def plan_at_shapes(captured: Captured, plan: Plan) -> Plan:
    """`plan`'s decisions on `captured` (the same model at other input sizes), its node shapes
    updated; the predicted costs stay those of the shape it was planned for. A ValueError
    naming the node when a decision does not apply at these sizes."""
    fixed = {name: pl for name, pl in zip(captured.inputs, plan.input_placements) if pl is not None}
    annotate(captured.gm, plan.mesh, fixed, plan.output_placements)
    by_name = {n.name: n for n in plan.nodes}
    nodes = []
    for node in captured.gm.graph.nodes:
        chosen = by_name.get(node.name)
        if chosen is None:
            raise ValueError(f"node {node.name!r} is not in the plan: the graph differs at these sizes")
        if not any(s.inputs == chosen.inputs and s.outputs == chosen.outputs and s.kernel == chosen.kernel
                   for s in node.meta[STRATEGIES]):
            raise ValueError(f"node {node.name!r} cannot run as planned ({chosen.kernel}, inputs {chosen.inputs}) "
                             "at these sizes")
        first = output_values(node)[0] if node.op != "output" else None
        nodes.append(replace(chosen, shape=tuple(first.shape) if first is not None else (),
                             input_shapes=tuple(tuple(output_values(src)[i].shape) for src, i in tensor_inputs(node))))
    if len(nodes) != len(plan.nodes):
        raise ValueError(f"the graph has {len(nodes)} nodes at these sizes, the plan {len(plan.nodes)}")
    return replace(plan, nodes=tuple(nodes), explainer=None)
