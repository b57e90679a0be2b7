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
selective-checkpointing policy function are never cached.

A third store, :data:`MODELS`, keeps the catalog models a trace built and prepared (on
``meta``; :mod:`vramplan.trace.reuse`): a later trace of the same model and workload at
another batch or sequence length borrows one instead of building it again (``fit`` and
``plan`` trace one model at several batches). A model is lent to one trace at a time.
"""

from __future__ import annotations

import dataclasses
import json
import threading
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
MAX_MODELS = 6
"""Prepared models kept per process: the three reduced models of a replicated trace, for two
workloads."""
MAX_MODULES = 20_000
"""Modules (over all kept models) kept per process: a model with more is not kept."""
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

    def pop(self, key: Hashable) -> V | None:
        """Remove and return the entry under ``key`` (a hit), or None (a miss)."""
        if not self.enabled:
            return None
        got = self._data.pop(key, None)
        if got is None:
            self.misses += 1
            return None
        self.weight -= got[1]
        self.hits += 1
        return got[0]

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


class ModelPool:
    """Prepared models waiting between traces (a :class:`vramplan.trace.reuse.ModelStore`):
    keyed by the whole model spec and the trace's key (every workload field but batch and
    sequence, the attention, the device profile), bounded like the caches above, and lent:
    :meth:`take` removes the model, so two traces (threads of the web UI) never share one."""

    def __init__(self, max_entries: int = MAX_MODELS, max_modules: int = MAX_MODULES) -> None:
        self.cache: BoundedCache[Any] = BoundedCache(max_entries, max_modules, lambda v: int(v.modules))
        self._lock = threading.Lock()

    def take(self, spec: ModelSpec, key: Hashable) -> Any:
        k = (spec_key(spec), key)
        with self._lock:
            return self.cache.pop(k)

    def give(self, spec: ModelSpec, key: Hashable, value: Any) -> None:
        k = (spec_key(spec), key)
        with self._lock:
            self.cache.put(k, value)

    def clear(self) -> None:
        with self._lock:
            self.cache.clear()


TRACES: BoundedCache[TraceResult] = BoundedCache(MAX_TRACES, MAX_EVENTS, _events)
REPLAYS: BoundedCache[tuple[TraceResult, Any]] = BoundedCache(MAX_REPLAYS, MAX_EVENTS, lambda v: len(v[0].events))
MODELS = ModelPool()


def clear() -> None:
    """Forget every cached trace, replay and prepared model (tests; a process that changed a
    model in place)."""
    TRACES.clear()
    REPLAYS.clear()
    MODELS.clear()


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


def trace_key(spec: ModelSpec, w: Workload, dev: DeviceProfile, options: Hashable = None) -> Hashable:
    """The key of a catalog-model trace (``options``: its ``TraceOptions``, which read the
    environment, e.g. ``VRAMPLAN_FULL_TRACE``)."""
    return (spec_key(spec), w, dev, options)


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


def cached_trace(spec: ModelSpec, w: Workload, dev: DeviceProfile, run: Callable[[], TraceResult], *,
                 options: Hashable = None) -> TraceResult:
    key = trace_key(spec, w, dev, options)
    hit = TRACES.get(key)
    if hit is not None:
        return hit
    tr = run()
    TRACES.put(key, tr)
    return tr


__all__ = ["BoundedCache", "ModelPool", "TRACES", "REPLAYS", "MODELS", "clear", "spec_key", "trace_key", "replay_key", "cached_trace",
           "cached_replay", "MAX_TRACES", "MAX_REPLAYS", "MAX_EVENTS", "MAX_MODELS", "MAX_MODULES"]
