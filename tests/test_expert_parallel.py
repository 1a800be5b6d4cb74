"""Expert parallelism with a gathered output (kernels/experts.py, the "experts gathered" strategy).

The kernel against the grouped matmul on one device (outputs, the gradients of X and of each
rank's experts, both gradient kinds, experts and ranks without rows, uneven experts) with the
bytes it sends, in fp64 over transformers' fallback and in bf16 over torch._grouped_mm; the
planner choosing it where the output's all-reduce costs more than the weights' gather; and a
tiny Mixtral whose experts are split over 2 ranks training like one device. The Mixtrals route by
code the token dispatch does not recognise (tests/moe_models.py), so their grouped matmuls stay.
"""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import transformers as tf
import transformers.integrations.moe  # noqa: F401  (defines transformers.grouped_mm_fallback)
from torch.distributed.tensor import Partial, Replicate, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.dtypes import reduce_dtype
from autojigsaw.ir import GradKind, bytes_sent
from autojigsaw.kernels import collectives as C
from autojigsaw.kernels.experts import expert_gather_mm
from autojigsaw.mesh import MeshAxis
from autojigsaw.strategies.rules.expert_gather import KERNEL
from autojigsaw.strategies.rules.moe import GROUPED_MM
from autojigsaw.testing.local_ranks import get_mesh

from .moe_models import custom_routing
from .side_by_side import build, loss_of, max_diff

R = Replicate()
FP64_TOL = 8 * torch.finfo(torch.float64).eps  # relative to the largest value
FP32_TOL = 40 * torch.finfo(torch.float32).eps  # relative to the largest value
MESH = {"tensor": 2}
STEPS, LR, ADAM_EPS = 1, 1e-2, 1e-8  # side_by_side.train's Adam: one step, so outputs compare before Adam acts
K, N = 6, 5
# the grouped matmul each dtype is captured as, with its sizes: torch._grouped_mm needs rows of 16 bytes
KERNEL_OPS = {torch.float64: (torch.ops.transformers.grouped_mm_fallback.default, K, N),
              torch.bfloat16: (torch.ops.aten._grouped_mm.default, 8, 16)}
# bf16: the kernel's dW (torch.mm per expert) and the reference's (_grouped_mm's backward) sum in
# other orders in fp32, then round: one bf16 ulp (2^-7 relative) apart at most
KERNEL_TOL = {torch.float64: FP64_TOL, torch.bfloat16: 2.0**-7}
CASES = {  # rows per expert, experts per rank, rows past the last expert
    "an expert without rows": ([3, 0, 5, 2], (2, 2), 0),
    "uneven experts": ([4, 1, 3], (2, 1), 0),
    "a rank without rows": ([0, 0, 4, 3], (2, 2), 0),
    "the other rank without rows": ([2, 5, 0, 0], (2, 2), 0),
    "rows past the last expert": ([1, 2, 3, 1], (2, 2), 2),
}


def _kernel_case(counts, experts, extra, kind, dtype=torch.float64):
    """(max error / scale of output, dX, dW; the collectives run) on this rank."""
    op, k, n_cols = KERNEL_OPS[dtype]
    n, r = dist.get_world_size(), dist.get_rank()
    axis = MeshAxis("experts", n, dist.group.WORLD.group_name, r)
    torch.manual_seed(0)
    rows = sum(counts) + extra
    x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
    w = torch.randn(len(counts), k, n_cols, dtype=dtype, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    # small integers: the ranks' contributions sum to g exactly in any dtype
    parts = torch.randint(-4, 5, (n, rows, n_cols)).to(dtype)
    g = parts.sum(0)
    want = op(x, w, offs)
    want_dx, want_dw = torch.autograd.grad(want, (x, w), g)
    # rows past the last expert: torch._grouped_mm leaves them unwritten, the kernel gives zeros
    want, want_dx = want.detach(), want_dx.clone()
    want[int(offs[-1]):], want_dx[int(offs[-1]):] = 0, 0

    first = sum(experts[:r])
    xl, wl = x.detach().requires_grad_(), w[first:first + experts[r]].detach().requires_grad_()
    with C.count_comm() as log:
        got = expert_gather_mm(op, xl, wl, offs, experts=experts, axis=axis, grad=GradKind(kind))
        got.backward(g if kind == "R" else parts[r])
    dx = xl.grad if kind == "R" else C.raw_all_reduce(xl.grad, "sum", axis)

    def err(a, b):
        return ((a - b).abs().max() / max(b.abs().max(), 1e-300)).item() if b.numel() else 0.0

    errors = (err(got, want), err(dx, want_dx), err(wl.grad, want_dw[first:first + experts[r]]))
    return errors, log.calls


def _check_kernel(results, counts, experts, kind, dtype=torch.float64):
    n = len(experts)
    _, k, n_cols = KERNEL_OPS[dtype]
    size = dtype.itemsize
    bounds = [sum(experts[:r]) for r in range(n + 1)]
    lengths = [sum(counts[bounds[r]:bounds[r + 1]]) for r in range(n)]
    for r, (errors, calls) in enumerate(results):
        assert max(errors) <= KERNEL_TOL[dtype], (r, errors)
        own, total = lengths[r], sum(lengths)
        want = [("all_gather", "experts", bytes_sent("all_gather", own * n_cols * size, n))]
        if kind == "R":  # backward: X's gradient gathered from the ranks' ranges
            want.append(("all_gather", "experts", bytes_sent("all_gather", own * k * size, n)))
        else:  # backward: the other ranks' ranges of the output gradient sent to them, summed in reduce_dtype
            want.append(("send_recv", "experts", (total - own) * n_cols * reduce_dtype(dtype, "sum").itemsize))
        assert calls == want, (r, calls)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
@pytest.mark.parametrize("kind", ["R", "P"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_grouped_matmul_and_sends_its_rows(ranks2, case, kind, dtype):
    counts, experts, extra = CASES[case]
    _check_kernel(ranks2.run(_kernel_case, counts, experts, extra, kind, dtype), counts, experts, kind, dtype)


@pytest.mark.parametrize("kind", ["R", "P"])
def test_kernel_on_four_ranks_one_without_rows(ranks4, kind):
    counts, experts = [3, 0, 4, 1, 2, 5, 1], (2, 2, 2, 1)  # rank 1's two experts get no rows
    _check_kernel(ranks4.run(_kernel_case, counts, experts, 1, kind), counts, experts, kind)


# ---------------------------------------------------------------- in a plan: traffic, choice, training

GATHERED = dict(inputs=((Replicate(),), (Shard(0),), (Replicate(),)), outputs=((Replicate(),),),
                kernel=KERNEL, note="tensor: experts gathered")


def grouped_nodes(plan: Plan):
    return [n for n in plan.nodes if n.op == GROUPED_MM.removesuffix(".default")]


def with_experts_gathered(plan: Plan) -> Plan:
    """`plan` with every grouped matmul's experts split over the one axis, the output gathered, and
    the experts' weights (3-D parameters) stored split so."""
    grouped = grouped_nodes(plan)
    shapes = {n.name: n.shape for n in plan.nodes}
    weights = {f"p_{name.replace('.', '_')}": name for name in plan.param_placements}
    weights = {node: name for node, name in weights.items() if len(shapes[node] or ()) == 3}
    nodes = [dataclasses.replace(n, **GATHERED) if n in grouped else n for n in plan.nodes]
    nodes = [dataclasses.replace(n, outputs=((Shard(0),),)) if n.name in weights else n for n in nodes]
    params = {**plan.param_placements, **{name: (Shard(0),) for name in weights.values()}}
    return dataclasses.replace(plan, nodes=tuple(nodes), param_placements=params)


class Experts(torch.nn.Module):
    """A linear, then the grouped matmul of its rows (so that X wants a gradient)."""

    def __init__(self, experts=4, k=K, n=N):
        super().__init__()
        self.proj = torch.nn.Linear(k, k, dtype=torch.float64)
        self.w = torch.nn.Parameter(torch.randn(experts, k, n, dtype=torch.float64))

    def forward(self, x, offs):
        return torch.ops.transformers.grouped_mm_fallback(self.proj(x), self.w, offs)


def _experts_inputs():
    torch.manual_seed(0)
    return Experts(), (torch.randn(12, K, dtype=torch.float64), torch.tensor([3, 6, 9, 12], dtype=torch.int32))


def _counted_bytes(plan_json):
    model, inputs = _experts_inputs()
    mesh = get_mesh((2,), ("tensor",))
    pmodel = autojigsaw.parallelize(model, mesh, inputs, compile=False, plan=Plan.from_json(plan_json))
    with C.count_comm() as log:
        pmodel(*inputs).square().sum().backward()
    return log.calls


def test_predicted_traffic_is_what_the_kernel_sends_at_balanced_routing(ranks2):
    model, inputs = _experts_inputs()
    plan = with_experts_gathered(autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu"))
    plan = autojigsaw.evaluate(plan, model, inputs, device="cpu")
    (node,) = grouped_nodes(plan)
    assert node.kernel == KERNEL and node.comm_bytes > 0, plan.table(every_node=True)
    for calls in ranks2.run(_counted_bytes, plan.to_json()):
        gathers = [c for c in calls if c[0] == "all_gather"]
        # 6 of the 12 rows each way: the output (N columns) forward, X's gradient (K columns) backward
        assert gathers == [("all_gather", "tensor", 6 * N * 8), ("all_gather", "tensor", 6 * K * 8)], calls
        assert sum(b for _, _, b in calls) == plan.comm_bytes, (calls, plan.table(every_node=True))


class ExpertsHead(torch.nn.Module):
    """Experts, then a linear that the plan splits by output columns: the experts' output gets a
    partial gradient ("P"), so the kernel sums its range of it and leaves X's a contribution."""

    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.head = torch.nn.Linear(N, 8, dtype=torch.float64)

    def forward(self, x, offs):
        return self.head(self.experts(x, offs))


def _head_inputs():
    torch.manual_seed(0)
    return ExpertsHead(), _experts_inputs()[1]


def with_column_head(plan: Plan) -> Plan:
    """`plan` with the head's weight and bias split by output columns, its output Shard(1)."""
    split = dict(inputs=((Replicate(),), (Shard(0),), (Shard(0),)), outputs=((Shard(1),),), kernel="local", note="")
    nodes = [dataclasses.replace(n, **split) if n.name == "linear_1" else
             dataclasses.replace(n, outputs=((Shard(0),),)) if n.name in ("p_head_weight", "p_head_bias") else n
             for n in plan.nodes]
    params = {**plan.param_placements, "head.weight": (Shard(0),), "head.bias": (Shard(0),)}
    return dataclasses.replace(plan, nodes=tuple(nodes), param_placements=params)


def _train_head(plan_json, model="head", mesh=(("tensor", 2),)):
    """One Adam step of ExpertsHead (or Experts), parallel and single-device, in fp64: (largest
    differences / scale, collectives)."""
    ref, inputs = _head_inputs() if model == "head" else _experts_inputs()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(tuple(n for _, n in mesh), tuple(a for a, _ in mesh)),
                                    inputs, compile=False, plan=Plan.from_json(plan_json))
    opt, ref_opt = torch.optim.Adam(pmodel.parameters(), lr=LR), torch.optim.Adam(ref.parameters(), lr=LR)
    with C.count_comm() as log:
        out = pmodel(*inputs)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        out.square().sum().backward()
    ref_out = ref(*inputs)
    ref_out.square().sum().backward()
    pairs = list(zip(pmodel.parameters(), ref.parameters()))
    errors = {"output": max_diff(out, ref_out) / ref_out.abs().max().item(),
              "grad": max(max_diff(p.grad.full_tensor(), q.grad) / q.grad.abs().max().item() for p, q in pairs)}
    opt.step(), ref_opt.step()
    errors["param"] = max(max_diff(p.full_tensor(), q) for p, q in pairs)
    return errors, log.calls


def test_a_partial_output_gradient_is_summed_over_the_ranges_and_trains_like_single_device(ranks2):
    model, inputs = _head_inputs()
    plan = with_column_head(with_experts_gathered(autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")))
    plan = autojigsaw.evaluate(plan, model, inputs, device="cpu")
    for errors, calls in ranks2.run(_train_head, plan.to_json()):
        print({k: f"{v / torch.finfo(torch.float64).eps:.1f} eps" for k, v in errors.items()})
        assert errors["output"] <= FP64_TOL and errors["grad"] <= FP64_TOL, errors
        assert errors["param"] <= FP64_TOL + LR * FP64_TOL / ADAM_EPS, errors  # Adam's step amplifies rounding
        # backward: the other rank's 6 rows of the output's gradient, not X's gather
        assert ("send_recv", "tensor", 6 * N * 8) in calls and ("all_gather", "tensor", 6 * K * 8) not in calls, calls
        assert sum(b for _, _, b in calls) == plan.comm_bytes, (calls, plan.table(every_node=True))


def test_experts_gathered_on_one_axis_and_split_by_columns_on_another(ranks4):
    """2 x 2 ranks: experts over "x", each expert's 5 output columns over "tensor" (3 and 2)."""
    model, inputs = _experts_inputs()
    mesh = {"x": 2, "tensor": 2}
    plan = autojigsaw.plan(model, inputs, mesh, device="cpu")
    split = dict(inputs=((R, R), (Shard(0), Shard(2)), (R, R)), outputs=((R, Shard(1)),), kernel=KERNEL,
                 note="x: experts gathered; tensor: columns")
    nodes = tuple(dataclasses.replace(n, **split) if n in grouped_nodes(plan) else
                  dataclasses.replace(n, outputs=((Shard(0), Shard(2)),)) if n.name == "p_w" else n for n in plan.nodes)
    plan = dataclasses.replace(plan, nodes=nodes, param_placements={**plan.param_placements, "w": (Shard(0), Shard(2))})
    plan = autojigsaw.evaluate(plan, model, inputs, device="cpu")
    results = ranks4.run(_train_head, plan.to_json(), "experts", tuple(mesh.items()))
    for errors, _ in results:
        assert errors["output"] <= FP64_TOL and errors["grad"] <= FP64_TOL, errors
        assert errors["param"] <= FP64_TOL + LR * FP64_TOL / ADAM_EPS, errors
    calls = results[0][1]  # rank (0, 0): 6 rows of 3 columns, X's gradient (6 rows, all 6 columns)
    assert ("all_gather", "x", 6 * 3 * 8) in calls and ("all_gather", "x", 6 * K * 8) in calls, calls
    assert sum(b for _, _, b in calls) == plan.comm_bytes, (calls, plan.table(every_node=True))


def _mixtral(hidden, intermediate, experts, tokens):
    cfg = tf.MixtralConfig(num_hidden_layers=1, hidden_size=hidden, intermediate_size=intermediate,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                           num_local_experts=experts, num_experts_per_tok=2, use_cache=False)
    with torch.device("meta"):
        model = custom_routing(tf.MixtralForCausalLM(cfg))
    return model, (torch.zeros(1, tokens, dtype=torch.long),)


def test_planner_splits_wide_experts_and_gathers_their_rows():
    """64 experts of hidden 2048, 128 tokens on 2 H100s: the experts' weights cannot be gathered
    cheaply and the rows' gather beats the Partial output's all-reduce (and Megatron's inside
    every expert, which main chose: rows, then columns)."""
    model, inputs = _mixtral(2048, 1024, 64, 128)
    plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="h100")
    grouped = grouped_nodes(plan)
    print(*(f"{n.name}: {n.kernel} ({n.note})" for n in grouped), sep="\n")
    assert [n.kernel for n in grouped] == [KERNEL] * 2, plan.table(every_node=True)
    partial = dict(GATHERED, outputs=((Partial(),),), kernel="grouped_mm", note="tensor: experts")
    reduced = autojigsaw.evaluate(dataclasses.replace(plan, nodes=tuple(
        dataclasses.replace(n, **partial) if n in grouped else n for n in plan.nodes)), model, inputs, device="h100")
    print(f"step {plan.step_time * 1e3:.3f} ms, {plan.comm_bytes} B sent; with the output all-reduced: "
          f"{reduced.step_time * 1e3:.3f} ms, {reduced.comm_bytes} B")
    assert plan.step_time < reduced.step_time and plan.comm_bytes < reduced.comm_bytes


def check(results):
    """Outputs and gradients to fp32 rounding; parameters to what one Adam step makes of it (as tests/test_moe.py)."""
    for r in results:
        grad_tol = FP32_TOL * r["grad_scale"]
        tols = {"output": FP32_TOL * max(r["scale"], 1.0), "grad": grad_tol,
                "param": FP32_TOL + STEPS * LR * grad_tol / ADAM_EPS}
        for key, tol in tols.items():
            assert r[key] <= tol, (key, r[key], tol, r["table"])


def _mixtral_inputs():
    """The tiny Mixtral (8 experts, top 2) on 4 tokens, which its routing spreads as checked below."""
    model, inputs = build("mixtral-custom-routing", dtype=torch.float32)
    return model, (inputs[0][:, :4],)


def _train_mixtral(plan_json):
    """One Adam step of the parallel and the single-device Mixtral: the largest differences (as side_by_side.train)."""
    ref, inputs = _mixtral_inputs()
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=False,
                                    plan=Plan.from_json(plan_json))
    opt, ref_opt = torch.optim.Adam(pmodel.parameters(), lr=LR), torch.optim.Adam(ref.parameters(), lr=LR)
    out, ref_out = pmodel(*inputs), ref(*inputs)
    diffs = {"output": max_diff(out.logits, ref_out.logits), "scale": ref_out.logits.abs().max().item()}
    loss_of(out).backward()
    loss_of(ref_out).backward()
    pairs = list(zip(pmodel.parameters(), ref.parameters()))
    diffs["grad"] = max(max_diff(p.grad.full_tensor(), q.grad) for p, q in pairs)
    diffs["grad_scale"] = max(q.grad.abs().max().item() for _, q in pairs)
    opt.step(), ref_opt.step()
    diffs["param"] = max(max_diff(p.full_tensor(), q) for p, q in pairs)
    diffs["sharded"] = [n for n, p in pmodel.named_parameters() if p.placements[0] == Shard(0) and p.ndim == 3]
    diffs["table"] = pmodel.plan.table() if dist.get_rank() == 0 else None
    return diffs


def test_mixtral_with_its_experts_split_and_gathered_trains_like_single_device(ranks2):
    model, inputs = _mixtral_inputs()
    routed = []
    hooks = [layer.mlp.experts.register_forward_pre_hook(
        lambda m, args: routed.append(torch.bincount(args[1].flatten(), minlength=m.num_experts).tolist()))
        for layer in model.model.layers]
    model(*inputs)
    for hook in hooks:
        hook.remove()
    # experts 0-3 on rank 0, 4-7 on rank 1: experts without rows, and in layer 2 a rank without any
    assert routed == [[0, 1, 2, 1, 0, 2, 1, 1], [0, 2, 2, 4, 0, 0, 0, 0]], routed
    plan = with_experts_gathered(autojigsaw.plan(model, inputs, MESH, device="cpu"))
    assert len(grouped_nodes(plan)) == 4, plan.table(every_node=True)
    results = ranks2.run(_train_mixtral, plan.to_json())
    assert len(results[0]["sharded"]) == 4, results[0]["sharded"]  # gate_up_proj and down_proj of both layers
    eps = torch.finfo(torch.float32).eps
    print(*(f"rank {r}: output {d['output'] / max(d['scale'], 1) / eps:.1f} eps, grad {d['grad'] / d['grad_scale'] / eps:.1f} "
            f"eps (of the largest), param {d['param']:.2e}" for r, d in enumerate(results)), sep="\n")
    check(results)
