"""Meta-device init: each rank creates only its shards, with the single-device model's values.

`meta_init` records the model's construction on the meta device and `parallelize` replays it one
parameter at a time. The values must equal those of the model built eagerly with the same seed
(and the RNG stream after construction too), and a rank must never hold the whole model: a
dispatch mode counts the bytes alive on the rank and fails the moment they pass a cap below
the model's size.
"""

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import autojigsaw
from autojigsaw import Plan
from autojigsaw.runtime.init import materialize
from autojigsaw.testing.local_ranks import get_mesh

from .side_by_side import MODELS, build, loss_of, max_diff, plan_json


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of real tensor storages alive inside the block; MemoryError past `cap`."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap, self.live, self.peak = cap, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ref in [r for r in self.live if r.expired()]:
            del self.live[ref]
        for t in torch.utils._pytree.tree_leaves(out):
            # Plain tensors only: a DTensor or FakeTensor wrapper owns no memory of its own.
            if type(t) is torch.Tensor and not t.is_meta:
                self.live.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(self.live.values()))
        if self.peak > self.cap:
            raise MemoryError(f"{self.peak} bytes alive on this rank, over the cap of {self.cap} "
                              f"(after {func})")
        return out


@pytest.mark.parametrize("name", MODELS)
def test_replayed_values_equal_the_eagerly_built_model(name):
    ref, _ = build(name)
    rng_after = torch.get_rng_state()
    with autojigsaw.meta_init():
        model, _ = build(name)
    assert torch.equal(torch.get_rng_state(), rng_after)  # the stream goes on as on one device
    for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.is_meta
        expected = dict([*ref.named_parameters(), *ref.named_buffers()])[fqn]
        assert torch.equal(materialize(t), expected), fqn


def _sgd_steps(model, inputs, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss_of(model(*inputs)).backward()
        opt.step()
        opt.zero_grad()


def _parallelize_under_cap(name: str, plan: str, fraction: float) -> dict:
    """Peak live bytes of building (cap: `fraction` of the parameters) and training (cap:
    `fraction` of what training takes on one device) a meta-built model; its differences."""
    ref, inputs = build(name)
    full = sum(p.numel() * p.element_size() for p in ref.parameters())
    with LiveBytes(10 * full) as single:
        _sgd_steps(ref, inputs)
    with autojigsaw.meta_init():
        model, _ = build(name)
    mesh = get_mesh((dist.get_world_size(),), ("tensor",))
    with LiveBytes(int(fraction * full)) as building:
        pmodel = autojigsaw.parallelize(model, mesh, inputs, compile=False, plan=Plan.from_json(plan))
    with LiveBytes(int(fraction * single.peak)) as training:
        _sgd_steps(pmodel, inputs)
    params = max(max_diff(p.full_tensor(), q) for p, q in zip(pmodel.parameters(), ref.parameters()))
    return {"param": params, "full": full, "building": building.peak, "training": training.peak,
            "single_training": single.peak}


def test_meta_model_larger_than_the_cap_parallelizes_and_trains(ranks4):
    """GPT-2 over 4 ranks: no rank ever holds 60 % of the parameters, or 60 % of one device's training."""
    plan = plan_json("gpt2", {"tensor": 4}, 0.33)  # 1.28 MB
    for r in ranks4.run(_parallelize_under_cap, "gpt2", plan, 0.6):
        assert r["building"] <= 0.6 * r["full"] and r["training"] <= 0.6 * r["single_training"], r
        assert r["param"] <= 1e-12, r
