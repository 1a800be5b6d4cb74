"""Rules for aten.scaled_dot_product_attention: batch, heads, sequence (ring or gathered K/V), replicated.

Per mesh axis, for SDPA(Q [..., H, Sq, D], K and V [..., Hkv, Sk, *], mask broadcastable to
[..., H, Sq, Sk]); the mask is sharded like Q on every dim where it does not broadcast:
  batch     Q, K, V Shard(d), d a leading dim                      -> Shard(d)
  heads     Q, K, V Shard(-3) if every rank keeps the kv heads of exactly its query heads
            (grouped-query attention); K, V Replicate if there is one kv head -> Shard(-3)
  ring      Q, K, V Shard(-2), mask rows Shard(-2)                 -> Shard(-2), ring_attention
  zigzag    the same, load-balanced for is_causal; mask Replicate  -> Shard(-2), ring_attention_zigzag
  gathered  Q Shard(-2), K, V Replicate, mask rows Shard(-2)       -> Shard(-2), kv_gather_attention
The ring runs on one axis; the others may add batch or heads (2-D: heads over "tensor",
sequence over "domain"). Attention with dropout stays replicated: the single-device random
mask. `attention_cost` prices every strategy, the ring's hops and causal imbalance included.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Replicate, Shard

from ...cost_model.compute import backward_factor, flops, roofline_time
from ...dtypes import acc_dtype
from ...ir import GLOBAL, PLACEMENTS, bytes_sent, tensor_inputs
from ...kernels import registry, seq_attention
from ...kernels.ring import zigzag_sizes
from ...placements import chunk_sizes, local_offset, local_shape
from .base import AxisOption, kernel_axis, per_axis, register

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
R = Replicate()
RINGS = {"ring_attention": "contiguous", "ring_attention_zigzag": "zigzag"}
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def sdpa_args(node) -> dict:
    """SDPA's arguments after q, k, v by name, defaults filled in (HF passes some as kwargs)."""
    return {**_DEFAULTS, **dict(zip(("attn_mask", "dropout_p", "is_causal"), node.args[3:])), **node.kwargs}


def groups_kept(hq: int, hkv: int, q_heads, kv_heads, sizes) -> bool:
    """Does every rank hold the kv heads of exactly its query heads, so that local GQA is exact?

    `q_heads`, `kv_heads`: per mesh axis, Shard(0) where the head dim is sharded, else Replicate.
    """
    group = hq // hkv
    axes = [a for a, p in enumerate(q_heads) if p != R or kv_heads[a] != R]
    for sub in itertools.product(*(range(sizes[a]) for a in axes)):
        coord = [0] * len(sizes)
        for a, c in zip(axes, sub):
            coord[a] = c
        (qo,), (ql,) = local_offset((hq,), q_heads, sizes, coord), local_shape((hq,), q_heads, sizes, coord)
        (ko,), (kl,) = (local_offset((hkv,), kv_heads, sizes, coord),
                        local_shape((hkv,), kv_heads, sizes, coord))
        if ql == 0 and kl == 0:
            continue
        if kl == 0 or ql % kl or any((qo + i) // group != ko + i // (ql // kl) for i in range(ql)):
            return False
    return True


@register(SDPA)
def attention(node, mesh, candidates):
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    args = sdpa_args(node)
    mask = args["attn_mask"].meta["val"] if args["attn_mask"] is not None else None
    seq, heads = q.ndim - 2, q.ndim - 3
    sq, sk = q.shape[seq], k.shape[seq]
    self_attention = q.ndim == 4 and sq == sk and (mask is None or mask.shape[-1] == sk)

    def inputs(qp, kvp, mask_dim):
        """Placements of q, k, v and the mask: the mask sharded like Q's dim `mask_dim`, if not broadcast."""
        if mask is None:
            return qp, kvp, kvp
        d = None if mask_dim is None else mask_dim - (q.ndim - mask.ndim)
        return qp, kvp, kvp, Shard(d) if d is not None and d >= 0 and mask.shape[d] != 1 else R

    def options(n):
        if args["dropout_p"]:
            return [AxisOption(inputs(R, R, None), (R,), note="dropout: replicated, as on one device")]
        opts = [AxisOption(inputs(R, R, None), (R,))]
        if n == 1:
            return opts
        note = ""
        for d in range(seq):
            if q.shape[d] < n:
                continue
            if q.shape[d] == k.shape[d]:
                opts.append(AxisOption(inputs(Shard(d), Shard(d), d), (Shard(d),),
                                       note="heads" if d == heads else "batch"))
            elif d == heads and groups_kept(q.shape[d], k.shape[d], (Shard(0),), (Shard(0),), (n,)):
                opts.append(AxisOption(inputs(Shard(d), Shard(d), d), (Shard(d),), note="heads"))
            elif d == heads and k.shape[d] == 1:
                opts.append(AxisOption(inputs(Shard(d), R, d), (Shard(d),), note="heads, one kv head"))
            elif d == heads:
                note = (f"heads not split: {q.shape[d]} query heads in groups over {k.shape[d]} kv "
                        f"heads cannot split over {n} ranks keeping each group with its kv head")
        if sq >= n:
            s = Shard(seq)
            if self_attention:
                opts.append(AxisOption(inputs(s, s, seq), (s,), kernel="ring_attention", note="ring"))
                if args["is_causal"]:
                    opts.append(AxisOption(inputs(s, s, None), (s,), kernel="ring_attention_zigzag",
                                           note="zigzag ring"))
            opts.append(AxisOption(inputs(s, R, seq), (s,), kernel="kv_gather_attention",
                                   note="gathered K/V"))
        return [AxisOption(o.inputs, o.outputs, o.kernel, "; ".join(filter(None, (o.note, note))))
                for o in opts]

    found = per_axis(mesh, options)
    return [s for s in found if _legal(s, q, k, seq, heads, mesh)]


def _legal(strategy, q, k, seq: int, heads: int, mesh) -> bool:
    """One ring axis at most, and query groups kept with their kv heads over all axes together."""
    q_pl, kv_pl = strategy.inputs[0], strategy.inputs[1]
    if strategy.kernel in RINGS and q_pl.count(Shard(seq)) > 1:
        return False
    if q.shape[heads] == k.shape[heads] or Shard(heads) not in q_pl:
        return True
    as_heads = [tuple(Shard(0) if p == Shard(heads) else R for p in pl) for pl in (q_pl, kv_pl)]
    return groups_kept(q.shape[heads], k.shape[heads], *as_heads, mesh.sizes)


# ---------------------------------------------------------------- kernel calls and traffic


def _seq_axis(node, sharding) -> int:
    """The mesh axis the ring runs on: the one sharding Q's sequence dim."""
    return kernel_axis(node, sharding.inputs[0], node.args[0].meta["val"].ndim - 2, sharding.kernel)


def _ring_call(node, sharding, rank, local_inputs):
    args = sdpa_args(node)
    mask = local_inputs[3] if len(local_inputs) > 3 else None
    kwargs = dict(is_causal=args["is_causal"], scale=args["scale"], enable_gqa=args["enable_gqa"],
                  layout=RINGS[sharding.kernel], seq_len=node.args[0].meta["val"].shape[-2],
                  axis=rank.axis(_seq_axis(node, sharding)))
    return seq_attention.ring, (*local_inputs[:3], mask), kwargs


def _gathered_call(node, sharding, rank, local_inputs):
    q, args = node.args[0].meta["val"], sdpa_args(node)
    offset = local_offset(q.shape, sharding.inputs[0], rank.mesh.sizes, rank.coord)[q.ndim - 2]
    mask = local_inputs[3] if len(local_inputs) > 3 else None
    kwargs = dict(is_causal=args["is_causal"], scale=args["scale"], enable_gqa=args["enable_gqa"],
                  row_offset=offset)
    return seq_attention.gathered_kv, (*local_inputs[:3], mask), kwargs


def _local(value, rank) -> tuple[list[int], torch.dtype]:
    """Local shape and dtype of a rewritten node's (first) output on `rank`."""
    val = value.meta[GLOBAL]
    return list(local_shape(val.shape, value.meta[PLACEMENTS][0], rank.mesh.sizes, rank.coord)), val.dtype


def _ring_traffic(node, rank, backward) -> list[tuple[str, int]]:
    """K, V hops around the ring (n-1 forward; n-1 and n of dK, dV backward) and the zigzag moves."""
    kw = node.kwargs
    n, zigzag = kw["axis"].size, kw["layout"] == "zigzag"
    q, k, v = node.args[:3]
    (k_shape, dtype), (v_shape, _) = _local(k, rank), _local(v, rank)
    rest = math.prod(k_shape) // k_shape[-2] + math.prod(v_shape) // v_shape[-2]
    sizes = zigzag_sizes(kw["seq_len"], n) if zigzag else chunk_sizes(kw["seq_len"], n)
    acc = acc_dtype(dtype).itemsize
    hop = ("send_recv", bytes_sent("send_recv", rest * max(sizes) * dtype.itemsize, n))
    grad_hop = ("send_recv", bytes_sent("send_recv", rest * max(sizes) * acc, n))
    out = [hop] * (n - 1) + ([hop] * (n - 1) + [grad_hop] * n if backward else [])
    if zigzag:
        mine = kw["axis"].coord
        contiguous, zig = chunk_sizes(kw["seq_len"], n)[mine], sizes[mine]

        def move(t, length):
            shape, _ = _local(t, rank)
            return "all_to_all", bytes_sent("all_to_all", math.prod(shape) // shape[-2] * length
                                            * dtype.itemsize, n)

        out += [move(t, contiguous) for t in (q, k, v)] + [move(node, zig)]  # q, k, v in; out back
        if backward:
            out += [move(node, contiguous)] + [move(t, zig) for t in (q, k, v) if t in backward]
    return out


# ---------------------------------------------------------------- cost


def attention_cost(node, strategy, ctx, grad: bool) -> tuple[float, float]:
    """Seconds of one strategy, for every kernel: causal skipping, the ring's hops, zigzag moves.

    Saved bytes are the default estimate's (NaN: q, k, v as the node reads them -- gathered
    K/V whole --, its output and log-sum-exp, which is what the ring saves too), but for causal
    gathered K/V: SDPA also saves the shifted mask it is given, as a [rows, keys] float tensor.
    """

    vals = [src.meta["val"] for src, _ in tensor_inputs(node)]
    shapes = [local_shape(v.shape, p, ctx.mesh.sizes, ctx.coord0) for v, p in zip(vals, strategy.inputs)]
    out = local_shape(node.meta["val"].shape, strategy.output, ctx.mesh.sizes, ctx.coord0)
    dtype = vals[0].dtype
    moved = sum(math.prod(s) * t.dtype.itemsize for s, t in zip(shapes, vals))
    moved += math.prod(out) * dtype.itemsize
    backward = backward_factor(SDPA) if ctx.training and grad else 0.0
    causal = sdpa_args(node)["is_causal"]
    full = flops(SDPA, shapes[:3], [out])  # every local query row against every local key
    if strategy.kernel in RINGS:
        return _ring_time(node, strategy, ctx, shapes, full, moved, dtype, causal, backward), math.nan
    share = 0.5 if causal and strategy.kernel == "local" else 1.0  # a shifted mask hides nothing
    t = float(roofline_time(share * full, moved, dtype, ctx.device, "attention")) * (1 + backward)
    if not (causal and backward and strategy.kernel == "kv_gather_attention"):
        return t, math.nan
    q, k = shapes[:2]
    mask = max([q[-2] * k[-2]] + [math.prod(s) for s in shapes[3:]])
    lse = math.prod(q[:-1]) * 4
    return t, (sum(math.prod(s) for s in shapes[:3]) + mask) * dtype.itemsize + lse


def _ring_time(node, strategy, ctx, shapes, block: float, moved: int, dtype, causal: bool,
               backward: float) -> float:
    """n steps, each computing one block of keys while the next travels; the slowest rank sets the pace."""
    q, k, v = shapes[:3]
    a = kernel_axis(node, strategy.inputs[0], len(q) - 2, strategy.kernel)
    n = ctx.mesh.sizes[a]
    zigzag = RINGS[strategy.kernel] == "zigzag"
    # The share of a block the busiest rank computes per step: after the diagonal, causal
    # contiguous chunks leave the last rank whole blocks; zigzag gives every rank half of one.
    steps = [0.5] * n if zigzag else [0.5] + [1.0] * (n - 1) if causal else [1.0] * n

    def compute(share: float) -> float:
        return float(roofline_time(share * block, moved, dtype, ctx.device, "attention"))

    def send(kind: str, nbytes: int) -> float:
        return ctx.collective_time(kind, nbytes, a)

    kv_numel = math.prod(k) + math.prod(v)
    hop = send("send_recv", kv_numel * dtype.itemsize)
    t = sum(max(compute(s), hop) for s in steps[:-1]) + compute(steps[-1])
    if backward:  # K, V travel again, their gradients (fp32 or fp64) once more, the last hop home
        grad_hop = send("send_recv", kv_numel * acc_dtype(dtype).itemsize)
        t += sum(max(backward * compute(s), hop + grad_hop) for s in steps[:-1])
        t += max(backward * compute(steps[-1]), grad_hop) + grad_hop
    if zigzag:  # q, k, v to zigzag and the output back, their gradients the other way
        out = q[:-1] + v[-1:]
        moves = sum(send("all_to_all", math.prod(s) * dtype.itemsize) for s in (q, k, v, out))
        t += moves * (2 if backward else 1)
    return t


for _name in RINGS:
    registry.add(registry.Kernel(_name, _ring_call, _ring_traffic, attention_cost))
registry.add(registry.Kernel("kv_gather_attention", _gathered_call, cost=attention_cost))


def _local_attention_cost(node, strategy, ctx, grad: bool, operand_grads) -> tuple[float, float]:
    """attention_cost: SDPA's backward kernel computes the gradients of q, k and v together, needed or not."""
    return attention_cost(node, strategy, ctx, grad)


registry.local_cost(SDPA, _local_attention_cost)
