"""The caching-allocator replay against PyTorch's rules, on sequences counted by hand."""

from __future__ import annotations

from capopt.validation.caching_allocator import (CachingAllocator, allocation_size, replay,
                                                 round_size)

MiB = 1 << 20
KiB = 1 << 10


def test_rounding_and_segment_sizes_follow_the_allocator():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert allocation_size(MiB) == 2 * MiB                  # small pool: a 2 MiB segment
    assert allocation_size(MiB + 512) == 20 * MiB           # large, under 10 MiB: 20 MiB
    assert allocation_size(10 * MiB) == 10 * MiB            # 10 MiB and up: rounded to 2 MiB
    assert allocation_size(10 * MiB + 1) == 12 * MiB


def test_large_blocks_split_share_a_segment_and_merge_back():
    a = CachingAllocator()
    x = a.malloc(3 * MiB)                  # a new 20 MiB segment, split (17 MiB > 1 MiB left)
    y = a.malloc(5 * MiB)                  # fits the 17 MiB remainder
    assert a.reserved == 20 * MiB and a.segments == 1
    assert a.allocated == 8 * MiB
    a.free(x)
    a.free(y)                              # merged back into one 20 MiB free block
    z = a.malloc(19 * MiB + 512 * KiB)     # fits; 0.5 MiB left is not split (<= 1 MiB)
    assert a.reserved == 20 * MiB
    assert a.allocated == 20 * MiB         # the whole block is the allocation
    a.free(z)
    assert a.allocated == 0


def test_small_pool_packs_2_mib_segments():
    a = CachingAllocator()
    blocks = [a.malloc(100 * KiB) for _ in range(20)]     # 20 x 100 KiB fit in 2 MiB
    assert a.reserved == 2 * MiB
    a.malloc(100 * KiB)                                   # the 21st opens a second segment
    assert a.reserved == 4 * MiB
    assert len(blocks) == 20


def test_a_freed_block_too_small_for_the_next_request_is_fragmentation():
    a = CachingAllocator()
    x = a.malloc(12 * MiB)
    a.malloc(12 * MiB)
    a.free(x)
    a.malloc(14 * MiB)                     # the free 12 MiB segment cannot hold it
    assert a.reserved == 38 * MiB
    assert a.peak_allocated == 26 * MiB


def test_expandable_segments_grow_by_pages():
    a = CachingAllocator(expandable_segments=True)
    a.malloc(3 * MiB)
    assert a.reserved == 20 * MiB          # one 20 MiB page of the large pool
    a.malloc(25 * MiB)                     # the segment grows to 28 MiB: two pages
    assert a.reserved == 40 * MiB
    a.malloc(100 * KiB)                    # the small pool maps its own 2 MiB page
    assert a.reserved == 42 * MiB


def test_replay_reuses_the_cache_on_the_second_step():
    # before the step: 40 MiB of parameters; the step: 30 MiB then 10 MiB, both freed
    events = [(1, 0, 40 * MiB), (1, 1, 30 * MiB), (1, 2, 10 * MiB), (-1, 1, 0), (-1, 2, 0)]
    r = replay(events, start=1, passes=2)
    assert r["reserved_after_pass1"] == 80 * MiB
    assert r["reserved_after_pass2"] == 80 * MiB          # the cached blocks serve it again
    assert r["peak_allocated_bytes"] == 80 * MiB
    # a storage resized in place to 0 and back (FSDP2's unsharded parameters)
    events = [(1, 0, 12 * MiB), (0, 0, 0), (0, 0, 12 * MiB)]
    r = replay(events, start=1, passes=1)
    assert r["reserved_after_pass1"] == 12 * MiB


def test_expandable_segments_reuse_the_mapped_tail_and_holes():
    """The mapped range past a request is a free block (``map_block``): a later request
    that fits it, or a freed hole, takes no new page."""
    a = CachingAllocator(expandable_segments=True)
    x = a.malloc(3 * MiB)
    a.malloc(14 * MiB + 512 * KiB)        # 17.5 MiB used of one 20 MiB page
    a.free(x)                             # a 3 MiB hole at the start
    a.malloc(2 * MiB)                     # fits the 2.5 MiB left at the end, or the hole
    a.malloc(3 * MiB)                     # fits what is left of those
    assert a.reserved == 20 * MiB


def test_a_resize_between_two_sizes_holds_both_while_it_copies():
    r = replay([(1, 0, 8 * MiB), (0, 0, 9 * MiB)], start=0, passes=1)
    assert r["peak_allocated_bytes"] == 8 * MiB + 9 * MiB
