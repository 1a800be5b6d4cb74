"""Ring attention against single-device SDPA: outputs and dQ, dK, dV (and dMask) each.

Every rank builds the same global tensors, runs SDPA on them, and compares its shard of the
result and of every gradient with what ring_attention gives for its local shards. Which
positions a rank holds is computed here from torch.chunk, independently of kernels/ring.py.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autojigsaw.kernels.attention import from_zigzag, ring_attention, to_zigzag, zigzag_sizes
from autojigsaw.kernels.collectives import count_comm
from autojigsaw.mesh import MeshAxis

B, H, D = 2, 4, 8
F32, F64 = torch.float32, torch.float64
TOL = {F32: 1e-5, F64: 1e-10}


def _positions(seq_len, n, r, layout):
    """Global positions rank r holds: torch.chunk pieces (zigzag: pieces r and 2n-1-r)."""
    idx = torch.arange(seq_len)
    parts = 2 * n if layout == "zigzag" else n
    chunks = list(torch.chunk(idx, parts)) + [idx[:0]] * parts
    return torch.cat([chunks[r], chunks[parts - 1 - r]]) if layout == "zigzag" else chunks[r]


def _world():
    n, r = dist.get_world_size(), dist.get_rank()
    return n, r, MeshAxis("seq", n, dist.group.WORLD.group_name, r)


def _global_mask(kind, seq_len, dtype, gen):
    """A global mask of the given kind (None, bool or float), and whether it takes a grad."""
    if kind in ("padding", "padding_bcast"):  # batch 0 ignores its last 3 keys
        keep = torch.arange(seq_len)[None, :] < torch.tensor([seq_len - 3, seq_len])[:, None]
        return keep[:, None, None, :], False
    if kind == "bool":  # random, with query row 1 seeing no key at all
        keep = torch.rand(B, H, seq_len, seq_len, generator=gen) > 0.4
        keep[:, :, 1] = False
        return keep, False
    if kind == "float":  # a learnable bias with -inf holes and one fully masked row
        bias = torch.randn(1, H, seq_len, seq_len, generator=gen, dtype=dtype)
        bias[0, 1, 2, ::3] = float("-inf")
        bias[0, 2, seq_len - 1] = float("-inf")
        return bias, True
    return None, False


def _nc(x):
    """The same values in a non-contiguous (transposed) layout."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _attention_case(seq_len, dtype, causal, layout, mask_kind, hkv, transposed, scale):
    n, r, seq = _world()
    gen = torch.Generator().manual_seed(seq_len)
    q, dout = (torch.randn(B, H, seq_len, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, hkv, seq_len, D, generator=gen, dtype=dtype) for _ in range(2))
    mask, mask_grad = _global_mask(mask_kind, seq_len, dtype, gen)
    if mask_kind == "padding":
        mask = mask.expand(B, 1, seq_len, seq_len)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    full_mask = mask.clone().requires_grad_() if mask_grad else mask
    ref_mask, ref_causal = full_mask, causal
    if causal and mask_grad:  # SDPA's math path refuses both; CPU flash combines them
        hidden = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        ref_mask, ref_causal = full_mask.masked_fill(hidden, float("-inf")), False
    ref = F.scaled_dot_product_attention(*full, attn_mask=ref_mask, is_causal=ref_causal,
                                         scale=scale, enable_gqa=hkv != H)
    ref.backward(dout)

    pos = _positions(seq_len, n, r, layout)
    sizes = tuple(len(_positions(seq_len, n, i, layout)) for i in range(n))
    mine = [t.index_select(2, pos) for t in (q, k, v)]
    mine = [(_nc(t) if transposed else t).detach().requires_grad_() for t in mine]
    my_mask = mask
    if mask is not None and mask.shape[2] != 1:
        my_mask = mask.index_select(2, pos).detach().requires_grad_(mask_grad)
    out = ring_attention(*mine, my_mask, is_causal=causal, scale=scale, enable_gqa=hkv != H,
                         seq_sizes=sizes, layout=layout, axis=seq)
    my_dout = dout.index_select(2, pos)
    out.backward(_nc(my_dout) if transposed else my_dout)

    def err(a, b):
        return (a - b).abs().max().item() if a.numel() else 0.0

    errors = {"out": err(out, ref.index_select(2, pos))}
    for name, a, b in zip(("dq", "dk", "dv"), mine, full):
        errors[name] = err(a.grad, b.grad.index_select(2, pos))
    if mask_grad:
        errors["dmask"] = err(my_mask.grad, full_mask.grad.index_select(2, pos))
    return errors


# (seq_len, dtype, causal, layout, mask, kv heads, transposed inputs, scale)
CASES4 = [
    (16, F64, False, "contiguous", None, 4, False, None),
    (16, F64, True, "contiguous", None, 4, False, None),
    (16, F64, True, "zigzag", None, 4, False, None),
    (16, F64, False, "zigzag", None, 4, False, 0.3),
    (16, F32, True, "zigzag", None, 4, False, None),
    (16, F32, False, "contiguous", "float", 4, False, None),
    (7, F64, True, "contiguous", None, 4, False, None),  # 2, 2, 2, 1
    (10, F64, True, "zigzag", None, 4, False, None),  # 2, 2, 2, 4
    (10, F64, False, "contiguous", "padding", 4, True, None),
    (5, F64, True, "contiguous", "bool", 4, False, None),  # 2, 2, 1, 0: a rank holds nothing
    (3, F64, True, "zigzag", None, 4, False, None),  # 1, 1, 1, 0
    (16, F64, True, "zigzag", "float", 2, True, None),  # GQA, learnable bias, transposed
    (12, F64, False, "contiguous", "padding_bcast", 2, False, None),
    (13, F32, True, "contiguous", None, 2, True, None),
]
CASES2 = [
    (9, F64, True, "zigzag", "bool", 4, False, None),
    (8, F32, False, "contiguous", None, 2, True, None),
]


def _check(errors, dtype):
    assert all(e <= TOL[dtype] for rank in errors for e in rank.values()), errors


@pytest.mark.parametrize("case", CASES4, ids=lambda c: "-".join(map(str, c)))
def test_ring_attention_4_ranks(ranks4, case):
    _check(ranks4.run(_attention_case, *case), case[1])


@pytest.mark.parametrize("case", CASES2, ids=lambda c: "-".join(map(str, c)))
def test_ring_attention_2_ranks(ranks2, case):
    _check(ranks2.run(_attention_case, *case), case[1])


def _one_rank_case():
    sub, _ = dist.new_subgroups(group_size=1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, 6, D, dtype=F64, requires_grad=True) for _ in range(3))
    out = ring_attention(q, k, v, is_causal=True, seq_sizes=(6,), layout="zigzag",
                         axis=MeshAxis("seq", 1, sub.group_name, 0))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    return max((a - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads)))


def test_one_rank_is_sdpa(ranks2):
    assert max(ranks2.run(_one_rank_case)) <= 1e-12


def _zigzag_case(seq_len, dim):
    n, r, seq = _world()
    gen = torch.Generator().manual_seed(1)
    shape = [2, 3, 5]
    shape[dim] = seq_len
    full, grad = (torch.randn(shape, generator=gen, dtype=F64) for _ in range(2))
    contiguous = _positions(seq_len, n, r, "contiguous")
    zigzag = _positions(seq_len, n, r, "zigzag")
    kw = dict(dim=dim, seq_len=seq_len, axis=seq)
    x = full.index_select(dim, contiguous).requires_grad_()
    z = to_zigzag(x, **kw)
    z.backward(grad.index_select(dim, zigzag))  # adjoint: the gradient comes back contiguous
    back = from_zigzag(z.detach().requires_grad_(), **kw)
    back.backward(grad.index_select(dim, contiguous))
    return (zigzag_sizes(seq_len, n)[r] == len(zigzag),
            torch.equal(z, full.index_select(dim, zigzag)),
            torch.equal(back, x),
            torch.equal(x.grad, grad.index_select(dim, contiguous)))


@pytest.mark.parametrize("seq_len,dim", [(16, 1), (10, -1), (7, 1), (3, 0)])
def test_zigzag_round_trip_and_adjoint(ranks4, seq_len, dim):
    assert ranks4.run(_zigzag_case, seq_len, dim) == [(True,) * 4] * 4


def _comm_case():
    n, r, seq = _world()
    q = torch.randn(B, H, (3, 3, 3, 1)[r], D, requires_grad=True)
    k, v = (torch.randn(B, 2, (3, 3, 3, 1)[r], D, requires_grad=True) for _ in range(2))
    with count_comm() as log:
        ring_attention(q, k, v, is_causal=True, enable_gqa=True, seq_sizes=(3, 3, 3, 1),
                       axis=seq).sum().backward()
    return log.calls


def test_ring_traffic_is_counted(ranks4):
    block = 2 * B * 2 * 3 * D * 4  # k and v of 2 heads, padded to 3 tokens, fp32
    # forward: n-1 hops of k, v; backward: n-1 hops of k, v and n of dK, dV (fp32 as well)
    expected = [("send_recv", "seq", block)] * (3 + 3 + 4)
    assert ranks4.run(_comm_case) == [expected] * 4


def _saved_bytes_case(local_len, layout):
    n, r, seq = _world()
    q, k, v = (torch.randn(B, H, local_len, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ring_attention(q, k, v, is_causal=True, seq_sizes=(local_len,) * n, layout=layout,
                             axis=seq)
    out.sum().backward()
    return saved


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_saved_memory_scales_with_local_shard(ranks2, layout):
    shard = B * H * D * 4  # bytes of one fp32 token of q (and of k, v, out)
    for local_len in (8, 16):
        for saved in ranks2.run(_saved_bytes_case, local_len, layout):
            # exactly q, k, v, out and the fp32 log-sum-exp: nothing of size S or S^2
            assert sorted(saved) == sorted([shard * local_len] * 4 + [B * H * 4 * local_len])
            gathered_kv = 2 * shard * local_len * 2  # what holding all of K and V would cost
            assert sum(saved) < 2 * shard * local_len + gathered_kv


def _bad_inputs_case():
    n, r, seq = _world()
    q, k3 = torch.randn(B, 4, 4, D), torch.randn(B, 3, 4, D)
    k, q3 = torch.randn(B, 2, 4, D), torch.randn(B, 4, 3, D)
    kw = dict(seq_sizes=(4, 4), axis=seq)
    calls = {
        "heads not divisible": lambda: ring_attention(q, k3, k3, enable_gqa=True, **kw),
        "gqa not enabled": lambda: ring_attention(q, k, k, **kw),
        "seq_sizes vs group": lambda: ring_attention(q, q, q, **{**kw, "seq_sizes": (4, 4, 4)}),
        "local length": lambda: ring_attention(q, q, q, **{**kw, "seq_sizes": (5, 3)}),
        "not zigzag": lambda: ring_attention(q3, q3, q3, layout="zigzag", seq_sizes=(3, 3),
                                             axis=seq._replace(coord=0)),  # (2, 4) is
        "layout name": lambda: ring_attention(q, q, q, layout="striped", **kw),
        "mask columns": lambda: ring_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool), **kw),
        "mask grad": lambda: ring_attention(q, q, q, torch.zeros(1, 8, requires_grad=True), **kw),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reports which type it was
            raised[name] = type(e).__name__
    return raised


def test_bad_inputs_raise_value_error(ranks2):
    for raised in ranks2.run(_bad_inputs_case):
        assert set(raised.values()) == {"ValueError"}, raised
