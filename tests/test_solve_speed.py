"""A tight memory budget still gets a plan proven optimal (the times are in benchmarks/solve_speed.py)."""

import pytest

from autojigsaw.planner import highs
from autojigsaw.planner.highs import solve_mip
from benchmarks.solve_speed import small

from .side_by_side import planned


def _planned(name: str, mesh: dict[str, int], **options):
    """benchmarks.solve_speed's small `name` planned on `mesh` (its graph captured once per test process)."""
    return planned((f"small {name}", ()), mesh, lambda: small(name)[:2], **options)


@pytest.mark.parametrize("name", ["mistral", "llama"])
def test_language_model_on_2x2_under_70_percent_of_its_memory_is_proven_optimal(name):
    # at 0.7 a proof over the whole program without the memory rows its plans break stops at the time
    # limit 4-12 % above the LP bound
    budget = int(0.7 * _planned(name, {"tensor": 1}).memory_per_rank)
    # a plan cut short by the time limit warns, and pyproject.toml makes that warning an error
    plan = _planned(name, {"domain": 2, "tensor": 2}, memory_budget=budget, mip_gap=0)
    assert plan.stats.gap == 0.0 and plan.memory_per_rank <= budget  # proven optimal, and it fits
    fastest = _planned(name, {"domain": 2, "tensor": 2})
    assert fastest.memory_per_rank > budget and fastest.step_time < plan.step_time  # the budget binds


def test_a_proof_polishes_the_plan_a_quick_round_accepted_at_once(monkeypatch):
    # a quick round ends at its first improving plan near the bound; the proof from it runs HiGHS' primal
    # heuristics (T5 at 0.6: 53 -> 16 s), a proof from a window's optimum does not (the mixers: slower)
    calls = []

    def recorded(*args, **kwargs):
        result = solve_mip(*args, **kwargs)
        calls.append((kwargs.get("stop") is not None, kwargs.get("polish", False), result.stopped))
        return result

    monkeypatch.setattr(highs, "solve_mip", recorded)
    budget = int(0.6 * _planned("llama", {"tensor": 1}).memory_per_rank)
    _planned("llama", {"tensor": 2}, memory_budget=budget)
    proofs = [(polish, stopped_before) for (quick, polish, _), (_, _, stopped_before) in zip(calls[1:], calls)
              if not quick]
    assert any(polish for polish, _ in proofs), calls
    assert all(polish == stopped_before for polish, stopped_before in proofs), calls
