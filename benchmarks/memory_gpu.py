"""Predicted against measured peak memory on GPUs: max_memory_allocated and max_memory_reserved per rank.

Run on a GPU machine: torchrun --nproc-per-node N benchmarks/memory_gpu.py (N = 1, 2, 4, 8).
A small Llama (benchmarks/plan_speed.py's, 4 layers, 1024 wide) trains one Adam step to
create the optimizer state; the next step's peaks are measured from a reset of CUDA's counters
and compared with the plan's: memory_allocated (what the caching allocator hands out) and
memory_per_rank (what it reserves); the bar: within 15 %. On one GPU, benchmarks/gpu_acceptance.py
measures the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import autojigsaw  # noqa: E402
from plan_speed import Llama  # noqa: E402

SIZES = dict(layers=4, hidden=1024, heads=8, kv_heads=4, ffn=4096, vocab=32000)


def main() -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    shape, names = ((2, world // 2), ("domain", "tensor")) if world >= 4 else ((world,), ("tensor",))
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = Llama(**SIZES).cuda()
    ids = torch.randint(0, SIZES["vocab"], (4, 1024), device="cuda")
    pmodel = autojigsaw.parallelize(model, mesh, (ids, ids), compile=False)
    opt = torch.optim.Adam(pmodel.parameters(), lr=1e-4)

    def step():
        pmodel(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    plan = pmodel.plan
    for what, measured, predicted in (("allocated", torch.cuda.max_memory_allocated(), plan.memory_allocated),
                                      ("reserved", torch.cuda.max_memory_reserved(), plan.memory_per_rank)):
        print(f"rank {rank}: {what} predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, "
              f"error {(predicted - measured) / measured:+.1%}")
    print(f"rank {rank}: reserved peak predicted at the {plan.peak_at}")
    if rank == 0:
        print(pmodel.plan.table())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
