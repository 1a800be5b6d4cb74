"""One sample too large for one GPU: convolutional networks planned with their points sharded.

Run: python -m benchmarks.cnn_domain [--tiny]

A 2-D U-Net (4 levels, GroupNorm, SiLU; an 8192 x 8192 image, a satellite scene or a pathology
slide tile) and a 3-D nnU-Net (5 stages, InstanceNorm, LeakyReLU, stride-2 convolutions down,
transposed convolutions up; a 512^3 CT volume), batch 1, fp32, Adam, planned on the meta device
for H100s with 1, 2, 4 and 8 ranks on a "domain" axis and the whole 80 GB as budget. With one
sample there is no batch to split: either the points are sharded (the halo kernels of
rules/conv.py, pool.py, pad.py, resample.py) or the step does not fit. --tiny plans 64^2 and
32^3 samples on 1 and 4 ranks under 0.6 of their one-rank memory.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import autojigsaw
from autojigsaw.cost_model.devices import GiB

from .common import Report


class UNet2d(nn.Module):
    """A U-Net: two 3x3 convolutions with GroupNorm and SiLU per level, max pooling down, nearest
    upsampling and concatenated skips up."""

    def __init__(self, channels: int = 3, width: int = 32, levels: int = 4):
        super().__init__()
        widths = [width * 2 ** i for i in range(levels)]

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())

        self.down = nn.ModuleList(block(cin, cout) for cin, cout in zip([channels] + widths[:-1], widths))
        self.up = nn.ModuleList(block(2 * w, w // 2 if i else w) for i, w in reversed(list(enumerate(widths[:-1]))))
        self.bottom = nn.Conv2d(widths[-1], widths[-2], 1)
        self.head = nn.Conv2d(widths[0], 2, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = self.bottom(skips.pop())
        for block in self.up:
            x = block(torch.cat([skips.pop(), F.interpolate(x, scale_factor=2.0)], 1))
        return self.head(x)


class NnUNet3d(nn.Module):
    """nnU-Net's 3-D full-resolution network: two 3x3x3 convolutions with InstanceNorm and LeakyReLU
    per stage, the first of each lower stage strided, transposed convolutions up."""

    def __init__(self, channels: int = 1, width: int = 32, stages: int = 5):
        super().__init__()
        widths = [min(width * 2 ** i, 320) for i in range(stages)]

        def stage(cin, cout, stride):
            layers = []
            for i in range(2):
                layers += [nn.Conv3d(cin if i == 0 else cout, cout, 3, stride=stride if i == 0 else 1, padding=1,
                                     bias=False), nn.InstanceNorm3d(cout, affine=True), nn.LeakyReLU(0.01)]
            return nn.Sequential(*layers)

        self.down = nn.ModuleList(stage(cin, cout, 1 if i == 0 else 2)
                                  for i, (cin, cout) in enumerate(zip([channels] + widths[:-1], widths)))
        self.ups = nn.ModuleList(nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2) for i in range(stages - 1))
        self.decode = nn.ModuleList(stage(2 * widths[i], widths[i], 1) for i in range(stages - 1))
        self.head = nn.Conv3d(widths[0], 2, 1)

    def forward(self, x):
        skips = []
        for stage in self.down:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        for i in reversed(range(len(self.ups))):
            x = self.decode[i](torch.cat([skips.pop(), self.ups[i](x)], 1))
        return self.head(x)


CASES = {  # name: (model class, sample shape, tiny sample shape)
    "U-Net 2-D, 8192^2 image": (UNet2d, (1, 3, 8192, 8192), (1, 3, 64, 64)),
    "nnU-Net 3-D, 512^3 volume": (NnUNet3d, (1, 1, 512, 512, 512), (1, 1, 32, 32, 32)),
}


def _model_and_input(cls, shape):
    with torch.device("meta"):
        return cls(), torch.empty(shape, device="meta")


def plan_row(name: str, cls, shape, gpus: int, budget: float, device: str) -> list:
    model, x = _model_and_input(cls, shape)
    start = time.perf_counter()
    try:
        # each rank is passed only its slice of the sample (the split the planner chooses), as a loader of one too
        # large for a GPU reads it (autojigsaw.load_shard)
        plan = autojigsaw.plan(model, (x,), {"domain": gpus}, device=device, memory_budget=int(budget),
                               input_placements=[None])
    except ValueError as e:
        return [name, gpus, "does not fit", "-", "-", "-", f"{time.perf_counter() - start:.1f}", str(e).split(":")[0]]
    kernels = sorted({n.kernel for n in plan.nodes if n.kernel.startswith("halo") or "group_norm" in n.kernel})
    return [name, gpus, f"{plan.memory_per_rank / GiB:.1f}", f"{plan.step_time * 1e3:.1f}",
            f"{plan.comm_bytes / 2**20:.0f}", f"{_spatial_share(plan):.0%}",
            f"{time.perf_counter() - start:.1f}", ", ".join(kernels) or "whole"]


def _spatial_share(plan) -> float:
    """The share of convolutions whose input is sharded over a spatial dim."""
    convs = [n for n in plan.nodes if "conv" in n.op]
    spatial = [n for n in convs if any(getattr(p, "dim", 0) >= 2 for p in n.inputs[0])]
    return len(spatial) / max(len(convs), 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small samples, budget scaled (the smoke test)")
    args = p.parse_args(argv)
    rep = Report("cnn_domain", "One sample too large for one GPU: convolutional networks with sharded points"
                 + (" (tiny)" if args.tiny else ""))
    rows = []
    for name, (cls, shape, tiny) in CASES.items():
        shape = tiny if args.tiny else shape
        budget = 80 * GiB
        if args.tiny:
            model, x = _model_and_input(cls, shape)
            budget = 0.6 * autojigsaw.plan(model, (x,), {"domain": 1}, device="h100").memory_per_rank
        for gpus in (1, 4) if args.tiny else (1, 2, 4, 8):
            rows.append(plan_row(name, cls, shape, gpus, budget, "h100"))
    rep.table("Planned on H100s (80 GB), batch 1, fp32, Adam; the budget is the GPU's memory", rows,
              ["model", "GPUs", "GiB/GPU", "step ms", "MiB sent/GPU", "convs sharded in space", "plan s", "kernels"])
    rep.save()
    return rep


if __name__ == "__main__":
    main()
