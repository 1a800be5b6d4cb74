"""Random numbers drawn in the forward (a diffusion model's noise, a VAE's sample) are the
single-device model's, shard by shard.

Every rank's generator is seeded alike, so drawing on each shard would give every shard the same
numbers (the noise of a data-sharded batch the first half's twice: loss 1.0701 against 1.1200 on
one device, no error). Elementwise draws take the whole draw's slice; draws whose count depends on
the values (gamma, Poisson) run whole.
"""

import copy

import pytest
import torch

import autojigsaw
from autojigsaw.capture import capture
from autojigsaw.capture.eager_strides import EAGER_STRIDES
from autojigsaw.kernels import random
from autojigsaw.testing.local_ranks import get_mesh

from .jigsaw_common import rows_plan
from .side_by_side import build, train, whole

F64 = torch.float64
ROUNDOFF = 64 * torch.finfo(F64).eps  # values of order 1; a sharded sum rounds in another order
ADAM_STEPPED = 1e-10  # as tests/test_hf_models.py: Adam divides tiny gradients' roundoff by their own size

_DRAWS = {
    "randn_like": torch.randn_like,
    "rand_like": torch.rand_like,
    "normal_": lambda x: torch.empty_like(x).normal_(),
    "bernoulli": lambda x: torch.bernoulli(torch.sigmoid(x)),
}


class Denoiser(torch.nn.Module):
    """Noise a clean sample, predict the noise back: a diffusion training step's loss."""

    def __init__(self, draw: str):
        super().__init__()
        self.draw = draw
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))

    def forward(self, x):
        if self.draw == "by value":  # rejection samplers: how many numbers they draw depends on the value
            rate = torch.nn.functional.softplus(x) + 1  # a gamma sample (reparameterized: a gradient flows)
            noise = torch.distributions.Gamma(rate, 1.0).rsample() + torch.poisson(rate)
        else:  # every elementwise draw, each on its own share of the noise
            noise = sum(draw(x) * (i + 1) for i, draw in enumerate(_DRAWS.values()))
        return (self.net(x + noise) - noise).square().mean()


def _side_by_side(draw: str, shape: tuple, axes: tuple) -> dict:
    """Largest differences from one device over two SGD steps (loss, gradients, weights) and the
    kernel and output placements of the nodes that draw."""
    torch.manual_seed(0)
    ref = Denoiser(draw).to(F64)
    x = torch.randn(8, 64, 16, dtype=F64, generator=torch.Generator().manual_seed(1))
    # Too little memory for a whole sample's activations: they shard on every axis, and so does the noise (the
    # sample, passed whole, is held whole by every rank)
    one = autojigsaw.plan(copy.deepcopy(ref), (x,), {"data": 1}, device="cpu").memory_per_rank
    budget = int(0.6 / len(axes) * (one - x.nbytes) + x.nbytes)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(shape, axes), (x,), compile=False,
                                    memory_budget=budget)
    drawn = [n for n in pmodel.plan.nodes if n.op in (
        "aten.randn_like", "aten.rand_like", "aten.normal_functional", "aten.bernoulli", "aten._standard_gamma",
        "aten.poisson")]
    diffs = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pmodel, ref)]
    for _ in range(2):
        losses = []
        for m in (pmodel, ref):
            torch.manual_seed(123)
            losses.append(whole(m(x)))
            losses[-1].backward()
        diffs["loss"] = max(diffs["loss"], (losses[0] - losses[1]).abs().item())
        for p, q in zip(pmodel.parameters(), ref.parameters()):
            diffs["grad"] = max(diffs["grad"], (whole(p.grad) - q.grad).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(pmodel.parameters(), ref.parameters()):
        diffs["weight"] = max(diffs["weight"], (whole(p.detach()) - q.detach()).abs().max().item())
    return {"diffs": diffs, "drawn": [(n.kernel, n.outputs[0]) for n in drawn]}


@pytest.mark.parametrize("shape, axes", [((2,), ("data",)), ((2, 2), ("data", "domain"))], ids=["data", "2x2"])
def test_elementwise_draws_shard_like_one_device(ranks2, ranks4, shape, axes):
    """Noise drawn like the sharded sample (batch; batch and sequence): each rank's slice, or 2-D
    block, of the single-device draw."""
    ranks = ranks2 if len(shape) == 1 else ranks4
    result = ranks.run(_side_by_side, "elementwise", shape, axes, timeout=300)[0]
    assert len(result["drawn"]) == len(_DRAWS), result
    assert all(k == "draw" and not any(p.is_replicate() for p in pl) for k, pl in result["drawn"]), result
    assert max(result["diffs"].values()) <= ROUNDOFF, result


def test_draws_that_depend_on_values_run_whole(ranks2):
    """Gamma and Poisson samples draw more numbers for some values than for others: a whole draw
    around one shard's values is not one device's draw, so they stay whole on every rank."""
    result = ranks2.run(_side_by_side, "by value", (2,), ("data",), timeout=300)[0]
    assert len(result["drawn"]) == 2 and all(pl[0].is_replicate() for _, pl in result["drawn"]), result
    assert max(result["diffs"].values()) <= ROUNDOFF, result


def test_shards_keep_no_whole_tensor():
    """A kept shard (dropout's mask, a draw) owns its storage: a view would hold the whole tensor."""
    x = torch.randn(2, 1000)
    out, mask = random.dropout(x, 0.5, True, shape=(4, 1000), stride=(1000, 1), offset=(2, 0))
    noise = random.draw(torch.ops.aten.randn_like.default, (x,), {}, shape=(4, 1000), offset=(2, 0),
                        strides=((1000, 1),))
    for kept in (mask, noise):
        assert kept.shape == x.shape and kept.untyped_storage().nbytes() == kept.nbytes


def test_dropout_masks_follow_the_single_device_layout(ranks4):
    """Hugging Face's SegFormer, dropout and drop-path on, its image split in rows over 4 ranks.

    A CPU generator fills a mask in memory order. Mix-FFN's dropout reads a transposed tensor, and
    export's fake strides disagree with eager's (channels-last after a convolution of a transposed
    view, where eager's is contiguous); a mask drawn in either wrong layout trained another model
    (output 0.2 off, gradients 1.7 off in fp64)."""
    model, inputs = build("segformer", dropout=0.1)
    gm = capture(model, inputs).gm
    drops = [n for n in gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert any(n.meta[EAGER_STRIDES][0] != n.args[0].meta["val"].stride() for n in drops)
    assert any(n.meta[EAGER_STRIDES][0] != torch.empty(n.args[0].meta["val"].shape).stride() for n in drops)
    plan = rows_plan(model, inputs, {"domain": 4})
    assert {"halo_conv", "dropout"} <= {n.kernel for n in plan.nodes}
    for r in ranks4.run(train, "segformer", (4,), ("domain",), plan.to_json(), steps=2, dropout=0.1):
        assert max(r["output"], r["grad"], r["param"]) <= ADAM_STEPPED, r["table"]


class TokensOnAGrid(torch.nn.Module):
    """DPT's reassembly: attention over patch tokens (CPU's flash kernel keeps the queries' (batch,
    tokens, heads, dim) layout), the tokens put back on the image grid (a permuted view, channels-last
    in memory), a 1x1 convolution (channels-last out, as its input) and dropout."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(8, 24), torch.nn.Conv2d(8, 8, 1)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        tokens = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        grid = tokens.permute(0, 2, 1).reshape(b, c, 4, 4)
        return torch.nn.functional.dropout(torch.relu(self.proj(grid)), 0.5)


def _grid_side_by_side() -> dict:
    torch.manual_seed(0)
    ref = TokensOnAGrid().to(F64)
    x = torch.randn(4, 16, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    budget = int(0.8 * autojigsaw.plan(copy.deepcopy(ref), (x,), {"domain": 1}, device="cpu").memory_per_rank)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("domain",)), (x,), compile=False,
                                    memory_budget=budget)
    outs = []
    for m in (pmodel, ref):
        torch.manual_seed(123)
        outs.append(whole(m(x)))
        outs[-1].square().sum().backward()
    grads = [(whole(p.grad) - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), ref.parameters())]
    return {"output": (outs[0] - outs[1]).abs().max().item(), "grad": max(grads)}


def test_dropout_after_attention_and_a_channels_last_convolution_takes_eager_layout(ranks2):
    """The mask of a dropout whose input eager lays out channels-last: the meta replay had it contiguous
    (meta runs attention's math kernel, and every convolution contiguous), so DPT with its head's
    dropout on trained another model (fp64, 2x2: output 0.07, gradients 200 off)."""
    model, x = TokensOnAGrid().to(F64), torch.randn(4, 16, 8, dtype=F64)
    drop = next(n for n in capture(model, (x,)).gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default)
    eager = []
    original = torch.nn.functional.dropout
    try:
        torch.nn.functional.dropout = lambda t, *a, **k: eager.append(t.stride()) or original(t, *a, **k)
        model(x)
    finally:
        torch.nn.functional.dropout = original
    assert drop.meta[EAGER_STRIDES][0] == eager[0] != torch.empty(drop.args[0].meta["val"].shape).stride()
    for r in ranks2.run(_grid_side_by_side):
        assert r["output"] <= ROUNDOFF and r["grad"] <= ROUNDOFF, r
