"""Process-wide, bounded caches of traces and allocator replays.

A trace of a catalog model is a pure function of the model spec, the workload and the
device profile (traces are deterministic: automatic garbage collection is off during a trace,
see ``trace.run._collect_deterministically``), and a replay is a pure function of the event
log, the allocator configuration and the capacity. A process that estimates the same
workload twice — the web UI, a notebook, ``fit`` after ``estimate``, a sweep over points a
search already confirmed — reuses the first result instead of tracing again.

Both caches are bounded (entries and total events held, least recently used first out), keyed
by everything the result depends on (a spec by all its fields and its config, the whole
workload, the whole device profile; a replay by the identity of the trace it replayed, held
alive by the entry), and can be cleared or switched off (``enabled``). Traces run with a
selective-checkpointing policy function or non-default options are never cached.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from ..models.spec import ModelSpec
    from ..target import DeviceProfile
    from ..trace.result import TraceResult
    from ..workload import Workload

V = TypeVar("V")

MAX_TRACES = 8
"""Traces kept per process."""
MAX_REPLAYS = 16
"""Replay results kept per process."""
MAX_EVENTS = 4_000_000
"""Events (over all cached traces) kept per process, about 150 MB of event log: a 70B
generation trace holds 1.8 M; a trace larger than this is not cached."""


class BoundedCache(Generic[V]):
    """Least-recently-used cache bounded by entries and by a total weight."""

    def __init__(self, max_entries: int, max_weight: int, weigh: Callable[[V], int]) -> None:
        if max_entries < 1 or max_weight < 1:
            raise ValueError("a bounded cache needs room for at least one entry")
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._weigh = weigh
        self._data: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.weight = 0
        self.hits = 0
        self.misses = 0
        self.enabled = True

    def get(self, key: Hashable) -> V | None:
        if not self.enabled:
            return None
        hit = self._data.get(key)
        if hit is None:
            self.misses += 1
            return None
        self._data.move_to_end(key)
        self.hits += 1
        return hit[0]

    def put(self, key: Hashable, value: V) -> None:
        if not self.enabled:
            return
        w = self._weigh(value)
        if w > self.max_weight:
            return
        old = self._data.pop(key, None)
        if old is not None:
            self.weight -= old[1]
        self._data[key] = (value, w)
        self.weight += w
        while len(self._data) > self.max_entries or self.weight > self.max_weight:
            _, (_, ow) = self._data.popitem(last=False)
            self.weight -= ow

    def clear(self) -> None:
        self._data.clear()
        self.weight = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data


def _events(tr: Any) -> int:
    return len(tr.events)


TRACES: BoundedCache[TraceResult] = BoundedCache(MAX_TRACES, MAX_EVENTS, _events)
REPLAYS: BoundedCache[tuple[TraceResult, Any]] = BoundedCache(MAX_REPLAYS, MAX_EVENTS, lambda v: len(v[0].events))


def clear() -> None:
    """Forget every cached trace and replay (tests; a process that changed a model in place)."""
    TRACES.clear()
    REPLAYS.clear()


def _frozen(x: Any) -> Hashable:
    if isinstance(x, Mapping):
        return json.dumps(x, sort_keys=True, default=repr)
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    if isinstance(x, (set, frozenset)):
        return tuple(sorted(repr(v) for v in x))
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x  # type: ignore[no-any-return]


def spec_key(spec: ModelSpec) -> Hashable:
    """Every field of a model spec (its config as canonical JSON): two specs share a key only
    when nothing the trace could read differs."""
    return (type(spec).__qualname__,
            tuple((f.name, _frozen(getattr(spec, f.name))) for f in dataclasses.fields(spec)))


def trace_key(spec: ModelSpec, w: Workload, dev: DeviceProfile) -> Hashable:
    """The key of a catalog-model trace with default options."""
    return (spec_key(spec), w, dev)


def replay_key(tr: TraceResult, alloc_conf: str | None, capacity: int | None) -> Hashable:
    """A replay of this very trace object (held alive by its entry, so the id stays its own)."""
    return (id(tr), alloc_conf or "", capacity)


def cached_replay(tr: TraceResult, alloc_conf: str | None, capacity: int | None,
                  run: Callable[[], V]) -> V:
    key = replay_key(tr, alloc_conf, capacity)
    hit = REPLAYS.get(key)
    if hit is not None and hit[0] is tr:
        return hit[1]  # type: ignore[no-any-return]
    res = run()
    REPLAYS.put(key, (tr, res))
    return res


def cached_trace(spec: ModelSpec, w: Workload, dev: DeviceProfile, run: Callable[[], TraceResult]) -> TraceResult:
    key = trace_key(spec, w, dev)
    hit = TRACES.get(key)
    if hit is not None:
        return hit
    tr = run()
    TRACES.put(key, tr)
    return tr


__all__ = ["BoundedCache", "TRACES", "REPLAYS", "clear", "spec_key", "trace_key", "replay_key", "cached_trace",
           "cached_replay", "MAX_TRACES", "MAX_REPLAYS", "MAX_EVENTS"]
