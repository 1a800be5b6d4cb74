"""Vocab-parallel cross-entropy: the kernel alone, then language models whose loss uses it.

The kernel runs on each rank's chunk of the classes (uneven: 97 classes over 2 and 4 ranks) and
is checked against F.cross_entropy on the whole logits: loss and d logits, fp32 and fp64, with
ignored targets, every reduction, label smoothing, and rows also sharded (a global mean).
Then a tiny Llama and GPT-2 return their loss for `labels=` and train one Adam step on
{"tensor": 2} and a 2x2 mesh next to one device: the plan must run the loss by the kernel
(no fallback), keep the logits sharded (1/N of them per rank) and predict the bytes sent exactly.
A bare head with many rows puts them over "data" and the classes over "tensor": a global mean.
"""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autojigsaw
from autojigsaw import Plan
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.kernels.cross_entropy import vocab_parallel_cross_entropy
from autojigsaw.mesh import MeshAxis
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.placements import Partial, Shard, chunk_sizes

from .cost_checks import CPU_100US
from .hf_models import hf_model

V, ROWS = 97, 12  # 97 classes split unevenly over 2 and 4 ranks
VOCAB = 509  # the language models' (prime: uneven over 2 ranks)
LR, EPS = 1e-2, 1e-8  # Adam's
LM_HEAD = {"llama": "linear_14", "gpt2": "linear"}  # the node making the logits
FP32_U = 2.0**-24


def _chunk(t, dim, n, r):
    sizes = chunk_sizes(t.shape[dim], n)
    return t.narrow(dim, sum(sizes[:r]), sizes[r])


def _tol(dtype):
    return dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)


def _kernel_case(row_split: int):
    """Every setting on this rank's class chunk (rows over `row_split` groups); failures as text."""
    n, r = dist.get_world_size(), dist.get_rank()
    classes_n = n // row_split
    world = dist.group.WORLD.group_name
    if row_split == 1:
        class_group, count_over, class_r, row_r = world, (), r, 0
    else:  # a 2x2 mesh: rows over dim 0, classes over dim 1
        mesh = get_mesh((row_split, classes_n), ("rows", "classes"))
        class_group = mesh.get_group("classes").group_name
        row_r, class_r = mesh.get_coordinate()
        count_over = (MeshAxis("rows", row_split, mesh.get_group("rows").group_name, row_r),)
    fails = []
    cases = [(dtype, shape, reduction, smoothing) for dtype in (torch.float32, torch.float64)
             for shape in ((ROWS, V), (3, V, 4)) for reduction in ("mean", "sum", "none")
             for smoothing in (0.0, 0.1) if shape == (ROWS, V) or dtype == torch.float64]
    for dtype, shape, reduction, smoothing in cases:
        torch.manual_seed(0)
        x = (3 * torch.randn(shape, dtype=dtype)).requires_grad_()
        target = torch.randint(0, V, shape[:1] + shape[2:])
        target.view(-1)[::4] = -100  # ignored rows
        target.view(-1)[1] = V - 1  # the last class: owned by the last non-empty chunk
        ref = F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)
        g = torch.randn(ref.shape, dtype=dtype)
        (ref * g).sum().backward()
        sizes = chunk_sizes(V, classes_n)
        mine = _chunk(_chunk(x.detach(), 0, row_split, row_r), 1, classes_n, class_r).requires_grad_()
        t = _chunk(target, 0, row_split, row_r)
        loss = vocab_parallel_cross_entropy(
            mine, t, reduction, -100, smoothing, classes=V, offset=sum(sizes[:class_r]),
            axis=MeshAxis("classes", classes_n, class_group, class_r),
            count_over=count_over if reduction == "mean" else ())
        gl = g if reduction != "none" else _chunk(g, 0, row_split, row_r)
        (loss * gl).sum().backward()
        name = f"{dtype} {shape} {reduction} smoothing={smoothing} rows/{row_split}"
        want = ref.detach() if reduction != "none" else _chunk(ref.detach(), 0, row_split, row_r)
        if reduction != "none" and row_split > 1:  # this rank's part of the sum over row groups
            parts = [torch.zeros_like(loss) for _ in range(n)]
            dist.all_gather(parts, loss.detach())
            got = sum(parts[k] for k in range(0, n, classes_n))
        else:
            got = loss.detach()
        if not torch.allclose(got, want, **_tol(dtype)):
            fails.append(f"{name} loss: {got} != {want}")
        dwant = _chunk(_chunk(x.grad, 0, row_split, row_r), 1, classes_n, class_r)
        if mine.grad.dtype != dtype or not torch.allclose(mine.grad, dwant, **_tol(dtype)):
            fails.append(f"{name} dx: max err {(mine.grad - dwant).abs().max().item():.3g}")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_kernel_matches_cross_entropy(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_kernel_case, 1) == [[]] * world


def test_kernel_with_rows_sharded_takes_the_global_mean(ranks4):
    assert ranks4.run(_kernel_case, 2) == [[]] * 4


# ---------------------------------------------------------------- language models


class LossOnly(torch.nn.Module):
    """A causal LM called with `labels=`, returning its loss (as a training loop reads `.loss`)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(ids, labels=labels).loss


def _lm(name: str, dtype=torch.float64, vocab: int = VOCAB):
    """(model, (ids, labels)): a tiny `name` on 4 x 32 tokens, its first three labels ignored (-100).

    As in real training, the logits outweigh the embedding: more rows (128) than hidden units (64),
    more classes than hidden units (gathering GPT-2's tied embedding for the lookup then costs
    less than gathering the logits).
    """
    lm, _ = hf_model(name)
    lm.config.vocab_size = vocab
    torch.manual_seed(0)
    lm = type(lm)(lm.config)
    ids = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    return LossOnly(lm).to(dtype).train(), (ids, labels)


class Head(torch.nn.Module):
    """A language model's head and loss alone, in fp64 (no upcast): 8 x 256 tokens, more rows than weights."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, VOCAB)

    def forward(self, h, labels):
        return F.cross_entropy(self.proj(h).flatten(0, 1), labels.flatten())


def _build(name: str):
    if name != "head":
        return _lm(name)
    torch.manual_seed(0)
    labels = torch.randint(0, VOCAB, (8, 256))
    labels[:3, :40] = -100  # ignored: 120 in the first data rank's rows, none in the second's
    return Head().to(torch.float64), (torch.randn(8, 256, 4, dtype=torch.float64), labels)


def _plan(name: str, mesh: dict) -> Plan:
    """The plan under 0.7 of the 1-rank plan's bytes, so that weights and logits get sharded.

    On links of 100 us: with the "cpu" spec's measured 0.5 ms, GPT-2's loss and the head's rows stay
    whole (their collectives cost more than the compute they save at these sizes)."""
    model, inputs = _build(name)
    whole = autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu").memory_per_rank
    # DDP on a data axis: these tests count the graph's own traffic (FSDP's is FSDP's to count)
    return autojigsaw.plan(model, inputs, mesh, device=CPU_100US, memory_budget=int(0.7 * whole),
                           data_parallel="ddp" if "data" in mesh else None)


def _train(name: str, shape: tuple, axes: tuple, plan: str) -> dict:
    """One Adam step next to one device: largest differences, bytes counted and predicted."""
    ref, inputs = _build(name)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh(shape, axes), inputs, compile=False,
                                    plan=Plan.from_json(plan))
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=LR, eps=EPS) for m in (pmodel, ref))
    with count_comm() as log:
        loss = pmodel(*inputs)
        loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    out = {"loss": abs(loss.item() - ref_loss.item()), "loss_scale": abs(ref_loss.item()),
           "grad": 0.0, "grad_scale": 0.0, "param": 0.0, "step_excess": 0.0}
    # Adam's first step is lr g / (|g| + eps): a gradient off by dg moves it by up to
    # lr eps dg / (|g| + eps)^2, much more than dg where |g| is near eps.
    allowed = []
    for p, q in zip(pmodel.parameters(), ref.parameters()):
        dg = (p.grad.full_tensor() - q.grad).abs()
        out["grad"] = max(out["grad"], dg.max().item())
        out["grad_scale"] = max(out["grad_scale"], q.grad.abs().max().item())
        allowed.append(2 * LR * EPS * dg / (q.grad.abs() + EPS) ** 2)
    opt.step(), ref_opt.step()
    for p, q, a in zip(pmodel.parameters(), ref.parameters(), allowed):
        dp = (p.full_tensor() - q).abs()
        out["param"] = max(out["param"], dp.max().item())
        out["step_excess"] = max(out["step_excess"], (dp - a).max().item())
    out["measured"] = log.total_bytes
    program = pmodel.program
    out["predicted"] = sum(traffic_by_origin(program.graph, program.rank, set(program.captured.params), True).values())
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("mesh", [{"tensor": 2}, {"data": 2, "tensor": 2}], ids=["tensor2", "data2xtensor2"])
def test_language_model_loss_is_vocab_parallel_and_trains_like_one_device(name, mesh, ranks2, ranks4):
    plan = _plan(name, mesh)
    loss = plan.node("cross_entropy_loss")
    assert loss.kernel == "vocab_parallel_cross_entropy" and not loss.fallback, plan.table()
    tensor = list(mesh).index("tensor")
    rows, chunk = 4 * 32, -(-VOCAB // 2)
    # Every value with the classes as its last dim stays sharded over them: 1/N of the logits per rank.
    logits = [n for n in plan.nodes if n.kind not in ("param", "input") and n.shape and n.shape[-1] == VOCAB]
    assert LM_HEAD[name] in {n.name for n in logits}
    for n in logits:
        assert n.output[tensor] == Shard(len(n.shape) - 1), (n.name, n.output)
    # The loss keeps its fp32 chunk of the logits, a log-sum-exp and a target per row, and its output
    # and output gradient (a replicated loss would keep the whole log-softmax: rows x VOCAB x 4 bytes).
    assert loss.memory_bytes == rows * chunk * 4 + rows * (4 + 8) + 2 * 4, loss.memory_bytes
    # One all-gather of 3 fp32 statistics per row of this rank's rows; on a data axis, perhaps the
    # labels too: HF pads them (shifted) before the loss, and whether that pad runs on the batch shards
    # (then the loss gathers the int64 labels of the other data rank) or after they are gathered is a
    # tie in time, which the solver breaks either way. The logits never move.
    row_ranks = math.prod(s for a, s in enumerate(mesh.values()) if loss.inputs[0][a] == Shard(0))
    stats = 3 * 4 * (rows // row_ranks)
    data = mesh.get("data", 1)
    labels = 8 * rows // data * (data - 1)  # the other data ranks' labels, where they arrive split
    assert loss.comm_bytes in (stats, stats + labels), loss.comm_bytes
    pool = ranks2 if len(mesh) == 1 else ranks4
    for rank, r in enumerate(pool.run(_train, name, tuple(mesh.values()), tuple(mesh), plan.to_json())):
        # HF's loss upcasts the logits to fp32: loss and gradients agree to fp32 rounding
        assert r["loss"] <= 16 * FP32_U * r["loss_scale"], r
        assert r["grad"] <= 16 * FP32_U * r["grad_scale"], r
        assert r["step_excess"] <= 1e-14, r
        assert r["measured"] == r["predicted"] > 0, r
        if rank == 0:
            assert r["measured"] == plan.comm_bytes, (r, plan.comm_bytes)


def test_rows_over_the_data_axis_take_the_global_mean(ranks4):
    """Rows over "data", classes over "tensor": the mean divides by the count of every rank's targets."""
    mesh = {"data": 2, "tensor": 2}
    plan = _plan("head", mesh)
    loss = plan.node("cross_entropy_loss")
    assert loss.kernel == "vocab_parallel_cross_entropy" and loss.inputs[0] == (Shard(0), Shard(1)), plan.table()
    assert loss.outputs[0][0] == Partial(), loss.outputs
    for rank, r in enumerate(ranks4.run(_train, "head", (2, 2), tuple(mesh), plan.to_json())):
        assert r["loss"] <= 1e-14 * r["loss_scale"] and r["grad"] <= 1e-14 * r["grad_scale"], r
        assert r["step_excess"] <= 1e-14, r
        assert r["measured"] == r["predicted"] > 0, r
        if rank == 0:
            assert r["measured"] == plan.comm_bytes, (r, plan.comm_bytes)


def _compiled_loss(plan: str) -> tuple[float, float, float]:
    """(loss, reference loss, largest gradient difference) of the head compiled (fullgraph)."""
    ref, inputs = _build("head")
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), get_mesh((2,), ("tensor",)), inputs, compile=True,
                                    plan=Plan.from_json(plan))
    loss, ref_loss = pmodel(*inputs), ref(*inputs)
    loss.backward(), ref_loss.backward()
    grad = max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(pmodel.parameters(), ref.parameters()))
    return loss.item(), ref_loss.item(), grad


def test_kernel_compiles_without_graph_breaks(ranks2):
    plan = _plan("head", {"tensor": 2})
    assert plan.node("cross_entropy_loss").kernel == "vocab_parallel_cross_entropy", plan.table()
    for loss, ref, grad in ranks2.run(_compiled_loss, plan.to_json()):
        assert abs(loss - ref) <= 1e-14 * abs(ref) and grad <= 1e-14, (loss, ref, grad)


def _loss_and_logits_term(shape: tuple, axes: tuple, plan: str) -> dict:
    """GPT-2 returning its loss and its logits, trained on the loss plus a term of the logits (as a z-loss
    adds one): differences from one device."""
    model, (ids, labels) = _lm("gpt2")
    pmodel = autojigsaw.parallelize(copy.deepcopy(model.lm), get_mesh(shape, axes), (ids,), compile=False,
                                    example_kwargs={"labels": labels}, plan=Plan.from_json(plan))
    outs = [m(ids, labels=labels) for m in (pmodel, model.lm)]
    losses = [out.loss + 1e-2 * out.logits.square().mean() for out in outs]
    for loss in losses:
        loss.backward()
    grads = [(p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(pmodel.parameters(), model.parameters())]
    return {"sharded": type(outs[0].logits).__name__,
            "loss": abs(losses[0].full_tensor().item() - losses[1].item()), "loss_scale": losses[1].item(),
            "grad": max(grads), "grad_scale": max(q.grad.abs().max().item() for q in model.parameters())}


def test_a_loss_with_a_term_of_the_sharded_logits_trains_like_one_device(ranks2):
    """The logits come back as a DTensor beside the loss; adding a term of them to the plain loss sends a
    DTensor gradient into the program's backward, which failed deep in torch ("got mixed torch.Tensor
    and DTensor") until the loss's gradient was made whole."""
    model, (ids, labels) = _lm("gpt2")
    whole = autojigsaw.plan(model.lm, (ids,), {"tensor": 1}, device="cpu", example_kwargs={"labels": labels})
    plan = autojigsaw.plan(model.lm, (ids,), {"tensor": 2}, device=CPU_100US, example_kwargs={"labels": labels},
                           memory_budget=int(0.7 * whole.memory_per_rank))
    for r in ranks2.run(_loss_and_logits_term, (2,), ("tensor",), plan.to_json()):
        assert r["sharded"] == "DTensor", r
        assert r["loss"] <= 16 * FP32_U * r["loss_scale"], r
        assert r["grad"] <= 16 * FP32_U * r["grad_scale"], r
