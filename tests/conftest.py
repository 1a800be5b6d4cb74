"""Shared fixtures: one pool of gloo worker processes per world size, reused by every test."""

import pytest

from autojigsaw.testing.local_ranks import LocalRanks


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4) as pool:
        yield pool
