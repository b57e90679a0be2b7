"""``backend:cudaMallocAsync``, approximated.

CUDA's stream-ordered pool (``cudaMallocAsync``) places blocks itself; its placement and
fragmentation are not documented, so there is no block/segment model here. PyTorch sets the
pool's release threshold to the maximum, so the pool keeps what it grew to until
``empty_cache`` trims it. The approximation:

- allocated/active/requested count requested bytes exactly (PyTorch's async backend does not
  round);
- reserved is the high-water mark of active bytes rounded up to 2 MiB (the driver's
  allocation granularity), trimmed back to the current active bytes by ``empty_cache``;
- with a capacity, a request that would push reserved past it first triggers a sync + trim
  and one retry (``num_alloc_retries``), then counts as an OOM and is skipped.

Expect reserved to be a lower bound: the real pool fragments too.
"""

from __future__ import annotations

from .config import AllocatorConfig, as_config
from .counters import Counters
from .result import SegmentInfo

GRANULE = 2 * 1024 * 1024


def _granules(n: int) -> int:
    return -(-n // GRANULE) * GRANULE


class AsyncBlock:
    __slots__ = ("size", "req", "events", "ev")

    def __init__(self, size: int) -> None:
        self.size = size
        self.req = size
        self.events = 0
        self.ev = -1


class MallocAsyncApprox(Counters):
    """Same interface as :class:`~vramplan.allocator.native.CachingAllocator`."""

    def __init__(self, conf: AllocatorConfig | str | None = None, *, capacity: int | None = None,
                 record_segments: bool = False) -> None:
        self.conf = as_config(conf)
        self.capacity = capacity
        self._init_counters(record_segments)
        self._pending: list[AsyncBlock] = []

    def malloc(self, size: int, stream: int = 0) -> AsyncBlock | None:
        need = _granules(self.active + size)
        if self.capacity is not None and need > self.capacity:
            self.num_alloc_retries += 1
            self.empty_cache()
            if _granules(self.active + size) > self.capacity:
                self.num_ooms += 1
                return None
        b = AsyncBlock(size)
        self.allocated += size
        self.active += size
        self.requested += size
        self.max_active = max(self.max_active, self.active)
        self.max_requested = self.max_active
        if need > self.reserved:
            self.reserved = need
            self.num_segments = self.max_segments = 1
        return b

    def free(self, b: AsyncBlock, deferred: bool = False) -> None:
        self.allocated -= b.size
        if deferred:
            b.events = 1
            self._pending.append(b)
            return
        self.active -= b.size
        self.requested -= b.size

    def complete(self, b: AsyncBlock) -> None:
        if b.events:
            b.events = 0
            self._pending.remove(b)
            self.active -= b.size
            self.requested -= b.size

    def synchronize(self) -> None:
        pending, self._pending = self._pending, []
        for b in pending:
            b.events = 0
            self.active -= b.size
            self.requested -= b.size

    def empty_cache(self) -> None:
        self.synchronize()
        self.reserved = _granules(self.active)
        self.num_segments = 1 if self.reserved else 0

    @property
    def segment_count(self) -> int:
        return self.num_segments

    def snapshot(self, label: object = None) -> tuple[SegmentInfo, ...]:
        return ()
