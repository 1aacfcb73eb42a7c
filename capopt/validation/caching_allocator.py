"""PyTorch's CUDA caching allocator, replayed: what an allocation sequence reserves.

The rules of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.5 to main; read in pytorch/pytorch
and a current fork) with their defaults (no ``PYTORCH_CUDA_ALLOC_CONF``), one stream:

- every request is rounded up to a multiple of ``MIN_BLOCK`` = 512 bytes (``round_size``;
  ``roundup_power2_divisions`` is off by default);
- a rounded size up to ``SMALL_SIZE`` = 1 MiB is served from the small pool, anything larger
  from the large pool (``get_pool``);
- a request no free block can hold gets a new segment (``cudaMalloc``) of
  ``get_allocation_size``: 2 MiB (``kSmallBuffer``) in the small pool, 20 MiB (``kLargeBuffer``)
  for large requests under 10 MiB (``kMinLargeAlloc``), else the size rounded up to 2 MiB
  (``kRoundLarge``);
- a free block is chosen by best fit: the smallest free block of the pool at least as large,
  the lowest address among equals (``get_free_block`` over blocks ordered by size then
  address; ``max_split_size`` is unlimited by default, so its oversize rules never apply);
- a chosen block is split when the remainder is at least 512 bytes in the small pool, more
  than 1 MiB in the large pool (``should_split``), the request taking the front;
- a freed block merges with free neighbours in its segment (``free_block`` /
  ``try_merge_blocks``);
- segments are never returned (``cudaFree`` only on an out-of-memory retry or
  ``empty_cache``): reserved memory is the sum of the segments, and only grows.

With ``expandable_segments`` each pool is one segment that grows at its end in pages of
2 MiB (small pool) or 20 MiB (large pool), every split is allowed (remainder >= 512 bytes),
and a free block at the end counts the unmapped space after it; reserved is the mapped pages.

`replay(events)` takes the torch tier's sequence (`capopt.validation.torch_memory.LiveBytes`:
``(+1, id, bytes)``, ``(-1, id, bytes)``, ``(0, id, bytes)`` for a storage resized in place)
and returns the peaks of allocated (block) bytes and of reserved bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize
SMALL_BUFFER = 2 << 20          # kSmallBuffer
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
LARGE_BUFFER = 20 << 20         # kLargeBuffer
ROUND_LARGE = 2 << 20           # kRoundLarge


def round_size(size: int) -> int:
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment a rounded request that fits no free block gets (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    small: bool
    addr: int
    size: int
    free: bool = True
    prev: "_Block | None" = field(default=None, repr=False)
    next: "_Block | None" = field(default=None, repr=False)


class _Pool:
    def __init__(self, small: bool):
        self.small = small
        self.free: list[tuple[int, int]] = []               # (size, order), sorted
        self.by_key: dict[tuple[int, int], _Block] = {}
        self.page = SMALL_BUFFER if small else LARGE_BUFFER
        self.mapped = 0                                      # expandable: mapped bytes
        self.tail: _Block | None = None                      # expandable: the last block

    @staticmethod
    def _key(b: _Block) -> tuple[int, int]:
        return (b.size, b.addr)

    def insert(self, b: _Block) -> None:
        key = self._key(b)
        bisect.insort(self.free, key)
        self.by_key[key] = b

    def remove(self, b: _Block) -> None:
        key = self._key(b)
        del self.free[bisect.bisect_left(self.free, key)]
        del self.by_key[key]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.free, (size, -1))
        return self.by_key[self.free[i]] if i < len(self.free) else None


class CachingAllocator:
    """One device's caching allocator, one stream; sizes in bytes. Blocks get distinct
    addresses (each segment at its own base), so best fit's tie-break is by address."""

    def __init__(self, expandable_segments: bool = False):
        self.expandable = expandable_segments
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.next_base = 0
        self.segments = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0
        self.peak_allocated = 0

    def _split_ok(self, pool: _Pool, remaining: int) -> bool:
        if pool.small or self.expandable:
            return remaining >= MIN_BLOCK
        return remaining > SMALL_SIZE

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        alloc = allocation_size(size)
        self.segments += 1
        self.reserved += alloc
        base, self.next_base = self.next_base, self.next_base + alloc
        return _Block(small=pool.small, addr=base, size=alloc)

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Expandable: a block at the pool's end (a free last block is extended), mapping
        whole pages as needed. Each pool's segment starts at its own base."""
        base = 0 if pool.small else 1 << 60
        tail = pool.tail
        if tail is not None and tail.free:
            pool.remove(tail)
            blk = tail
        else:
            start = base if tail is None else tail.addr + tail.size
            blk = _Block(small=pool.small, addr=start, size=0, prev=tail)
            if tail is not None:
                tail.next = blk
            pool.tail = blk
        need = blk.addr - base + size
        if need > pool.mapped:
            pages = -(-(need - pool.mapped) // pool.page)
            pool.mapped += pages * pool.page
            self.reserved += pages * pool.page
        # the whole mapped range after the block's start is one block (``map_block``); the
        # split in `malloc` returns what the request does not use to the free list
        blk.size = base + pool.mapped - blk.addr
        return blk

    def malloc(self, nbytes: int) -> _Block | None:
        if nbytes <= 0:
            return None              # a zero-byte storage asks the allocator for nothing
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        blk = pool.best_fit(size)
        if blk is not None:
            pool.remove(blk)
        elif self.expandable:
            blk = self._grow(pool, size)
        else:
            blk = self._new_segment(pool, size)
        remaining = blk.size - size
        if remaining and self._split_ok(pool, remaining):
            rest = _Block(small=pool.small, addr=blk.addr + size, size=remaining, prev=blk,
                          next=blk.next)
            if blk.next is not None:
                blk.next.prev = rest
            blk.next = rest
            blk.size = size
            if pool.tail is blk:
                pool.tail = rest
            pool.insert(rest)
        blk.free = False
        self.allocated += blk.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return blk

    @staticmethod
    def _join(pool: _Pool, left: _Block, right: _Block) -> _Block:
        """One block from two neighbours, ``left`` first; returns it."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        if pool.tail is right:
            pool.tail = left
        return left

    def free(self, blk: _Block | None) -> None:
        if blk is None:
            return
        pool = self.pools[blk.small]
        self.allocated -= blk.size
        blk.free = True
        prev = blk.prev
        if prev is not None and prev.free:
            pool.remove(prev)                   # (listed by its size, which changes)
            blk = self._join(pool, prev, blk)
        nxt = blk.next
        if nxt is not None and nxt.free:
            pool.remove(nxt)
            blk = self._join(pool, blk, nxt)
        pool.insert(blk)


def replay(events, *, start: int = 0, expandable_segments: bool = False,
           passes: int = 2) -> dict[str, int]:
    """Peaks of a tier's allocation sequence through the caching allocator: ``events[:start]``
    (what exists before the step: parameters, optimizer state) once, then the step's events
    ``passes`` times (the first warms the cache, as the steps before a steady one do; a
    storage the step leaves alive is freed when the next step makes it again)."""
    alloc = CachingAllocator(expandable_segments)
    blocks: dict[int, _Block | None] = {}

    def run(evs) -> None:
        for sign, sid, nbytes in evs:
            old = blocks.pop(sid, None)
            if sign == 0 and nbytes and old is not None:
                # a resize from one size to another allocates, copies, then frees
                blocks[sid] = alloc.malloc(nbytes)
                alloc.free(old)
                continue
            alloc.free(old)
            if sign > 0 or (sign == 0 and nbytes):
                blocks[sid] = alloc.malloc(nbytes)

    run(events[:start])
    out: dict[str, int] = {}
    for k in range(passes):
        run(events[start:])
        out[f"reserved_after_pass{k + 1}"] = alloc.reserved
    out.update(peak_allocated_bytes=alloc.peak_allocated, peak_reserved_bytes=alloc.peak_reserved,
               segments=alloc.segments)
    return out


__all__ = ["CachingAllocator", "allocation_size", "replay", "round_size"]
