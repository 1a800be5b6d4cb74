"""Ranks that traced the same program lower it once: rank 0 lowers, the others read its lowering.

Lowering (`run_decompositions`) is most of a capture's time, and every rank's tracing gives the same program
where the ranks agree, as they must. Each rank still traces the model itself, so that `check_agreement`
compares what each traced; only when every rank's program has the same fingerprint does rank 0's lowering
stand for all. Ranks that share a host's cores (CPU ranks, a test's) save that time on all but one.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.export import ExportedProgram

from ..capture.lowering import LoweringExchangeError, keep, kept, lowered
from ..capture.portable import dumps, fingerprint, loads
from .exchange import from_every_rank, from_rank0


class SharedLowering:
    """A `lower` for `capture` on every rank of the default group, for one capture each.

    Every rank joins the exchange once: in the call, or, where its capture stopped before lowering, in `join`.
    """

    def __init__(self):
        self.joined = False

    def __call__(self, ep: ExportedProgram) -> ExportedProgram:
        key = fingerprint(ep)
        if not self._exchange_keys(key):
            return lowered(ep, key)
        if dist.get_rank() == 0:
            try:
                out = lowered(ep, key)
            except Exception:
                self._send(None)
                raise
            self._send(kept(key) or dumps(out))
            return out
        data = self._send(None)
        if data is None:  # rank 0 could not lower it, or write it: as rank 0 did, on its own
            return lowered(ep, key)
        keep(key, data)
        return loads(data, ep)

    def join(self) -> None:
        """Join the exchange where this rank's capture stopped before lowering (no program of its own)."""
        if not self.joined:
            self._exchange_keys(None)

    def _exchange_keys(self, key: str | None) -> bool:
        """Whether every rank traced a portable program with fingerprint `key`."""
        self.joined = True
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return False
        try:
            keys = from_every_rank(key, "every rank's traced program fingerprint")
        except RuntimeError as e:
            raise LoweringExchangeError(str(e)) from e
        return key is not None and keys.count(key) == len(keys)

    @staticmethod
    def _send(data: bytes | None) -> bytes | None:
        """Rank 0's `data` (its lowering, or None) on every rank."""
        try:
            return from_rank0(data, "rank 0's lowered program")
        except RuntimeError as e:
            raise LoweringExchangeError(str(e)) from e
