"""A tight memory budget still gets a plan proven optimal (the times are in benchmarks/solve_speed.py)."""

import pytest

import autojigsaw
from benchmarks.solve_speed import small


@pytest.mark.parametrize("name", ["mistral", "llama"])
def test_language_model_on_2x2_under_70_percent_of_its_memory_is_proven_optimal(name):
    # at 0.7 the proof used to branch on the whole program without the memory rows its plans broke, and
    # stopped at the time limit 4-12 % above the LP bound
    model, inputs = small(name)
    budget = int(0.7 * autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu").memory_per_rank)
    model, inputs = small(name)
    # a plan cut short by the time limit warns, and pyproject.toml makes that warning an error
    plan = autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="cpu", memory_budget=budget)
    assert plan.stats.gap == 0.0 and plan.memory_per_rank <= budget  # proven optimal, and it fits
    model, inputs = small(name)
    fastest = autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="cpu")
    assert fastest.memory_per_rank > budget and fastest.step_time < plan.step_time  # the budget binds
