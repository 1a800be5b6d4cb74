"""A "data" mesh axis is pure data parallelism, composed with domain and tensor axes, and FSDP2.

The data axis shards the batch of every input and never a weight; the weights' gradients are
all-reduced over it. Training on 3-D ("data", "domain", "tensor") meshes, and with FSDP2's
`fully_shard` then sharding the weights over the data axis, must equal the single-device model.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import autojigsaw
from autojigsaw import Plan
from autojigsaw.capture import capture
from autojigsaw.ir import bytes_sent
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.modules import layer_units
from autojigsaw.runtime import regional
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh

from .cost_checks import measure_step
from .side_by_side import build, loss_of, max_diff, plan_json, train

AXES = ("data", "domain", "tensor")


def _data_parallel(plan: Plan, *, sharded_elsewhere: bool = True) -> bool:
    """Batch sharded over "data", every weight whole over it (FSDP shards it at run time), and
    some weight sharded over another axis (`sharded_elsewhere`)."""
    return (all(pl[0] == Shard(0) for pl in plan.input_placements)
            and all(pl[0] == Replicate() for pl in plan.param_placements.values())
            and (not sharded_elsewhere or any(p != Replicate() for pl in plan.param_placements.values()
                                              for p in pl[1:])))


def test_a_batch_smaller_than_the_data_axis_is_refused():
    model, inputs = build("mixer")
    with pytest.raises(ValueError, match="batch of 2 is smaller than the 4 ranks of data axis 'data'"):
        autojigsaw.plan(model, inputs, {"data": 4}, device="cpu")


# Mixer fractions are of its replicated bytes (216.6 KiB; no buffer is counted between placements
# of 1-rank axes).
# GPT-2 under FSDP: below 0.53 of its replicated bytes nothing fits, above it FSDP's sharding alone
# does, so its tensor axis shards activations, not weights.
@pytest.mark.parametrize("name,mesh,fsdp,fraction", [("mixer", (2, 1, 2), False, 0.65), ("mixer", (2, 2, 1), True, 0.39),
                                                     ("gpt2", (2, 1, 2), True, 0.54)])
def test_3d_mesh_trains_like_single_device(ranks4, name, mesh, fsdp, fraction):
    plan = plan_json(name, dict(zip(AXES, mesh)), fraction, data_parallel="fsdp" if fsdp else "ddp")
    assert _data_parallel(Plan.from_json(plan), sharded_elsewhere=name != "gpt2")
    for r in ranks4.run(train, name, mesh, AXES, plan, steps=3, fsdp=fsdp):
        if fsdp:  # FSDP2 sharded every weight over the data axis
            assert r["whole_over_first_axis"] == 0, r
        for key in ("output", "grad", "param"):
            assert r[key] <= 1e-10, (key, r[key])


def test_a_mesh_of_three_axes_of_two_trains_like_single_device():
    # every axis of 2x2x2 at work (8 ranks on CI's 2 cores, ~45 s): FSDP on "data", GPT-2's weights
    # split on both "domain" and "tensor"; a 1-rank axis (above) makes every collective on it trivial
    mesh = (2, 2, 2)
    plan = plan_json("gpt2", dict(zip(AXES, mesh)), 0.5, data_parallel="fsdp")
    assert _data_parallel(Plan.from_json(plan))
    placements = Plan.from_json(plan).param_placements.values()
    assert all(any(pl[axis] != Replicate() for pl in placements) for axis in (1, 2)), Plan.from_json(plan).table()
    with LocalRanks(8) as ranks8:
        results = ranks8.run(train, "gpt2", mesh, AXES, plan, steps=3, fsdp=True)
    for r in results:
        assert r["whole_over_first_axis"] == 0, r
        for key in ("output", "grad", "param"):
            assert r[key] <= 1e-10, (key, r[key])


class _FsdpTraffic(TorchDispatchMode):
    """What FSDP's own collectives send: c10d's in-place ops (the graph's are functional ones)."""

    KINDS = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._schema.name.removeprefix("c10d::"))
        if kind is not None:
            src = args[1]  # (output, input, ...)
            self.calls.append((kind, bytes_sent(kind, src.numel() * src.element_size(), self.n)))
        return func(*args, **(kwargs or {}))


def _fsdp_step(plan: str) -> dict:
    ref, inputs = build("mixer")
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2, 2), ("data", "tensor")), inputs,
                                    compile=False, plan=Plan.from_json(plan))
    fsdp = _FsdpTraffic(2)
    with count_comm() as log, fsdp:
        loss_of(pmodel(*inputs)).backward()
    loss_of(ref(*inputs)).backward()
    return {"graph": log.calls, "fsdp": fsdp.calls, "sent": log.total_bytes + sum(b for _, b in fsdp.calls),
            "grad": max(max_diff(p.grad.full_tensor(), q.grad) for p, q in zip(pmodel.parameters(), ref.parameters())),
            "grad_scale": max(q.grad.abs().max().item() for q in ref.parameters())}


def test_fsdp_alone_sums_the_weights_gradients_over_the_data_axis(ranks4):
    """No in-graph all-reduce on the data axis beside FSDP's: per unit (the mixer's two blocks and the
    root) two gathers and one reduce-scatter per step, the bytes the plan predicts, and the single
    device's gradients."""
    plan = plan_json("mixer", {"data": 2, "tensor": 2}, 0.39, data_parallel="fsdp")
    for r in ranks4.run(_fsdp_step, plan):
        assert not [c for c in r["graph"] if c[1] == "data" and c[0] in ("all_reduce", "reduce_scatter")], r["graph"]
        kinds = [kind for kind, _ in r["fsdp"]]
        assert kinds[:3] == ["all_gather"] * 3 and kinds.count("all_gather") == 6, r["fsdp"]  # root, blocks.0, .1
        assert kinds.count("reduce_scatter") == 3 and kinds[-1] == "reduce_scatter", r["fsdp"]
        assert r["sent"] == Plan.from_json(plan).comm_bytes, r
        assert r["grad"] <= 64 * 2.0**-52 * r["grad_scale"], r


def _two_adam_steps(pmodel, ref, x, around=contextlib.nullcontext) -> dict:
    """Largest differences from one device (`ref`) over two Adam steps of the output's mean square: outputs,
    gradients, then parameters. `around()`: a context each step's parallel forward and backward run in."""
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (pmodel, ref)]
    diffs = {"output": 0.0, "grad": 0.0}
    for _ in range(2):
        with around():
            out = pmodel(x)
            out.square().mean().backward()
        expected = ref(x)
        expected.square().mean().backward()
        diffs["output"] = max(diffs["output"], max_diff(out, expected))
        diffs["grad"] = max(diffs["grad"], *(max_diff(p.grad.full_tensor(), q.grad)
                                             for p, q in zip(pmodel.parameters(), ref.parameters())))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {**diffs, "param": max(max_diff(p.full_tensor(), q) for p, q in zip(pmodel.parameters(), ref.parameters()))}


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin(x))


class _Stack(nn.Module):
    """Wide layers on a small batch: the weights are most of the memory."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _stack(depth: int, width: int):
    torch.manual_seed(0)
    return _Stack(depth, width), (torch.randn(16, width),)


def test_fsdp_gathers_a_layer_only_while_it_runs(ranks2):
    """One FSDP unit per repeated layer, as the plan prices it: an 8-layer stack's measured peak is
    within 10 % of the predicted one. With the whole model one unit (every weight gathered for the whole
    forward and backward, and every gradient unsharded until the backward ends) it measured 1.75x that."""
    for r in ranks2.run(measure_step, _stack, (8, 512), (2,), ("data",)):
        assert abs(r.memory_error) <= 0.1, (r.predicted_peak, r.peak)


_COMPILED: list[int] = []


def _counting(gm, example_inputs):
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""
    _COMPILED.append(len(gm.graph.nodes))
    return gm.forward


def _compiles_and_diffs(depth: int) -> dict:
    """Graphs torch.compile compiled (a counting backend), and the largest differences from one device over two
    Adam steps, of a `depth`-layer stack under FSDP on data=2."""
    torch._dynamo.reset()
    if "counting" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_counting, name="counting")
    _COMPILED.clear()
    ref, (x,) = _stack(depth, 16)
    ref, x = ref.double(), x.double()
    computations = []  # what each piece of the program computes (None: never shared)
    alike = regional.computation
    regional.computation = lambda piece: computations.append(alike(piece)) or computations[-1]
    try:  # the program is made here, for the example input
        pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("data",)), (x,), compile="counting")
    finally:
        regional.computation = alike
    return {**_two_adam_steps(pmodel, ref, x), "compiles": len(_COMPILED), "pieces": len(computations),
            "distinct": len({c for c in computations if c is not None}) + computations.count(None)}


def test_fsdp_compiles_a_repeated_layer_once(ranks2):
    """Under FSDP each layer's piece of the program runs through its unit and is compiled apart: an 8-layer
    stack took a compile per layer (a 32-layer Llama, 32 or more). Pieces that compute alike now share one
    compiled module: torch.compile compiles each distinct piece at most once, and training is unchanged."""
    r = ranks2.run(_compiles_and_diffs, 8)[0]
    assert r["pieces"] > 8 > r["distinct"] >= r["compiles"], r  # measured: 9 pieces, 4 distinct, 4 compiles (9 before)
    for key in ("output", "grad", "param"):
        assert r[key] <= 1e-14, (key, r)


class _Revisits(nn.Module):
    """Layer 0 runs twice (before and after layer 1); the head reuses the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = self.layers[0](self.layers[1](self.layers[0](self.embed(x))))
        return F.linear(self.layers[2](x), self.embed.weight)


def test_fsdp_units_are_the_layers_that_alone_read_their_weights_in_one_stretch():
    captured = capture(_Revisits(), (torch.randn(2, 8),), {})
    units = layer_units(list(captured.gm.graph.nodes), captured.params)
    assert {captured.params[ph]: layer for ph, layer in units.items()} == {
        "layers.1.weight": "layers.1", "layers.1.bias": "layers.1",
        "layers.2.weight": "layers.2", "layers.2.bias": "layers.2"}


class _PatchEmbed(nn.Module):
    """timm's layout: a class token and position embedding on the root module, a linear whose weight
    is scaled by a learned gain (weight normalization's form): parameters read only by other parameters."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, 16))
        self.proj = nn.Linear(16, 16, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return F.linear(x, self.proj.weight * self.gain[:, None])


def _patch_embed():
    torch.manual_seed(0)
    return _PatchEmbed().double(), (torch.randn(4, 4, 16, dtype=torch.float64),)


def _patch_embed_step(plan: str, data_parallel: str) -> dict:
    ref, inputs = _patch_embed()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("data",)), inputs, compile=False,
                                    plan=Plan.from_json(plan), data_parallel=data_parallel)
    loss_of(pmodel(*inputs)).backward()
    loss_of(ref(*inputs)).backward()
    grads = {n: max_diff(p.grad.full_tensor(), q.grad) / q.grad.abs().max().item() if p.grad is not None else None
             for (n, p), q in zip(pmodel.named_parameters(), ref.parameters())}
    for opt in (torch.optim.SGD(pmodel.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)):
        opt.step()
    return {"grads": grads, "param": max(max_diff(p.full_tensor(), q) for p, q in zip(pmodel.parameters(),
                                                                                          ref.parameters()))}


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_parameters_read_only_by_parameters_get_their_gradient_once(ranks2, data_parallel):
    """The class token, the position embedding and the gain are the root's or read by no activation: under
    FSDP the first two got no gradient (the graph read the module's pre-FSDP parameters) and the
    gathered-batch plan's full gradients were summed over the data ranks again (2x)."""
    model, inputs = _patch_embed()
    plan = autojigsaw.plan(model, inputs, {"data": 2}, device="cpu", data_parallel=data_parallel)
    assert plan.node("linear").inputs[0] == (Replicate(),)  # the premise: the batch is gathered, gradients full
    for r in ranks2.run(_patch_embed_step, plan.to_json(), data_parallel):
        assert all(err is not None and err <= 16 * 2.0**-52 for err in r["grads"].values()), r
        assert r["param"] <= 16 * 2.0**-52, r


class _GatedBlock(nn.Module):
    """A residual layer behind a learned scalar gate (ReZero)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin, self.alpha = nn.Linear(width, width), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.alpha * torch.relu(self.lin(x))


class _Gated(nn.Module):
    """Scalar parameters as models write them: a ReZero gate in every layer, CLIP's learned temperature."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_GatedBlock(16) for _ in range(2))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x * self.logit_scale.exp()


def _gated_steps() -> dict:
    """Largest differences from one device over two Adam steps, the placements of the scalars and the
    other weights, and the bytes sent in the first step (the graph's and FSDP's) beside the plan's."""
    torch.manual_seed(0)
    ref, x = _Gated().double(), torch.randn(8, 4, 16, dtype=torch.float64)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("data",)), (x,), compile=False)
    sent = []

    @contextlib.contextmanager
    def counted():
        fsdp = _FsdpTraffic(2)
        with count_comm() as log, fsdp:
            yield
        sent.append(log.total_bytes + sum(b for _, b in fsdp.calls))

    diffs = _two_adam_steps(pmodel, ref, x, counted)
    return {**diffs, "placements": {name: tuple(p.placements) for name, p in pmodel.named_parameters()},
            "sent": sent[0], "predicted": pmodel.plan.comm_bytes, "data_parallel": pmodel.plan.data_parallel}


def test_fsdp_keeps_scalar_parameters_whole_and_trains_like_one_device(ranks2):
    """FSDP2 shards a parameter's dim 0, which a scalar lacks: `fully_shard` refused CLIP's logit_scale,
    so FSDP, the default on a data axis, failed on it. A scalar now stays whole on the data axis and the
    program sums its gradient over it, as under DDP, beside FSDP's units of the other weights."""
    captured = capture(_Gated(), (torch.randn(8, 4, 16),), {})
    assert sorted(set(layer_units(list(captured.gm.graph.nodes), captured.params).values())) == ["layers.0", "layers.1"]
    for r in ranks2.run(_gated_steps):
        assert r["data_parallel"] == "fsdp", r
        scalars = ("logit_scale", "layers.0.alpha", "layers.1.alpha")
        assert all(r["placements"][name] == (Replicate(),) for name in scalars), r["placements"]
        assert all(pl == (Shard(0),) for name, pl in r["placements"].items() if name not in scalars), r
        assert r["sent"] == r["predicted"], r
        for key in ("output", "grad", "param"):
            assert r[key] <= 1e-14, (key, r)


class _ReturnsItsEmbedding(nn.Module):
    """A model that returns a weight beside its output (an embedding for a tied loss outside)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(32, 16), nn.Linear(16, 16)

    def forward(self, ids):
        return self.fc(self.emb(ids)), self.emb.weight, self.fc.weight.t()


def _returned_weights_step() -> dict:
    """Largest differences from one device over two Adam steps of a loss on the returned weights."""
    torch.manual_seed(0)
    ref = _ReturnsItsEmbedding().to(torch.float64)
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(1))
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("data",)), (ids,), compile=False)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (pmodel, ref)]
    diffs = {"loss": 0.0, "grad": 0.0}
    for _ in range(2):
        losses = [out.square().mean() + 0.01 * (emb.square().sum() + fc_t.sum(0).square().sum())
                  for out, emb, fc_t in (m(ids) for m in (pmodel, ref))]
        for loss in losses:
            loss.backward()
        diffs["loss"] = max(diffs["loss"], (losses[0] - losses[1]).abs().item())
        diffs["grad"] = max(diffs["grad"], *(max_diff(p.grad.full_tensor(), q.grad)
                                             for p, q in zip(pmodel.parameters(), ref.parameters())))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {**diffs, "data_parallel": pmodel.plan.data_parallel}


def test_returned_weights_outlive_fsdp_resharding(ranks2):
    """FSDP frees a gathered weight after the forward: an output that was that weight read freed
    memory (a segfault at the first use) until the rewrite copied it."""
    result = ranks2.run(_returned_weights_step, timeout=300)[0]
    assert result["data_parallel"] == "fsdp" and max(result["loss"], result["grad"]) <= 1e-14, result
