"""PyTorch's native CUDA caching allocator (``DeviceCachingAllocator`` in
c10/cuda/CUDACachingAllocator.cpp), simulated on integers.

What it reproduces, rule by rule (names are the C++ functions):

- ``round_size``: 512-byte granularity, ``roundup_power2_divisions``;
- ``get_pool``: small pool for requests ≤ 1 MiB, large otherwise; one pool per stream;
- ``get_free_block``: best fit in (size, address) order within the stream; a request below
  ``max_split_size`` never takes an oversize block, an oversize request takes one only if it
  is less than ``max_non_split_rounding_mb`` larger;
- ``get_allocation_size``: 2 MiB small segments, ``large_segment_size`` (20 MiB) for large
  requests below 10 MiB, else the request rounded up to 2 MiB;
- ``should_split`` / ``alloc_found_block``: the small pool (and expandable segments) split off
  remainders ≥ 512 B, the large pool remainders > 1 MiB of requests below ``max_split_size``;
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours;
- ``garbage_collect_cached_blocks``: with a memory fraction and a threshold, unsplit cached
  large blocks older than average are released once reserved exceeds threshold × allowed;
- ``alloc_block`` → ``release_available_cached_blocks`` → ``release_cached_blocks`` (retry,
  ``num_alloc_retries``) → OOM (``num_ooms``) against a device ``capacity``;
- ``free`` with ``record_stream`` uses: the block stays active until its events complete
  (``synchronize`` here), and ``release_cached_blocks`` synchronises first;
- expandable segments: see :mod:`vramplan.allocator.expandable`;
- ``segment_addresses``: a recorded trace's cudaMalloc addresses, so that address-ordered
  ties break as they did on the GPU (:meth:`CachingAllocator._segment_address`).

- CUDA graphs' private pools: streams from :data:`~vramplan.allocator.constants.PRIVATE_POOL` up
  are pools like a stream's whose cached segments ``release_cached_blocks`` and garbage
  collection leave alone (a live graph's pool; a graph's destruction is not modelled).

Not simulated: user MemPools (``torch.cuda.MemPool``), free-memory callbacks, IPC. An OOM'd
request is counted and skipped (the caller would normally see OutOfMemoryError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vramplan.errors import ConfigError

from . import freelist
from .blocks import SHIFT, Block, Pool, Segment
from .config import AllocatorConfig, as_config
from .constants import NO_LIMIT, PRIVATE_POOL, SMALL_SIZE
from .counters import Counters
from .expandable import ExpandableSegmentsMixin
from .result import BlockInfo, SegmentInfo
from .sizes import allocation_size, round_size
from .vaspace import VA_LIMIT, VASpace


class CachingAllocator(Counters, ExpandableSegmentsMixin):
    """A stateful simulation of one device's caching allocator.

    ``malloc(size, stream) -> Block | None`` (None: out of memory, counted in ``num_ooms``),
    ``free(block, deferred=False)``, ``synchronize()``, ``empty_cache()``. Byte counters are
    public attributes: ``allocated``, ``active``, ``requested``, ``reserved``,
    ``inactive_split`` (current values) and ``max_*`` peaks for active/requested/segments.
    """

    def __init__(self, conf: AllocatorConfig | str | None = None, *, capacity: int | None = None,
                 record_segments: bool = False,
                 segment_addresses: Sequence[tuple[int, int]] | None = None) -> None:
        cfg = as_config(conf)
        if cfg.backend != "native":
            raise ConfigError(f"CachingAllocator simulates backend:native, not {cfg.backend}",
                              hint="use vramplan.allocator.replay(), which approximates it")
        if capacity is not None and capacity < 0:
            raise ConfigError(f"capacity must be >= 0 bytes, got {capacity}")
        self.conf = cfg
        self.capacity = capacity
        """Bytes cudaMalloc can hand out in total (None: unlimited)."""
        fraction = cfg.per_process_memory_fraction
        self.allowed: int | None = (int(fraction * capacity)
                                    if fraction < 1.0 and capacity is not None else None)
        """``allowed_memory_maximum`` (set when a memory fraction below 1 and a capacity are given)."""
        self._gc = cfg.garbage_collection_threshold > 0.0 and self.allowed is not None
        self._es = cfg.expandable_segments
        self._msplit = cfg.max_split_size
        self._nsr = cfg.max_non_split_rounding_size
        self._any_div = any(d > 1 for d in cfg.roundup_power2_divisions)
        self._small_pools: dict[int, Pool] = {}
        self._large_pools: dict[int, Pool] = {}
        self._free: dict[int, Block] = {}
        """Free mapped blocks by free-list key."""
        self._unmapped_blocks: dict[int, Block] = {}
        self._segments: dict[int, Segment] = {}
        self._pending: list[Block] = []
        self._va = VASpace()
        self._plan: list[tuple[int, int]] = []
        """(address, size) cudaMalloc returned, in order, reversed (see :meth:`_segment_address`)."""
        self._planned: set[int] = set()
        if segment_addresses and not cfg.expandable_segments:
            plan = list(segment_addresses)
            if all(0 < a and a + n <= VA_LIMIT and a % 512 == 0 for a, n in plan):
                self._plan = plan[::-1]
                self._va.reserve(min(a for a, _ in plan), max(a + n for a, n in plan))
        self._gc_calls = [0, 0]
        """get_free_blocks_call_count of the large [0] and small [1] pools."""
        self._init_counters(record_segments)

    # ------------------------------------------------------------------ public API
    def malloc(self, size: int, stream: int = 0) -> Block | None:
        """Allocate ``size`` requested bytes on ``stream``; None when out of memory."""
        orig = size
        if size <= 512:
            if size < 0:
                raise ValueError(f"malloc of a negative size ({size})")
            size = 512
        elif self._any_div:
            size = round_size(size, self.conf)
        else:
            size = (size + 511) & ~511
        small = size <= SMALL_SIZE
        pools = self._small_pools if small else self._large_pools
        pool = pools.get(stream)
        if pool is None:
            pool = pools[stream] = Pool(small, stream)
        if self._gc:
            self._gc_calls[small] += 1
        b: Block | None = None
        if self._es:
            b = self._get_free_block_es(pool, size)
        else:  # get_free_block, inlined: this is the hot path
            key = freelist.ge(pool.keys, size << SHIFT)
            if key >= 0:
                bsize = key >> SHIFT
                msplit = self._msplit
                if (bsize < msplit) if size < msplit else (bsize < size + self._nsr):
                    freelist.remove(pool.keys, key)
                    b = self._free.pop(key)
        if b is None:
            b = self._malloc_slow(pool, size, allocation_size(size, self.conf))
            if b is None:
                return None
        # should_split + alloc_found_block
        remaining = b.size - size
        if (remaining >= 512) if (small or self._es) else (size < self._msplit and remaining > SMALL_SIZE):
            already_split = b.prev is not None or b.next is not None
            nb = Block(b.addr, size, pool, b.seg)
            p = b.prev
            nb.prev = p
            if p is None:
                b.seg.head = nb
            else:
                p.next = nb
            nb.next = b
            b.prev = nb
            b.addr += size
            b.size = remaining
            key = (remaining << SHIFT) | b.addr
            freelist.add(pool, key)
            self._free[key] = b
            b.gc_base = self._gc_calls[small]
            if not self._es:
                if already_split:
                    self.inactive_split -= size
                else:
                    self.inactive_split += remaining
            b = nb
        elif not self._es and (b.prev is not None or b.next is not None):
            self.inactive_split -= b.size
        b.allocated = True
        b.req = orig
        bs = b.size
        self.allocated += bs
        a = self.active + bs
        self.active = a
        if a > self.max_active:
            self.max_active = a
        r = self.requested + orig
        self.requested = r
        if r > self.max_requested:
            self.max_requested = r
        return b

    def free(self, b: Block, deferred: bool = False) -> None:
        """Free a block. ``deferred``: it was used on another stream (``record_stream``), so
        it stays active (not reusable) until :meth:`synchronize` or :meth:`complete`."""
        b.allocated = False
        self.allocated -= b.size
        if deferred:
            b.events += 1
            self._pending.append(b)
            return
        self._free_block(b)

    def complete(self, b: Block) -> None:
        """The cross-stream events of one deferred free completed: the block becomes free."""
        if b.events:
            b.events = 0
            self._pending.remove(b)
            self._free_block(b)

    def synchronize(self) -> None:
        """All pending cross-stream events complete (``synchronize_and_free_events``)."""
        pending, self._pending = self._pending, []
        for b in pending:
            b.events = 0
            self._free_block(b)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every fully free cached segment (and, with
        expandable segments, unmap every free page)."""
        self._release_cached_blocks()

    @property
    def segment_count(self) -> int:
        return self.num_segments

    def snapshot(self, label: Callable[[int], str] | None = None) -> tuple[SegmentInfo, ...]:
        """The segments and their blocks, as ``torch.cuda.memory._snapshot()`` lists them,
        sorted by address. ``label(event_index)`` names a block's category."""
        out: list[SegmentInfo] = []
        for seg in self._segments.values():
            pool = seg.pool
            run: list[BlockInfo] = []
            b = seg.head
            while b is not None:
                if b.mapped:
                    run.append(_block_info(b, label))
                elif run:
                    out.append(_segment_info(run, pool, seg.expandable))
                    run = []
                b = b.next
            if run:
                out.append(_segment_info(run, pool, seg.expandable))
        out.sort(key=lambda s: s.addr)
        return tuple(out)

    # ------------------------------------------------------------------ internals
    def _insert_free(self, b: Block) -> None:
        """``BlockPool::insert_into_blocks``."""
        key = (b.size << SHIFT) | b.addr
        freelist.add(b.pool, key)
        self._free[key] = b
        b.gc_base = self._gc_calls[b.pool.small]

    def _remove_free(self, b: Block) -> None:
        key = (b.size << SHIFT) | b.addr
        freelist.remove(b.pool.keys, key)
        del self._free[key]

    def _free_block(self, b: Block) -> None:
        """``free_block``: merge with free neighbours and return to the pool."""
        orig_size = b.size
        pool = b.pool
        keys = pool.keys
        free = self._free
        net = 0
        p = b.prev
        if p is not None and not p.allocated and not p.events and p.mapped:
            key = (p.size << SHIFT) | p.addr
            freelist.remove(keys, key)
            del free[key]
            b.addr = p.addr
            b.size += p.size
            net -= p.size
            pp = p.prev
            b.prev = pp
            if pp is None:
                b.seg.head = b
            else:
                pp.next = b
        n = b.next
        if n is not None and not n.allocated and not n.events and n.mapped:
            key = (n.size << SHIFT) | n.addr
            freelist.remove(keys, key)
            del free[key]
            b.size += n.size
            net -= n.size
            nn = n.next
            b.next = nn
            if nn is not None:
                nn.prev = b
        key = (b.size << SHIFT) | b.addr
        freelist.add(pool, key)
        free[key] = b
        b.gc_base = self._gc_calls[pool.small]
        if not self._es:
            if b.prev is not None or b.next is not None:
                net += b.size
            self.inactive_split += net
        self.active -= orig_size
        self.requested -= b.req
        b.req = 0

    def _malloc_slow(self, pool: Pool, size: int, alloc_size: int) -> Block | None:
        """No cached block fits: GC, cudaMalloc, then the two release-and-retry steps."""
        if self._gc:
            self._garbage_collect()
        b = self._alloc_block(pool, size, alloc_size, False)
        if b is None and self._release_available_cached_blocks(pool, size):
            b = self._alloc_block(pool, size, alloc_size, False)
        if b is None:
            self._release_cached_blocks()
            b = self._alloc_block(pool, size, alloc_size, True)
        if b is None:
            self.num_ooms += 1
        return b

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, retry: bool) -> Block | None:
        """``alloc_block``: a new segment from cudaMalloc (or mapped expandable pages)."""
        if retry:
            self.num_alloc_retries += 1
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self._es:
            return self._try_allocate_expandable(pool, size)
        if self.capacity is not None and self.reserved + alloc_size > self.capacity:
            return None
        addr = self._segment_address(alloc_size)
        seg = Segment(addr, alloc_size, pool, False)
        b = Block(addr, alloc_size, pool, seg)
        seg.head = b
        self._segments[addr] = seg
        self.reserved += alloc_size
        self.num_segments += 1
        if self.num_segments > self.max_segments:
            self.max_segments = self.num_segments
        self._record("segment_alloc", addr, alloc_size, pool.stream)
        return b

    def _segment_address(self, size: int) -> int:
        """Where cudaMalloc puts a new segment. Real addresses cannot be predicted, but a
        recorded trace has them (``segment_addresses``): while the simulated segments follow the
        recording (same sizes, in order) they get the recorded addresses, so that best-fit ties
        between equal blocks of different segments break as they did on the GPU (PyTorch's free
        lists order by size, then address). At the first difference (another size, or an
        address the simulation still holds) the plan is dropped and addresses come from the
        simulated range, which keeps clear of the recorded ones."""
        plan = self._plan
        if plan:
            addr, n = plan.pop()
            end = addr + n
            if n == size and not any(s.base < end and addr < s.base + s.size for s in self._segments.values()):
                self._planned.add(addr)
                return addr
            plan.clear()
        return self._va.alloc(size)

    def _release_block(self, b: Block) -> None:
        """``release_block``: cudaFree an unsplit cached segment."""
        self._remove_free(b)
        self.reserved -= b.size
        self.num_segments -= 1
        del self._segments[b.addr]
        if b.addr in self._planned:
            self._planned.discard(b.addr)
        else:
            self._va.free(b.addr, b.size)
        self._record("segment_free", b.addr, b.size, b.pool.stream)

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        """Free one oversize cached block big enough, or several, largest first, until their
        total reaches the request (only with ``max_split_size``; never expandable blocks)."""
        msplit = self._msplit
        if msplit == NO_LIMIT or self._es:
            return False
        target = size if size >= msplit else msplit
        keys = pool.keys
        key = freelist.ge(keys, target << SHIFT)
        if key >= 0:
            self._release_block(self._free[key])
            return True
        released = 0
        key = freelist.lt(pool.keys, target << SHIFT)
        while released < target and key >= 0:
            b = self._free[key]
            if b.size < msplit:
                break
            released += b.size
            self._release_block(b)
            key = freelist.lt(pool.keys, key)
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: complete pending frees, then release every unsplit cached
        block (large pools first, each in (stream, size, address) order)."""
        self.synchronize()
        for pools in (self._large_pools, self._small_pools):
            to_unmap: list[Block] = []
            for stream in sorted(pools):
                if stream >= PRIVATE_POOL:  # a CUDA graph's private pool keeps its memory
                    continue
                for key in list(pools[stream].keys):
                    b = self._free[key]
                    if b.seg.expandable:
                        to_unmap.append(b)
                    elif b.prev is None and b.next is None:
                        self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)
                if b.prev is None and b.next is None:
                    self._release_expandable_segment(b)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: release unsplit cached large blocks of above-
        average age until reserved is back under threshold × allowed."""
        assert self.allowed is not None
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        count_now = self._gc_calls[0]

        def blocks() -> list[Block]:
            return [self._free[k] for s in sorted(self._large_pools) if s < PRIVATE_POOL
                    for k in self._large_pools[s].keys]

        freeable = [b for b in blocks() if b.prev is None and b.next is None]
        count = len(freeable)
        if not count:
            return
        total_age = sum(count_now - b.gc_base for b in freeable)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in blocks():
                age = count_now - b.gc_base
                if b.prev is None and b.next is None and not b.seg.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)


def _block_info(b: Block, label: Callable[[int], str] | None) -> BlockInfo:
    if b.allocated:
        state = "active_allocated"
    elif b.events:
        state = "active_pending_free"
    else:
        state = "inactive"
    live = state != "inactive"
    category = label(b.ev) if (label is not None and live and b.ev >= 0) else ""
    return BlockInfo(b.addr, b.size, b.req if live else 0, state, category, b.ev if live else -1)


def _segment_info(blocks: list[BlockInfo], pool: Pool, expandable: bool) -> SegmentInfo:
    return SegmentInfo(blocks[0].addr, sum(x.size for x in blocks), pool.stream, pool.name,
                       expandable, tuple(blocks))
