"""The planner rediscovers Jigsaw's hand-written 2 x 2 layers, and sends no more bytes than they do.

The baseline is written here as Jigsaw writes it (arXiv 2507.05753): plain torch.distributed
calls inside autograd functions, each rank (d, t) of a domain x tensor mesh holding a disjoint
quarter of every activation (tokens over domain, channels over tensor) and of every weight. A
linear either moves its weight quarter and reduce-scatters the partial output ("weight-moving",
for layers that shrink the features) or moves its input and weight quarters ("input-moving",
for layers that widen them), whichever sends fewer bytes. autojigsaw plans the same
single-device layers under a memory budget that only a zero-redundancy layout meets; the plan
must put every weight and activation where the baseline does, compute the same outputs and
gradients, and send at most the baseline's bytes.
"""

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw.ir import bytes_sent
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.placements import format_placements

from .jigsaw_common import BANDWIDTH_BOUND, MixerBlock, inputs_are, outputs_are, pinned_plan, seeded

F64 = torch.float64
MESH = {"domain": 2, "tensor": 2}
QUARTERS = [(Shard(1), Shard(2))]  # [batch, tokens, channels]: tokens over domain, channels over tensor

# ---------------------------------------------------------------- the hand-written baseline

_SENT: list[int] = []  # bytes this rank sent, by the project's one definition of a byte sent


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((n * src.shape[0], *src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=group)
    _SENT.append(bytes_sent("all_gather", src.numel() * src.element_size(), n))
    return out.movedim(0, dim)


def _reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    src = t.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // n, *src.shape[1:]))
    dist.reduce_scatter_tensor(out, src, group=group)
    _SENT.append(bytes_sent("reduce_scatter", src.numel() * src.element_size(), n))
    return out.movedim(0, dim)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    _SENT.append(bytes_sent("all_reduce", t.numel() * t.element_size(), dist.get_world_size(group)))
    return t


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _WeightMoving(torch.autograd.Function):
    """x [rows/R, in/F] @ w [out/R, in/F]^T: gather w over R, reduce-scatter the sum over F."""

    @staticmethod
    def forward(ctx, x, w, rows_group, features_group):
        w_full = _gather(w, 0, rows_group)
        ctx.save_for_backward(x, w_full)
        ctx.groups = rows_group, features_group
        return _reduce_scatter(x @ w_full.T, -1, features_group)

    @staticmethod
    def backward(ctx, g):
        x, w_full = ctx.saved_tensors
        rows_group, features_group = ctx.groups
        g_full = _gather(g, -1, features_group)
        dw = _reduce_scatter(_flat(g_full).T @ _flat(x), 0, rows_group)
        return g_full @ w_full, dw, None, None


class _InputMoving(torch.autograd.Function):
    """x [rows/R, in/F] @ w [out/F, in/R]^T: gather x over F and w over R, no reduction."""

    @staticmethod
    def forward(ctx, x, w, rows_group, features_group):
        x_full, w_full = _gather(x, -1, features_group), _gather(w, 1, rows_group)
        ctx.save_for_backward(x_full, w_full)
        ctx.groups = rows_group, features_group
        return x_full @ w_full.T

    @staticmethod
    def backward(ctx, g):
        x_full, w_full = ctx.saved_tensors
        rows_group, features_group = ctx.groups
        dx = _reduce_scatter(g @ w_full, -1, features_group) if ctx.needs_input_grad[0] else None
        dw = _reduce_scatter(_flat(g).T @ _flat(x_full), 1, rows_group)
        return dx, dw, None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward; all-reduce of the gradient backward (each rank used the sum)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _all_reduce(t, group)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


def _quarter(t: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """The block of t at chunk index dims[dim] along each dim (2 equal chunks: Jigsaw's layout)."""
    for dim, index in dims.items():
        t = t.chunk(2, dim)[index]
    return t.detach().clone()


class HandLinear(nn.Module):
    """A Jigsaw linear: `variant` is _WeightMoving or _InputMoving; rows and features are mesh axes."""

    def __init__(self, ref: nn.Linear, variant, rows: str, features: str, mesh):
        super().__init__()
        r, f = mesh.get_local_rank(rows), mesh.get_local_rank(features)
        out_axis, in_axis = (r, f) if variant is _WeightMoving else (f, r)
        self.layout = {0: out_axis, 1: in_axis}
        self.weight = nn.Parameter(_quarter(ref.weight, self.layout))
        self.variant, self.groups = variant, (mesh.get_group(rows), mesh.get_group(features))

    def forward(self, x):
        return self.variant.apply(x, self.weight, *self.groups)


class HandLayerNorm(nn.Module):
    """LayerNorm over channels split over tensor: statistics summed over tensor, exactly."""

    def __init__(self, ref: nn.LayerNorm, mesh):
        super().__init__()
        self.layout = {0: mesh.get_local_rank("tensor")}
        self.weight = nn.Parameter(_quarter(ref.weight, self.layout))
        self.bias = nn.Parameter(_quarter(ref.bias, self.layout))
        self.group, self.count, self.eps = mesh.get_group("tensor"), ref.normalized_shape[0], ref.eps
        self.domain = mesh.get_group("domain")

    def forward(self, x):
        mean = _SumOverGroup.apply(x.sum(-1, keepdim=True), self.group) / self.count
        centered = x - mean
        var = _SumOverGroup.apply(centered.square().sum(-1, keepdim=True), self.group) / self.count
        return centered * torch.rsqrt(var + self.eps) * self.weight + self.bias

    def reduce_grads(self):
        """Each domain rank normalized its own tokens: the parameters' gradients sum over domain."""
        for p in (self.weight, self.bias):
            p.grad = _all_reduce(p.grad, self.domain)


class HandMixerBlock(nn.Module):
    """The mixer block on quarters: x [batch, tokens/domain, channels/tensor]."""

    def __init__(self, ref: MixerBlock, mesh):
        super().__init__()
        self.norm1, self.norm2 = HandLayerNorm(ref.norm1, mesh), HandLayerNorm(ref.norm2, mesh)
        # token mixing works on x^T [batch, channels/tensor, tokens/domain]: rows over tensor
        self.token_fc1 = HandLinear(ref.token_fc1, _InputMoving, "tensor", "domain", mesh)
        self.token_fc2 = HandLinear(ref.token_fc2, _WeightMoving, "tensor", "domain", mesh)
        self.channel_fc1 = HandLinear(ref.channel_fc1, _InputMoving, "domain", "tensor", mesh)
        self.channel_fc2 = HandLinear(ref.channel_fc2, _WeightMoving, "domain", "tensor", mesh)

    def forward(self, x):
        t = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(F.gelu(self.token_fc1(t))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))

    def reduce_grads(self):
        self.norm1.reduce_grads()
        self.norm2.reduce_grads()


# ---------------------------------------------------------------- side by side


def _layouts(hand: nn.Module) -> dict:
    """name -> {dim: chunk index} of every hand-written parameter (its quarter of the whole)."""
    return {f"{mod_name}.{p_name}" if mod_name else p_name: mod.layout
            for mod_name, mod in hand.named_modules() if hasattr(mod, "layout")
            for p_name, _ in mod.named_parameters(recurse=False)}


def _side_by_side(make, hand_cls, x, plan_json: str):
    """Output quarters and gradient quarters of both against one device; bytes each sent."""
    plan = autojigsaw.Plan.from_json(plan_json)
    mesh = get_mesh((2, 2), ("domain", "tensor"))
    d, t = mesh.get_coordinate()
    ref = make()
    hand = hand_cls(ref, mesh=mesh)
    auto = autojigsaw.parallelize(copy.deepcopy(ref), mesh, (autojigsaw.stand_in(x.shape, x.dtype),),
                                  plan=plan, input_placements=QUARTERS, compile=False)
    y_ref = ref(x)
    weights = torch.linspace(0.5, 1.5, y_ref.numel(), dtype=x.dtype).view_as(y_ref)
    (y_ref.square() * weights).sum().backward()
    mine = {1: d, 2: t}
    x_local, w_local, y_want = (_quarter(v, mine) for v in (x, weights, y_ref))
    _SENT.clear()
    y_hand = hand(x_local)
    (y_hand.square() * w_local).sum().backward()
    if hasattr(hand, "reduce_grads"):
        hand.reduce_grads()
    with count_comm() as log:
        y_auto = auto(x_local)
        (y_auto.square() * w_local).sum().backward()
    ref_grads = dict(ref.named_parameters())
    layouts = _layouts(hand)
    hand_grad = max((p.grad - _quarter(ref_grads[n].grad, layouts[n])).abs().max().item()
                    for n, p in hand.named_parameters())
    auto_grad = max((p.grad.full_tensor() - ref_grads[n].grad).abs().max().item()
                    for n, p in auto.named_parameters())
    kernels = {getattr(n.target, "__name__", "") for n in auto.program.graph.graph.nodes}
    return {"hand": ((y_hand - y_want).abs().max().item(), hand_grad, sum(_SENT)),
            "auto": ((y_auto - y_want).abs().max().item(), auto_grad, log.total_bytes),
            "fused": "summa_linear" in kernels}


def _zero_redundancy_plan(model, x, jigsaw_pins):
    """The planner's free choice under the memory of the Jigsaw layout (pinned), bytes deciding."""
    options = dict(input_placements=QUARTERS, output_placements=QUARTERS, device=BANDWIDTH_BOUND)
    budget = pinned_plan(model, (x,), MESH, jigsaw_pins, **options).memory_per_rank
    return autojigsaw.plan(model, (x,), MESH, memory_budget=budget, mip_gap=0, **options)  # the optimum's layout


def _same_placements(plan, jigsaw_pins) -> None:
    """Every node the Jigsaw layout fixes runs in it in the planner's free choice, too.

    (Transposes are left free: one of a partial sum before or after its reduce-scatter moves
    the same bytes.)
    """
    for name, pin in jigsaw_pins.items():
        assert pin(plan.node(name)), (name, [format_placements(p) for p in plan.node(name).inputs])


def _check(results):
    for r in results:
        for side in ("hand", "auto"):
            out, grad, _ = r[side]
            assert out < 1e-12 and grad < 1e-11, (side, r)
        assert r["auto"][2] <= r["hand"][2], r  # no more bytes than the hand-written layers


def test_jigsaw_linear(ranks4):
    """A weight-moving linear (20 -> 6 features, 16 rows): SUMMA, fused into summa_linear."""
    make = partial(seeded, nn.Linear, F64, in_features=20, out_features=6, bias=False)
    x = torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(1), dtype=F64)
    pins = {"p_weight": outputs_are("S(0),S(1)"),  # out over domain, in over tensor
            "linear": inputs_are("S(1),S(2)", "R,S(1)")}  # the weight gathered over domain
    plan = _zero_redundancy_plan(make(), x, pins)
    _same_placements(plan, pins)
    hand = partial(HandLinear, variant=_WeightMoving, rows="domain", features="tensor")
    results = ranks4.run(_side_by_side, make, hand, x, plan.to_json())
    _check(results)
    assert all(r["fused"] and r["auto"][2] == r["hand"][2] for r in results)


# Each MLP widens then narrows: input-moving then weight-moving, in token and channel mixing.
# 18 token-hidden features split 9 + 9 over domain, but 5 + 4 + 5 + 4 when nested under tensor.
BLOCK = dict(tokens=8, dim=8, token_hidden=18, channel_hidden=16, bias=False)
BLOCK_LAYOUT = {  # the baseline's weights: (domain, tensor) placements of each quarter
    "norm1.weight": "R,S(0)", "norm1.bias": "R,S(0)", "norm2.weight": "R,S(0)", "norm2.bias": "R,S(0)",
    "token_fc1.weight": "S(0),S(1)", "token_fc2.weight": "S(1),S(0)",
    "channel_fc1.weight": "S(1),S(0)", "channel_fc2.weight": "S(0),S(1)",
}
ROWS, TOKENS = "S(1),S(2)", "S(2),S(1)"  # x and x^T of the block in quarters
BLOCK_PINS = {
    **{f"p_{name.replace('.', '_')}": outputs_are(pl) for name, pl in BLOCK_LAYOUT.items()},
    "layer_norm": inputs_are(ROWS, "R,S(0)", "R,S(0)"), "layer_norm_1": inputs_are(ROWS, "R,S(0)", "R,S(0)"),
    "add": inputs_are(ROWS, ROWS),
    "linear": inputs_are("R,S(1)", "S(0),R"), "linear_1": inputs_are(TOKENS, "S(1),R"),
    "linear_2": inputs_are("S(1),R", "R,S(0)"), "linear_3": inputs_are(ROWS, "R,S(1)"),
    "add_1": inputs_are(ROWS, ROWS),
}


def test_jigsaw_mixer_block(ranks4):
    make = partial(seeded, MixerBlock, F64, **BLOCK)
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    plan = _zero_redundancy_plan(make(), x, BLOCK_PINS)
    assert {k: format_placements(v) for k, v in plan.param_placements.items()} == BLOCK_LAYOUT
    _same_placements(plan, BLOCK_PINS)
    _check(ranks4.run(_side_by_side, make, HandMixerBlock, x, plan.to_json()))
