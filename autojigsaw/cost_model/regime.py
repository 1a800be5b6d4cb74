"""The training regime on a plan: its precision, recomputed layers and data parallelism, and FSDP's traffic."""

from __future__ import annotations

import math
from dataclasses import replace

from ..capture import Captured
from ..placements import local_shape
from ..plan import Plan
from ..training import Regime
from .estimate import CostContext
from .recompute import repeated_layers


def with_regime(plan: Plan, ctx: CostContext, recomputed) -> Plan:
    """The plan labelled with the regime it is made for (the rewrite reads its data-parallel mode)."""
    return replace(plan, precision=ctx.regime.precision.describe(), recompute=tuple(recomputed),
                   data_parallel=ctx.regime.data_parallel, sums_once=ctx.summed_axis is not None)


def fsdp_layers(captured: Captured, regime: Regime) -> int:
    """The repeated layers FSDP prefetches over, whose exposed traffic the planning problem prices itself
    (planner/problem.py DataTraffic); 0 where the traffic is priced whole and exposed after the solve
    (`with_data_traffic`): DDP, and a pipeline stage's traffic once per step."""
    if not regime.fsdp or regime.fsdp_once:
        return 0
    return max(len(repeated_layers(list(captured.gm.graph.nodes), captured.params)), 1)


def with_data_traffic(plan: Plan, captured: Captured, ctx: CostContext, grad: dict[str, bool]) -> Plan:
    """The plan with the data axis' own traffic (CostContext.data_comm): its bytes, and, unless the planning
    problem priced it (FSDP's per-layer prefetch, planner/problem.py DataTraffic), its time less what
    compute hides (once per step, a pipeline stage's: the gathers run as the first microbatch arrives,
    the first layer's exposed, the reduce-scatters after the last backward; DDP's one all-reduce after
    the last microbatch is exposed), the compute that hides it slowed by the device's overlap_slowdown
    (the two share the GPU). That traffic alone sums the weights' gradients over that axis: the
    rewritten graph leaves them to it, and it has none to sum for a weight that gets none (`grad`, the
    planned problem's: frozen, or behind a detach)."""
    placeholders = {n.name: n for n in captured.gm.graph.nodes if n.name in captured.params}
    fsdp_s, fsdp_bytes, gather_s = 0.0, 0, 0.0
    for name in captured.params:
        val, placements = placeholders[name].meta["val"], plan.node(name).output
        local = local_shape(tuple(val.shape), placements, ctx.mesh.sizes, ctx.coord0)
        nbytes = math.prod(local) * val.dtype.itemsize
        s, b = ctx.data_comm(nbytes, placeholders[name], placements, trained=grad[name])
        fsdp_s, fsdp_bytes = fsdp_s + float(s), fsdp_bytes + int(b)
        gather_s += float(ctx.data_comm(nbytes, placeholders[name], placements, trained=False)[0])
    if not fsdp_s:
        return plan
    if ctx.fsdp_layers:  # its exposed time is in the planned step already
        return replace(plan, comm_bytes=plan.comm_bytes + fsdp_bytes)
    compute = sum(n.compute_s for n in plan.nodes if n.kind != "param")
    layers = max(len(repeated_layers(list(captured.gm.graph.nodes), captured.params)), 1)
    exposed = max(fsdp_s - compute, gather_s / layers + (fsdp_s - gather_s)) if ctx.regime.fsdp else fsdp_s
    step = plan.step_time - fsdp_s + exposed + ctx.device.overlap_slowdown * (fsdp_s - exposed)
    return replace(plan, step_time=step, comm_bytes=plan.comm_bytes + fsdp_bytes)
