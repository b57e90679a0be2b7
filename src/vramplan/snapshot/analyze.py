"""What a PyTorch memory snapshot says: peaks, fragmentation, the largest allocations, OOMs.

Input: the dict that ``torch.cuda.memory._snapshot()`` returns (``_dump_snapshot`` pickles
it; read files with :func:`vramplan.snapshot.reader.load_snapshot`, never ``pickle.load``).

How the numbers are made:

- The trace (``device_traces``) is replayed **backwards from the end state** (``segments``),
  as PyTorch's viewer does, so a trace that starts late (history enabled after the model
  was loaded, or a ``max_entries`` ring buffer that dropped old entries) still gives
  absolute numbers.
- *allocated* counts each live block as its requested size rounded up to 512 B (the trace
  records requested sizes; the allocator's unsplit remainders are not in it), and drops at
  ``free_requested`` as ``torch.cuda.memory_allocated()`` does. *reserved* is exact: the sum
  of ``segment_alloc``/``segment_map`` minus ``segment_free``/``segment_unmap``.
- Categories come from frames and lifetimes (:mod:`vramplan.snapshot.categorize`).
- The end state (``segments``) gives exact allocated/active/reserved at the moment the
  snapshot was taken, which is not the peak.
- With ``simulate`` the trace is also replayed through vramplan's allocator simulation
  (:func:`vramplan.snapshot.reader.compare_with_recorded`): its ``max_memory_allocated``
  counts whole blocks, and whether it reproduces the recorded segment events checks the simulator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vramplan._json import jsonable
from vramplan.errors import SnapshotError

from .categorize import CATEGORIES, UNKNOWN, categorize, user_frames
from .history import (
    SegmentState,
    add_preexisting,
    blocks_of,
    frames_of,
    int_field,
    rounded,
    segments_at,
    walk_trace,
)
from .reader import compare_with_recorded, validate_snapshot


@dataclass(frozen=True)
class Allocation:
    """One block's life as the trace records it."""

    addr: int
    size: int
    """Requested bytes."""
    stream: int
    alloc_index: int
    """Trace entry of the ``alloc``; -1 when it was allocated before the trace starts."""
    free_index: int | None
    """Trace entry of the ``free_requested``; None when alive when the snapshot was taken."""
    category: str
    rule: str
    """Which categorisation rule decided (see :mod:`vramplan.snapshot.categorize`)."""
    where: tuple[str, ...]
    """Innermost frames outside PyTorch, ``file:line:function``."""

    def live_at(self, index: int) -> bool:
        return self.alloc_index <= index and (self.free_index is None or self.free_index > index)


@dataclass(frozen=True)
class OomEvent:
    index: int
    size: int
    """Bytes requested when the allocator gave up."""
    device_free: int
    """What CUDA still reported free."""
    allocated: int
    reserved: int
    where: tuple[str, ...]


@dataclass(frozen=True)
class Site:
    """Bytes live at the allocated peak, grouped by allocation site."""

    where: str
    category: str
    bytes: int
    count: int


@dataclass(frozen=True)
class EndState:
    """Exact totals from the snapshot's ``segments`` (the moment it was taken)."""

    allocated: int
    requested: int
    active: int
    reserved: int
    segments: int


@dataclass(frozen=True)
class SnapshotTimeline:
    """Decimated to at most a few thousand points; both peaks are always kept.

    ``index[k]`` is the trace entry after which the values hold (-1: before the first entry).
    """

    index: tuple[int, ...]
    allocated: tuple[int, ...]
    reserved: tuple[int, ...]
    by_category: Mapping[str, tuple[int, ...]]

    @property
    def fragmentation(self) -> tuple[float, ...]:
        """1 − allocated / reserved at each point (0 where nothing is reserved)."""
        return tuple(1 - a / r if r else 0.0 for a, r in zip(self.allocated, self.reserved, strict=True))


@dataclass(frozen=True)
class Simulated:
    """vramplan's allocator simulation replaying the same trace: a check of the simulator
    (see :func:`vramplan.snapshot.reader.compare_with_recorded`)."""

    allocated: int
    """Simulated ``max_memory_allocated`` (block sizes, which the trace itself lacks)."""
    reserved: int
    recorded_segment_events: int
    matching_segment_events: int
    match: bool
    """Every segment event and the reserved peak reproduced."""
    complete: bool
    """Whether the trace starts from an empty allocator, or does but for whole segments
    reserved before recording (``reserved_before``); otherwise differences are expected."""
    conf: str
    reason: str = ""
    reserved_before: int = 0
    """Bytes of segments reserved before recording began, left out of the comparison."""


@dataclass(frozen=True)
class SnapshotAnalysis:
    device: int
    entries: int
    """Trace entries analysed (0: a snapshot without recorded history)."""
    peak_allocated: int
    peak_allocated_index: int
    peak_reserved: int
    peak_reserved_index: int
    fragmentation_at_peak: float
    """1 − allocated/reserved at the reserved peak."""
    fragmentation_at_allocated_peak: float
    start_allocated: int
    start_reserved: int
    """Inferred state before the first trace entry (0 when recording started on an empty GPU)."""
    end: EndState
    breakdown_at_peak: Mapping[str, int]
    """Allocated bytes by category at the allocated peak (sums to ``peak_allocated``)."""
    largest: tuple[Allocation, ...]
    sites_at_peak: tuple[Site, ...]
    segments_at_peak: tuple[SegmentState, ...]
    """Largest first."""
    segments_at_peak_count: int
    ooms: tuple[OomEvent, ...]
    rules: Mapping[str, int]
    """How many allocations each categorisation rule decided."""
    timeline: SnapshotTimeline
    simulated: Simulated | None = None
    notes: tuple[str, ...] = ()
    allocator_settings: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (integer bytes); the timeline is left out."""
        d = asdict(self)
        d.pop("timeline")
        d["breakdown_at_peak"] = dict(self.breakdown_at_peak)
        d["rules"] = dict(self.rules)
        d["allocator_settings"] = {str(k): jsonable(v) for k, v in self.allocator_settings.items()}
        d["notes"] = list(self.notes)
        return jsonable(d)


# --------------------------------------------------------------------------- input checks
def pick_device(snap: Mapping[str, Any], device: int | None) -> int:
    """The device to analyse: ``device`` if the snapshot has data for it, else the busiest one."""
    traces = snap.get("device_traces", [])
    seg_devices = {int(s.get("device", 0)) for s in snap["segments"]}
    known = seg_devices | {i for i, t in enumerate(traces) if t}
    if device is not None:
        if device not in known:
            listing = ", ".join(map(str, sorted(known))) or "none"
            raise SnapshotError(f"the snapshot has no data for device {device}", hint=f"devices: {listing}")
        return device
    if not known:
        return 0
    return max(sorted(known), key=lambda d: (len(traces[d]) if d < len(traces) else 0,
                                             sum(1 for s in snap["segments"] if int(s.get("device", 0)) == d)))


# --------------------------------------------------------------------------- analysis
def _end_state(segs: Sequence[Mapping[str, Any]]) -> EndState:
    alloc = req = active = 0
    for _, b, _s in blocks_of(segs):
        state = b.get("state")
        if state == "active_allocated":
            alloc += int(b["size"])
            req += int(b.get("requested_size", b["size"]))
        if state in ("active_allocated", "active_awaiting_free", "active_pending_free"):
            active += int(b["size"])
    reserved = sum(int_field(s, "total_size", "a segment") for s in segs)
    return EndState(allocated=alloc, requested=req, active=active, reserved=reserved, segments=len(segs))


def analyze(
    snap: Mapping[str, Any], *, device: int | None = None, top: int = 10,
    max_points: int = 2000, simulate: bool = True,
) -> SnapshotAnalysis:
    """Analyse a memory snapshot dict (see the module docstring)."""
    snap = validate_snapshot(snap)
    dev = pick_device(snap, device)
    traces = snap.get("device_traces", [])
    entries: list[Mapping[str, Any]] = list(traces[dev]) if dev < len(traces) else []
    segs = [s for s in snap["segments"] if int(s.get("device", 0)) == dev]
    n = len(entries)
    notes: list[str] = []

    recs, seg_delta, oom_idx = walk_trace(entries)
    end = _end_state(segs)
    add_preexisting(recs, segs)

    verdicts = []
    rules: dict[str, int] = defaultdict(int)
    for r in recs:
        v = categorize(r.alloc_frames, r.free_frames, alive_at_end=r.free_index is None, label=r.label)
        rules[v.rule] += 1
        verdicts.append(v)

    # allocated after each entry (index k -> after entry k; start before entry 0)
    alloc_delta = [0] * n
    start_alloc = 0
    for r in recs:
        sz = rounded(r.size)
        if r.alloc_index >= 0:
            alloc_delta[r.alloc_index] += sz
        else:
            start_alloc += sz
        if r.free_index is not None:
            alloc_delta[r.free_index] -= sz
    start_res = end.reserved - sum(seg_delta)
    if start_res < 0:
        notes.append("the trace frees segments that the end state cannot account for; "
                     "reserved before the trace is clamped to 0")
        start_res = 0
    allocated = _cumsum(start_alloc, alloc_delta)
    reserved = _cumsum(start_res, seg_delta)
    if start_alloc or start_res:
        notes.append(
            f"{start_alloc:,} B allocated and {start_res:,} B reserved before the first trace entry "
            "(recording started late, or max_entries dropped older entries); "
            "their allocations are categorised 'unknown' unless their frames say more"
        )
    if n == 0:
        notes.append("no allocation history in this snapshot: only the end state is known "
                     "(record with torch.cuda.memory._record_memory_history())")

    pa = _argmax(allocated)
    pr = _argmax(reserved, allocated)
    peak_alloc, peak_res = allocated[pa], reserved[pr]
    frag = [1 - a / r if r else 0.0 for a, r in zip(allocated, reserved, strict=True)]

    allocs = tuple(
        Allocation(addr=r.addr, size=r.size, stream=r.stream, alloc_index=r.alloc_index,
                   free_index=r.free_index, category=v.category, rule=v.rule,
                   where=user_frames(r.alloc_frames or r.free_frames or []))
        for r, v in zip(recs, verdicts, strict=True)
    )
    keep = _decimate(allocated, reserved, max_points, (pa, pr))
    timeline = SnapshotTimeline(
        index=tuple(k - 1 for k in keep),
        allocated=tuple(allocated[k] for k in keep),
        reserved=tuple(reserved[k] for k in keep),
        by_category=_category_series(allocs, keep),
    )
    at_peak = [a for a in allocs if a.live_at(pa - 1)]
    breakdown = {c: 0 for c in CATEGORIES}
    for a in at_peak:
        breakdown[a.category] += rounded(a.size)
    segments_at_peak = segments_at(segs, entries, pr - 1,
                                   [(a.addr, rounded(a.size)) for a in allocs if a.live_at(pr - 1)])
    ooms = tuple(
        OomEvent(index=i, size=int_field(entries[i], "size", f"trace entry {i}"),
                 device_free=int(entries[i].get("device_free", 0) or 0),
                 allocated=allocated[i + 1], reserved=reserved[i + 1],
                 where=user_frames(frames_of(entries[i].get("frames"))))
        for i in oom_idx
    )
    if ooms:
        notes.append(f"{len(ooms)} out-of-memory event(s) recorded; the first asked for "
                     f"{ooms[0].size:,} B with {ooms[0].device_free:,} B free on the device")
    sim = _simulate(snap, dev) if simulate and n else None
    return SnapshotAnalysis(
        device=dev, entries=n,
        peak_allocated=peak_alloc, peak_allocated_index=pa - 1,
        peak_reserved=peak_res, peak_reserved_index=pr - 1,
        fragmentation_at_peak=frag[pr], fragmentation_at_allocated_peak=frag[pa],
        start_allocated=start_alloc, start_reserved=start_res, end=end,
        breakdown_at_peak=breakdown,
        largest=tuple(sorted(allocs, key=lambda a: (-a.size, a.alloc_index))[:top]),
        sites_at_peak=_sites(at_peak)[:top],
        segments_at_peak=segments_at_peak[:top], segments_at_peak_count=len(segments_at_peak),
        ooms=ooms, rules=dict(sorted(rules.items())), timeline=timeline, simulated=sim,
        notes=tuple(notes), allocator_settings=dict(snap.get("allocator_settings") or {}),
    )


def _cumsum(start: int, deltas: Sequence[int]) -> list[int]:
    out = [start]
    cur = start
    for d in deltas:
        cur += d
        out.append(cur)
    return out


def _argmax(xs: Sequence[int], tie: Sequence[int] | None = None) -> int:
    """First position of the maximum (ties broken by the highest ``tie`` value)."""
    best = 0
    for k in range(1, len(xs)):
        if xs[k] > xs[best] or (tie is not None and xs[k] == xs[best] and tie[k] > tie[best]):
            best = k
    return best


def _decimate(a: Sequence[int], r: Sequence[int], max_points: int, must: Sequence[int]) -> list[int]:
    """Point positions to keep: per bin the highest allocated and the highest reserved."""
    n = len(a)
    if n <= max_points:
        return list(range(n))
    bins = max(1, max_points // 2)
    keep = {0, n - 1, *must}
    for b in range(bins):
        lo, hi = b * n // bins, (b + 1) * n // bins
        if hi > lo:
            keep.add(max(range(lo, hi), key=a.__getitem__))
            keep.add(max(range(lo, hi), key=r.__getitem__))
    return sorted(keep)


def _category_series(allocs: Sequence[Allocation], keep: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Allocated bytes by category at the kept positions (position k = after entry k-1)."""
    changes: list[tuple[int, str, int]] = []
    cur = {c: 0 for c in CATEGORIES}
    for a in allocs:
        sz = rounded(a.size)
        if a.alloc_index < 0:
            cur[a.category] += sz
        else:
            changes.append((a.alloc_index + 1, a.category, sz))
        if a.free_index is not None:
            changes.append((a.free_index + 1, a.category, -sz))
    changes.sort(key=lambda c: c[0])
    out: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    j = 0
    for k in keep:
        while j < len(changes) and changes[j][0] <= k:
            cur[changes[j][1]] += changes[j][2]
            j += 1
        for c in CATEGORIES:
            out[c].append(cur[c])
    return {c: tuple(v) for c, v in out.items() if any(v) or c != UNKNOWN}


def _sites(live: Sequence[Allocation]) -> tuple[Site, ...]:
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for a in live:
        key = (a.where[0] if a.where else "<no frames>", a.category)
        acc[key][0] += rounded(a.size)
        acc[key][1] += 1
    sites = [Site(where=w, category=c, bytes=b, count=k) for (w, c), (b, k) in acc.items()]
    return tuple(sorted(sites, key=lambda s: (-s.bytes, s.where)))


def _simulate(snap: Mapping[str, Any], dev: int) -> Simulated:
    c = compare_with_recorded(snap, device=dev)
    return Simulated(
        allocated=c.result.max_allocated, reserved=c.simulated_peak_reserved,
        recorded_segment_events=c.recorded_segment_events, matching_segment_events=c.matching,
        match=c.match, complete=c.complete, conf=c.conf, reason=c.reason or c.first_mismatch,
        reserved_before=c.reserved_before_recording,
    )
