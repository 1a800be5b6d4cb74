"""Autojigsaw's kernels are differentiable once: a backward that builds its own graph is refused.

Their backward passes send gradients through collectives autograd does not record, so with
`create_graph=True` (a gradient penalty, a physics-informed loss, a Hessian-vector product) the
gradient's graph would miss every one of them, and a second backward would return wrong numbers.
"""

from __future__ import annotations

import functools

import torch

from ..mesh import MeshAxis


def differentiable_once(backward):
    """Wrap a kernel's backward: under create_graph=True it raises, naming the kernel and its mesh axis."""
    kernel = backward.__qualname__.split(".")[0].lstrip("_")

    @functools.wraps(backward)
    def checked(ctx, *grads):
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            axis = _axis(ctx)
            where = f" on mesh axis {axis.name!r}" if axis is not None else ""
            raise ValueError(
                f"{kernel}{where} is differentiable once, and this backward runs with create_graph=True (a "
                "gradient of a gradient: a gradient penalty, a physics-informed loss, a Hessian-vector product), "
                "which would miss its collectives and give wrong second derivatives. Not supported: compute "
                "that term on the single-device model, or give parallelize a plan that keeps the layers it "
                "differentiates replicated")
        return backward(ctx, *grads)

    return checked


def _axis(ctx) -> MeshAxis | None:
    """The first mesh axis the kernel saved on its context (in ctx.args or as an attribute)."""
    for value in vars(ctx).values():
        for item in value if isinstance(value, tuple) and not isinstance(value, MeshAxis) else (value,):
            if isinstance(item, MeshAxis):
                return item
    return None
