"""Write a predicted event trace in PyTorch's memory-snapshot format.

The result opens in pytorch.org/memory_viz and in ``torch.cuda._memory_viz`` (``trace_plot``,
``segment_plot``, ``segsum``) like a snapshot recorded on a GPU: the event log is replayed
through vramplan's caching-allocator simulation, which gives every block its address and
every segment its ``segment_alloc``/``segment_free`` (``segment_map``/``segment_unmap`` with
expandable segments). The snapshot holds

- ``device_traces[0]``: ``alloc``, ``free_requested`` + ``free_completed``, ``segment_*`` and
  ``oom`` entries in event order (``time_us`` is the event index); a run spread over several GPUs
  (``vramplan run`` of a device map: :attr:`MemoryReport.gpu_events`) has ``device_traces[N]`` for
  each GPU N, from that GPU's own allocator replay (an empty list for a GPU without events), as
  PyTorch writes one trace per device (``torch.cuda.memory._snapshot``: one per
  ``DeviceCachingAllocator``);
- ``segments``: the allocator's state after the last event, blocks and all, each with its
  ``device``;
- ``allocator_settings``: the simulated configuration;
- ``vramplan``: what produced it (model, method, predicted peaks), ignored by the viewers.

Frames name the module and the category instead of source lines, innermost first:
``{"filename": "model.layers.3.mlp", "line": 0, "name": "activation: aten.mm bf16[4,2048,11008]"}``,
then ``{"filename": "vramplan", "line": <iteration>, "name": "phase: backward"}``. Entries carry a
``category`` (the breakdown bucket), which the viewer's timeline colours by.

The pickle uses protocol 4 and only the opcodes PyTorch's JavaScript viewer reads.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from vramplan.errors import VramplanError
from vramplan.events import PHASES, Action, Category, EventLog

if TYPE_CHECKING:
    from vramplan.allocator import AllocatorConfig, CachingAllocator, SegmentInfo
    from vramplan.allocator.blocks import Block
    from vramplan.results import MemoryReport

PROTOCOL = 4
"""The JavaScript unpickler of the viewer reads protocols 2-4."""
UNKNOWN = "unknown"

Frames = list[dict[str, Any]]


def write_predicted_snapshot(
    log: EventLog, path: str | Path, *, conf: AllocatorConfig | str | None = None,
    report: MemoryReport | None = None, capacity: int | None = None,
    others: Sequence[tuple[int, EventLog]] | None = None,
) -> None:
    """Replay ``log`` through the allocator simulation (``conf``: a ``PYTORCH_CUDA_ALLOC_CONF``
    string or config) and write the snapshot pickle to ``path`` (``others``: see
    :func:`predicted_snapshot`)."""
    check_snapshot_path(path)
    snap = predicted_snapshot(log, conf=conf, report=report, capacity=capacity, others=others)
    p = Path(path)
    try:
        with open(p, "wb") as f:
            pickle.dump(snap, f, protocol=PROTOCOL)
    except OSError as e:
        raise VramplanError(f"cannot write '{p}': {e.strerror or e}", hint="choose a file in a folder you can write") from None


def check_snapshot_path(path: str | Path) -> Path:
    """Fail early (before a long trace) on a path the snapshot cannot be written to."""
    p = Path(path)
    if not p.parent.exists():
        raise VramplanError(f"cannot write '{p}': folder '{p.parent}' does not exist")
    if p.is_dir():
        raise VramplanError(f"cannot write '{p}': it is a folder", hint="name a file, e.g. predicted.pickle")
    return p


def predicted_snapshot(
    log: EventLog, *, conf: AllocatorConfig | str | None = None, report: MemoryReport | None = None,
    capacity: int | None = None, others: Sequence[tuple[int, EventLog]] | None = None,
) -> dict[str, Any]:
    """The snapshot dict (what :func:`write_predicted_snapshot` pickles). ``log`` is GPU 0's;
    ``others`` (index, log) of each other GPU of a run spread over several (default: the
    ``report``'s :attr:`~vramplan.results.MemoryReport.gpu_events`), each replayed through an
    allocator of its own into ``device_traces[index]`` and segments of that device."""
    from vramplan.allocator import CachingAllocator, parse_conf

    cfg = parse_conf(conf) if isinstance(conf, str) or conf is None else conf
    if cfg.backend != "native":
        raise VramplanError(f"a predicted snapshot needs the native allocator's addresses; {cfg.backend} is "
                            "only approximated", hint="drop backend:cudaMallocAsync from `alloc_conf`")
    if others is None:
        others = report.gpu_events if report is not None else ()
    logs = [(0, log), *sorted(others, key=lambda x: x[0])]
    traces: list[list[dict[str, Any]]] = [[] for _ in range(max(i for i, _ in logs) + 1)]
    segs: list[dict[str, Any]] = []
    for device, lg in logs:  # (one caching allocator per device, as PyTorch's NativeCachingAllocator keeps)
        al = CachingAllocator(cfg, capacity=capacity, record_segments=True)
        frames = _FrameMaker(lg)
        traces[device] = _Tracer(al, frames, capacity).run(lg)
        segs += [_segment(s, frames.for_event, device) for s in al.snapshot()]
    snap: dict[str, Any] = {
        "segments": segs,
        "device_traces": traces,
        "allocator_settings": _settings(cfg),
        "external_annotations": [],
        "vramplan": _provenance(report, log, others),
    }
    return snap


class _FrameMaker:
    """Frames per event, shared between events with the same description (small pickles)."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self._cache: dict[tuple[int, int, int, int, int, int], Frames] = {}

    def category(self, k: int) -> str:
        return Category(self.log.category[k]).bucket

    def for_event(self, k: int) -> Frames:
        if k < 0:
            return []
        lg = self.log
        key = (lg.module[k], lg.op[k], lg.category[k], lg.desc[k], lg.phase[k], lg.iteration[k])
        fr = self._cache.get(key)
        if fr is None:
            s = lg.strings
            what = " ".join(x for x in (s[lg.op[k]], s[lg.desc[k]]) if x)
            fr = [
                {"filename": s[lg.module[k]] or "(model)", "line": 0,
                 "name": f"{Category(lg.category[k]).label}: {what or 'tensor'}"},
                {"filename": "vramplan", "line": int(lg.iteration[k]), "name": f"phase: {PHASES[lg.phase[k]]}"},
            ]
            self._cache[key] = fr
        return fr


class _Live(NamedTuple):
    block: Block | None
    event: int
    """The ALLOC event's index."""
    addr: int
    stream: int


class _Tracer:
    """Replays the log (the same event semantics as :func:`vramplan.allocator.replay`) and
    writes the trace entries."""

    def __init__(self, al: CachingAllocator, frames: _FrameMaker, capacity: int | None) -> None:
        self.al = al
        self.frames = frames
        self.capacity = capacity
        self.out: list[dict[str, Any]] = []
        self.seen = 0
        """Segment events already turned into entries."""
        self.live: dict[int, _Live] = {}
        self.deferred: dict[int, _Live] = {}

    def run(self, log: EventLog) -> list[dict[str, Any]]:
        al = self.al
        for k in range(len(log)):
            act = Action(log.action[k])
            al.cur_event = k
            ident = log.id[k]
            if act is Action.ALLOC:
                self._alloc(k, ident, log.size[k], log.stream[k])
            elif act is Action.FREE:
                if ident in self.live:
                    lv = self.live.pop(ident)
                    if lv.block is not None:
                        self._entry("free_requested", lv, k)
                        al.free(lv.block)
                        self._entry("free_completed", lv, k)
                elif ident in self.deferred:
                    lv = self.deferred.pop(ident)
                    if lv.block is not None:
                        al.complete(lv.block)
                        self._entry("free_completed", lv, k)
                else:
                    raise VramplanError(f"event {k}: free of id {ident}, which is not allocated")
            elif act is Action.FREE_DEFERRED:
                if ident not in self.live:
                    raise VramplanError(f"event {k}: deferred free of id {ident}, which is not allocated")
                lv = self.live.pop(ident)
                if lv.block is not None:
                    self._entry("free_requested", lv, k)
                    al.free(lv.block, True)
                    self.deferred[ident] = lv
            elif act is Action.SYNC:
                al.synchronize()
                self._completed(k)
            elif act is Action.EMPTY_CACHE:
                al.empty_cache()
                self._completed(k)
            self._segments()
        return self.out

    def _alloc(self, k: int, ident: int, size: int, stream: int) -> None:
        if ident in self.live:
            raise VramplanError(f"event {k}: id {ident} allocated again before it was freed")
        if size <= 0:  # PyTorch does not call the allocator for empty tensors
            self.live[ident] = _Live(None, k, 0, stream)
            return
        retries = self.al.num_alloc_retries
        b = self.al.malloc(size, stream)
        if self.al.num_alloc_retries != retries:
            self._completed(k)  # the OOM path synchronises pending frees first
        self._segments()
        if b is None:  # counted and skipped, as the replay does; its FREE is skipped too
            free = max((self.capacity or 0) - self.al.reserved, 0)
            self.out.append({"action": "oom", "addr": 0, "size": size, "stream": stream, "device_free": free,
                             "time_us": k, "frames": self.frames.for_event(k), "category": self.frames.category(k)})
            self.live[ident] = _Live(None, k, 0, stream)
            return
        b.ev = k  # the end state's blocks name their allocating event
        lv = _Live(b, k, b.addr, stream)
        self.live[ident] = lv
        self._entry("alloc", lv, k)

    def _entry(self, action: str, lv: _Live, k: int) -> None:
        """``size`` is the requested size, as PyTorch records it for alloc and free entries;
        ``addr`` the block's address when it was allocated (merging moves a freed block's)."""
        self.out.append({
            "action": action, "addr": int(lv.addr), "size": int(self.frames.log.size[lv.event]),
            "stream": int(lv.stream), "time_us": k,
            "frames": self.frames.for_event(lv.event), "category": self.frames.category(lv.event),
        })

    def _completed(self, k: int) -> None:
        """free_completed entries for deferred frees that the allocator has now completed."""
        for ident, lv in list(self.deferred.items()):
            if lv.block is not None and not lv.block.events:
                del self.deferred[ident]
                self._entry("free_completed", lv, k)

    def _segments(self) -> None:
        events = self.al.seg_events or []
        while self.seen < len(events):
            action, addr, size, stream, k = events[self.seen]
            self.seen += 1
            self.out.append({"action": action, "addr": int(addr), "size": int(size), "stream": int(stream),
                             "time_us": max(int(k), 0), "frames": [], "category": UNKNOWN})


def _segment(s: SegmentInfo, frames: Callable[[int], Frames], device: int = 0) -> dict[str, Any]:
    blocks = [{
        "address": int(b.addr), "size": int(b.size), "requested_size": int(b.requested), "state": b.state,
        "frames": frames(b.event_index) if b.state != "inactive" else [],
    } for b in s.blocks]
    return {
        "device": device, "address": int(s.addr), "total_size": int(s.size), "stream": int(s.stream),
        "segment_type": s.pool, "segment_pool_id": (0, 0),
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
        "is_expandable": bool(s.expandable), "frames": [], "blocks": blocks,
    }


def _settings(cfg: Any) -> dict[str, Any]:
    from vramplan.allocator.constants import NO_LIMIT

    mss = cfg.max_split_size
    return {
        "PYTORCH_CUDA_ALLOC_CONF": cfg.text,
        "backend": cfg.backend,
        "max_split_size": -1 if mss >= NO_LIMIT else int(mss),
        "garbage_collection_threshold": float(cfg.garbage_collection_threshold),
        "expandable_segments": bool(cfg.expandable_segments),
        "roundup_power2_divisions": [int(d) for d in cfg.roundup_power2_divisions],
    }


def _provenance(report: MemoryReport | None, log: EventLog,
                others: Sequence[tuple[int, EventLog]] = ()) -> dict[str, Any]:
    d: dict[str, Any] = {"predicted": True, "events": len(log)}
    if others:  # (each other GPU's event count, by index: a run spread over several GPUs)
        d["gpu_events"] = {int(i): len(lg) for i, lg in others}
    try:
        from importlib.metadata import version

        d["version"] = version("vramplan")
    except Exception:  # not installed (running from a source tree)
        d["version"] = "unknown"
    if report is not None:
        d.update(model=report.model, method=str(report.method), workload=report.workload.to_dict(),
                 peak={"allocated": report.peak.allocated, "reserved": report.peak.reserved,
                       "device_used": report.peak.device_used})
        if report.gpus:
            d["gpus"] = [{"gpu": g.gpu, "allocated": g.allocated, "reserved": g.reserved,
                          "device_used": g.device_used} for g in report.gpus]
    return d
