"""Random draws outside torch (numpy's and Python's generators) made by a model while it is traced.

torch.export records what the host computes as a constant of the graph. A mask drawn with numpy
in the forward (Hugging Face's SpecAugment in Wav2Vec2, HuBERT and their kin, on by default in
training) would be the one drawn while tracing, at every step, where eager draws a new one: the
model would train differently with no error. Torch's own draws are ops of the graph, replayed
each step. Tracing under `host_draws` records each call the model's code makes to numpy's or
Python's generators; `refuse_host_draws` then names the line and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys

import numpy as np
import torch

_NOT_DRAWS = {"seed", "get_state", "set_state", "getstate", "setstate", "get_bit_generator", "set_bit_generator"}
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, np))


def _draws(module, instance) -> list[str]:
    """The names of `module`'s functions that draw from its global generator `instance`."""
    return [name for name in dir(module) if not name.startswith("_") and name not in _NOT_DRAWS
            and getattr(getattr(module, name), "__self__", None) is instance]


@contextlib.contextmanager
def host_draws(found: list[str]):
    """Record in `found` each call of numpy's or Python's random functions made from outside torch
    and numpy (as "numpy.random.rand at file:line")."""
    patched = [(np.random, name, f"numpy.random.{name}") for name in _draws(np.random, np.random.mtrand._rand)]
    patched += [(np.random, "default_rng", "numpy.random.default_rng")]
    patched += [(random, name, f"random.{name}") for name in _draws(random, random._inst)]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]

    def recorded(fn, label):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            caller = sys._getframe(1)
            if not caller.f_code.co_filename.startswith(_LIBRARY_DIRS):
                found.append(f"{label} at {caller.f_code.co_filename}:{caller.f_lineno}")
            return fn(*args, **kwargs)
        return call

    for (module, name, label), (_, _, fn) in zip(patched, originals):
        setattr(module, name, recorded(fn, label))
    try:
        yield found
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


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
