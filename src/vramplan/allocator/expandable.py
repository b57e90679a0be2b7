"""``expandable_segments:True`` (Note [Expandable Segments] in CUDACachingAllocator.cpp).

One virtual range per (stream, pool), as large as 9/8 of the device memory, whose pages are
mapped on demand: 2 MiB pages in the small pool, ``large_segment_size`` (20 MiB) pages in the
large pool. ``find_expandable_block`` looks for the *lowest address* where free and unmapped
space together fit the request; ``map_block`` maps the pages covering it (``segment_map``) and
merges the new range with free neighbours. Every split keeps remainders ≥ 512 B. Releasing
(``empty_cache``, the OOM path) unmaps the whole pages inside each free block
(``segment_unmap``); a range left entirely unmapped is given back. ``get_free_block`` prefers,
among blocks that fit, one that cannot grow into unmapped space.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from . import freelist
from .blocks import SHIFT, Block, Pool, Segment
from .constants import SMALL_BUFFER

if TYPE_CHECKING:
    from .config import AllocatorConfig
    from .vaspace import VASpace

DEFAULT_VA = 1 << 40
"""Virtual range of an expandable segment when no capacity is given (1 TiB: never limiting)."""


def _allocatable(b: Block | None) -> bool:
    return b is not None and not b.allocated and not b.events


def _expandable_size(b: Block) -> int:
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


class ExpandableSegmentsMixin:
    """The expandable-segment half of :class:`~vramplan.allocator.native.CachingAllocator`."""

    conf: AllocatorConfig
    capacity: int | None
    reserved: int
    num_segments: int
    max_segments: int
    _free: dict[int, Block]
    _unmapped_blocks: dict[int, Block]
    _segments: dict[int, Segment]
    _va: VASpace
    _msplit: int
    _nsr: int

    def _record(self, action: str, addr: int, size: int, stream: int) -> None: ...
    def _insert_free(self, b: Block) -> None: ...
    def _remove_free(self, b: Block) -> None: ...

    # ---------------------------------------------------------------- free-list search
    def _get_free_block_es(self, pool: Pool, size: int) -> Block | None:
        """``get_free_block`` with the expandable rule: walk to larger blocks while their
        expandable size (own size + unmapped space after them) is smaller."""
        keys = pool.keys
        key = freelist.ge(keys, size << SHIFT)
        if key < 0:
            return None
        free = self._free
        b = free[key]
        e = _expandable_size(b)
        while (nk := freelist.ge(keys, key + 1)) >= 0:
            nb = free[nk]
            ne = _expandable_size(nb)
            if ne >= e:
                break
            key, b, e = nk, nb, ne
        msplit = self._msplit
        if size < msplit and b.size >= msplit:
            return None
        if size >= msplit and b.size >= size + self._nsr:
            return None
        freelist.remove(keys, key)
        del free[key]
        return b

    # ---------------------------------------------------------------- unmapped bookkeeping
    def _add_unmapped(self, b: Block) -> None:
        insort(b.pool.unmapped, b.addr)
        self._unmapped_blocks[b.addr] = b

    def _remove_unmapped(self, b: Block) -> None:
        lst = b.pool.unmapped
        del lst[bisect_left(lst, b.addr)]
        del self._unmapped_blocks[b.addr]

    def _try_merge(self, dst: Block, src: Block | None) -> int:
        """``try_merge_blocks`` for blocks of the same kind (both mapped or both unmapped)."""
        if src is None or src.allocated or src.events or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            self._remove_free(src)
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if src.prev is None:
                dst.seg.head = dst
            else:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size
        return src.size

    # ---------------------------------------------------------------- mapping
    def _va_size(self, page: int) -> int:
        total = self.capacity if self.capacity is not None else DEFAULT_VA * 8 // 9
        return -(-(total + total // 8) // page) * page

    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        """The lowest-addressed run of free + unmapped blocks with ``size`` bytes of room;
        a new virtual range when there is none."""
        for addr in pool.unmapped:
            c = self._unmapped_blocks[addr]
            if _allocatable(c.prev):
                assert c.prev is not None
                c = c.prev
            room = 0
            x: Block | None = c
            while room < size and x is not None and _allocatable(x):
                room += x.size
                x = x.next
            if room >= size:
                return c
        page = SMALL_BUFFER if pool.small else self.conf.large_segment_size
        va = self._va_size(page)
        base = self._va.alloc(va)
        seg = Segment(base, va, pool, True, page)
        c = Block(base, va, pool, seg, mapped=False)
        seg.head = c
        self._segments[base] = seg
        self._add_unmapped(c)
        return c

    def _map_block(self, to_map: Block, size: int) -> bool:
        """``map_block``: map the pages covering [addr, addr + size) of an unmapped block."""
        seg = to_map.seg
        page, base = seg.page, seg.base
        begin = (to_map.addr - base) // page
        end = -(-(to_map.addr + size - base) // page)
        nbytes = (end - begin) * page
        if nbytes == 0 or (self.capacity is not None and self.reserved + nbytes > self.capacity):
            return False
        self._remove_unmapped(to_map)
        to_map.mapped = True
        addr = to_map.addr
        if nbytes < to_map.size:
            rest = Block(addr + nbytes, to_map.size - nbytes, to_map.pool, seg, mapped=False)
            _link_after(to_map, rest)
            self._add_unmapped(rest)
            to_map.size = nbytes
        left = to_map.prev is not None and to_map.prev.mapped
        right = to_map.next is not None and to_map.next.mapped
        self._count_runs(1 - left - right)
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        self._insert_free(to_map)
        self.reserved += nbytes
        self._record("segment_map", addr, nbytes, to_map.pool.stream)
        return True

    def _try_allocate_expandable(self, pool: Pool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map pages until a free block of ``size`` exists."""
        c = self._find_expandable_block(pool, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nc = c.next
            assert nc is not None and not nc.mapped
            if not self._map_block(nc, min(size - c.size, nc.size)):
                return None
            c = nc
        self._remove_free(c)
        return c

    def _unmap_block(self, b: Block) -> None:
        """``unmap_block``: unmap the whole pages inside a free block."""
        seg = b.seg
        page, base = seg.page, seg.base
        begin = -(-(b.addr - base) // page)
        end = (b.addr + b.size - base) // page
        if begin >= end:
            return
        self._remove_free(b)
        start = base + begin * page
        nbytes = (end - begin) * page
        before = start - b.addr
        after = b.size - before - nbytes
        if before > 0:
            bf = Block(b.addr, before, b.pool, seg)
            bf.prev = b.prev
            bf.next = b
            if b.prev is None:
                seg.head = bf
            else:
                b.prev.next = bf
            b.prev = bf
            self._insert_free(bf)
        if after > 0:
            af = Block(start + nbytes, after, b.pool, seg)
            _link_after(b, af)
            self._insert_free(af)
        b.addr = start
        b.size = nbytes
        b.mapped = False
        left = b.prev is not None and b.prev.mapped
        right = b.next is not None and b.next.mapped
        self._count_runs(left + right - 1)
        self._try_merge(b, b.prev)
        self._try_merge(b, b.next)
        self._add_unmapped(b)
        self.reserved -= nbytes
        self._record("segment_unmap", start, nbytes, b.pool.stream)

    def _release_expandable_segment(self, b: Block) -> None:
        """Give back a virtual range that is entirely unmapped (no trace event in PyTorch)."""
        seg = b.seg
        self._remove_unmapped(b)
        del self._segments[seg.base]
        self._va.free(seg.base, seg.size)

    def _count_runs(self, delta: int) -> None:
        """Keep ``num_segments`` = number of contiguous mapped ranges (what a snapshot lists)."""
        self.num_segments += delta
        if self.num_segments > self.max_segments:
            self.max_segments = self.num_segments


def _link_after(b: Block, nb: Block) -> None:
    """Insert ``nb`` right after ``b`` in its segment's address-ordered block list."""
    nb.prev = b
    nb.next = b.next
    if b.next is not None:
        b.next.prev = nb
    b.next = nb
