"""Mixtral, Qwen3-MoE and DeepSeek-V3 with their experts behind a token dispatch train like one device.

Hugging Face's models (tests/moe_models.py) on 2 and 4 gloo ranks, experts over data=2, over
data=2 x tensor=2 (one all-to-all over the four ranks) and over data=4: the loss, every gradient
and every parameter after an AdamW step equal the single device's in fp32. Each model is planned
and parallelized once per mesh; its routers' bias buffers then force the routings in turn: the
model's own; every token to rank 0's experts (the worst imbalance, priced with moe_imbalance =
the group's size); as many experts per rank as balance the ranks, the others receiving no token.
Top-k equal to the number of experts, 5 of them split unevenly (3 and 2 on two ranks; 2, 2, 1
and none on four), is a model of its own. At a forced routing every rank's measured bytes equal
its predicted bytes.
"""

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.api import capture_for
from autojigsaw.kernels import collectives as C
from autojigsaw.mesh import MeshSpec, RankView
from autojigsaw.rewrite.rewrite import rewrite
from autojigsaw.rewrite.traffic import traffic_by_origin
from autojigsaw.strategies.rules.routed_experts_cost import IMBALANCE
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.training import Precision, Regime

from .moe_models import moe_model, route, routed, with_dispatch
from .side_by_side import loss_of, max_diff

MESHES = {"data=2": (("data", 2),), "data=2 x tensor=2": (("data", 2), ("tensor", 2)), "data=4": (("data", 4),)}
# 16 experts, top-4 (DeepSeek-V3: the top 4 of 8 groups of 2), routers biased: every routing below is forced on it
MANY = (("experts", 16), ("top_k", 4), ("groups", (8, 4)), ("forced", True))
UNEVEN = (("experts", 5), ("top_k", 5), ("groups", (1, 1)))  # top-k = experts, which no mesh here divides
ROUTINGS = ("own", "all to rank 0", "experts without tokens")
FP32_TOL = 40 * torch.finfo(torch.float32).eps  # relative to the largest value, as tests/test_expert_parallel.py
# bf16: one rounding per matmul on the path (tests/test_moe.py's bound: 2 layers x 7 + the head)
TOL = {torch.float32: FP32_TOL, torch.bfloat16: 15 * 2.0**-8}
LR, ADAM_EPS = 1e-2, 1e-8


@functools.cache
def forced(case: str, n: int) -> tuple[tuple[int, ...] | None, float | None]:
    """(the experts every token goes to, None: its own; the moe_imbalance its bytes are exact at, None: none)
    on the MANY shape over a group of n ranks (16 / n experts each)."""
    block, k = dict(MANY)["experts"] // n, dict(MANY)["top_k"]
    if case == "own":
        return None, None
    if case == "all to rank 0":  # rank 0's first experts, the others' receive no token
        return tuple(range(k)), float(n)
    if case == "experts without tokens":  # the first k / n of each rank's block: every rank its balanced share
        return tuple(r * block + i for r in range(n) for i in range(k // n)), 1.0
    raise ValueError(case)


@functools.cache
def planned(name: str, mesh: str, model_kwargs: tuple, data_parallel: str = "ddp",
            imbalance: float | None = None) -> str:
    """The planner's plan, every routed-experts node dispatched over all the mesh's axes, priced again at
    `imbalance` (None: not priced again, its bytes and times the planner's own choice's)."""
    model, inputs = moe_model(name, **dict(model_kwargs))
    plan = autojigsaw.plan(model, inputs, dict(MESHES[mesh]), device="cpu", data_parallel=data_parallel)
    plan = with_dispatch(plan, tuple(a for a, _ in MESHES[mesh]))
    if imbalance is None:
        return plan.to_json()
    return autojigsaw.evaluate(plan, model, inputs, device="cpu", moe_imbalance=imbalance).to_json()


def predicted_bytes(name: str, model_kwargs: tuple, plan_json: str, imbalances: list[float]) -> list[list[int]]:
    """Per imbalance, every rank's predicted bytes (the plan states rank 0's), read off its own rewritten graph
    (FSDP's own gathers and reduce-scatters, which the plan adds, aside)."""
    plan = Plan.from_json(plan_json)
    model, inputs = moe_model(name, **dict(model_kwargs))
    captured = capture_for(model, inputs, {}, Regime(data_parallel="ddp"))
    graphs = []
    for r in range(plan.mesh.world_size):
        rank = RankView(plan.mesh, _coord(r, plan.mesh.sizes), (None,) * plan.mesh.ndim)
        graphs.append((rank, rewrite(captured, plan, rank, training=True)))
    out = []
    for imbalance in imbalances:
        out.append([])
        for rank, gm in graphs:
            gm.meta[IMBALANCE] = imbalance
            out[-1].append(sum(traffic_by_origin(gm, rank, captured.trained_params, True).values()))
    return out


def _coord(rank: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    coord = []
    for size in reversed(sizes):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def _train(name: str, mesh: tuple, plan_json: str, model_kwargs: tuple, routings: list, compile: bool | str) -> list:
    """One parallel model; per routing (experts chosen, or None), one AdamW step of it and of the single-device
    model from the same start: largest differences, bytes sent."""
    start, inputs = moe_model(name, **dict(model_kwargs))
    device_mesh = get_mesh(tuple(n for _, n in mesh), tuple(a for a, _ in mesh))
    pmodel = autojigsaw.parallelize(copy.deepcopy(start), device_mesh, inputs, compile=compile,
                                    plan=Plan.from_json(plan_json))
    initial = {fqn: p.detach().clone() for fqn, p in pmodel.named_parameters()}
    out = []
    for chosen in routings:
        ref = copy.deepcopy(start)
        with torch.no_grad():
            for fqn, p in pmodel.named_parameters():
                p.copy_(initial[fqn])
                p.grad = None
        if dict(model_kwargs).get("forced"):
            route(ref, chosen)
            route(pmodel, chosen)
        out.append(_step(pmodel, ref, inputs))
    return out


def _step(pmodel, ref, inputs) -> dict:
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=LR) for m in (pmodel, ref))
    with C.count_comm() as log:
        loss = loss_of(pmodel(*inputs))
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


def check(results: list[dict], mesh: str, tol: float = FP32_TOL, *, fsdp_experts: bool = False) -> None:
    for r in results:
        grad_tol = tol * r["grad_scale"]
        assert r["loss"] <= tol, (r["loss"], r["table"])
        assert r["grad"] <= grad_tol, (r["grad"], grad_tol, r["table"])
        assert r["param"] <= tol + LR * grad_tol / ADAM_EPS, (r["param"], r["table"])
        if fsdp_experts:  # FSDP holds them, sharded over data and by the plan over the other axes
            assert any(".experts." in fqn for fqn in r["fsdp_holds"]), r["fsdp_holds"]
        else:  # the experts split over every axis of the mesh: no rank holds another's experts
            assert r["expert_weights"] == [str(tuple(Shard(0) for _ in MESHES[mesh]))], r["expert_weights"]


def check_forced_routing(name: str, chosen: tuple[int, ...], n: int) -> None:
    """The single-device model routes every token to `chosen`, so the routing the bytes are predicted at is run."""
    model, inputs = moe_model(name, **dict(MANY))
    route(model, chosen)
    tokens = inputs[0].numel()
    for counts in routed(model, inputs):
        assert counts == [tokens if e in chosen else 0 for e in range(dict(MANY)["experts"])], counts


def run_routings(pool, name: str, mesh: str, cases=ROUTINGS, dtype: torch.dtype = torch.float32, *,
                 priced: bool = False, plan: str | None = None, group: int | None = None) -> None:
    """`name` (the MANY shape) with its experts dispatched over every axis of `mesh` (or as `plan`, a plan's
    JSON, dispatches them over groups of `group` ranks), parallelized once, trained at each routing of
    `cases`; at a forced one, every rank's bytes are the predicted ones. `priced`: the plan is evaluated at
    every token to rank 0 and states that routing's bytes (rank 0's)."""
    n = group or MeshSpec.of(dict(MESHES[mesh])).world_size
    imbalances = {case: forced(case, n)[1] for case in cases}
    model_kwargs = (*MANY, ("dtype", dtype))
    plan = plan or planned(name, mesh, model_kwargs, imbalance=float(n) if priced else None)
    results = pool.run(_train, name, MESHES[mesh], plan, model_kwargs, [forced(case, n)[0] for case in cases], False)
    by_case = list(zip(*results))  # per case, every rank's
    for case, ranks in zip(cases, by_case):
        check(ranks, mesh, TOL[dtype], fsdp_experts=group is not None)
    checked = [case for case in cases if imbalances[case] is not None]
    predicted = predicted_bytes(name, model_kwargs, plan, [imbalances[c] for c in checked])
    for case, want in zip(checked, predicted):
        check_forced_routing(name, forced(case, n)[0], n)
        sent = [r["sent"] for r in by_case[cases.index(case)]]
        print(f"{name} on {mesh}, {case}: bytes sent per rank {sent}, predicted {want}")
        assert sent == want, (case, sent, want)
        if priced and imbalances[case] == n:  # the plan, priced at this routing, states rank 0's
            assert sent[0] == Plan.from_json(plan).comm_bytes


def test_mixtral_over_data_2(ranks2):
    run_routings(ranks2, "mixtral", "data=2", priced=True)


def test_qwen3_moe_over_data_2_x_tensor_2(ranks4):
    """One all-to-all over the four ranks while the rest of the plan uses tensor as it chose (parallel folding)."""
    run_routings(ranks4, "qwen3_moe", "data=2 x tensor=2")


def test_deepseek_v3_over_data_4(ranks4):
    run_routings(ranks4, "deepseek_v3", "data=4")


def _tokens_split_over_data(strategy) -> bool:
    """A routed-experts strategy whose tokens are split over every axis (data, tensor)."""
    return strategy.inputs[0] == (Shard(0), Shard(0))


def test_experts_sharded_by_fsdp_over_data_and_dispatched_over_tensor(ranks4):
    """Megatron-Core's expert data parallelism: the experts kept whole over data, where FSDP shards and gathers
    them with the layer's other weights, their tokens split with the batch there and dispatched over tensor
    (constraints pin the experts so; the planner lays out the rest)."""
    name, mesh = "qwen3_moe", "data=2 x tensor=2"
    model, inputs = moe_model(name, **dict(MANY))
    by_expert = (Replicate(), Shard(0))
    plan = autojigsaw.plan(model, inputs, dict(MESHES[mesh]), device="cpu", data_parallel="fsdp",
                           constraints={"*.experts.gate_up_proj": by_expert, "*.experts.down_proj": by_expert,
                                        "*routed_experts*": _tokens_split_over_data})
    notes = {n.note for n in plan.nodes if n.op == "autojigsaw.routed_experts"}
    assert notes == {"data: tokens; tensor: token dispatch"}, plan.table(every_node=True)
    assert not plan.split_over_data(n.name for n in plan.nodes if n.kind == "param"), plan.table(every_node=True)
    run_routings(ranks4, name, mesh, ("own", "all to rank 0"), plan=plan.to_json(), group=2)


@pytest.mark.parametrize("name, mesh, data_parallel", [("qwen3_moe", "data=2", "fsdp"), ("mixtral", "data=4", "ddp")])
def test_top_k_equal_to_the_experts_split_unevenly(request, name, mesh, data_parallel):
    """Every token to every expert, 5 experts in torch.chunk's blocks; under FSDP (parallelize's default on a data
    axis) the experts' weights stay split over the data axis and FSDP shards every other weight."""
    n = MeshSpec.of(dict(MESHES[mesh])).world_size
    pool = request.getfixturevalue(f"ranks{n}")
    plan = planned(name, mesh, UNEVEN, data_parallel, imbalance=1.0 if data_parallel == "ddp" else None)
    results = [r[0] for r in pool.run(_train, name, MESHES[mesh], plan, UNEVEN, [None], False)]
    check(results, mesh)
    predicted = predicted_bytes(name, UNEVEN, plan, [1.0])[0]
    print(f"{name} on {mesh}, top-k = 5 experts: bytes sent per rank {[r['sent'] for r in results]}, "
          f"predicted {predicted}")
    assert [r["sent"] for r in results] == predicted
    if data_parallel == "fsdp":
        held = results[0]["fsdp_holds"]
        assert held and not any(".experts." in fqn for fqn in held), held
        assert any(".self_attn." in fqn for fqn in held), held
    else:
        assert results[0]["sent"] == Plan.from_json(plan).comm_bytes


def test_bf16_experts_run_torch_grouped_mm_behind_the_dispatch(ranks2):
    name = "deepseek_v3"
    plan = Plan.from_json(planned(name, "data=2", (*MANY, ("dtype", torch.bfloat16))))
    routed_nodes = [n for n in plan.nodes if n.op == "autojigsaw.routed_experts"]
    assert routed_nodes and all(n.note == "data: token dispatch" for n in routed_nodes), plan.table(every_node=True)
    model, inputs = moe_model(name, **dict(MANY), dtype=torch.bfloat16)
    graph = capture_for(model, inputs, {}, Regime()).gm.graph
    assert {n.args[5] for n in graph.nodes if "routed_experts" in str(n.target)} == {"aten._grouped_mm.default"}
    run_routings(ranks2, name, "data=2", ("own", "all to rank 0"), torch.bfloat16)


def test_the_whole_program_with_the_routers_load_balancing_loss_traces_fullgraph(ranks2):
    """torch.compile (aot_eager: dynamo's graph, fullgraph, and the traced backward) of Mixtral with its dispatch,
    returning its loss plus its router's load-balancing loss (over every token of every rank)."""
    plan = Plan.from_json(planned("mixtral", "data=2", (("aux_loss", True),)))
    assert any(n.note == "data: token dispatch" for n in plan.nodes), plan.table(every_node=True)
    results = ranks2.run(_train, "mixtral", MESHES["data=2"], plan.to_json(), (("aux_loss", True),), [None],
                         "aot_eager")
    check([r[0] for r in results], "data=2")


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_routers_keep_their_precision_under_mixed_precision(name):
    """With bf16 compute the router computes its scores in fp32 as the model writes it (Mixtral: a float
    softmax; DeepSeek-V3: an fp32 linear), and routed experts take them so, beside bf16 tokens and weights."""
    model, inputs = moe_model(name)
    graph = capture_for(model, inputs, {}, Regime(Precision(torch.bfloat16, torch.float32))).gm.graph
    routed_nodes = [n for n in graph.nodes if "routed_experts" in str(n.target)]
    assert routed_nodes, graph
    for node in routed_nodes:
        x, index, scores, w1, w2 = (a.meta["val"].dtype for a in node.args[:5])
        assert (x, scores, w1, w2, node.meta["val"].dtype) == (torch.bfloat16, torch.float32, torch.bfloat16,
                                                               torch.bfloat16, torch.bfloat16), node.format_node()
