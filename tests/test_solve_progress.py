"""A solve past 5 s shows its progress: elapsed time, the incumbent, the bound and the gap, on one updating line
on a terminal, else a log line every 10 s; a shorter one shows nothing."""

import io
import logging

import pytest
import torch

from autojigsaw.planner import solve
from autojigsaw.planner.progress import SolveProgress

from .test_planner import _problem
from .side_by_side import build, replicated_bytes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    """A clock the test moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_terminal_gets_one_line_redrawn_in_place_after_5_seconds():
    clock, terminal = _Clock(), _Terminal()
    progress = SolveProgress(terminal, clock=clock)
    progress.update(incumbent=9e-3, bound=8e-3)
    clock.now = 4.9
    progress.update(incumbent=8.5e-3)
    assert terminal.getvalue() == ""  # the first 5 s show nothing
    clock.now = 6.0
    progress.update(bound=8.1e-3)
    assert terminal.getvalue() == "\rplanning: 6 s, best plan 8.500 ms/step, bound 8.100 ms, within 4.7% of optimal\033[K"
    clock.now = 6.2
    progress.update(bound=8.2e-3)  # redrawn at most every 0.5 s
    clock.now = 7.0
    progress.update(incumbent=8.3e-3)
    lines = terminal.getvalue().split("\r")[1:]
    assert len(lines) == 2 and lines[1].startswith("planning: 7 s, best plan 8.300 ms/step, bound 8.200 ms, within 1.2%")
    progress.close()
    assert terminal.getvalue().endswith("\n")


def test_elsewhere_a_log_line_every_10_seconds(caplog):
    clock = _Clock()
    progress = SolveProgress(io.StringIO(), clock=clock)
    with caplog.at_level(logging.INFO, logger="autojigsaw"):
        for clock.now in (1.0, 6.0, 9.0, 15.0, 16.5, 30.0):
            progress.update(incumbent=2.0, bound=1.5)
    progress.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"planning: {t} s, best plan 2000.000 ms/step, bound 1500.000 ms, within 25.0% of optimal" for t in (6, 16, 30)]


def test_a_real_solve_reports_its_incumbents_and_bounds_as_it_goes():
    """GPT-2 under 65 % of its memory branches; a clock that moves a second a reading shows its progress."""
    model, inputs = build("gpt2")
    problem = _problem(model, inputs, {"tensor": 2})
    budget = 0.65 * replicated_bytes("gpt2", torch.float64)

    class Fast(_Clock):
        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    terminal = _Terminal()
    solution = solve(problem, budget, mip_gap=0.01, progress=SolveProgress(terminal, clock=Fast()))
    shown = [line for line in terminal.getvalue().split("\r") if line]
    assert shown and all("best plan" in line and "bound" in line and "of optimal" in line for line in shown[1:]), shown
    bounds = [float(line.split("bound ")[1].split(" ms")[0]) for line in shown if "bound" in line]
    assert bounds == sorted(bounds) and bounds[-1] <= solution.objective * 1e3 + 1e-9  # a bound never falls
    assert terminal.getvalue().endswith("\n")


@pytest.mark.parametrize("gap", [0.0, 0.01])
def test_a_short_solve_shows_nothing(gap):
    model, inputs = build("gpt2")
    problem = _problem(model, inputs, {"tensor": 2})
    terminal = _Terminal()
    solve(problem, None, mip_gap=gap, progress=SolveProgress(terminal))
    assert terminal.getvalue() == ""
