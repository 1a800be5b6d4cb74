"""Peak memory under recomputation, predicted against measured: Hugging Face models on tensor=2 (gloo, CPU).

Each model (tests/hf_models.py, 2 layers, a batch of 8) is planned once on 2 ranks with 100 us
links (so that the plan splits its layers), then priced and run with that sharding four ways:
no recomputation, and every repeated layer "selective", "selective-op" (torchtitan's) and "full". One Adam step warms up; the
next step's peak is measured with torch's MemTracker (tests/cost_checks.measure_step), optimizer
states included, beside the plan's prediction. The drops (none minus the policy) are what
recomputation frees: the planner trades them against time.

Run: python -m benchmarks.recompute_memory [--models gpt2 llama ...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import autojigsaw
from autojigsaw.testing.local_ranks import LocalRanks
from tests.cost_checks import CPU_100US, measure_step
from tests.hf_models import batch_of_8

from .common import Report, kib

MODELS = ("gpt2", "llama", "bert", "vit", "swin", "segformer", "convnextv2", "resnet")
POLICIES = ("none", "selective", "selective-op", "full")


def _plans(name: str) -> dict[str, autojigsaw.Plan]:
    """One sharding, priced with each policy on every layer the planner would recompute."""
    model, inputs = batch_of_8(name)
    full = autojigsaw.plan(model, inputs, {"tensor": 2}, device=CPU_100US, activation_checkpointing="full")
    layers = [layer for layer, _ in full.recompute]
    recompute = {p: tuple((layer, p) for layer in layers) if p != "none" else () for p in POLICIES}
    return {p: autojigsaw.evaluate(replace(full, recompute=recompute[p]), model, inputs, device=CPU_100US)
            for p in POLICIES}


def main(argv: list[str] | None = None) -> Report:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = p.parse_args(argv)
    report = Report("recompute_memory", "Peak memory per rank under recomputation, predicted and measured "
                                         "(tensor=2, fp32, Adam)")
    rows = []
    with LocalRanks(2) as pool:
        for name in args.models:
            plans = _plans(name)
            peak = {}
            for policy, plan in plans.items():
                r = pool.run(measure_step, batch_of_8, (name,), (2,), ("tensor",), plan=plan.to_json(),
                             device=CPU_100US)[0]
                peak[policy] = (r.predicted_peak, r.peak)
            for policy, (predicted, measured) in peak.items():
                drop = ""
                if policy != "none":
                    want, got = peak["none"][0] - predicted, peak["none"][1] - measured
                    drop = f"{kib(want)} / {kib(got)}"
                rows.append((name, policy, kib(predicted), kib(measured), f"{predicted / measured - 1:+.1%}", drop))
    report.table("Hugging Face models on tensor=2 (100 us links), every repeated layer recomputed", rows,
                 ["model", "recompute", "predicted KiB", "measured KiB", "error", "drop predicted / measured KiB"])
    report.save()
    return report


if __name__ == "__main__":
    main()
