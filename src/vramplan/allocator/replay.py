"""Replay an :class:`~vramplan.events.EventLog` through the allocator simulation.

Event semantics: ALLOC/FREE as recorded; FREE_DEFERRED frees a block used on another stream
(it stays active until a SYNC, an EMPTY_CACHE or the OOM path synchronises); a FREE of an id
whose deferred free is still pending completes just that one (how snapshot traces report
``free_completed``); SYNC completes every pending free; EMPTY_CACHE is
``torch.cuda.empty_cache()``. A zero-byte ALLOC takes no memory (PyTorch does not call the
allocator for it). An ALLOC that runs out of ``capacity`` is counted in ``ooms`` and skipped,
as is its later FREE (``first_oom``: the replay ends there instead, as a PyTorch run would).

The segment map at the reserved peak comes from a second run that stops at the peak event (a
map at every new peak would cost O(blocks) each time); the peak usually comes early (the first
iteration), so this costs little; ``segment_map=False`` skips it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from vramplan.errors import VramplanError
from vramplan.events import Category, EventLog

from . import fused as _fused
from .config import AllocatorConfig, as_config
from .mallocasync import MallocAsyncApprox
from .native import CachingAllocator
from .result import ReplayResult, ReplayTimeline, SegmentEvent, SegmentInfo

PERIODIC_MIN_EVENTS = 100_000
"""From this many events an uncapped plain replay fast-forwards repeats (:mod:`.periodic`);
shorter logs replay event by event (finding the repeats would cost more than it saves)."""

MAX_POINTS = 10_000
MAX_OOM_INDICES = 100
_MISSING: Any = object()


def make_allocator(conf: AllocatorConfig, capacity: int | None, record_segments: bool = False,
                   segment_addresses: Sequence[tuple[int, int]] | None = None,
                   ) -> CachingAllocator | MallocAsyncApprox:
    if conf.backend == "cudaMallocAsync":
        return MallocAsyncApprox(conf, capacity=capacity, record_segments=record_segments)
    return CachingAllocator(conf, capacity=capacity, record_segments=record_segments,
                            segment_addresses=segment_addresses)


class _Run:
    """Counters of one pass over the log."""

    __slots__ = ("max_allocated", "max_reserved", "peak_allocated_index", "peak_reserved_index",
                 "allocated_at_peak", "segments_at_peak", "oom_indices", "series", "reserved_changes")

    def __init__(self) -> None:
        self.max_allocated = 0
        self.max_reserved = 0
        self.peak_allocated_index = -1
        self.peak_reserved_index = -1
        self.allocated_at_peak = 0
        self.segments_at_peak = 0
        self.oom_indices: list[int] = []
        self.series: tuple[array, ...] | None = None
        self.reserved_changes: list[tuple[int, int]] = []


def _run(log: EventLog, al: CachingAllocator | MallocAsyncApprox, *, stop: int = -1,
         tag: bool = False, timeline: bool = False, fused: bool = True, first_oom: bool = False) -> _Run:
    """One pass; ``stop`` ≥ 0 ends after that event; ``first_oom`` ends at the first ALLOC
    that runs out of memory; ``tag`` stamps event indices. Without a timeline the native
    allocator takes the fused loop (:mod:`.fused`) unless ``fused=False``."""
    if not timeline and fused and _fused.eligible(al):
        return _run_plain(log, al, fused=True, stop=stop, tag=tag, first_oom=first_oom)
    if stop < 0 and not tag and not timeline:
        return _run_plain(log, al, first_oom=first_oom)
    out = _Run()
    malloc = al.malloc
    live: dict[int, Any] = {}
    deferred: dict[int, Any] = {}
    max_a = max_r = 0
    ia = ir = -1
    last_r = 0
    changes = out.reserved_changes
    if timeline:
        s_alloc, s_act, s_req, s_res, s_inact = (array("q") for _ in range(5))
        out.series = (s_alloc, s_act, s_req, s_res, s_inact)
    n = len(log) if stop < 0 else min(len(log), stop + 1)
    rows = zip(range(n), log.action, log.id, log.size, log.stream, strict=False)
    for k, act, ident, size, stream in rows:
        if tag:
            al.cur_event = k
        if act == 0:  # ALLOC
            if ident in live:
                raise VramplanError(f"event {k}: id {ident} allocated again before it was freed")
            if size > 0:
                b = malloc(size, stream)
                if b is None:
                    if len(out.oom_indices) < MAX_OOM_INDICES:
                        out.oom_indices.append(k)
                    if first_oom:
                        break
                elif tag:
                    b.ev = k
                live[ident] = b
            else:
                live[ident] = None
            a = al.allocated
            if a > max_a:
                max_a = a
                ia = k
            r = al.reserved
            if r != last_r:
                changes.append((k, r))
                last_r = r
            if r > max_r:
                max_r = r
                ir = k
                out.allocated_at_peak = a
                out.segments_at_peak = al.num_segments
        elif act == 1:  # FREE
            _free(live, deferred, al, k, ident)
        elif act == 2:  # FREE_DEFERRED
            _free_deferred(live, deferred, al, k, ident)
        elif act == 3:  # SYNC
            al.synchronize()
            deferred.clear()
        elif act == 4:  # EMPTY_CACHE
            al.empty_cache()
            r = al.reserved
            if r != last_r:
                changes.append((k, r))
                last_r = r
        if timeline:
            s_alloc.append(al.allocated)
            s_act.append(al.active)
            s_req.append(al.requested)
            s_res.append(al.reserved)
            s_inact.append(al.inactive_split)
    out.max_allocated, out.max_reserved = max_a, max_r
    out.peak_allocated_index, out.peak_reserved_index = ia, ir
    return out


def _run_plain(log: EventLog, al: CachingAllocator | MallocAsyncApprox, *, fused: bool = False,
               stop: int = -1, tag: bool = False, first_oom: bool = False) -> _Run:
    """:func:`_run` over the whole log without tags or a timeline: the hot loop of every
    estimate (the same semantics, fewer branches per event). ``fused``: the native allocator's
    malloc and free inlined in the loop (:mod:`.fused`; the same decisions, 1.1–1.5× faster),
    which also takes ``stop`` and ``tag`` (see :func:`_run`; the method loop here ignores them)."""
    out = _Run()
    if fused:
        (out.max_allocated, out.peak_allocated_index, out.max_reserved, out.peak_reserved_index,
         out.allocated_at_peak, out.segments_at_peak, out.oom_indices, out.reserved_changes) = _fused.run(
            al, log.action, log.id, log.size, log.stream, MAX_OOM_INDICES,  # type: ignore[arg-type]
            stop=stop, tag=tag, first_oom=first_oom)
        return out
    malloc = al.malloc
    free = al.free
    live: dict[int, Any] = {}
    deferred: dict[int, Any] = {}
    max_a = max_r = last_r = 0
    ia = ir = -1
    changes = out.reserved_changes
    k = -1
    for act, ident, size, stream in zip(log.action, log.id, log.size, log.stream, strict=False):
        k += 1
        if act == 0:
            if ident in live:
                raise VramplanError(f"event {k}: id {ident} allocated again before it was freed")
            if size > 0:
                b = malloc(size, stream)
                if b is None:
                    if len(out.oom_indices) < MAX_OOM_INDICES:
                        out.oom_indices.append(k)
                    if first_oom:
                        break
                live[ident] = b
                a = al.allocated
                if a > max_a:
                    max_a = a
                    ia = k
                r = al.reserved
                if r != last_r:
                    changes.append((k, r))
                    last_r = r
                    if r > max_r:
                        max_r = r
                        ir = k
                        out.allocated_at_peak = a
                        out.segments_at_peak = al.num_segments
            else:
                live[ident] = None
        elif act == 1:
            b = live.pop(ident, _MISSING)
            if b is None:
                continue
            if b is _MISSING:
                _free(live, deferred, al, k, ident)
            else:
                free(b)
        elif act == 2:
            _free_deferred(live, deferred, al, k, ident)
        elif act == 3:
            al.synchronize()
            deferred.clear()
        elif act == 4:
            al.empty_cache()
            r = al.reserved
            if r != last_r:
                changes.append((k, r))
                last_r = r
    out.max_allocated, out.max_reserved = max_a, max_r
    out.peak_allocated_index, out.peak_reserved_index = ia, ir
    return out


def _from_periodic(f: Any, al: CachingAllocator | MallocAsyncApprox) -> _Run:
    """A :class:`.periodic.Figures` as one pass's counters, and as the state ``al`` would
    have after that pass (the counters the result reads)."""
    al.max_active, al.max_requested, al.max_segments = f.max_active, f.max_requested, f.max_segments
    al.allocated, al.reserved = f.final_allocated, f.final_reserved
    out = _Run()
    out.max_allocated, out.peak_allocated_index = f.max_allocated, f.peak_allocated_index
    out.max_reserved, out.peak_reserved_index = f.max_reserved, f.peak_reserved_index
    out.allocated_at_peak, out.segments_at_peak = f.allocated_at_peak, f.segments_at_peak
    out.reserved_changes = f.reserved_changes
    return out


def _free(live: dict[int, Any], deferred: dict[int, Any], al: Any, k: int, ident: int) -> None:
    b = live.pop(ident, _MISSING)
    if b is _MISSING:
        d = deferred.pop(ident, _MISSING)
        if d is _MISSING:
            raise VramplanError(f"event {k}: free of id {ident}, which is not allocated")
        if d is not None:  # (None: a zero-byte or OOM'd storage, which has no block)
            al.complete(d)
    elif b is not None:
        al.free(b)


def _free_deferred(live: dict[int, Any], deferred: dict[int, Any], al: Any, k: int, ident: int) -> None:
    b = live.pop(ident, _MISSING)
    if b is _MISSING:
        raise VramplanError(f"event {k}: deferred free of id {ident}, which is not allocated")
    if b is not None:
        al.free(b, True)
    deferred[ident] = b  # its completion may still come (a FREE of the id)


def _timeline(series: tuple[array, ...], full: bool, max_points: int) -> ReplayTimeline:
    n = len(series[0])
    if full or n <= max_points:
        a, act, req, res, inact = (tuple(s) for s in series)
        return ReplayTimeline(tuple(range(n)), a, act, req, res, inact, False)
    step = -(-n // max_points)
    index = tuple(range(0, n, step))
    a, act, req, res, inact = (tuple(max(s[i:i + step]) for i in index) for s in series)
    return ReplayTimeline(index, a, act, req, res, inact, True)


def _label(log: EventLog) -> Any:
    cats = log.category

    def label(index: int) -> str:
        return Category(cats[index]).label

    return label


def final_segments(log: EventLog, conf: AllocatorConfig | str | None = None, *,
                   capacity: int | None = None,
                   segment_addresses: Sequence[tuple[int, int]] | None = None,
                   ) -> tuple[SegmentInfo, ...]:
    """The segment map after the last event (what ``torch.cuda.memory._snapshot()`` would
    list at the end). ``segment_addresses``: see :func:`replay`."""
    cfg = as_config(conf)
    al = make_allocator(cfg, capacity, segment_addresses=segment_addresses)
    _run(log, al, tag=True)
    return al.snapshot(_label(log))


def replay(log: EventLog, conf: AllocatorConfig | str | None = None, *,
           capacity: int | None = None, record_timeline: bool = False,
           record_segments: bool = False, full_timeline: bool = False,
           max_points: int = MAX_POINTS, segment_map: bool = True,
           segment_addresses: Sequence[tuple[int, int]] | None = None,
           first_oom: bool = False) -> ReplayResult:
    """Replay ``log`` through the caching allocator configured by ``conf``.

    ``capacity``: bytes the allocator may reserve in total (the GPU's memory less what lies
    outside PyTorch); None never runs out. ``record_timeline``: counters after every event
    (decimated to ``max_points`` bucket maxima unless ``full_timeline``). ``record_segments``:
    the segment events (segment_alloc/free, segment_map/unmap). ``segment_map``: the segments
    and their blocks at the reserved peak. ``segment_addresses``: the (address, size) of
    each segment cudaMalloc returned when the log was recorded, in order (a snapshot's
    ``segment_alloc`` entries); new segments take them while the sizes agree, so address-
    ordered ties break as on the GPU (native backend without expandable segments only).
    ``first_oom``: end at the first ALLOC that runs out of ``capacity`` (PyTorch raises there:
    ``ooms`` is then 0 or 1 and the figures are those up to that event) instead of skipping it
    and going on.
    """
    cfg = as_config(conf)
    if capacity is not None and capacity < 0:
        raise VramplanError(f"capacity must be >= 0 bytes, got {capacity}")
    al = make_allocator(cfg, capacity, record_segments, segment_addresses)
    fast = None
    if not (record_segments or record_timeline) and len(log) >= PERIODIC_MIN_EVENTS:
        from . import periodic  # (numpy: only for long logs)

        if periodic.applies(al):
            fast = periodic.run(log, cfg)  # (None where it does not apply: then event by event)
    run = _from_periodic(fast, al) if fast is not None else _run(log, al, tag=record_segments, timeline=record_timeline,
                                                             first_oom=first_oom)
    notes = list(cfg.notes)
    backend = "native"
    if cfg.backend == "cudaMallocAsync":
        backend = "cudaMallocAsync (approximation)"
        notes.append("cudaMallocAsync is approximated: reserved = high-water of live bytes in "
                     "2 MiB granules, no fragmentation model (a lower bound)")
    if cfg.per_process_memory_fraction < 1.0 and capacity is None:
        notes.append("per_process_memory_fraction needs a capacity to act on; ignored")

    seg_map: tuple[SegmentInfo, ...] = ()
    seg_events: tuple[SegmentEvent, ...] | None = None
    if record_segments:
        assert al.seg_events is not None
        seg_events = tuple(SegmentEvent(*e) for e in al.seg_events)
    if segment_map and run.peak_reserved_index >= 0:
        al2 = make_allocator(cfg, capacity, segment_addresses=segment_addresses)
        _run(log, al2, stop=run.peak_reserved_index, tag=True)
        seg_map = al2.snapshot(_label(log))

    peak_res = run.max_reserved
    frag = 1.0 - run.allocated_at_peak / peak_res if peak_res else 0.0
    return ReplayResult(
        backend=backend, conf=cfg, events=len(log),
        max_allocated=run.max_allocated, max_reserved=peak_res,
        max_active=al.max_active, max_requested=al.max_requested,
        segments=run.segments_at_peak, max_segments=al.max_segments,
        peak_reserved_index=run.peak_reserved_index,
        peak_allocated_index=run.peak_allocated_index,
        allocated_at_peak=run.allocated_at_peak, fragmentation_at_peak=frag,
        alloc_retries=al.num_alloc_retries, ooms=al.num_ooms,
        oom_indices=tuple(run.oom_indices), final_allocated=al.allocated,
        final_reserved=al.reserved, segment_map_at_peak=seg_map, segment_events=seg_events,
        timeline=_timeline(run.series, full_timeline, max_points) if run.series else None,
        reserved_changes=tuple(run.reserved_changes),
        notes=tuple(notes),
    )

