"""The worker pool itself: results in rank order, errors, deaths and hangs reported, pool reusable."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from autojigsaw.testing.local_ranks import LocalRanks, RankFailure

from .hf_models import WORKER_PRELOAD


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    dist.barrier()


def _exit_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)  # gone without a word, as when the kernel kills it for memory
    return True


def _sleep_forever_on_rank_zero():
    if dist.get_rank() == 0:
        import time

        time.sleep(60)
    return True


def _imported(names: tuple[str, ...]) -> list[bool]:
    return [name in sys.modules for name in names]


def _imports_at_start():
    return _imported(("torch.export._trace",) + WORKER_PRELOAD)


def test_workers_start_with_the_preloaded_modules_imported():
    with LocalRanks(1) as pool:  # a fresh worker (conftest.py preloads them): its first task
        assert pool.run(_imports_at_start) == [[True] * (1 + len(WORKER_PRELOAD))]
        assert pool.run(_imported, ("mailbox",)) == [[False]]  # and what none preloads is not there


def test_results_in_rank_order(ranks2):
    assert ranks2.run(_rank_and_sum) == [(0, 1.0), (1, 1.0)]


def test_failure_names_rank_and_pool_recovers(ranks2):
    with pytest.raises(RankFailure, match="(?s)rank 1.*boom on one"):
        ranks2.run(_fail_on_rank_one)
    assert ranks2.run(_rank_and_sum) == [(0, 1.0), (1, 1.0)]


def test_a_rank_that_dies_is_named_at_once_not_at_the_timeout(ranks2):
    with pytest.raises(RankFailure, match="rank 1's process exited with code 3"):
        ranks2.run(_exit_on_rank_one, timeout=120)  # the task timeout would say TimeoutError
    assert ranks2.run(_rank_and_sum) == [(0, 1.0), (1, 1.0)]


def test_hang_times_out():
    with LocalRanks(2, timeout=3) as pool:
        with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
            pool.run(_sleep_forever_on_rank_zero)
