"""Which routed-expert regions the capture recognises (capture/expert_region.py), and what others get.

Recognised: transformers' default experts, written out by hand here as in transformers, become
one routed_experts node that computes exactly what the region did. Not recognised, each with
the reason the plan gives on its grouped matmuls (which keep today's rules): offsets by another
computation, a norm after the experts, a descending sort, a value of the region read elsewhere.
Also the experts' shares (kernels/expert_share.py): summed over the ranks of any expert blocks,
they are the routed experts' output and gradients; and bad arguments to the kernels and options.
"""

import dataclasses
import re

import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (defines transformers.grouped_mm_fallback)
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw.api import capture_for
from autojigsaw.capture import capture
from autojigsaw.capture.routed_experts import routed_experts
from autojigsaw.kernels.expert_share import expert_share
from autojigsaw.kernels.token_dispatch import token_dispatch
from autojigsaw.mesh import MeshAxis, RankView
from autojigsaw.rewrite.rewrite import rewrite
from autojigsaw.training import Regime

from .moe_models import moe_model

FALLBACK = "transformers.grouped_mm_fallback.default"
E, H, INTER, K = 4, 8, 6, 2


class HandWritten(torch.nn.Module):
    """Routed experts as transformers writes them (sort, histc, grouped matmuls, weighted unsort), with variants."""

    def __init__(self, variant: str = "transformers"):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.router = torch.nn.Linear(H, E, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(E, 2 * INTER, H) / 3)
        self.down = torch.nn.Parameter(torch.randn(E, H, INTER) / 3)

    def forward(self, x):
        top, index = torch.topk(self.router(x).softmax(-1), K, dim=-1)
        ids, perm = torch.sort(index.reshape(-1), descending=self.variant == "descending")
        rows = x[perm // K]
        if self.variant == "searchsorted offsets":
            offs = torch.searchsorted(ids, torch.arange(E), right=True).to(torch.int32)
        else:
            offs = torch.cumsum(torch.histc(ids.float(), bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
        gate, up = torch.ops.transformers.grouped_mm_fallback(rows, self.gate_up.transpose(1, 2), offs).chunk(2, -1)
        y = torch.ops.transformers.grouped_mm_fallback(torch.nn.functional.silu(gate) * up, self.down.transpose(1, 2),
                                                       offs)
        if self.variant == "a norm after the experts":
            y = torch.nn.functional.rms_norm(y, (H,))
        y = y * top.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        out = y[inverse].view(x.shape[0], K, H).sum(1)
        return out + ids.float().mean() if self.variant == "sorted ids read elsewhere" else out


def test_transformers_experts_become_one_node_that_computes_the_same():
    model, x = HandWritten(), torch.randn(6, H)
    captured = capture(model, (x,))
    gm = captured.gm
    [node] = [n for n in gm.graph.nodes if n.target is torch.ops.autojigsaw.routed_experts.default]
    assert node.args[5:] == (FALLBACK, "silu", True), node.format_node()
    assert not any("grouped_mm" in str(n.target) or "sort" in str(n.target) for n in gm.graph.nodes), gm.code
    params = dict(model.named_parameters())
    feeds = [params[captured.params[n.name]] if n.name in captured.params else x
             for n in gm.graph.nodes if n.op == "placeholder"]
    assert torch.equal(gm(*feeds)[0], model(x))


@pytest.mark.parametrize("variant, reason", [
    ("searchsorted offsets", "its offsets are not the cumulative histogram of the sorted expert ids"),
    ("a norm after the experts", "the experts' rows are not weighted by the sorted scores"),
    ("descending", "the routed rows are sorted in descending expert order"),
    ("sorted ids read elsewhere", r"getitem_\d+ of the routed experts is also read by _to_copy"),
])
def test_unrecognised_routing_keeps_its_grouped_matmuls_and_the_plan_says_why(variant, reason):
    plan = autojigsaw.plan(HandWritten(variant), (torch.randn(6, H),), {"tensor": 2}, device="cpu")
    grouped = [n for n in plan.nodes if "grouped_mm" in n.op]
    assert len(grouped) == 2 and not any("routed_experts" in n.op for n in plan.nodes), plan.table(every_node=True)
    assert all(re.search(f"no token dispatch: {reason}", n.note) for n in grouped), [n.note for n in grouped]


@pytest.mark.parametrize("blocks", [(2, 2), (3, 1), (1, 1, 1, 1), (2, 1, 1, 0)], ids=str)
def test_the_experts_shares_sum_to_the_routed_experts(blocks):
    """Every rank's share (its block of experts, the tokens whole): outputs and gradients sum to one device's."""
    torch.manual_seed(0)
    x, index = torch.randn(6, H, dtype=torch.float64), torch.stack([torch.randperm(E)[:K] for _ in range(6)])
    weights = torch.rand(6, K, dtype=torch.float64)
    w1 = torch.randn(E, H, 2 * INTER, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(E, INTER, H, dtype=torch.float64, requires_grad=True)
    xs = x.clone().requires_grad_()
    want = routed_experts(xs, index, weights, w1, w2, FALLBACK, "silu", True)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (xs, w1, w2), g)
    starts = [sum(blocks[:r]) for r in range(len(blocks))]
    shares, grads_x, grads_w = [], [], []
    for first, e in zip(starts, blocks):
        xr, w1r, w2r = (t.detach().requires_grad_() for t in (x, w1[first:first + e], w2[first:first + e]))
        out = expert_share(xr, index, weights, w1r, w2r, mm=FALLBACK, act="silu", gated=True, first=first, experts=E)
        out.backward(g)
        shares.append(out)
        grads_x.append(xr.grad)
        grads_w.append((w1r.grad, w2r.grad))
    tol = 16 * torch.finfo(torch.float64).eps
    assert (sum(shares) - want).abs().max() <= tol * want.abs().max()
    assert (sum(grads_x) - want_grads[0]).abs().max() <= tol * want_grads[0].abs().max()
    for got, want_grad in zip(zip(*grads_w), want_grads[1:]):  # each rank its own experts' gradients
        assert (torch.cat(got) - want_grad).abs().max() <= tol * want_grad.abs().max()


def test_token_dispatch_refuses_expert_blocks_that_do_not_match_its_weights():
    axis = MeshAxis("data", 2, None, 1)
    w1, w2 = torch.zeros(3, H, 2 * INTER), torch.zeros(3, INTER, H)
    with pytest.raises(ValueError, match=r"experts=\(4, 4\) over mesh axis 'data' \(2 ranks\).*this rank's \(1\) "
                                         r"equal to its weights' 3"):
        token_dispatch(torch.zeros(2, H), torch.zeros(2, K, dtype=torch.long), torch.zeros(2, K), w1, w2,
                       mm=FALLBACK, act="silu", gated=True, experts=(4, 4), axis=axis)


@pytest.mark.parametrize("value", [0.5, 0, float("inf"), True, "2"])
def test_moe_imbalance_that_is_no_ratio_of_at_least_one_is_refused(value):
    model, inputs = moe_model("mixtral")
    with pytest.raises(ValueError, match="moe_imbalance=.*busiest rank's routed tokens over the mean"):
        autojigsaw.plan(model, inputs, {"data": 2}, device="cpu", moe_imbalance=value)


def test_a_plan_edited_to_split_the_experts_otherwise_is_refused_by_name():
    """An expert's rows (dim 1) are no layout of the kernel: the rewrite names the node and the fix."""
    model, inputs = moe_model("mixtral")
    plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")
    split = dict(inputs=((Replicate(),),) * 3 + ((Shard(1),),) * 2, outputs=((Replicate(),),))
    bad = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, **split) if n.name == "routed_experts" else n
                                                for n in plan.nodes))
    captured = capture_for(model, inputs, {}, Regime())
    with pytest.raises(ValueError, match=r"node 'routed_experts': routed experts split the tokens .* on dim 0 only"):
        rewrite(captured, bad, RankView.planning(bad.mesh))


def test_fewer_experts_than_data_ranks_stay_whole_over_the_data_axis():
    """4 experts on data=8: their weights cannot be stored split there (8 ranks, 4 experts), so they stay whole."""
    model, inputs = moe_model("mixtral", experts=4, batch=8)
    plan = autojigsaw.plan(model, inputs, {"data": 8}, device="cpu")
    experts = {fqn: p for fqn, p in plan.param_placements.items() if ".experts." in fqn}
    assert experts and all(p == (Replicate(),) for p in experts.values()), experts
    assert all(n.note != "data: token dispatch" for n in plan.nodes if n.op == "autojigsaw.routed_experts")
