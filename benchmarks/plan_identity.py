"""Plans of 18 model x mesh cases as one canonical digest, to prove a refactor keeps every plan.

Run: python benchmarks/plan_identity.py [--out FILE] [--compare FILE]

The cases: GPT-2, Llama, BERT and ViT (tests/hf_models.py), the weather mixer
(examples/mixer_model.py) and the MLP stack (benchmarks/models.py), in float64, each on
{"tensor": 2}, {"domain": 2} and {"domain": 2, "tensor": 2} under 0.7 of its 1-rank plan's
memory, as tests/side_by_side.py budgets them, each proven optimal (mip_gap=0: a plan within a gap
depends on where the search stopped). The digest keeps, per node, the placements,
kernel, predicted comm bytes and memory (and the predicted times to 9 digits); --compare
prints every difference to a saved digest and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import autojigsaw  # noqa: E402
from benchmarks.models import build as build_mlp, sample  # noqa: E402
from mixer_model import WeatherMixer  # noqa: E402
from tests.hf_models import hf_model  # noqa: E402

MODELS = ("gpt2", "llama", "bert", "vit", "mixer", "mlp")
MESHES = ({"tensor": 2}, {"domain": 2}, {"domain": 2, "tensor": 2})
FRACTION = 0.7


def build(name: str):
    """(model, example inputs) of `name` in float64, seeded."""
    if name == "mixer":
        torch.manual_seed(0)
        model, inputs = WeatherMixer(), (torch.randn(2, 3, 8, 8),)
    elif name == "mlp":
        model, inputs = build_mlp(64, 128, 2), (sample(2, 16, 64),)
    else:
        model, inputs = hf_model(name)
    model.train()
    return model.double(), tuple(x.double() if x.is_floating_point() else x for x in inputs)


def _round(x: float) -> float:
    return float(f"{x:.9g}")


def digest(plan) -> dict:
    """The decisions and predictions of `plan` as plain, comparable data."""
    data = json.loads(plan.to_json())
    data["step_time"] = _round(data["step_time"])
    data["nodes"] = {n.pop("name"): {**n, "compute_s": _round(n["compute_s"]), "comm_s": _round(n["comm_s"])}
                     for n in data["nodes"]}
    return data


def plans() -> dict:
    """The digest of every case, keyed "model on mesh"."""
    out = {}
    for name in MODELS:
        model, inputs = build(name)
        whole = autojigsaw.plan(model, inputs, {"tensor": 1}, device="cpu", mip_gap=0).memory_per_rank
        for mesh in MESHES:
            model, inputs = build(name)
            plan = autojigsaw.plan(model, inputs, mesh, device="cpu", memory_budget=int(FRACTION * whole), mip_gap=0)
            key = f"{name} on {mesh}"
            out[key] = digest(plan)
            print(f"{key}: comm {plan.comm_bytes} B, peak {plan.memory_per_rank} B, "
                  f"fingerprint {plan.fingerprint()}", flush=True)
    return out


def differences(before, after, path: str = "") -> list[str]:
    """Every path at which `before` and `after` differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [line for key in sorted(set(before) | set(after), key=str)
                for line in (differences(before.get(key), after.get(key), f"{path}/{key}")
                             if key in before and key in after else [f"{path}/{key}: only in "
                                                                     f"{'before' if key in before else 'after'}"])]
    if before != after:
        return [f"{path}: {before!r} -> {after!r}"]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="save the digest as JSON here")
    parser.add_argument("--compare", help="a saved digest to diff against")
    args = parser.parse_args()
    now = plans()
    if args.out:
        Path(args.out).write_text(json.dumps(now, indent=1, sort_keys=True))
    if args.compare:
        diff = differences(json.loads(Path(args.compare).read_text()), now)
        print("\n".join(diff) if diff else f"identical: {len(now)} plans")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
