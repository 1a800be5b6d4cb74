"""Random draws outside torch (numpy's and Python's generators) made by a model while it is traced.

torch.export records what the host computes as a constant of the graph. A mask drawn with numpy
in the forward (Hugging Face's SpecAugment in Wav2Vec2, HuBERT and their kin, on by default in
training) would be the one drawn while tracing, at every step, where eager draws a new one: the
model would train differently with no error. Torch's own draws are ops of the graph, replayed
each step. Tracing under `host_draws` records each call the model's code makes to numpy's or
Python's generators; `refuse_host_draws` then names the line and the fix. A draw those calls do not
show -- a function imported by name (`from numpy.random import rand`), a generator made ahead (a
module's `self.rng = np.random.default_rng(0)`, a module-level one) -- is found by the generator's
state, which the trace changed. A generator the forward makes itself draws alike at every step when
it is seeded (the trace's constant is right), and from fresh entropy when not: that is refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import random
import sys
from collections.abc import Callable
from types import FrameType

import numpy as np
import torch

_NOT_DRAWS = {"seed", "get_state", "set_state", "getstate", "setstate", "get_bit_generator", "set_bit_generator"}
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, np))
_GENERATORS = (np.random.Generator, np.random.RandomState, random.Random)
_NUMPY_GLOBAL = "numpy's global generator (a function imported by name: from numpy.random import ...)"
_PYTHON_GLOBAL = "Python's global generator (a function imported by name: from random import ...)"


def _draws(module, instance) -> list[str]:
    """The names of `module`'s functions that draw from its global generator `instance`."""
    return [name for name in dir(module) if not name.startswith("_") and name not in _NOT_DRAWS
            and getattr(getattr(module, name), "__self__", None) is instance]


def _unseeded(cls: type, label: str, record: Callable[[str, FrameType], None]) -> type:
    """`cls` for the forward's calls: each instance made without a seed is recorded as `label`, and
    isinstance sees instances made before as its own."""

    class Meta(type(cls)):
        def __instancecheck__(self, instance):
            return isinstance(instance, cls)

        def __subclasscheck__(self, subclass):
            return issubclass(subclass, cls)

    def __init__(self, seed=None, *args, **kwargs):
        if seed is None:
            record(label, sys._getframe(1))
        cls.__init__(self, seed, *args, **kwargs)

    return Meta(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def _reachable_generators(model: torch.nn.Module) -> dict[str, object]:
    """The generators the model's code can draw from without a call `host_draws` patches, by where
    they live: numpy's and Python's global ones, and those its modules or their source files hold."""
    found = {_NUMPY_GLOBAL: np.random.mtrand._rand, _PYTHON_GLOBAL: random._inst}
    for name, module in model.named_modules():
        found.update({f"{type(model).__name__}{'.' + name if name else ''}.{k}": v
                      for k, v in vars(module).items() if isinstance(v, _GENERATORS)})
    for source in {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}:
        found.update({f"{source.__name__}.{k}": v for k, v in vars(source).items() if isinstance(v, _GENERATORS)})
    return found


def _state(generator) -> bytes:
    """The generator's state, as bytes to compare."""
    if isinstance(generator, np.random.Generator):
        return pickle.dumps(generator.bit_generator.state)
    return pickle.dumps(generator.getstate() if isinstance(generator, random.Random) else generator.get_state())


@contextlib.contextmanager
def host_draws(model: torch.nn.Module, found: list[str]):
    """Record in `found` each call of numpy's or Python's random functions made from outside torch
    and numpy (as "numpy.random.rand at file:line"), and each generator the model reaches whose
    state changed otherwise (as "a draw from MyModel.noise.rng")."""
    generators = _reachable_generators(model)
    before = {where: _state(g) for where, g in generators.items()}
    patched = [(np.random, name, f"numpy.random.{name}") for name in _draws(np.random, np.random.mtrand._rand)]
    patched += [(random, name, f"random.{name}") for name in _draws(random, random._inst)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    originals += [(np.random, name, getattr(np.random, name)) for name in ("default_rng", "RandomState")]
    originals += [(random, "Random", random.Random)]

    def record(label, caller):
        if not caller.f_code.co_filename.startswith(_LIBRARY_DIRS):
            found.append(f"{label} at {caller.f_code.co_filename}:{caller.f_lineno}")

    def recorded(fn, label):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            record(label, sys._getframe(1))
            return fn(*args, **kwargs)
        return call

    @functools.wraps(np.random.default_rng)
    def default_rng(seed=None):
        if seed is None:
            record("numpy.random.default_rng() without a seed", sys._getframe(1))
        return default_rng.__wrapped__(seed)

    for (module, name, label), (_, _, fn) in zip(patched, originals):
        setattr(module, name, recorded(fn, label))
    np.random.default_rng = default_rng
    np.random.RandomState = _unseeded(np.random.RandomState, "numpy.random.RandomState() without a seed", record)
    random.Random = _unseeded(random.Random, "random.Random() without a seed", record)
    try:
        yield found
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    called = {label.split(".")[0] for label in found}  # "numpy", "random": calls seen, which moved a global state
    seen = {_NUMPY_GLOBAL: "numpy" in called, _PYTHON_GLOBAL: "random" in called}
    found += [f"a draw from {where}" for where, g in generators.items()
              if _state(g) != before[where] and not seen.get(where)]


def refuse_host_draws(model: torch.nn.Module, found: list[str]) -> None:
    """A ValueError naming the first host draw the trace froze, and the fix."""
    if not found:
        return
    config = getattr(model, "config", None)
    hint = ""
    if any(getattr(config, k, 0) for k in ("mask_time_prob", "mask_feature_prob")):
        hint = (" Hugging Face's SpecAugment draws its masks so: pass them as mask_time_indices= (drawn each step "
                "outside the model, as transformers' _compute_mask_indices does; the base models and "
                "Wav2Vec2ForPreTraining take them) with mask_feature_prob=0, or train without it "
                "(apply_spec_augment=False).")
    if getattr(config, "layerdrop", 0) and getattr(model, "training", False):
        hint += (f" LayerDrop (config.layerdrop={config.layerdrop}) may draw so too: build the model with "
                 "layerdrop=0.0.")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    raise ValueError(
        f"{type(model).__name__} draws random numbers outside torch in its forward: {found[0]}{more}. The "
        "captured graph would keep the one draw made while tracing and reuse it at every step. Draw with "
        "torch instead (torch.rand, torch.randperm: replayed each step), or pass what is drawn as an "
        f"input.{hint}")
