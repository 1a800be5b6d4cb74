"""Each collective against its global meaning: the identity on the tensor it represents.

A local shard goes in, the local shard of the new placement must come out; a gradient
given in the output's representation must come back in the input's (see kernels/collectives.py).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial

from autojigsaw.ir import GLOBAL, PLACEMENTS
from autojigsaw.kernels import collectives as C
from autojigsaw.mesh import MeshAxis, MeshSpec, RankView
from autojigsaw.placements import chunk_sizes
from autojigsaw.rewrite.traffic import collective_traffic

SHAPE = (3, 7, 5)  # 7 does not divide by 2 or 4


def _setup():
    n, r = dist.get_world_size(), dist.get_rank()
    axis = MeshAxis("a", n, dist.group.WORLD.group_name, r)
    torch.manual_seed(0)
    full = torch.randn(SHAPE, dtype=torch.float64)
    grad = torch.randn(SHAPE, dtype=torch.float64)
    return n, r, axis, full, grad


def _chunk(t, dim, n, r):
    sizes = chunk_sizes(t.shape[dim], n)
    return t.narrow(dim, sum(sizes[:r]), sizes[r]), sizes


def _contribution(g, n, r):
    """A split of g into n different summands: rank r holds (r + 1) / (1 + ... + n) of it."""
    return g * (r + 1) / (n * (n + 1) / 2)


def _all_gather_case():
    n, r, axis, full, grad = _setup()
    out = {}
    for mode in ("R", "P"):
        x, sizes = _chunk(full, 1, n, r)
        x = x.clone().requires_grad_()
        y = C.all_gather(x, dim=1, sizes=sizes, axis=axis, grad=mode)
        g = grad if mode == "R" else _contribution(grad, n, r)
        y.backward(g)
        out[mode] = (torch.equal(y, full), torch.allclose(x.grad, _chunk(grad, 1, n, r)[0]))
    return out


def _reduce_scatter_case():
    n, r, axis, full, grad = _setup()
    x = _contribution(full, n, r).clone().requires_grad_()
    sizes = chunk_sizes(SHAPE[2], n)
    y = C.reduce_scatter(x, dim=2, sizes=sizes, op="sum", axis=axis)
    y.backward(_chunk(grad, 2, n, r)[0])
    return torch.allclose(y, _chunk(full, 2, n, r)[0]), torch.allclose(x.grad, grad)


def _reduce_scatter_bytes(dtype: torch.dtype) -> tuple[int, int]:
    """(bytes predicted off a rewritten reduce_scatter node, bytes it sends) for one forward and backward."""
    n, r, axis, _, _ = _setup()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta[GLOBAL], x.meta[PLACEMENTS] = torch.empty(SHAPE, dtype=dtype, device="meta"), ((Partial(),),)
    sizes = chunk_sizes(SHAPE[2], n)
    node = graph.call_function(C.reduce_scatter, (x,), {"dim": 2, "sizes": sizes, "op": "sum", "axis": axis})
    rank = RankView(MeshSpec(("a",), (n,)), (r,), (axis.group,))
    predicted = sum(nbytes for _, nbytes in collective_traffic(node, rank, frozenset({x})))
    value = torch.randn(SHAPE, dtype=dtype).requires_grad_()
    with C.count_comm() as log:
        C.reduce_scatter(value, dim=2, sizes=sizes, op="sum", axis=axis).sum().backward()
    return predicted, log.total_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_reduce_scatter_sends_the_bytes_its_node_predicts(ranks2, dtype):
    # a bf16 sum goes in fp32; its gradient's gather backward sums nothing and goes in bf16
    for predicted, sent in ranks2.run(_reduce_scatter_bytes, dtype):
        assert predicted == sent > 0, (predicted, sent)


def _all_reduce_case():
    n, r, axis, full, grad = _setup()
    out = {}
    for mode in ("R", "P"):
        x = _contribution(full, n, r).clone().requires_grad_()
        y = C.all_reduce(x, op="sum", axis=axis, grad=mode)
        y.backward(grad if mode == "R" else _contribution(grad, n, r))
        out[mode] = (torch.allclose(y, full), torch.allclose(x.grad, grad))
    return out


def _all_to_all_case():
    n, r, axis, full, grad = _setup()
    x, src_sizes = _chunk(full, 1, n, r)
    x = x.clone().requires_grad_()
    dst_sizes = chunk_sizes(SHAPE[0], n)
    y = C.all_to_all(x, src_dim=1, dst_dim=0, src_sizes=src_sizes, dst_sizes=dst_sizes, axis=axis)
    y.backward(_chunk(grad, 0, n, r)[0])
    return torch.equal(y, _chunk(full, 0, n, r)[0]), torch.allclose(x.grad, _chunk(grad, 1, n, r)[0])


def _slice_and_partial_case():
    n, r, axis, full, grad = _setup()
    out = {}
    for mode in ("R", "P"):
        x = full.clone().requires_grad_()
        sizes = chunk_sizes(SHAPE[1], n)
        y = C.shard_slice(x, dim=1, sizes=sizes, axis=axis, grad=mode)
        y.backward(_chunk(grad, 1, n, r)[0])
        got = x.grad.clone()
        if mode == "P":
            dist.all_reduce(got)
        out[mode] = (torch.equal(y, _chunk(full, 1, n, r)[0]), torch.allclose(got, grad))
    x = full.clone().requires_grad_()
    y = C.to_partial(x, op="sum", axis=axis, grad="R")
    total = y.detach().clone()
    dist.all_reduce(total)
    y.backward(grad)  # the gradient of a Partial value is full on every rank
    out["to_partial"] = (torch.allclose(total, full), torch.allclose(x.grad, grad))
    return out


def test_all_gather_uneven(ranks4):
    for res in ranks4.run(_all_gather_case):
        assert res == {"R": (True, True), "P": (True, True)}


def test_reduce_scatter_uneven(ranks4):
    assert ranks4.run(_reduce_scatter_case) == [(True, True)] * 4


def test_all_reduce_both_grad_kinds(ranks2):
    for res in ranks2.run(_all_reduce_case):
        assert res == {"R": (True, True), "P": (True, True)}


def test_all_to_all_uneven(ranks4):
    assert ranks4.run(_all_to_all_case) == [(True, True)] * 4


def test_slice_and_to_partial(ranks4):
    for res in ranks4.run(_slice_and_partial_case):
        assert res == {"R": (True, True), "P": (True, True), "to_partial": (True, True)}
