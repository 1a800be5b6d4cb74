"""Train a parallel model next to its single-device twin and report the largest differences.

The models: the tiny Hugging Face ones of tests/hf_models.py and the weather mixer. Plans are
made once in the test process (planning on every rank would only repeat it) and sent as JSON.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

import autojigsaw
from autojigsaw import MeshSpec, Plan
from autojigsaw.api import capture_for, plan_captured
from autojigsaw.testing.local_ranks import get_mesh

from .hf_models import hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from mixer_model import WeatherMixer  # noqa: E402

MODELS = ("gpt2", "llama", "bert", "vit", "mixer")


def build(name: str, *, dtype: torch.dtype = torch.float64, dropout: float = 0.0):
    """(model, example inputs) of `name` in `dtype`, seeded: the same on every rank."""
    if name == "mixer":
        torch.manual_seed(0)
        model, inputs = WeatherMixer(), (torch.randn(2, 3, 8, 8),)
    else:
        model, inputs = hf_model(name, dropout=dropout)
    model.train()
    return model.to(dtype), tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def loss_of(out) -> torch.Tensor:
    """Mean square of every floating output: a loss that reaches every parameter."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() if t.dtype == torch.bfloat16 else t.square().mean() for t in leaves)


@functools.cache
def replicated_bytes(name: str, dtype: torch.dtype = torch.float64) -> int:
    """Predicted peak bytes per rank of `name` with every tensor whole (a 1-rank plan)."""
    return planned((name, (("dtype", dtype),)), {"tensor": 1}).memory_per_rank


_CAPTURED: dict = {}  # a model's graph, captured once per test process: capture takes most of a small plan


def planned(model: tuple[str, tuple], mesh: dict[str, int], make=None, **options) -> Plan:
    """autojigsaw.plan of `model`, (name, build's keywords as sorted pairs), which `make()` builds as (module,
    args) or (module, args, kwargs) (default: build), on `mesh` with `options` (device "cpu" unless given),
    from its graph captured once per test process and precision."""
    options = autojigsaw.Options(**{"device": "cpu", **options})
    mesh = MeshSpec.of(mesh)
    regime = options.regime(mesh)
    key = (model, regime.precision)
    if key not in _CAPTURED:
        name, build_kwargs = model
        module, args, kwargs = (*(make() if make is not None else build(name, **dict(build_kwargs))), {})[:3]
        _CAPTURED[key] = capture_for(module, args, kwargs, regime)
    return plan_captured(_CAPTURED[key], mesh, options)


def plan_json(name: str, mesh: dict[str, int], fraction: float = 0.7, *, data_parallel: str | None = None,
              **build_kwargs) -> str:
    """The plan for `name` on `mesh` under `fraction` of the replicated bytes: sharded weights."""
    return _plan_json(name, tuple(mesh.items()), fraction, data_parallel, tuple(sorted(build_kwargs.items())))


SHARED_PLANS = "AUTOJIGSAW_TEST_PLANS"  # a directory every test process of this run shares plans in (conftest.py)


# Plans are deterministic (tests/test_numerics.py): each is made once per test run, by the first test process
# that needs it
@functools.cache
def _plan_json(name: str, mesh: tuple, fraction: float, data_parallel: str | None, build_kwargs: tuple) -> str:
    key = hashlib.sha256(repr((name, mesh, fraction, data_parallel, build_kwargs)).encode()).hexdigest()[:24]
    shared = Path(os.environ[SHARED_PLANS]) / f"{key}.json" if SHARED_PLANS in os.environ else None
    if shared is not None and shared.exists():
        return shared.read_text()
    budget = int(fraction * replicated_bytes(name, dict(build_kwargs).get("dtype", torch.float64)))
    model = (name, tuple(sorted({"dtype": torch.float64, **dict(build_kwargs)}.items())))
    text = planned(model, dict(mesh), memory_budget=budget, data_parallel=data_parallel).to_json()
    if shared is not None:  # written whole, then renamed: the other worker reads all of it or nothing
        partial = shared.with_suffix(f".{os.getpid()}")
        partial.write_text(text)
        partial.replace(shared)
    return text


def train(name: str, mesh_shape: tuple, axes: tuple, plan: str | None = None, *, steps: int = 3,
          dtype: torch.dtype = torch.float64, dropout: float = 0.0, clip: float | None = None,
          fsdp: bool = False, optimizer: str = "adam") -> dict:
    """`steps` Adam (or SGD) steps of the parallel and the single-device model; the largest differences.

    `fsdp`: parallelize shards the weights over the mesh's "data" axis with FSDP2 (else DDP).
    `optimizer="sgd"`: each tensor's learning rate is its largest entry over its largest gradient
    entry (the single device's, before the step, the same in both models), so every tensor moves
    by about its own scale and a parameter's error is its lr times its gradient's error plus rounding.
    "tensors": per parameter name, its largest gradient and parameter differences, scales and lr.
    """
    ref, inputs = build(name, dtype=dtype, dropout=dropout)
    mesh = get_mesh(mesh_shape, axes)
    data_parallel = ("fsdp" if fsdp else "ddp") if "data" in axes else None
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), mesh, inputs, compile=False,
                                    plan=Plan.from_json(plan) if plan else None, data_parallel=data_parallel)
    opt_cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt = opt_cls([{"params": [p]} for p in pmodel.parameters()], lr=1e-2)
    ref_opt = opt_cls([{"params": [q]} for q in ref.parameters()], lr=1e-2)
    diffs = {"output": 0.0, "grad": 0.0, "param": 0.0, "norm": 0.0, "scale": 0.0, "grad_scale": 0.0}
    names = [name for name, _ in ref.named_parameters()]
    tensors = {name: dict.fromkeys(("grad", "grad_scale", "param", "param_scale"), 0.0) for name in names}
    for name, group in zip(names, ref_opt.param_groups):
        tensors[name]["lr"] = group["lr"]
    for step in range(steps):
        torch.manual_seed(100 + step)  # the same dropout masks in both models
        out = pmodel(*inputs)
        torch.manual_seed(100 + step)
        ref_out = ref(*inputs)
        for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref_out)):
            diffs["output"] = max(diffs["output"], max_diff(a, b))
            diffs["scale"] = max(diffs["scale"], b.abs().max().item())
        loss_of(out).backward()
        loss_of(ref_out).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(pmodel.parameters(), clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            diffs["norm"] = max(diffs["norm"], abs(norm.full_tensor().item() - ref_norm.item()))
        _compare_grads(names, pmodel, ref, tensors, diffs)
        if optimizer == "sgd":
            _scale_lrs(names, opt, ref_opt, ref, tensors)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for name, p, q in zip(names, pmodel.parameters(), ref.parameters()):
        tensors[name].update(param=max_diff(p.full_tensor(), q), param_scale=q.abs().max().item())
        diffs["param"] = max(diffs["param"], tensors[name]["param"])
    diffs["tensors"] = tensors
    diffs["sharded"] = sum(any(not pl.is_replicate() for pl in p.placements) for p in pmodel.parameters())
    diffs["whole_over_first_axis"] = sum(p.placements[0].is_replicate() for p in pmodel.parameters())
    diffs["table"] = pmodel.plan.table() if dist.get_rank() == 0 else None
    return diffs


def _compare_grads(names: list[str], pmodel, ref, tensors: dict, diffs: dict) -> None:
    """Each parameter's largest gradient difference and gradient entry, kept in `tensors` and `diffs`."""
    for name, p, q in zip(names, pmodel.parameters(), ref.parameters()):
        t = tensors[name]
        if q.grad is None:  # frozen (PatchTST's sinusoidal positions): no gradient in either model
            assert p.grad is None, name
            continue
        t["grad"] = max(t["grad"], max_diff(p.grad.full_tensor(), q.grad))
        t["grad_scale"] = max(t["grad_scale"], q.grad.abs().max().item())
        diffs["grad"] = max(diffs["grad"], t["grad"])
        diffs["grad_scale"] = max(diffs["grad_scale"], t["grad_scale"])


def _scale_lrs(names: list[str], opt, ref_opt, ref, tensors: dict) -> None:
    """SGD's per-tensor learning rate: its largest entry over its largest gradient entry (the single device's)."""
    for name, group, ref_group, q in zip(names, opt.param_groups, ref_opt.param_groups, ref.parameters()):
        g = q.grad.abs().max().item() if q.grad is not None else 0.0
        group["lr"] = ref_group["lr"] = tensors[name]["lr"] = q.abs().max().item() / g if g else 0.0


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
