"""A Plan is plain data: it prints, saves, loads and applies; every node of a real model gets one."""

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autojigsaw
from autojigsaw import Plan
from autojigsaw.capture import capture

from .hf_models import NAMES, hf_model
from .models import MLP, build


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mesh", [{"tensor": 2}, {"domain": 2, "tensor": 2}])
def test_every_node_of_hugging_face_models_is_planned(name, mesh):
    model, inputs = hf_model(name)
    plan = autojigsaw.plan(model, inputs, mesh, device="h100")
    graph_nodes = {n.name for n in capture(model, inputs).gm.graph.nodes}
    assert {n.name for n in plan.nodes} == graph_nodes
    for node in plan.nodes:
        if node.op.startswith("aten."):
            assert all(len(p) == len(mesh) for p in node.inputs), node
    table = plan.table(wide=True)
    assert "aten.linear" in table or "aten.addmm" in table
    for node in plan.fallbacks:  # replicated everywhere, and said so
        assert all(p.is_replicate() for pl in node.inputs + node.outputs if pl for p in pl)
        assert f"{node.kernel} (fallback)" in table and node.note.startswith("no sharding rule")


def test_json_round_trip_is_lossless():
    plan = autojigsaw.plan(MLP(), (torch.randn(2, 5, 16),), {"domain": 2, "tensor": 2}, device="cpu",
                           memory_budget=40_000)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.fingerprint() == plan.fingerprint() and again.table() == plan.table()


def test_the_routing_a_plan_is_priced_at_survives_json():
    """Options.moe_imbalance is recorded in the Plan and its JSON (left out at its default, balanced routing)."""
    model, inputs = MLP(), (torch.randn(2, 5, 16),)
    balanced = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu")
    assert balanced.moe_imbalance == 1.0 and "moe_imbalance" not in balanced.to_json()
    hot = autojigsaw.plan(model, inputs, {"tensor": 2}, device="cpu", moe_imbalance=2.5)
    again = Plan.from_json(hot.to_json())
    assert hot.moe_imbalance == again.moe_imbalance == 2.5 and again == hot
    assert autojigsaw.evaluate(again, model, inputs, device="cpu").moe_imbalance == 2.5
    assert autojigsaw.evaluate(again, model, inputs, device="cpu", moe_imbalance=3).moe_imbalance == 3


class _Permuted(torch.nn.Module):
    """A model whose first op is a view of its input (the Jigsaw mixer's permute of its fields)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x.permute(0, 2, 1))


def test_evaluate_prices_a_plan_whose_view_reads_a_slice_of_its_whole_input():
    """The plan keeps x whole and its permute reads x's shard (a slice). evaluate pinned x whole, and offered its
    permute only what a whole x gives: "no sharding rule offers" the plan's strategy (the Jigsaw runs' TF32 rows
    failed so). The inputs are pinned on data axes alone, as the planner pins them."""
    torch.manual_seed(0)
    model, inputs = _Permuted(), (torch.randn(4, 8, 16),)
    whole, split = (Replicate(), Replicate()), (Replicate(), Shard(1))
    plan = autojigsaw.plan(model, inputs, {"data": 1, "tensor": 2}, device="cpu",
                           constraints={"x": lambda s: s.outputs[0] == whole,
                                        "permute": lambda s: s.inputs[0] == split})
    assert plan.input_placements == (whole,) and plan.node("permute").inputs == (split,)
    again = autojigsaw.evaluate(plan, model, inputs, device="cpu")
    assert (again.step_time, again.memory_per_rank) == (plan.step_time, plan.memory_per_rank)


def _apply_saved(text):
    from autojigsaw.testing.local_ranks import get_mesh

    plan = Plan.from_json(text)
    model = autojigsaw.parallelize(build("mlp", torch.float32), get_mesh((2,), ("tensor",)),
                                   (torch.randn(2, 5, 16),), compile=False, plan=plan)
    return model.plan.fingerprint() == plan.fingerprint(), model.plan.param_placements


def test_saved_plan_applies_unchanged(ranks2):
    plan = autojigsaw.plan(build("mlp", torch.float32), (torch.randn(2, 5, 16),), {"tensor": 2},
                           device="cpu", memory_budget=30_000)
    for same, placements in ranks2.run(_apply_saved, plan.to_json()):
        assert same and placements == plan.param_placements


def _train_with_plan(text):
    from autojigsaw.testing.local_ranks import get_mesh

    ref = build("mlp", torch.float64)
    model = autojigsaw.parallelize(build("mlp", torch.float64), get_mesh((2,), ("tensor",)),
                                   (torch.randn(2, 5, 16, dtype=torch.float64),), compile=False,
                                   plan=Plan.from_json(text))
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, y_ref = model(x), ref(x)
    y.square().sum().backward(), y_ref.square().sum().backward()
    grad = max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))
    return (y - y_ref).abs().max().item(), grad, model.plan.param_placements["fc1.weight"]


def test_edited_plan_is_applied_and_still_exact(ranks2):
    """Store fc1.weight sharded in an otherwise replicated plan: it is gathered where used."""
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    plan = autojigsaw.plan(build("mlp", torch.float64), (x,), {"tensor": 2}, device="cpu")
    assert all(p == (Replicate(),) for p in plan.param_placements.values())
    node = plan.node("p_fc1_weight")
    edited = replace(plan, nodes=tuple(replace(n, outputs=((Shard(0),),)) if n is node else n
                                       for n in plan.nodes),
                     param_placements={**plan.param_placements, "fc1.weight": (Shard(0),)})
    for out, grad, placement in ranks2.run(_train_with_plan, edited.to_json()):
        assert out < 1e-12 and grad < 1e-12 and placement == (Shard(0),)
