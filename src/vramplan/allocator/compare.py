"""Compare simulated segment events with recorded ones (a snapshot's device trace).

Both sides are lists of :class:`~vramplan.allocator.result.SegmentEvent` stamped with the
index of the event-log event during which they happened. Events of one index are compared as
a multiset of (action, size, stream): within one call PyTorch releases segments in (size,
address) order, and simulated addresses cannot equal real ones, so only the set is checkable.
Addresses are checked for consistency instead: a ``segment_free`` must free the segment whose
``segment_alloc`` was paired with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from .result import SegmentEvent

_GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


@dataclass(frozen=True)
class EventsComparison:
    recorded: int
    simulated: int
    matching: int
    """Events with an identical counterpart (same event index, action, size and stream)."""
    first_mismatch_index: int
    """Event-log index of the first difference (-1: none)."""
    first_mismatch: str
    """One line describing it ('' when none)."""

    @property
    def identical(self) -> bool:
        return self.first_mismatch_index < 0 and self.recorded == self.simulated == self.matching


def peak_reserved(events: Iterable[SegmentEvent], start: int = 0) -> int:
    """Highest running total of reserved bytes implied by the events."""
    cur = peak = start
    for e in events:
        cur += _GROWS[e.action] * e.size
        peak = max(peak, cur)
    return peak


def _fmt(evs: Sequence[SegmentEvent]) -> str:
    if not evs:
        return "nothing"
    return ", ".join(f"{e.action} {e.size:,} B (stream {e.stream})" for e in evs)


def compare_segment_events(recorded: Sequence[SegmentEvent],
                           simulated: Sequence[SegmentEvent]) -> EventsComparison:
    def groups(evs: Sequence[SegmentEvent]) -> dict[int, list[SegmentEvent]]:
        return {k: list(g) for k, g in groupby(evs, key=lambda e: e.event_index)}

    rec, sim = groups(recorded), groups(simulated)
    matching = 0
    first_index, first = -1, ""
    pair: dict[int, int] = {}  # recorded segment address -> simulated address
    for k in sorted(set(rec) | set(sim)):
        r, s = rec.get(k, []), sim.get(k, [])
        rc = Counter((e.action, e.size, e.stream) for e in r)
        sc = Counter((e.action, e.size, e.stream) for e in s)
        common = rc & sc
        matching += sum(common.values())
        problem = ""
        if rc != sc:
            problem = f"recorded {_fmt(r)}; simulated {_fmt(s)}"
        else:
            problem = _pair_addresses(r, s, pair)
        if problem and first_index < 0:
            first_index, first = k, f"event {k}: {problem}"
    return EventsComparison(len(recorded), len(simulated), matching, first_index, first)


def _pair_addresses(r: list[SegmentEvent], s: list[SegmentEvent], pair: dict[int, int]) -> str:
    """Pair cudaMalloc'd segments by (size, stream) in order; check frees against the pairs."""
    sim_allocs: dict[tuple[int, int], list[int]] = {}
    for e in s:
        if e.action == "segment_alloc":
            sim_allocs.setdefault((e.size, e.stream), []).append(e.addr)
    for e in r:
        if e.action == "segment_alloc":
            pair[e.addr] = sim_allocs[(e.size, e.stream)].pop(0)
    sim_frees = Counter((e.addr, e.size) for e in s if e.action == "segment_free")
    for e in r:
        if e.action != "segment_free":
            continue
        mine = pair.pop(e.addr, None)
        if mine is None:
            return f"segment_free of {e.addr:#x}, whose segment_alloc is not in the trace"
        if sim_frees[(mine, e.size)] <= 0:
            return (f"segment_free of the {e.size:,} B segment recorded at {e.addr:#x}: the "
                    "simulation frees another segment of that size")
        sim_frees[(mine, e.size)] -= 1
    return ""
