"""A "data" mesh axis is pure data parallelism, composed with domain and tensor axes, and FSDP2.

The data axis shards the batch of every input and never a weight; the weights' gradients are
all-reduced over it. Training on 3-D ("data", "domain", "tensor") meshes, and with FSDP2's
`fully_shard` then sharding the weights over the data axis, must equal the single-device model.
"""

import pytest
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw import Plan

from .side_by_side import build, plan_json, train

AXES = ("data", "domain", "tensor")


def _data_parallel(plan: Plan) -> bool:
    """Batch sharded over "data", every weight whole over it, some weight sharded elsewhere."""
    return (all(pl[0] == Shard(0) for pl in plan.input_placements)
            and all(pl[0] == Replicate() for pl in plan.param_placements.values())
            and any(p != Replicate() for pl in plan.param_placements.values() for p in pl[1:]))


def test_a_batch_smaller_than_the_data_axis_is_refused():
    model, inputs = build("mixer")
    with pytest.raises(ValueError, match="batch of 2 is smaller than the 4 ranks of data axis 'data'"):
        autojigsaw.plan(model, inputs, {"data": 4}, device="cpu")


@pytest.mark.parametrize("name,mesh,fsdp", [("mixer", (2, 1, 2), False), ("mixer", (2, 2, 1), True),
                                            ("gpt2", (2, 1, 2), True)])
def test_3d_mesh_trains_like_single_device(ranks4, name, mesh, fsdp):
    plan = plan_json(name, dict(zip(AXES, mesh)), 0.5 if not fsdp else 0.3, data_parallel="fsdp" if fsdp else "ddp")
    assert _data_parallel(Plan.from_json(plan))
    for r in ranks4.run(train, name, mesh, AXES, plan, steps=3, fsdp=fsdp):
        if fsdp:  # FSDP2 sharded every weight over the data axis
            assert r["whole_over_first_axis"] == 0, r
        for key in ("output", "grad", "param"):
            assert r[key] <= 1e-10, (key, r[key])
