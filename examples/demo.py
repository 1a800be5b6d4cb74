"""Demo: parallelize a small model over 4 local CPU ranks (a 2 x 2 domain x tensor mesh).

Prints the plan, trains three steps, and compares output, gradients and parameters with
the same model trained on one device. Run: python examples/demo.py
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import autojigsaw
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh


class Block(nn.Module):
    """LayerNorm -> MLP with a residual, as in a transformer or a weather mixer."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 256, depth: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d, hidden) for _ in range(depth)))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        return self.head(self.blocks(x))


def _quiet() -> None:
    """DTensor warns when .full_tensor() gathers over two axes; the demo does that on purpose."""
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def train(steps: int = 3) -> dict:
    torch.manual_seed(0)
    reference = Model()
    x = torch.randn(4, 32, 64)  # batch 4, 32 tokens, 64 features
    mesh = get_mesh((2, 2), ("domain", "tensor"))
    # A budget of half the replicated footprint forces autojigsaw to shard.
    model = autojigsaw.parallelize(copy.deepcopy(reference), mesh, (x,), compile=False,
                                   memory_budget=900_000)
    if dist.get_rank() == 0:
        print(model.plan, "\n")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    diff = {"output": 0.0, "gradient": 0.0, "parameter": 0.0}
    for _ in range(steps):
        y, y_ref = model(x), reference(x)
        diff["output"] = max(diff["output"], (y - y_ref).abs().max().item())
        y.square().mean().backward()
        y_ref.square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            diff["gradient"] = max(diff["gradient"], (p.grad.full_tensor() - q.grad).abs().max().item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        diff["parameter"] = max(diff["parameter"], (p.full_tensor() - q).abs().max().item())
    return diff


def main() -> None:
    with LocalRanks(4) as ranks:
        ranks.run(_quiet)
        results = ranks.run(train)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print("max difference from the single-device model over 3 training steps, all 4 ranks:")
    for key, value in worst.items():
        print(f"  {key:10s} {value:.2e}")
    ok = all(v < 1e-4 for v in worst.values())
    print("OK: matches the single-device model" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
