"""The counters every allocator model keeps, named as ``torch.cuda.memory_stats()`` names them."""

from __future__ import annotations


class Counters:
    """Byte and event counters shared by the native and cudaMallocAsync models."""

    def _init_counters(self, record_segments: bool) -> None:
        self.allocated = 0
        self.active = 0
        self.requested = 0
        self.reserved = 0
        self.inactive_split = 0
        self.num_segments = 0
        """Segments as a snapshot lists them (expandable: contiguous mapped ranges)."""
        self.max_active = 0
        self.max_requested = 0
        self.max_segments = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.seg_events: list[tuple[str, int, int, int, int]] | None = [] if record_segments else None
        """(action, addr, size, stream, event index) when ``record_segments``."""
        self.cur_event = -1
        """Event index stamped on segment events (the replay sets it)."""

    def stats(self) -> dict[str, int]:
        """Current counters, named after ``torch.cuda.memory_stats()`` keys."""
        return {
            "allocated_bytes.all.current": self.allocated,
            "active_bytes.all.current": self.active,
            "requested_bytes.all.current": self.requested,
            "reserved_bytes.all.current": self.reserved,
            "inactive_split_bytes.all.current": self.inactive_split,
            "segment.all.current": self.num_segments,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

    def _record(self, action: str, addr: int, size: int, stream: int) -> None:
        if self.seg_events is not None:
            self.seg_events.append((action, addr, size, stream, self.cur_event))
