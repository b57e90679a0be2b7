"""The fused replay loop (:mod:`vramplan.allocator.fused`) equals the method-by-method replay.

Every figure of the pass, every counter of the allocator afterwards and its segment map, on
random logs under every allocator option (expandable segments take the method path: the
check there is that they still do), with and without a capacity.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_allocator_props import CONFS, MiB, sizes
from vramplan.allocator import fused
from vramplan.allocator.check import check_invariants
from vramplan.allocator.config import as_config
from vramplan.allocator.native import CachingAllocator
from vramplan.allocator.replay import MAX_OOM_INDICES, _run, _run_plain, make_allocator, replay
from vramplan.errors import VramplanError
from vramplan.events import Action, EventLog

_FIELDS = ("max_allocated", "max_reserved", "peak_allocated_index", "peak_reserved_index",
           "allocated_at_peak", "segments_at_peak", "oom_indices", "reserved_changes")
_STATE = ("allocated", "active", "requested", "reserved", "inactive_split", "num_segments",
          "max_active", "max_requested", "max_segments", "num_alloc_retries", "num_ooms")

op = st.one_of(
    st.tuples(st.just("alloc"), st.one_of(sizes, st.sampled_from([0, 1, 512, 513, MiB, MiB + 1])),
              st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 10**6), st.sampled_from(["free", "deferred", "complete"])),
    st.tuples(st.just("sync"), st.just(0), st.just(0)),
    st.tuples(st.just("empty"), st.just(0), st.just(0)),
)


def build_log(ops: list[tuple]) -> EventLog:
    log = EventLog()
    live: list[int] = []
    pending: list[int] = []
    nxt = 0
    for kind, a, b in ops:
        if kind == "alloc":
            log.alloc(nxt, a, stream=b)
            live.append(nxt)
            nxt += 1
        elif kind == "free" and b == "complete" and pending:
            log.append(Action.FREE, pending.pop(a % len(pending)))  # one deferred free completes
        elif kind == "free" and live:
            ident = live.pop(a % len(live))
            if b == "deferred":
                log.append(Action.FREE_DEFERRED, ident)
                pending.append(ident)
            else:
                log.append(Action.FREE, ident)
        elif kind == "sync":
            log.append(Action.SYNC)
            pending.clear()
        elif kind == "empty":
            log.append(Action.EMPTY_CACHE)
    return log


def both(log: EventLog, conf: str, capacity: int | None, first_oom: bool = False) -> tuple[tuple, tuple]:
    out: list[tuple] = []
    for use in (False, True):
        al = make_allocator(as_config(conf), capacity)
        run = _run_plain(log, al, fused=use and fused.eligible(al), first_oom=first_oom)
        state = tuple(getattr(al, f) for f in _STATE)
        assert check_invariants(al) == [] if isinstance(al, CachingAllocator) else True
        out.append((tuple(getattr(run, f) for f in _FIELDS), state, al.snapshot(), al._gc_calls))
    return out[0], out[1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), ops=st.lists(op, min_size=5, max_size=200),
       capacity=st.one_of(st.none(), st.integers(8, 300).map(lambda m: m * MiB)), first_oom=st.booleans())
def test_fused_equals_method_replay(conf, ops, capacity, first_oom):
    plain, fast = both(build_log(ops), conf, capacity, first_oom)
    assert fast == plain


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), ops=st.lists(op, min_size=5, max_size=200),
       capacity=st.integers(8, 300).map(lambda m: m * MiB))
def test_first_oom_ends_where_the_replay_first_runs_out(conf, ops, capacity):
    """``first_oom`` ends the replay at its first failed ALLOC (where PyTorch raises): one OOM,
    and every figure that of the replay that skips it, stopped right before it."""
    log = build_log(ops)
    full = replay(log, conf, capacity=capacity, segment_map=False)
    first = replay(log, conf, capacity=capacity, segment_map=False, first_oom=True)
    if not full.oom_indices:
        assert first == full
        return
    k = full.oom_indices[0]
    assert first.ooms == 1 and first.oom_indices == (k,)
    assert first.ooms < full.ooms or full.oom_indices == (k,)
    if k:
        before = _run(log, make_allocator(as_config(conf), capacity), stop=k - 1, fused=False)
        assert (first.max_allocated, first.max_reserved) == (before.max_allocated, before.max_reserved)


def test_fused_is_taken_only_where_it_applies():
    assert fused.eligible(CachingAllocator())
    assert not fused.eligible(CachingAllocator("expandable_segments:True"))
    assert not fused.eligible(make_allocator(as_config("backend:cudaMallocAsync"), None))


def test_a_long_decode_like_log_is_identical():
    """Growing caches (the shape of a generate log): allocations that grow by 2 KiB a step
    across the small/large pool boundary, temporaries, and a capacity that runs out."""
    log = EventLog()
    nxt = 0
    caches = []
    for _ in range(8):
        log.alloc(nxt, 300 * MiB)  # weights
        nxt += 1
    for _ in range(6):
        log.alloc(nxt, 500 * 2048)
        caches.append(nxt)
        nxt += 1
    for step in range(1, 60):
        for layer in range(6):
            log.alloc(nxt, (500 + step) * 2048)  # torch.cat into a new cache, the old one freed
            log.append(Action.FREE, caches[layer])
            caches[layer] = nxt
            nxt += 1
            for size in (8192, 3 * MiB, 512):
                log.alloc(nxt, size)
                log.append(Action.FREE, nxt)
                nxt += 1
    retries = []
    for capacity in (None, 2000 * MiB, 2424 * MiB, 2430 * MiB, 2440 * MiB):
        plain, fast = both(log, "", capacity)
        assert fast == plain
        retries.append(plain[1][-2])
    assert retries[0] == 0 and retries[1] > 0  # the capacities ran out: retries and OOMs alike


@pytest.mark.parametrize("bad", ["double", "unknown", "deferred_unknown"])
def test_fused_reports_inconsistent_logs_as_the_method_loop_does(bad):
    log = EventLog()
    log.alloc(1, 4096)
    if bad == "double":
        log.alloc(1, 4096)
    elif bad == "unknown":
        log.append(Action.FREE, 7)
    else:
        log.append(Action.FREE_DEFERRED, 7)
    messages = []
    for use in (False, True):
        with pytest.raises(VramplanError) as e:
            _run_plain(log, CachingAllocator(), fused=use)
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_oom_indices_are_capped():
    log = EventLog()
    for i in range(MAX_OOM_INDICES + 5):
        log.alloc(i, 64 * MiB)
    al = CachingAllocator(capacity=32 * MiB)
    run = _run_plain(log, al, fused=True)
    assert len(run.oom_indices) == MAX_OOM_INDICES and al.num_ooms == MAX_OOM_INDICES + 5


@pytest.mark.parametrize("use", [False, True])
def test_completing_the_deferred_free_of_a_storage_without_a_block(use):
    """A zero-byte storage, or one that ran out of memory, has no block: its deferred free and
    the FREE that completes it (a snapshot's ``free_completed``) are no-ops, not an error."""
    log = EventLog()
    log.alloc(1, 0)
    log.alloc(2, 64 * MiB)  # over the capacity: OOM
    log.alloc(3, 4096)
    for i in (1, 2, 3):
        log.append(Action.FREE_DEFERRED, i)
    for i in (1, 2, 3):
        log.append(Action.FREE, i)
    al = CachingAllocator(capacity=32 * MiB)
    run = _run_plain(log, al, fused=use)
    assert run.oom_indices == [1] and al.allocated == al.active == 0 and not al._pending
    with pytest.raises(VramplanError, match="free of id 3, which is not allocated"):
        log.append(Action.FREE, 3)  # completed already
        _run_plain(log, CachingAllocator(capacity=32 * MiB), fused=use)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), ops=st.lists(op, min_size=5, max_size=150),
       capacity=st.one_of(st.none(), st.integers(8, 300).map(lambda m: m * MiB)),
       stop=st.integers(-1, 200), segments=st.booleans())
def test_fused_tagged_pass_equals_the_method_pass(conf, ops, capacity, stop, segments):
    """The segment-map pass (``stop`` at the peak, blocks tagged with their event) and the
    segment events of ``record_segments``: the same through either loop."""
    log = build_log(ops)
    out = []
    for use in (False, True):
        al = make_allocator(as_config(conf), capacity, record_segments=segments)
        run = _run(log, al, stop=stop, tag=True, fused=use)
        out.append((tuple(getattr(run, f) for f in _FIELDS), tuple(getattr(al, f) for f in _STATE),
                    al.snapshot(str), al.seg_events, al.cur_event))
    assert out[1] == out[0]
