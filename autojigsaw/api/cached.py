"""Rank 0's plan for parallelize: from the plan cache when a launch like this one made it, else solved and stored.

The key is everything that decides a plan: the captured program's fingerprint (its code, parameters
and input shapes), the mesh, the whole device spec (a calibrated one differs), every option but the
memory budget (a cached plan serves any budget between its peak and the one it was made under), the
parameters already placed, and the torch and autojigsaw versions (autojigsaw's with a digest of its source,
so an edited cost model never reads the plans the code before it made). An option no text names alike in
another process (a solver or a constraint defined inside a function) turns the cache off for the call.
"""

from __future__ import annotations

import dataclasses


from ..capture import Captured
from ..mesh import MeshSpec
from ..options import Options
from ..placements import Placements, format_placements
from ..plan import Plan
from ..rewrite.rewrite import check_plan_matches
from ..runtime.checks import check_plan, installed_versions, program_facts
from ..runtime.plan_cache import PlanCache, cache_dir, callable_text
from ..strategies.constraints import describe_constraints
from ..training import Regime
from .recipe import plan_captured


def planned_or_cached(captured: Captured, mesh: MeshSpec, options: Options, pinned: dict[str, Placements],
                      regime: Regime) -> Plan:
    """The plan of `captured` on `mesh`: the cache's, checked against the graph, or plan_captured's (stored)."""
    directory = cache_dir()
    fields = None if directory is None else cache_fields(captured, mesh, options, pinned)
    if fields is None:
        return plan_captured(captured, mesh, options, pinned)
    cache = PlanCache(directory)

    def check(plan: Plan) -> None:
        check_plan(plan, mesh, captured, regime)
        check_plan_matches(captured, plan)

    plan = cache.load(fields, check, options.memory_budget)
    if plan is None:
        plan = plan_captured(captured, mesh, options, pinned)
        if plan.pipeline is None:  # Plan.to_json keeps no pipeline stages
            cache.store(fields, plan)
    return plan


def cache_fields(captured: Captured, mesh: MeshSpec, options: Options, pinned: dict[str, Placements]) -> dict | None:
    """What decides the plan, as text; None where an option has no text another process would write alike."""
    functions = [options.solver] if options.solver is not None else []
    functions += [v for v in (options.constraints or {}).values() if callable(v)]
    if any(callable_text(fn) is None for fn in functions):
        return None
    shown = {}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if field.name == "memory_budget":
            continue
        if field.name == "device":
            value = options.device_spec()
        elif field.name == "solver":
            value = None if value is None else callable_text(value)
        elif field.name == "constraints":
            value = describe_constraints(value, function_text=callable_text)
        shown[field.name] = repr(value)
    return {**program_facts(captured), "mesh": mesh.describe(), "options": shown,
            "pinned": sorted((ph, format_placements(pl)) for ph, pl in pinned.items()),
            "versions": installed_versions()}

