"""torch's CUDA caching allocator, replayed: what it reserves for a sequence of allocations and frees.

The rules of c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator::malloc and free) with
the default configuration (no max_split_size, no garbage collection, no power-of-two rounding):

- every request is rounded up to a multiple of 512 B (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) come from the small pool, others from the large one;
  each stream has its own pools: a block freed on one stream serves only that stream;
- a request takes the smallest cached free block of its pool that holds it (best fit);
- without one, a new segment is reserved: 2 MiB (kSmallBuffer) for a small request, 20 MiB
  (kLargeBuffer) for one under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
  (kRoundLarge);
- the block taken is split when the rest is worth keeping: at least 512 B in the small pool, more
  than 1 MiB in the large one; a smaller rest stays in the block (and counts as allocated);
- a freed block merges with its free neighbours in its segment; segments are kept, until a device
  that cannot hold a new segment makes the allocator give back every cached segment that is
  wholly free and try again (release_cached_blocks; torch counts num_alloc_retries): `capacity`,
  the device's bytes, makes the replay do so, and `shortfall` is what a request still lacked.

With `expandable_segments` (PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", torchtitan's
setting) each pool of each stream is one segment of virtual addresses that grows by mapping
pages at its end, 2 MiB in the small pool and 20 MiB in the large one: a request that no free
block holds takes the free block at the end of the segment and maps what it lacks; every rest
of at least 512 B is split off; a free block at the end serves a request only when no other
free block holds it; out of memory, the pages of the free blocks at the segments' ends are given
back (the replay keeps free pages inside a segment mapped, as torch does until it runs out).

`max_memory_reserved` is the peak of the segments' bytes, `max_memory_allocated` that of the
blocks handed out (rounded and unsplit rests included): `Allocator.peak_reserved`,
`Allocator.peak_allocated`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

KiB, MiB = 1024, 1024**2
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest small request
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: a small segment; an expandable small pool's page
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: a segment for requests of 1-10 MiB; an expandable large pool's page
ROUND_LARGE = 2 * MiB  # kRoundLarge


def round_size(nbytes: int) -> int:
    """The block size of a request: a multiple of 512 B, at least 512 B."""
    return max(MIN_BLOCK, -(-int(nbytes) // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment reserved for a (rounded) request no cached block holds (get_allocation_size)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    """A range of one segment: [offset, offset + size), handed out or cached free."""

    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class _Pool:
    """The cached free blocks of one stream's small or large pool, by (size, segment, offset)."""

    small: bool
    free: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int, int], _Block] = field(default_factory=dict)
    tail: int | None = None  # expandable: this pool's one segment

    def add(self, block: _Block) -> None:
        bisect.insort(self.free, block.key())
        self.blocks[block.key()] = block

    def remove(self, block: _Block) -> None:
        k = block.key()
        self.free.pop(bisect.bisect_left(self.free, k))
        del self.blocks[k]


class Allocator:
    """The caching allocator of one device: `malloc(nbytes, stream)` -> a handle, `free(handle)`.

    `expandable_segments`: PYTORCH_CUDA_ALLOC_CONF's option; `capacity`: the bytes the device holds (None:
    unlimited). Streams are any hashable names. `retries` counts the times the cache was given back to make
    room, `shortfall` is the most bytes a request lacked even then (0: the device held every one).
    """

    def __init__(self, *, expandable_segments: bool = False, capacity: int | None = None):
        self.expandable, self.capacity = expandable_segments, capacity
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.retries = self.shortfall = 0
        self._pools: dict[tuple, _Pool] = {}
        self._segments: list[int] = []  # bytes per segment (mapped bytes, expandable)
        self._pool_of: list[_Pool] = []  # per segment: its pool
        self._last: dict[int, _Block] = {}  # per segment: the block at its end
        self._live: dict[int, _Block] = {}
        self._next_handle = 0

    def malloc(self, nbytes: int, stream=0) -> int:
        """Hand out a block of at least `nbytes` on `stream`; returns its handle."""
        size = round_size(nbytes)
        pool = self._pools.setdefault((stream, size <= SMALL_SIZE), _Pool(size <= SMALL_SIZE))
        block = self._best_fit(pool, size) or self._grow(pool, size)
        rest = block.size - size
        if rest >= MIN_BLOCK if (pool.small or self.expandable) else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, True, block, block.next)
            if block.next is None:
                self._last[block.segment] = tail
            else:
                block.next.prev = tail
            block.next, block.size = tail, size
            pool.add(tail)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_handle += 1
        self._live[self._next_handle] = block
        return self._next_handle

    def free(self, handle: int) -> None:
        """Give a block back to its pool's cache, merged with its free neighbours."""
        block = self._live.pop(handle)
        pool = self._pool_of[block.segment]
        self.allocated -= block.size
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                pool.remove(other)
                self._merge(block, other)
        pool.add(block)

    def _merge(self, block: _Block, other: _Block) -> None:
        """`other`, a free neighbour of `block`, becomes part of it."""
        if other is block.prev:
            block.offset, block.prev = other.offset, other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is None:
                self._last[block.segment] = block
            else:
                other.next.prev = block
        block.size += other.size

    def _at_end(self, block: _Block) -> bool:
        """Is `block` an expandable segment's last, which mapping more pages extends?"""
        return self.expandable and self._last[block.segment] is block

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        """The smallest cached block that holds `size` (expandable: the segment's end only when no other does)."""
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        for k in pool.free[i:i + 2]:  # one pool has one segment end
            block = pool.blocks[k]
            if not self._at_end(block):
                pool.remove(block)
                return block
        return None

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Reserve what no cached block holds: a new segment, or (expandable) pages mapped at the segment's end."""
        if not self.expandable:
            seg = self._new_segment(pool, segment_size(size))
            block = _Block(seg, 0, self._segments[seg])
            self._last[seg] = block
            return block
        if pool.tail is None:
            pool.tail = self._new_segment(pool, 0)
        seg = pool.tail
        last = self._last.get(seg)
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        mapped = max(0, -(-(size - (last.size if last is not None and last.free else 0)) // page) * page)
        self._make_room(mapped, growing=seg)  # this segment's free end is mapped again at once: kept
        if last is not None and last.free:
            pool.remove(last)
        else:
            last = _Block(seg, self._segments[seg], 0, True, last)
            if last.prev is not None:
                last.prev.next = last
            self._last[seg] = last
        self._segments[seg] += mapped
        self._reserve(mapped)
        last.size += mapped
        return last

    def _new_segment(self, pool: _Pool, nbytes: int) -> int:
        self._make_room(nbytes)
        self._segments.append(nbytes)
        self._pool_of.append(pool)
        self._reserve(nbytes)
        return len(self._segments) - 1

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _make_room(self, nbytes: int, growing: int | None = None) -> None:
        """Out of capacity for `nbytes` more: give back the cache (wholly free segments; expandable, the free
        pages at the segments' ends but `growing`'s) and record what is still lacking."""
        if self.capacity is None or self.reserved + nbytes <= self.capacity:
            return
        self.retries += 1
        for seg, block in list(self._last.items()):
            if block.free and seg != growing and (self.expandable or block.prev is None):
                self._give_back(seg, block)
        self.shortfall = max(self.shortfall, self.reserved + nbytes - self.capacity)

    def _give_back(self, seg: int, block: _Block) -> None:
        """Return the whole pages of a free block that ends segment `seg` (all of a wholly free segment)."""
        pool = self._pool_of[seg]
        page = (SMALL_BUFFER if pool.small else LARGE_BUFFER) if self.expandable else block.size
        end = block.offset + block.size
        freed = end - -(-block.offset // page) * page if page else 0
        if freed <= 0:
            return
        pool.remove(block)
        block.size -= freed
        self._segments[seg] -= freed
        self.reserved -= freed
        if block.size:
            pool.add(block)
        elif block.prev is not None:
            block.prev.next, self._last[seg] = None, block.prev
        else:
            del self._last[seg]
