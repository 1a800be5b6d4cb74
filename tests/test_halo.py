"""Domain parallelism of convolutional networks: stencils with halos (3x3, dilated, strided; 2-D and
3-D), GroupNorm and InstanceNorm over sharded points, pooling and nearest upsampling of whole
windows, on 1-D and 2-D meshes: a U-Net, a volume stack and an nnU-Net stage.

Each case trains the parallelized model beside the single-device one (same seed and input:
output, gradients of parameters and input, two Adam steps) and checks that every rank sent
exactly the bytes the rewritten graph predicts.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements
from autojigsaw.strategies.annotate import annotate

from .jigsaw_common import assert_matches, pinned_plan, seeded, train_side_by_side

F64 = torch.float64
_SPATIAL_OPS = ("conv2d", "group_norm", "max_pool2d", "upsample_nearest2d", "silu", "cat", "add")


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, dilation: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(2, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=dilation, dilation=dilation)

    def forward(self, x):
        return F.silu(self.conv2(F.silu(self.norm(self.conv1(x)))))


class UNet(nn.Module):
    """One level down and up, a skip concatenated: the shape of medical and satellite segmenters."""

    def __init__(self):
        super().__init__()
        self.down = Block(3, 8)
        self.middle = Block(8, 8, dilation=2)
        self.up = Block(16, 8)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        skip = self.down(x)
        deep = self.middle(F.max_pool2d(skip, 2))
        return self.head(self.up(torch.cat([skip, F.interpolate(deep, scale_factor=2.0)], 1)))


def _spatial_pins(model, x, layout: str) -> dict:
    """Every node of the U-Net's spatial ops pinned to take its first input in `layout` ("S(2),S(3)")."""
    names = [n.name for n in capture(model, (x,)).gm.graph.nodes if n.name.startswith(_SPATIAL_OPS)]
    return {name: (lambda s: format_placements(s.inputs[0]) == layout) for name in names}


@pytest.mark.parametrize("mesh, shape, layout", [
    ({"domain": 4}, (1, 3, 16, 6), "S(2)"),  # 4 rows per rank, edge and inner; the dilated conv's halo is 2 of 2
    ({"domain": 2, "tensor": 2}, (2, 3, 8, 12), "S(2),S(3)"),  # rows and columns: halos with corners
], ids=["rows-4", "rows-columns-2x2"])
def test_unet_trains_like_one_device_with_its_points_sharded(ranks4, mesh, shape, layout):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, UNet, F64)
    plan = pinned_plan(make(), (x,), mesh, _spatial_pins(make(), x, layout))
    kernels = {n.name: n.kernel for n in plan.nodes}
    assert {kernels[f"conv2d{i}"] for i in ("", "_1", "_2", "_3", "_4", "_5")} == {"halo_conv"}, kernels
    assert {kernels[f"group_norm{i}"] for i in ("", "_1", "_2")} == {"sharded_group_norm"}, kernels
    assert kernels["upsample_nearest2d"] == "local_upsample", kernels
    assert format_placements(plan.node("max_pool2d").outputs[0]) == layout
    results = ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json())
    assert_matches(results, F64)


def _halo_layouts(conv: nn.Module, shape, mesh: dict) -> set[str]:
    """The layouts of x among the halo_conv strategies the conv rule offers `conv` on `mesh`."""
    captured = capture(conv, (torch.empty(shape),))
    annotate(captured.gm, MeshSpec.of(mesh))
    node = next(n for n in captured.gm.graph.nodes if n.name.startswith("conv"))
    return {format_placements(s.inputs[0]) for s in node.meta[STRATEGIES] if s.kernel == "halo_conv"}


def test_halos_only_where_each_rank_holds_the_rows_its_neighbours_need():
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 4, 4), {"domain": 2}) == {"S(2)", "S(3)"}
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding="same"), (1, 2, 4, 4), {"domain": 2}) == {"S(2)", "S(3)"}
    # 5 rows over 4 ranks: 2, 2, 1, 0 -- the last holds none
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 5, 8), {"domain": 4}) == {"S(3)"}
    # a halo of 2 (dilation 2) and 2 columns per rank; not 1 row per rank
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding=2, dilation=2), (1, 2, 4, 8), {"domain": 4}) == {"S(3)"}
    # the rows of one dim over two axes: a neighbour across both axes, not offered
    assert "S(2),S(2)" not in _halo_layouts(nn.Conv2d(2, 2, 3, padding=1), (1, 2, 8, 8), {"a": 2, "b": 2})
    # strided over whole strides: 8 rows -> 4, 4 + 4 -> 2 + 2; not 12 columns over 4 ranks (3 each; 6 -> 2, 2, 2, 0)
    assert _halo_layouts(nn.Conv2d(2, 2, 3, stride=2, padding=1), (1, 2, 8, 12), {"domain": 2}) == {"S(2)", "S(3)"}
    assert _halo_layouts(nn.Conv2d(2, 2, 3, stride=2, padding=1), (1, 2, 8, 12), {"domain": 4}) == {"S(2)"}
    # unpadded (the output shrinks), or whole patches (the patch rule's, with no halo)
    assert not _halo_layouts(nn.Conv2d(2, 2, 3), (1, 2, 8, 8), {"domain": 2})
    assert not _halo_layouts(nn.Conv2d(2, 2, 2, stride=2), (1, 2, 8, 8), {"domain": 2})
    assert _halo_layouts(nn.Conv2d(2, 2, (3, 2), padding=(1, 0)), (1, 2, 8, 8), {"domain": 2}) == {"S(2)"}
    # "same" with an even kernel pads one side more: no halo on either dim
    assert not _halo_layouts(nn.Conv2d(2, 2, (3, 2), padding="same"), (1, 2, 8, 8), {"domain": 2})


class Volume(nn.Module):
    """A 3-D stencil stack (CT and MRI volumes): depth sharded."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.MaxPool3d(2),
                                 nn.Upsample(scale_factor=2.0), nn.Conv3d(4, 2, 3, padding="same"))

    def forward(self, x):
        return self.net(x)


def test_volume_trains_like_one_device_with_its_depth_sharded(ranks2):
    x = torch.randn(1, 2, 8, 4, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, Volume, F64)
    names = [n.name for n in capture(make(), (x,)).gm.graph.nodes if n.name.startswith(("conv", "group_norm",
                                                                                          "max_pool", "upsample"))]
    plan = pinned_plan(make(), (x,), {"domain": 2}, {n: (lambda s: format_placements(s.inputs[0]) == "S(2)")
                                                     for n in names})
    assert [plan.node(n).kernel for n in names] == ["halo_conv", "sharded_group_norm", "local", "local_upsample",
                                                     "halo_conv"], names
    assert_matches(ranks2.run(train_side_by_side, make, (x,), (2,), plan.to_json()), F64)


class NnUNet(nn.Module):
    """nnU-Net's 3-D stage: 3x3x3 stencils, InstanceNorm, LeakyReLU, a stride-2 3x3x3 convolution down,
    a transposed 2x2x2 convolution up, a skip concatenated. The convolutions before a norm have no
    bias: its gradient is zero but for roundoff (1e-14), which Adam's first step divides by eps."""

    def __init__(self):
        super().__init__()

        def stage(cin, cout, stride):
            return nn.Sequential(nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 nn.InstanceNorm3d(cout, affine=True),
                                 nn.LeakyReLU(0.01))

        self.encode, self.down, self.up = stage(1, 4, 1), stage(4, 8, 2), nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.decode, self.head = stage(8, 4, 1), nn.Conv3d(4, 2, 1)

    def forward(self, x):
        skip = self.encode(x)
        return self.head(self.decode(torch.cat([skip, self.up(self.down(skip))], 1)))


@pytest.mark.parametrize("mesh, shape, layout", [
    ({"domain": 4}, (1, 1, 16, 4, 6), "S(2)"),  # depth: 4 slices per rank, 2 after the strided convolution
    ({"domain": 2, "tensor": 2}, (1, 1, 8, 8, 4), "S(2),S(3)"),  # depth and height: strided halos with corners
], ids=["depth-4", "depth-height-2x2"])
def test_nnunet_trains_like_one_device_with_its_volume_sharded(ranks4, mesh, shape, layout):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, NnUNet, F64)
    names = [n.name for n in capture(make(), (x,)).gm.graph.nodes if n.name.startswith(("conv3d", "instance_norm"))]
    plan = pinned_plan(make(), (x,), mesh, {n: (lambda s: format_placements(s.inputs[0]) == layout) for n in names})
    kernels = [plan.node(n).kernel for n in names]
    assert kernels == ["halo_conv", "sharded_group_norm"] * 3 + ["local"], list(zip(names, kernels))
    assert_matches(ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json()), F64)
