"""Framework overhead at world size 1 on one GPU, and predicted against measured time.

On a single-process NCCL group (world size 1: no traffic), compares forward + backward of
- autojigsaw's distributed linears (all_gather_linear, linear_reduce_scatter) with F.linear,
- autojigsaw's ring attention with F.scaled_dot_product_attention (causal),
- a training step of benchmarks.models.MLPStack through autojigsaw.parallelize with the plain model,
eager and under torch.compile, and sets each beside the time autojigsaw's cost model predicts
for the device (the "h200" spec on an H200). Takes a few minutes on one H200.

Run: python -m benchmarks.gpu_overhead            (exits with a message when there is no GPU)
     python -m benchmarks.gpu_overhead --cpu --tiny --no-compile   (CPU and gloo: a smoke test)
"""

from __future__ import annotations

import argparse
import copy
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .common import Report

aten = torch.ops.aten

SIZES = {  # tokens x in x out for the linears; batch, heads, sequence, head dim for attention
    "full": dict(tokens=8192, d_in=4096, d_out=4096, attn=(1, 32, 4096, 128), mlp=(2048, 8192, 4), batch=(4, 1024)),
    "tiny": dict(tokens=64, d_in=32, d_out=48, attn=(1, 2, 32, 16), mlp=(32, 64, 2), batch=(2, 16)),
}


def _init(device: str) -> str:
    """A process group of this one process; returns its name."""
    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    return dist.group.WORLD.group_name


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn, device: str, *, rounds: int = 5, calls: int = 10, warmup: int = 3) -> float:
    """Median over `rounds` of the mean seconds per call of `fn` (after warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def _fwd_bwd(f, *inputs):
    """A closure running f forward and backward on leaf inputs that require grad."""
    def run():
        for t in inputs:
            t.grad = None
        f(*inputs).sum().backward()
    return run


def _predicted(op, in_shapes, out_shape, dtype, spec) -> float:
    """Forward + backward seconds by autojigsaw's roofline for one node."""
    from autojigsaw.cost_model.compute import backward_factor, flops, op_kind, roofline_time

    nbytes = sum(torch.Size(s).numel() for s in [*in_shapes, out_shape]) * dtype.itemsize
    t = roofline_time(flops(op, [tuple(s) for s in in_shapes], [tuple(out_shape)]), nbytes, dtype, spec,
                      op_kind(op).name)
    return t * (1 + backward_factor(op))


def _row(name: str, compiled: bool, make_torch, make_ours, predicted, device: str, failures: list) -> tuple:
    """One row: torch's and autojigsaw's time, the overhead, measured / predicted.

    make_torch and make_ours build a step to time (compiling or parallelizing as they go);
    predicted() gives the cost model's seconds. A failure becomes a row and is listed.
    """
    mode = "compiled" if compiled else "eager"
    try:
        t_ref, t_ours = measure(make_torch(), device), measure(make_ours(), device)
        t_pred = predicted()
    except Exception as e:  # noqa: BLE001 - one broken case must not lose the others' numbers
        failures.append(f"{name} ({mode}): {type(e).__name__}: {e}")
        return (name, mode, "failed", type(e).__name__, "", "", "")
    return (name, mode, f"{t_ref * 1e3:.3f}", f"{t_ours * 1e3:.3f}", f"{t_ours / t_ref:.2f}x",
            f"{t_pred * 1e3:.3f}", f"{t_ours / t_pred:.2f}x")


def _maybe_compiled(fn, compiled: bool):
    return torch.compile(fn) if compiled else fn


def kernel_rows(device: str, group: str, sizes: dict, dtype, spec, modes, failures: list) -> list:
    """Forward + backward of each kernel against its torch counterpart, per mode."""
    from autojigsaw.kernels.attention import ring_attention
    from autojigsaw.kernels.matmul import all_gather_linear, linear_reduce_scatter
    from autojigsaw.mesh import MeshAxis

    t, k, n = sizes["tokens"], sizes["d_in"], sizes["d_out"]
    x = torch.randn(t, k, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5).requires_grad_()
    b, h, s, d = sizes["attn"]
    q, kk, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    one = dict(sizes=(t,), axis=MeshAxis("tensor", 1, group, 0))

    def linear(x, w):
        return F.linear(x, w)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    linear_s = _predicted(aten.linear.default, [(t, k), (n, k)], (t, n), dtype, spec)
    sdpa_s = _predicted(aten.scaled_dot_product_attention.default, [(b, h, s, d)] * 3, (b, h, s, d), dtype, spec)
    cases = [
        ("linear: all_gather_linear", linear,
         lambda x, w: all_gather_linear(x, w, dim=0, grad="R", **one), (x, w), linear_s),
        ("linear: linear_reduce_scatter", linear,
         lambda x, w: linear_reduce_scatter(x, w, dim=0, op="sum", **one), (x, w), linear_s),
        ("causal attention: ring_attention", sdpa,
         lambda q, k, v: ring_attention(q, k, v, is_causal=True, seq_sizes=(s,), axis=MeshAxis("seq", 1, group, 0)),
         (q, kk, v), sdpa_s),
    ]
    return [_row(name, c, lambda: _fwd_bwd(_maybe_compiled(ref, c), *inputs),
                 lambda: _fwd_bwd(_maybe_compiled(ours, c), *inputs), lambda: pred, device, failures)
            for c in modes for name, ref, ours, inputs, pred in cases]


def _train_step(module, x):
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step():
        module(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def model_rows(device: str, sizes: dict, dtype, spec_name: str, modes, failures: list) -> list:
    """A training step of MLPStack: the plain model against autojigsaw.parallelize on a 1-rank mesh."""
    import autojigsaw
    from torch.distributed.device_mesh import init_device_mesh

    from .models import build, sample

    d, hidden, depth = sizes["mlp"]
    batch, seq = sizes["batch"]
    mesh = init_device_mesh(device, (1,), mesh_dim_names=("tensor",))
    ref = build(d, hidden, depth).to(device=device, dtype=dtype)
    x = sample(batch, seq, d).to(device=device, dtype=dtype)
    built = {}

    def ours(compiled: bool):
        built["module"] = autojigsaw.parallelize(copy.deepcopy(ref), mesh, (x,), compile=compiled, device=spec_name)
        return _train_step(built["module"], x)
    # each _row runs its builders at once, so the lambdas see this iteration's c
    return [_row(f"MLPStack d={d} hidden={hidden} depth={depth}, batch {batch}x{seq}", c,
                 lambda: _train_step(_maybe_compiled(copy.deepcopy(ref), c), x), lambda: ours(c),
                 lambda: built["module"].plan.step_time, device, failures)
            for c in modes]


def main(argv: list[str] | None = None) -> Report | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (to test the script)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--spec", help="device spec for the predictions (default: h200 on CUDA, cpu on --cpu)")
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_overhead: no CUDA GPU here, nothing run. Run it on a GPU machine "
              "(python -m benchmarks.gpu_overhead), or with --cpu --tiny to test the script.")
        return None
    from autojigsaw.cost_model.devices import device_spec

    device = "cpu" if args.cpu else "cuda"
    spec_name = args.spec or ("cpu" if args.cpu else "h200")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    sizes = SIZES["tiny" if args.tiny else "full"]
    modes = [False] if args.no_compile else [False, True]
    torch.manual_seed(0)
    group = _init(device)
    rep = Report("gpu_overhead", f"Overhead at world size 1 and predicted vs measured ({spec_name} spec)")
    headers = ["case (forward + backward)", "mode", "torch ms", "autojigsaw ms", "overhead",
               f"predicted ms ({spec_name})", "measured / predicted"]
    failures = []
    rep.table(f"Kernels, {str(dtype).removeprefix('torch.')}",
              kernel_rows(device, group, sizes, dtype, device_spec(spec_name), modes, failures), headers)
    rep.table("Training step (forward, backward, AdamW)", model_rows(device, sizes, dtype, spec_name, modes, failures),
              ["model", "mode", "plain ms", "autojigsaw ms", "overhead", f"predicted ms ({spec_name})",
               "measured / predicted"])
    if failures:
        rep.text("Failed", "\n".join(failures))
    rep.save()
    dist.destroy_process_group()
    if failures:
        raise RuntimeError(f"{len(failures)} case(s) failed (the others are in the tables):\n" + "\n".join(failures))
    return rep


if __name__ == "__main__":
    main()
