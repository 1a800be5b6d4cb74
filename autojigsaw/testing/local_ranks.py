"""A pool of local processes joined in one gloo process group: run a function on every rank.

Tests, the demo and the benchmarks use it instead of spawning processes per call: starting
torch costs seconds, so the workers live as long as the pool and take one task after another,
and are forked from a server that imported torch and autojigsaw once (multiprocessing's
forkserver: 0.1 s for a pool of 4, against 7 s and 13 CPU-seconds spawned afresh); each
worker takes the environment its pool was started in. A process has one such server, started
by its first pool: `preload(...)` before then names more modules for it to import (the tests'
transformers; one missing is skipped).
Each task carries the lowered programs (capture/lowering.py) this process made since the last, so a model it
planned is not lowered again on the ranks that parallelize it.
Every collective runs under the process group's timeout and every task under the pool's, so
a bug fails fast instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from ..capture.lowering import keep, kept, kept_keys

_MESHES: dict[tuple, Any] = {}
# imported once, in the forkserver; torch.export._trace is what a worker's first capture would import (0.4 s)
_PRELOAD = ["torch", "torch.distributed", "torch.export._trace", "autojigsaw", __name__]


def preload(*modules: str) -> None:
    """More modules for the forkserver to import once, for every worker of this process: call it before its
    first pool starts (the server lives as long as the process).

        preload("transformers")
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def get_mesh(shape: tuple[int, ...], names: tuple[str, ...], device_type: str = "cpu"):
    """A DeviceMesh over this worker's process group, created once per (shape, names)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), tuple(names), device_type)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, collective_timeout, threads, environ, tasks, results):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the pool's environment, not the forkserver's (started with the first pool)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    results.put((rank, None, "ready"))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs, lowerings = task
        for key, data in lowerings.items():
            keep(key, data)
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankFailure(RuntimeError):
    """A task raised on some rank; the message holds that rank's traceback."""


class LocalRanks:
    """`world_size` local processes in a gloo group; `run(fn, *args)` returns each rank's result."""

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 300.0,
        collective_timeout: float = 60.0,
        threads_per_rank: int = 1,
        startup_timeout: float = 180.0,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.threads_per_rank = threads_per_rank
        self.startup_timeout = startup_timeout
        self._procs: list = []
        self._lowerings_sent: set[str] = set()  # fingerprints of this process's lowerings the workers were given

    def _start(self) -> None:
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
        else:  # Windows: every worker starts torch afresh
            ctx = mp.get_context("spawn")
        port = _free_port()
        self._lowerings_sent = set()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        # every rank hashes strings alike (README: launching): a forkserver takes the seed of the pool that starts it
        seed = os.environ.get("PYTHONHASHSEED")
        environ = {**os.environ, "PYTHONHASHSEED": seed or "0"}
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.collective_timeout,
                      self.threads_per_rank, environ, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        os.environ["PYTHONHASHSEED"] = environ["PYTHONHASHSEED"]
        try:
            for p in self._procs:
                p.start()
        finally:
            if seed is None:
                del os.environ["PYTHONHASHSEED"]
        # Starting torch takes seconds: wait for every worker here, not in a task's timeout.
        ready = 0
        while ready < self.world_size:
            try:
                self._results.get(timeout=self.startup_timeout)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{self.world_size} workers did not start within "
                                   f"{self.startup_timeout:.0f} s") from None
            ready += 1

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        try:  # fail here, not after the timeout, when the task cannot reach the workers
            pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"cannot send {getattr(fn, '__name__', fn)} to the workers: {e}; "
                            "pass a module-level function and picklable arguments") from e
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        lowerings = {key: kept(key) for key in kept_keys() if key not in self._lowerings_sent}
        self._lowerings_sent.update(lowerings)
        for q in self._tasks:
            q.put((fn, args, kwargs, lowerings))
        deadline = timeout or self.timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        end = time.monotonic() + deadline
        while len(results) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=max(min(end - time.monotonic(), 1.0), 0.01))
            except queue.Empty:
                dead = self._dead(set(results) | set(failures))
                if dead and not failures:  # its peers learn of it only when their collective times out
                    end = min(end, time.monotonic() + self.collective_timeout + 5.0)
                failures.update(dead)
                if time.monotonic() >= end:
                    break
                continue
            if not ok and not failures:  # the other ranks may be stuck in a collective: give them a moment
                end = min(end, time.monotonic() + 5.0)
            (results if ok else failures)[rank] = value
        missing = sorted(set(range(self.world_size)) - results.keys() - failures.keys())
        if failures or missing:
            self.close()  # a rank that failed or hangs leaves the group unusable
        if failures:
            rank = min(failures)
            raise RankFailure(f"{fn.__name__} failed on rank {rank}:\n{failures[rank]}")
        if missing:
            raise TimeoutError(
                f"{fn.__name__} did not finish within {deadline:.0f} s on ranks {missing}"
            )
        return [results[r] for r in range(self.world_size)]

    def _dead(self, answered: set[int]) -> dict[int, str]:
        """Ranks whose process ended before they answered, with their exit codes."""
        return {r: f"rank {r}'s process exited with code {p.exitcode} before it answered (killed, out of "
                   "memory, or os._exit)" for r, p in enumerate(self._procs) if r not in answered and not p.is_alive()}

    def close(self) -> None:
        """Stop the workers (the pool restarts itself on the next `run`)."""
        for p, q in zip(self._procs, getattr(self, "_tasks", [])):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs = []

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
