"""Counterexamples the fuzzer found (tests/test_fuzz.py), kept as plain tests: each against one device."""

import itertools

import pytest
import torch

from autojigsaw.capture import capture
from autojigsaw.mesh import MeshSpec
from autojigsaw.ir import STRATEGIES
from autojigsaw.strategies.annotate import annotate
from autojigsaw.placements import local_shape

from .fuzz_check import ROUNDOFF_UNITS, compare_all, plan_or_error
from .fuzz_models import MLP, ModelSpec, SoftmaxGate, TokenMix, build


def _matches(pool, spec: ModelSpec, mesh: dict[str, int], fraction: float) -> None:
    plan, message = plan_or_error(spec, mesh, fraction)
    assert plan is not None, message
    for r in pool.run(compare_all, [(spec, plan)], tuple(mesh.values()), tuple(mesh)):
        assert r[0]["sharded"] > 0
        assert all(v <= ROUNDOFF_UNITS for v in r[0]["errors"].values()), r[0]["errors"]

# BatchNorm in train mode updates its running statistics: export returns the new values as the
# graph's first outputs, which the parallel module took for the model's outputs (a pytree error).
BATCHNORM = ModelSpec(stem="features", batch=2, seq=5, dim=6, in_dim=3, final_norm="batch", head="linear",
                      out_dim=3, seed=0, blocks=(MLP(hidden=7, act="gelu", gated=False, norm="batch", bias=True),))


@pytest.mark.parametrize("two_outputs", [False, True], ids=["one_output", "two_outputs"])
@pytest.mark.parametrize("mesh", [{"domain": 2}, {"tensor": 2}], ids=["domain2", "tensor2"])
def test_batchnorm_running_statistics_match_single_device(ranks2, mesh, two_outputs):
    _matches(ranks2, ModelSpec(**{**BATCHNORM.__dict__, "two_outputs": two_outputs}), mesh, 0.7)


# A patch embedding of 6 channels over 4 ranks: torch.chunk gives 2, 2, 2, 0, and conv2d refuses
# rank 3's weight of 0 output channels (with 0 input channels it returns a wrong shape instead).
PATCHES = ModelSpec(stem="patches", batch=1, seq=3, dim=6, in_dim=5, blocks=(TokenMix(hidden=16),),
                    final_norm="rms", head="none", out_dim=3, seed=1, positions=True)


@pytest.mark.parametrize("mesh", [{"tensor": 4}, {"domain": 2, "tensor": 2}], ids=["tensor4", "2x2"])
def test_no_conv2d_strategy_leaves_a_rank_without_channels_or_pixels(mesh):
    model, inputs = build(PATCHES)
    captured = capture(model, inputs)
    spec = MeshSpec.of(mesh)
    annotate(captured.gm, spec)
    conv = next(n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.conv2d.default)
    x, w = conv.args[0].meta["val"].shape, conv.args[1].meta["val"].shape
    for s in conv.meta[STRATEGIES]:
        for coord in itertools.product(*map(range, spec.sizes)):
            assert min(local_shape(x, s.inputs[0], spec.sizes, coord)[1:]) > 0, s
            assert min(local_shape(w, s.inputs[1], spec.sizes, coord)[:2]) > 0, s


def test_patch_embedding_of_six_channels_on_four_ranks(ranks4):
    _matches(ranks4, PATCHES, {"tensor": 4}, 0.5)


# BatchNorm over 6 channels on 4 ranks: DTensor's rule shards the channels, rank 3 gets none, and
# batch_norm refuses an input without elements.
BATCHNORM_6 = ModelSpec(stem="features", batch=2, seq=2, dim=6, in_dim=3, blocks=(SoftmaxGate(temperature=1.0),),
                        final_norm="batch", head="linear", out_dim=3, seed=0)


def test_no_batch_norm_strategy_leaves_a_rank_an_empty_input():
    model, inputs = build(BATCHNORM_6)
    captured = capture(model, inputs)
    spec = MeshSpec.of({"tensor": 4})
    annotate(captured.gm, spec)
    bn = next(n for n in captured.gm.graph.nodes if "batch_norm" in str(n.target))
    x = bn.args[0].meta["val"].shape
    for s in bn.meta[STRATEGIES]:
        for coord in range(4):
            assert min(local_shape(x, s.inputs[0], spec.sizes, (coord,))) > 0, s


def test_batch_norm_of_six_channels_on_four_ranks(ranks4):
    # 0.65: with a residual's gradient held from its first contribution, no layout fits under 0.6
    _matches(ranks4, BATCHNORM_6, {"tensor": 4}, 0.65)
