"""What routed experts cost and send, at a routing: balanced by default, or with the busiest rank hotter.

The bytes of a token dispatch depend on where the router sends the tokens, so they are stated at
a routing: every source rank sends the same share of its routed rows to each expert rank (its
`load`). Balanced routing (`moe_imbalance=1`) gives rank q the share e_q / E of its E experts'
block; `moe_imbalance=rho` gives the busiest rank (the first of the group) rho times its balanced
share, at most all of it, and the others the rest in proportion to their experts. So rho = E / e_0
(the group's size, experts split evenly) is every token routed to one rank's experts, the worst
imbalance. The grouped GEMM and the all-to-alls are priced at that busiest rank; the bytes of
every rank are exact whenever the routing is such (tests force it), rows being whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch.distributed.tensor import Shard

from ...cost_model.compute import backward_factor, memory_time, roofline_time
from ...ir import GLOBAL, PLACEMENTS
from ...placements import Placements, local_shape

IMBALANCE = "autojigsaw_moe_imbalance"  # rewritten GraphModule.meta: the routing its traffic is predicted at
COUNT_BYTES = 8  # the exchanged counts are int64


@dataclass(frozen=True)
class Layout:
    """How a routed-experts strategy uses the mesh axes (each of size > 1)."""

    tokens: tuple[int, ...]  # axes splitting the tokens
    dispatch: tuple[int, ...]  # of those, axes splitting the experts too: the token all-to-all's group
    share: tuple[int, ...]  # axes splitting the experts of whole tokens: each rank its experts' share

    @classmethod
    def of(cls, x: Placements, w: Placements, sizes: tuple[int, ...]) -> Layout:
        axes = [a for a in range(len(sizes)) if sizes[a] > 1]
        tokens = tuple(a for a in axes if x[a] == Shard(0))
        experts = {a for a in axes if w[a] == Shard(0)}
        return cls(tokens, tuple(a for a in tokens if a in experts), tuple(a for a in axes if a in experts
                                                                           and a not in tokens))


def members(coord: tuple[int, ...], axes: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The coordinates of the group over `axes` that holds `coord`, in row-major order over those axes."""
    out = [tuple(coord)]
    for a in axes:
        out = [c[:a] + (i,) + c[a + 1:] for c in out for i in range(sizes[a])]
    return out


def loads(blocks: tuple[int, ...], imbalance: float) -> list[Fraction]:
    """The share of each rank's routed rows that goes to each expert rank (blocks: experts per rank)."""
    total = sum(blocks)
    first = min(Fraction(1), Fraction(imbalance).limit_denominator(10**6) * blocks[0] / total)
    rest = total - blocks[0]
    return [first] + [(1 - first) * e / rest if rest else Fraction(0) for e in blocks[1:]]


def rows_sent(tokens: list[int], k: int, share: list[Fraction]) -> list[list[int]]:
    """rows[r][q]: the routed rows rank r sends to rank q."""
    return [[round(t * k * s) for s in share] for t in tokens]


def dispatch_traffic(node, rank, backward) -> list[tuple[str, int]]:
    """The counts, the rows out and back (forward), the gradients back and out (backward), at the routing
    the graph is predicted at (its GraphModule.meta[IMBALANCE], balanced without one)."""
    x, index, w1, w2 = (node.args[i] for i in (0, 1, 3, 4))
    axis, blocks = node.kwargs["axis"], node.kwargs["experts"]
    sizes, val = rank.mesh.sizes, x.meta[GLOBAL]
    layout = Layout.of(x.meta[PLACEMENTS][0], w1.meta[PLACEMENTS][0], sizes)
    tokens = [local_shape(val.shape, x.meta[PLACEMENTS][0], sizes, c)[0]
              for c in members(rank.coord, layout.dispatch, sizes)]
    imbalance = node.graph.owning_module.meta.get(IMBALANCE, 1.0)
    rows = rows_sent(tokens, index.meta[GLOBAL].shape[1], loads(blocks, imbalance))
    me = axis.coord
    out_rows = sum(rows[me]) - rows[me][me]
    in_rows = sum(r[me] for r in rows) - rows[me][me]
    width, x_size, y_size = val.shape[1], val.dtype.itemsize, w2.meta[GLOBAL].dtype.itemsize
    sent = [(sum(blocks) - blocks[me]) * COUNT_BYTES, out_rows * width * x_size, in_rows * width * y_size]
    if backward & {x, w1, w2}:  # the combine's adjoint: the gradients of the rows back to their experts
        sent.append(out_rows * width * y_size)
    if x in backward:  # the dispatch's adjoint: the gradients of the rows back to their tokens
        sent.append(in_rows * width * x_size)
    return [("all_to_all", b) for b in sent]


def _exchange_time(ctx, axes: tuple[int, ...], nbytes: float) -> float:
    """Seconds of an uneven all-to-all over the group of `axes` whose busiest rank sends or receives `nbytes`,
    spread evenly over its peers. NCCL posts the sends to every peer at once (one message latency), and
    the bytes to the peers first differing on axis a cross that axis' link; the slowest link sets the time."""
    sizes = ctx.mesh.sizes
    peers = math.prod(sizes[a] for a in axes) - 1
    slowest = 0.0
    for k, a in enumerate(axes):
        share = (sizes[a] - 1) * math.prod(sizes[b] for b in axes[k + 1:]) / peers
        link = ctx.link(a)
        slowest = max(slowest, link.latency_s + nbytes * share / link.bandwidth)
    return slowest


def routed_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """The busiest rank's grouped GEMMs on its rows, the dispatch's permutations and its all-to-alls."""
    x, index, w1, w2 = (node.args[i].meta["val"] for i in (0, 1, 3, 4))
    sizes, coord = ctx.mesh.sizes, ctx.coord0
    layout = Layout.of(strategy.inputs[0], strategy.inputs[3], sizes)
    t, k = local_shape(x.shape, strategy.inputs[0], sizes, coord)[0], index.shape[1]
    blocks = _blocks(w1.shape[0], strategy.inputs[3], sizes, coord, layout.dispatch or layout.share)
    share = loads(blocks, ctx.moe_imbalance)[0] if blocks else Fraction(1)
    group = math.prod(sizes[a] for a in layout.dispatch)
    rows = float(t * k * share * (group if layout.dispatch else 1))
    e1, e2 = local_shape(w1.shape, strategy.inputs[3], sizes, coord), local_shape(w2.shape, strategy.inputs[4],
                                                                                  sizes, coord)
    flops = 2 * rows * (e1[1] * e1[2] + e2[1] * e2[2])
    size = x.dtype.itemsize
    moved = (math.prod(e1) + math.prod(e2) + rows * (2 * e1[1] + e1[2] + e2[1] + e2[2])) * size
    times = float(roofline_time(flops, moved, x.dtype, ctx.device, "matmul"))
    permuted = float(memory_time(6 * t * k * x.shape[1] * size, ctx.device, "memory"))
    passes = 1 + (backward_factor(torch.ops.aten.mm.default) if ctx.training and grad else 0)
    seconds = (times + permuted) * passes
    if layout.dispatch:  # the busiest rank receives its rows from the others and sends its own tokens' away
        busiest = max(rows * (group - 1) / group, t * k * (1 - float(share))) * x.shape[1] * size
        exchanges = 2 + (2 if ctx.training and grad else 0)
        seconds += exchanges * _exchange_time(ctx, layout.dispatch, busiest) + _exchange_time(
            ctx, layout.dispatch, sum(blocks) * COUNT_BYTES)
    saved = (rows * (2 * e1[1] + e1[2] + e2[1]) + t * k * x.shape[1]) * size
    return seconds, saved


def _blocks(experts: int, w: Placements, sizes, coord, axes: tuple[int, ...]) -> tuple[int, ...]:
    """Experts per rank of the group over `axes` (none: the rank holds them all)."""
    return tuple(local_shape((experts,), tuple(w), sizes, c)[0] for c in members(coord, axes, sizes)) if axes else ()
