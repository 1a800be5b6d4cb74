"""The layouts benchmarks/ranking.py imposes through constraints= hold in the plans it compares.

Each is planned at a tiny size on a 2-rank tensor axis with no process group; the checks read the
plan, not the constraints: data parallelism reads every linear's activation split on the batch and
its weight whole, sequence parallelism on a later dim with the weight whole, the tp_plan splits the
weights it names as Megatron does (colwise on the output features, rowwise on the input features),
and no two of the four plans are the same.
"""

import pytest
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from benchmarks import ranking_layouts as layouts

TINY = layouts.Sized(layers=1, hidden=32, heads=2, batch=2, seq=16, vocab=64, image=32, patch=8)


def _plans(name: str) -> dict:
    model, args, kwargs = layouts.build(name, TINY)
    plans = {}
    for layout in layouts.LAYOUTS:
        constraints, _ = layouts.constraints(layout, name, model, args, kwargs, 2)
        plans[layout] = autojigsaw.plan(model, args, {"tensor": 2}, example_kwargs=kwargs, device="cpu",
                                        constraints=constraints)
    return plans


def _linears(plan) -> list:
    return [n for n in plan.nodes if n.op == "aten.linear"]


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_each_imposed_layout_holds_in_its_plan_and_no_two_plans_are_alike(name):
    plans = _plans(name)
    data, sequence = plans["data"], plans["sequence"]
    for plan in (data, sequence):
        assert all(pl == (Replicate(),) for pl in plan.param_placements.values())
    for node in _linears(data):
        assert node.inputs[0] == (Shard(0),) and node.inputs[1] == (Replicate(),), node
    for node in _linears(sequence):  # a classifier's pooled (batch, features) has no sequence to split
        (p,), ndim = node.inputs[0], len(node.input_shapes[0])
        assert p != Shard(0) and (ndim < 3 or isinstance(p, Shard)) and node.inputs[1] == (Replicate(),), node
    assert sum(len(n.input_shapes[0]) >= 3 for n in _linears(sequence)) >= 6
    if name == "vit":  # the image's rows (or columns) split, not its batch
        pixels = next(n for n in sequence.nodes if n.kind == "input" and len(n.shape) == 4)
        assert pixels.output in ((Shard(2),), (Shard(3),)), pixels
    model, _, _ = layouts.build(name, TINY)
    styles = model._expand_parallel_plan(layouts.tp_plan(name, model)) if name == "llama" else {
        fqn: style for fqn, _ in model.named_parameters() for key, style in layouts.MEGATRON_VIT.items()
        if fqn.rpartition(".")[0].endswith(key)}
    split = {"colwise": Shard(0), "rowwise": Shard(1)}
    checked = 0
    for fqn, placements in plans["tp_plan"].param_placements.items():
        style = styles.get(fqn) or styles.get(fqn.rpartition(".")[0])
        if style in split and fqn.endswith("weight"):
            assert placements == (split[style],), (fqn, style, placements)
            checked += 1
    assert checked >= 6, styles  # q, k, v, o and the two (or three) FFN projections
    tables = {layout: tuple((n.name, n.inputs, n.outputs) for n in plan.nodes) for layout, plan in plans.items()}
    assert len(set(tables.values())) == len(tables), "two imposed layouts planned the same"

