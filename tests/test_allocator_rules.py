"""Hand-built event sequences, one allocator rule each. Every expected number is derived in
the comments from c10/cuda/CUDACachingAllocator.cpp (function names in backticks)."""

from __future__ import annotations

import pytest

from vramplan.allocator import CachingAllocator, parse_conf, replay
from vramplan.allocator.check import check_invariants
from vramplan.allocator.sizes import allocation_size, round_size, roundup_power2_next_division
from vramplan.events import Action, EventLog

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def ok(al: CachingAllocator) -> CachingAllocator:
    assert check_invariants(al) == []
    return al


def seg_sizes(al: CachingAllocator) -> list[int]:
    return sorted(s.size for s in al.snapshot())


# ------------------------------------------------------------------ rounding (`round_size`)
@pytest.mark.parametrize("size,expected", [
    (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024),
    (MiB + 1, MiB + 512),
])
def test_round_to_512(size, expected):
    assert round_size(size, parse_conf("")) == expected


def test_roundup_power2_next_division_examples():
    # the C++ comment's own example: 1200 in [1024, 2048) with 4 divisions -> 1280
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(1024, 4) == 1024  # powers of two stay
    assert roundup_power2_next_division(1280, 4) == 1280  # already on a division
    # floor 2, 8 divisions: the step 2 >> 3 is 0 -> the next power of two
    assert roundup_power2_next_division(3, 8) == 4


def test_roundup_divisions_apply_only_above_512_times_d():
    conf = parse_conf("roundup_power2_divisions:4")
    # 1200 <= 512*4: plain 512 rounding -> 1536 (not 1280)
    assert round_size(1200, conf) == 1536
    # 3000 > 2048: [2048, 4096) in 4 steps of 512 -> 3072
    assert round_size(3000, conf) == 3072
    # 5 MiB + 1 in [4 MiB, 8 MiB), steps of 1 MiB -> 6 MiB (plain rounding would be 5 MiB + 512)
    assert round_size(5 * MiB + 1, conf) == 6 * MiB


def test_roundup_division_intervals_list_form():
    conf = parse_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # index = log2(size) - 20: 300 MiB -> [256 MiB, 512 MiB) -> 1 division -> plain rounding
    assert round_size(300 * MiB + 1, conf) == 300 * MiB + 512
    # 600 MiB in [512 MiB, 1 GiB): 2 divisions of 256 MiB -> 768 MiB
    assert round_size(600 * MiB, conf) == 768 * MiB
    # 1.1 GiB in [1, 2) GiB: 4 divisions -> 1.25 GiB
    assert round_size(int(1.1 * GiB), conf) == 5 * GiB // 4
    # 3 GiB + 1 in [2, 4) GiB: '>' -> 8 divisions of 256 MiB -> 3.25 GiB
    assert round_size(3 * GiB + 1, conf) == 3 * GiB + 256 * MiB
    # below the first boundary the first value (1) applies: 100 MiB + 1 -> plain
    assert round_size(100 * MiB + 1, conf) == 100 * MiB + 512


# ------------------------------------------------------------------ segment sizes (`get_allocation_size`)
@pytest.mark.parametrize("size,expected", [
    (512, 2 * MiB), (MiB, 2 * MiB),                 # small pool: 2 MiB buffers
    (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),  # 1 MiB < size < 10 MiB: kLargeBuffer
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB),   # >= 10 MiB: round up to 2 MiB
])
def test_allocation_size(size, expected):
    assert allocation_size(size, parse_conf("")) == expected


def test_large_segment_size_option():
    conf = parse_conf("large_segment_size_mb:64")
    assert allocation_size(3 * MiB, conf) == 64 * MiB
    assert allocation_size(12 * MiB, conf) == 12 * MiB  # >= 10 MiB unaffected


# ------------------------------------------------------------------ small pool
def test_small_request_gets_2mib_segment_and_splits():
    al = CachingAllocator()
    b = al.malloc(1000)
    # round 1000 -> 1024; small pool; new 2 MiB segment; remainder 2 MiB - 1024 >= 512 -> split
    assert (b.size, al.allocated, al.reserved, al.requested) == (1024, 1024, 2 * MiB, 1000)
    assert al.inactive_split == 2 * MiB - 1024
    c = al.malloc(3000)  # 3072 from the remainder of the same segment, at the next address
    assert c.addr == b.addr + 1024 and al.reserved == 2 * MiB
    ok(al)


def test_small_remainder_below_512_is_not_split():
    al = CachingAllocator()
    a = al.malloc(2 * MiB - 1024)  # rounded: 1 MiB < 2 MiB - 1024? no: > 1 MiB -> large pool
    assert a.size == 2 * MiB - 1024 and al.reserved == 20 * MiB
    al2 = CachingAllocator()
    x = al2.malloc(MiB)  # small: 2 MiB segment, remainder 1 MiB
    y = al2.malloc(MiB - 512)  # takes the remainder; leftover 512 >= 512 -> split
    assert y.size == MiB - 512 and al2.inactive_split == 512
    z = al2.malloc(512)  # exactly the leftover: remainder 0 -> no split, the block is reused whole
    assert z.size == 512 and al2.inactive_split == 0 and al2.reserved == 2 * MiB
    assert {x.addr, y.addr, z.addr} == {x.addr, x.addr + MiB, x.addr + 2 * MiB - 512}
    ok(al2)


# ------------------------------------------------------------------ large pool splitting (`should_split`)
def test_large_request_under_10mib_uses_20mib_segment():
    al = CachingAllocator()
    b = al.malloc(3 * MiB)
    # 20 MiB segment, remainder 17 MiB > 1 MiB -> split
    assert (b.size, al.reserved, al.inactive_split) == (3 * MiB, 20 * MiB, 17 * MiB)
    ok(al)


def test_large_remainder_of_exactly_1mib_is_not_split():
    al = CachingAllocator()
    b = al.malloc(19 * MiB)
    # >= 10 MiB: segment = 19 MiB rounded up to 2 MiB = 20 MiB; remainder 1 MiB is not > 1 MiB
    assert (b.size, al.allocated, al.reserved, al.inactive_split) == (20 * MiB, 20 * MiB, 20 * MiB, 0)
    assert al.requested == 19 * MiB
    ok(al)


def test_large_remainder_above_1mib_is_split():
    al = CachingAllocator()
    b = al.malloc(10 * MiB + 1)
    # rounded 10 MiB + 512; segment 12 MiB; remainder 2 MiB - 512 > 1 MiB -> split
    assert b.size == 10 * MiB + 512 and al.reserved == 12 * MiB
    assert al.inactive_split == 2 * MiB - 512
    ok(al)


# ------------------------------------------------------------------ best fit (`get_free_block`)
def test_best_fit_smallest_block_then_lowest_address():
    al = CachingAllocator()
    a = al.malloc(12 * MiB)  # 12 MiB segment A
    b = al.malloc(16 * MiB)  # 16 MiB segment B
    c = al.malloc(12 * MiB)  # 12 MiB segment C (higher address than A)
    a_addr, b_addr, c_addr = a.addr, b.addr, c.addr
    assert a_addr < b_addr < c_addr
    for x in (c, b, a):
        al.free(x)
    # 11 MiB: smallest free block >= 11 MiB is 12 MiB; A and C tie -> lower address A.
    # remainder 1 MiB - is not > 1 MiB -> no split, the whole 12 MiB is taken
    d = al.malloc(11 * MiB)
    assert d.addr == a_addr and d.size == 12 * MiB
    e = al.malloc(11 * MiB)
    assert e.addr == c_addr
    f = al.malloc(11 * MiB)  # only B (16 MiB) left: 16 - 11 = 5 MiB > 1 MiB -> split
    assert f.addr == b_addr and f.size == 11 * MiB and al.reserved == 40 * MiB
    ok(al)


def test_pools_and_streams_are_separate():
    al = CachingAllocator()
    big = al.malloc(3 * MiB)
    al.free(big)  # a 20 MiB free large segment
    al.malloc(1000)  # small request: never from the large pool -> new 2 MiB segment
    assert al.reserved == 22 * MiB
    al.malloc(3 * MiB, stream=1)  # another stream: never reuses stream 0's blocks
    assert al.reserved == 42 * MiB
    al.malloc(3 * MiB, stream=0)  # stream 0 reuses its cached segment
    assert al.reserved == 42 * MiB
    ok(al)


# ------------------------------------------------------------------ merging (`free_block`)
def test_free_merges_neighbours_back_into_one_block():
    al = CachingAllocator()
    xs = [al.malloc(2 * MiB) for _ in range(5)]  # 5 x 2 MiB from one 20 MiB segment + 10 MiB tail
    assert al.reserved == 20 * MiB and len(al.snapshot()[0].blocks) == 6
    for i in (1, 3, 0, 4, 2):  # free out of order: merges both ways
        al.free(xs[i])
        ok(al)
    (seg,) = al.snapshot()
    assert len(seg.blocks) == 1 and seg.blocks[0].state == "inactive"
    assert al.inactive_split == 0  # an unsplit free block is not "inactive split"


def test_inactive_split_counts_free_parts_of_split_segments():
    al = CachingAllocator()
    a = al.malloc(4 * MiB)
    b = al.malloc(4 * MiB)
    # segment 20 MiB: [a 4][b 4][free 12] -> inactive_split 12 MiB
    assert al.inactive_split == 12 * MiB
    al.free(a)  # [free 4][b 4][free 12] -> 16 MiB
    assert al.inactive_split == 16 * MiB
    al.free(b)  # all merge into one unsplit 20 MiB block -> 0
    assert al.inactive_split == 0
    ok(al)


# ------------------------------------------------------------------ empty_cache (`release_cached_blocks`)
def test_empty_cache_releases_only_unsplit_free_segments():
    al = CachingAllocator()
    keep = al.malloc(4 * MiB)   # segment 1 (20 MiB), stays split by `keep`
    gone = al.malloc(30 * MiB)  # segment 2 (30 MiB)
    al.free(gone)
    al.empty_cache()
    assert al.reserved == 20 * MiB and seg_sizes(al) == [20 * MiB]
    al.free(keep)
    al.empty_cache()
    assert al.reserved == 0 and al.snapshot() == ()
    ok(al)


# ------------------------------------------------------------------ max_split_size_mb
def test_max_split_size_oversize_blocks():
    al = CachingAllocator("max_split_size_mb:40")
    big = al.malloc(100 * MiB)  # >= 40 MiB: oversize, segment 100 MiB
    al.free(big)
    # a request below max_split_size never takes an oversize block -> new 20 MiB segment
    small = al.malloc(5 * MiB)
    assert al.reserved == 120 * MiB
    al.free(small)
    # an oversize request takes a cached oversize block only if block < request + 20 MiB
    x = al.malloc(85 * MiB)  # 100 < 85 + 20 -> reuse, unsplit (size >= max_split)
    assert x.size == 100 * MiB and al.reserved == 120 * MiB
    al.free(x)
    y = al.malloc(70 * MiB)  # 100 >= 70 + 20 -> not reused: new 70 MiB segment
    assert y.size == 70 * MiB and al.reserved == 190 * MiB
    ok(al)


def test_oversize_boundaries_are_inclusive():
    al = CachingAllocator("max_split_size_mb:40")
    al.free(al.malloc(40 * MiB))  # a cached block of exactly max_split_size: oversize (>=)
    al.malloc(30 * MiB)  # below max_split_size: may not take it -> new 30 MiB segment
    assert al.reserved == 70 * MiB
    al2 = CachingAllocator("max_split_size_mb:40")
    al2.free(al2.malloc(80 * MiB))
    al2.malloc(60 * MiB)  # 80 >= 60 + 20 (the limit is exclusive) -> not reused
    assert al2.reserved == 140 * MiB
    al3 = CachingAllocator("max_split_size_mb:40")
    al3.free(al3.malloc(80 * MiB))
    b = al3.malloc(60 * MiB + 512)  # 80 < 60 MiB + 512 + 20 MiB -> reused whole
    assert b.size == 80 * MiB and al3.reserved == 80 * MiB


def test_max_non_split_rounding_mb():
    al = CachingAllocator("max_split_size_mb:40,max_non_split_rounding_mb:64")
    al.free(al.malloc(100 * MiB))
    y = al.malloc(70 * MiB)  # 100 < 70 + 64 -> reused whole
    assert y.size == 100 * MiB and al.reserved == 100 * MiB


def test_blocks_below_max_split_still_split():
    al = CachingAllocator("max_split_size_mb:40")
    b = al.malloc(30 * MiB)  # 30 MiB segment, fits exactly
    al.free(b)
    c = al.malloc(20 * MiB)  # 20 < 40 and remainder 10 MiB > 1 MiB -> split
    assert c.size == 20 * MiB and al.inactive_split == 10 * MiB


# ------------------------------------------------------------------ OOM path (`malloc`)
def test_oom_retry_after_releasing_cache():
    al = CachingAllocator(capacity=100 * MiB)
    a = al.malloc(60 * MiB)
    al.free(a)  # 60 MiB cached
    b = al.malloc(70 * MiB)
    # cudaMalloc(70) fails (60 + 70 > 100); no max_split -> release_available does nothing;
    # release_cached_blocks frees the 60 MiB segment; retry succeeds: num_alloc_retries = 1
    assert b is not None and al.num_alloc_retries == 1 and al.num_ooms == 0
    assert al.reserved == 70 * MiB
    c = al.malloc(40 * MiB)  # 70 + 40 > 100 even after releasing (nothing cached): OOM
    assert c is None and al.num_ooms == 1 and al.num_alloc_retries == 2
    ok(al)


def test_release_available_cached_blocks_frees_one_oversize_block():
    al = CachingAllocator("max_split_size_mb:40", capacity=200 * MiB)
    a = al.malloc(50 * MiB)
    b = al.malloc(60 * MiB)
    keep = al.malloc(30 * MiB)
    al.free(a)
    al.free(b)  # cached: 50 and 60 MiB oversize segments; reserved 140 MiB
    c = al.malloc(90 * MiB)
    # cudaMalloc(90): 140 + 90 > 200 fails. release_available_cached_blocks: key = max(90, 40)
    # = 90 MiB; no single cached block >= 90 -> free oversize blocks largest first: 60
    # (total 60 < 90), then 50 (total 110 >= 90) -> true; retry: 30 + 90 <= 200 succeeds.
    # This path does not count a retry (isRetry is only set for the last attempt).
    assert c is not None and al.num_alloc_retries == 0
    assert al.reserved == 120 * MiB and keep.size == 30 * MiB
    ok(al)


def test_replay_counts_oom_and_skips_it():
    log = EventLog()
    log.alloc(1, 60 * MiB)
    log.alloc(2, 60 * MiB)  # does not fit in 100 MiB: OOM, counted and skipped
    log.free(2)             # the free of the OOM'd tensor is ignored
    log.free(1)
    r = replay(log, capacity=100 * MiB)
    assert (r.ooms, r.alloc_retries, r.oom_indices) == (1, 1, (1,))
    assert r.max_allocated == 60 * MiB and r.max_reserved == 60 * MiB


# ------------------------------------------------------------------ garbage collection
def test_garbage_collection_needs_a_memory_fraction():
    conf = "garbage_collection_threshold:0.5"
    al = CachingAllocator(conf, capacity=100 * MiB)  # fraction 1.0: GC never runs
    al.free(al.malloc(40 * MiB))
    al.malloc(30 * MiB)  # 30 < 40 and remainder 10 > 1 -> reuses the cached 40 MiB block
    assert al.reserved == 40 * MiB
    assert "has no effect" in " ".join(parse_conf(conf).notes)


def test_garbage_collection_releases_old_blocks():
    al = CachingAllocator("garbage_collection_threshold:0.5,per_process_memory_fraction:0.8",
                          capacity=100 * MiB)
    # allowed = 80 MiB, gc threshold = 40 MiB of reserved
    a = al.malloc(30 * MiB)
    b = al.malloc(20 * MiB)  # reserved 50 MiB
    al.free(a)
    al.free(b)  # both cached and unsplit
    c = al.malloc(34 * MiB)
    # no cached block fits 34 MiB -> GC: reserved 50 > 40, target 10 MiB. Ages (get_free_block
    # calls on the large pool since each was freed): both 1 -> average 1, both >= 1 -> both
    # released (GC does not stop at the target within a pass). Then cudaMalloc(34 MiB).
    assert c is not None and al.reserved == 34 * MiB
    ok(al)


def test_fraction_limits_reserved():
    al = CachingAllocator("per_process_memory_fraction:0.5", capacity=100 * MiB)
    assert al.malloc(40 * MiB) is not None
    assert al.malloc(20 * MiB) is None and al.num_ooms == 1  # 40 + 20 > 50 allowed


# ------------------------------------------------------------------ cross-stream frees (record_stream)
def test_deferred_free_stays_active_until_sync():
    log = EventLog()
    log.alloc(1, 4 * MiB)
    log.append(Action.FREE_DEFERRED, 1)
    log.alloc(2, 4 * MiB)  # cannot reuse block 1 (its events are pending): placed after it
    log.append(Action.SYNC)
    log.alloc(3, 4 * MiB)  # block 1 is free again: reused
    r = replay(log, record_timeline=True, record_segments=True)
    tl = r.timeline
    assert tl.allocated[1] == 0 and tl.active[1] == 4 * MiB  # freed but still active
    assert tl.allocated[2] == 4 * MiB and tl.active[2] == 8 * MiB
    assert tl.active[3] == 4 * MiB  # SYNC completed it
    assert r.max_reserved == 20 * MiB and r.max_active == 8 * MiB


def test_free_of_pending_id_completes_only_that_block():
    al = CachingAllocator()
    a = al.malloc(4 * MiB)
    b = al.malloc(4 * MiB)
    al.free(a, deferred=True)
    al.free(b, deferred=True)
    al.complete(a)
    assert al.active == 4 * MiB and ok(al)
    al.empty_cache()  # release_cached_blocks synchronises first: b completes, segment freed
    assert al.active == 0 and al.reserved == 0


# ------------------------------------------------------------------ expandable segments
def test_expandable_segment_grows_by_pages():
    al = CachingAllocator("expandable_segments:True", record_segments=True)
    a = al.malloc(3 * MiB)   # large pool: map one 20 MiB page
    b = al.malloc(30 * MiB)  # 17 MiB free at the end + map ceil(13/20) = 1 more page
    assert al.reserved == 40 * MiB
    assert b.addr == a.addr + 3 * MiB  # contiguous in the one virtual range
    assert [e[0] for e in al.seg_events] == ["segment_map", "segment_map"]
    assert [e[2] for e in al.seg_events] == [20 * MiB, 20 * MiB]
    (seg,) = al.snapshot()  # one contiguous mapped range -> one segment
    assert seg.expandable and seg.size == 40 * MiB and al.num_segments == 1
    ok(al)


def test_expandable_split_threshold_is_512_everywhere():
    al = CachingAllocator("expandable_segments:True")
    a = al.malloc(19 * MiB)  # one 20 MiB page; remainder 1 MiB >= 512 -> split (large pool!)
    assert a.size == 19 * MiB and al.allocated == 19 * MiB
    ok(al)


def test_expandable_empty_cache_unmaps_free_pages():
    al = CachingAllocator("expandable_segments:True", record_segments=True)
    a = al.malloc(30 * MiB)  # 2 pages [0, 40)
    b = al.malloc(5 * MiB)   # [30, 35) inside page 1
    al.free(a)
    al.empty_cache()
    # free block [0, 30): only page 0 ([0, 20)) is whole -> unmap 20 MiB; [20, 30) stays mapped
    assert al.reserved == 20 * MiB
    assert al.seg_events[-1][0] == "segment_unmap" and al.seg_events[-1][2] == 20 * MiB
    al.free(b)
    al.empty_cache()  # everything free: the last page goes, then the virtual range
    assert al.reserved == 0 and al.snapshot() == () and ok(al)


def test_expandable_small_pool_pages_are_2mib():
    al = CachingAllocator("expandable_segments:True")
    for _ in range(3):
        al.malloc(MiB)  # each 1 MiB; two per 2 MiB page
    assert al.reserved == 4 * MiB and ok(al)


def test_large_segment_size_sets_expandable_page():
    al = CachingAllocator("expandable_segments:True,large_segment_size_mb:64")
    al.malloc(3 * MiB)
    assert al.reserved == 64 * MiB


def test_expandable_oom_unmaps_and_retries():
    al = CachingAllocator("expandable_segments:True", capacity=60 * MiB, record_segments=True)
    a = al.malloc(40 * MiB)       # pages 0-1 of stream 0
    al.free(a)                    # cached, mapped
    b = al.malloc(40 * MiB, stream=1)  # stream 1 cannot use them: map fails (40 + 40 > 60);
    # release_cached_blocks unmaps stream 0's two pages; retry maps stream 1's -> 1 retry
    assert b is not None and al.num_alloc_retries == 1 and al.reserved == 40 * MiB
    kinds = [e[0] for e in al.seg_events]
    assert kinds == ["segment_map", "segment_unmap", "segment_map"]
    ok(al)


# ------------------------------------------------------------------ cudaMallocAsync (approximation)
def test_malloc_async_is_labelled_approximation():
    log = EventLog()
    log.alloc(1, 3 * MiB)
    log.free(1)
    log.alloc(2, 5 * MiB)
    r = replay(log, "backend:cudaMallocAsync")
    assert r.backend == "cudaMallocAsync (approximation)"
    assert r.max_allocated == 5 * MiB and r.max_reserved == 6 * MiB  # high-water, 2 MiB granules
    assert any("approximated" in n for n in r.notes)


# ------------------------------------------------------------------ replay bookkeeping
def test_replay_peaks_and_indices():
    log = EventLog()
    log.alloc(1, 3 * MiB)   # reserved 20
    log.alloc(2, 30 * MiB)  # reserved 50, allocated 33: both peaks here
    log.free(2)
    log.alloc(3, 10 * MiB)  # from the 20 MiB segment's tail (17 MiB free): no new segment
    r = replay(log, record_segments=True)
    assert (r.max_allocated, r.max_reserved) == (33 * MiB, 50 * MiB)
    assert (r.peak_allocated_index, r.peak_reserved_index, r.segments) == (1, 1, 2)
    assert r.fragmentation_at_peak == pytest.approx(1 - 33 / 50)
    assert [e.action for e in r.segment_events] == ["segment_alloc", "segment_alloc"]
    assert [e.event_index for e in r.segment_events] == [0, 1]
    cats = {b.category for s in r.segment_map_at_peak for b in s.blocks if b.state != "inactive"}
    assert cats == {"other"}


def test_replay_rejects_inconsistent_logs():
    from vramplan.errors import VramplanError

    log = EventLog()
    log.free(5)
    with pytest.raises(VramplanError, match="event 0: free of id 5"):
        replay(log)
    log = EventLog()
    log.alloc(1, 10)
    log.alloc(1, 10)
    with pytest.raises(VramplanError, match="allocated again"):
        replay(log)


def test_zero_byte_alloc_takes_nothing():
    log = EventLog()
    log.alloc(1, 0)
    log.free(1)
    r = replay(log)
    assert r.max_allocated == 0 and r.max_reserved == 0


def test_timeline_decimation_keeps_the_peak():
    log = EventLog()
    for i in range(5000):
        log.alloc(i, MiB // 2)
    for i in range(5000):
        log.free(i)
    r = replay(log, record_timeline=True, max_points=100)
    tl = r.timeline
    assert tl.decimated and len(tl.index) <= 100
    assert max(tl.allocated) == r.max_allocated
    full = replay(log, record_timeline=True, full_timeline=True).timeline
    assert len(full.allocated) == 10000 and not full.decimated


def test_segment_map_at_peak_by_default():
    log = EventLog()
    log.alloc(1, 3 * MiB)
    log.alloc(2, 30 * MiB)
    log.free(1)
    r = replay(log)
    # taken after event 1 (the reserved peak): block 1 is still allocated there
    assert [len(s.blocks) for s in r.segment_map_at_peak] == [2, 1]
    assert r.segment_map_at_peak[0].blocks[0].state == "active_allocated"
    assert replay(log, segment_map=False).segment_map_at_peak == ()


def test_caching_allocator_guards():
    from vramplan.errors import ConfigError

    with pytest.raises(ConfigError, match="backend:native"):
        CachingAllocator("backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="negative"):
        CachingAllocator().malloc(-1)


# ------------------------------------------------------------------ recorded segment addresses
def _two_tied_segments(plan=None):
    """9 MiB requests take 20 MiB segments (`get_allocation_size`, below 10 MiB) and split
    (remainder > 1 MiB): A, B -> segment 1 (9 + 9 + 2 free); C: no block fits -> segment 2;
    D -> segment 2 (9 + 9 + 2 free). E 1.5 MiB: the two free 2 MiB blocks tie on size, so
    `get_free_block`'s (size, address) order takes the lower address."""
    al = CachingAllocator(segment_addresses=plan)
    a, b, c, d = (al.malloc(9 * MiB) for _ in range(4))
    e = al.malloc(3 * MiB // 2)
    assert a is not None and c is not None and e is not None
    assert a.seg is not c.seg and len(al.snapshot()) == 2
    return ok(al), a, c, e


def test_recorded_addresses_decide_best_fit_ties():
    _, a, c, e = _two_tied_segments()
    assert a.addr < c.addr and e.seg is a.seg  # simulated addresses grow: segment 1 is lower
    hi, lo = 0x7F0000000000, 0x7E0000000000  # as recorded: cudaMalloc put segment 2 lower
    al, a, c, e = _two_tied_segments([(hi, 20 * MiB), (lo, 20 * MiB)])
    assert (a.addr, c.addr) == (hi, lo) and e.seg is c.seg and e.addr == lo + 18 * MiB
    assert sorted(s.addr for s in al.snapshot()) == [lo, hi]


def test_recorded_addresses_are_dropped_at_the_first_difference():
    base = 0x7F0000000000
    # the recording's second segment was 22 MiB: the simulation's 20 MiB one differs, so from
    # there on addresses are simulated, outside the recorded range
    _, a, c, _ = _two_tied_segments([(base, 20 * MiB), (base + 20 * MiB, 22 * MiB)])
    assert a.addr == base and not base <= c.addr < base + 42 * MiB
    # an address still in use in the simulation is not handed out twice
    _, a, c, _ = _two_tied_segments([(base, 20 * MiB), (base + 10 * MiB, 20 * MiB)])
    assert a.addr == base and not base <= c.addr < base + 30 * MiB
    # unusable plans (unaligned, beyond the simulated address space) are ignored
    _, a, _, _ = _two_tied_segments([(base + 3, 20 * MiB)])
    assert a.addr != base + 3
    _, a, _, _ = _two_tied_segments([(1 << 48, 20 * MiB)])
    assert a.addr < 1 << 47


# ------------------------------------------------------------------ CUDA graphs' private pools
def test_a_cuda_graphs_private_pool_keeps_its_segments_and_serves_only_itself():
    # `release_cached_blocks` skips private pools in use (a live graph's), and a block freed in
    # the pool serves only allocations of that pool (`get_pool` by the capture's MempoolId)
    from vramplan.allocator.constants import PRIVATE_POOL

    al = CachingAllocator()
    pool = PRIVATE_POOL + 1
    captured = al.malloc(30 * MiB, stream=pool)  # the capture's own segment (30 MiB)
    al.free(captured)  # freed during capture: back to the pool
    eager = al.malloc(30 * MiB)  # the rest of the program cannot take it: a new segment
    assert al.reserved == 60 * MiB
    again = al.malloc(30 * MiB, stream=pool)  # a capture sharing the pool reuses it
    assert al.reserved == 60 * MiB
    al.free(again)
    al.free(eager)
    al.empty_cache()  # the eager segment goes; the pool's stays
    assert al.reserved == 30 * MiB and seg_sizes(al) == [30 * MiB]
    ok(al)
