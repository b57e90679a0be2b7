"""The memory figures a script reads (``torch.cuda.memory_allocated()``, ``memory_stats()``…):
the caching-allocator simulation fed with the events recorded so far."""

from __future__ import annotations

from typing import Any

from ..allocator import CachingAllocator, parse_conf
from ..events import EventLog


class LiveAllocator:
    """Replays the recorded events incrementally, so the script's memory queries get the
    simulation's figures at the moment it asks."""

    def __init__(self, log: EventLog, conf: str | None = None, capacity: int | None = None) -> None:
        self.log = log
        self.al = CachingAllocator(parse_conf(conf or ""), capacity=capacity)
        self._pos = 0
        self._live: dict[int, Any] = {}
        self.peak_allocated = 0
        self.peak_reserved = 0

    def sync(self) -> CachingAllocator:
        log, al, live = self.log, self.al, self._live
        n = len(log)
        for k in range(self._pos, n):
            act = log.action[k]
            if act == 0:
                size = log.size[k]
                live[log.id[k]] = al.malloc(size, log.stream[k]) if size > 0 else None
                self.peak_allocated = max(self.peak_allocated, al.allocated)
                self.peak_reserved = max(self.peak_reserved, al.reserved)
            elif act in (1, 2):
                b = live.pop(log.id[k], None)
                if b is not None:
                    al.free(b)
            elif act == 4:
                al.empty_cache()
        self._pos = n
        return al

    def reset_peaks(self) -> None:
        al = self.sync()
        self.peak_allocated, self.peak_reserved = al.allocated, al.reserved

    def stats(self) -> dict[str, int]:
        al = self.sync()
        return {
            "allocated_bytes.all.current": al.allocated, "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": al.reserved, "reserved_bytes.all.peak": self.peak_reserved,
            "active_bytes.all.current": al.active, "active_bytes.all.peak": al.max_active,
            "requested_bytes.all.current": al.requested, "requested_bytes.all.peak": al.max_requested,
            "num_alloc_retries": al.num_alloc_retries, "num_ooms": al.num_ooms,
            "segment.all.current": al.num_segments,
        }

