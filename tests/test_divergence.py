"""Ranks that diverge (versions, input shapes, model, program, plan, options) get a clear error before any
collective of the step.

Every rank raises a ValueError naming what differs and on which ranks; none hangs. Rank 0 alone plans
and sends the plan, or its planning error, to the others.
"""

import os
import time

import pytest
import torch
from torch.distributed.tensor import DTensor

import autojigsaw
from autojigsaw import Plan
from autojigsaw.planner import solve
from autojigsaw.runtime import checks
from autojigsaw.testing.local_ranks import get_mesh

from .models import ConstantScale, build


def _diverge(what: str, plan_json: str):
    rank = torch.distributed.get_rank()
    model = build("mlp", torch.float64, hidden=64 if (what != "model" or rank == 0) else 32)
    x = torch.randn(4, 8 if (what != "inputs" or rank == 0) else 6, 16, dtype=torch.float64)
    plan = Plan.from_json(plan_json) if what == "plan" and rank == 1 else None
    try:
        autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (x,), compile=False, plan=plan,
                               memory_budget=60_000)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what,key", [("inputs", "input shapes"), ("model", "model"), ("plan", "plan")])
def test_diverging_ranks_are_told_what_differs(ranks2, what, key):
    model, x = build("mlp", torch.float64), torch.randn(4, 8, 16, dtype=torch.float64)
    other = autojigsaw.plan(model, (x,), {"tensor": 2}, device="cpu").to_json()  # replicated: not rank 0's
    for message in ranks2.run(_diverge, what, other, timeout=120):
        assert message is not None and f"ranks disagree on the {what}" in message, message
        assert "ranks [0]" in message and "ranks [1]" in message and key in message, message


OTHER_VERSIONS = "torch 2.99.0, autojigsaw 0.0.1"


def _other_versions_on_rank1():
    """Rank 1 reports another installation; (the error, whether any parameter became a DTensor)."""
    model, x = build("mlp", torch.float64), torch.randn(4, 8, 16, dtype=torch.float64)
    real = checks.installed_versions
    if torch.distributed.get_rank() == 1:
        checks.installed_versions = lambda: OTHER_VERSIONS
    try:
        autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (x,), compile=False)
    except ValueError as e:
        return str(e), any(isinstance(p, DTensor) for p in model.parameters())
    finally:
        checks.installed_versions = real
    return None, None


def test_ranks_with_another_version_are_told_which(ranks2):
    for message, sharded in ranks2.run(_other_versions_on_rank1, timeout=120):
        assert message is not None and message.startswith("ranks disagree on the versions"), message
        assert f"ranks [0]: {checks.installed_versions()}" in message, message
        assert f"ranks [1]: {OTHER_VERSIONS}" in message, message
        fix = "give every rank the same installation (torch and autojigsaw versions, autojigsaw's source)"
        assert fix in message, message
        assert not sharded  # raised before any parameter was sharded, let alone a step ran


def _planned(case: str):
    """How many times this rank solved a plan, the plan's fingerprint, and the error it raised (if any)."""
    rank = torch.distributed.get_rank()
    model, x = build("mlp", torch.float64), torch.randn(4, 8, 16, dtype=torch.float64)
    sharded = int(0.7 * autojigsaw.plan(model, (x,), {"tensor": 1}, device="cpu").memory_per_rank)
    budget = {"one plan": sharded, "rank 0 cannot plan": 1_000, "options differ": sharded + rank}[case]
    calls = []
    try:
        pmodel = autojigsaw.parallelize(model, get_mesh((2,), ("tensor",)), (x,), compile=False,
                                        memory_budget=budget, solver=lambda *a, **k: calls.append(1) or solve(*a, **k))
        return len(calls), pmodel.plan.fingerprint(), None
    except ValueError as e:
        return len(calls), None, str(e)


def test_rank_0_alone_plans_and_every_rank_runs_its_plan(ranks2):
    (calls0, plan0, error0), (calls1, plan1, error1) = ranks2.run(_planned, "one plan", timeout=120)
    assert (calls0, calls1) == (1, 0) and error0 is None and error1 is None
    assert plan0 == plan1


def test_rank_0s_planning_error_is_raised_on_every_rank(ranks2):
    (calls0, _, error0), (calls1, _, error1) = ranks2.run(_planned, "rank 0 cannot plan", timeout=120)
    assert (calls0, calls1) == (1, 0)
    assert error0 is not None and error0 == error1, (error0, error1)
    assert "1,000" in error0 or "1000" in error0 or "budget" in error0, error0


def test_ranks_with_other_options_are_told_before_any_plan_is_made(ranks2):
    for calls, _, error in ranks2.run(_planned, "options differ", timeout=120):
        assert calls == 0
        assert error is not None and error.startswith("ranks disagree on the options"), error
        assert error.count("memory_budget=") == 2, error


def _default_budgets() -> tuple[int, int]:
    """This rank's default budget, with rank 1 alone told that 4 ranks share its host."""
    rank, before = torch.distributed.get_rank(), os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "4" if rank == 1 else "2"
    try:
        return checks.default_budget(get_mesh((2,), ("tensor",))), os.sysconf("SC_PHYS_PAGES")
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if before is None else os.environ.update(LOCAL_WORLD_SIZE=before)


def test_the_default_budget_is_the_emptiest_ranks(ranks2):
    (budget0, pages), (budget1, _) = ranks2.run(_default_budgets, timeout=60)
    assert budget0 == budget1 == int(0.9 * os.sysconf("SC_PAGE_SIZE") * pages / 4)


class _BranchesOnRank1(torch.nn.Module):
    """Data-dependent control flow on rank 1 only: torch.export captures it on rank 0, not on rank 1."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16, dtype=torch.float64)

    def forward(self, x):
        y = self.proj(x)
        if torch.distributed.get_rank() == 1 and y.sum() > 0:
            y = y * 2
        return y


def _scale_set_per_rank(hash_seeds: tuple[str, str] = ("0", "0")):
    """parallelize's error where each rank scales by another constant (same weights, same shapes), each rank's
    PYTHONHASHSEED set to its entry of `hash_seeds` (as its launcher would have)."""
    torch.manual_seed(0)
    launched = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = hash_seeds[torch.distributed.get_rank()]
    try:
        autojigsaw.parallelize(ConstantScale(1.0 + torch.distributed.get_rank()), get_mesh((2,), ("tensor",)),
                               (torch.randn(4, 8, 16, dtype=torch.float64),), compile=False)
    except ValueError as e:
        return str(e)
    finally:
        if launched is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = launched
    return None


def test_a_constant_that_differs_by_rank_is_found_in_the_traced_program(ranks2):
    """Weights, shapes and plan agree; only the program differs. Each rank would train its own model."""
    for message in ranks2.run(_scale_set_per_rank, timeout=120):
        assert message is not None and "ranks disagree on the program" in message, message
        assert "ranks [0]" in message and "ranks [1]" in message and "set per rank" in message, message
        assert "PYTHONHASHSEED" not in message, message  # every rank hashes alike: not the cause


def test_a_program_that_differs_where_ranks_hash_strings_apart_names_the_hash_seed(ranks2):
    # torchrun leaves each rank its own random hash seed: a loop over a set of strings (ModernBERT) then traced
    # its ops in another order on each rank, and the error blamed the model code alone
    for message in ranks2.run(_scale_set_per_rank, ("1", "2"), timeout=120):
        assert "ranks disagree on the program" in message, message
        assert "Launch every rank with the same seed: PYTHONHASHSEED=0 torchrun" in message, message


def _capture_fails_on_rank1():
    """(the error, seconds to it) of parallelize where only rank 1 cannot capture the model."""
    torch.manual_seed(0)
    start = time.monotonic()
    try:
        autojigsaw.parallelize(_BranchesOnRank1(), get_mesh((2,), ("tensor",)),
                               (torch.randn(4, 8, 16, dtype=torch.float64),), compile=False)
    except ValueError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_rank_that_cannot_capture_the_model_tells_the_others(ranks2):
    """Rank 0 captured and went on to the agreement; it hears why rank 1 stopped rather than waiting out
    the 60 s process-group timeout."""
    (message0, seconds0), (message1, seconds1) = ranks2.run(_capture_fails_on_rank1, timeout=120)
    for message in (message0, message1):
        assert message is not None and "ranks disagree on the model" in message, message
        assert "ranks [1]: not captured" in message and "could not capture" in message, message
    assert max(seconds0, seconds1) < ranks2.collective_timeout / 2, (seconds0, seconds1)
