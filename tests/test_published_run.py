"""The planner's prediction for a published, measured run: torchtitan's Llama 3.1 8B on 8 H100s.

pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: FSDP on 8 GPUs, local
batch 2 x 8192 tokens, bf16 mixed precision, selective activation checkpointing: 6,667 tokens/s
per GPU at 77.0 GiB. Planned as the issue that asked for it wrote the call, on the meta device.
benchmarks/published.py compares six more runs (torchtitan on 128 GPUs, Megatron-LM tensor parallel on 8-256).
"""

import logging

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import autojigsaw

logging.getLogger("transformers").setLevel(logging.ERROR)


def test_torchtitan_llama3_8b_on_8_h100_is_predicted_within_25_percent():
    import transformers as tf

    cfg = tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
        ids = torch.zeros(16, 8192, dtype=torch.long)
    plan = autojigsaw.plan(model, (ids,), {"data": 8}, device="h100", example_kwargs={"labels": ids},
                           memory_budget=92e9, data_parallel="fsdp", activation_checkpointing="selective",
                           mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    tokens_per_gpu = 16 * 8192 / plan.step_time / 8
    assert abs(tokens_per_gpu / 6667 - 1) <= 0.25, tokens_per_gpu
    assert abs(plan.memory_per_rank / 2**30 / 77.0 - 1) <= 0.20, plan.memory_per_rank / 2**30
    assert plan.recompute_summary() == "selective on model.layers.{0..31} (x32)"
    assert plan.precision == "bf16 compute, fp32 masters, fp32 gradient sums" and plan.data_parallel == "fsdp"
