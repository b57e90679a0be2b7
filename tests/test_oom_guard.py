"""The out-of-memory guard of `vramplan run` (script.oom): where, inside a recovering handler, the
allocator frees its cache, the run's own replay is told to free it there too."""

from __future__ import annotations

import pytest

from vramplan.emulate import LiveAllocator
from vramplan.events import EventLog
from vramplan.script.oom import OomGuard

MIB = 2**20


def _guard(log: EventLog, capacity: int) -> tuple[OomGuard, list[str]]:
    heard: list[str] = []
    g = OomGuard(capacity=capacity, total=capacity, replay=LiveAllocator(log, None, capacity=capacity))
    g.on_release = lambda: heard.append("release")
    g.depth = 1  # inside a handler
    return g, heard


def test_the_cache_freed_to_fit_or_before_the_error_is_heard() -> None:
    log = EventLog()
    log.alloc(1, 40 * MIB)
    log.free(1)  # a 40 MiB segment stays cached
    g, heard = _guard(log, 64 * MIB)
    g(20 * MIB)  # fits inside the cached segment: nothing freed
    assert heard == []
    g(50 * MIB)  # fits only once the cached 40 MiB segment is released
    assert heard == ["release"] and g.released == 1 and not g.raised
    log.alloc(2, 50 * MIB)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        g(30 * MIB)  # does not fit even after freeing the cache: CUDA's allocator released it before raising
    assert heard == ["release", "release"] and len(g.raised) == 1
    g.depth = 0
    g(500 * MIB)  # outside a handler the run goes on past the GPU
    assert len(g.raised) == 1

