"""Pinned layouts (`constraints=`): the ecosystem's tensor-parallel plans placed exactly, the rest planned,
and an entry that cannot hold refused by name."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

import autojigsaw
from autojigsaw.testing.local_ranks import get_mesh

from .side_by_side import build, train

logging.getLogger("transformers").setLevel(logging.ERROR)
FP32_TOL = 5e-6  # Llama's RMSNorm computes in fp32 whatever the model's dtype (tests/test_hf_models.py)


class Block(nn.Module):
    """An embedding, a norm and a two-layer MLP: one module of each kind a tp plan names."""

    def __init__(self, vocab: int = 32, width: int = 16, hidden: int = 64, out: int = 16):
        super().__init__()
        self.emb, self.norm = nn.Embedding(vocab, width), nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, out)

    def forward(self, ids):
        return self.down(torch.relu(self.up(self.norm(self.emb(ids)))))


IDS = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))


def _plan(constraints, mesh=None, model=None, **options):
    torch.manual_seed(0)
    return autojigsaw.plan(model or Block(), (IDS,), mesh or {"tensor": 2}, device="cpu", constraints=constraints,
                           **options)


def _weight_read(plan, module: str):
    """The placements the matmul or embedding of `module` reads its weight in."""
    node = next(n for n in plan.nodes if n.module == module and n.op in ("aten.linear", "aten.embedding"))
    return node.inputs[0 if node.op == "aten.embedding" else 1]


def test_torch_styles_place_the_modules_weights_and_read_them_split():
    plan = _plan({"up": ColwiseParallel(), "down": RowwiseParallel(), "emb": ColwiseParallel(),
                  "norm": SequenceParallel()})
    placed = {fqn: pl[0] for fqn, pl in plan.param_placements.items()}
    # torch's ColwiseParallel splits an embedding's columns, a linear's rows (its outputs)
    assert placed == {"emb.weight": Shard(1), "norm.weight": Replicate(), "norm.bias": Replicate(),
                      "up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1), "down.bias": Replicate()}
    # never gathered where read: the matmuls compute with their shards
    assert _weight_read(plan, "up") == (Shard(0),) and _weight_read(plan, "down") == (Shard(1),)
    assert _weight_read(plan, "emb") == (Shard(1),)
    # RowwiseParallel splits an embedding's vocabulary: each rank looks up the ids it holds (vocabulary-parallel)
    vocab = _plan({"emb": RowwiseParallel()})
    assert vocab.param_placements["emb.weight"] == (Shard(0),) and _weight_read(vocab, "emb") == (Shard(0),)
    embedding = next(n for n in vocab.nodes if n.module == "emb" and n.op == "aten.embedding")
    assert embedding.kernel == "vocab_parallel_embedding", embedding


def test_a_pinned_weight_is_read_split_where_the_free_plan_gathers_it():
    # a small weight and many tokens: left free, the planner replicates the weights and splits the tokens
    free = _plan(None, mip_gap=0)
    assert _weight_read(free, "down") == (Replicate(),), free.table()
    pinned = _plan({"down": "rowwise"}, mip_gap=0)
    assert pinned.param_placements["down.weight"] == (Shard(1),) and _weight_read(pinned, "down") == (Shard(1),)
    assert pinned.step_time >= free.step_time and pinned.fingerprint() != free.fingerprint()


def test_transformers_style_names_and_globs_over_the_end_of_a_name():
    plan = _plan({"*p": "colwise", "down.weight": "rowwise", "emb": "embedding_colwise"})
    placed = {fqn: pl[0] for fqn, pl in plan.param_placements.items()}
    # "*p" matches "up"; the parameter's own entry wins over its module's ("down.weight" over "*p"'s nothing)
    assert placed["up.weight"] == Shard(0) and placed["up.bias"] == Shard(0)
    assert placed["down.weight"] == Shard(1) and placed["emb.weight"] == Shard(1)
    # rowwise keeps a bias whole, as transformers adds it after the sum
    assert _plan({"down": "rowwise"}).param_placements["down.bias"] == (Replicate(),)


def test_placements_pin_a_parameter_on_every_axis_and_split_leaves_the_dim_to_the_planner():
    mesh = {"domain": 2, "tensor": 2}
    plan = _plan({"up.weight": (Shard(1), Shard(0)), "down.weight": (None, Replicate())}, mesh)
    assert plan.param_placements["up.weight"] == (Shard(1), Shard(0))
    assert plan.param_placements["down.weight"][1] == Replicate()
    split = _plan({"up.weight": "split", "down.weight": "split"})
    for fqn, module in (("up.weight", "up"), ("down.weight", "down")):
        assert isinstance(split.param_placements[fqn][0], Shard)
        assert isinstance(_weight_read(split, module)[0], Shard)


def test_a_function_keeps_a_named_node_to_the_strategies_it_accepts():
    plan = _plan({"relu": lambda s: s.outputs[0] == (Shard(2),)})
    assert plan.node("relu").outputs[0] == (Shard(2),)


def test_a_style_applies_to_the_axis_named_tensor_or_tp_or_the_one_given():
    assert _plan({"up": "colwise"}, {"data": 2, "tp": 2}).param_placements["up.weight"] == (Replicate(), Shard(0))
    plan = _plan({"up": "colwise"}, {"domain": 2, "model": 2}, constraints_axis="model")
    assert plan.param_placements["up.weight"] == (plan.param_placements["up.weight"][0], Shard(0))
    with pytest.raises(ValueError, match=r"constraints\['up'\].*no axis.*constraints_axis="):
        _plan({"up": "colwise"}, {"domain": 2})


@pytest.mark.parametrize("constraints, message", [
    ({"mlp.up": "colwise"}, r"constraints\['mlp.up'\] matches no parameter or module"),
    ({"up": "packed_colwise"}, r"constraints\['up'\]: transformers' style 'packed_colwise' is not supported"),
    ({"up": "columnwise"}, r"constraints\['up'\]: unknown style 'columnwise'"),
    ({"norm": ColwiseParallel()}, r"ColwiseParallel shards nn.Linear and nn.Embedding.*LayerNorm"),
    ({"up": PrepareModuleInput()}, r"PrepareModuleInput is not supported"),
    ({"up.weight": (Shard(0),)}, r"1 placements for a mesh of 2 axes"),
    ({"up": "colwise", "up.weight": "rowwise", "*.weight": "colwise"}, r"both match up.weight and disagree"),
    ({"up.weight": (Shard(0), Replicate())}, r"up.weight cannot be S\(0\) on data axis 'data' \(2 ranks\)"),
    ({"nothing_*": lambda s: True}, r"matches no node of the captured graph"),
    ({"relu": lambda s: False}, r"constraints\['relu'\] cannot hold at node relu"),
    ({"up": 3}, r"constraints\['up'\] = 3: give a style"),
])
def test_an_entry_that_cannot_hold_is_a_value_error_naming_it(constraints, message):
    with pytest.raises(ValueError, match=message):
        _plan(constraints, {"data": 2, "tensor": 2})


def test_a_split_the_axis_cannot_make_names_the_entry_the_parameter_and_the_axis():
    model = Block(out=1)  # down.weight is [1, 64]: colwise splits its one row over 2 ranks
    with pytest.raises(ValueError, match=r"constraints\['down'\]: down.weight of shape \[1, 64\] cannot be split "
                                         r"on dim 0 \(1\) over 'tensor' \(2 ranks\)"):
        _plan({"down": "colwise"}, model=model)


@pytest.mark.parametrize("which", ["base_model_tp_plan", "tp_plan"])
def test_a_transformers_tp_plan_places_each_weight_as_transformers_does(ranks2, which):
    """A Llama's config.base_model_tp_plan (its layers) and its whole tp_plan (with the embedding's vocabulary
    and the head split) place every weight they name as transformers' own tensor parallelism does, on 2
    gloo ranks, given to plan and to parallelize; the model trains as on one device."""
    model, inputs = build("llama")
    tp_plan = _tp_plan(model, which)
    plan = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", constraints=tp_plan)
    ours = {fqn: str(pl[0]) for fqn, pl in plan.param_placements.items()}
    named = sorted(set(model._expand_parallel_plan(_from_root(tp_plan))) & set(ours))
    assert len(named) == 2 * 7 + (2 if which == "tp_plan" else 0), named  # 7 projections per layer
    for theirs, parallelized in ranks2.run(_placements, which):
        assert [ours[f] for f in named] == [theirs[f] for f in named] == [parallelized[f] for f in named]
    for r in ranks2.run(train, "llama", (2,), ("tensor",), plan.to_json()):  # three Adam steps
        for key in ("output", "grad", "param"):
            assert r[key] <= FP32_TOL * max(r["scale"], 1.0), (key, r[key], r["table"])


def _tp_plan(model, which: str) -> dict:
    return dict(model.config.base_model_tp_plan if which == "base_model_tp_plan" else model.tp_plan)


def _from_root(tp_plan: dict) -> dict:
    """A base model's plan named from the causal LM's root, as transformers' tp_plan names it."""
    return {(k if k.startswith("model.") or k == "lm_head" else f"model.{k}"): v for k, v in tp_plan.items()}


def _placements(which: str) -> tuple[dict, dict]:
    """On every rank: each parameter's placement under transformers' TP, and under parallelize(constraints=)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    model, inputs = build("llama")
    mesh = get_mesh((dist.get_world_size(),), ("tensor",))
    tp_plan = _tp_plan(model, which)
    tp = apply_tensor_parallelism(copy.deepcopy(model), mesh, model._expand_parallel_plan(_from_root(tp_plan)))
    theirs = {name: str(p.placements[0] if isinstance(p, DTensor) else Replicate()) for name, p in tp.named_parameters()}
    pmodel = autojigsaw.parallelize(copy.deepcopy(model), mesh, inputs, compile=False, constraints=tp_plan)
    return theirs, {fqn: str(pl[0]) for fqn, pl in pmodel.plan.param_placements.items()}
