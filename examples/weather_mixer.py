"""Train a weather-style MLP-Mixer on a 2 x 2 domain x tensor mesh of 4 CPU ranks, from shards.

Writes a few samples of a 3-channel latitude-longitude field (and the fields to predict) to
.npy files. Every rank reads only its block of rows of each sample, through numpy's memmap and
`autojigsaw.load_shard`, so no rank ever loads a whole sample; the planner shards the rest.
Trains three steps and compares the loss with the same model trained on one device.
Run: python examples/weather_mixer.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import Shard

import autojigsaw
from autojigsaw.testing.local_ranks import LocalRanks, get_mesh
from mixer_model import FieldLoss

SIZES = dict(channels=3, lat=64, lon=64, patch=4, dim=32, token_hidden=32, channel_hidden=64, depth=2)
BATCH, STEPS = 2, 3
FIELD = (BATCH, SIZES["channels"], SIZES["lat"], SIZES["lon"])
ROWS = (Shard(2), Shard(2))  # latitude rows over both mesh axes: a quarter of the rows per rank
BUDGET = 600_000  # bytes per rank; training on one device takes 2.2 MiB by the planner's count


def write_samples(folder: Path) -> None:
    """STEPS samples of the input field and of the field to predict, one .npy file each."""
    gen = np.random.default_rng(0)
    for name in ("inputs", "targets"):
        np.save(folder / f"{name}.npy", gen.standard_normal((STEPS, *FIELD), dtype=np.float32))


def _reader(path: Path, step: int):
    """read_fn for load_shard: one block of sample `step`, read from disk through a memmap."""
    return lambda index: np.load(path, mmap_mode="r")[step][index]


def _model() -> FieldLoss:
    torch.manual_seed(0)
    return FieldLoss(**SIZES)


def make_plan() -> autojigsaw.Plan:
    """Plan once, with no data and no processes: the model on the meta device."""
    with torch.device("meta"):
        model, field = FieldLoss(**SIZES), torch.empty(FIELD)
    return autojigsaw.plan(model, (field, field), {"domain": 2, "tensor": 2}, device="cpu",
                           input_placements=[ROWS, ROWS], memory_budget=BUDGET)


def train(folder: Path, plan_json: str) -> list[float]:
    """On every rank: shard the model by the plan, train STEPS steps from this rank's blocks."""
    mesh = get_mesh((2, 2), ("domain", "tensor"))
    # Example inputs of the global shape that store one element: nothing is loaded to build.
    examples = (autojigsaw.stand_in(FIELD), autojigsaw.stand_in(FIELD))
    model = autojigsaw.parallelize(_model(), mesh, examples, plan=autojigsaw.Plan.from_json(plan_json),
                                   input_placements=[ROWS, ROWS], compile=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        x, target = (autojigsaw.load_shard(_reader(folder / f"{name}.npy", step), FIELD, ROWS, mesh)
                     for name in ("inputs", "targets"))
        loss = model(x, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_one_device(folder: Path) -> list[float]:
    """The reference: the same model and steps on whole samples, in this process."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        loss = model(*(torch.from_numpy(np.load(folder / f"{name}.npy")[step])
                       for name in ("inputs", "targets")))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, LocalRanks(4) as ranks:
        folder = Path(tmp)
        write_samples(folder)
        plan = make_plan()
        print(plan, "\n")
        results = ranks.run(train, folder, plan.to_json())
        reference = train_one_device(folder)
    print(f"each rank read {np.prod(FIELD) // 4} of the {np.prod(FIELD)} values of every sample")
    print("step   loss (2 x 2 mesh)   loss (one device)")
    for step, (loss, ref) in enumerate(zip(results[0], reference)):
        print(f"{step:4d}   {loss:17.6f}   {ref:17.6f}")
    worst = max(abs(a - b) for r in results for a, b in zip(r, reference))
    print(f"largest difference over {STEPS} steps and 4 ranks: {worst:.2e}")
    print("OK: matches the single-device run" if worst < 1e-5 else "MISMATCH")
    raise SystemExit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
