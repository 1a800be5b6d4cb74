"""Domain parallelism of convolutional networks: stencils with halos (3x3, dilated, strided; 2-D and
3-D), GroupNorm and InstanceNorm over sharded points, pooling and nearest upsampling of whole
windows, on 1-D and 2-D meshes: a U-Net, a volume stack and an nnU-Net stage; and the edges of
those idioms: transposed convolutions with output padding or kernels narrower than their stride,
pooling in ceil mode, bilinear resampling with aligned corners or to any size, global and pyramid
average pooling.

Each case trains the parallelized model beside the single-device one (same seed and input:
output, gradients of parameters and input, two Adam steps) and checks that every rank sent
exactly the bytes the rewritten graph predicts.
"""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autojigsaw
from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.strategies.annotate import annotate
from autojigsaw.testing.local_ranks import get_mesh

from .jigsaw_common import assert_matches, pinned_plan, rows_plan, seeded, train_side_by_side
from .side_by_side import build, train

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


def _plan_sharded(make, x, mesh: dict, layout: str, prefixes: tuple[str, ...]):
    """(plan of make() on `mesh`, names): every node whose name starts with one of `prefixes` pinned to take
    its first input in `layout` ("S(2),S(3)"); their names in graph order."""
    names = [n.name for n in capture(make(), (x,)).gm.graph.nodes if n.name.startswith(prefixes)]
    pins = {name: (lambda s: format_placements(s.inputs[0]) == layout) for name in names}
    return pinned_plan(make(), (x,), mesh, pins), names


@pytest.mark.parametrize("mesh, shape, layout", [
    ({"domain": 4}, (1, 3, 16, 6), "S(2)"),  # 4 rows per rank, edge and inner; the dilated conv's halo is 2 of 2
    ({"domain": 2, "tensor": 2}, (2, 3, 8, 12), "S(2),S(3)"),  # rows and columns: halos with corners
], ids=["rows-4", "rows-columns-2x2"])
def test_unet_trains_like_one_device_with_its_points_sharded(ranks4, mesh, shape, layout):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, UNet, F64)
    plan, _ = _plan_sharded(make, x, mesh, layout, _SPATIAL_OPS)
    kernels = {n.name: n.kernel for n in plan.nodes}
    assert {kernels[f"conv2d{i}"] for i in ("", "_1", "_2", "_3", "_4", "_5")} == {"halo_conv"}, kernels
    assert {kernels[f"group_norm{i}"] for i in ("", "_1", "_2")} == {"sharded_group_norm"}, kernels
    assert kernels["upsample_nearest2d"] == "local_upsample", kernels
    assert format_placements(plan.node("max_pool2d").outputs[0]) == layout
    results = ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json())
    assert_matches(results, F64)


def _halo_layouts(module: nn.Module, shape, mesh: dict, op: str = "conv", kernel: str = "halo_conv") -> set[str]:
    """The layouts of x among the `kernel` strategies offered to `module`'s first `op` node on `mesh`."""
    captured = capture(module, (torch.empty(shape),))
    annotate(captured.gm, MeshSpec.of(mesh))
    node = next(n for n in captured.gm.graph.nodes if n.name.startswith(op))
    return {format_placements(s.inputs[0]) for s in node.meta[STRATEGIES] if s.kernel == kernel}


def test_any_convolution_shards_its_rows_but_where_a_rank_would_hold_none():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    assert _halo_layouts(conv, (1, 2, 4, 4), {"domain": 2}) == {"S(2)", "S(3)"}
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding="same"), (1, 2, 4, 4), {"domain": 2}) == {"S(2)", "S(3)"}
    # 5 rows over 4 ranks: 2, 2, 1, 0 -- the last would hold none
    assert _halo_layouts(conv, (1, 2, 5, 8), {"domain": 4}) == {"S(3)"}
    # a halo wider than a chunk (dilation 2: 2 rows past a 1-row chunk), strided, unpadded: all fetched
    assert _halo_layouts(nn.Conv2d(2, 2, 3, padding=2, dilation=2), (1, 2, 4, 8), {"domain": 4}) == {"S(2)", "S(3)"}
    assert _halo_layouts(nn.Conv2d(2, 2, 3, stride=2, padding=1), (1, 2, 8, 14), {"domain": 4}) == {"S(2)", "S(3)"}
    assert _halo_layouts(nn.Conv2d(2, 2, 3), (1, 2, 8, 8), {"domain": 2}) == {"S(2)", "S(3)"}
    # the rows of one dim over two axes (a neighbour across both), or whole patches (the patch rule's)
    assert "S(2),S(2)" not in _halo_layouts(conv, (1, 2, 8, 8), {"a": 2, "b": 2})
    assert not _halo_layouts(nn.Conv2d(2, 2, 2, stride=2), (1, 2, 8, 8), {"domain": 2})
    # "same" with an even kernel pads one side more: not offered
    assert not _halo_layouts(nn.Conv2d(2, 2, (3, 2), padding="same"), (1, 2, 8, 8), {"domain": 2})


class Signal(nn.Module):
    """1-D convolutions whose windows do not line up with the shards: a dilated kernel reaching past a
    whole chunk, a strided unpadded one, and one that shrinks the signal."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Conv1d(2, 3, 5, padding=4, dilation=2)
        self.down = nn.Conv1d(3, 3, 3, stride=2)
        self.valid = nn.Conv1d(3, 2, 2)

    def forward(self, x):
        return self.valid(torch.tanh(self.down(torch.tanh(self.wide(x)))))


def test_misaligned_windows_fetch_the_rows_they_read(ranks4):
    x = torch.randn(2, 2, 23, generator=torch.Generator().manual_seed(1), dtype=F64)  # 6, 6, 6, 5 points
    make = partial(seeded, Signal, F64)
    plan, names = _plan_sharded(make, x, {"domain": 4}, "S(2)", ("conv1d",))
    assert [plan.node(n).kernel for n in names] == ["halo_conv"] * 3, names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), (4,), plan.to_json()), F64)


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
    plan, names = _plan_sharded(make, x, {"domain": 2}, "S(2)", ("conv", "group_norm", "max_pool", "upsample"))
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
    plan, names = _plan_sharded(make, x, mesh, layout, ("conv3d", "instance_norm"))
    kernels = [plan.node(n).kernel for n in names]
    assert kernels == ["halo_conv", "sharded_group_norm"] * 3 + ["local"], list(zip(names, kernels))
    assert_matches(ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json()), F64)


class Stem(nn.Module):
    """A ResNet stem: a 7x7 stride-2 convolution, then a 3x3 stride-2 max pool with padding 1, then a
    padded 3x3 average pool that counts its padding."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 7, stride=2, padding=3)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.smooth = nn.AvgPool2d(3, stride=1, padding=1)

    def forward(self, x):
        return self.smooth(self.pool(torch.tanh(self.conv(x) - 1)))  # mostly negative: padding must be -inf


class CeilPools(nn.Module):
    """Pooling in ceil mode (GoogLeNet, Inception): a max pool whose last window runs past the rows
    (14 -> 7), then an average pool whose last window ends in its padding (7 -> 4)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.smooth = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)

    def forward(self, x):
        return self.smooth(self.pool(torch.tanh(self.conv(x) - 1)))  # mostly negative: past the end must be -inf


@pytest.mark.parametrize("model, rows", [(Stem, 32), (CeilPools, 14)], ids=["stem", "ceil-mode"])
def test_overlapping_pooling_windows_fetch_their_rows_padded_as_the_pool_pads(ranks4, model, rows):
    x = torch.randn(1, 3, rows, 8, generator=torch.Generator().manual_seed(1), dtype=F64)  # stem: 32 -> 16 -> 8
    make = partial(seeded, model, F64)
    plan, names = _plan_sharded(make, x, {"domain": 4}, "S(2)", ("conv2d", "max_pool2d", "avg_pool2d"))
    assert [plan.node(n).kernel for n in names] == ["halo_conv", "halo_pool", "halo_pool"], names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), (4,), plan.to_json()), F64)


class Classifier(nn.Module):
    """A ResNet's head: global average pooling of the last feature map, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(self.pool(torch.tanh(self.conv(x))).flatten(1))


def test_global_average_pooling_sums_each_ranks_share_instead_of_gathering_the_map(ranks4):
    x = torch.randn(2, 2, 7, 5, generator=torch.Generator().manual_seed(1), dtype=F64)  # 4 + 3 rows, 3 + 2 columns
    make = partial(seeded, Classifier, F64)
    plan, names = _plan_sharded(make, x, {"domain": 2, "tensor": 2}, "S(2),S(3)", ("conv2d", "adaptive_avg_pool2d"))
    assert [plan.node(n).kernel for n in names] == ["halo_conv", "partial_mean_pool"], names
    assert format_placements(plan.node("adaptive_avg_pool2d").outputs[0]) == "P(sum),P(sum)"
    assert_matches(ranks4.run(train_side_by_side, make, (x,), (2, 2), plan.to_json()), F64)


class PyramidPooling(nn.Module):
    """PSPNet's pyramid pooling (segmentation): the feature map averaged to 1x1, 2x2, 3x3 and 6x6 over
    windows of varying size (13 rows to 6: 3 rows each, overlapping by one where 13 does not divide),
    each projected and resized back with align_corners=True, concatenated with the map."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pools = nn.ModuleList(nn.Sequential(nn.AdaptiveAvgPool2d(k), nn.Conv2d(4, 1, 1)) for k in (1, 2, 3, 6))

    def forward(self, x):
        x = torch.tanh(self.conv(x))
        size = x.shape[-2:]
        return torch.cat([x] + [F.interpolate(p(x), size=size, mode="bilinear", align_corners=True)
                                for p in self.pools], 1)


def test_pyramid_pooling_averages_windows_of_varying_size_over_sharded_rows(ranks4):
    x = torch.randn(1, 2, 13, 10, generator=torch.Generator().manual_seed(1), dtype=F64)  # rows 7 + 6, columns 5 + 5
    make = partial(seeded, PyramidPooling, F64)
    plan, names = _plan_sharded(make, x, {"domain": 2, "tensor": 2}, "S(2),S(3)", ("adaptive_avg_pool2d",))
    assert [plan.node(n).kernel for n in names] == ["partial_mean_pool"] + ["halo_adaptive_pool"] * 3, names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), (2, 2), plan.to_json()), F64)


def test_an_average_whose_last_window_runs_past_its_padding_keeps_that_dim_whole():
    """In ceil mode a window past the padding divides by the rows inside it: fetched zeros would count."""
    shape, mesh = (1, 2, 8, 9), {"domain": 2}  # rows: the last window is 6..8 of 8; columns: 6..8 of 9
    assert _halo_layouts(nn.AvgPool2d(3, stride=2, ceil_mode=True), shape, mesh, "avg_pool", "halo_pool") == {"S(3)"}
    assert _halo_layouts(nn.MaxPool2d(3, stride=2, ceil_mode=True), shape, mesh, "max_pool", "halo_pool") == {
        "S(2)", "S(3)"}


class PeriodicCNN(nn.Module):
    """A weather CNN on a latitude x longitude grid: longitude wraps around (circular padding, then an
    unpadded convolution on it); a Conv2d with padding_mode="circular"; reflect, replicate and
    constant padding (with a crop) as image models write them."""

    def __init__(self):
        super().__init__()
        self.periodic = nn.Conv2d(3, 4, 3, padding=(1, 0))
        self.torus = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.mirror = nn.Conv2d(4, 2, 5)

    def forward(self, x):
        x = torch.tanh(self.periodic(F.pad(x, (1, 1, 0, 0), mode="circular")))
        x = torch.tanh(self.torus(x))
        x = self.mirror(F.pad(x, (2, 2, 2, 2), mode="reflect"))
        return F.pad(F.pad(x, (1, 1, 1, 1), mode="replicate"), (-1, 2, 1, -1), value=0.5)


@pytest.mark.parametrize("mesh, layout", [({"domain": 4}, "S(3)"), ({"domain": 2, "tensor": 2}, "S(2),S(3)")],
                         ids=["longitude-4", "latitude-longitude-2x2"])
def test_periodic_and_mirrored_padding_fetch_the_rows_they_copy(ranks4, mesh, layout):
    x = torch.randn(1, 3, 10, 16, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, PeriodicCNN, F64)
    plan, names = _plan_sharded(make, x, mesh, layout, ("pad", "conv2d"))
    kernels = {plan.node(n).kernel for n in names}
    assert kernels == {"halo_pad", "halo_conv"}, [(n, plan.node(n).kernel) for n in names]
    assert_matches(ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json()), F64)


class Decoder(nn.Module):
    """Upsampling as decoders write it: nearest by 2 on sizes whose chunks do not line up (10 rows over 4
    ranks: 3, 3, 3, 1, and 20 output rows: 5 each; 5 columns over 2: 3 + 2, and 10: 5 + 5), bilinear, and
    the transposed convolutions of GAN and VAE decoders (4x4 stride 2 padding 1; 3x3 stride 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.up = nn.ConvTranspose2d(3, 3, 4, stride=2, padding=1)
        self.smooth = nn.ConvTranspose2d(3, 2, 3, padding=1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        x = F.interpolate(torch.tanh(self.conv(x)), scale_factor=2.0, mode="bilinear")
        return self.smooth(torch.tanh(self.up(x)))


@pytest.mark.parametrize("mesh, layout", [({"domain": 4}, "S(2)"), ({"domain": 2, "tensor": 2}, "S(2),S(3)")],
                         ids=["rows-4", "rows-columns-2x2"])
def test_upsampling_and_transposed_convolutions_fetch_their_rows(ranks4, mesh, layout):
    x = torch.randn(1, 2, 10, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, Decoder, F64)
    plan, names = _plan_sharded(make, x, mesh, layout, ("upsample", "conv"))
    assert [plan.node(n).kernel for n in names] == ["halo_resample", "halo_conv"] * 2 + ["halo_conv"], names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json()), F64)


class Upsampler(nn.Module):
    """Transposed convolutions that reach past the input's scatter: CycleGAN's and many VAE decoders'
    3x3 stride 2 padding 1 with output padding 1 (the last row is reached by one input row only), and
    kernels narrower than their stride (1 and 2 rows, stride 3: rows no input reaches hold the bias
    alone; output padding 2 adds two of them at the end)."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1)
        self.sparse = nn.ConvTranspose2d(3, 2, (1, 3), stride=(3, 1), padding=(0, 1))
        self.tail = nn.ConvTranspose2d(2, 2, (2, 1), stride=(3, 1), output_padding=(2, 0))

    def forward(self, x):
        return self.tail(torch.tanh(self.sparse(torch.tanh(self.up(x)))))


def test_transposed_convolutions_with_output_padding_or_narrow_kernels_fetch_their_rows(ranks4):
    x = torch.randn(1, 2, 7, 3, generator=torch.Generator().manual_seed(1), dtype=F64)  # 2, 2, 2, 1 rows
    make = partial(seeded, Upsampler, F64)
    plan, names = _plan_sharded(make, x, {"domain": 4}, "S(2)", ("conv_transpose",))
    assert [plan.node(n).kernel for n in names] == ["halo_conv"] * 3, names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), (4,), plan.to_json()), F64)


class CornerAligned(nn.Module):
    """Bilinear resampling with align_corners=True, as the most used PyTorch U-Net writes its decoder:
    up by 2 (source rows at i x 9 / 19), to a size no power of two relates (20 x 10 -> 13 x 7), and
    back up to a skip's size."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=True)
        x = F.interpolate(torch.tanh(self.conv(x)), size=(13, 7), mode="bilinear", align_corners=True)
        return F.interpolate(x, size=(20, 10), mode="bilinear", align_corners=True)


class AnySize(nn.Module):
    """Bilinear resampling without aligned corners to sizes no power of two relates, as UperNet resizes
    its pyramid to the feature map: up to 13 x 7, by a scale factor of 1.5 (source rows at
    (i + 0.5) / 1.5 - 0.5), and down to 8 x 4; with UperNet's dropout before the last."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        x = F.interpolate(x, size=(13, 7), mode="bilinear", align_corners=False)
        x = F.interpolate(torch.tanh(self.conv(x)), scale_factor=1.5, mode="bilinear", align_corners=False)
        x = self.dropout(x)
        return F.interpolate(x, size=(8, 4), mode="bilinear", align_corners=False)


@pytest.mark.parametrize("model", [CornerAligned, AnySize], ids=["aligned-corners", "any-size"])
@pytest.mark.parametrize("mesh, layout", [({"domain": 4}, "S(2)"), ({"domain": 2, "tensor": 2}, "S(2),S(3)")],
                         ids=["rows-4", "rows-columns-2x2"])
def test_linear_resampling_fetches_its_rows(ranks4, model, mesh, layout):
    x = torch.randn(1, 2, 10, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, model, F64)
    plan, names = _plan_sharded(make, x, mesh, layout, ("upsample",))
    assert [plan.node(n).kernel for n in names] == ["halo_resample"] * 3, names
    assert_matches(ranks4.run(train_side_by_side, make, (x,), tuple(plan.mesh.sizes), plan.to_json()), F64)


def compiled_step(make, x, plan_json: str) -> float:
    """Largest difference of the output and gradients between the compiled parallel model and one device."""
    ref = make()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("domain",)), (x,), compile=True,
                                    plan=autojigsaw.Plan.from_json(plan_json))
    out = pmodel(x)
    out.square().sum().backward()
    ref_out = ref(x)
    ref_out.square().sum().backward()
    diffs = [(out.full_tensor() if hasattr(out, "full_tensor") else out).sub(ref_out).abs().max().item()]
    diffs += [p.grad.full_tensor().sub(q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters())]
    return max(diffs)


def test_compiled_halos_on_uneven_shards_keep_every_rank_in_step(ranks2):
    """torch.compile's partitioner moves backward work that does not depend on the gradients into the
    forward. With uneven shards one rank's backward block can be all padding: if that padding were a
    constant, its collective would move on that rank only, and the ranks would exchange mismatched
    buffers (a gloo abort, or gradients 1e7 off)."""
    x = torch.randn(1, 2, 7, generator=torch.Generator().manual_seed(1), dtype=F64)  # 4 + 3 points
    make = partial(seeded, Signal, F64)
    plan, _ = _plan_sharded(make, x, {"domain": 2}, "S(2)", ("conv1d",))
    assert max(ranks2.run(compiled_step, make, x, plan.to_json(), timeout=600)) <= 1e-10


class BatchNormBlock(nn.Module):
    """A classic U-Net/ResNet block: 3x3 convolutions with BatchNorm (running averages updated), ReLU."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                 nn.Conv2d(4, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2, momentum=0.3))

    def forward(self, x):
        return self.net(x)


def batch_norm_steps(make, x, mesh_shape, plan_json: str) -> dict:
    """Two SGD steps beside one device: largest differences of outputs, gradients and running averages; the
    bytes the first step sent, counted and predicted, and the number of all-reduces in its forward."""
    plan = autojigsaw.Plan.from_json(plan_json)
    ref = make()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(mesh_shape, plan.mesh.axis_names), (x,), plan=plan,
                                    compile=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pmodel, ref)]
    diffs = dict.fromkeys(("output", "grad", "running"), 0.0)
    traffic = {}
    for step in range(2):
        with count_comm() as forward:
            out = pmodel(x)
        ref_out = ref(x)
        with count_comm() as rest:
            whole = out.full_tensor() if hasattr(out, "full_tensor") else out
            diffs["output"] = max(diffs["output"], whole.sub(ref_out).abs().max().item())
            ramp = torch.linspace(0, 1, whole.numel(), dtype=whole.dtype).view(whole.shape)
            (whole * ramp).sum().backward()
        (ref_out * ramp).sum().backward()
        if step == 0:
            program = pmodel.program
            predicted = traffic_by_origin(program.graph, program.rank, set(program.captured.params), True)
            traffic = {"counted": forward.total_bytes + rest.total_bytes, "predicted": sum(predicted.values()),
                       "forward all-reduces": forward.count("all_reduce")}
        for p, q in zip(pmodel.parameters(), ref.parameters()):
            diffs["grad"] = max(diffs["grad"], p.grad.full_tensor().sub(q.grad).abs().max().item())
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, b), q in zip(pmodel.named_buffers(), ref.buffers()):
        if b.is_floating_point():
            b = b.full_tensor() if hasattr(b, "full_tensor") else b
            diffs["running"] = max(diffs["running"], b.sub(q).abs().max().item())
    return diffs, traffic


@pytest.mark.parametrize("mesh, layout", [({"domain": 4}, "S(2)"), ({"data": 2, "domain": 2}, "S(0),S(2)")],
                         ids=["rows-4", "samples-rows-2x2"])
def test_batch_norm_sums_its_statistics_over_the_ranks_that_shard_its_points(ranks4, mesh, layout):
    x = torch.randn(4, 2, 8, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    make = partial(seeded, BatchNormBlock, F64)
    plan, names = _plan_sharded(make, x, mesh, layout, ("conv2d", "_native"))
    assert {plan.node(n).kernel for n in names if n.startswith("_native")} == {"sharded_batch_norm"}
    for r, traffic in ranks4.run(batch_norm_steps, make, x, tuple(mesh.values()), plan.to_json()):
        assert max(r.values()) <= 1e-10, r
        assert traffic["counted"] == traffic["predicted"], traffic
        # mean and variance of each of the 2 BatchNorms, once per axis that shards its points: the running
        # averages reuse them (they were all-reduced again for those: twice as many)
        assert traffic["forward all-reduces"] == 2 * 2 * len(layout.split(",")), traffic


@pytest.mark.parametrize("name", ["resnet", "convnextv2"])
def test_vision_models_from_transformers_train_with_their_images_split(ranks4, name):
    """Unmodified Hugging Face ResNet and ConvNeXt V2, every convolution that can with its input's rows split
    over 4 ranks: outputs, gradients and two Adam steps as on one device."""
    model, inputs = build(name)
    plan = rows_plan(model, inputs, {"domain": 4})
    assert "halo_conv" in {n.kernel for n in plan.nodes}
    for r in ranks4.run(train, name, (4,), ("domain",), plan.to_json(), steps=2):
        assert max(r["output"], r["grad"], r["param"]) <= 1e-10, r["table"]
