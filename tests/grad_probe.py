"""The gradient probe: every model the suite builds, one random backward, every parameter's gradient.

`(out * w).sum().backward()` with a fixed random `w` per output leaf reaches every parameter
through every path, unlike a loss whose gradient happens to vanish or be symmetric. A wrong
gradient (a dropped shard, a missing sum) shows as a difference from the single-device model.
Plans are made once in the test process under 0.7 of the replicated memory, so weights shard.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import autojigsaw
from autojigsaw import Plan
from autojigsaw.dtypes import carries_grad
from autojigsaw.testing.local_ranks import get_mesh

from . import side_by_side
from .attention_cases import build_model as attention_model
from .hf_models import hf_model
from .models import build as small_model
from .rope_llama import RopeBlock, RopeLlama, in_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.models import build as mlp_stack  # noqa: E402
from mixer_model import WeatherMixer  # noqa: E402

F64 = torch.float64


def _seeded(make: Callable, *inputs: torch.Tensor):
    torch.manual_seed(0)
    return make(), inputs


def _hf(name: str):
    model, inputs = hf_model(name)
    return model.to(F64), tuple(x.to(F64) if x.is_floating_point() else x for x in inputs)


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)


def _tokens(*shape, vocab):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1))


# name -> (model, inputs) and the unit roundoff of the dtype the model computes in (RoPE: fp32).
MODELS: dict[str, tuple[Callable, float]] = {
    "mlp": (lambda: (small_model("mlp", F64), (_randn(4, 8, 16),)), 2.0**-53),
    "linear_stack": (lambda: (small_model("stack", F64), (_randn(4, 8, 16),)), 2.0**-53),
    # nn.Sequential's forward names its input `input`, a Python builtin (FX renames it in a new graph)
    "sequential": (lambda: _seeded(lambda: torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                                               torch.nn.Linear(64, 16)).to(F64), _randn(4, 8, 16)),
                   2.0**-53),
    "mlp_stack": (lambda: (mlp_stack(32, 64, 2).to(F64), (_randn(2, 8, 32),)), 2.0**-53),
    "gpt2": (lambda: _hf("gpt2"), 2.0**-53),
    "llama": (lambda: _hf("llama"), 2.0**-24),  # RMSNorm and RoPE tables computed in fp32
    "bert": (lambda: _hf("bert"), 2.0**-53),
    "vit": (lambda: _hf("vit"), 2.0**-53),
    "mixer": (lambda: _seeded(lambda: WeatherMixer().to(F64), _randn(2, 3, 8, 8)), 2.0**-53),
    "gpt_block_gqa": (lambda: attention_model("gpt", F64, seq_len=8), 2.0**-53),
    "vision_attention": (lambda: attention_model("vision", F64, seq_len=8), 2.0**-53),
    "rope_block": (lambda: _seeded(lambda: in_dtype(F64, RopeBlock, 64, 4, 16, 128), _randn(2, 16, 64)), 2.0**-24),
    "rope_llama": (lambda: _seeded(lambda: in_dtype(F64, RopeLlama, 96, 64, 4, 16, 2), _tokens(2, 16, vocab=96)),
                   2.0**-24),
}


def build(name: str):
    """(model, inputs tuple) of probe model `name`, seeded: the same on every rank."""
    model, inputs = MODELS[name][0]()
    return model.train(), inputs if isinstance(inputs, tuple) else (inputs,)


def plan_json(name: str, mesh: dict[str, int], fraction: float = 0.7) -> str:
    """The plan for `name` under `fraction` of its replicated memory: weights must shard."""
    if name in side_by_side.MODELS:  # the same model and shapes: the plan test_hf_models.py makes too
        return side_by_side.plan_json(name, mesh, fraction)
    return _planned(name, mesh, memory_budget=int(fraction * _whole(name))).to_json()


@functools.cache  # one 1-rank plan per model and test process, for every mesh
def _whole(name: str) -> int:
    """Bytes of `name`'s step on one rank."""
    return _planned(name, {"tensor": 1}).memory_per_rank


def _planned(name: str, mesh: dict[str, int], **options) -> Plan:
    """Probe model `name` planned on `mesh`, from its graph captured once per test process."""
    return side_by_side.planned((f"probe {name}", ()), mesh, functools.partial(build, name), **options)


def _probe(out) -> torch.Tensor:
    """sum(out * w) over every differentiable output leaf, w fixed and random per leaf."""
    gen = torch.Generator().manual_seed(7)
    total = 0
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and carries_grad(leaf.dtype):
            w = torch.randn(leaf.shape, generator=gen, dtype=torch.float64).to(leaf.dtype)
            total = total + (leaf * w).sum()
    return total


def probe(name: str, plan: str, mesh_shape: tuple, axes: tuple) -> dict:
    """Output, every parameter's and every floating input's gradient against one device, relative to
    the largest entry (of the parameters' gradients, of the inputs').

    Gradients are measured against the model's largest gradient entry, since some are zero in
    exact arithmetic (an attention key bias: softmax ignores a shift) and only rounding noise.
    """
    ref, inputs = build(name)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(mesh_shape, axes), inputs, compile=False,
                                    plan=Plan.from_json(plan))
    mine, theirs = _leaves(inputs), _leaves(inputs)
    out, ref_out = pmodel(*mine), ref(*theirs)
    _probe(out).backward()
    _probe(ref_out).backward()
    pairs = [(a, b) for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref_out)) if isinstance(b, torch.Tensor)]
    errors = {"output": max(_diff(a, b) for a, b in pairs) / max(b.abs().max().item() for _, b in pairs)}
    scale = max(q.grad.abs().max().item() for q in ref.parameters())
    for (pname, p), q in zip(pmodel.named_parameters(), ref.parameters()):
        errors[pname] = _diff(p.grad.full_tensor(), q.grad) / scale
    floats = [(i, a, b) for i, (a, b) in enumerate(zip(mine, theirs)) if b.requires_grad]
    scale = max([b.grad.abs().max().item() for _, _, b in floats] or [0.0])
    for i, a, b in floats if scale else ():  # inputs' gradients, as a gradient penalty or a saliency map reads them
        errors[f"input {i}"] = _diff(a.grad, b.grad) / scale
    sharded = sum(any(not pl.is_replicate() for pl in p.placements) for p in pmodel.parameters())
    return {"errors": errors, "sharded": sharded, "unit": MODELS[name][1]}


def _leaves(inputs: tuple) -> list:
    """Fresh copies of the inputs, the floating ones requiring grad."""
    return [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]


def probe_all(names: list[str], plans: dict[str, str], mesh_shape: tuple, axes: tuple) -> dict:
    """probe() for every model, in one task (starting a task per model costs seconds)."""
    return {name: probe(name, plans[name], mesh_shape, axes) for name in names}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
