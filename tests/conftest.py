"""Shared fixtures: one pool of gloo worker processes per world size, reused by every test."""

import os

import pytest

from autojigsaw.testing.local_ranks import LocalRanks, preload

from .hf_models import WORKER_PRELOAD
from .side_by_side import SHARED_PLANS

# Plans are made, not read from a plan cache: a test counts solves and plans again after a change (the rank
# pools and every subprocess inherit this; tests/test_plan_cache.py names a directory of its own)
os.environ["AUTOJIGSAW_CACHE"] = "off"
# before any pool starts the server its workers fork from
preload(*WORKER_PRELOAD)

# The files that take most of a minute or more on 2 cores (measured with --durations), longest first:
# `-n 2 --dist loadfile` (with --no-loadscope-reorder, pyproject.toml) hands each worker the next file
# when it is almost done, so the suite does not end with one worker in a long file while the other waits.
# (xdist's own order, by number of tests, ran the two-test files of a minute and more last.)
_LONGEST_FIRST = ("test_attention_rules.py", "test_grad_probe.py", "test_benchmarks_smoke.py", "test_train_example.py",
                  "test_moe_dispatch.py", "test_pipeline.py", "test_data_parallel.py", "test_halo.py", "test_hf_models.py", "test_faults.py",
                  "test_expert_parallel.py", "test_fuzz.py", "test_vocab_parallel_loss.py", "test_complex_rope.py",
                  "test_training_regime.py", "test_local_ranks.py", "test_errors.py")


def pytest_collection_modifyitems(items):
    """Order the tests by file, the longest files first (stable otherwise)."""
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def _plans_shared_by_the_workers(tmp_path_factory):
    """Under xdist, the workers of one run share side_by_side's plans (in a directory of this run's own)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = tmp_path_factory.getbasetemp().parent / "plans"
        shared.mkdir(exist_ok=True)
        os.environ[SHARED_PLANS] = str(shared)


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4) as pool:
        yield pool
