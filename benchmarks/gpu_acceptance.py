"""GPU acceptance: kernel overhead, memory measured against predicted, the training example; one GPU.

Run: python -m benchmarks.gpu_acceptance      (one GPU, at most 8 minutes; without a GPU it says so and exits 0)

Three parts, one markdown report (benchmarks/out/gpu_acceptance.md):

1. Memory. A Hugging Face Llama (4 layers, 1024 wide, vocabulary 32,000, 4 x 1024 tokens, fp32,
   Adam stepping one parameter at a time, as the memory model prices it) is trained through
   `parallelize` on a 1-rank mesh, each case in a fresh process: eager with the caching allocator's
   default segments, eager and compiled with expandable segments (PYTORCH_CUDA_ALLOC_CONF). Measured:
   torch.cuda.max_memory_reserved over the first three steps and max_memory_allocated of the third;
   predicted: the plan's memory_per_rank (reserved) and memory_allocated, on the GPU's spec.
2. The training example, examples/train.py under torchrun on 1 GPU (NCCL), eager and --compile:
   its exit status and losses (the two must agree).
3. The kernels' overhead at world size 1 (NCCL): benchmarks/gpu_overhead.py's distributed linears and
   ring attention against F.linear and SDPA, eager and compiled, with the time the cost model predicts.

A part that fails or runs out of the time budget is a row that says so; the script then exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from .common import Report

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 8 * 60  # the whole script
MEMORY_CASES = (("eager", False), ("eager", True), ("compiled", True))  # (mode, expandable segments)
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=32000)
BATCH = (4, 1024)
FLAG = 0.10  # memory errors beyond this are marked


@dataclass(frozen=True)
class MemoryMeasurement:
    """One memory case: predicted and measured peaks (bytes), or why it failed."""

    mode: str  # "eager" | "compiled"
    expandable: bool
    predicted_allocated: int = 0
    measured_allocated: int = 0
    predicted_reserved: int = 0
    measured_reserved: int = 0
    peak_at: str = ""
    error: str = ""


@dataclass(frozen=True)
class ExampleRun:
    """One run of examples/train.py: exit status, losses per step, the last step's tokens/s."""

    mode: str
    returncode: int
    losses: tuple[float, ...] = ()
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    error: str = ""


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def _error(predicted: int, measured: int) -> str:
    if not measured:
        return "-"
    e = (predicted - measured) / measured
    return f"{e:+.1%}" + (" !" if abs(e) > FLAG else "")


def memory_rows(cases: list[MemoryMeasurement]) -> list[tuple]:
    """The memory table: allocated and reserved, predicted against measured, with the error."""
    rows = []
    for c in cases:
        alloc = "expandable segments" if c.expandable else "default segments"
        if c.error:
            rows.append((c.mode, alloc, "failed", "", "", "", "", "", c.error[:160]))
            continue
        rows.append((c.mode, alloc, _gib(c.predicted_allocated), _gib(c.measured_allocated),
                     _error(c.predicted_allocated, c.measured_allocated), _gib(c.predicted_reserved),
                     _gib(c.measured_reserved), _error(c.predicted_reserved, c.measured_reserved), c.peak_at))
    return rows


MEMORY_HEADERS = ["mode", "allocator", "allocated, predicted", "allocated, measured", "error", "reserved, predicted",
                  "reserved, measured", "error", "predicted peak at"]


def example_rows(runs: list[ExampleRun]) -> list[tuple]:
    """The training example's table, and whether eager and compiled losses agree."""
    return [(r.mode, r.returncode, " ".join(f"{x:.4f}" for x in r.losses), f"{r.tokens_per_s:,.0f}",
             f"{r.seconds:.0f} s", r.error[:160]) for r in runs]


EXAMPLE_HEADERS = ["mode", "exit", "losses", "tokens/s (last step)", "time", "error"]


def losses_agree(runs: list[ExampleRun], rtol: float = 1e-3) -> bool:
    """Eager and compiled runs of the example reach the same losses (fp32; compiled kernels round differently)."""
    done = [r for r in runs if r.returncode == 0 and r.losses]
    if len(done) < 2:
        return False
    first = done[0].losses
    return all(len(r.losses) == len(first) and all(abs(a - b) <= rtol * max(abs(b), 1.0) for a, b in
                                                     zip(r.losses, first)) for r in done[1:])


def write_report(memory: list[MemoryMeasurement], examples: list[ExampleRun], kernels: list[tuple],
                 kernel_headers: list[str], failures: list[str]) -> Report:
    """The report: three tables, the failures, saved as benchmarks/out/gpu_acceptance.md."""
    rep = Report("gpu_acceptance", "GPU acceptance: memory, the training example, kernel overhead")
    rep.table("Memory: predicted against measured (torch.cuda.max_memory_allocated / max_memory_reserved)",
              memory_rows(memory), MEMORY_HEADERS,
              f"model: Hugging Face Llama {LLAMA}, batch {BATCH[0]} x {BATCH[1]} tokens, fp32, Adam (foreach=False); "
              f"'!' marks an error beyond {FLAG:.0%}")
    rep.table("Training example (examples/train.py, torchrun, 1 GPU, NCCL)", example_rows(examples), EXAMPLE_HEADERS,
              "eager and compiled losses agree" if losses_agree(examples) else "eager and compiled losses DIFFER "
              "(or a run failed)")
    rep.table("Kernels at world size 1 (forward + backward)", kernels, kernel_headers)
    if failures:
        rep.text("Failed", "\n".join(failures))
    rep.save()
    return rep


# ---------------------------------------------------------------- measuring (GPU only)


def _memory_case(mode: str, expandable: bool) -> MemoryMeasurement:
    """Run in a fresh process (the allocator's setting is read at CUDA's start): train 3 steps, measure."""
    import torch.distributed as dist
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh

    import autojigsaw
    from autojigsaw.runtime.checks import device_of

    from .gpu_overhead import _init

    _init("cuda")
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tensor",))
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA, use_cache=False)).cuda()
    ids = torch.randint(0, LLAMA["vocab_size"], BATCH, device="cuda")
    spec = device_of(mesh) + ("+expandable" if expandable else "") + ("+compile" if mode == "compiled" else "")
    pmodel = autojigsaw.parallelize(model, mesh, (ids,), example_kwargs={"labels": ids}, device=spec,
                                    compile=mode == "compiled")
    del model
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-5, foreach=False)

    def step():
        pmodel(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what building the model cached: the step starts from its parameters alone
    torch.cuda.reset_peak_memory_stats()
    step()
    step()
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()  # segments stay: the first steps' peak is the run's
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    plan = pmodel.plan
    measured = MemoryMeasurement(mode, expandable, plan.memory_allocated or 0, torch.cuda.max_memory_allocated(),
                                 plan.memory_per_rank, max(reserved, torch.cuda.max_memory_reserved()), plan.peak_at)
    dist.destroy_process_group()
    return measured


def run_memory_case(mode: str, expandable: bool, timeout_s: float) -> MemoryMeasurement:
    """One memory case in a subprocess with its allocator setting; its JSON line, or the failure."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"expandable_segments:{expandable}")
    cmd = [sys.executable, "-m", "benchmarks.gpu_acceptance", "--memory-case", mode, str(int(expandable))]
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return MemoryMeasurement(mode, expandable, error=f"timed out after {timeout_s:.0f} s")
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith("{")), None)
    if out.returncode or line is None:
        return MemoryMeasurement(mode, expandable, error=f"exit {out.returncode}: {_last_line(out.stderr)}")
    return MemoryMeasurement(**json.loads(line))


_STEP = re.compile(r"step\s+\d+\s+loss ([0-9.eE+-]+)\s+([0-9.]+) tokens/s")


def run_example(mode: str, timeout_s: float) -> ExampleRun:
    """examples/train.py under torchrun on this GPU, 5 steps, no checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "examples" / "train.py"), "--mesh", "1", "--steps", "5", "--recompute", "none",
           "--checkpoint-dir", ""] + (["--compile"] if mode == "compiled" else [])
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ExampleRun(mode, -1, error=f"timed out after {timeout_s:.0f} s", seconds=time.perf_counter() - start)
    steps = [(float(loss), float(tps)) for loss, tps in _STEP.findall(out.stdout)]
    return ExampleRun(mode, out.returncode, tuple(s[0] for s in steps), steps[-1][1] if steps else 0.0,
                      time.perf_counter() - start, "" if out.returncode == 0 else _last_line(out.stderr))


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def kernel_table(failures: list[str]) -> tuple[list[tuple], list[str]]:
    """benchmarks/gpu_overhead.py's kernel rows on this GPU (its spec for the predictions)."""
    import torch.distributed as dist

    from autojigsaw.cost_model.devices import device_spec
    from autojigsaw.runtime.checks import device_of

    from .gpu_overhead import SIZES, _init, kernel_rows

    group = _init("cuda")
    spec = device_of(SimpleNamespace(device_type="cuda"))
    rows = kernel_rows("cuda", group, SIZES["full"], torch.bfloat16, device_spec(spec), [False, True], failures)
    dist.destroy_process_group()
    return rows, ["case (forward + backward)", "mode", "torch ms", "autojigsaw ms", "overhead",
                  f"predicted ms ({spec})", "measured / predicted"]


def main(argv: list[str] | None = None) -> Report | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory-case", nargs=2, metavar=("MODE", "EXPANDABLE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_acceptance: no CUDA GPU here, nothing run. Run it on a machine with one "
              "(python -m benchmarks.gpu_acceptance).")
        return None
    if args.memory_case:  # the child of run_memory_case
        print(json.dumps(asdict(_memory_case(args.memory_case[0], args.memory_case[1] == "1"))), flush=True)
        return None
    deadline, failures = time.perf_counter() + BUDGET_S, []

    def left(share: float) -> float:
        return max(share * (deadline - time.perf_counter()), 1.0)

    memory = [run_memory_case(mode, expandable, left(0.25)) for mode, expandable in MEMORY_CASES]
    examples = [run_example(mode, left(0.4)) for mode in ("eager", "compiled")]
    failures += [f"memory, {m.mode}, expandable={m.expandable}: {m.error}" for m in memory if m.error]
    failures += [f"example, {r.mode}: {r.error or f'exit {r.returncode}'}" for r in examples if r.returncode]
    if deadline - time.perf_counter() > 60:
        kernels, headers = kernel_table(failures)
    else:
        kernels, headers = [], ["case"]
        failures.append(f"kernels: not run, the {BUDGET_S} s budget is spent")
    report = write_report(memory, examples, kernels, headers, failures)
    if failures:
        raise SystemExit(f"gpu_acceptance: {len(failures)} part(s) failed (the report has the others)")
    return report


if __name__ == "__main__":
    main()
