"""Meta-device init that reproduces the single-device initialization, one tensor at a time.

`with meta_init(): model = Model(...)` builds the model on the meta device while recording every
ATen op of its construction, as torchdistx's deferred init does. Each random op is drawn once on
the real device while it is recorded, only to advance that device's generator exactly as the
single-device construction would (so the RNG stream after the block is the same too), and the
generator state before it is kept. `materialize(t)` later replays only the ops that make `t`,
random ones from their recorded state: `t` gets exactly the single-device values. CPU generators
cannot skip ahead to a slice, so a replay draws the whole tensor: the peak is one parameter (and
the temporaries that make it), never the model.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_META = torch.device("meta")
# torch.nn.init functions that return early on a meta tensor, or loop on its values
# (trunc_normal_'s rejection sampling): recorded as one call each and run on real tensors.
_WHOLE_CALLS = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@dataclass(frozen=True)
class _Ref:
    """A meta tensor as it was when an op used it (a Parameter's storage can be swapped later)."""

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        return cls(_key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)


@dataclass
class _Op:
    """One recorded ATen call: meta tensors as _Refs, real tensors as constants."""

    func: torch._ops.OpOverload | object  # an ATen op, or one of _WHOLE_CALLS
    args: tuple
    kwargs: dict
    outs: list[int]  # the storages of its outputs, flattened
    writes: frozenset[int]  # storages it creates or mutates
    reads: frozenset[int]  # storages of its tensor inputs
    rng_state: torch.Tensor | None  # the generator state before a random op


class _Recording:
    """Every op of one construction, and which storages they made."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ops: list[_Op] = []
        self.alive: list[torch.Tensor] = []  # keeps meta storages alive: their keys stay unique

    def add(self, func, args: tuple, kwargs: dict, outs: list[torch.Tensor], writes, reads,
            rng_state) -> None:
        refs = pytree.tree_map(lambda x: _Ref.of(x) if isinstance(x, torch.Tensor) and x.is_meta else x,
                               (args, kwargs))
        writes = frozenset(_key(t) for t in writes)
        self.ops.append(_Op(func, *refs, [_key(t) for t in outs], writes,
                            frozenset(_key(t) for t in reads), rng_state))
        self.alive += outs
        for k in writes:
            _RECORDED[k] = self

    def ops_for(self, storage: int) -> list[_Op]:
        """The ops a storage's final value depends on, in recorded order."""
        need, chosen = {storage}, []
        for op in reversed(self.ops):
            if op.writes & need:
                chosen.append(op)
                need |= op.reads
        return chosen[::-1]


# meta storage -> the recording that made it (until materialized)
_RECORDED: dict[int, _Recording] = {}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(t.is_meta for t in tensors):
            # Work on real constants only (torch.tensor(data), ...) stays real, as a probe of
            # the default device (Hugging Face skips init on a meta one) expects.
            return func(*args, **kwargs)
        meta_args, meta_kwargs = pytree.tree_map(_as_meta, (args, kwargs))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = _META
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            rng = _draw(func, args, kwargs, self.recording.device)
        out = func(*meta_args, **meta_kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        mutated = [a for a, arg in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
        self.recording.add(func, args, kwargs, outs, outs + mutated, [t for t in tensors if t.is_meta], rng)
        return out


def _as_meta(x):
    return x.to(_META) if isinstance(x, torch.Tensor) and not x.is_meta else x


def _generator(kwargs: dict, device: torch.device) -> torch.Generator:
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.default_generator


def _draw(func, args, kwargs, device: torch.device) -> torch.Tensor:
    """Run a random op on scratch tensors of the same geometry: the generator advances as it would."""
    gen = _generator(kwargs, device)
    state = gen.get_state()

    def scratch(x):
        if isinstance(x, torch.Tensor) and x.is_meta:
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=device).zero_()
        return x

    real_args, real_kwargs = pytree.tree_map(scratch, (args, kwargs))
    if "device" in real_kwargs:
        real_kwargs["device"] = device
    func(*real_args, **real_kwargs)
    return state


def _whole_call(fn, recording: _Recording):
    """`fn(tensor, ...)` that, on a meta tensor, records itself and advances the generator."""

    def call(tensor, *args, **kwargs):
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return fn(tensor, *args, **kwargs)
        with _disable_current_modes():
            rng = _draw(fn, (tensor, *args), kwargs, recording.device)
        recording.add(fn, (tensor, *args), kwargs, [], [tensor], [tensor], rng)
        return tensor

    return call


@contextlib.contextmanager
def _patched_whole_calls(recording: _Recording):
    """Route _WHOLE_CALLS (and Hugging Face's own references to them) through `_whole_call`."""
    tables = [vars(torch.nn.init)]
    hf = sys.modules.get("transformers.initialization")
    if hf is not None:
        tables.append(hf.TORCH_INIT_FUNCTIONS)
    saved = [(table, name, table[name]) for table in tables for name in _WHOLE_CALLS if name in table]
    for table, name, fn in saved:
        table[name] = _whole_call(fn, recording)
    try:
        yield
    finally:
        for table, name, fn in saved:
            table[name] = fn


@contextlib.contextmanager
def meta_init(device: str | torch.device = "cpu"):
    """Build models on the meta device, recording how the single-device model on `device` is made.

    Parameters built inside are meta tensors; `parallelize` then creates each rank's shards with
    the values the model would have had if built on `device` with the same seed. Convert dtypes
    inside the block (`Model().double()`): a conversion outside it is not recorded.

        with autojigsaw.meta_init():
            model = Model()  # no memory used
        pmodel = autojigsaw.parallelize(model, mesh, (x,))  # each rank builds only its shards
    """
    recording = _Recording(torch.device(device))
    with _Recorder(recording), _patched_whole_calls(recording):
        yield


def is_recorded(t: torch.Tensor) -> bool:
    """Was meta tensor `t` made inside `meta_init`?"""
    return t.is_meta and _key(t) in _RECORDED


def recorded_draws(t: torch.Tensor) -> torch.Tensor | None:
    """The generator states the random ops that make meta tensor `t` start from, as one tensor
    (None if none draws): ranks seeded apart would materialize other values from them."""
    recording = _RECORDED.get(_key(t)) if t.is_meta else None
    states = [op.rng_state for op in recording.ops_for(_key(t)) if op.rng_state is not None] if recording else []
    return torch.cat(states) if states else None


def materialize(t: torch.Tensor) -> torch.Tensor:
    """The real value of meta tensor `t`, replayed on the device it was recorded for."""
    recording = _RECORDED[_key(t)]
    device = recording.device
    storages: dict[int, torch.UntypedStorage] = {}  # meta storage -> its real twin

    def real(x):
        if isinstance(x, _Ref):
            return _alias(storages[x.storage], x, device)
        return x.to(device) if isinstance(x, torch.Tensor) else x

    with torch.no_grad():
        for op in recording.ops_for(_key(t)):
            args, kwargs = pytree.tree_map(real, (op.args, op.kwargs))
            if "device" in kwargs:
                kwargs["device"] = device
            out = _run(op, args, kwargs, device)
            for key, value in zip(op.outs, [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]):
                storages.setdefault(key, value.untyped_storage())
    return _alias(storages[_key(t)], _Ref.of(t), device)


def _run(op: _Op, args, kwargs, device: torch.device):
    if op.rng_state is None:
        return op.func(*args, **kwargs)
    gen = _generator(kwargs, device)
    current = gen.get_state()
    gen.set_state(op.rng_state)
    try:
        return op.func(*args, **kwargs)
    finally:
        gen.set_state(current)


def _alias(storage: torch.UntypedStorage, ref: _Ref, device: torch.device) -> torch.Tensor:
    """A real tensor on `storage` with the geometry `ref` recorded."""
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)


def forget(tensors) -> None:
    """Drop the recordings that made `tensors` (after materializing them), freeing their constants."""
    done = {_RECORDED.get(_key(t)) for t in tensors if t.is_meta} - {None}
    for k in [k for k, r in _RECORDED.items() if r in done]:
        del _RECORDED[k]
