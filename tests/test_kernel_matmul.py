"""The fused matmul kernels against the single-device F.linear and the unfused compositions.

Each rank builds the same full tensors (same seed), runs the kernel on its shards and checks
its output shard and the gradients of every input against full-tensor autograd. Inputs are
transposed views (non-contiguous), sizes are uneven (zero-size chunks on 4 ranks), batch > 1.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autojigsaw.kernels import collectives as C
from autojigsaw.kernels.matmul import all_gather_linear, linear_reduce_scatter, summa_linear
from autojigsaw.mesh import MeshAxis
from autojigsaw.testing.local_ranks import get_mesh
from autojigsaw.placements import chunk_sizes

DTYPES = (torch.float32, torch.float64)
B, T, IN, HID, OUT = 2, 7, 5, 6, 3  # 7 and 5 do not divide by 2 or 4


def _randn(*shape, dtype):
    """A non-contiguous tensor of `shape` (the transpose of a contiguous one)."""
    return torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def _chunk(t, dim, sizes, coord):
    return t.narrow(dim, sum(sizes[:coord]), sizes[coord])


def _leaf(t):
    return None if t is None else t.detach().requires_grad_()


def _contribution(g, n, r):
    """A split of g into n different summands: rank r holds (r + 1) / (1 + ... + n) of it."""
    return g * (r + 1) / (n * (n + 1) / 2)


def _summed(t, group=None):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _check(fails, name, got, want):
    tol = dict(rtol=1e-9, atol=1e-11) if want.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    if got is None or got.shape != want.shape or not torch.allclose(got, want, **tol):
        err = "missing" if got is None else (
            f"shape {tuple(got.shape)} != {tuple(want.shape)}" if got.shape != want.shape
            else f"max err {(got - want).abs().max().item():.3g}")
        fails.append(f"{name}: {err}")


def _reference(fn, *tensors, grad):
    leaves = [_leaf(t) for t in tensors]
    y = fn(*leaves)
    y.backward(grad)
    return y.detach(), [t.grad for t in leaves]


# ---------------------------------------------------------------- all_gather_linear


def _all_gather_linear_case():
    n, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    fails = []
    for dtype in DTYPES:
        # dim 0: batch 2 on 4 ranks -> empty chunks; 4-d: a dim between gathered dim and features
        for lead, dim, mode in (((B, T), 1, "P"), ((B, T), 1, "R"), ((B, T), 0, "P"),
                                ((B, T, 2), 1, "P")):
            torch.manual_seed(0)
            x, w, b, g = (_randn(*lead, IN, dtype=dtype), torch.randn(OUT, IN, dtype=dtype),
                          torch.randn(OUT, dtype=dtype), torch.randn(*lead, OUT, dtype=dtype))
            y_ref, (dx, dw, db) = _reference(F.linear, x, w, b, grad=g)
            sizes = chunk_sizes(x.shape[dim], n)
            xl, wl, bl = _leaf(_chunk(x, dim, sizes, r)), _leaf(w), _leaf(b)
            y = all_gather_linear(xl, wl, bl, dim=dim, sizes=sizes, axis=MeshAxis("a", n, group, r), grad=mode)
            y.backward(_contribution(g, n, r) if mode == "P" else g)
            case = f"{dtype} {x.ndim}-d dim={dim} grad={mode}"
            _check(fails, f"y {case}", y, y_ref)
            _check(fails, f"dx {case}", xl.grad, _chunk(dx, dim, sizes, r))
            reduce = _summed if mode == "P" else (lambda t: t)
            _check(fails, f"dw {case}", reduce(wl.grad), dw)
            _check(fails, f"db {case}", reduce(bl.grad), db)
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_linear(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_all_gather_linear_case) == [[]] * world


# ---------------------------------------------------------------- linear_reduce_scatter


def _linear_reduce_scatter_case():
    n, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    fails = []
    for dtype in DTYPES:
        for lead, dim, op in (((B, T), 1, "sum"), ((B, T), 1, "avg"), ((B, T), 0, "sum"),
                              ((B, T, 2), 1, "sum")):
            torch.manual_seed(0)
            x, w, b, g = (_randn(*lead, IN, dtype=dtype), torch.randn(OUT, IN, dtype=dtype),
                          torch.randn(OUT, dtype=dtype), torch.randn(*lead, OUT, dtype=dtype))
            scale = 1 / n if op == "avg" else 1
            y_ref, (dx, dw, db) = _reference(lambda *a: F.linear(*a) * scale, x, w, b, grad=g)
            ins, sizes = chunk_sizes(IN, n), chunk_sizes(x.shape[dim], n)
            # The composition adds the bias on every rank: give it to rank 0 only.
            xl, wl = _leaf(_chunk(x, -1, ins, r)), _leaf(_chunk(w, 1, ins, r))
            bl = _leaf(b) if r == 0 else None
            y = linear_reduce_scatter(xl, wl, bl, dim=dim, sizes=sizes, op=op, axis=MeshAxis("a", n, group, r))
            y.backward(_chunk(g, dim, sizes, r))
            case = f"{dtype} {x.ndim}-d dim={dim} op={op}"
            _check(fails, f"y {case}", y, _chunk(y_ref, dim, sizes, r))
            _check(fails, f"dx {case}", xl.grad, _chunk(dx, -1, ins, r))
            _check(fails, f"dw {case}", wl.grad, _chunk(dw, 1, ins, r))
            if r == 0:
                _check(fails, f"db {case}", bl.grad, db)
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_linear_reduce_scatter(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_linear_reduce_scatter_case) == [[]] * world


# ---------------------------------------------------------------- summa_linear


def _summa_axes(shape):
    mesh = get_mesh(shape, ("domain", "tensor"))
    d, t = mesh.get_group("domain"), mesh.get_group("tensor")
    return (dict(domain=MeshAxis("domain", shape[0], d.group_name, mesh.get_local_rank("domain")),
                 tensor=MeshAxis("tensor", shape[1], t.group_name, mesh.get_local_rank("tensor"))), d)


def _summa_shards(shape, out, inn):
    """Sizes of the 2-D layout: tokens and weight rows over domain, in and out over tensor."""
    a, b = shape
    return chunk_sizes(T, a), chunk_sizes(out, a), chunk_sizes(inn, b), chunk_sizes(out, b)


def _summa_case(shape):
    axes, domain_group = _summa_axes(shape)
    dc, tc = axes["domain"].coord, axes["tensor"].coord
    toks, w_rows, ins, outs = _summa_shards(shape, HID, IN)
    fails = []
    for dtype in DTYPES:
        torch.manual_seed(0)
        x, w, b, g = (_randn(B, T, IN, dtype=dtype), torch.randn(HID, IN, dtype=dtype),
                      torch.randn(HID, dtype=dtype), _randn(B, T, HID, dtype=dtype))
        y_ref, (dx, dw, db) = _reference(F.linear, x, w, b, grad=g)

        def x_shard(t, cols):
            return _chunk(_chunk(t, 1, toks, dc), 2, cols, tc)

        xl, wl = _leaf(x_shard(x, ins)), _leaf(_chunk(_chunk(w, 0, w_rows, dc), 1, ins, tc))
        bl = _leaf(_chunk(b, 0, outs, tc))
        y = summa_linear(xl, wl, bl, weight_sizes=w_rows, out_sizes=outs, **axes)
        y.backward(x_shard(g, outs))
        _check(fails, f"y {dtype}", y, x_shard(y_ref, outs))
        _check(fails, f"dx {dtype}", xl.grad, x_shard(dx, ins))
        _check(fails, f"dw {dtype}", wl.grad, _chunk(_chunk(dw, 0, w_rows, dc), 1, ins, tc))
        _check(fails, f"db {dtype}", _summed(bl.grad, domain_group), _chunk(db, 0, outs, tc))
    return fails


def _frozen_weight_case():
    """Each kernel with a weight that needs no gradient (LoRA's base): dX as F.linear's, and no
    activation kept (it serves only dW), as F.linear keeps none."""
    n, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    axis = MeshAxis("a", n, group, r)
    summa_axes, _ = _summa_axes((1, n))
    fails = []
    torch.manual_seed(0)
    x, w = _randn(B, T, IN * n, dtype=torch.float64), torch.randn(OUT, IN * n, dtype=torch.float64)
    kernels = {
        "all_gather_linear": (lambda xl: all_gather_linear(xl, w, dim=1, sizes=chunk_sizes(T, n), axis=axis, grad="R"),
                              lambda t: _chunk(t, 1, chunk_sizes(T, n), r), lambda t: t),
        "linear_reduce_scatter": (lambda xl: linear_reduce_scatter(xl, _chunk(w, 1, [IN] * n, r), dim=1,
                                                                   sizes=chunk_sizes(T, n), op="sum", axis=axis),
                                  lambda t: _chunk(t, 2, [IN] * n, r), lambda t: _chunk(t, 1, chunk_sizes(T, n), r)),
        "summa_linear": (lambda xl: summa_linear(xl, _chunk(w, 1, [IN] * n, r), weight_sizes=(OUT,),
                                                 out_sizes=chunk_sizes(OUT, n), **summa_axes),
                         lambda t: _chunk(t, 2, [IN] * n, r), lambda t: _chunk(t, 2, chunk_sizes(OUT, n), r)),
    }
    for name, (kernel, x_shard, y_shard) in kernels.items():
        g = torch.randn(B, T, OUT, dtype=torch.float64)
        y_ref, (dx,) = _reference(lambda a: F.linear(a, w), x, grad=g)
        xl, kept = _leaf(x_shard(x)), []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
            y = kernel(xl)
        y.backward(y_shard(g))
        _check(fails, f"y {name}", y, y_shard(y_ref))
        _check(fails, f"dx {name}", xl.grad, x_shard(dx))
        if any(len(shape) == 3 for shape in kept):  # only the weight, 2-D, is needed
            fails.append(f"{name} keeps an activation for a weight that needs no gradient: {kept}")
    return fails


def test_a_frozen_weight_keeps_no_activation(ranks2):
    assert ranks2.run(_frozen_weight_case) == [[]] * 2


def test_summa_linear_2x2(ranks4):
    assert ranks4.run(_summa_case, (2, 2)) == [[]] * 4


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_summa_linear_degenerate_meshes(shape, ranks2):
    assert ranks2.run(_summa_case, shape) == [[]] * 2


# ---------------------------------------------------------------- kernels back to back


def _chain_case():
    """Megatron's sequence-parallel MLP (AG-linear, linear-RS), then two SUMMA linears in a row."""
    n, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    fails = []
    torch.manual_seed(1)
    x, w1, b1, w2, b2, g = (_randn(B, T, IN, dtype=torch.float64),
                            torch.randn(HID, IN, dtype=torch.float64),
                            torch.randn(HID, dtype=torch.float64),
                            torch.randn(OUT, HID, dtype=torch.float64),
                            torch.randn(OUT, dtype=torch.float64),
                            torch.randn(B, T, OUT, dtype=torch.float64))

    def mlp(x, w1, b1, w2, b2):
        return F.linear(F.linear(x, w1, b1), w2, b2)

    y_ref, grads = _reference(mlp, x, w1, b1, w2, b2, grad=g)
    toks, hid = chunk_sizes(T, n), chunk_sizes(HID, n)
    leaves = [_leaf(_chunk(x, 1, toks, r)), _leaf(_chunk(w1, 0, hid, r)),
              _leaf(_chunk(b1, 0, hid, r)), _leaf(_chunk(w2, 1, hid, r)),
              _leaf(b2) if r == 0 else None]
    xl, w1l, b1l, w2l, b2l = leaves
    ax = MeshAxis("a", n, group, r)
    h = all_gather_linear(xl, w1l, b1l, dim=1, sizes=toks, axis=ax, grad="P")
    y = linear_reduce_scatter(h, w2l, b2l, dim=1, sizes=toks, op="sum", axis=ax)
    y.backward(_chunk(g, 1, toks, r))
    _check(fails, "mlp y", y, _chunk(y_ref, 1, toks, r))
    wants = [_chunk(grads[0], 1, toks, r), _chunk(grads[1], 0, hid, r),
             _chunk(grads[2], 0, hid, r), _chunk(grads[3], 1, hid, r), grads[4]]
    for name, leaf, want in zip(("dx", "dw1", "db1", "dw2", "db2"), leaves, wants):
        if leaf is not None:
            _check(fails, f"mlp {name}", leaf.grad, want)

    axes, _ = _summa_axes((2, n // 2))
    dc, tc = axes["domain"].coord, axes["tensor"].coord
    toks, w1_rows, ins, hids = _summa_shards((2, n // 2), HID, IN)
    _, w2_rows, _, outs = _summa_shards((2, n // 2), OUT, HID)

    def x_shard(t, cols):
        return _chunk(_chunk(t, 1, toks, dc), 2, cols, tc)

    def w_shard(w, rows, cols):
        return _chunk(_chunk(w, 0, rows, dc), 1, cols, tc)

    y_ref, grads = _reference(lambda x, w1, w2: F.linear(F.linear(x, w1), w2), x, w1, w2, grad=g)
    xl, w1l, w2l = _leaf(x_shard(x, ins)), _leaf(w_shard(w1, w1_rows, ins)), _leaf(
        w_shard(w2, w2_rows, hids))
    h = summa_linear(xl, w1l, weight_sizes=w1_rows, out_sizes=hids, **axes)
    y = summa_linear(h, w2l, weight_sizes=w2_rows, out_sizes=outs, **axes)
    y.backward(x_shard(g, outs))
    _check(fails, "summa y", y, x_shard(y_ref, outs))
    _check(fails, "summa dx", xl.grad, x_shard(grads[0], ins))
    _check(fails, "summa dw1", w1l.grad, w_shard(grads[1], w1_rows, ins))
    _check(fails, "summa dw2", w2l.grad, w_shard(grads[2], w2_rows, hids))
    return fails


@pytest.mark.parametrize("world", [2, 4])
def test_kernels_back_to_back(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    assert pool.run(_chain_case) == [[]] * world


# ---------------------------------------------------------------- traffic


def _traffic(fn, grad):
    with C.count_comm() as log:
        y = fn()
        y.backward(grad)
    return y.detach(), log.calls


def _traffic_case():
    """Each fused kernel logs exactly the collectives (kind, axis, bytes) of its composition."""
    n, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    torch.manual_seed(2)
    x, w, g = _randn(B, T, IN, dtype=torch.float32), torch.randn(OUT, IN), torch.randn(B, T, OUT)
    toks, ins = chunk_sizes(T, n), chunk_sizes(IN, n)
    ax = dict(axis=MeshAxis("a", n, group, r))
    xl, xin, win = _chunk(x, 1, toks, r), _chunk(x, 2, ins, r), _chunk(w, 1, ins, r)
    pairs = {
        "all_gather_linear": (
            lambda: all_gather_linear(_leaf(xl), _leaf(w), dim=1, sizes=toks, grad="P", **ax),
            lambda: F.linear(C.all_gather(_leaf(xl), dim=1, sizes=toks, grad="P", **ax), _leaf(w)),
            g),
        "all_gather_linear R": (
            lambda: all_gather_linear(_leaf(xl), _leaf(w), dim=1, sizes=toks, grad="R", **ax),
            lambda: F.linear(C.all_gather(_leaf(xl), dim=1, sizes=toks, grad="R", **ax), _leaf(w)),
            g),
        "linear_reduce_scatter": (
            lambda: linear_reduce_scatter(_leaf(xin), _leaf(win), dim=1, sizes=toks, op="sum",
                                          **ax),
            lambda: C.reduce_scatter(F.linear(_leaf(xin), _leaf(win)), dim=1, sizes=toks, op="sum",
                                     **ax),
            _chunk(g, 1, toks, r)),
    }
    axes, _ = _summa_axes((2, n // 2))
    toks2, w_rows, ins2, outs = _summa_shards((2, n // 2), OUT, IN)
    dc, tc = axes["domain"].coord, axes["tensor"].coord
    xs = _chunk(_chunk(x, 1, toks2, dc), 2, ins2, tc)
    ws = _chunk(_chunk(w, 0, w_rows, dc), 1, ins2, tc)
    pairs["summa_linear"] = (
        lambda: summa_linear(_leaf(xs), _leaf(ws), weight_sizes=w_rows, out_sizes=outs, **axes),
        lambda: C.reduce_scatter(
            F.linear(_leaf(xs), C.all_gather(_leaf(ws), dim=0, sizes=w_rows, axis=axes["domain"], grad="P")),
            dim=2, sizes=outs, op="sum", axis=axes["tensor"]),
        _chunk(_chunk(g, 1, toks2, dc), 2, outs, tc))
    out = {}
    for name, (fused, plain, grad) in pairs.items():
        y_fused, fused_calls = _traffic(fused, grad=grad)
        y_plain, plain_calls = _traffic(plain, grad=grad)
        expected = {"summa_linear": 4, "all_gather_linear R": 1}.get(name, 2)  # forward, backward
        out[name] = (fused_calls == plain_calls and len(fused_calls) == expected,
                     torch.allclose(y_fused, y_plain, rtol=1e-5, atol=1e-6))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_fused_kernels_send_the_bytes_of_their_composition(world, ranks2, ranks4):
    pool = ranks2 if world == 2 else ranks4
    for res in pool.run(_traffic_case):
        assert res == {k: (True, True) for k in res} and len(res) == 4


# ---------------------------------------------------------------- bad input


def _bad_sizes_case():
    group = dist.group.WORLD.group_name
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    try:
        all_gather_linear(x, w, dim=1, sizes=(3,), axis=MeshAxis("domain", dist.get_world_size(), group, 0), grad="P")
    except ValueError as e:
        return str(e)
    return "no error"


def test_sizes_must_match_the_axis(ranks2):
    msg = ranks2.run(_bad_sizes_case)[0]
    assert "'domain'" in msg and "chunk_sizes" in msg and "2 ranks" in msg
