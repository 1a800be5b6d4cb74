"""A model's own reentrant activation checkpointing, traced as the gradients eager computes.

`torch.utils.checkpoint(fn, *args, use_reentrant=True)` (Hugging Face's
`gradient_checkpointing_enable()` with `use_reentrant=True`, older models' default) runs `fn`
under no_grad inside an autograd.Function whose backward recomputes it. Export keeps the no_grad
region and drops the Function, so the region's outputs were detached: no gradient reached the
checkpointed layers, and a loss computed from them raised "does not require grad". Traced
under `reentrant_checkpoints_inlined`, the region is an ordinary call where any tensor argument
requires a gradient, and detached where none does, as eager's reentrant checkpoint gives no
gradient then; such a graph holds only for inputs that need a gradient where these did
(Captured.needs_grad_inputs).
Which activations to recompute is the planner's choice (activation_checkpointing=).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.checkpoint import CheckpointFunction


@contextlib.contextmanager
def reentrant_checkpoints_inlined(traced: list[str]):
    """Trace reentrant checkpoints as plain calls (see the module docstring), each named in `traced`:
    whether its region has a gradient depends on which inputs need one."""
    def inlined(function, preserve_rng_state, *args):
        traced.append(getattr(function, "__qualname__", repr(function)))
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        warnings.warn("autojigsaw: a reentrant checkpoint (use_reentrant=True) of inputs that need no gradient "
                      "gives its layers none, as in eager; checkpoint with use_reentrant=False to train them",
                      stacklevel=3)
        with torch.no_grad():
            return function(*args)

    CheckpointFunction.apply = staticmethod(inlined)  # shadows autograd.Function.apply
    try:
        yield traced
    finally:
        del CheckpointFunction.apply
