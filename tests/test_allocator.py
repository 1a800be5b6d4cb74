"""The caching allocator's rules (cost_model/allocator.py), each on a sequence worked out by hand from
c10/cuda/CUDACachingAllocator.cpp."""

import pytest

from autojigsaw.cost_model.allocator import MiB, Allocator, round_size, segment_size


def test_requests_round_to_512_bytes_and_segments_to_the_pool_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert segment_size(MiB) == 2 * MiB  # small: packed into 2 MiB
    assert segment_size(MiB + 512) == 20 * MiB  # 1-10 MiB: a 20 MiB segment to split
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(10 * MiB + 512) == 12 * MiB  # rounded to 2 MiB


def test_small_requests_share_two_mib_segments():
    a = Allocator()
    for _ in range(4):
        a.malloc(512 * 1024)
    assert (a.reserved, a.allocated) == (2 * MiB, 2 * MiB)
    a.malloc(1)
    assert (a.reserved, a.allocated) == (4 * MiB, 2 * MiB + 512)


def test_a_large_rest_is_split_off_a_small_one_stays_allocated():
    a = Allocator()
    a.malloc(int(1.5 * MiB))  # a 20 MiB segment, 18.5 MiB split off
    a.malloc(5 * MiB)  # fits the rest
    assert (a.reserved, a.allocated) == (20 * MiB, int(6.5 * MiB))
    b = Allocator()
    b.malloc(int(11.5 * MiB))  # a 12 MiB segment; the 0.5 MiB rest (not over 1 MiB) stays in the block
    assert (b.reserved, b.allocated) == (12 * MiB, 12 * MiB)


def test_a_freed_block_serves_only_requests_it_holds_and_merges_with_free_neighbours():
    a = Allocator()
    first = a.malloc(100 * MiB)
    a.malloc(100 * MiB)  # held: the first one's hole has no free neighbour
    a.free(first)
    a.malloc(150 * MiB)  # the 100 MiB hole cannot hold it: a new segment
    assert a.reserved == 350 * MiB
    b = Allocator()
    x, y, z = (b.malloc(2 * MiB) for _ in range(3))  # three blocks of one 20 MiB segment
    b.free(x)
    b.free(y)
    b.malloc(int(3.5 * MiB))  # the two merged blocks hold it
    assert b.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    a = Allocator()
    small, big = a.malloc(30 * MiB), a.malloc(50 * MiB)
    a.free(small)
    a.free(big)
    a.malloc(25 * MiB)  # into the 30 MiB segment, which leaves the 50 MiB one whole
    a.malloc(45 * MiB)
    assert a.reserved == 80 * MiB and a.peak_allocated == 30 * MiB + 50 * MiB  # rests of 5 MiB are split off


def test_a_block_freed_on_one_stream_does_not_serve_another():
    a = Allocator()
    a.free(a.malloc(100 * MiB, "copy-in"))
    a.malloc(100 * MiB, "default")
    assert a.reserved == 200 * MiB
    a.malloc(100 * MiB, "copy-in")
    assert a.reserved == 200 * MiB


def test_expandable_segments_grow_in_pages_at_their_end():
    a = Allocator(expandable_segments=True)
    first, second = a.malloc(100 * MiB), a.malloc(100 * MiB)
    assert a.reserved == 200 * MiB  # one segment, ten 20 MiB pages
    a.free(second)
    a.malloc(150 * MiB)  # the free end (100 MiB) plus 60 MiB mapped
    assert a.reserved == 260 * MiB
    b = Allocator(expandable_segments=True)
    first = b.malloc(100 * MiB)
    b.malloc(100 * MiB)
    b.free(first)
    b.malloc(150 * MiB)  # the hole at the start cannot hold it: 160 MiB mapped at the end
    assert b.reserved == 360 * MiB
    b.malloc(90 * MiB)  # best fit: the 100 MiB hole, not the 10 MiB left at the end
    assert b.reserved == 360 * MiB


@pytest.mark.parametrize("expandable", [False, True])
def test_peaks_are_what_torch_reports(expandable):
    a = Allocator(expandable_segments=expandable)
    handles = [a.malloc(30 * MiB) for _ in range(3)]
    for h in handles:
        a.free(h)
    a.malloc(10 * MiB)
    assert a.peak_allocated == 90 * MiB and a.allocated == 10 * MiB
    assert a.peak_reserved == a.reserved == (100 * MiB if expandable else 90 * MiB)


def test_a_full_device_gets_the_cache_back_and_tries_again():
    """torch's retry (release_cached_blocks): wholly free cached segments are given back to make room."""
    a = Allocator(capacity=200 * MiB)
    a.free(a.malloc(100 * MiB))
    a.malloc(150 * MiB)  # 250 MiB would not fit: the free 100 MiB segment goes back first
    assert (a.reserved, a.peak_reserved, a.retries, a.shortfall) == (150 * MiB, 150 * MiB, 1, 0)
    b = Allocator(capacity=200 * MiB)
    b.malloc(100 * MiB)
    b.malloc(150 * MiB)  # nothing cached to give back: 50 MiB short
    assert (b.retries, b.shortfall) == (1, 50 * MiB)


def test_a_full_device_unmaps_the_free_pages_at_an_expandable_segments_end():
    a = Allocator(expandable_segments=True, capacity=200 * MiB)
    a.malloc(100 * MiB)
    a.free(a.malloc(90 * MiB))
    a.malloc(100 * MiB, "other stream")  # 100 + 100 mapped, 80 on the other stream: the free 90 MiB go back
    assert (a.reserved, a.retries, a.shortfall) == (200 * MiB, 1, 0)
    b = Allocator(expandable_segments=True, capacity=70 * MiB)
    b.free(b.malloc(60 * MiB))
    b.malloc(80 * MiB)  # the segment that grows keeps its free end (60 MiB) and lacks the page it maps past 70
    assert (b.reserved, b.retries, b.shortfall) == (80 * MiB, 1, 10 * MiB)
