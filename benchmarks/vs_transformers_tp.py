"""autojigsaw against transformers' own tensor-parallel plan, on a tiny Llama on local gloo ranks.

transformers' models ship a TP plan (`config.base_model_tp_plan`: q/k/v and gate/up colwise,
o/down rowwise; `lm_head` colwise with its output gathered). `from_pretrained(..., tp_plan="auto")`
applies it with `transformers.distributed.tensor_parallel.apply_tensor_parallelism` on the "tp"
mesh; this script calls the same function, with the plan expanded to the model's layers, on a
model built from a config. autojigsaw plans the unmodified model by itself (the built-in "cpu"
spec, its default budget), and once more on a 100 us gloo link (5x less latency than
benchmarks/gloo_links.py measures). All train eager: forward with labels, backward, Adam step.
The losses of two steps must match the single-device model's first; repetitions are interleaved,
the table shows medians. Collectives and bytes are measured on one step (benchmarks/measure.py).

Run: python -m benchmarks.vs_transformers_tp [--reps 6] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import warnings

import torch
import torch.distributed as dist

import autojigsaw
from autojigsaw.cost_model.devices import LinkSpec, device_spec
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh

from .common import Report, kib, ratio
from .measure import comm_of, timed_step

TOLERANCE = 1e-4  # relative, fp32
NAMES = ("single", "transformers-tp", "autojigsaw", "autojigsaw-100us")
# A gloo link of 100 us and 1 GB/s, 5x less latency than benchmarks/gloo_links.py measures: many small collectives.
_OLD_LINKS = (LinkSpec("gloo loopback", 100e-6, 1.0e9), LinkSpec("gloo tcp", 200e-6, 0.5e9))


def tiny_llama(cfg: dict):
    """(model, input ids), seeded: the same on every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=4 * cfg["hidden"],
                                      num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                                      num_key_value_heads=cfg["heads"], vocab_size=cfg["vocab"],
                                      max_position_embeddings=cfg["seq"], use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    return model, torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))


def transformers_tp(model, mesh):
    """transformers' own TP plan, applied as from_pretrained(tp_plan="auto") applies it."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    return apply_tensor_parallelism(model, mesh, model._expand_parallel_plan(model.tp_plan))


class _Run:
    def __init__(self, module, active: bool = True):
        self.module, self.active = module, active
        self.optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)

    def step(self, ids) -> float:
        loss = self.module(ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def run_rank(cfg: dict) -> dict:
    """On every rank: build the three, check two steps' losses, time them interleaved, measure traffic."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    n = dist.get_world_size()
    mesh = get_mesh((n,), ("tensor",))
    model, ids = tiny_llama(cfg)
    runs = {"single": _Run(copy.deepcopy(model), active=dist.get_rank() == 0),
            "transformers-tp": _Run(transformers_tp(copy.deepcopy(model), mesh)),
            "autojigsaw": _Run(autojigsaw.parallelize(copy.deepcopy(model), mesh, (ids,), compile=False,
                                                      example_kwargs={"labels": ids})),
            "autojigsaw-100us": _Run(autojigsaw.parallelize(copy.deepcopy(model), mesh, (ids,), compile=False,
                                                            example_kwargs={"labels": ids},
                                                            device=device_spec("cpu").with_links(*_OLD_LINKS)))}
    losses = {name: [r.step(ids) for _ in range(2)] if r.active else None for name, r in runs.items()}
    ref = torch.tensor(losses["single"] if losses["single"] else [0.0, 0.0], dtype=torch.float64)
    dist.broadcast(ref, 0)
    diffs = {name: max(abs(a - b) / abs(b) for a, b in zip(v, ref.tolist()))
             for name, v in losses.items() if v is not None}
    bad = {k: d for k, d in diffs.items() if not d < TOLERANCE}
    if bad:
        raise AssertionError(f"losses differ from the single-device model by {bad}; nothing was timed")
    for run in runs.values():
        timed_step(run, ids)
    times = {name: [] for name in runs}
    for _ in range(cfg["reps"]):
        for name, run in runs.items():
            times[name].append(timed_step(run, ids))
    comm, counted = {}, {}
    for name, run in runs.items():
        if name != "single":
            with count_comm() as log:
                comm[name] = comm_of(lambda r=run: r.step(ids))
            counted[name] = log.total_bytes
    return {"times": times, "comm": comm, "counted": counted, "diffs": diffs,
            "table": runs["autojigsaw"].module.plan.table(),
            "plan": {name: run.module.plan.comm_bytes for name, run in runs.items() if name.startswith("autojigsaw")}}


def report(ranks: list[dict], cfg: dict, n: int) -> Report:
    rep = Report("vs_transformers_tp", "autojigsaw against transformers' tensor-parallel plan (CPU, gloo)")
    rep.lines += [f"Model: LlamaForCausalLM, hidden {cfg['hidden']}, {cfg['layers']} layers, {cfg['heads']} heads, "
                  f"FFN {4 * cfg['hidden']}, vocab {cfg['vocab']}, fp32; input {cfg['batch']} x {cfg['seq']} tokens "
                  f"with labels; {n} gloo ranks, one thread each; step = forward + backward + Adam step, eager; "
                  f"median of {cfg['reps']} interleaved repetitions after one warm-up; 'single' runs on rank 0 "
                  "alone. transformers-tp: the model's base_model_tp_plan and lm_head colwise_gather_output, "
                  "applied by transformers.distributed.tensor_parallel.apply_tensor_parallelism (what "
                  "from_pretrained(tp_plan='auto') calls); autojigsaw: its own plan with the built-in 'cpu' spec; "
                  "autojigsaw-100us: planned with that spec's gloo link as it was before it was measured (100 us "
                  "and 1 GB/s per round).", ""]
    r0 = ranks[0]
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    rows = []
    for name in NAMES:
        calls = r0["comm"].get(name, (0, 0))[0]
        sent = max(r["comm"][name][1] for r in ranks) if name in r0["comm"] else 0
        lo, hi = min(r0["times"][name]), max(r0["times"][name])
        rows.append((name, f"{med[name] * 1e3:.1f}", f"{lo * 1e3:.1f}-{hi * 1e3:.1f}",
                     ratio(med[name], med["transformers-tp"]), calls if name != "single" else "",
                     kib(sent) if name != "single" else "",
                     kib(max(r["counted"][name] for r in ranks)) if name in r0["plan"] else "",
                     kib(r0["plan"][name]) if name in r0["plan"] else "",
                     f"{max(r['diffs'].get(name, 0.0) for r in ranks):.1e}"))
    rep.table(f"{n} ranks: step time and communication per rank", rows,
              ["implementation", "median ms", "range ms", "vs transformers-tp", "collectives", "KiB sent",
               "KiB counted", "KiB predicted", "loss rel. diff"],
              note="collectives and KiB sent: one step, measured by CommDebugMode (ring-algorithm bytes, the most "
                   "loaded rank; it prices the ring steps of autojigsaw's fused kernels, all_to_all_single calls, by "
                   "all_to_all's formula, not the bytes they send); KiB counted: autojigsaw's own count of the "
                   "same step (count_comm); "
                   "loss rel. diff: largest relative difference of two steps' losses from the single-device model.")
    rep.text(f"{n} ranks: the plan autojigsaw chose", r0["table"])
    return rep


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "batch", "seq", "reps")}
    with LocalRanks(args.ranks, timeout=3600, collective_timeout=900) as ranks:
        results = ranks.run(run_rank, cfg)
    rep = report(results, cfg, args.ranks)
    rep.save()
    return rep


if __name__ == "__main__":
    main()
