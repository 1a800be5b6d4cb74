"""Ring attention: scaled_dot_product_attention with the sequence sharded over one mesh axis.

Each rank keeps its query rows and passes its key/value block around the ring (n-1 hops,
the next hop in flight while the current block is computed). Every block is folded into a
flash-style online softmax (running max, sum and output, in fp32, or fp64 for fp64 inputs).
Backward recomputes the blocks the same way: dQ accumulates locally, dK/dV travel with their
block and a last hop brings them home. Only the local q, k, v, the output and the
log-sum-exp are saved, so memory per rank scales as S/n; blocks that causality hides
entirely are skipped (decided from positions, never from tensor values).

Semantics follow SDPA on CPU: a query row with every key masked returns 0 (zero gradients);
is_causal together with attn_mask attends where both allow; a float mask that requires grad
gets its gradient (this rank's rows, like the mask itself).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..dtypes import acc_dtype
from ..mesh import MeshAxis
from .collectives import pad_dim, wait
from .once import differentiable_once
from .ring import Layout, from_zigzag, make_layout, ring_shift, to_zigzag, zigzag_sizes

__all__ = ["from_zigzag", "ring_attention", "to_zigzag", "zigzag_sizes"]

_INF = float("inf")


class _Pair(NamedTuple):
    """A visible sub-block: one query run of this rank against one key run of a block."""

    run: int  # index of the query run (its softmax state)
    q_off: int  # local row offset of the run
    q_start: int  # global position of its first row
    q_len: int
    k_off: int  # offset of the key run inside the block
    k_start: int
    k_len: int
    causal: bool  # partly hidden by causality: needs a position mask


def _pairs(q_runs, k_runs, causal: bool) -> list[_Pair]:
    """The sub-blocks worth computing; the ones causality hides entirely are left out."""
    pairs, q_off = [], 0
    for run, (q_start, q_len) in enumerate(q_runs):
        k_off = 0
        for k_start, k_len in k_runs:
            hidden = causal and k_start > q_start + q_len - 1
            if q_len and k_len and not hidden:
                partly = causal and k_start + k_len - 1 > q_start
                pairs.append(_Pair(run, q_off, q_start, q_len, k_off, k_start, k_len, partly))
            k_off += k_len
        q_off += q_len
    return pairs


def _additive(keep: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, -_INF)


def _bias(mask, p: _Pair, hkv: int, dtype, device):
    """Additive bias of one sub-block, broadcastable to [B, Hkv, G, q_len, k_len], or None."""
    bias = None
    if mask is not None:
        m = mask.narrow(-1, p.k_start, p.k_len)
        if m.shape[-2] != 1:
            m = m.narrow(-2, p.q_off, p.q_len)
        m = _additive(m, dtype) if m.dtype == torch.bool else m.to(dtype)
        bias = m.unsqueeze(2) if m.shape[1] == 1 else m.unflatten(1, (hkv, -1))
    if p.causal:
        rows = torch.arange(p.q_start, p.q_start + p.q_len, device=device)
        cols = torch.arange(p.k_start, p.k_start + p.k_len, device=device)
        causal = _additive(rows[:, None] >= cols[None, :], dtype)
        bias = causal if bias is None else bias + causal
    return bias


def _scores(q, k, bias, scale):
    s = q @ k.transpose(-1, -2) * scale
    return s if bias is None else s + bias


def _fold(state, q, k, v, bias, scale):
    """Fold one key block into a query run's online softmax (max, sum, unnormalised out)."""
    m, l, o = state
    s = _scores(q, k, bias, scale)
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = torch.where(m_new == -_INF, 0.0, m_new)  # rows that see no key yet: keep 0s
    alpha = torch.exp(m - m_safe)
    p = torch.exp(s - m_safe.unsqueeze(-1))
    return m_new, l * alpha + p.sum(-1), o * alpha.unsqueeze(-1) + p @ v


def _finish(state):
    """(out, lse) of a query run; rows that saw no key get out 0 and lse -inf."""
    m, l, o = state
    return o / torch.where(l > 0, l, 1.0).unsqueeze(-1), m + torch.log(l)


def _block_grads(q, k, v, do, lse, delta, bias, scale):
    """dQ, dK, dV and dS of one sub-block, its probabilities recomputed from the lse."""
    p = torch.exp(_scores(q, k, bias, scale) - lse.unsqueeze(-1))
    ds = p * (do @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q) * scale
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    return ds @ k * scale, dk, dv, ds


def _pack(a, b, width):
    """One flat buffer holding two [B, H, S, *] blocks padded to `width` tokens."""
    return torch.cat([pad_dim(a, 2, width).reshape(-1), pad_dim(b, 2, width).reshape(-1)])


def _unpack(buf, shape_a, shape_b):
    na = shape_a.numel()
    return buf[:na].view(shape_a), buf[na:].view(shape_b)


def _ring_forward(q, k, v, mask, ring):
    layout, scale, causal, axis = ring
    n, coord = len(layout), axis.coord
    b, h, sq, d = q.shape
    hkv, dv, acc = k.shape[1], v.shape[-1], acc_dtype(q.dtype)
    width = max(sum(length for _, length in runs) for runs in layout)
    kshape, vshape = torch.Size((b, hkv, width, d)), torch.Size((b, hkv, width, dv))
    q5 = q.to(acc).reshape(b, hkv, h // hkv, sq, d)
    states = [
        (q5.new_full((b, hkv, h // hkv, length), -_INF), q5.new_zeros((b, hkv, h // hkv, length)),
         q5.new_zeros((b, hkv, h // hkv, length, dv)))
        for _, length in layout[coord]
    ]
    kv = _pack(k, v, width)
    for t in range(n):
        pending = ring_shift(kv, axis=axis) if t < n - 1 else None
        pairs = _pairs(layout[coord], layout[(coord - t) % n], causal)
        if pairs:
            kb, vb = (x.to(acc).unsqueeze(2) for x in _unpack(kv, kshape, vshape))
        for p in pairs:
            states[p.run] = _fold(
                states[p.run], q5.narrow(3, p.q_off, p.q_len), kb.narrow(3, p.k_off, p.k_len),
                vb.narrow(3, p.k_off, p.k_len), _bias(mask, p, hkv, acc, q.device), scale,
            )
        if pending is not None:
            kv = wait("send_recv", axis, pending)
    outs, lses = zip(*(_finish(s) for s in states))
    return torch.cat(outs, 3).reshape(b, h, sq, dv).to(q.dtype), torch.cat(lses, 3)


def _add_mask_grad(dmask, ds, p: _Pair):
    b, hkv, g, lq, lk = ds.shape
    ds = ds.reshape(b, hkv * g, lq, lk)
    dims = [i for i in (0, 1) if dmask.shape[i] == 1 and ds.shape[i] != 1]
    if dims:
        ds = ds.sum(dims, keepdim=True)
    dmask.narrow(-2, p.q_off, p.q_len).narrow(-1, p.k_start, p.k_len).add_(ds)


def _ring_backward(dout, q, k, v, out, lse, mask, ring, mask_grad: bool):
    layout, scale, causal, axis = ring
    n, coord = len(layout), axis.coord
    b, h, sq, d = q.shape
    hkv, dv, acc = k.shape[1], v.shape[-1], acc_dtype(q.dtype)
    width = max(sum(length for _, length in runs) for runs in layout)
    kshape, vshape = torch.Size((b, hkv, width, d)), torch.Size((b, hkv, width, dv))
    q5 = q.to(acc).reshape(b, hkv, h // hkv, sq, d)
    do5 = dout.to(acc).reshape(b, hkv, h // hkv, sq, dv)
    delta = (do5 * out.to(acc).reshape(do5.shape)).sum(-1)
    lse = torch.where(lse == -_INF, _INF, lse)  # rows that saw no key: probabilities 0
    dq = torch.zeros_like(q5)
    dmask = torch.zeros(mask.shape, dtype=acc, device=q.device) if mask_grad else None
    kv, pending_dkv = _pack(k, v, width), None
    for t in range(n):
        pending_kv = ring_shift(kv, axis=axis) if t < n - 1 else None
        pairs = _pairs(layout[coord], layout[(coord - t) % n], causal)
        dk, dvb = q5.new_zeros(kshape), q5.new_zeros(vshape)
        if pairs:
            kb, vb = (x.to(acc).unsqueeze(2) for x in _unpack(kv, kshape, vshape))
        for p in pairs:
            rows = slice(p.q_off, p.q_off + p.q_len)
            dq_p, dk_p, dv_p, ds = _block_grads(
                q5[..., rows, :], kb.narrow(3, p.k_off, p.k_len), vb.narrow(3, p.k_off, p.k_len),
                do5[..., rows, :], lse[..., rows], delta[..., rows],
                _bias(mask, p, hkv, acc, q.device), scale,
            )
            dq[..., rows, :] += dq_p
            dk.narrow(2, p.k_off, p.k_len).add_(dk_p)
            dvb.narrow(2, p.k_off, p.k_len).add_(dv_p)
            if dmask is not None:
                _add_mask_grad(dmask, ds, p)
        dkv = torch.cat([dk.reshape(-1), dvb.reshape(-1)])
        if pending_dkv is not None:  # the same block's dK/dV from the ranks it visited before
            dkv = dkv + wait("send_recv", axis, pending_dkv)
        if n > 1:  # after the last step this hop takes dK/dV home
            pending_dkv = ring_shift(dkv, axis=axis)
        if pending_kv is not None:
            kv = wait("send_recv", axis, pending_kv)
    if pending_dkv is not None:
        dkv = wait("send_recv", axis, pending_dkv)
    dk, dvb = (x.narrow(2, 0, k.shape[2]) for x in _unpack(dkv, kshape, vshape))
    dmask = dmask.to(mask.dtype) if dmask is not None else None
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dvb.to(v.dtype), dmask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, ring):
        out, lse = _ring_forward(q, k, v, mask, ring)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse, mask)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        grads = _ring_backward(dout, q, k, v, out, lse, mask, ctx.ring, ctx.needs_input_grad[3])
        return *grads, None


# ---------------------------------------------------------------- checks and the public op


def _check_qkv(q, k, v, enable_gqa, seq_sizes, axis: MeshAxis):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"ring_attention: q, k, v must be [batch, heads, seq, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"ring_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    (b, h, sq, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if bk != b or v.shape[0] != b or v.shape[1] != hkv or v.shape[2] != sk or dk != d:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not match "
                         f"q {tuple(q.shape)} in batch, heads, sequence or head_dim")
    if hkv != h and not enable_gqa:
        raise ValueError(f"ring_attention: q has {h} heads but k, v have {hkv}; "
                         f"pass enable_gqa=True for grouped-query attention")
    if h % hkv:
        raise ValueError(f"ring_attention: q heads ({h}) must be a multiple of k, v heads ({hkv})")
    if len(seq_sizes) != axis.size:
        raise ValueError(f"ring_attention: seq_sizes has {len(seq_sizes)} entries but mesh axis {axis.name!r} "
                         f"has {axis.size} ranks; give one local length per rank of the axis")
    coord = axis.coord
    if sq != seq_sizes[coord] or sk != seq_sizes[coord]:
        raise ValueError(f"ring_attention: seq_sizes gives rank {coord} {seq_sizes[coord]} tokens, "
                         f"but q has {sq} and k, v {sk}; pass this rank's chunks along dim -2")


def _check_mask(mask, q, seq_len):
    """The mask as [B|1, H|1, S_local|1, S]."""
    if mask is None:
        return None
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"ring_attention: attn_mask must be bool or floating, got {mask.dtype}")
    if mask.ndim > 4:
        raise ValueError(f"ring_attention: attn_mask has {mask.ndim} dims; at most 4 are allowed")
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    (b, h, rows, _), (mb, mh, mr, mc) = q.shape, mask.shape
    if mc != seq_len or mr not in (1, rows) or mh not in (1, h) or mb not in (1, b):
        raise ValueError(f"ring_attention: attn_mask {tuple(mask.shape)} must be [{b}|1, {h}|1, "
                         f"{rows}|1, {seq_len}]: this rank's query rows, all keys in global order")
    if mr == 1 and rows != 1 and mask.requires_grad:
        raise ValueError("ring_attention: a row-broadcast attn_mask cannot take a gradient; "
                         f"expand it to the {rows} local rows")
    return mask


def ring_attention(q, k, v, attn_mask=None, *, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, seq_sizes: tuple[int, ...], layout: str = "contiguous",
                   axis: MeshAxis) -> torch.Tensor:
    """This rank's rows of SDPA(Q, K, V) for q, k, v sharded along dim -2 (over `axis`) in `layout`."""
    seq_sizes = tuple(seq_sizes)
    _check_qkv(q, k, v, enable_gqa, seq_sizes, axis)
    runs: Layout = make_layout(seq_sizes, layout)
    mask = _check_mask(attn_mask, q, sum(seq_sizes))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, mask, (runs, scale, is_causal, axis))
