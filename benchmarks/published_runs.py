"""Published, measured training runs: model, cluster, parallel layout and what was measured (data).

Each run is what its source states, with the source named (repository + path, or paper +
table). Only runs autojigsaw can express are listed: data, FSDP and tensor parallelism with
or without recomputation, pipeline stages (Megatron-LM's 39B-1T rows), gradient accumulation and
expert parallelism (Megatron-Core's Qwen3-235B-A22B). Not here: Float8 GEMMs (torchtitan's
"+ Float8" rows and its 70B FSDP 32 x TP 8 run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (linked from docs/performance.md)"
# torchtitan runs with the caching allocator's expandable segments (run_train.sh sets
# PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), and its memory figures are the allocator's
# reserved peaks (torchtitan/components/metrics.py, max_reserved_gib): "+expandable".
# Its "selective activation checkpointing" is the 8B config's default, selective_ac_option = "op":
# torchtitan/parallelisms/parallelize_llama.py saves mm and attention outputs "except every second mm"
# (k, o and up projections recomputed): autojigsaw's "selective-op".
# The vanilla-TP baselines of torchtitan's async-TP runs (June 2025, the same 500 W H100 96 GB hosts). Its
# tokens/s are per GPU (torchtitan/components/metrics.py divides a data rank's tokens by the TP degree);
# "local batch" is per data rank; seq_len 8192 (the llama3_8b / _70b train configs at commit 820504e).
ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
# MosaicML's MPT runs: Composer's FSDP (FULL_SHARD, "DEFAULT" mixed precision: bf16 compute, fp32 gradient
# reductions), FlashAttention, eager, on H100 80 GB; only rows without gradient accumulation (one
# microbatch per step, as the plan prices it). MPT as GPT-2's config: d_model, n_heads, n_layers,
# expansion 4, vocab 50368, tied embeddings (MPT has no biases and ALiBi instead of learned positions). Their
# optimizer is Composer's DecoupledAdamW (scripts/train/yamls/pretrain/mpt-*.yaml: decoupled_adamw).
MPT = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
PTDP = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
        "arXiv 2104.04473, Table 1 (also NVIDIA/Megatron-LM README, 2021)")
SELECTIVE = ("Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models, "
             "arXiv 2205.05198, Tables 3 and 5")
# NVIDIA's MoE recipes for Megatron-Core: 256 H100s, NVLink 4, InfiniBand 8 x 50 GB/s per node; the model's
# arguments in model_configs/benchmarking/Qwen3-235B-A22B.yaml
MOE_ZOO = "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (commit e865051)"

LLAMA_3_1_70B = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                 "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                 "rope_theta": 500000.0, "max_position_embeddings": 131072}
# Qwen/Qwen3-235B-A22B's config.json (as Megatron's recipe states it: 94 layers, every one MoE, 64 query heads of
# 128 in 4 groups, 128 experts of 1536, top-8, softmax router normalised over the top-k, untied embeddings)
QWEN3_235B_A22B = {"hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                   "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                   "vocab_size": 151936, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                   "tie_word_embeddings": False}
LLAMA_3_1_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                "rope_theta": 500000.0, "max_position_embeddings": 131072}


def gpt(hidden: int, layers: int, heads: int, seq: int = 2048, vocab: int = 51200) -> dict:
    """A Megatron GPT as transformers' GPT2Config: 4h MLP, GELU, LayerNorm, tied embeddings."""
    return {"n_embd": hidden, "n_layer": layers, "n_head": heads, "n_inner": 4 * hidden, "vocab_size": vocab,
            "n_positions": seq}


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: what was trained, on what, how, and what it reached."""

    name: str
    family: str  # "llama" (transformers LlamaConfig), "gpt2" (GPT2Config) or "qwen3_moe" (Qwen3MoeConfig)
    config: dict = field(hash=False)  # the model, in that config's keyword arguments
    gpus: int
    device: str  # an autojigsaw device spec name
    mesh: dict = field(hash=False)  # {"data": .., "tensor": ..}: data first (across nodes), tensor inside a node
    global_batch: int  # sequences per optimizer step
    seq: int
    precision: str  # "bf16 mixed" (fp32 master weights and reductions) or "fp16 mixed"
    recompute: str  # autojigsaw's names: "none", "selective", "selective-op" (torchtitan's "selective" with its "op" option), "full"
    data_parallel: str  # "fsdp" or "ddp"
    compiled: bool  # torch.compile (fuses elementwise ops)
    tokens_per_s_per_gpu: float
    source: str
    memory_gib: float | None = None  # peak per GPU, as published
    mfu: float | None = None  # as the source states it (its own FLOP count)
    memory_budget: float | None = None  # bytes the plan may use per GPU (None: 90 % of the device)
    optimizer: str = "adam"  # the optimizer step the run takes, by autojigsaw's name (fused or foreach AdamW)
    note: str = ""
    # "planned": the planner chooses the layout; "tensor-parallel": the run's Megatron-style layout is
    # imposed on the "tensor" axis (its matrix weights split there, never gathered: benchmarks/layouts.py);
    # "megatron-moe": Megatron-Core's experts over expert x tensor, attention over data x expert and tensor
    layout: str = "planned"
    # over a "pipe" axis: PyTorch's schedule name, sequences per microbatch, stages per pipe rank
    schedule: str | None = None
    microbatch: int | None = None
    virtual_stages: int | None = None
    accumulation: int = 1  # without a pipe axis: microbatches per data replica and step (gradient accumulation)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq


def _tps_from_tflops(tflops: float, cfg: dict, seq: int) -> float:
    """tokens/s per GPU from Megatron's achieved TFLOP/s per GPU.

    Narayanan et al. count 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs per batch of B
    sequences, full recomputation included (their eq. 3): divide by B s for one token.
    """
    h, l, v = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    per_token = 96 * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))
    return tflops * 1e12 / per_token


def megatron_gpt(hidden: int, layers: int, heads: int) -> dict:
    """Megatron-LM's GPT of 2021-22 as it ran: its GELU one fused kernel (bias_gelu, the tanh form:
    GPT-2's "gelu_new" is eight elementwise ops), its attention two batched matmuls around a fused
    scaled, masked softmax (no FlashAttention yet): transformers' "eager" attention."""
    return {**gpt(hidden, layers, heads), "activation_function": "gelu_pytorch_tanh", "attn_implementation": "eager"}


_GPT_7_5B, _GPT_18_4B, _GPT_22B = megatron_gpt(4096, 36, 32), megatron_gpt(6144, 40, 48), megatron_gpt(6144, 48, 64)
_GPT_39B, _GPT_76B = megatron_gpt(8192, 48, 64), megatron_gpt(10240, 60, 80)
_GPT_530B, _GPT_1T = megatron_gpt(20480, 105, 128), megatron_gpt(25600, 128, 160)
# Table 1's pipelined rows (NVIDIA/Megatron-LM examples/academic_paper_scripts/sc21, run_table_1.sh and
# CONFIG.sh): TP within a DGX A100, PP and DP across them, DDP (no distributed optimizer), fp16, full
# recomputation, seq 2048, vocab 51200; "interleaved" is Megatron's interleaved 1F1B (PyTorch's
# Interleaved1F1B lays out the same stages per rank)
# MPT's feed-forward uses torch's exact GELU (nn.GELU()): one op, one saved input, where GPT-2's
# "gelu_new" is eight elementwise ops that each save theirs (the 7B without recomputation did not fit).
_MPT = {size: {**gpt(d, layers, heads, vocab=50368), "activation_function": "gelu"}
        for size, (d, layers, heads) in {"7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 56),
                                         "70b": (8192, 80, 64)}.items()}


def _mpt(size: str, gpus: int, micro_batch: int, recompute: str, tokens_per_s: float, table: str) -> PublishedRun:
    """One MPT row of llm-foundry's H100 tables: FSDP over every GPU, sequence 2,048, one microbatch per step."""
    return PublishedRun(
        f"mpt-{size}-fsdp{gpus}", "gpt2", _MPT[size], gpus=gpus, device="h100", mesh={"data": gpus},
        global_batch=micro_batch * gpus, seq=2048, precision="bf16 mixed", recompute=recompute, data_parallel="fsdp",
        compiled=False, tokens_per_s_per_gpu=tokens_per_s, optimizer="decoupled_adamw",
        source=f"{MPT}, table '{table}', row {size} 2048 {gpus} (MicroBatchSize {micro_batch}, GradAccum 1)",
        note="Composer FSDP FULL_SHARD, activation checkpointing " + ("on" if recompute == "full" else "off"))


_LARGE, _SMALL = "H100 80GB BF16 (Large Scale, >= 128 GPUs)", "H100 80GB BF16"

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        "torchtitan-8b-fsdp8", "llama", LLAMA_3_1_8B, gpus=8, device="h100-96gb+expandable", mesh={"data": 8},
        global_batch=16, seq=8192, precision="bf16 mixed", recompute="selective-op", data_parallel="fsdp",
        compiled=True, tokens_per_s_per_gpu=6667, memory_gib=77.0, mfu=0.39, memory_budget=92e9,
        source=TORCHTITAN + ", Table 1, row FSDP + torch.compile",
        note="H100 96 GB HBM2e at 500 W; MFU 33-39 % stated for the 1-D 8B runs (footnote 2, SXM peak)"),
    PublishedRun(
        "torchtitan-8b-fsdp8-eager", "llama", LLAMA_3_1_8B, gpus=8, device="h100-96gb+expandable", mesh={"data": 8},
        global_batch=16, seq=8192, precision="bf16 mixed", recompute="selective-op", data_parallel="fsdp",
        compiled=False, tokens_per_s_per_gpu=5762, memory_gib=82.4, mfu=0.33, memory_budget=92e9,
        source=TORCHTITAN + ", Table 1, row FSDP", note="the same run without torch.compile"),
    PublishedRun(
        "torchtitan-8b-fsdp128", "llama", LLAMA_3_1_8B, gpus=128, device="h100-96gb+expandable", mesh={"data": 128},
        global_batch=256, seq=8192, precision="bf16 mixed", recompute="selective-op", data_parallel="fsdp",
        compiled=True, tokens_per_s_per_gpu=6514, memory_gib=62.0, memory_budget=92e9,
        source=TORCHTITAN + ", Table 3, row FSDP + torch.compile", note="16 nodes, 400 Gb/s RDMA per GPU"),
    PublishedRun(
        "torchtitan-8b-fsdp128-eager", "llama", LLAMA_3_1_8B, gpus=128, device="h100-96gb+expandable",
        mesh={"data": 128},
        global_batch=256, seq=8192, precision="bf16 mixed", recompute="selective-op", data_parallel="fsdp",
        compiled=False, tokens_per_s_per_gpu=5605, memory_gib=67.0, memory_budget=92e9,
        source=TORCHTITAN + ", Table 3, row FSDP", note="the same run without torch.compile"),
    PublishedRun(
        "torchtitan-8b-fsdp8-tp8", "llama", LLAMA_3_1_8B, gpus=64, device="h100-96gb+expandable",
        mesh={"data": 8, "tensor": 8},
        global_batch=96, seq=8192, precision="bf16 mixed", recompute="selective-op", data_parallel="fsdp",
        compiled=True, tokens_per_s_per_gpu=4378, memory_budget=92e9, layout="tensor-parallel",
        source=ASYNC_TP + ", table Llama3 8b, row None (bfloat16), vanilla TP",
        note="8 nodes, TP inside a node; local batch 12 per data rank; memory not published"),
    PublishedRun(
        "torchtitan-70b-fsdp32-tp8", "llama", LLAMA_3_1_70B, gpus=256, device="h100-96gb+expandable",
        mesh={"data": 32, "tensor": 8}, global_batch=512, seq=8192, precision="bf16 mixed", recompute="full",
        data_parallel="fsdp", compiled=True, tokens_per_s_per_gpu=597.3, memory_budget=92e9,
        layout="tensor-parallel", source=ASYNC_TP + ", table Llama3 70b, row None (bfloat16), vanilla TP",
        note="32 nodes; local batch 16 per data rank; memory not published"),
    _mpt("70b", 128, 8, "full", 1058, _LARGE),
    _mpt("30b", 128, 8, "full", 2199, _LARGE),
    _mpt("13b", 128, 16, "full", 5080, _LARGE),
    _mpt("7b", 128, 6, "none", 10475, _LARGE),
    _mpt("13b", 8, 2, "none", 4792, _SMALL),
    _mpt("7b", 8, 6, "none", 10643, _SMALL),
    PublishedRun(
        "megatron-7.5b-tp4", "gpt2", _GPT_7_5B, gpus=128, device="a100", mesh={"data": 32, "tensor": 4},
        global_batch=512, seq=2048, precision="fp16 mixed", recompute="full", data_parallel="ddp",
        layout="tensor-parallel", compiled=False, tokens_per_s_per_gpu=_tps_from_tflops(142, _GPT_7_5B, 2048),
        mfu=0.46,
        source=PTDP + ", row 7.5B: 142 TFLOP/s per GPU (46 % of peak)",
        note="tokens/s derived from the TFLOP/s; the 46 % counts recomputation (hardware FLOPs); "
             "micro-batch size not stated (the plan runs each replica's 16 sequences at once)"),
    PublishedRun(
        "megatron-18.4b-tp8", "gpt2", _GPT_18_4B, gpus=256, device="a100", mesh={"data": 32, "tensor": 8},
        global_batch=1024, seq=2048, precision="fp16 mixed", recompute="full", data_parallel="ddp",
        layout="tensor-parallel", compiled=False, tokens_per_s_per_gpu=_tps_from_tflops(135, _GPT_18_4B, 2048),
        mfu=0.43,
        source=PTDP + ", row 18.4B: 135 TFLOP/s per GPU (43 % of peak)",
        note="as the 7.5B row; 32 sequences per replica"),
    PublishedRun(
        "megatron-22b-tp8-selective", "gpt2", _GPT_22B, gpus=8, device="a100", mesh={"tensor": 8},
        global_batch=4, seq=2048, precision="fp16 mixed", recompute="selective", data_parallel="ddp",
        layout="tensor-parallel", compiled=False, tokens_per_s_per_gpu=4 * 2048 / 1.10 / 8, mfu=0.415,
        source=SELECTIVE + ": 22B, TP 8, 1.10 s per iteration with sequence parallelism + selective "
                           "recomputation (1.42 s with full recomputation), MFU 41.5 %",
        note="one DGX A100; tokens/s = 4 x 2048 / 1.10 s / 8"),
    PublishedRun(
        "megatron-22b-tp8-full", "gpt2", _GPT_22B, gpus=8, device="a100", mesh={"tensor": 8},
        global_batch=4, seq=2048, precision="fp16 mixed", recompute="full", data_parallel="ddp",
        layout="tensor-parallel", compiled=False, tokens_per_s_per_gpu=4 * 2048 / 1.42 / 8,
        source=SELECTIVE + ": 22B, TP 8, 1.42 s per iteration with full recomputation (the baseline of the "
                           "row above)",
        note="one DGX A100; tokens/s = 4 x 2048 / 1.42 s / 8"),
    *(PublishedRun(
        f"megatron-{name}-pp{pp}", "gpt2", cfg, gpus=8 * pp * dp, device="a100", mesh={"pipe": pp, "data": dp, "tensor": 8},
        global_batch=batch, seq=2048, precision="fp16 mixed", recompute="full", data_parallel="ddp",
        layout="tensor-parallel", compiled=False, tokens_per_s_per_gpu=_tps_from_tflops(tflops, cfg, 2048),
        schedule=schedule, microbatch=micro, virtual_stages=virtual,
        source=PTDP + f", row {name}: TP 8, PP {pp}, DP {dp}, {tflops} TFLOP/s per GPU",
        note=f"micro-batch {micro}, {batch // dp // micro} microbatches per replica; tokens/s from the TFLOP/s")
      for name, cfg, pp, dp, batch, micro, schedule, virtual, tflops in (
          ("39.1b", _GPT_39B, 2, 32, 1536, 4, "1F1B", 1, 138),
          ("76.1b", _GPT_76B, 4, 32, 1792, 2, "interleaved", 3, 140),
          ("530b", _GPT_530B, 35, 9, 2520, 1, "interleaved", 3, 163),
          ("1t", _GPT_1T, 64, 6, 3072, 1, "1F1B", 1, 163))),
    # Megatron's layout: attention's tokens over data x expert (its DP 128) with heads over tensor (TP 2); the
    # experts over expert x tensor (EP 8 inside a node, ETP 1) with Megatron-FSDP over data (EDP 32); GA 4 of
    # micro-batch 4 per DP rank. Imposed as "megatron-moe" (benchmarks/layouts.py); the notes give the free plan.
    PublishedRun(
        "megatron-qwen3-235b-a22b-tp2-ep8", "qwen3_moe", QWEN3_235B_A22B, gpus=256, device="h100",
        mesh={"data": 32, "expert": 4, "tensor": 2}, global_batch=2048, seq=4096, precision="bf16 mixed",
        recompute="full", data_parallel="fsdp", compiled=False, tokens_per_s_per_gpu=2048 * 4096 / 17.6 / 256,
        accumulation=4, layout="megatron-moe",
        source=MOE_ZOO + ", table Performance Results (H100), Intra-node EP strategy, first row: TP 2, EP 8, "
                         "EDP 32, DP 128, FSDP on, MBS 4, GBS 2048, GA 4, full recompute, DeepEP dispatcher, "
                         "17.6 s per step, 276 TFLOP/s per GPU",
        note="tokens/s = 2048 x 4096 / 17.6 s / 256; aux-loss load balancing, dropless (priced at balanced routing)"),
)


def run_named(name: str) -> PublishedRun:
    for run in RUNS:
        if run.name == name:
            return run
    raise ValueError(f"no published run {name!r}; known: {[r.name for r in RUNS]}")
