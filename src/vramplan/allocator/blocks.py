"""The allocator's data: blocks (``struct Block``), segments and per-stream pools.

Speed matters (a replay handles millions of events), so these are ``__slots__`` classes with
public fields, and a pool's free list is sorted integer keys ``size << SHIFT | addr`` searched
with :mod:`bisect` (:mod:`.freelist`): that is PyTorch's ``std::set<Block*, BlockComparatorSize>``
order (size, then address) for one stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .freelist import Keys

SHIFT: Final = 47
"""Free-list keys are ``size << SHIFT | addr``; simulated addresses stay below 2**SHIFT."""
ADDR_MASK = (1 << SHIFT) - 1


class Segment:
    """A cudaMalloc'd segment, or the virtual range of one expandable segment."""

    __slots__ = ("base", "size", "pool", "expandable", "page", "head")

    def __init__(self, base: int, size: int, pool: Pool, expandable: bool, page: int = 0) -> None:
        self.base = base
        self.size = size
        """Bytes (for an expandable segment: its whole virtual range, mapped or not)."""
        self.pool = pool
        self.expandable = expandable
        self.page = page
        """Mapping granularity of an expandable segment (2 MiB small pool, 20 MiB large)."""
        self.head: Block | None = None
        """The lowest-addressed block (kept up to date on splits and merges)."""


class Block:
    """One contiguous range of a segment: allocated, free (cached), or unmapped."""

    __slots__ = ("addr", "size", "req", "pool", "seg", "allocated", "mapped", "events",
                 "prev", "next", "gc_base", "ev")

    def __init__(self, addr: int, size: int, pool: Pool, seg: Segment, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.req = 0
        """Requested bytes of the current allocation."""
        self.pool = pool
        self.seg = seg
        self.allocated = False
        self.mapped = mapped
        self.events = 0
        """Outstanding cross-stream uses (``record_stream``): freed but not yet reusable."""
        self.prev: Block | None = None
        self.next: Block | None = None
        self.gc_base = 0
        """The pool's get_free_block call count when the block became free (GC age)."""
        self.ev = -1
        """Event-log index of the allocation (set by the replay when it records segments)."""

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def key(self) -> int:
        return (self.size << SHIFT) | self.addr

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        state = "alloc" if self.allocated else ("pending" if self.events else
                                                ("free" if self.mapped else "unmapped"))
        return f"Block({self.addr:#x}, {self.size}, {state})"


class Pool:
    """Free blocks of one (small|large, stream): PyTorch's BlockPool restricted to a stream."""

    __slots__ = ("small", "stream", "keys", "unmapped")

    def __init__(self, small: bool, stream: int) -> None:
        self.small = small
        self.stream = stream
        self.keys: Keys = []
        """Sorted free-list keys of mapped free blocks (a plain list, or :class:`.freelist.Blocked`
        once long)."""
        self.unmapped: list[int] = []
        """Sorted addresses of unmapped blocks (expandable segments only)."""

    @property
    def name(self) -> str:
        return "small" if self.small else "large"
