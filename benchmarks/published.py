"""Replan published, measured training runs on the meta device and compare with what they measured.

Run: python -m benchmarks.published [--only NAME ...] [--tiny] [--search]

Each run of benchmarks/published_runs.py is rebuilt with transformers on the meta device (same
model shape, global batch, sequence length, mesh, precision and recomputation) and planned with
autojigsaw.plan on its device spec (a torch.compile'd run on the spec's compiled variant), on the
whole mesh (a 128-GPU FSDP run on 128 ranks). Predicted and published side by side:

  tokens/s per GPU = global batch x seq / plan.step_time / GPUs
  MFU = tokens/s per GPU x (6 N + 12 L d s) / bf16 peak (PaLM, arXiv 2204.02311, appendix B;
        torchtitan's get_num_flop_per_token): N the parameters in matmuls (the input embedding
        left out unless tied; of routed experts, the top-k of each token's share), L layers, d
        width, s sequence. The "published" MFU is this formula
        on the published tokens/s; the source's own figure is listed with the sources.

--tiny shrinks every model to two layers of width 64 (what the smoke test runs). --search plans each
pipelined run free as well: its schedule, microbatches and virtual stages chosen on its own mesh, and its
mesh chosen from its GPU count (benchmarks/published_search.py).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, replace

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate

import autojigsaw
from autojigsaw.cost_model.devices import GiB, device_spec

from .common import Report
from .layouts import megatron_moe, tensor_parallel
from .published_runs import RUNS, PublishedRun, run_named
from .published_search import HEADERS as SEARCH_HEADERS, searched_rows

logging.getLogger("transformers").setLevel(logging.ERROR)

_TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256}
_TINY_GPT = {"n_embd": 64, "n_inner": 256, "n_layer": 2, "n_head": 4, "vocab_size": 256}
_TINY_MOE = {**_TINY_LLAMA, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def tiny(run: PublishedRun) -> PublishedRun:
    """The same run on a two-layer, 64-wide model, 64 tokens per sequence, at most 8 per data rank."""
    shrink = {"llama": _TINY_LLAMA, "qwen3_moe": _TINY_MOE}.get(run.family, _TINY_GPT)
    config = {**run.config, **shrink}
    if run.family == "gpt2":
        config["n_positions"] = 64
    batch = min(run.global_batch, 2 * run.mesh.get("data", 1) * run.accumulation)
    return replace(run, config=config, seq=64, global_batch=batch, memory_budget=None)


def build(run: PublishedRun) -> torch.nn.Module:
    """The run's model on the meta device, from its transformers config."""
    import transformers as tf

    with torch.device("meta"):
        if run.family == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**run.config, use_cache=False))
        if run.family == "qwen3_moe":
            return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**run.config, use_cache=False))
        # Dropout off: autojigsaw draws the single-device mask, so an SDPA with dropout runs
        # replicated; the published runs' 0.1 dropout costs them a few percent of elementwise time.
        return tf.GPT2LMHeadModel(tf.GPT2Config(**run.config, use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0,
                                                embd_pdrop=0.0))


_COMPUTE_DTYPE = {"bf16 mixed": torch.bfloat16, "fp16 mixed": torch.float16}


def plan_options(run: PublishedRun) -> dict:
    """The keyword options of autojigsaw.plan that say how a run trains: its precision, recomputation,
    data parallelism, and what comes back whole."""
    options = {"mp_policy": MixedPrecisionPolicy(param_dtype=_COMPUTE_DTYPE[run.precision], reduce_dtype=torch.float32),
               "activation_checkpointing": run.recompute, "optimizer": run.optimizer,
               # The loss comes back whole; the logits stay wherever the planner puts them (a training loop
               # reads the loss only), as in the published runs, whose models never return them.
               "output_placements": [tuple(Replicate() for _ in run.mesh), None]}
    if run.schedule is not None:  # over a pipe axis the last stage returns the loss whole beside its logits
        del options["output_placements"]
        options.update(pipeline_schedule=run.schedule, virtual_stages=run.virtual_stages,
                       microbatches=run.global_batch // run.mesh.get("data", 1) // run.microbatch)
    if run.accumulation > 1:
        options["microbatches"] = run.accumulation
    if "data" in run.mesh:
        options["data_parallel"] = run.data_parallel
    return options


@dataclass(frozen=True)
class Outcome:
    """A planned run: predicted throughput, MFU and memory, or why planning failed."""

    run: PublishedRun
    tokens_per_s_per_gpu: float | None
    memory_gib: float | None
    flops_per_token: float
    plan_s: float
    notes: tuple[str, ...]
    error: str = ""
    split: tuple[tuple[str, float], ...] = ()  # (part, seconds) of the predicted step
    allocated_gib: float | None = None  # the plan's memory_allocated (what the caching allocator hands out)

    @property
    def ratio(self) -> float | None:
        return self.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu if self.tokens_per_s_per_gpu else None

    @property
    def step_error(self) -> float | None:
        """Predicted step time over the published one, less 1 (-0.1: predicted 10 % fast)."""
        return 1 / self.ratio - 1 if self.ratio else None

    @property
    def fitted(self) -> tuple[str, ...]:
        """The device parameters fitted on this run (its device spec names them): empty for a test run."""
        return tuple(name for name, runs in device_spec(self.run.device).fitted if self.run.name in runs)

    def mfu(self, tokens_per_s: float | None) -> float | None:
        peak = device_spec(self.run.device).peak_flops(_COMPUTE_DTYPE[self.run.precision])
        return tokens_per_s * self.flops_per_token / peak if tokens_per_s else None


def flops_per_token(model: torch.nn.Module, run: PublishedRun) -> float:
    """6 N + 12 L d s: N the parameters in matmuls (an untied input embedding left out; of the routed experts,
    the share a token's top-k reads)."""
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - (0 if tied else embed.numel())
    cfg = model.config
    experts = getattr(cfg, "num_experts", None)
    if experts:
        routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
        n -= routed * (1 - cfg.num_experts_per_tok / experts)
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * run.seq


def plan_run(run: PublishedRun) -> Outcome:
    """Plan one run as published (or its closest expressible plan) and predict its numbers."""
    model = build(run)
    fpt = flops_per_token(model, run)
    options, notes = plan_options(run), []
    spec = device_spec(run.device)
    spec = spec.compiled() if run.compiled else spec
    ids = torch.zeros(run.global_batch, run.seq, dtype=torch.long, device="meta")

    def planned(budget, constraints=None):
        return autojigsaw.plan(model, (ids,), run.mesh, device=spec, example_kwargs={"labels": ids},
                               memory_budget=budget, constraints=constraints, **options)

    start = time.perf_counter()
    try:
        plan = planned(run.memory_budget, layout_constraints(run, model))
        plan_s = time.perf_counter() - start
        if (folded := expert_layout(plan)) is not None:
            notes.append(folded)
        if run.layout != "planned":
            notes.append(own_layout(run, planned))
    except Exception as e:  # noqa: BLE001 - one run that can't be planned must not hide the others
        return Outcome(run, None, None, fpt, time.perf_counter() - start, tuple(notes),
                       f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    tps = run.tokens_per_step / plan.step_time / run.gpus
    allocated = plan.memory_allocated / GiB if plan.memory_allocated is not None else None
    return Outcome(run, tps, plan.memory_per_rank / GiB, fpt, plan_s, tuple(notes),
                   split=time_split(plan), allocated_gib=allocated)


def own_layout(run: PublishedRun, planned) -> str:
    """What autojigsaw would run instead of the run's own layout, for the notes."""
    try:
        own = planned(run.memory_budget)
    except ValueError as e:
        return f"autojigsaw's own layout: no plan ({str(e).splitlines()[0][:80]})"
    folded = expert_layout(own)
    return (f"autojigsaw's own layout: {run.tokens_per_step / own.step_time / run.gpus:,.0f} tok/s/GPU, "
            f"{own.memory_per_rank / GiB:.1f} GiB" + (f" ({folded})" if folded else ""))


_SPLITS = {0: "batch", 1: "heads", 2: "sequence"}  # attention's query [B, H, S, D]


def expert_layout(plan) -> str | None:
    """Where a plan with routed experts puts them and attention, per mesh axis (None without routed experts)."""
    routed = [n for n in plan.nodes if n.op == "autojigsaw.routed_experts"]
    if not routed:
        return None
    text = f"experts {'; '.join(sorted({n.note or 'replicated' for n in routed}))}"
    attention = [n for n in plan.nodes if n.kind == "attention"]
    if attention:
        query = attention[0].inputs[0]
        axes = ", ".join(f"{name}: {_SPLITS.get(getattr(p, 'dim', None), 'whole') if p.is_shard() else 'whole'}"
                         for name, p in zip(plan.mesh.axis_names, query))
        text += f"; attention {axes}"
    return text


def layout_constraints(run: PublishedRun, model: torch.nn.Module) -> dict | None:
    """The run's own layout (its `layout`) as constraints on the plan; None: the planner's free choice."""
    if run.layout == "planned":
        return None
    if run.layout == "tensor-parallel":
        return tensor_parallel(model)
    if run.layout == "megatron-moe":
        return megatron_moe(model, tuple(run.mesh))
    raise ValueError(f"run {run.name!r}: unknown layout {run.layout!r}; known: 'planned', 'tensor-parallel', "
                     "'megatron-moe'")


_PARTS = {"matmul": "matmul", "attention": "attention", "softmax": "softmax+norm", "norm": "softmax+norm",
          "param": "optimizer"}
PARTS = ("matmul", "attention", "softmax+norm", "other ops", "optimizer", "resharding")


def time_split(plan) -> tuple[tuple[str, float], ...]:
    """Seconds of the predicted step per part: node kinds (kernel-internal collectives included), resharding;
    none for a pipelined plan, whose step is its schedule's (its stages' table says where it goes)."""
    if plan.pipeline is not None:
        return ()
    total = dict.fromkeys(PARTS, 0.0)
    for n in plan.nodes:
        total[_PARTS.get(n.kind, "other ops")] += n.compute_s
        total["resharding"] += n.comm_s
    return tuple(total.items())


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def rows(outcomes: list[Outcome]) -> list[tuple]:
    out = []
    for o in outcomes:
        r = o.run
        mesh = " x ".join(f"{k}={v}" for k, v in r.mesh.items())
        out.append((r.name, "training: " + ", ".join(o.fitted) if o.fitted else "test", r.gpus, mesh,
                    _f(o.tokens_per_s_per_gpu, ",.0f"), f"{r.tokens_per_s_per_gpu:,.0f}",
                    _f(o.ratio, ".2f"), _f(o.step_error, "+.1%"), _f(o.mfu(o.tokens_per_s_per_gpu), ".1%"),
                    _f(o.mfu(r.tokens_per_s_per_gpu), ".1%"),
                    _f(o.allocated_gib, ".1f"), _f(o.memory_gib, ".1f"), _f(r.memory_gib, ".1f"), f"{o.plan_s:.1f}",
                    "; ".join(o.notes + ((o.error,) if o.error else ()))))
    return out


HEADERS = ["run", "role", "GPUs", "mesh", "tok/s/GPU pred", "published", "ratio", "step err", "MFU pred", "MFU pub",
           "GiB alloc", "GiB pred", "GiB pub", "plan s", "notes"]


def errors_apart(outcomes: list[Outcome]) -> str:
    """The step-time error of the training runs and of the test runs, apart: worst and mean magnitude."""
    parts = []
    training = [o for o in outcomes if o.fitted]
    for role, group in (("training", training), ("test", [o for o in outcomes if o not in training])):
        errs = [o.step_error for o in group if o.step_error is not None]
        if errs:
            worst = max(errs, key=abs)
            parts.append(f"{role} runs ({len(errs)}): worst step-time error {worst:+.1%}, mean |error| "
                         f"{sum(map(abs, errs)) / len(errs):.1%}")
    return "; ".join(parts) or "no run planned"


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"runs to plan, of {[r.name for r in RUNS]}")
    p.add_argument("--tiny", action="store_true", help="two-layer, 64-wide models (the smoke test)")
    p.add_argument("--search", action="store_true", help="pipelined runs planned free too: on their own mesh, and "
                                                          "their GPU count with the mesh searched (minutes each)")
    args = p.parse_args(argv)
    runs = [run_named(n) for n in args.only] if args.only else list(RUNS)
    if args.tiny:
        runs = [tiny(r) for r in runs]
    rep = Report("published", "Published training runs, replanned" + (" (tiny models)" if args.tiny else ""))
    outcomes = []
    for run in runs:
        print(f"planning {run.name} ({run.gpus} x {run.device}, {run.mesh}) ...", flush=True)
        outcomes.append(plan_run(run))
    rep.table("Predicted against published, per GPU", rows(outcomes), HEADERS,
              f"{errors_apart(outcomes)}. Step err: predicted step time over the published one, less 1; role: "
              "training where a device parameter was fitted on the run (DeviceSpec.fitted names it), test "
              "otherwise. MFU = tokens/s x (6N + 12 L d s) / peak (both columns, same formula); GiB pred: on a GPU "
              "the peak the caching allocator reserves (max_memory_reserved, what torchtitan publishes), GiB alloc: "
              "what it hands out (max_memory_allocated)")
    rep.table("Where the predicted step goes (% of the sum of node and resharding times)",
              [(o.run.name, *(f"{100 * t / max(sum(dict(o.split).values()), 1e-30):.0f}" for _, t in o.split))
               for o in outcomes if o.split], ["run", *PARTS])
    if args.search:
        rep.table("Pipelined runs left free: on their own mesh, and given only their GPU count",
                  [row for o in outcomes if o.run.schedule is not None
                   for row in searched_rows(o.run, build(o.run), plan_options(o.run), o.tokens_per_s_per_gpu)],
                  SEARCH_HEADERS, "vs own layout: predicted tokens/s over the run's own layout's prediction")
    rep.text("Sources", "\n".join(
        f"{o.run.name}: {o.run.source}" + (f"; stated MFU {o.run.mfu:.1%}" if o.run.mfu else "")
        + (f" ({o.run.note})" if o.run.note else "") for o in outcomes))
    rep.save()
    return rep


if __name__ == "__main__":
    main()
