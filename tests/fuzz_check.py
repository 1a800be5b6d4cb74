"""Plan a fuzzed model in the test process, run it on the ranks, compare with one device.

The comparison: outputs, every parameter's gradient through a random probe `(out * w).sum()`,
and the parameters after one Adam step, each relative to the largest single-device entry and in
units of roundoff of the dtype the model computes in (ModelSpec.unit).
"""

from __future__ import annotations

import copy
import re

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import autojigsaw
from autojigsaw import Plan
from autojigsaw.testing.local_ranks import get_mesh

from .fuzz_models import ModelSpec, build
from .grad_probe import _diff, _probe

ROUNDOFF_UNITS = 64  # as tests/test_grad_probe.py: a few units per op over a few dozen ops
LR, EPS = 1e-2, 1e-8


def plan_or_error(spec: ModelSpec, mesh: dict[str, int], fraction: float) -> tuple[str | None, str | None]:
    """(plan JSON, None), or (None, the ValueError's message) under `fraction` of one rank's bytes."""
    model, inputs = build(spec)
    whole = autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu").memory_per_rank
    try:
        return autojigsaw.plan(model, inputs, mesh, device="cpu", memory_budget=int(fraction * whole)).to_json(), None
    except ValueError as e:
        return None, str(e)


def clear_error(message: str, spec: ModelSpec, mesh: dict[str, int]) -> bool:
    """Does a ValueError name what (a node or parameter) and where or how (a mesh axis or a fix)?"""
    model, _ = build(spec)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    what = any(n in message for n in names) or re.search(r"%\w+|aten\.\w+|node", message)
    axis = any(f"'{a}'" in message or f"{a}=" in message for a in mesh)
    where = axis or re.search(r"\b(try|relax|use|pass|raise)\b", message, re.IGNORECASE)
    return bool(what and where)


def compare(spec: ModelSpec, plan: str, mesh_shape: tuple, axes: tuple) -> dict:
    """Largest differences from one device in units of roundoff (relative to the largest entry):
    output, gradients, one Adam step; or the ValueError parallelize raised."""
    ref, inputs = build(spec)
    try:
        pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(mesh_shape, axes), inputs, compile=False,
                                        plan=Plan.from_json(plan))
    except ValueError as e:
        return {"error": str(e)}
    out, ref_out = pmodel(*inputs), ref(*inputs)
    u = spec.unit
    leaves, ref_leaves = pytree.tree_leaves(out), pytree.tree_leaves(ref_out)
    scale = max(b.abs().max().item() for b in ref_leaves) or 1.0  # all zero: compare absolutely
    errors = {"output": max(_diff(a, b) for a, b in zip(leaves, ref_leaves)) / scale / u}
    _probe(out).backward()
    _probe(ref_out).backward()
    params = dict(pmodel.named_parameters())
    ref_params = dict(ref.named_parameters())
    assert params.keys() == ref_params.keys(), (sorted(params), sorted(ref_params))
    full = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in params.items()}
    gscale = max(q.grad.abs().max().item() for q in ref_params.values()) or 1.0
    errors.update({f"grad {n}": _diff(full[n], q.grad) / gscale / u for n, q in ref_params.items()})
    grads = {n: q.grad.clone() for n, q in ref_params.items()}
    for model in (pmodel, ref):
        opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        opt.step()
    pscale = max(q.abs().max().item() for q in ref_params.values())
    for n, q in ref_params.items():
        p = params[n].full_tensor() if isinstance(params[n], DTensor) else params[n]
        # Adam's first step is lr * g / (|g| + eps): a gradient off by dg moves it by up to
        # lr * dg / (|g| + eps); then the step's own rounding.
        bound = (LR * gscale / (grads[n].abs() + EPS) + pscale) * u
        errors[f"step {n}"] = ((p.detach() - q.detach()).abs() / bound).max().item()
    buffers = dict(pmodel.named_buffers())
    for n, q in ref.named_buffers():  # BatchNorm's running statistics, updated by the forward
        b = buffers[n].full_tensor() if isinstance(buffers[n], DTensor) else buffers[n]
        if q.is_floating_point():
            errors[f"buffer {n}"] = _diff(b, q) / max(q.abs().max().item(), 1.0) / u
        else:
            errors[f"buffer {n}"] = 0.0 if torch.equal(b, q) else float("inf")
    sharded = sum(isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)
                  for p in params.values())
    return {"errors": errors, "sharded": sharded}


def compare_all(cases: list[tuple[ModelSpec, str]], mesh_shape: tuple, axes: tuple) -> list[dict]:
    """compare() for several cases in one task."""
    return [compare(spec, plan, mesh_shape, axes) for spec, plan in cases]
