"""What the planner chooses for mixture-of-experts models at their published widths (meta device, H100s).

Two layers each of Mixtral-8x7B (8 experts of 14336, top-2), Qwen3-30B-A3B (128 experts of 768,
top-8) and a small DeepSeek-V3 (DeepSeek-V2-Lite's widths: 64 experts of 1408, top-6 in 4 of 8
groups, 2 shared experts, latent attention), bf16 compute, 4096 tokens per data rank. On 8 ranks
of data the experts are dispatched over the data axis (expert parallelism on the data ranks); on
data=8 x tensor=8 the many-expert models fold their experts over all 64 ranks, laid out apart
from attention's (Qwen3's splits heads over tensor), and Mixtral's 8 experts stay one per data
rank, its tokens split over tensor. Across nodes, whether the data axis splits the experts or FSDP
shards them there is the planner's choice. A busier busiest rank (moe_imbalance) costs more.
"""

import functools

import pytest
import torch
import transformers as tf
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard

import autojigsaw

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SEQ = 4096


def published(name: str, layers: int = 2):
    """`layers` layers of `name` at its published widths, on the meta device."""
    if name == "mixtral-8x7b":
        cls, cfg = tf.MixtralForCausalLM, tf.MixtralConfig(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)
    elif name == "qwen3-30b-a3b":
        cls, cfg = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
            decoder_sparse_step=1, norm_topk_prob=True)
    else:
        cls, cfg = tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
            num_experts_per_tok=6, n_shared_experts=2, n_group=8, topk_group=4, first_k_dense_replace=1,
            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400)
    cfg.num_hidden_layers, cfg.use_cache = layers, False
    with torch.device("meta"):
        return cls(cfg)


@functools.cache
def planned(name: str, layers: int, per_rank: int, mesh: tuple, imbalance: float = 1.0,
            experts_over_data=None, loss: bool = False) -> autojigsaw.Plan:
    """`layers` of `name` planned on `mesh`, `per_rank` sequences per data rank; `experts_over_data`: the
    routed experts' placement over the data axis, pinned; `loss`: the model returns its loss (whole) and
    its logits where the planner puts them, with full recomputation, as it trains."""
    ids = torch.zeros(dict(mesh)["data"] * per_rank, SEQ, dtype=torch.long)
    pins, options = None, {}
    if experts_over_data is not None:
        pin = tuple(experts_over_data if axis == "data" else None for axis, _ in mesh)
        pins = {"*.experts.gate_up_proj": pin, "*.experts.down_proj": pin}
    if loss:
        options = {"example_kwargs": {"labels": ids}, "activation_checkpointing": "full",
                   "output_placements": [tuple(Replicate() for _ in mesh), None]}
    return autojigsaw.plan(published(name, layers), (ids,), dict(mesh), device="h100", mp_policy=BF16,
                           moe_imbalance=imbalance, constraints=pins, **options)


def routed_notes(plan: autojigsaw.Plan) -> set[str]:
    notes = {n.note for n in plan.nodes if n.op == "autojigsaw.routed_experts"}
    assert notes, plan.table(every_node=True)
    return notes


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3-small"])
def test_experts_borrow_the_data_ranks(name):
    plan = planned(name, 2, 1, (("data", 8),))
    print(plan)
    assert routed_notes(plan) == {"data: token dispatch"}
    experts = {n.name: n.outputs[0] for n in plan.nodes if n.kind == "param" and ".experts." in n.module}
    assert experts and all(p == (torch.distributed.tensor.Shard(0),) for p in experts.values()), experts


@pytest.mark.parametrize("name, folded", [("qwen3-30b-a3b", True), ("deepseek-v3-small", True),
                                          ("mixtral-8x7b", False)])
def test_many_experts_fold_over_data_and_tensor(name, folded):
    """Parallel folding: the experts' layout over the 64 ranks is the routed experts' own, whatever attention's."""
    plan = planned(name, 2, 1, (("data", 8), ("tensor", 8)))
    print(plan)
    want = "data: token dispatch; tensor: token dispatch" if folded else "data: token dispatch; tensor: tokens"
    assert routed_notes(plan) == {want}


def test_the_experts_over_a_data_axis_across_nodes_are_the_planners_choice():
    """On data=4 x expert=8 the data axis crosses nodes. Split over it, the experts take a token all-to-all across
    InfiniBand; kept whole there, FSDP gathers them behind the compute of the layer before, its exposed
    traffic priced in the solve as the step has it (planner/problem.py DataTraffic). Neither is forced
    (strategies/data_pins.py): with 16 sequences per data rank FSDP's is the faster, and the planner's."""
    mesh, shape = (("data", 4), ("expert", 8)), ("qwen3-30b-a3b", 4, 16)
    free = planned(*shape, mesh, loss=True)
    split, whole = (planned(*shape, mesh, experts_over_data=p, loss=True) for p in (Shard(0), Replicate()))
    print(f"step {free.step_time * 1e3:.2f} ms free ({routed_notes(free)}), {split.step_time * 1e3:.2f} split "
          f"over data, {whole.step_time * 1e3:.2f} kept whole there (FSDP)")
    assert routed_notes(split) == {"data: token dispatch; expert: token dispatch"}
    assert routed_notes(whole) == routed_notes(free) == {"data: tokens; expert: token dispatch"}
    assert whole.step_time < split.step_time and free.step_time <= whole.step_time * 1.01  # the solve's gap
    experts = {n.outputs[0] for n in free.nodes if n.kind == "param" and ".experts." in n.module}
    assert experts == {(Replicate(), Shard(0))}, experts


def test_a_busier_busiest_rank_costs_more():
    balanced = planned("qwen3-30b-a3b", 2, 1, (("data", 8),))
    hot = planned("qwen3-30b-a3b", 2, 1, (("data", 8),), 4.0)
    assert hot.moe_imbalance == 4.0 and hot.step_time > balanced.step_time
    again = autojigsaw.evaluate(autojigsaw.Plan.from_json(hot.to_json()), published("qwen3-30b-a3b"),
                                (torch.zeros(8, SEQ, dtype=torch.long),), device="h100", mp_policy=BF16)
    assert again.moe_imbalance == 4.0 and again.step_time == pytest.approx(hot.step_time, rel=1e-9)
    routed = [n for n in hot.nodes if n.op == "autojigsaw.routed_experts"]
    print(f"step {balanced.step_time * 1e3:.2f} ms balanced, {hot.step_time * 1e3:.2f} ms at moe_imbalance=4; "
          f"{routed[0].note}")
