"""Attention and softmax, one op parallelized in each layout the rules offer, against one device.

Each case forces one strategy (the planner's plan, edited) and compares the output and the
gradient of every input -- dQ, dK, dV and a learnable mask each -- with the single-device
op, and the bytes each rank really sent with what the plan's accounting predicts.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw.capture import capture
from autojigsaw.ir import STRATEGIES
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.mesh import MeshSpec
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.strategies.annotate import annotate
from autojigsaw.testing.local_ranks import get_mesh

from .attention_cases import Attention, attention_case, compiled_case, forced_plan

F32, F64 = torch.float32, torch.float64
TOL = {F32: 2e-5, F64: 1e-12}
D1, T1, DT = ((2,), ("domain",)), ((2,), ("tensor",)), ((2, 2), ("domain", "tensor"))
D4 = ((4,), ("domain",))

# (kernel, output), mesh, seq_len, dtype, causal, mask, kv heads (of 4 query heads)
CASES = [
    (("ring_attention", "S(2)"), D1, 16, F64, True, None, 4),
    (("ring_attention", "S(2)"), D1, 9, F64, False, "float_rows", 4),  # learnable, row-broadcast
    (("ring_attention_zigzag", "S(2)"), D1, 9, F64, True, "bool", 4),
    (("kv_gather_attention", "S(2)"), D1, 9, F32, True, None, 2),
    (("local", "S(1)"), T1, 8, F64, False, "float", 2),  # heads, GQA, learnable [H, S, S] bias
    (("local", "S(1)"), T1, 8, F64, True, None, 1),  # heads, one kv head: K, V replicated
    (("local", "S(0)"), D1, 8, F32, False, "padding", 4),  # batch
    (("ring_attention", "S(2)"), D4, 13, F32, True, None, 2),  # 4, 3, 3, 3 tokens, GQA
    (("ring_attention", "S(2)"), D4, 10, F64, False, "float", 4),
    (("ring_attention_zigzag", "S(2)"), D4, 16, F64, True, "bool", 4),
    (("kv_gather_attention", "S(2)"), D4, 7, F64, False, "padding", 4),
    (("ring_attention", "S(2),S(1)"), DT, 8, F64, True, None, 2),  # sequence x heads
    (("ring_attention_zigzag", "S(2),S(0)"), DT, 12, F32, True, "padding", 4),  # sequence x batch
    (("kv_gather_attention", "S(2),S(2)"), DT, 9, F64, True, None, 4),  # rows over both axes
]


@pytest.mark.parametrize("pick,mesh,seq_len,dtype,causal,mask,kv_heads", CASES,
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_attention_matches_single_device(ranks2, ranks4, pick, mesh, seq_len, dtype, causal, mask, kv_heads):
    pool = ranks2 if mesh[0] == (2,) else ranks4
    results = pool.run(attention_case, pick, *mesh, seq_len, dtype, causal, mask, kv_heads)
    for errors, sent, predicted, kernel, rank in results:
        assert kernel == pick[0]
        assert all(e <= TOL[dtype] for e in errors.values()), (rank, errors)
        assert sent == predicted, (rank, sent, predicted)
    assert {"dq", "dk", "dv"} <= results[0][0].keys()
    if mask in ("float", "float_rows"):
        assert "dmask" in results[0][0]


def _strategies(q_shape, kv_shape, mesh) -> list:
    """The attention node's strategies for q and k, v of these shapes (GQA) on `mesh`."""
    kv = torch.empty(kv_shape)
    captured = capture(Attention(gqa=True), (torch.empty(q_shape), kv, kv))
    annotate(captured.gm, MeshSpec.of(mesh))
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    node = next(n for n in captured.gm.graph.nodes if n.target == sdpa)
    return node.meta[STRATEGIES]


def test_heads_that_cannot_keep_their_groups_are_not_split():
    # torch.chunk splits 6 query heads 3 + 3 but their 3 kv heads 2 + 1: rank 1 would lack
    # the kv head of query head 3 -- so no strategy splits heads, and every one says why
    strategies = _strategies((2, 6, 8, 8), (2, 3, 8, 8), {"domain": 2, "tensor": 2})
    assert not any(Shard(1) in s.inputs[0] for s in strategies)
    assert all("heads not split" in s.note for s in strategies)
    # 8 query heads over 4 kv heads split 2 x 2 ways: each rank 2 query heads and their kv head
    strategies = _strategies((2, 8, 8, 8), (2, 4, 8, 8), {"domain": 2, "tensor": 2})
    assert any(s.inputs[0] == s.inputs[1] == (Shard(1), Shard(1)) for s in strategies)


def test_one_kv_head_splits_query_heads_only():
    strategies = _strategies((2, 4, 8, 8), (2, 1, 8, 8), {"tensor": 2})
    heads = [s.inputs[:3] for s in strategies if Shard(1) in s.inputs[0]]
    assert heads == [((Shard(1),), (Replicate(),), (Replicate(),))]


class Softmax(torch.nn.Module):
    """One softmax-like op over `dim`, by the name its captured node has."""

    OPS = {"softmax": "aten.softmax.int", "log_softmax": "aten.log_softmax.int",
           "_softmax": "aten._softmax", "to_float": "aten.softmax.int", "safe": "aten._safe_softmax"}

    def __init__(self, op: str, dim: int):
        super().__init__()
        self.op, self.dim = op, dim

    def forward(self, x):
        if self.op == "softmax":
            return x.softmax(self.dim)
        if self.op == "log_softmax":
            return torch.log_softmax(x, self.dim)
        if self.op == "_softmax":
            return torch.ops.aten._softmax(x, self.dim, False)
        if self.op == "to_float":
            return x.softmax(self.dim, dtype=torch.float32)
        return torch.ops.aten._safe_softmax(x, self.dim)


def softmax_case(op, mesh_shape, names, shape, dim, dtype, pick):
    """Forced layout vs one device, rows of -inf included: output, gradient, bytes sent vs predicted."""
    mesh = get_mesh(mesh_shape, names)
    model = Softmax(op, dim)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 1] = float("-inf")  # a row with no finite entry, over every rank's chunk
    x[1, :, 2] = float("-inf")
    plan = forced_plan(model, (x,), MeshSpec.of(mesh), {Softmax.OPS[op]: pick})
    pmodel = autojigsaw.parallelize(model, mesh, (x,), plan=plan, compile=False)
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    with count_comm() as log:
        y = pmodel(mine)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=y.dtype)
        y.masked_fill(y.isinf(), 0).backward(g)
    y_ref = model(ref)
    y_ref.masked_fill(y_ref.isinf(), 0).backward(g)
    errors = {"out": (y - y_ref).nan_to_num().abs().max().item(),
              "grad": (mine.grad - ref.grad).nan_to_num().abs().max().item()}
    program = pmodel.program
    predicted = traffic_by_origin(program.graph, program.rank, set(program.captured.inputs), True)
    node = next(n for n in plan.nodes if n.op == Softmax.OPS[op])
    same = torch.equal(y.isnan(), y_ref.isnan()) and y.dtype == y_ref.dtype
    return errors, same, log.total_bytes, sum(predicted.values()), node.kernel


SOFTMAX_CASES = [
    ("softmax", D1, (2, 3, 8), -1, F64, ("sharded_softmax", "S(2)")),
    ("log_softmax", D4, (2, 3, 10), 2, F32, ("sharded_softmax", "S(2)")),  # 3, 3, 3, 1
    ("_softmax", D4, (2, 3, 6), 1, F64, ("local", "S(2)")),  # another dim sharded: local
    ("safe", D4, (2, 3, 7), -1, F64, ("sharded_softmax", "S(2)")),  # all -inf rows give 0
    ("to_float", D1, (2, 3, 8), -1, torch.bfloat16, ("sharded_softmax", "S(2)")),
    ("softmax", DT, (2, 4, 8), -1, F32, ("sharded_softmax", "S(2),S(1)")),
]


@pytest.mark.parametrize("op,mesh,shape,dim,dtype,pick", SOFTMAX_CASES,
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_softmax_matches_single_device(ranks2, ranks4, op, mesh, shape, dim, dtype, pick):
    pool = ranks2 if mesh[0] == (2,) else ranks4
    tol = 1e-12 if dtype == F64 else 1e-6
    for errors, same, sent, predicted, kernel in pool.run(softmax_case, op, *mesh, shape, dim, dtype, pick):
        assert kernel == pick[0] and same
        assert errors["out"] <= tol and errors["grad"] <= tol, errors
        assert sent == predicted


def test_compiled_zigzag_ring_has_no_graph_breaks(ranks2):
    """The one compiled case: relayouts, ring hops and their backward, one graph."""
    for r in ranks2.run(compiled_case, ("ring_attention_zigzag", "S(2)"), 12, 2, timeout=600):
        assert r["breaks"] == 0 and r["graphs"] == 1, r
        assert all(e <= TOL[F32] for e in r["errors"].values()), r
