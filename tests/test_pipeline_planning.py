"""Planning pipeline stages, microbatches and the mesh itself, without processes (the meta device).

A pipelined plan names its stages (layers in order, the pipe rank of each as PyTorch's schedule lays
them out), its schedule, microbatches and bubble, prints within 120 columns and survives JSON; the
cut moves away from a costly head; a stage's saved activations count once per microbatch it holds;
gradient accumulation prices its microbatches one after another, FSDP's traffic with each; a number of
GPUs in place of the mesh returns the fastest mesh found with the others beside it. Bad input is
refused by name.
"""

import numpy as np
import pytest
import torch
import transformers as tf
from torch import nn

import autojigsaw
from autojigsaw.api import capture_for
from autojigsaw.api.recipe import plan_captured
from autojigsaw.capture.stages import cut
from autojigsaw.mesh import MeshSpec
from autojigsaw.planner.layer_costs import LayerCosts, balanced_starts

DEVICE = "h100"


def _llama(layers: int = 4, vocab: int = 128):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, use_cache=False)
    with torch.device("meta"):
        return tf.LlamaForCausalLM(cfg)


def _ids(batch: int = 8, seq: int = 32):
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def _plan(model, mesh, **options):
    ids = _ids()
    return autojigsaw.plan(model, (ids,), mesh, device=DEVICE, example_kwargs={"labels": ids}, **options)


@pytest.fixture(scope="module")
def one_f_one_b():
    return _plan(_llama(4), {"pipe": 2, "tensor": 2}, pipeline_schedule="1F1B", microbatches=4)


def test_a_pipelined_plan_names_its_stages_schedule_and_bubble(one_f_one_b):
    plan = one_f_one_b
    pipe = plan.pipeline
    assert (pipe.schedule, pipe.microbatches, pipe.virtual_stages, pipe.ranks) == ("1F1B", 4, 1, 2)
    layers = [layer for st in pipe.stages for layer in st.layers]
    assert layers == [f"model.layers.{i}" for i in range(4)]
    assert [st.rank for st in pipe.stages] == [0, 1] and [st.in_flight for st in pipe.stages] == [2, 1]
    assert 0 < pipe.bubble < 1 and plan.step_time > max(st.forward_s + st.backward_s for st in pipe.stages) * 4
    # a GPU spec: a pipe rank's reserved and allocated peaks are its own stages', allocated within reserved
    assert plan.memory_per_rank == max(st.plan.memory_per_rank for st in pipe.stages)
    assert plan.memory_allocated == max(st.plan.memory_allocated for st in pipe.stages) <= plan.memory_per_rank
    assert plan.gap == max(st.plan.gap for st in pipe.stages)
    text = str(plan)
    assert "pipeline over pipe=2: 1F1B, 4 microbatch(es)" in text and "stage 1 (" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    again = autojigsaw.Plan.from_json(plan.to_json())
    assert again == plan and again.pipeline == plan.pipeline


@pytest.mark.parametrize("schedule,owners", [("interleaved", [0, 1, 0, 1]), ("zero-bubble", [0, 1, 1, 0])])
def test_virtual_stages_sit_on_ranks_as_pytorchs_schedules_place_them(schedule, owners):
    plan = _plan(_llama(4), {"pipe": 2}, pipeline_schedule=schedule, microbatches=4, virtual_stages=2)
    assert [st.rank for st in plan.pipeline.stages] == owners
    assert [len(st.layers) for st in plan.pipeline.stages] == [1, 1, 1, 1]


def test_the_cut_gives_the_stage_with_a_costly_head_fewer_layers():
    n = 8
    work = np.ones(n + 2)
    work[0], work[-1] = 0.0, 3.0  # nothing before the layers, a head that costs three layers after them
    costs = LayerCosts(tuple(f"layers.{i}" for i in range(n)), work / 3, 2 * work / 3, 0 * work, 0 * work,
                       0 * work, 0 * work, 0 * work, 0.0)
    assert balanced_starts(costs, [1, 1], None) == (0, 5)  # 5 layers | 3 layers + the head
    saved = np.ones(n + 2)  # a byte saved per layer, and by the embedding and the head
    tight = LayerCosts(costs.layers, costs.forward, costs.backward, costs.weight, saved, 0 * work, 0 * work, 0 * work,
                       0.0)
    # two microbatches in flight on the first stage, one on the last: within 9 bytes the first holds 3 layers
    # (2 x (3 + 1) = 8 bytes), the last 5 and the head (6 bytes); 4 layers need 10 bytes
    assert balanced_starts(tight, [2, 1], 9.0) == (0, 3)
    assert balanced_starts(tight, [2, 1], 3.0) is None


def test_a_stage_holds_the_activations_of_each_microbatch_in_flight():
    model = _llama(2)
    ids = torch.zeros(4, 32, dtype=torch.long, device="meta")
    options = autojigsaw.Options(device=DEVICE)
    captured = capture_for(model, (ids,), {"labels": ids}, options.regime(MeshSpec.of({"tensor": 2})))
    stage = cut(captured, [0, 1])[0]
    mesh = MeshSpec.of({"tensor": 2})
    # the bytes live (the caching allocator's reserve comes in 2 MiB segments, more than this tiny stage's growth)
    peaks = [plan_captured(stage.captured, mesh, options, in_flight=k, stage=True).explainer.solution.peak_memory
             for k in (1, 2, 3)]
    assert peaks[0] < peaks[1] < peaks[2]
    assert peaks[2] - peaks[1] == peaks[1] - peaks[0]  # each more microbatch: the same saved bytes again


def test_gradient_accumulation_prices_its_microbatches_one_after_another():
    model = _llama(2)
    whole = _plan(model, {"tensor": 2})
    four = _plan(model, {"tensor": 2}, microbatches=4)
    assert four.microbatches == 4 and four.memory_per_rank < whole.memory_per_rank
    assert whole.step_time < four.step_time < 4 * whole.step_time


def test_accumulated_microbatches_send_fsdps_traffic_with_each_and_ddps_sum_once():
    # on data=2 FSDP's is all the traffic: four microbatches send four times what one sends, and take four times
    # its step but for the optimizer's, which runs once (train_step reduce-scatters each microbatch's gradients)
    model, ids, micro = _llama(2), _ids(batch=8), _ids(batch=2)
    four = autojigsaw.plan(model, (ids,), {"data": 2}, device=DEVICE, example_kwargs={"labels": ids}, microbatches=4)
    one = autojigsaw.plan(model, (micro,), {"data": 2}, device=DEVICE, example_kwargs={"labels": micro})
    assert one.comm_bytes > 0 and four.comm_bytes == 4 * one.comm_bytes
    optimizer = sum(ns.compute_s for ns in one.nodes if ns.kind == "param")
    assert 0 < optimizer < one.step_time / 2
    assert four.step_time == pytest.approx(4 * (one.step_time - optimizer) + optimizer, rel=1e-12)
    # DDP sums the accumulated gradients once, after the last: 4 microbatches of 2 rows send what 2 of 4 rows do
    ddp = [autojigsaw.plan(model, (ids,), {"data": 2}, device=DEVICE, example_kwargs={"labels": ids}, microbatches=m,
                           data_parallel="ddp") for m in (2, 4)]
    assert ddp[0].comm_bytes > 0 and ddp[0].comm_bytes == ddp[1].comm_bytes


def test_a_number_of_gpus_chooses_the_mesh_and_keeps_the_runners_up():
    model = _llama(4)
    ids = _ids()
    # data_parallel holds on the meshes with a data axis; the others plan without it
    plan = autojigsaw.plan(model, (ids,), 8, device=DEVICE, gpus_per_node=4, example_kwargs={"labels": ids},
                           data_parallel="ddp")
    assert plan.mesh.world_size == 8 and plan.alternatives
    assert all(c.mesh.world_size == 8 for c in plan.alternatives)
    assert all(c.mesh.size("tensor") <= 4 for c in plan.alternatives if "tensor" in c.mesh.axis_names)
    assert "chosen" in str(plan)
    sizes, names = autojigsaw.best_mesh(model, (ids,), 8, device=DEVICE, gpus_per_node=4,
                                        example_kwargs={"labels": ids}, data_parallel="ddp")
    assert (sizes, names) == (plan.mesh.sizes, plan.mesh.axis_names)


def test_constraints_place_each_stage_by_the_entries_that_name_its_layers():
    # one layer's MLP pinned as Megatron places it: only the stage that runs it has it; the other stage plans free
    pins = {"model.layers.3.mlp.up_proj": "colwise", "model.layers.3.mlp.down_proj": "rowwise"}
    plan = _plan(_llama(4), {"pipe": 2, "tensor": 2}, pipeline_schedule="1F1B", microbatches=4, constraints=pins)
    assert plan.param_placements["model.layers.3.mlp.up_proj.weight"][-1].is_shard(0)
    assert plan.param_placements["model.layers.3.mlp.down_proj.weight"][-1].is_shard(1)
    with pytest.raises(ValueError, match=r"constraints\['layers.9.mlp'\] matches no parameter or module"):
        _plan(_llama(4), {"pipe": 2, "tensor": 2}, pipeline_schedule="1F1B", microbatches=4,
              constraints={"layers.9.mlp": "colwise"})


def test_pipelines_that_cannot_be_are_refused_by_name():
    with pytest.raises(ValueError, match="pipe axis has 8 ranks but the model has 4 repeated layers"):
        _plan(_llama(4), {"pipe": 8})
    with pytest.raises(ValueError, match="microbatches=3 does not divide the batch"):
        _plan(_llama(4), {"pipe": 2}, microbatches=3)
    with pytest.raises(ValueError, match="virtual_stages=3 = 6 stages, but the model has 4 repeated layers"):
        _plan(_llama(4), {"pipe": 2}, pipeline_schedule="interleaved", virtual_stages=3, microbatches=4)
    with pytest.raises(ValueError, match="'1F1B' runs 1 stage"):
        _plan(_llama(4), {"pipe": 2}, pipeline_schedule="1F1B", virtual_stages=2)
    with pytest.raises(ValueError, match="has none: drop the pipe axis"):
        autojigsaw.plan(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), (torch.randn(4, 8),), {"pipe": 2},
                        device=DEVICE)
    with pytest.raises(ValueError, match="pipeline stage 0 of 2"):
        _plan(_llama(4), {"pipe": 2}, pipeline_schedule="1F1B", microbatches=4, memory_budget=10_000)
