"""Rule for routed experts (capture/routed_experts.py): token dispatch, experts' shares, or tokens split.

Inputs: the tokens X [T, H], the router's top-k `index` and scores [T, k], the experts W1, W2
(dim 0: the E experts); output [T, H]. Per mesh axis:
  replicated      everything Replicate                          -> Replicate
  tokens          X, index, scores Shard(0); W1, W2 Replicate   -> Shard(0)  (data parallelism)
  token dispatch  X, index, scores, W1, W2 Shard(0)              -> Shard(0)  each rank's rows sent by
                  all-to-all to their expert's rank and back (kernels/token_dispatch.py); over several
                  axes, one all-to-all over their flattened group: experts over data x tensor while
                  attention splits the batch over data and heads over tensor ("parallel folding")
  experts         X, index, scores Replicate; W1, W2 Shard(0)    -> Partial   each rank its experts'
                  rows of tokens all ranks hold (kernels/expert_share.py)
Token dispatch and experts' shares are not combined in one strategy. The data axis may split the
experts too, their weights stored split over it, or keep them whole, FSDP's or DDP's as every other
weight (the planner's choice: strategies/data_pins.py). Priced at balanced routing, or at
`moe_imbalance` (routed_experts_cost.py).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...capture.routed_experts import OP
from ...kernels import registry
from ...kernels.expert_share import expert_share
from ...kernels.token_dispatch import token_dispatch
from ...placements import local_offset, local_shape
from .base import AxisOption, per_axis, register
from .routed_experts_cost import Layout, dispatch_traffic, members, routed_cost

R, S0 = Replicate(), Shard(0)
KERNEL = "routed_experts"


@register(OP)
def routed_experts(node, mesh, candidates):
    tokens = node.args[0].meta["val"].shape[0]

    def options(n):
        opts = [AxisOption((R,) * 5, (R,), kernel=KERNEL)]
        if n == 1:
            return opts
        if tokens >= n:
            opts.append(AxisOption((S0, S0, S0, R, R), (S0,), kernel=KERNEL, note="tokens"))
            opts.append(AxisOption((S0,) * 5, (S0,), kernel=KERNEL, note="token dispatch"))
        opts.append(AxisOption((R, R, R, S0, S0), (Partial(),), kernel=KERNEL, note="experts"))
        return opts

    found = []
    for s in per_axis(mesh, options):
        layout = Layout.of(s.inputs[0], s.inputs[3], mesh.sizes)
        split = math.prod(mesh.sizes[a] for a in layout.tokens)
        if not (layout.dispatch and layout.share) and split <= tokens:
            found.append(s)
    return found


def _call(node, sharding, rank, local_inputs):
    """token_dispatch over the dispatch axes, expert_share over the experts' axes, else the op on local tokens."""
    _check_layout(node, sharding)
    layout = Layout.of(sharding.inputs[0], sharding.inputs[3], rank.mesh.sizes)
    mm, act, gated = node.args[5:8]
    w1 = node.args[3].meta["val"]
    if layout.dispatch:
        torch._dynamo.config.capture_scalar_outputs = True  # the all-to-all's sizes are the routing's counts
        blocks = tuple(local_shape(w1.shape, sharding.inputs[3], rank.mesh.sizes, c)[0]
                       for c in members(rank.coord, layout.dispatch, rank.mesh.sizes))
        return token_dispatch, tuple(local_inputs), {"mm": mm, "act": act, "gated": gated, "experts": blocks,
                                                     "axis": rank.axes(layout.dispatch)}
    if layout.share:
        first = local_offset(w1.shape, sharding.inputs[3], rank.mesh.sizes, rank.coord)[0]
        return expert_share, tuple(local_inputs), {"mm": mm, "act": act, "gated": gated, "first": first,
                                                   "experts": w1.shape[0]}
    return OP, (*local_inputs, mm, act, gated), {}


def _check_layout(node, sharding) -> None:
    """The placements this kernel runs: per axis the tokens (x, index, scores) alike and the experts (W1, W2)
    alike, each whole or split on dim 0, and the output as the rule gives it."""
    x, w = sharding.inputs[0], sharding.inputs[3]
    want = tuple(Partial() if t == R and e == S0 else t for t, e in zip(x, w))
    if (sharding.inputs[1:3] != (x, x) or sharding.inputs[4] != w or sharding.outputs[0] != want
            or any(p not in (R, S0) for p in (*x, *w))):
        raise ValueError(f"node {node.name!r}: routed experts split the tokens (x, index, scores alike) and the experts "
                         f"(W1, W2 alike) on dim 0 only, the output as the tokens (Partial where only the experts are "
                         f"split), but the plan gives inputs {sharding.inputs} and output {sharding.outputs[0]}: plan again, "
                         "or edit the plan to one of the rule's strategies")


def _traffic(node, rank, backward) -> list[tuple[str, int]]:
    return dispatch_traffic(node, rank, backward) if node.target is token_dispatch else []


registry.add(registry.Kernel(KERNEL, _call, _traffic, routed_cost))
