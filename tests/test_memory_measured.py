"""Memory measured, not predicted: the weather mixer on 2 x 2 ranks holds about a quarter of it.

Each rank loads only its block of the sample (load_shard from a numpy array), trains one step,
and counts the bytes of its parameters, gradients and Adam state and of every tensor autograd
saved for backward (distinct storages, the parameters' own left out). The same count on the
single-device model is the reference. A dispatch mode watches every tensor the rank's forward
and backward produce: none is as large as the sample.
"""

import copy
from functools import partial

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .jigsaw_common import BANDWIDTH_BOUND, FieldLoss, seeded

# 16 x 16 patch rows and columns, 4 patch rows per rank: activations outweigh the weights
SIZES = dict(lat=32, lon=32, patch=2, dim=8, token_hidden=4, channel_hidden=16, depth=1)
BATCH = 4
FIELD = (BATCH, 3, SIZES["lat"], SIZES["lon"])
LAT = [(Shard(2), Shard(2))]  # latitude rows over both mesh axes


class _Largest(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> dict[int, int]:
    """Bytes per distinct storage."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _footprint(model, inputs, watch: _Largest | None = None) -> dict[str, int]:
    """One Adam step; bytes of params, grads, optimizer state, and tensors saved for backward."""
    saved = []
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with watch or _Largest():
            loss = model(*inputs)
            loss.backward()
    opt.step()
    params = [_local(p) for p in model.parameters()]
    own = _nbytes(params)
    activations = {k: v for k, v in _nbytes(saved).items() if k not in own}
    states = [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    grads = _nbytes(_local(p.grad) for p in model.parameters())
    return {"params": sum(own.values()), "grads": sum(grads.values()),
            "optimizer": sum(_nbytes(states).values()), "activations": sum(activations.values()),
            "loss": loss.item()}


def _measure(plan_json: str):
    plan = autojigsaw.Plan.from_json(plan_json)
    mesh = get_mesh((2, 2), ("domain", "tensor"))
    make = partial(seeded, FieldLoss, torch.float32, **SIZES)
    gen = np.random.default_rng(0)
    sample, target = (gen.standard_normal(FIELD, dtype=np.float32) for _ in range(2))
    # this rank's blocks only; the whole arrays exist here for the single-device reference
    mine = [autojigsaw.load_shard(lambda index, a=a: a[index], FIELD, LAT[0], mesh)
            for a in (sample, target)]
    stand_ins = (autojigsaw.stand_in(FIELD), autojigsaw.stand_in(FIELD))  # two objects: two inputs
    model = autojigsaw.parallelize(make(), mesh, stand_ins, plan=plan, input_placements=LAT * 2,
                                   compile=False)
    watch = _Largest()
    ours = _footprint(model, mine, watch)
    ref = _footprint(copy.deepcopy(make()), [torch.from_numpy(a) for a in (sample, target)])
    return ours, ref, watch.numel, max(t.numel() for t in mine)


def test_each_rank_holds_a_quarter(ranks4):
    with torch.device("meta"):
        model = FieldLoss(**SIZES)
    x = torch.empty(FIELD, device="meta")
    # bytes decide (no latency): activations dominate, so the planner shards the sample
    plan = autojigsaw.plan(model, (x, x), {"domain": 2, "tensor": 2}, device=BANDWIDTH_BOUND,
                           input_placements=LAT * 2)
    for ours, ref, largest, local_input in ranks4.run(_measure, plan.to_json()):
        assert abs(ours.pop("loss") - ref.pop("loss")) < 1e-6
        total, ref_total = sum(ours.values()), sum(ref.values())
        assert total <= ref_total / 4 * 1.1, (total / ref_total, ours, ref)
        assert local_input * 4 == np.prod(FIELD) and largest < np.prod(FIELD), largest
