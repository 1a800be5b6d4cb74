"""Custom autograd.Functions the model applies: export keeps their forward and drops their backward.

That is harmless where the backward is the forward's own derivative (Bloom's fused GELU, written as a
Function for speed): the captured forward ops give the same gradient. Each Function is checked once,
on seeded fp64 inputs of the shapes it was applied to; one whose backward differs (a straight-through
round, a gradient reversal) is refused by name, with the rewrite that keeps its gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

CHECK_NUMEL = 1 << 16  # larger inputs are checked at shapes cut to 8 along every dim
RTOL, ATOL = 1e-6, 1e-9  # fp64: a hand-written derivative with rounded constants stays well inside


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of one application: its shape (None if symbolic), dtype and requires_grad."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype
    requires_grad: bool


@contextlib.contextmanager
def functions_applied(applied: dict[type, tuple]):
    """Record each torch.autograd.Function the model applies while export runs it, with its first arguments."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        applied.setdefault(cls, tuple(_describe(a) for a in args) if not kwargs else None)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _describe(arg):
    if not isinstance(arg, torch.Tensor):
        return arg
    shape = tuple(s if isinstance(s, int) else None for s in arg.shape)
    return TensorArg(None if None in shape else shape, arg.dtype, arg.requires_grad)


def backward_is_derivative(cls: type, args: tuple | None) -> bool:
    """Whether `cls`'s backward equals the gradient of its forward's ops, on seeded inputs of `args`' shapes."""
    if args is None or any(isinstance(a, TensorArg) and a.shape is None for a in args):
        return False
    if not any(isinstance(a, TensorArg) and a.requires_grad for a in args):
        return True  # no gradient passes through it, so none is lost
    try:
        inputs = _inputs(args)
        return _grads_agree(_grads(cls, inputs, own_backward=True), _grads(cls, inputs, own_backward=False))
    except Exception:  # noqa: BLE001 - a Function the check cannot run is refused as unchecked
        return False


def _inputs(args: tuple) -> tuple:
    numel = sum(torch.Size(a.shape).numel() for a in args if isinstance(a, TensorArg))
    generator = torch.Generator().manual_seed(0)

    def make(a):
        if not isinstance(a, TensorArg):
            return a
        shape = a.shape if numel <= CHECK_NUMEL else tuple(min(s, 8) for s in a.shape)
        if not a.dtype.is_floating_point:
            return torch.zeros(shape, dtype=a.dtype)
        return torch.randn(shape, dtype=torch.float64, generator=generator).requires_grad_(a.requires_grad)

    return tuple(make(a) for a in args)


class _Context:
    """What a Function's forward may call on ctx, when it runs outside autograd.Function.apply."""

    def __init__(self, inputs: tuple):
        self.needs_input_grad = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def _grads(cls: type, inputs: tuple, own_backward: bool) -> list:
    """Gradients of a seeded cotangent through the Function: by its backward, or by its forward's ops."""
    inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                   for x in inputs)
    with torch.enable_grad():
        if own_backward:
            out = cls.apply(*inputs)
        elif _has_setup_context(cls):
            out = cls.forward(*inputs)
        else:
            out = cls.forward(_Context(inputs), *inputs)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    wanted = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    generator = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    grads = torch.autograd.grad(outs, wanted, cotangents, allow_unused=True) if outs else [None] * len(wanted)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(wanted, grads)]


def _has_setup_context(cls: type) -> bool:
    """A Function written with setup_context takes no ctx in its forward."""
    return cls.setup_context is not torch.autograd.Function.setup_context


def _grads_agree(own: list, derived: list) -> bool:
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL * max(1.0, b.abs().max().item()))
               for a, b in zip(own, derived))
