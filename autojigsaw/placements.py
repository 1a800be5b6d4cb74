"""The placement vocabulary: DTensor's Shard / Replicate / Partial, one per mesh axis.

A `Placements` tuple says how one tensor is laid out over a mesh. Shards follow DTensor's
semantics exactly (torch.chunk sizes, uneven allowed; several axes sharding the same dim
nest in axis order), so a local shard here is the `_local_tensor` of the matching DTensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

__all__ = [
    "Partial", "Placement", "Placements", "Replicate", "Shard", "chunk_sizes", "compact_placements",
    "format_placements", "local_offset", "local_shape", "normalize", "parse_placements", "replicated",
]


def replicated(ndim: int) -> Placements:
    return (Replicate(),) * ndim


def normalize(placements: Sequence[Placement], tensor_ndim: int) -> Placements:
    """Placements with negative Shard dims made positive."""
    return tuple(
        Shard(p.dim % tensor_ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements
    )


def chunk_sizes(size: int, parts: int) -> tuple[int, ...]:
    """Sizes of `torch.chunk(size, parts)` padded with empty chunks to `parts` entries."""
    return tuple(Shard.local_shard_size_and_offset(size, parts, r)[0] for r in range(parts))


def chunks_align(size_fine: int, size_coarse: int, ratio: int, parts: list[int]) -> bool:
    """Do torch.chunk's nested chunks (over `parts` ranks, outermost first) of a dim of size_fine
    hold exactly `ratio` x those of size_coarse: does every shard keep whole patches or windows?"""
    if not parts:
        return size_fine == ratio * size_coarse
    fine, coarse = chunk_sizes(size_fine, parts[0]), chunk_sizes(size_coarse, parts[0])
    return all(chunks_align(f, c, ratio, parts[1:]) for f, c in zip(fine, coarse))


def _walk(shape, placements, mesh_sizes, coord):
    shape = list(shape)
    offset = [0] * len(shape)
    for p, n, c in zip(placements, mesh_sizes, coord):
        if isinstance(p, Shard):
            size, off = Shard.local_shard_size_and_offset(shape[p.dim], n, c)
            shape[p.dim] = size
            offset[p.dim] += off
    return tuple(shape), tuple(offset)


def local_shape(shape, placements: Placements, mesh_sizes, coord) -> tuple[int, ...]:
    """Shape of the shard that mesh coordinate `coord` holds of a tensor of `shape`."""
    return _walk(shape, placements, mesh_sizes, coord)[0]


def local_offset(shape, placements: Placements, mesh_sizes, coord) -> tuple[int, ...]:
    """Offset of that shard inside the global tensor, per dim."""
    return _walk(shape, placements, mesh_sizes, coord)[1]


def format_placements(placements: Placements) -> str:
    """"S(1),R,P(sum)": one short token per mesh axis."""
    return ",".join(_format_one(p) for p in placements)


def _format_one(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"unsupported placement {p!r}")


def compact_placements(placements: Placements) -> str:
    """"S0P" for (Shard(0), Partial()): DTensor's "S(0)P(sum)" without brackets, for the plan table."""
    return "".join(_compact_one(p) for p in placements)


def _compact_one(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial) and p.reduce_op == "sum":
        return "P"
    return _format_one(p)  # R, P(max)


_TOKEN = re.compile(r"^(?:S\((-?\d+)\)|R|P\((\w+)\))$")


def parse_placements(text: str) -> Placements:
    """The inverse of format_placements."""
    out = []
    for token in text.split(","):
        m = _TOKEN.match(token.strip())
        if not m:
            raise ValueError(f"cannot parse placement {token!r}: use S(dim), R or P(op)")
        if m.group(1) is not None:
            out.append(Shard(int(m.group(1))))
        elif m.group(2) is not None:
            out.append(Partial(m.group(2)))
        else:
            out.append(Replicate())
    return tuple(out)
