"""The plan cache: a relaunch reads rank 0's plan instead of solving; a corrupt, stale or unfitting entry is
ignored with a warning (or a log line) and the plan made again; entries are JSON."""

import copy
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

import autojigsaw
from autojigsaw.api.cached import cache_fields, planned_or_cached
from autojigsaw.api.recipe import capture_for
from autojigsaw.mesh import MeshSpec
from autojigsaw.planner import solve
from autojigsaw.runtime import checks
from autojigsaw.runtime.plan_cache import CACHE_ENV, PlanCache
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.training import Regime

from .models import build

MESH = MeshSpec.of({"tensor": 2})
SOLVES = []  # the solves of this process (in a rank pool: of that rank)


def counted_solve(problem, budget, **kw):
    """autojigsaw.planner.solve, counted: a module-level function, so the cache can name it."""
    SOLVES.append(1)
    return solve(problem, budget, **kw)


X = torch.randn(4, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
# 60 % of the replicated plan's bytes: a sharded plan (tests/test_numerics.py)
BUDGET = int(0.6 * autojigsaw.plan(build("stack", torch.float64), (X,), {"tensor": 1}, device="cpu").memory_per_rank)
OPTIONS = autojigsaw.Options(device="cpu", memory_budget=BUDGET, solver=counted_solve)


def _captured(name: str = "stack", batch: int = 4):
    return capture_for(build(name, torch.float64), (X[:batch],), {}, Regime())


def _planned(options=OPTIONS, name: str = "stack"):
    """(plan, solves it took) of a freshly captured program, through the cache."""
    before = len(SOLVES)
    plan = planned_or_cached(_captured(name), MESH, options, {}, Regime())
    return plan, len(SOLVES) - before


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def _entries(directory) -> list:
    return sorted(directory.glob("plan-*.json"))


def test_the_same_program_planned_again_comes_from_the_cache(cache):
    first, solves = _planned()
    assert solves > 0 and not first.stats.from_cache and len(_entries(cache)) == 1
    again, solves = _planned()
    assert solves == 0 and again.stats.from_cache and again.fingerprint() == first.fingerprint()
    assert again.to_json() == first.to_json() and "from the plan cache" in again.summary_line()
    entry = json.loads(_entries(cache)[0].read_text())  # JSON, with the plan as Plan.to_json writes it
    assert entry["plan"] == json.loads(first.to_json()) and entry["stats"]["gap"] == first.stats.gap


def test_what_decides_a_plan_is_in_its_key(cache):
    _planned()
    for other in (dict(mip_gap=0.0), dict(device="cpu+compile"), dict(training=False)):
        plan, solves = _planned(autojigsaw.Options(**{**vars(OPTIONS), **other}))
        assert solves > 0 and not plan.stats.from_cache, other
    plan, solves = _planned(name="mlp")  # another program
    assert solves > 0 and not plan.stats.from_cache
    fields = cache_fields(_captured(), MESH, OPTIONS, {})
    assert cache_fields(_captured(), MeshSpec.of({"domain": 2}), OPTIONS, {}) != fields
    assert cache_fields(_captured(batch=2), MESH, OPTIONS, {}) != fields  # other input shapes
    assert len(_entries(cache)) == 5


def test_another_build_of_the_code_is_another_key(tmp_path):
    # the key's versions hold a digest of autojigsaw's source: a cost model edited under one version number
    # never gets the plans the code before it cached
    copy = tmp_path / "autojigsaw"
    shutil.copytree(checks.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert checks.source_digest(copy) == checks.source_digest(checks.PACKAGE)
    edited = copy / "cost_model" / "compute.py"
    edited.write_text(edited.read_text() + "# edited\n")
    checks.source_digest.cache_clear()
    assert checks.source_digest(copy) != checks.source_digest(checks.PACKAGE)
    versions = cache_fields(_captured(), MESH, OPTIONS, {})["versions"]
    assert versions.endswith(f"(source {checks.source_digest(checks.PACKAGE)})"), versions


def test_a_cached_plan_serves_a_budget_between_its_peak_and_the_one_it_was_made_under(cache):
    first, _ = _planned()
    for budget, cached in ((first.memory_per_rank, True), (OPTIONS.memory_budget, True),
                           (first.memory_per_rank - 1, False), (OPTIONS.memory_budget + 1, False)):
        plan, solves = _planned(autojigsaw.Options(**{**vars(OPTIONS), "memory_budget": budget}))
        assert plan.stats.from_cache == cached and (solves == 0) == cached, budget
        assert plan.memory_budget == budget


def test_a_corrupt_entry_warns_and_is_planned_again(cache):
    first, _ = _planned()
    (path,) = _entries(cache)
    whole = path.read_text()
    entry = json.loads(whole)
    entry["plan"]["nodes"][-2]["shape"] = [3, 3]
    for corrupt in ("{not json", whole[:len(whole) // 2], json.dumps({"format": 1}), json.dumps(entry)):
        path.write_text(corrupt)
        with pytest.warns(UserWarning, match=f"ignoring plan cache entry {path}"):
            plan, solves = _planned()
        assert solves > 0 and plan.fingerprint() == first.fingerprint()
        assert json.loads(path.read_text())["plan"] == json.loads(first.to_json())  # written again, whole


def test_a_stale_entry_of_another_model_is_never_used(cache):
    mine, _ = _planned()
    theirs = planned_or_cached(_captured("mlp"), MESH, OPTIONS, {}, Regime())
    PlanCache(cache).store(cache_fields(_captured(), MESH, OPTIONS, {}), theirs)  # under this program's key
    with pytest.warns(UserWarning, match="ignoring plan cache entry .*made for another model"):
        plan, solves = _planned()
    assert solves > 0 and plan.fingerprint() == mine.fingerprint() != theirs.fingerprint()


def test_no_cache_when_turned_off_or_when_an_option_has_no_name(cache, monkeypatch):
    _planned(autojigsaw.Options(**{**vars(OPTIONS), "solver": lambda p, b, **kw: solve(p, b, **kw)}))
    assert not _entries(cache)  # a lambda: another process could not tell it from another one
    monkeypatch.setenv(CACHE_ENV, "off")
    _planned()
    assert not _entries(cache)


def test_a_relaunch_of_parallelize_takes_rank_0s_plan_from_the_cache(ranks2, tmp_path):
    first, again = ranks2.run(_launched_twice, str(tmp_path))
    for r in (first, again):
        assert r["second"]["from_cache"] and not r["first"]["from_cache"]
        assert r["first"]["fingerprint"] == r["second"]["fingerprint"]
        assert r["second"]["output"] <= 1e-12 and r["second"]["grad"] <= 1e-12
    assert first["first"]["solves"] > 0 and first["second"]["solves"] == 0  # rank 0 plans, once
    assert again["first"]["solves"] == again["second"]["solves"] == 0  # rank 1 never plans
    assert len(_entries(tmp_path)) == 1


def _launched_twice(directory: str) -> dict:
    """On every rank: parallelize the model twice with the cache in `directory`, each beside one device."""
    os.environ[CACHE_ENV] = directory
    try:
        return {"first": _launch(), "second": _launch()}
    finally:
        os.environ[CACHE_ENV] = "off"


def _launch() -> dict:
    model, x = build("stack", torch.float64), X
    ref = copy.deepcopy(model)
    before = len(SOLVES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no entry is ignored
        pmodel = autojigsaw.parallelize(model, get_mesh((dist.get_world_size(),), ("tensor",)), (x,), compile=False,
                                        device="cpu", memory_budget=BUDGET, solver=counted_solve)
    out, ref_out = pmodel(x), ref(x)
    out.square().sum().backward(), ref_out.square().sum().backward()
    grad = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {"from_cache": pmodel.plan.stats.from_cache, "solves": len(SOLVES) - before,
            "fingerprint": pmodel.plan.fingerprint(), "output": (out - ref_out).abs().max().item(), "grad": grad}
