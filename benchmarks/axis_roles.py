"""Axis names as labels (the planner's rule) against axis roles enforced: predicted bytes and step time.

Run: python benchmarks/axis_roles.py [--models gpt2,llama] [--meshes 2x2,4x4,8x8]

Labels: the planner may put anything on any axis (only "data"/"dp" is special). Roles are enforced
as constraints on each node's strategies (`constraints=`, a function per node name):
- weights only on `tensor`: a parameter, and a parameter read by a node, is whole over `domain`;
- samples only on `domain`: the model's inputs are whole over `tensor`;
- activations keep their batch dim (dim 0) whole over `tensor` (Megatron's feature and head
  shards on `tensor` stay allowed; sequence, spatial and batch shards go on `domain`).
A node with no strategy left keeps them all (counted under "unfiltered"). The models: GPT-2,
Llama, BERT, ViT (tests/hf_models.py, 2 layers, 64 wide), the weather mixer and the MLP stack, in
fp32, priced on "h100", planned with no process group. The budget is half the 1-rank plan's
memory, so that something must be sharded; the planner then minimises the step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch
from tabulate import tabulate
from torch.distributed.tensor import Replicate, Shard

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import autojigsaw  # noqa: E402
import autojigsaw.api  # noqa: E402
from autojigsaw.ir import STRATEGIES, tensor_inputs  # noqa: E402
from autojigsaw.strategies.annotate import annotate  # noqa: E402
from benchmarks.models import build as build_mlp, sample  # noqa: E402
from mixer_model import WeatherMixer  # noqa: E402
from tests.hf_models import hf_model  # noqa: E402

MODELS = ("gpt2", "llama", "bert", "vit", "mixer", "mlp")
MESHES = {"2x2": (2, 2), "4x4": (4, 4), "8x8": (8, 8)}
DOMAIN, TENSOR = 0, 1  # the axes of {"domain": d, "tensor": t}


def build(name: str):
    """(model, example inputs) of `name` in fp32, seeded, with a batch every mesh can split."""
    torch.manual_seed(0)
    if name == "mixer":
        return WeatherMixer(), (torch.randn(16, 3, 8, 8),)
    if name == "mlp":
        return build_mlp(256, 1024, 4), (sample(16, 256, 256),)
    model, inputs = hf_model(name)
    if name == "vit":
        return model, (torch.randn(16, 3, 32, 32),)
    return model, (torch.randint(0, 128, (16, 64)),)


def _keeps_roles(node, strategy, params: set[str], inputs: set[str]) -> bool:
    """Whether `strategy` puts weights only on `tensor`, samples and batch only on `domain`."""
    if node.op == "placeholder":
        out = strategy.outputs[0]
        if node.name in params:
            return isinstance(out[DOMAIN], Replicate)
        return not (node.name in inputs and isinstance(out[TENSOR], Shard))
    for (src, _), placements in zip(tensor_inputs(node), strategy.inputs):
        if src.name in params and not isinstance(placements[DOMAIN], Replicate):
            return False
    return all(out is None or out[TENSOR] != Shard(0) for out in strategy.outputs)


def roles_kept(captured, mesh) -> tuple[dict, list[str]]:
    """The roles as constraints (node name -> which of its strategies keep them), and the nodes none of whose
    strategies does (left free)."""
    params, inputs = set(captured.params), set(captured.inputs)
    annotate(captured.gm, mesh)
    constraints, unfiltered = {}, []
    for node in captured.gm.graph.nodes:
        if not any(_keeps_roles(node, s, params, inputs) for s in node.meta.get(STRATEGIES, ())):
            unfiltered += [node.name] if STRATEGIES in node.meta else []
            continue
        constraints[node.name] = functools.partial(_keeps_roles, node, params=params, inputs=inputs)
    return constraints, unfiltered


@functools.cache
def captured_and_whole(name: str):
    """The captured graph of `name` (planned again for every mesh) and its 1-rank plan's bytes."""
    model, inputs = build(name)
    captured = autojigsaw.api.capture_for(model, inputs, {}, autojigsaw.training.Regime())
    whole = autojigsaw.api.plan_captured(captured, autojigsaw.MeshSpec(("tensor",), (1,)),
                                         autojigsaw.Options("h100")).memory_per_rank
    return captured, whole


def plan_both(name: str, mesh_shape: tuple[int, int]) -> list:
    """[model, mesh, (bytes, step s) with labels, the same with roles, ratios, unfiltered nodes]."""
    captured, whole = captured_and_whole(name)
    mesh = autojigsaw.MeshSpec(("domain", "tensor"), mesh_shape)
    options = autojigsaw.Options("h100", memory_budget=whole // 2)
    roles, unfiltered = roles_kept(captured, mesh)
    results = []
    for enforce in (False, True):
        try:
            results.append(autojigsaw.api.plan_captured(
                captured, mesh, dataclasses.replace(options, constraints=roles) if enforce else options))
        except ValueError as e:  # no plan fits the budget
            results.append(str(e).splitlines()[0][:60])
    labels, roles = results
    row = [name, "x".join(map(str, mesh_shape))]
    for p in results:
        row += [f"{p.comm_bytes / 2**20:.2f}", f"{p.step_time * 1e3:.3f}", f"{p.memory_per_rank / 2**20:.1f}"] \
            if not isinstance(p, str) else ["no plan", "-", "-"]
    both = not isinstance(labels, str) and not isinstance(roles, str)
    row += [f"{roles.comm_bytes / max(labels.comm_bytes, 1):.2f}" if both else "-",
            f"{roles.step_time / labels.step_time:.2f}" if both else "-", len(set(unfiltered))]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--meshes", default=",".join(MESHES))
    args = parser.parse_args()
    rows = []
    for mesh in args.meshes.split(","):
        for name in args.models.split(","):
            t0 = time.perf_counter()
            rows.append(plan_both(name, MESHES[mesh]))
            print(f"{rows[-1]} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["model", "mesh", "labels MiB sent", "labels ms", "labels MiB held",
                                  "roles MiB sent", "roles ms", "roles MiB held", "bytes roles/labels",
                                  "time roles/labels", "unfiltered"], tablefmt="github"))


if __name__ == "__main__":
    main()
