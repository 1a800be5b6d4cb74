"""Mixtral, Qwen3-MoE and DeepSeek-V3 with their experts behind a token dispatch train like one device.

Hugging Face's models (tests/moe_models.py) on 2 and 4 gloo ranks, experts over data=2, over
data=2 x tensor=2 (one all-to-all over the four ranks) and over data=4: the loss, every gradient
and every parameter after an AdamW step equal the single device's in fp32. Routings: the model's
own; every token to rank 0's experts (the worst imbalance, priced with moe_imbalance = the
group's size); one expert per rank, the others receiving no token; top-k equal to the number of
experts. At a forced routing every rank's measured bytes equal its predicted bytes.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.api import capture_for
from autojigsaw.kernels import collectives as C
from autojigsaw.mesh import MeshSpec, RankView
from autojigsaw.placements import chunk_sizes
from autojigsaw.rewrite.rewrite import rewrite
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.strategies.rules.routed_experts_cost import IMBALANCE
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.training import Precision, Regime

from .moe_models import moe_model, with_dispatch
from .side_by_side import loss_of, max_diff

MESHES = {"data=2": (("data", 2),), "data=2 x tensor=2": (("data", 2), ("tensor", 2)), "data=4": (("data", 4),)}
FP32_TOL = 40 * torch.finfo(torch.float32).eps  # relative to the largest value, as tests/test_expert_parallel.py
# bf16: one rounding per matmul on the path (tests/test_moe.py's bound: 2 layers x 7 + the head)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: 15 * 2.0**-8}
LR, ADAM_EPS = 1e-2, 1e-8


def routing(case: str, n: int, name: str) -> tuple[dict, float | None]:
    """(moe_model keywords, moe_imbalance to predict its bytes at; None: the model's own routing)."""
    if case == "own":
        return {}, None
    if case == "all to rank 0":  # the first two experts of rank 0's block
        return {"chosen": (0, 1)}, float(n)
    if case == "an expert without tokens":  # one expert per rank: each rank's share is its balanced one
        first = [sum(chunk_sizes(8, n)[:r]) for r in range(n)]
        return {"chosen": tuple(first), "top_k": n, "groups": (4, n)}, 1.0
    if case == "top-k = experts":
        return {"experts": 4, "top_k": 4, "groups": (2, 2)}, 1.0
    if case == "experts the ranks do not divide":  # torch.chunk's blocks: 3 and 2 on two ranks, 2, 2, 1, 0 on four
        return {"experts": 5, "groups": (1, 1)}, None
    raise ValueError(case)


@functools.cache
def planned(name: str, mesh: str, case: str, dtype: torch.dtype = torch.float32, data_parallel: str = "ddp",
            aux: bool = False) -> str:
    """The planner's plan, every routed-experts node dispatched over all the mesh's axes, priced at the case's routing."""
    n = MeshSpec.of(dict(MESHES[mesh])).world_size
    kwargs, imbalance = routing(case, n, name)
    model, inputs = moe_model(name, dtype=dtype, aux_loss=aux, **kwargs)
    plan = autojigsaw.plan(model, inputs, dict(MESHES[mesh]), device="cpu", data_parallel=data_parallel)
    plan = with_dispatch(plan, tuple(a for a, _ in MESHES[mesh]))
    return autojigsaw.evaluate(plan, model, inputs, device="cpu", moe_imbalance=imbalance).to_json()


def predicted_bytes(name: str, mesh: str, case: str, plan_json: str, dtype: torch.dtype = torch.float32) -> list[int]:
    """Every rank's predicted bytes (the plan states rank 0's), read off its own rewritten graph (FSDP's own
    gathers and reduce-scatters, which the plan adds, aside)."""
    plan = Plan.from_json(plan_json)
    model, inputs = moe_model(name, dtype=dtype, **routing(case, plan.mesh.world_size, name)[0])
    captured = capture_for(model, inputs, {}, Regime(data_parallel="ddp"))
    out = []
    for r in range(plan.mesh.world_size):
        rank = RankView(plan.mesh, _coord(r, plan.mesh.sizes), (None,) * plan.mesh.ndim)
        gm = rewrite(captured, plan, rank, training=True)
        gm.meta[IMBALANCE] = plan.moe_imbalance
        out.append(sum(traffic_by_origin(gm, rank, captured.trained_params, True).values()))
    return out


def _coord(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for size in reversed(sizes):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def _train(name: str, mesh: tuple, plan_json: str, kwargs: dict, dtype: torch.dtype = torch.float32,
           compile: bool | str = False) -> dict:
    """One AdamW step of the parallel and the single-device model: largest differences, bytes sent."""
    ref, inputs = moe_model(name, dtype=dtype, **kwargs)
    device_mesh = get_mesh(tuple(n for _, n in mesh), tuple(a for a, _ in mesh))
    plan = Plan.from_json(plan_json)
    pmodel = autojigsaw.parallelize(copy.deepcopy(ref), device_mesh, inputs, compile=compile, plan=plan)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (pmodel, ref))
    with C.count_comm() as log:
        out = pmodel(*inputs)
        loss = loss_of(out)
        loss.backward()
    ref_loss = loss_of(ref(*inputs))
    ref_loss.backward()
    pairs = list(zip(pmodel.parameters(), ref.parameters()))
    diffs = {"loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
             "grad": max(max_diff(p.grad.full_tensor(), q.grad) for p, q in pairs),
             "grad_scale": max(q.grad.abs().max().item() for _, q in pairs)}
    opt.step(), ref_opt.step()
    diffs["param"] = max(max_diff(p.full_tensor(), q) for p, q in pairs)
    diffs["sent"] = log.total_bytes
    diffs["expert_weights"] = sorted({str(p.placements) for n, p in pmodel.named_parameters() if ".experts." in n})
    units = pmodel.program.units
    held = set() if units is None else {k for h in (units.root, *units.units.values()) for k in h._parameters}
    params = pmodel.program.captured.params
    diffs["fsdp_holds"] = sorted(params[k] for k in held if k in params)
    diffs["table"] = pmodel.plan.table() if dist.get_rank() == 0 else None
    return diffs


def check(results: list[dict], mesh: str, tol: float = FP32_TOL) -> None:
    for r in results:
        grad_tol = tol * r["grad_scale"]
        assert r["loss"] <= tol, (r["loss"], r["table"])
        assert r["grad"] <= grad_tol, (r["grad"], grad_tol, r["table"])
        assert r["param"] <= tol + LR * grad_tol / ADAM_EPS, (r["param"], r["table"])
        # the experts split over every axis of the mesh: no rank holds another's experts
        assert r["expert_weights"] == [str(tuple(Shard(0) for _ in MESHES[mesh]))], r["expert_weights"]


def run_case(pool, name: str, mesh: str, case: str, dtype: torch.dtype = torch.float32,
             data_parallel: str = "ddp", compile: bool | str = False) -> list[dict]:
    """Train `name` with its experts dispatched over every axis of `mesh`; check it (and the bytes, at a forced routing)."""
    plan = planned(name, mesh, case, dtype, data_parallel)
    kwargs, imbalance = routing(case, MeshSpec.of(dict(MESHES[mesh])).world_size, name)
    results = pool.run(_train, name, MESHES[mesh], plan, kwargs, dtype, compile)
    check(results, mesh, TOL[dtype])
    if imbalance is not None and not compile:  # a forced routing (compiled collectives are not counted)
        predicted = predicted_bytes(name, mesh, case, plan, dtype)
        print(f"{name} on {mesh}, {case}: bytes sent per rank {[r['sent'] for r in results]}, predicted {predicted}")
        assert [r["sent"] for r in results] == predicted
        if data_parallel == "ddp":  # the plan's bytes are rank 0's, FSDP's included
            assert results[0]["sent"] == Plan.from_json(plan).comm_bytes
    return results


NAMES = ["mixtral", "qwen3_moe", "deepseek_v3"]
CASES = ["own", "all to rank 0", "an expert without tokens", "top-k = experts"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_experts_over_data_2(ranks2, name, case):
    run_case(ranks2, name, "data=2", case)


# on four ranks every model once per mesh, the routings taken in turn (four ranks on two cores are slow)
@pytest.mark.parametrize("name, case", [("mixtral", "all to rank 0"), ("qwen3_moe", "top-k = experts"),
                                        ("deepseek_v3", "own")])
def test_experts_over_data_2_x_tensor_2(ranks4, name, case):
    """One all-to-all over the four ranks while the rest of the plan uses tensor as it chose (parallel folding)."""
    run_case(ranks4, name, "data=2 x tensor=2", case)


@pytest.mark.parametrize("name, case", [("mixtral", "an expert without tokens"), ("qwen3_moe", "own"),
                                        ("deepseek_v3", "all to rank 0"),
                                        ("mixtral", "experts the ranks do not divide")])
def test_experts_over_data_4(ranks4, name, case):
    run_case(ranks4, name, "data=4", case)


def test_experts_the_ranks_do_not_divide_split_unevenly(ranks2):
    run_case(ranks2, "qwen3_moe", "data=2", "experts the ranks do not divide")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_bf16_experts_run_torch_grouped_mm_behind_the_dispatch(ranks2, name):
    plan = Plan.from_json(planned(name, "data=2", "all to rank 0", torch.bfloat16))
    routed = [n for n in plan.nodes if n.op == "autojigsaw.routed_experts"]
    assert routed and all(n.note == "data: token dispatch" for n in routed), plan.table(every_node=True)
    model, inputs = moe_model(name, dtype=torch.bfloat16, **routing("all to rank 0", 2, name)[0])
    graph = capture_for(model, inputs, {}, Regime()).gm.graph
    assert {n.args[5] for n in graph.nodes if "routed_experts" in str(n.target)} == {"aten._grouped_mm.default"}
    run_case(ranks2, name, "data=2", "all to rank 0", torch.bfloat16)


def test_under_fsdp_the_experts_stay_split_over_the_data_axis_and_the_rest_is_fsdps(ranks2):
    """FSDP (parallelize's default on a data axis) shards every other weight; the experts' are the plan's."""
    results = run_case(ranks2, "qwen3_moe", "data=2", "top-k = experts", data_parallel="fsdp")
    held = results[0]["fsdp_holds"]
    assert held and not any(".experts." in fqn for fqn in held), held
    assert any(".self_attn." in fqn for fqn in held), held


def test_the_whole_program_traces_fullgraph(ranks2):
    """torch.compile (aot_eager: dynamo's graph, fullgraph, and the traced backward) of Mixtral with its dispatch."""
    run_case(ranks2, "mixtral", "data=2", "all to rank 0", compile="aot_eager")


def test_the_routers_load_balancing_loss_over_split_tokens(ranks2):
    """Mixtral returning its loss plus its router's load-balancing loss (over every token of every rank)."""
    plan = Plan.from_json(planned("mixtral", "data=2", "own", aux=True))
    assert any(n.note == "data: token dispatch" for n in plan.nodes), plan.table(every_node=True)
    check(ranks2.run(_train, "mixtral", MESHES["data=2"], plan.to_json(), {"aux_loss": True}), "data=2")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_routers_keep_their_precision_under_mixed_precision(name):
    """With bf16 compute the router computes its scores in fp32 as the model writes it (Mixtral: a float
    softmax; DeepSeek-V3: an fp32 linear), and routed experts take them so, beside bf16 tokens and weights."""
    model, inputs = moe_model(name)
    graph = capture_for(model, inputs, {}, Regime(Precision(torch.bfloat16, torch.float32))).gm.graph
    routed = [n for n in graph.nodes if "routed_experts" in str(n.target)]
    assert routed, graph
    for node in routed:
        x, index, scores, w1, w2 = (a.meta["val"].dtype for a in node.args[:5])
        assert (x, scores, w1, w2, node.meta["val"].dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                               torch.bfloat16, torch.bfloat16), node.format_node()
