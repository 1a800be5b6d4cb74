"""Softmax and norms over a sharded dim against the single-device ops on full tensors.

Each rank builds the same full tensors (same seed), runs the kernel on its chunk of the sharded
dim and checks its chunk of the output and of the gradients of x, weight and bias. Inputs are
transposed views (non-contiguous), sizes are uneven (empty chunks on 4 ranks), batch > 1.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autojigsaw.ir import bytes_sent
from autojigsaw.kernels import collectives as C
from autojigsaw.kernels.norm import sharded_layer_norm, sharded_rms_norm
from autojigsaw.kernels.softmax import sharded_log_softmax, sharded_softmax
from autojigsaw.mesh import MeshAxis
from autojigsaw.placements import chunk_sizes

DTYPES = (torch.float32, torch.float64)
B, S, K = 2, 3, 7  # K = 7 splits unevenly over 2 and 4 ranks; S = 3 leaves rank 3 empty


def _randn(*shape, dtype):
    """A non-contiguous tensor of `shape` (the transpose of a contiguous one)."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def _chunk(t, dim, n, r):
    sizes = chunk_sizes(t.shape[dim], n)
    return t.narrow(dim, sum(sizes[:r]), sizes[r])


def _leaf(t):
    return None if t is None else t.detach().requires_grad_()


def _world():
    return dict(axis=MeshAxis("a", dist.get_world_size(), dist.group.WORLD.group_name, dist.get_rank()))


def _check(fails, name, got, want, tol=None):
    tol = tol or (dict(rtol=1e-9, atol=1e-11) if want.dtype == torch.float64
                  else dict(rtol=1e-5, atol=1e-5))
    if got is None or got.shape != want.shape or got.dtype != want.dtype or not torch.allclose(
            got, want, **tol):
        err = "missing" if got is None else (
            f"{tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
            if got.shape != want.shape or got.dtype != want.dtype
            else f"max err {(got - want).abs().max().item():.3g}")
        fails.append(f"{name}: {err}")


def _run(fails, name, kernel, reference, full, grad, dim, params=()):
    """Kernel on this rank's chunks (of x and of each param) against reference on full tensors."""
    n, r = dist.get_world_size(), dist.get_rank()
    ref = [_leaf(t) for t in (full, *params)]
    y_ref = reference(*ref)
    y_ref.backward(grad)
    loc = [_leaf(_chunk(full, dim, n, r))] + [_leaf(_chunk(p, -1, n, r)) for p in params]
    y = kernel(*loc)
    y.backward(_chunk(grad, dim, n, r))
    _check(fails, f"{name} y", y, _chunk(y_ref.detach(), dim, n, r))
    _check(fails, f"{name} dx", loc[0].grad, _chunk(ref[0].grad, dim, n, r))
    for i, (mine, theirs) in enumerate(zip(loc[1:], ref[1:])):
        _check(fails, f"{name} dparam{i}", mine.grad, _chunk(theirs.grad, -1, n, r))


# ---------------------------------------------------------------- softmax


def _softmax_case():
    fails, w = [], _world()
    for dtype in DTYPES:
        # The last dim (K), a middle one (S: empty chunks on 4 ranks), and K masked as attention
        # masks do: -inf over the first 4 columns of batch 0, all of rank 0's chunk on 2 ranks.
        for dim, masked in ((2, False), (1, False), (2, True)):
            torch.manual_seed(0)
            x, g = _randn(B, S, K, dtype=dtype), _randn(B, S, K, dtype=dtype)
            if masked:
                x = x.clone()
                x[0, :, :4] = float("-inf")
            for name, ours, theirs in (("softmax", sharded_softmax, torch.softmax),
                                       ("log_softmax", sharded_log_softmax, torch.log_softmax)):
                _run(fails, f"{name} {dtype} dim={dim} masked={masked}",
                     lambda t: ours(t, dim, **w), lambda t: theirs(t, dim), x, g, dim)
    return fails


def _softmax_half_to_float_case():
    """bf16 in, fp32 out, accumulated in fp32 like the single-device op on upcast input."""
    fails, w = [], _world()
    torch.manual_seed(0)
    x, g = _randn(B, S, K, dtype=torch.bfloat16), _randn(B, S, K, dtype=torch.float32)
    for name, ours, theirs in (("softmax", sharded_softmax, torch.softmax),
                               ("log_softmax", sharded_log_softmax, torch.log_softmax)):
        n, r = dist.get_world_size(), dist.get_rank()
        ref = _leaf(x)
        y_ref = theirs(ref.float(), -1)
        y_ref.backward(g)
        loc = _leaf(_chunk(x, -1, n, r))
        y = ours(loc, -1, half_to_float=True, **w)
        y.backward(_chunk(g, -1, n, r))
        _check(fails, f"{name} y", y, _chunk(y_ref.detach(), -1, n, r))
        # bf16 gradients: fp32 values that differ in the last bits may round one bf16 ulp apart
        _check(fails, f"{name} dx", loc.grad, _chunk(ref.grad, -1, n, r),
               dict(rtol=1e-2, atol=1e-3))
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_softmax(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_softmax_case) == [[]] * world
    assert pool.run(_softmax_half_to_float_case) == [[]] * world


# ---------------------------------------------------------------- norms


def _norm_case():
    fails, w = [], _world()
    for dtype in DTYPES:
        torch.manual_seed(0)
        x, g = _randn(B, S, K, dtype=dtype), _randn(B, S, K, dtype=dtype)
        wt, bs = torch.randn(K, dtype=dtype), torch.randn(K, dtype=dtype)
        w2, b2 = torch.randn(S, K, dtype=dtype), torch.randn(S, K, dtype=dtype)
        cases = [
            ("layer_norm", lambda t, a, b: sharded_layer_norm(t, (K,), a, b, 1e-5, **w),
             lambda t, a, b: F.layer_norm(t, (K,), a, b, 1e-5), (wt, bs)),
            ("layer_norm 2-d", lambda t, a, b: sharded_layer_norm(t, (S, K), a, b, 1e-3, **w),
             lambda t, a, b: F.layer_norm(t, (S, K), a, b, 1e-3), (w2, b2)),
            ("layer_norm plain", lambda t: sharded_layer_norm(t, (K,), **w),
             lambda t: F.layer_norm(t, (K,)), ()),
            ("rms_norm", lambda t, a: sharded_rms_norm(t, (K,), a, **w),
             lambda t, a: F.rms_norm(t, (K,), a), (wt,)),
            ("rms_norm 2-d eps", lambda t, a: sharded_rms_norm(t, (S, K), a, 1e-2, **w),
             lambda t, a: F.rms_norm(t, (S, K), a, 1e-2), (w2,)),
            ("rms_norm plain", lambda t: sharded_rms_norm(t, [K], **w),
             lambda t: F.rms_norm(t, [K]), ()),
        ]
        for name, ours, theirs, params in cases:
            _run(fails, f"{name} {dtype}", ours, theirs, x, g, 2, params)
        # No batch dims at all: weight and bias gradients are then not summed over anything.
        _run(fails, f"layer_norm unbatched {dtype}",
             lambda t, a, b: sharded_layer_norm(t, (K,), a, b, **w),
             lambda t, a, b: F.layer_norm(t, (K,), a, b), x[0, 0], g[0, 0], 0, (wt, bs))
    return fails


def _norm_stability_case():
    """fp32 rows with mean 1e3 and variance 1: as accurate as torch's own kernel, vs fp64."""
    n, r, w = dist.get_world_size(), dist.get_rank(), _world()
    torch.manual_seed(0)
    x = _randn(B, S, 64, dtype=torch.float32) + 1e3
    exact = F.layer_norm(x.double(), (64,))
    torch_err = (F.layer_norm(x, (64,)).double() - exact).abs().max()
    ours = sharded_layer_norm(_chunk(x, 2, n, r), (64,), **w)
    our_err = (ours.double() - _chunk(exact, 2, n, r)).abs().max()
    return bool(our_err <= 2 * torch_err + 1e-6), float(our_err), float(torch_err)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_norms(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_norm_case) == [[]] * world
    for ok, ours, theirs in pool.run(_norm_stability_case):
        assert ok, f"layer_norm error {ours:.3g} vs torch's {theirs:.3g}"


# ---------------------------------------------------------------- back to back, traffic


def _chain_case():
    """Two kernels in a row on each other's output: a reused buffer would corrupt the first."""
    fails, w = [], _world()
    torch.manual_seed(3)
    x, g = _randn(B, S, K, dtype=torch.float64), _randn(B, S, K, dtype=torch.float64)
    wt, bs = torch.randn(K, dtype=torch.float64), torch.randn(K, dtype=torch.float64)
    _run(fails, "softmax twice", lambda t: sharded_softmax(sharded_log_softmax(t, 2, **w), 2, **w),
         lambda t: torch.softmax(torch.log_softmax(t, 2), 2), x, g, 2)
    _run(fails, "norm twice",
         lambda t, a, b: sharded_rms_norm(sharded_layer_norm(t, (K,), a, b, **w), (K,), a, **w),
         lambda t, a, b: F.rms_norm(F.layer_norm(t, (K,), a, b), (K,), a), x, g, 2, (wt, bs))
    return fails


def _traffic_case():
    """The all-reduces each kernel runs: rows of statistics, in fp32 for bf16 input."""
    n, r, w = dist.get_world_size(), dist.get_rank(), _world()
    x = _leaf(_chunk(torch.randn(B, S, K, dtype=torch.bfloat16), 2, n, r))
    rows = B * S * 4  # one fp32 statistic per row

    def ar(nbytes):
        return ("all_reduce", "a", bytes_sent("all_reduce", nbytes, n))

    expected = {
        "softmax": [ar(rows), ar(rows), ar(rows)],  # max, sum; backward: sum(g * y)
        "layer_norm": [ar(rows), ar(rows), ar(2 * rows)],  # mean, variance; backward: two sums
        "rms_norm": [ar(rows), ar(rows)],  # mean square; backward: sum(g * xhat)
    }
    kernels = {"softmax": lambda: sharded_softmax(x, 2, **w),
               "layer_norm": lambda: sharded_layer_norm(x, (K,), **w),
               "rms_norm": lambda: sharded_rms_norm(x, (K,), **w)}
    out = {}
    for name, fn in kernels.items():
        with C.count_comm() as log:
            fn().float().sum().backward()
        out[name] = log.calls == expected[name]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_back_to_back_and_traffic(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_chain_case) == [[]] * world
    for res in pool.run(_traffic_case):
        assert res == {"softmax": True, "layer_norm": True, "rms_norm": True}


def _bad_input_case():
    w, errors = _world(), []
    for call in (lambda: sharded_softmax(torch.randn(2, 3), 2, **w),
                 lambda: sharded_layer_norm(torch.randn(2, 5), (4,), **w),
                 lambda: sharded_rms_norm(torch.randn(2, 2), (4,), torch.ones(3), **w),
                 lambda: sharded_softmax(torch.ones(2, 3, dtype=torch.long), 1, **w)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_input_names_the_axis(ranks2):
    errors = ranks2.run(_bad_input_case)[0]
    assert len(errors) == 4 and all("'a'" in e for e in errors)
