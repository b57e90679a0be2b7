"""Property tests: random allocation sequences keep the allocator's state consistent."""

from __future__ import annotations

import bisect

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.allocator import CachingAllocator, replay
from vramplan.allocator.blocks import SHIFT
from vramplan.allocator.check import check_invariants
from vramplan.allocator.constants import SMALL_SIZE
from vramplan.events import Action, EventLog

KiB = 1024
MiB = 1024**2

CONFS = [
    "",
    "expandable_segments:True",
    "max_split_size_mb:24",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:2,4:8,>:1],max_split_size_mb:20,max_non_split_rounding_mb:40",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "expandable_segments:True,large_segment_size_mb:12",
]

sizes = st.one_of(
    st.integers(1, 4 * KiB),          # tiny: small pool, 512 rounding
    st.integers(4 * KiB, SMALL_SIZE),  # small pool
    st.integers(SMALL_SIZE + 1, 10 * MiB),  # large pool, 20 MiB segments
    st.integers(10 * MiB, 64 * MiB),  # large pool, own segments (some oversize)
)
_OPS = {
    "alloc": st.tuples(st.just("alloc"), sizes, st.integers(0, 1)),
    "free": st.tuples(st.just("free"), st.integers(0, 10**6), st.booleans()),
    "sync": st.tuples(st.just("sync"), st.just(0), st.just(0)),
    "empty": st.tuples(st.just("empty"), st.just(0), st.just(0)),
}
# weighted: mostly allocations and frees, now and then a sync or an empty_cache
op = st.sampled_from(["alloc"] * 5 + ["free"] * 4 + ["sync", "empty"]).flatmap(_OPS.__getitem__)
ops_lists = st.lists(op, min_size=10, max_size=150)
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def expected_best_fit(al: CachingAllocator, size: int, stream: int) -> int | None:
    """Reference ``get_free_block`` by linear scan (non-expandable configs)."""
    small = size <= SMALL_SIZE
    cands = [b for b in al._free.values() if b.pool.small == small and b.pool.stream == stream
             and b.size >= size]
    if not cands:
        return None
    b = min(cands, key=lambda x: (x.size, x.addr))
    msplit, nsr = al.conf.max_split_size, al.conf.max_non_split_rounding_size
    if size < msplit and b.size >= msplit:
        return None
    if size >= msplit and b.size >= size + nsr:
        return None
    return b.addr


def run_ops(conf: str, ops, capacity: int | None) -> CachingAllocator:
    al = CachingAllocator(conf, capacity=capacity)
    live = []
    es = al.conf.expandable_segments
    for kind, a, b in ops:
        if kind == "alloc":
            want = None
            if not es:
                from vramplan.allocator.sizes import round_size

                want = expected_best_fit(al, round_size(a, al.conf), b)
            blk = al.malloc(a, b)
            if blk is not None:
                if want is not None:  # the block came from the cache: the best fit's address
                    assert blk.addr == want
                live.append(blk)
        elif kind == "free" and live:
            blk = live.pop(a % len(live))
            al.free(blk, deferred=b)
        elif kind == "sync":
            al.synchronize()
        elif kind == "empty":
            al.empty_cache()
        problems = check_invariants(al)
        assert problems == [], problems
        assert al.reserved >= al.active >= al.allocated >= 0
        assert al.active >= al.requested
        if not al._pending:
            assert al.allocated >= al.requested
    # free everything: every segment merges back into a single free block
    for blk in live:
        al.free(blk)
    al.synchronize()
    assert check_invariants(al) == []
    assert al.allocated == al.active == al.requested == 0
    for seg in al.snapshot():
        if not seg.expandable:
            assert len(seg.blocks) == 1 and seg.blocks[0].state == "inactive"
    al.empty_cache()
    assert al.reserved == 0 and al.snapshot() == () and al.num_segments == 0
    return al


@SETTINGS
@given(conf=st.sampled_from(CONFS), ops=ops_lists)
def test_random_sequences_keep_invariants(conf, ops):
    run_ops(conf, ops, capacity=None)


@SETTINGS
@given(conf=st.sampled_from(CONFS), ops=ops_lists,
       capacity=st.integers(40, 400).map(lambda m: m * MiB))
def test_random_sequences_under_capacity(conf, ops, capacity):
    al = run_ops(conf, ops, capacity)
    assert al.num_alloc_retries >= al.num_ooms


@SETTINGS
@given(allocs=st.lists(st.tuples(sizes, st.integers(0, 2)), min_size=1, max_size=80),
       large_page=st.sampled_from([20, 12, 64]))
def test_expandable_maps_only_the_pages_it_needs(allocs, large_page):
    """Allocations only, expandable segments: blocks tile each (stream, pool) range from its
    start, so reserved is exactly the pages that cover the rounded sizes."""
    al = CachingAllocator(f"expandable_segments:True,large_segment_size_mb:{large_page}")
    need: dict[tuple[bool, int], int] = {}
    for size, stream in allocs:
        blk = al.malloc(size, stream)
        key = (blk.size <= SMALL_SIZE, stream)
        need[key] = need.get(key, 0) + blk.size
    pages = {True: 2 * MiB, False: large_page * MiB}
    want = sum(-(-n // pages[small]) * pages[small] for (small, _), n in need.items())
    assert al.reserved == want
    assert check_invariants(al) == []


@SETTINGS
@given(conf=st.sampled_from(CONFS), ops=ops_lists)
def test_replay_peaks_bound_the_timeline(conf, ops):
    log = EventLog()
    live: list[int] = []
    nxt = 0
    for kind, a, b in ops:
        if kind == "alloc":
            log.alloc(nxt, a, stream=b)
            live.append(nxt)
            nxt += 1
        elif kind == "free" and live:
            log.append(Action.FREE_DEFERRED if b else Action.FREE, live.pop(a % len(live)))
        elif kind == "sync":
            log.append(Action.SYNC)
        elif kind == "empty":
            log.append(Action.EMPTY_CACHE)
    r = replay(log, conf, record_timeline=True, full_timeline=True, record_segments=True)
    tl = r.timeline
    assert r.max_reserved >= r.max_allocated
    if len(log):
        assert max(tl.allocated) == r.max_allocated and max(tl.reserved) == r.max_reserved
        assert max(tl.active) == r.max_active and max(tl.requested) == r.max_requested
    if r.peak_reserved_index >= 0:
        assert tl.reserved[r.peak_reserved_index] == r.max_reserved
        assert sum(s.size for s in r.segment_map_at_peak) == r.max_reserved
        assert len(r.segment_map_at_peak) == r.segments
        assert sum(s.allocated for s in r.segment_map_at_peak) == r.allocated_at_peak
    # the segment events account for every reserved byte at the end
    delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    assert sum(delta[e.action] * e.size for e in r.segment_events) == r.final_reserved
    # the plain hot loop (no timeline, no tags) gives the same figures, and its sparse reserved
    # curve is the timeline's reserved series at every event
    plain = replay(log, conf, segment_map=False)
    for f in ("max_allocated", "max_reserved", "max_active", "max_requested", "segments",
              "peak_reserved_index", "peak_allocated_index", "allocated_at_peak", "ooms",
              "alloc_retries", "final_allocated", "final_reserved", "reserved_changes"):
        assert getattr(plain, f) == getattr(r, f), f
    idx = [k for k, _ in plain.reserved_changes]
    for k in range(len(log)):
        j = bisect.bisect_right(idx, k) - 1
        assert (plain.reserved_changes[j][1] if j >= 0 else 0) == tl.reserved[k]


def test_keys_pack_size_and_address():
    al = CachingAllocator()
    blk = al.malloc(3 * MiB)
    assert blk.key >> SHIFT == blk.size
