"""Ranks that diverge (versions, input shapes, model, plan) get a clear error before any collective of the step.

Every rank raises a ValueError naming what differs and on which ranks; none hangs.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

import autojigsaw
from autojigsaw import Plan
from autojigsaw.runtime import checks
from autojigsaw.testing.local_ranks import get_mesh

from .models import build


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
        assert "give every rank the same installation (torch and autojigsaw versions)" in message, message
        assert not sharded  # raised before any parameter was sharded, let alone a step ran
