"""Attention inside whole models -- a Hugging Face ViT, a GPT-style block, attention written out
by hand -- trained on 1-D and 2-D meshes against one device; and what the planner picks alone.

Multi-rank cases force the attention layout (the planner's plan, edited) and let the planner
lay out everything else; planner cases run no process and check the choice the costs make.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw import Plan

from .attention_cases import SDPA, Attention, GPTBlock, VisionAttention, model_case

F32, F64 = torch.float32, torch.float64
TOL = {F32: 2e-5, F64: 1e-12}
S1, R, S1R = (Shard(1),), (Replicate(),), (Shard(1), Replicate())
MATMUL = "aten.matmul"

# model, mesh, names, forced strategies, input placements, dtype
CASES = [
    ("gpt", (2,), ("domain",), {SDPA: ("ring_attention_zigzag", "S(2)")}, [S1], F64),
    ("gpt", (2, 2), ("domain", "tensor"), {SDPA: ("ring_attention", "S(2),S(1)")}, [S1R], F32),
    ("gpt3", (2,), ("tensor",), {SDPA: ("local", "S(1)")}, [R], F64),  # 3 heads over 2 ranks
    ("vit", (2,), ("domain",), {SDPA: ("ring_attention", "S(2)")}, None, F64),  # 17 tokens
    ("vit", (2, 2), ("domain", "tensor"), {SDPA: ("kv_gather_attention", "S(2),S(1)")}, None, F32),
    # q @ k^T, softmax, @ v: query rows against gathered K/V ...
    ("vision", (2,), ("domain",), {MATMUL: ("local", "S(2)")}, [S1], F64),
    # ... and keys sharded: a sharded softmax over keys, then a partial sum over them
    ("vision", (2,), ("domain",), {"matmul": ("local", "S(3)"), "softmax": ("sharded_softmax", "S(3)"),
                                   "matmul_1": ("local", "P(sum)")}, [S1], F64),
    # unbind's items read with a partial gradient (by a sharded matmul) and a full one (returned)
    ("unbind", (2,), ("domain",), {"matmul": ("local", "S(1)")}, None, F64),
]


@pytest.mark.parametrize("name,mesh,names,pick,inputs,dtype", CASES,
                         ids=lambda c: "-".join(map(str, c)) if isinstance(c, tuple) else None)
def test_training_matches_single_device(ranks2, ranks4, name, mesh, names, pick, inputs, dtype):
    pool = ranks2 if len(mesh) == 1 else ranks4
    results = pool.run(model_case, name, mesh, names, pick, inputs, dtype)
    for diffs, _ in results:
        assert all(d <= TOL[dtype] for d in diffs.values()), diffs
    plan = Plan.from_json(results[0][1])
    kernels = {n.kernel for n in plan.nodes}
    assert {k for k, _ in pick.values()} <= kernels | {"local"}, plan.table()


def _attention(plan: Plan):
    return next(n for n in plan.nodes if n.kind == "attention")


@pytest.mark.parametrize("seq_len,device,kernel", [
    (256, "h100", "kv_gather_attention"),  # short: one K/V gather beats 8 ring steps of ~6 us kernels
    (65536, "h100", "ring_attention_zigzag"),  # long: compute dominates, balance it
    (4096, "cpu", "ring_attention_zigzag"),  # slower compute per byte (and ~0.5 ms gloo rounds): balance pays earlier
])
def test_planner_picks_ring_layout_by_cost(seq_len, device, kernel):
    with torch.device("meta"):
        q = torch.empty(1, 2, seq_len, 128)  # 2 heads: too few to split over 8 ranks
    plan = autojigsaw.plan(Attention(causal=True), (q, q, q), {"domain": 8}, device=device,
                           input_placements=[(Shard(2),)] * 3)
    assert _attention(plan).kernel == kernel, plan.table()


def test_planner_splits_heads_over_tensor_and_sequence_over_domain():
    with torch.device("meta"):
        model, x = GPTBlock(d=512, heads=4, kv_heads=4, hidden=2048), torch.empty(1, 16384, 512)
    plan = autojigsaw.plan(model, (x,), {"domain": 4, "tensor": 4}, device="h100", input_placements=[S1R])
    node = _attention(plan)
    assert node.inputs[0] == (Shard(2), Shard(1)) and node.kernel == "ring_attention_zigzag", plan.table()


def test_planner_shards_heads_when_there_are_enough():
    with torch.device("meta"):
        model, x = GPTBlock(d=512, heads=4, kv_heads=4, hidden=2048), torch.empty(1, 2048, 512)
    plan = autojigsaw.plan(model, (x,), {"tensor": 4}, device="h100")
    node = _attention(plan)
    assert node.inputs[0] == (Shard(1),) and node.kernel == "local", plan.table()


def test_written_out_attention_composes_into_sequence_sharding():
    model, x = VisionAttention(d=32, heads=1), torch.empty(1, 1024, 32)  # no batch, no heads to split
    plan = autojigsaw.plan(model, (x,), {"domain": 2}, device="cpu", input_placements=[S1])
    by_name = {n.name: n for n in plan.nodes}
    # query rows against gathered keys: scores and probabilities stay row-sharded, S^2 / n each
    assert by_name["matmul"].inputs == ((Shard(2),), (Replicate(),)), plan.table()
    assert by_name["softmax"].inputs == ((Shard(2),),) and by_name["softmax"].kernel == "local"
    assert by_name["matmul_1"].inputs == ((Shard(2),), (Replicate(),))


def test_hf_gpt2_attention_is_no_longer_a_fallback():
    from .hf_models import hf_model

    model, inputs = hf_model("gpt2")
    plan = autojigsaw.plan(model, inputs, {"domain": 2, "tensor": 2}, device="h100")
    attention = [n for n in plan.nodes if n.kind == "attention"]
    assert len(attention) == 2 and not any(n.fallback for n in attention), plan.table()
