"""Simulated virtual addresses for segments.

Real cudaMalloc addresses cannot be predicted; what matters is that segments get distinct,
aligned, reusable address ranges so that the allocator's address-ordered rules (best-fit ties,
expandable-segment "lowest address" mapping) have something concrete to order. Freed ranges
are reused first-fit, lowest address first, like a typical driver heap.
"""

from __future__ import annotations

from bisect import bisect_left

from vramplan.errors import WorkloadError

VA_BASE = 1 << 32
"""First simulated address (4 GiB), so that no segment sits at 0."""
VA_LIMIT = 1 << 47
"""All simulated addresses stay below 2**47 (free-list keys pack ``size << 47 | addr``)."""
ALIGN = 2 * 1024 * 1024


class VASpace:
    """First-fit allocator of aligned address ranges, with coalescing of freed ranges."""

    __slots__ = ("_starts", "_sizes", "_top", "_limit")

    def __init__(self) -> None:
        self._starts: list[int] = []  # free ranges, sorted by start
        self._sizes: list[int] = []
        self._top = VA_BASE
        self._limit = VA_LIMIT

    def alloc(self, size: int) -> int:
        size = -(-size // ALIGN) * ALIGN
        for k, (start, avail) in enumerate(zip(self._starts, self._sizes, strict=True)):
            if avail >= size:
                if avail == size:
                    del self._starts[k], self._sizes[k]
                else:
                    self._starts[k] = start + size
                    self._sizes[k] = avail - size
                return start
        addr = self._top
        if addr + size > self._limit:
            raise WorkloadError(
                f"the simulated allocator ran out of address space ({VA_LIMIT - VA_BASE:,} B, about 128 TiB): "
                "the step reserves more memory than any GPU has",
                hint="check the sizes (`batch`, `seq`, `image_size`, or the event sizes)",
            )
        self._top = addr + size
        return addr

    def reserve(self, lo: int, hi: int) -> None:
        """Keep ``[lo, hi)`` out of the ranges handed out (addresses taken elsewhere): new
        ranges go above it when at least 4 TiB remain there, else below it. Call it first."""
        room = 1 << 42
        floor = -(-hi // ALIGN) * ALIGN
        if floor + room <= self._limit:
            self._top = max(self._top, floor)
        else:
            self._limit = min(self._limit, lo)

    def free(self, addr: int, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        k = bisect_left(self._starts, addr)
        # coalesce with the following range, then with the preceding one
        if k < len(self._starts) and addr + size == self._starts[k]:
            size += self._sizes[k]
            del self._starts[k], self._sizes[k]
        if k > 0 and self._starts[k - 1] + self._sizes[k - 1] == addr:
            self._sizes[k - 1] += size
            start, size = self._starts[k - 1], self._sizes[k - 1]
            del self._starts[k - 1], self._sizes[k - 1]
            k -= 1
            addr = start
        if addr + size == self._top:  # give the tail back to the bump pointer
            self._top = addr
            return
        self._starts.insert(k, addr)
        self._sizes.insert(k, size)
