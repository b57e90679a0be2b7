"""What a replay returns: frozen, plain data (integer bytes); rendering lives elsewhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .config import AllocatorConfig

BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")
"""Block states as PyTorch's memory snapshot names them."""

SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


@dataclass(frozen=True)
class BlockInfo:
    addr: int
    size: int
    requested: int
    """Requested bytes of the live tensor (0 for free blocks)."""
    state: str
    """``active_allocated``, ``active_pending_free`` (freed, awaiting another stream) or ``inactive``."""
    category: str = ""
    """The event log's category of the allocation (e.g. ``activation``); empty when free/unknown."""
    event_index: int = -1
    """Index of the ALLOC event that made this block (-1 when free)."""


@dataclass(frozen=True)
class SegmentInfo:
    """A segment as a memory snapshot lists it (for expandable segments: one contiguous mapped
    range). ``blocks`` tile it exactly."""

    addr: int
    size: int
    stream: int
    pool: str
    """``small`` or ``large``."""
    expandable: bool
    blocks: tuple[BlockInfo, ...]

    @property
    def allocated(self) -> int:
        return sum(b.size for b in self.blocks if b.state == "active_allocated")

    @property
    def active(self) -> int:
        return sum(b.size for b in self.blocks if b.state != "inactive")


@dataclass(frozen=True)
class SegmentEvent:
    """A change of reserved memory, as in a snapshot's device trace."""

    action: str
    """``segment_alloc`` / ``segment_free`` (cudaMalloc / cudaFree) or ``segment_map`` /
    ``segment_unmap`` (expandable segments)."""
    addr: int
    size: int
    stream: int
    event_index: int
    """Index of the event-log event during which it happened."""


@dataclass(frozen=True)
class ReplayTimeline:
    """Byte counters after each event, or after each bucket of events when decimated (then
    every series holds the bucket's maximum and ``index`` the bucket's first event)."""

    index: Sequence[int]
    allocated: Sequence[int]
    active: Sequence[int]
    requested: Sequence[int]
    reserved: Sequence[int]
    inactive_split: Sequence[int]
    decimated: bool = False

    @property
    def fragmentation(self) -> tuple[float, ...]:
        """1 − allocated/reserved per point (0 where nothing is reserved)."""
        return tuple(1.0 - a / r if r else 0.0 for a, r in zip(self.allocated, self.reserved, strict=True))


@dataclass(frozen=True)
class ReplayResult:
    """Statistics of one replay, named as ``torch.cuda.memory_stats()`` names them."""

    backend: str
    """``native`` or ``cudaMallocAsync (approximation)``."""
    conf: AllocatorConfig
    events: int
    max_allocated: int
    """Predicted ``torch.cuda.max_memory_allocated()``."""
    max_reserved: int
    """Predicted ``torch.cuda.max_memory_reserved()``."""
    max_active: int
    max_requested: int
    segments: int
    """Segments at the reserved peak (expandable segments: contiguous mapped ranges)."""
    max_segments: int
    peak_reserved_index: int
    """First event after which reserved reached its peak (-1: nothing reserved)."""
    peak_allocated_index: int
    allocated_at_peak: int
    """Allocated bytes at the reserved peak."""
    fragmentation_at_peak: float
    """1 − allocated/reserved at the reserved peak."""
    alloc_retries: int
    """``num_alloc_retries``: cudaMalloc retried after freeing every cached segment."""
    ooms: int
    """``num_ooms``: requests that failed even then (counted and skipped)."""
    oom_indices: tuple[int, ...] = ()
    """Event indices of the first OOMs (at most 100)."""
    final_allocated: int = 0
    final_reserved: int = 0
    segment_map_at_peak: tuple[SegmentInfo, ...] = ()
    """Segments and blocks after the peak-reserved event (empty with ``segment_map=False``)."""
    segment_events: tuple[SegmentEvent, ...] | None = None
    timeline: ReplayTimeline | None = None
    reserved_changes: tuple[tuple[int, int], ...] = ()
    """(event index, reserved bytes after it) at every change of reserved: the exact reserved
    curve at a fraction of a timeline's cost."""
    notes: tuple[str, ...] = ()

    def to_dict(self, *, segments: bool = False) -> dict[str, Any]:
        """JSON-ready dict; sizes are integer bytes. ``segments`` adds the segment map/events."""
        d: dict[str, Any] = {
            "backend": self.backend,
            "conf": self.conf.text,
            "events": self.events,
            "max_allocated": self.max_allocated,
            "max_reserved": self.max_reserved,
            "max_active": self.max_active,
            "max_requested": self.max_requested,
            "segments": self.segments,
            "max_segments": self.max_segments,
            "peak_reserved_index": self.peak_reserved_index,
            "peak_allocated_index": self.peak_allocated_index,
            "allocated_at_peak": self.allocated_at_peak,
            "fragmentation_at_peak": self.fragmentation_at_peak,
            "alloc_retries": self.alloc_retries,
            "ooms": self.ooms,
            "final_allocated": self.final_allocated,
            "final_reserved": self.final_reserved,
            "notes": list(self.notes),
        }
        if segments:
            d["segment_map_at_peak"] = [dataclasses.asdict(s) for s in self.segment_map_at_peak]
            if self.segment_events is not None:
                d["segment_events"] = [dataclasses.asdict(e) for e in self.segment_events]
        return d
