"""Property: a trace that begins after some segment existed still replays exactly on the rest.

A random allocation sequence is turned into a snapshot by the simulation itself
(:func:`predicted_snapshot`), then the first entries of its trace are dropped, as if recording
had begun later: the segments reserved by then are "reserved before recording". PyTorch's best
fit is a minimum over all free blocks, so leaving out the allocations that landed in those
segments changes no other choice: the comparison on the rest must be exact (native rules, no
capacity)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.allocator.constants import SMALL_SIZE
from vramplan.events import Action, EventLog
from vramplan.snapshot import compare_with_recorded, trace_coverage
from vramplan.snapshot.export import predicted_snapshot

MiB = 1024**2
sizes = st.one_of(st.integers(1, SMALL_SIZE), st.integers(SMALL_SIZE + 1, 10 * MiB),
                  st.integers(10 * MiB, 48 * MiB))
ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), sizes, st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("empty"), st.just(0), st.just(0)),
), min_size=5, max_size=120)


def build(ops_list: list[tuple[str, int, int]]) -> EventLog:
    log = EventLog()
    live: list[int] = []
    n = 0
    for kind, a, b in ops_list:
        if kind == "alloc":
            log.alloc(n, a, stream=b)
            live.append(n)
            n += 1
        elif kind == "free" and live:
            log.free(live.pop(a % len(live)))
        elif kind == "empty":
            log.append(Action.EMPTY_CACHE)
    return log


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_list=ops, conf=st.sampled_from(["", "max_split_size_mb:24", "roundup_power2_divisions:4"]),
       pick=st.integers(0, 10**6))
def test_rest_of_a_late_started_trace_replays_exactly(ops_list, conf, pick):
    snap = predicted_snapshot(build(ops_list), conf=conf)
    whole = compare_with_recorded(snap)
    assert whole.complete and whole.match and whole.addresses_match and not whole.reserved_before_recording
    trace = snap["device_traces"][0]
    if not trace:
        return
    t = pick % len(trace)  # keep at least one entry (an empty trace says nothing)
    held: dict[int, int] = {}  # segments reserved when recording begins at entry t
    for e in trace[:t]:
        if e["action"] == "segment_alloc":
            held[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            held.pop(e["addr"])
    snap["device_traces"][0] = trace[t:]
    cov = trace_coverage(snap)
    assert cov.complete and cov.reserved_before == sum(held.values()), cov
    assert cov.segments_before == len(held)
    c = compare_with_recorded(snap)
    assert c.match and c.layout_match and c.addresses_match, c.first_mismatch
    assert c.reserved_before_recording == sum(held.values())
