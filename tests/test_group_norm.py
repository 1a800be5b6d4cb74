"""GroupNorm sharded over the batch or over whole channel groups trains as on one device.

Its rule (strategies/rules/group_norm.py) runs a channel shard with the rank's own number of
groups: the captured call's count would split each local group again. Each case trains a
conv -> GroupNorm -> SiLU -> conv block beside the single-device one (outputs, gradients of
parameters and inputs, two Adam steps) on a 2x2 mesh, the norm pinned to one layout.
"""

from functools import partial

import pytest
import torch
from torch import nn

from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements
from autojigsaw.strategies.annotate import annotate

from .jigsaw_common import assert_matches, inputs_are, pinned_plan, seeded, train_side_by_side

MESH = {"domain": 2, "tensor": 2}
F64 = torch.float64


class _Block(nn.Module):
    def __init__(self, channels: int = 16, groups: int = 4):
        super().__init__()
        self.inp = nn.Conv2d(3, channels, 3, padding=1)
        self.norm = nn.GroupNorm(groups, channels)
        self.out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, x):
        return self.out(nn.functional.silu(self.norm(self.inp(x))))


X = torch.randn(3, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=F64)  # 3 samples: uneven batch shards

PINS = {
    "channels over both axes": ("S(1),S(1)", "S(0),S(0)", "S(0),S(0)"),  # 4 groups, 1 per rank
    "channels x samples": ("S(0),S(1)", "R,S(0)", "R,S(0)"),  # 2 groups per rank
    "samples": ("S(0),R", "R,R", "R,R"),
}


@pytest.mark.parametrize("pin", PINS.values(), ids=PINS.keys())
def test_group_norm_layouts_train_like_one_device(ranks4, pin):
    make = partial(seeded, _Block, F64)
    plan = pinned_plan(make(), (X,), MESH, {"group_norm": inputs_are(*pin)})
    results = ranks4.run(train_side_by_side, make, (X,), tuple(plan.mesh.sizes), plan.to_json())
    assert_matches(results, F64)  # with the captured group count, the channel layouts are off by O(1)


def test_channels_shard_only_in_whole_groups():
    def layouts(groups: int, mesh: dict) -> set[str]:
        captured = capture(_Block(channels=12, groups=groups), (X.float(),))
        annotate(captured.gm, MeshSpec.of(mesh))
        node = next(n for n in captured.gm.graph.nodes if n.name == "group_norm")
        return {format_placements(s.inputs[0]) for s in node.meta[STRATEGIES]}

    assert "S(1),S(1)" in layouts(4, MESH) and "S(1),S(1)" not in layouts(6, MESH)  # 6 groups: 1.5 per rank
    assert {"S(1),R", "R,S(1)"} <= layouts(6, MESH)  # 3 whole groups per rank on one axis
    assert not any("S(1)" in layout for layout in layouts(3, MESH))
