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
from dataclasses import dataclass
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


# --------------------------------------------------------------------------- before a trace
_BEFORE_TRACE: list[Callable[[], None]] = []


def on_first_trace(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` once, just before this process next traces a catalog model (torch and the
    model's code then imported, nothing stored answered): ``fit`` forks its sequence search
    there, so that a search answered from the store never imports torch and a child forked for
    one inherits the imports instead of repeating them. Returns a function that unregisters it."""
    _BEFORE_TRACE.append(fn)

    def cancel() -> None:
        if fn in _BEFORE_TRACE:
            _BEFORE_TRACE.remove(fn)

    return cancel


def tracing() -> None:
    """Called by the trace method just before it traces: runs what :func:`on_first_trace` registered."""
    while _BEFORE_TRACE:
        _BEFORE_TRACE.pop(0)()


# --------------------------------------------------------------------------- on disk
_DISK_KEYS: dict[int, str] = {}
"""id of a trace in this process → its key on disk (its replays are stored under it)."""


@dataclass(frozen=True)
class DiskKey:
    """Where a catalog trace lives on disk: its group (the key but for batch and sequence),
    its name in the group, and the whole key text the file must hold."""

    group: str
    name: str
    text: str
    batch: int
    seq: int


def disk_key(spec: ModelSpec, w: Workload, dev: DeviceProfile, options: Hashable) -> DiskKey | None:
    """The trace's key on disk (None where a field has no canonical text)."""
    from . import store

    try:
        fields = ";".join(f"{f.name}={store.canonical(getattr(w, f.name))}" for f in dataclasses.fields(w)
                          if f.name not in ("batch", "seq"))
        group = (f"trace|{store.fingerprint()}|{store.canonical(spec)}|{fields}|{store.canonical(dev)}|"
                 f"{store.canonical(options)}")
    except TypeError:
        return None
    return DiskKey(group=store.digest(group), name=f"b{w.batch}-s{w.seq}", text=f"{group}|batch={w.batch}|seq={w.seq}",
                   batch=w.batch, seq=w.seq)


def _remember(tr: TraceResult, key: DiskKey) -> None:
    import weakref

    _DISK_KEYS[id(tr)] = key.text
    weakref.finalize(tr, _DISK_KEYS.pop, id(tr), None)


def _nearby(spec: ModelSpec, w: Workload, dev: DeviceProfile, options: Hashable, key: DiskKey,
            disk: Any) -> TraceResult | None:
    """The trace at ``w``'s batch (or sequence length) written from three stored traces at other
    batches (lengths) of the same key (:mod:`vramplan.trace.nearby`), or None where none bracket
    it or they do not prove it."""
    if nearby_refusal(spec, w) is not None:
        return None
    stored: list[tuple[int, int]] = []
    for name in disk.names("trace", key.group):
        b, _, s = name.partition("-s")
        if b[:1] == "b" and b[1:].isdigit() and s.isdigit():
            stored.append((int(b[1:]), int(s)))
    from ..trace.nearby import SEQ_MODULUS, write_at

    for axis in ("batch", "seq"):
        if axis == "batch":
            others = [b for b, s in stored if s == key.seq and b != key.batch]
            x = key.batch
        else:
            others = [s for b, s in stored if b == key.batch and s != key.seq and s % SEQ_MODULUS == key.seq % SEQ_MODULUS]
            x = key.seq
        xs = _bracket(others, x, 3 if axis == "batch" else 4)
        if xs is None:
            continue
        results = []
        for v in xs:
            bb, ss = (v, key.seq) if axis == "batch" else (key.batch, v)
            wv = dataclasses.replace(w, batch=bb, seq=ss)
            got = TRACES.get(trace_key(spec, wv, dev, options))
            if got is None:
                text = key.text.rsplit("|batch=", 1)[0] + f"|batch={bb}|seq={ss}"
                got = disk.get("trace", key.group, f"b{bb}-s{ss}", text)
                if got is None or type(got).__name__ != "TraceResult":
                    break
                # (kept for this process: a search's confirmations ask for these very traces next)
                _remember(got, dataclasses.replace(key, name=f"b{bb}-s{ss}", text=text, batch=bb, seq=ss))
                TRACES.put(trace_key(spec, wv, dev, options), got)
            results.append(got)
        else:
            out = write_at(results, xs, x, axis)
            if isinstance(out, str):
                continue
            what = "batches" if axis == "batch" else "sequence lengths"
            note = (f"written from the traces at {what} {', '.join(map(str, xs))} (stored on disk), whose event "
                    f"logs are equal but for sizes collinear in the {axis} (`--no-cache` traces it)")
            return dataclasses.replace(out, notes=(*out.notes, note))
    return None


def _bracket(others: list[int], x: int, count: int) -> list[int] | None:
    """``count`` of ``others`` with ``x`` between the first and the last: the nearest below and
    above, and the nearest other ones (None where they do not exist)."""
    below = sorted(v for v in others if v < x)
    above = sorted(v for v in others if v > x)
    if not below or not above:
        return None
    picked = {below[-1], above[0]}
    rest = sorted((v for v in others if v not in picked), key=lambda v: (abs(v - x), v))
    if len(rest) < count - 2:
        return None
    return sorted(picked | set(rest[: count - 2]))


def nearby_refusal(spec: ModelSpec, w: Workload) -> str | None:
    """Why a trace of ``w`` is never written from nearby ones (a count that may step with the
    batch at points the three traces cannot see), or None."""
    if spec.is_moe:
        return "MoE routing rounds each expert's tokens"
    if w.compile:
        return "compile"
    if w.parallel.pp > 1:
        return "pipeline micro-batches divide the batch"
    if w.parallel.cp > 1 or w.parallel.sp:
        return "the sequence is sharded"
    return None


def cached_replay(tr: TraceResult, alloc_conf: str | None, capacity: int | None,
                  run: Callable[[], V]) -> V:
    key = replay_key(tr, alloc_conf, capacity)
    hit = REPLAYS.get(key)
    if hit is not None and hit[0] is tr:
        return hit[1]  # type: ignore[no-any-return]
    from . import store

    disk = store.default()
    text = _DISK_KEYS.get(id(tr))
    where = None
    if disk is not None and text is not None:
        tail = f"alloc_conf={alloc_conf or ''!r}|capacity={capacity!r}"
        where = (store.digest(text), "r" + store.digest(tail)[:24], f"replay|{text}|{tail}")
        got = disk.get("replay", *where)
        if got is not None:
            REPLAYS.put(key, (tr, got))
            return got  # type: ignore[no-any-return]
    res = run()
    REPLAYS.put(key, (tr, res))
    if where is not None and disk is not None:
        disk.put("replay", *where, res)
    return res


def cached_trace(spec: ModelSpec, w: Workload, dev: DeviceProfile, run: Callable[[], TraceResult], *,
                 options: Hashable = None) -> TraceResult:
    """The trace from this process's cache, else from the disk store (this workload's, or one
    written from nearby batches' traces), else ``run()`` (then stored on disk)."""
    key = trace_key(spec, w, dev, options)
    hit = TRACES.get(key)
    if hit is not None:
        return hit
    from . import store

    disk = store.default()
    dk = disk_key(spec, w, dev, options) if disk is not None else None
    if disk is not None and dk is not None:
        got = disk.get("trace", dk.group, dk.name, dk.text)
        if got is not None:
            got = dataclasses.replace(got, notes=(*got.notes, "the trace stored by an earlier run (`vramplan cache`; "
                                                  "`--no-cache` traces again)"))
        else:
            written = dataclasses.replace(dk, name="w" + dk.name[1:], text=dk.text + "|written")
            got = disk.get("trace", written.group, written.name, written.text)
            if got is None:
                got = _nearby(spec, w, dev, options, dk, disk)
                if got is not None:  # (stored apart: never one of the three a later one is written from)
                    disk.put("trace", written.group, written.name, written.text, got)
        if got is not None:
            _remember(got, dk)
            TRACES.put(key, got)
            return got  # type: ignore[no-any-return]
    tr = run()
    TRACES.put(key, tr)
    if disk is not None and dk is not None:
        disk.put("trace", dk.group, dk.name, dk.text, tr)
        _remember(tr, dk)
    return tr


__all__ = ["BoundedCache", "ModelPool", "TRACES", "REPLAYS", "MODELS", "clear", "spec_key", "trace_key", "replay_key", "cached_trace",
           "cached_replay", "disk_key", "DiskKey", "nearby_refusal", "on_first_trace", "tracing", "MAX_TRACES", "MAX_REPLAYS", "MAX_EVENTS", "MAX_MODELS", "MAX_MODULES"]
