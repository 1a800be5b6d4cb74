"""Domain parallelism end to end: each sharded op alone, then the weather mixer on 1x2, 2x1, 2x2.

Every case trains the parallelized model beside the single-device one (same seed and input:
output, gradients of parameters and inputs, two Adam steps) and checks that every rank sent
exactly the bytes the rewritten graph predicts. Sizes do not divide by the mesh axes.
"""

from functools import partial

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw.ir import STRATEGIES
from autojigsaw.kernels.patch_gemm import patch_conv, patch_conv_transpose
from autojigsaw.strategies.annotate import annotate
from autojigsaw.capture import capture
from autojigsaw.mesh import MeshSpec
from autojigsaw.placements import format_placements

from .jigsaw_common import (WeatherMixer, assert_matches, inputs_are, jigsaw_weathermixer, outputs_are,
                            pinned_plan, seeded, train_side_by_side)

MESH = {"domain": 2, "tensor": 2}
F64 = torch.float64
R = Replicate()


def _randn(*shape, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=dtype)


def _strategies(module, x, name: str):
    """The strategies the rules offer the first node of `module` on x whose name starts with `name`."""
    captured = capture(module, (x,))
    annotate(captured.gm, MeshSpec.of(MESH))
    return next(n for n in captured.gm.graph.nodes if n.name.startswith(name)).meta[STRATEGIES]


def _run(pool, make, inputs, plan, dtype=F64, kernel=None):
    results = pool.run(train_side_by_side, make, inputs, tuple(plan.mesh.sizes), plan.to_json())
    assert_matches(results, dtype)
    if kernel is not None:
        assert all(kernel in r["kernels"] for r in results), (kernel, results[0]["kernels"])
    return results


# ---------------------------------------------------------------- conv2d: patch embeddings


class Embed(nn.Module):
    def __init__(self, channels=4, dim=6, patch=2):
        super().__init__()
        self.conv = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x):
        return self.conv(x)


CONV_PINS = [
    ("S(0),R", "R,S(0)", "R,S(0)"),  # batch x out channels
    ("S(2),S(1)", "R,S(1)", "R,P(sum)"),  # latitude patches x in channels
    ("S(2),S(2)", "R,R", "R,R"),  # latitude patches over both axes: 4 patch rows, 1 per rank
]


@pytest.mark.parametrize("pin", CONV_PINS, ids=["batch-out", "patches-in", "patches-2d"])
def test_conv2d_strategies(ranks4, pin):
    x = _randn(2, 5, 8, 6)  # 5 channels and 6 // 2 = 3 patch columns do not divide by 2
    make = partial(seeded, Embed, F64, channels=5, dim=7)
    plan = pinned_plan(make(), (x,), MESH, {"conv2d": inputs_are(*pin)})
    _run(ranks4, make, (x,), plan)


def test_conv2d_shards_only_whole_patches():
    """3 patch columns over 2 ranks: torch.chunk splits 6 pixels 3 + 3, not on a patch boundary."""
    x_layouts = {format_placements(s.inputs[0]) for s in _strategies(Embed(), torch.empty(2, 4, 8, 6), "conv2d")}
    assert "S(2),R" in x_layouts and "S(2),S(2)" in x_layouts  # 4 patch rows: 2 + 2, 1 + 1 + 1 + 1
    assert not any("S(3)" in layout for layout in x_layouts)


# ---------------------------------------------------------------- 1-D patches and their recovery


class Patches1D(nn.Module):
    """The Jigsaw paper's patching: a strided Conv1d in, a strided ConvTranspose1d back out."""

    def __init__(self, channels=3, dim=5, patch=4):
        super().__init__()
        self.embed = nn.Conv1d(channels, dim, patch, stride=patch)
        self.recover = nn.ConvTranspose1d(dim, channels, patch, stride=patch)

    def forward(self, x):
        return self.recover(nn.functional.gelu(self.embed(x)))


PATCH_1D_PINS = {  # (conv1d's inputs, conv_transpose1d's inputs); 5 channels split 3 + 2
    "patches-2d": (("S(2),S(2)", "R,R", "R,R"), ("S(2),S(2)", "R,R", "R,R")),
    "patches-out-in": (("S(2),R", "R,S(0)", "R,S(0)"), ("S(2),S(1)", "R,S(0)", "R,P(sum)")),
    "batch-out": (("S(0),R", "R,R", "R,R"), ("S(0),R", "R,S(1)", "R,S(0)")),
}


def _running(kernel: str, pin):
    """A pin that also names the kernel: the convolution itself ("local") or "patch_gemm"."""
    return lambda s: pin(s) and s.kernel == kernel


@pytest.mark.parametrize("kernel", ["local", "patch_gemm"])
@pytest.mark.parametrize("case", PATCH_1D_PINS)
def test_1d_patch_embedding_and_transposed_recovery(ranks4, case, kernel):
    embed, recover = PATCH_1D_PINS[case]
    x = _randn(2, 3, 32)  # 8 patches of 4: 2 per rank over both axes
    make = partial(seeded, Patches1D, F64)
    plan = pinned_plan(make(), (x,), MESH, {"conv1d": _running(kernel, inputs_are(*embed)),
                                            "conv_transpose1d": _running(kernel, inputs_are(*recover))})
    _run(ranks4, make, (x,), plan, kernel=None if kernel == "local" else "patch_conv")


def test_patch_gemm_is_offered_for_whole_patches_only():
    """Whole, ungrouped patches: the convolution and the GEMM, with the same layouts; a sliding,
    a grouped or a remainder-dropping convolution: the convolution alone (with halos, when sliding)."""
    def kernels(conv, x):
        by_kernel = {}
        for s in _strategies(conv, x, "conv"):
            by_kernel.setdefault(s.kernel, set()).add((s.inputs, s.outputs))
        return by_kernel

    whole = kernels(nn.Conv2d(4, 6, 2, stride=2), torch.empty(2, 4, 8, 6))
    assert set(whole) == {"local", "patch_gemm"} and whole["local"] == whole["patch_gemm"]
    assert set(kernels(nn.ConvTranspose1d(4, 6, 3, stride=3), torch.empty(2, 4, 8))) == {"local", "patch_gemm"}
    assert set(kernels(nn.Conv2d(4, 6, 3, padding=1), torch.empty(2, 4, 8, 6))) == {"local", "halo_conv"}
    assert set(kernels(nn.Conv1d(4, 6, 2, stride=2, groups=2), torch.empty(2, 4, 8))) == {"local"}
    assert set(kernels(nn.Conv1d(4, 6, 3, stride=3), torch.empty(2, 4, 8))) == {"local"}  # 8 = 2 x 3 + 2


def test_patch_gemm_matches_the_convolution():
    """Forward and gradients of the patch GEMM equal those of torch's convolutions, 1- to 3-D."""
    g = torch.Generator().manual_seed(0)
    for n, (kernel, grid) in enumerate((((3,), (5,)), ((3, 2), (5, 3)), ((3, 2, 4), (2, 3, 2))), start=1):
        x = torch.randn(2, 6, *[a * k for a, k in zip(grid, kernel)], generator=g, dtype=F64, requires_grad=True)
        coarse = torch.randn(2, 7, *grid, generator=g, dtype=F64, requires_grad=True)
        w = torch.randn(7, 6, *kernel, generator=g, dtype=F64, requires_grad=True)
        b7, b6 = (torch.randn(c, generator=g, dtype=F64, requires_grad=True) for c in (7, 6))
        conv, transposed = getattr(nn.functional, f"conv{n}d"), getattr(nn.functional, f"conv_transpose{n}d")
        for fn, ref, args in ((patch_conv, partial(conv, stride=kernel), (x, w, b7)),
                              (patch_conv_transpose, partial(transposed, stride=kernel), (coarse, w, b6)),
                              (patch_conv, partial(conv, stride=kernel), (x, w))):
            want, got = ref(*args), fn(*args)
            torch.testing.assert_close(got, want)
            grad = torch.randn(want.shape, generator=g, dtype=F64)
            torch.testing.assert_close(torch.autograd.grad(got, args, grad), torch.autograd.grad(want, args, grad))


def test_transposed_patches_shard_only_whole_patches():
    """6 patches over 2 x 2 ranks: 3 + 3, then 2 + 1 patches against 12 = 6 + 6 points: refused."""
    recover = _strategies(Patches1D(), torch.empty(2, 3, 24), "conv_transpose1d")
    x_layouts = {format_placements(s.inputs[0]) for s in recover}
    assert "S(2),R" in x_layouts and "S(2),S(2)" not in x_layouts


def test_the_jigsaw_papers_weather_mixer_trains_like_single_device(ranks4):
    """Its own model, shrunk: 1-D patches with constant fields, concatenated skips, mse_loss; 2 x 2,
    under 0.75 of its memory, its convolutions held to sharded inputs (alone, the planner finds it
    cheaper to shard the loss and keep them whole at this size): nothing falls back to replication."""
    sizes = dict(fields=5, lat=4, lon=16, patch=4, dim=6, depth=1)
    make = partial(seeded, jigsaw_weathermixer.FieldLoss, F64, **sizes)
    inputs = (_randn(2, 5, 4, 16), _randn(2, 4, 16, 5))
    whole = autojigsaw.plan(make(), inputs, MESH, device="cpu").memory_per_rank
    sharded = {n: (lambda s: s.inputs[0] != (R, R)) for n in ("conv1d", "conv_transpose1d")}
    plan = pinned_plan(make(), inputs, MESH, sharded, memory_budget=int(0.75 * whole))
    assert not plan.fallbacks and plan.node("mse_loss").inputs[0] != (R, R), plan
    _run(ranks4, make, inputs, plan)


class FieldMSE(nn.Module):
    """A field through a linear map, scored by F.mse_loss (broadcast_tensors, then mse_loss)."""

    def __init__(self, width=7, reduction="mean"):
        super().__init__()
        self.proj, self.reduction = nn.Linear(width, width), reduction

    def forward(self, x, target):
        return nn.functional.mse_loss(self.proj(x), target, reduction=self.reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_over_uneven_shards(ranks4, reduction):
    """5 rows and 7 columns over 2 x 2 ranks (3 + 2 and 4 + 3): every rank's share of the loss
    adds up to the single-device loss, gradients included, without gathering the field."""
    x, target = _randn(3, 5, 7), _randn(3, 5, 7).flip(0)
    make = partial(seeded, FieldMSE, F64, reduction=reduction)
    uneven = inputs_are("S(1),S(2)", "S(1),S(2)")
    plan = pinned_plan(make(), (x, target), MESH, {"broadcast_tensors": uneven, "mse_loss": uneven})
    assert not plan.fallbacks, plan
    _run(ranks4, make, (x, target), plan, kernel=None if reduction == "none" else "sharded_mse_loss")


# ---------------------------------------------------------------- norms over a sharded dim


class Norms(nn.Module):
    def __init__(self, dim=5):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.rms = nn.RMSNorm(dim)

    def forward(self, x):
        return self.rms(self.ln(x) * 2)


def test_norms_over_sharded_channels(ranks4):
    """Tokens over domain, the 5 normalized channels over tensor (3 + 2): exact statistics."""
    x = _randn(2, 7, 5)
    make = partial(seeded, Norms, F64)
    pins = {"layer_norm": inputs_are("S(1),S(2)", "R,S(0)", "R,S(0)"),
            "rms_norm": inputs_are("S(1),S(2)", "R,S(0)")}
    plan = pinned_plan(make(), (x,), MESH, pins)
    assert {plan.node(n).kernel for n in pins} == {"sharded_layer_norm", "sharded_rms_norm"}
    _run(ranks4, make, (x,), plan)


# ---------------------------------------------------------------- fused linears


class MLP(nn.Module):
    def __init__(self, d=6, hidden=9, bias=True):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def test_sequence_parallel_mlp_fuses_gather_and_scatter(ranks4):
    """Batch over domain, 7 tokens over tensor: gathered into fc1, fc2's sum scattered back."""
    x = _randn(2, 7, 6)
    make = partial(seeded, MLP, F64)
    pins = {"linear": inputs_are("S(0),R", "R,S(0)", "R,S(0)"),
            "linear_1": inputs_are("S(0),S(2)", "R,S(1)", "R,P(sum)")}
    plan = pinned_plan(make(), (x,), MESH, pins, input_placements=[(Shard(0), Shard(1))],
                       output_placements=[(Shard(0), Shard(1))])
    results = _run(ranks4, make, (x,), plan)
    assert {"all_gather_linear", "linear_reduce_scatter"} <= set(results[0]["kernels"])


def test_2d_linears_fuse_into_summa(ranks4):
    """Jigsaw's layout: X tokens x features, W out x in, over domain x tensor; no bias."""
    x = _randn(2, 7, 6)
    make = partial(seeded, MLP, F64, bias=False)
    pins = {"linear": inputs_are("S(1),S(2)", "R,S(1)"), "linear_1": inputs_are("S(1),S(2)", "R,S(1)"),
            "p_fc1_weight": outputs_are("S(0),S(1)"), "p_fc2_weight": outputs_are("S(0),S(1)")}
    plan = pinned_plan(make(), (x,), MESH, pins, input_placements=[(Shard(1), Shard(2))],
                       output_placements=[(Shard(1), Shard(2))])
    results = _run(ranks4, make, (x,), plan, kernel="summa_linear")
    assert "linear" not in results[0]["kernels"]


# ---------------------------------------------------------------- the weather mixer


# mesh, model sizes, batch, input placements, pinned strategies, memory budget as a fraction of
# the replicated plan's (0.786: the bytes of 0.6 when a 1-rank axis' placements counted phantom buffers). Token mixing contracts over tokens that the domain axis shards.
TOKEN_MIXING = inputs_are("S(2),R", "S(1),R", "P(sum),R")
SIZES = dict(lat=8, lon=8, dim=6, token_hidden=10, channel_hidden=12)
MIXERS = {
    "1x2": ((1, 2), SIZES, 2, None, {}, 0.786),
    # whole patch rows to each rank, tokens stay with them through the block
    "2x1": ((2, 1), SIZES, 2, [(Shard(2), R)], {"conv2d": inputs_are("S(2),R", "R,R", "R,R"),
                                                 "linear": TOKEN_MIXING}, 0.786),
    # 3 x 5 = 15 patches, 5 channels, 7 and 9 hidden: nothing divides by 2. Tokens over domain,
    # channels over tensor into the first norm and the token mixing.
    "2x2-uneven": ((2, 2), dict(lat=6, lon=10, dim=5, token_hidden=7, channel_hidden=9), 2, None,
                   {"layer_norm": inputs_are("S(1),S(2)", "R,S(0)", "R,S(0)"),
                    "linear": inputs_are("S(2),S(1)", "S(1),R", "P(sum),R")}, None),
}


@pytest.mark.parametrize("case", MIXERS)
def test_weather_mixer_trains_like_single_device(ranks2, ranks4, case):
    mesh_shape, sizes, batch, input_placements, pins, fraction = MIXERS[case]
    make = partial(seeded, WeatherMixer, F64, depth=1, **sizes)
    x = _randn(batch, 3, sizes["lat"], sizes["lon"])
    mesh = dict(zip(("domain", "tensor"), mesh_shape))
    budget = None
    if fraction is not None:
        budget = int(autojigsaw.plan(make(), (x,), mesh, device="cpu").memory_per_rank * fraction)
    plan = pinned_plan(make(), (x,), mesh, pins, memory_budget=budget, input_placements=input_placements)
    pool = ranks4 if plan.mesh.world_size == 4 else ranks2
    _run(pool, make, (x,), plan)
