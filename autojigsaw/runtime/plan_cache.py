"""Plans kept on disk across launches, keyed by everything that decides a plan.

A relaunch of the same job (same program, mesh, device spec, options and versions) reads rank 0's
plan from the cache instead of solving again. The directory is $AUTOJIGSAW_CACHE
(default ~/.cache/autojigsaw; "off" keeps no cache). Entries are JSON (Plan.to_json), never pickle:
whoever can write to the directory can at worst make a job plan again, never run code in it. An
entry is checked against the captured graph before it is used; one that is corrupt, stale or does
not hold is ignored with a warning, and the plan is made again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..plan import Plan, PlanStats

log = logging.getLogger("autojigsaw")

CACHE_ENV = "AUTOJIGSAW_CACHE"
OFF = ("off", "0", "none", "false")
FORMAT = 1  # of an entry; another format is ignored


def cache_dir() -> Path | None:
    """The cache directory the environment names, or None where it turns the cache off."""
    value = os.environ.get(CACHE_ENV)
    if value is None:
        return Path.home() / ".cache" / "autojigsaw"
    return None if value.strip().lower() in OFF or not value.strip() else Path(value).expanduser()


def callable_text(fn) -> str | None:
    """A function as text another process writes alike (module and qualified name, a partial's arguments);
    None for one defined inside a function or a lambda, which no name tells apart."""
    if isinstance(fn, functools.partial):
        inner = callable_text(fn.func)
        return None if inner is None else f"partial({inner}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if "<locals>" in name or "<lambda>" in name:
        return None
    return f"{getattr(fn, '__module__', type(fn).__module__)}.{name}"


class PlanCache:
    """Plans by key in one directory: `load` returns a plan that holds, or None; `store` writes one.

        cache = PlanCache(cache_dir())
        plan = cache.load(fields, check=lambda p: None, budget=2**30) or make_plan()
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, fields: dict) -> Path:
        key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        return self.directory / f"plan-{key[:32]}.json"

    def load(self, fields: dict, check: Callable[[Plan], None], budget: float | None) -> Plan | None:
        """The plan stored under `fields`, if any, that passes `check` (raising ValueError when it does not
        hold) and fits `budget` as planned (at most its peak, at most the budget it was planned under)."""
        path = self.path(fields)
        if not path.exists():
            return None
        start = time.perf_counter()
        try:
            entry = json.loads(path.read_text())
            if entry.get("format") != FORMAT or entry.get("fields") != fields:
                raise ValueError("it was written for other facts (another format, or a hash collision)")
            plan = Plan.from_json(json.dumps(entry["plan"]))
            stats = PlanStats(**{**entry["stats"], "from_cache": True}) if entry.get("stats") else None
            plan = dataclasses.replace(plan, stats=stats)
            check(plan)
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"autojigsaw: ignoring plan cache entry {path}: {str(e).splitlines()[0][:300]}; "
                          "planning again", stacklevel=2)
            return None
        if budget is not None and not plan.memory_per_rank <= budget <= (plan.memory_budget or budget):
            log.info("autojigsaw: the cached plan %s was made under a budget of %s B, this run has %s B: planning "
                     "again", path.name, plan.memory_budget, budget)
            return None
        log.info("autojigsaw: plan read from the cache %s in %.3f s", path, time.perf_counter() - start)
        return dataclasses.replace(plan, memory_budget=int(budget) if budget is not None else plan.memory_budget)

    def store(self, fields: dict, plan: Plan) -> None:
        """Write `plan` under `fields` (atomically: a reader sees the old entry or the new one); a failure to
        write is logged, not raised."""
        entry = {"format": FORMAT, "fields": fields, "plan": json.loads(plan.to_json()),
                 "stats": None if plan.stats is None else {**dataclasses.asdict(plan.stats), "from_cache": False}}
        path = self.path(fields)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.directory, suffix=".tmp", delete=False) as f:
                json.dump(entry, f)
            os.replace(f.name, path)
        except OSError as e:
            log.warning("autojigsaw: could not write the plan cache entry %s: %s", path, e)
            return
        log.info("autojigsaw: plan stored in the cache %s", path)
