"""Lowering an exported program to ATen (`run_decompositions`), once per program in a process.

Lowering is most of a capture's time. A process that captures the same program again (a model planned, then
parallelized; a test suite's models) reads the lowering it keeps, by the program's fingerprint; ranks that
traced the same program can share one rank's lowering (runtime/shared_lowering.py passes `capture` a
`lower` that does).
"""

from __future__ import annotations

from collections import OrderedDict

from torch.export import ExportedProgram

from .portable import dumps, fingerprint, loads

KEPT_BYTES = 64 * 2**20  # the lowered programs a process keeps, the most recently used, take at most this
_kept: OrderedDict[str, bytes] = OrderedDict()


class LoweringExchangeError(RuntimeError):
    """The ranks could not exchange a lowered program (one stopped, or timed out): not the model's fault."""


def lower(ep: ExportedProgram) -> ExportedProgram:
    """`ep` lowered to ATen: as this process lowered the same program before, else anew (and kept)."""
    return lowered(ep, fingerprint(ep))


def lowered(ep: ExportedProgram, key: str | None) -> ExportedProgram:
    """`ep`, whose fingerprint is `key` (None: not portable), lowered: from what this process keeps, else anew."""
    if key is not None and key in _kept:
        _kept.move_to_end(key)
        return loads(_kept[key], ep)
    out = ep.run_decompositions({})
    if key is not None:
        keep(key, dumps(out))
    return out


def keep(key: str, data: bytes | None) -> None:
    """Keep the lowering `data` of the program fingerprinted `key` (None: it is not portable)."""
    if data is None:
        return
    _kept[key] = data
    _kept.move_to_end(key)
    while sum(map(len, _kept.values())) > KEPT_BYTES:
        _kept.popitem(last=False)


def kept(key: str) -> bytes | None:
    """The lowering this process keeps for the program fingerprinted `key`, if any."""
    return _kept.get(key)


def kept_keys() -> list[str]:
    """The fingerprints of the lowerings this process keeps, the least recently used first."""
    return list(_kept)


def forget() -> None:
    """Forget every lowering this process keeps (the next capture of each program lowers it anew)."""
    _kept.clear()
