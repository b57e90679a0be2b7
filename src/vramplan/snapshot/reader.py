"""Read PyTorch memory snapshots safely, turn their traces into events, check the simulator.

A snapshot (``torch.cuda.memory._dump_snapshot``) is a pickle of plain containers:
``segments`` (the final state), ``device_traces`` (one list of trace entries per device, a ring
buffer of ``max_entries``), ``allocator_settings`` and ``external_annotations``. Unpickling an
untrusted file runs code, so :func:`load_snapshot` uses an unpickler that refuses every global
(dicts, lists, tuples, strings, numbers, bools and None are all it can build).

Trace entry fields (``TraceEntry`` in CUDACachingAllocator.h, ``_memory_viz.py``): ``alloc``,
``free_requested`` and ``free_completed`` carry the *requested* size of the tensor (not the
rounded block size); ``segment_alloc``/``segment_free`` the cudaMalloc'd segment size;
``segment_map``/``segment_unmap`` the mapped range of an expandable segment; ``oom`` the rounded
request and ``device_free`` instead of ``addr``.

Conversion (:func:`snapshot_to_events`): ``alloc`` → ALLOC; ``free_requested`` directly
followed by its ``free_completed`` → FREE (PyTorch records both in one call); otherwise the
block had cross-stream uses → FREE_DEFERRED, and the later ``free_completed`` → FREE (which
completes just that block). A run of ``segment_free``/``segment_unmap`` entries → EMPTY_CACHE
(empty_cache() itself leaves no entry). Streams are renumbered 0, 1, … in the order of their
handles, which keeps PyTorch's (stream, size, address) ordering. ``oom`` entries produce no
event (the caller never got the tensor).

Traces that do not start at process start: the ring buffer keeps the *last* ``max_entries``
entries, and the state before the first one is unknown (the final ``segments`` only describe the
end). :func:`trace_completeness` detects this — an ``alloc`` inside a segment the trace never
allocated, a free of an allocation it never saw, or final segments that do not add up to the
trace's own reserved bytes — and :func:`compare_with_recorded` then reports the trace as
incomplete instead of claiming a match or a mismatch.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import zlib
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vramplan.allocator.compare import EventsComparison, compare_segment_events, peak_reserved
from vramplan.allocator.config import AllocatorConfig, as_config, parse_conf
from vramplan.allocator.constants import NO_LIMIT, MiB
from vramplan.allocator.replay import final_segments, replay
from vramplan.allocator.result import ReplayResult, SegmentEvent
from vramplan.errors import ConfigError, SnapshotError
from vramplan.events import Action, Category, EventLog, not_a_file

TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                 "segment_map", "segment_unmap", "oom", "snapshot", "user_defined")
_SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")
_RELEASES = ("segment_free", "segment_unmap")
MAX_BYTES = 4 * 1024**3
"""Refuse (decompressed) snapshots larger than this."""
INFLATE_FREELY = 64 * 1024**2
"""A gzip file may inflate to this many bytes at any ratio; beyond it, at most :data:`MAX_RATIO`."""
MAX_RATIO = 200
"""Inflated ÷ compressed bytes a gzip snapshot may reach past :data:`INFLATE_FREELY`. Snapshots
compress 11× (pickle) to 42× (indented JSON with stack frames: a trace of gpt2 exported by
``vramplan estimate --snapshot``); a run of one byte compresses ~1000× (a decompression bomb)."""
_CHUNK = 1 << 20
"""Bytes inflated per read of a gzip snapshot."""


# ---------------------------------------------------------------------------- loading
class _Refused(pickle.UnpicklingError):
    """The pickle asked for something other than plain data."""


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds plain containers only: every global lookup and persistent id is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise _Refused(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("refusing a persistent id")


PICKLE_MAGIC = (b"(", b"}", b"]")
"""First byte of a protocol 0/1 pickle of a dict or list: MARK, EMPTY_DICT, EMPTY_LIST."""


def _is_pickle(data: bytes) -> bool:
    """PROTO with protocol 2-5 (what torch writes), or a protocol 0/1 container."""
    if data[:1] == b"\x80":
        return len(data) > 1 and 2 <= data[1] <= 5
    return data[:1] in PICKLE_MAGIC
GZIP_MAGIC = b"\x1f\x8b"


def _json_start(data: bytes) -> bytes:
    """The first non-blank byte of a UTF-8 text (a byte-order mark skipped), or b""."""
    head = data[:4096].lstrip(b"\xef\xbb\xbf").lstrip()
    return head[:1]


def snapshot_format(data: bytes) -> str:
    """What the bytes hold, by content: "gzip", "pickle", "json", or "" (neither).

    "json" is any text starting with ``{`` or ``[`` (a JSON-lines event file too; see
    :func:`is_snapshot`)."""
    if data[:2] == GZIP_MAGIC:
        return "gzip"
    if _is_pickle(data):
        return "pickle"
    if _json_start(data) in (b"{", b"["):
        return "json"
    return ""


def is_snapshot(data: bytes) -> bool:
    """Whether ``data`` is a memory snapshot (pickle, gzip or JSON) rather than a JSON-lines
    event file: a text whose first line is a JSON object with an ``action`` is an event file."""
    kind = snapshot_format(data)
    if kind in ("gzip", "pickle"):
        return True
    if kind != "json":
        return False
    first = data.lstrip(b"\xef\xbb\xbf").lstrip().split(b"\n", 1)[0]
    try:
        obj = json.loads(first)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, nested too deep
        return True  # a multi-line (pretty-printed) document: not one event per line
    return not (isinstance(obj, dict) and "action" in obj)


def loads_snapshot(data: bytes, where: str = "snapshot") -> dict[str, Any]:
    """Read snapshot bytes — a pickle (restricted unpickler) or its JSON form (the same dict
    ``json.dump`` writes), either of them gzip-compressed — detected by content, then validate."""
    if data[:2] == GZIP_MAGIC:
        return _load_gzip(data, where)
    if len(data) > MAX_BYTES:
        raise SnapshotError(f"{where}: larger than {MAX_BYTES >> 30} GiB uncompressed; refusing")
    if not _is_pickle(data) and _json_start(data) in (b"{", b"["):
        return _load_json(data, where)
    return _unpickle(io.BytesIO(data), where)


def _load_json(data: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SnapshotError(f"{where}: not a readable JSON snapshot ({type(e).__name__}: {e})",
                            hint="expected json.dump(torch.cuda.memory._snapshot(), f) output") from None
    return validate_snapshot(obj, where)


def _unpickle(stream: Any, where: str) -> dict[str, Any]:
    try:
        obj = _RestrictedUnpickler(stream).load()
    except _Refused as e:
        raise SnapshotError(f"{where}: not a plain memory snapshot ({e})",
                            hint="only pickles of dicts/lists/numbers/strings are read") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, RecursionError, OverflowError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None
    return validate_snapshot(obj, where)


class _Capped:
    """A gzip stream that refuses to inflate past :data:`MAX_BYTES`, or past :data:`MAX_RATIO`
    times the compressed size once above :data:`INFLATE_FREELY` (a decompression bomb)."""

    def __init__(self, f: gzip.GzipFile, compressed: int, where: str) -> None:
        self.f, self.compressed, self.where, self.n = f, compressed, where, 0

    def _count(self, k: int) -> None:
        self.n += k
        if self.n > MAX_BYTES:
            raise SnapshotError(f"{self.where}: larger than {MAX_BYTES >> 30} GiB uncompressed; refusing")
        if self.n > INFLATE_FREELY and self.n > MAX_RATIO * self.compressed:
            raise SnapshotError(
                f"{self.where}: inflates more than {MAX_RATIO}× ({self.n >> 20} MiB from {self.compressed:,} B so "
                "far): refusing a likely decompression bomb",
                hint="if the file is genuine, decompress it (gunzip) and pass the plain file")

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            out = bytearray()
            while chunk := self.read(_CHUNK):
                out += chunk
            return bytes(out)
        data = self.f.read(size)
        self._count(len(data))
        return data

    def readinto(self, b: Any) -> int:
        k = self.f.readinto(b)
        self._count(k)
        return k

    def readline(self, size: int = -1) -> bytes:
        line = self.f.readline(size if size is not None and size >= 0 else _CHUNK)
        self._count(len(line))
        return line


def _load_gzip(data: bytes, where: str) -> dict[str, Any]:
    """A gzip snapshot, inflated as it is read: a pickle is unpickled from the stream (a bad
    byte stops it there), JSON is read whole; either way within the caps of :class:`_Capped`,
    and content that is neither is refused before anything more is inflated."""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            kind = snapshot_format(f.peek(4096)[:4096])
            capped = _Capped(f, len(data), where)
            if kind == "pickle":
                return _unpickle(capped, where)
            if kind == "json":
                return _load_json(capped.read(), where)
            raise SnapshotError(f"{where}: the gzip file does not hold a memory snapshot (it starts with "
                                f"{f.peek(8)[:8]!r})", hint="expected a gzip-compressed pickle or JSON snapshot")
    except (OSError, EOFError, zlib.error) as e:
        raise SnapshotError(f"{where}: not a valid gzip file ({e})") from None


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """Read ``torch.cuda.memory._dump_snapshot`` output or its JSON form, plain or gzip, by
    content (the file name does not matter).

    Never executes code from the file: a pickle that needs any global raises
    :class:`SnapshotError`, as does a structure that is not a memory snapshot.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            check_regular_file(p, os.fstat(f.fileno()), MAX_BYTES)
            data = f.read()
    except OSError as e:
        raise SnapshotError(f"cannot read {p}: {e.strerror or e}") from None
    return loads_snapshot(data, str(p))


def check_regular_file(p: Path, st: os.stat_result, limit: int) -> None:
    """A snapshot or event file is a regular file of at most ``limit`` bytes (a device such as
    /dev/zero never ends; a FIFO blocks)."""
    kind = not_a_file(st)
    if kind:
        raise SnapshotError(f"cannot read {p}: it is {kind}, not a file",
                            hint="save the snapshot or events to a file and pass its path")
    if limit and st.st_size > limit:
        raise SnapshotError(f"{p}: {st.st_size:,} B is larger than {limit >> 30} GiB; refusing")


def strip_frames(snap: Mapping[str, Any]) -> dict[str, Any]:
    """A copy without stack frames (trace entries, segments, blocks): the allocator's history
    and state, every entry kept, at a fraction of the size."""
    def entry(d: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if k != "frames"}

    out = dict(snap)
    out["device_traces"] = [[entry(e) for e in t] for t in snap.get("device_traces") or []]
    out["segments"] = [{**entry(sg), "blocks": [entry(b) for b in sg.get("blocks", [])]}
                       for sg in snap.get("segments", [])]
    return out


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise SnapshotError(f"{where}: {msg}", hint="expected torch.cuda.memory._snapshot() output")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


SIZE_LIMIT = (1 << 63) - 1
"""The largest size a trace entry or block may state (the event log's 64-bit sizes)."""
ADDR_LIMIT = (1 << 64) - 1
"""The largest device address (a 64-bit pointer)."""


def _is_size(x: Any) -> bool:
    return _is_int(x) and 0 <= x <= SIZE_LIMIT


def _is_addr(x: Any) -> bool:
    return _is_int(x) and 0 <= x <= ADDR_LIMIT


def _bad_size(action: str, size: int) -> str:
    if size < 0:
        return f"{action} size must be >= 0, got {size:,}"
    return f"{action} size {size:,} is out of range (at most {SIZE_LIMIT:,} bytes)"


def validate_snapshot(obj: Any, where: str = "snapshot") -> dict[str, Any]:
    """Check the structure; a bare list of segments (old ``memory_snapshot()``) is wrapped."""
    if isinstance(obj, list):
        obj = {"segments": obj, "device_traces": []}
    _need(isinstance(obj, dict), where, f"top level is a {type(obj).__name__}, not a dict")
    _need("segments" in obj, where, "no 'segments' key")
    segs = obj["segments"]
    _need(isinstance(segs, list), where, "'segments' is not a list")
    for i, s in enumerate(segs):
        at = f"{where}: segments[{i}]"
        _need(isinstance(s, dict), at, "not a dict")
        for key in ("total_size", "blocks"):
            _need(key in s, at, f"missing '{key}'")
        _need(_is_size(s["total_size"]), at, f"'total_size' is not a size in bytes (0 to 2^63 - 1): {s['total_size']!r}")
        _need(_is_addr(s.get("address", 0)), at, f"'address' is not a device address: {s.get('address')!r}")
        _need(isinstance(s["blocks"], list), at, "'blocks' is not a list")
        for j, b in enumerate(s["blocks"]):
            _need(isinstance(b, dict) and _is_int(b.get("size")) and isinstance(b.get("state"), str),
                  f"{at}.blocks[{j}]", "needs an integer 'size' and a string 'state'")
            _need(_is_size(b["size"]), f"{at}.blocks[{j}]", f"'size' is not a size in bytes (0 to 2^63 - 1): {b['size']!r}")
            _need(_is_addr(b.get("address", 0)), f"{at}.blocks[{j}]", f"'address' is not a device address: {b.get('address')!r}")
    traces = obj.setdefault("device_traces", [])
    _need(isinstance(traces, list), where, "'device_traces' is not a list")
    for d, trace in enumerate(traces):
        _need(isinstance(trace, list), f"{where}: device_traces[{d}]", "not a list")
        for k, e in enumerate(trace):
            at = f"{where}: device_traces[{d}][{k}]"
            _need(isinstance(e, dict), at, "not a dict")
            act = e.get("action")
            _need(act in TRACE_ACTIONS, at, f"unknown action {act!r}")
            _need(_is_int(e.get("size", 0)), at, "'size' is not an integer")
            _need(_is_size(e.get("size", 0)), at, _bad_size(act, e.get("size", 0)))
            if act not in ("oom", "snapshot", "user_defined"):
                _need(_is_int(e.get("addr")), at, "'addr' is not an integer")
                _need(_is_addr(e["addr"]), at, f"'addr' is not a device address (0 to 2^64 - 1): {e['addr']:,}")
            _need(_is_int(e.get("stream", 0)), at, "'stream' is not an integer")
    settings = obj.get("allocator_settings", {})
    _need(isinstance(settings, dict), where, "'allocator_settings' is not a dict")
    return obj


# ---------------------------------------------------------------------------- conf
def snapshot_conf(snap: Mapping[str, Any]) -> tuple[AllocatorConfig, str]:
    """The allocator configuration the snapshot was recorded with, and where it came from."""
    s = snap.get("allocator_settings") or {}
    text = s.get("PYTORCH_CUDA_ALLOC_CONF") or s.get("PYTORCH_ALLOC_CONF")
    if isinstance(text, str) and text.strip():
        try:
            conf = parse_conf(text)
        except ConfigError:
            conf = None  # a key this reader does not know: fall back to the individual fields
        if conf is not None:
            if conf.expandable_segments and s.get("expandable_segments") is False:
                # asked for, but the platform did not support it (PyTorch warns and ignores it)
                return replace(conf, expandable_segments=False), "allocator_settings (conf string; " \
                    "expandable segments unsupported on the recording platform)"
            return conf, "allocator_settings (conf string)"
    if not s:
        return parse_conf(""), "defaults (the snapshot has no allocator_settings)"
    parts: list[str] = []
    msplit = s.get("max_split_size")
    if isinstance(msplit, int) and 0 < msplit < NO_LIMIT and msplit // MiB >= 20:
        parts.append(f"max_split_size_mb:{msplit // MiB}")
    gc = s.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and 0 < gc < 1:
        parts.append(f"garbage_collection_threshold:{gc:g}")
    if s.get("expandable_segments") is True:
        parts.append("expandable_segments:True")
    div = s.get("roundup_power2_divisions")
    if isinstance(div, dict) and any(v for v in div.values() if _is_int(v) and v > 1):
        pairs = sorted((int(k), v) for k, v in div.items() if str(k).isdigit() and _is_int(v))
        parts.append("roundup_power2_divisions:[" + ",".join(f"{k}:{v}" for k, v in pairs) + "]")
    return parse_conf(",".join(parts)), "allocator_settings (fields)"


# ---------------------------------------------------------------------------- conversion
@dataclass(frozen=True)
class TraceEvents:
    """A device trace converted: the event log and the recorded segment events, stamped with
    the index of the log event they belong to."""

    log: EventLog
    segment_events: tuple[SegmentEvent, ...]
    stream_ids: tuple[int, ...]
    """Recorded stream handles; position = stream number in the log."""
    ooms: int
    notes: tuple[str, ...]


def _trace(snap: Mapping[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snap.get("device_traces") or []
    if device < 0 or device >= len(traces):
        return []
    return traces[device]


def convert_trace(snap: Mapping[str, Any], device: int = 0, *,
                  releases_as_empty_cache: bool = True,
                  set_aside: frozenset[int] = frozenset()) -> TraceEvents:
    """Convert one device's trace. ``releases_as_empty_cache=False`` leaves a release run that
    is followed by an allocation to the simulator (the OOM path; needs a capacity).
    ``set_aside``: trace indices to leave out — ``alloc`` entries (their frees go with them)
    and releases of memory reserved before recording (:attr:`TraceCoverage.set_aside`)."""
    trace = _trace(snap, device)
    streams = sorted({int(e.get("stream", 0)) for e in trace})
    rank = {s: i for i, s in enumerate(streams)}
    log = EventLog()
    seg_events: list[SegmentEvent] = []
    live: dict[int, int] = {}      # address -> id of the live allocation
    pending: dict[int, int] = {}   # address -> id awaiting free_completed
    next_id = 0
    ooms = 0
    notes: list[str] = []
    burst = -1  # log index of the EMPTY_CACHE standing for the current release run
    skip = False
    n = len(trace)
    for k, e in enumerate(trace):
        if skip:
            skip = False
            continue
        act = e["action"]
        addr = e.get("addr", 0)
        size = e.get("size", 0)
        stream = rank[int(e.get("stream", 0))]
        if act in _RELEASES:
            if burst < 0:
                if releases_as_empty_cache or not _allocation_follows(trace, k):
                    burst = len(log)
                    log.append(Action.EMPTY_CACHE, stream=stream, op="empty_cache")
            if k in set_aside:
                continue
            seg_events.append(SegmentEvent(act, addr, size, stream, burst if burst >= 0 else len(log)))
            continue
        if act != "free_completed":
            burst = -1
        if act in ("segment_alloc", "segment_map"):
            seg_events.append(SegmentEvent(act, addr, size, stream, len(log)))
        elif act == "alloc":
            if k in set_aside:
                continue
            live[addr] = next_id
            log.alloc(next_id, size, stream=stream, category=Category.OTHER, op="alloc")
            next_id += 1
        elif act == "free_requested":
            ident = live.pop(addr, None)
            if ident is None:
                continue  # allocated before the trace began
            nxt = trace[k + 1] if k + 1 < n else None
            if nxt is not None and nxt["action"] == "free_completed" and nxt.get("addr") == addr:
                log.free(ident, stream=stream)
                skip = True
            else:
                log.append(Action.FREE_DEFERRED, ident, stream=stream)
                pending[addr] = ident
        elif act == "free_completed":
            ident = pending.pop(addr, None)
            if ident is not None:
                log.free(ident, stream=stream)
        elif act == "oom":
            ooms += 1
    if ooms:
        notes.append(f"the trace has {ooms} OOM(s); those requests have no alloc entry")
    if any(s.get("segment_pool_id") not in (None, (0, 0), [0, 0]) for s in snap.get("segments", [])):
        notes.append("private pools (CUDA graphs / MemPool) are not simulated")
    return TraceEvents(log, tuple(seg_events), tuple(streams), ooms, tuple(notes))


def _allocation_follows(trace: Sequence[dict[str, Any]], k: int) -> bool:
    for e in trace[k + 1:]:
        act = e["action"]
        if act in _RELEASES or act == "free_completed":
            continue
        return act in ("segment_alloc", "segment_map", "alloc", "oom")
    return False


def snapshot_to_events(snap: Mapping[str, Any], device: int = 0) -> EventLog:
    """The device trace of ``snap`` as an :class:`EventLog` (see the module notes)."""
    return convert_trace(snap, device).log


# ---------------------------------------------------------------------------- completeness
class _Ranges:
    """Disjoint address ranges, adjacent ones merged (reserved memory seen in a trace)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.end: dict[int, int] = {}
        self.total = 0

    def _find(self, addr: int) -> int:
        i = bisect_right(self.starts, addr) - 1
        return i if i >= 0 and addr < self.end[self.starts[i]] else -1

    def contains(self, addr: int) -> bool:
        return self._find(addr) >= 0

    def add(self, addr: int, size: int) -> None:
        end = addr + size
        i = bisect_right(self.starts, addr)
        if i < len(self.starts) and self.starts[i] == end:  # merge with the next range
            end = self.end.pop(self.starts.pop(i))
        if i > 0 and self.end[self.starts[i - 1]] == addr:  # and with the previous one
            self.end[self.starts[i - 1]] = end
        else:
            self.starts.insert(i, addr)
            self.end[addr] = end
        self.total += size

    def remove(self, addr: int, size: int) -> bool:
        i = self._find(addr)
        if i < 0 or addr + size > self.end[self.starts[i]]:
            return False
        start = self.starts[i]
        end = self.end.pop(start)
        del self.starts[i]
        if addr + size < end:
            self.starts.insert(i, addr + size)
            self.end[addr + size] = end
        if start < addr:
            self.starts.insert(i, start)
            self.end[start] = addr
        self.total -= size
        return True


@dataclass(frozen=True)
class TraceCoverage:
    """How much of the allocator's life a device trace covers.

    ``complete`` with ``reserved_before == 0``: the trace starts at the first allocation, and
    a replay from an empty allocator must reproduce it. ``complete`` with ``reserved_before >
    0``: whole segments were reserved before recording began (typically a small-pool segment,
    or the model's weights loaded before ``_record_memory_history``); the allocations in them
    (``set_aside``) are left out and the rest replays on its own — the caching allocator picks
    the best fit over all free blocks, so a request that landed in a traced segment had no
    better fit anywhere, and one that landed in an earlier segment is gone from both sides.
    Not ``complete``: the state before the first entry cannot be separated (``reason``)."""

    complete: bool
    reason: str
    reserved_before: int = 0
    """Bytes of segments reserved before recording began (still held, or released in the trace)."""
    segments_before: int = 0
    set_aside: frozenset[int] = frozenset()
    """Trace indices left out: allocations in those segments and the releases of them."""
    allocations_set_aside: int = 0

    @property
    def whole(self) -> bool:
        """The trace covers the allocator's whole life."""
        return self.complete and self.reserved_before == 0

    def describe(self) -> str:
        if not self.complete:
            return f"incomplete: {self.reason}"
        if not self.reserved_before:
            return "complete"
        return (f"complete except {self.reserved_before:,} bytes reserved before recording "
                f"({self.segments_before} segment(s); {self.allocations_set_aside:,} allocation(s) in "
                "them left out of the replay)")


def _overlaps(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(a < hi and lo < b for a, b in ranges)


def trace_coverage(snap: Mapping[str, Any], device: int = 0) -> TraceCoverage:
    """Whether the trace covers the allocator's life, or all of it but segments reserved
    before recording began (see :class:`TraceCoverage`)."""
    trace = _trace(snap, device)
    segs = [s for s in snap.get("segments", []) if s.get("device", device) == device]
    final = sum(s["total_size"] for s in segs)
    if not trace:
        return TraceCoverage(final == 0, "" if final == 0 else "no trace was recorded "
                             "(torch.cuda.memory._record_memory_history was not on)")
    # segments the trace reserved itself, and releases of memory it never reserved
    traced: list[tuple[int, int]] = []
    ranges = _Ranges()
    early_releases: dict[int, tuple[int, int]] = {}  # trace index -> (lo, hi)
    for k, e in enumerate(trace):
        act, addr, size = e["action"], e.get("addr", 0), e.get("size", 0)
        if act in ("segment_alloc", "segment_map"):
            ranges.add(addr, size)
            traced.append((addr, addr + size))
        elif act in _RELEASES and not ranges.remove(addr, size):
            if act == "segment_unmap":
                return TraceCoverage(False, f"entry {k}: {act} of memory mapped before the trace began "
                                     "(the ring buffer dropped the start; raise max_entries)")
            early_releases[k] = (addr, addr + size)
    early_final = [s for s in segs if "address" in s and not s.get("is_expandable", False)
                   and not _overlaps(traced, s["address"], s["address"] + s["total_size"])]
    # the address ranges reserved before recording: held to the end (sorted, disjoint), or
    # released at a trace index
    held = sorted((s["address"], s["address"] + s["total_size"]) for s in early_final)
    held_starts = [lo for lo, _ in held]
    released = [(lo, hi, k) for k, (lo, hi) in early_releases.items()]

    def early(addr: int, k: int) -> bool:
        i = bisect_right(held_starts, addr) - 1
        if i >= 0 and addr < held[i][1]:
            return True
        return any(lo <= addr < hi and k < until for lo, hi, until in released)

    ranges = _Ranges()
    aside: set[int] = set(early_releases)
    live: set[int] = set()
    freeing: set[int] = set()
    live_early: set[int] = set()
    n_aside = 0
    for k, e in enumerate(trace):
        act, addr, size = e["action"], e.get("addr", 0), e.get("size", 0)
        if act in ("segment_alloc", "segment_map"):
            ranges.add(addr, size)
        elif act in _RELEASES:
            if k not in early_releases:
                ranges.remove(addr, size)
        elif act == "alloc":
            if ranges.contains(addr):
                live.add(addr)
            elif early(addr, k):
                aside.add(k)
                live_early.add(addr)
                n_aside += 1
            else:
                return TraceCoverage(False, (f"entry {k}: alloc in a segment reserved before the trace "
                                             "began (start recording before the first CUDA allocation)"))
        elif act == "free_requested":
            if addr in live:
                live.discard(addr)
                freeing.add(addr)
            elif addr in live_early or early(addr, k):
                live_early.discard(addr)  # allocated before recording, or set aside
            else:
                return TraceCoverage(False, f"entry {k}: free of an allocation made before the trace began")
        elif act == "free_completed":
            if addr in freeing:
                freeing.discard(addr)
            elif not early(addr, k):
                return TraceCoverage(False, f"entry {k}: free_completed without its free_requested")
    rest = final - sum(s["total_size"] for s in early_final)
    if ranges.total != rest:
        return TraceCoverage(False, f"the trace accounts for {ranges.total:,} B reserved but the final "
                             f"segments hold {rest:,} B")
    spans = held + [(lo, hi) for lo, hi, _ in released]
    return TraceCoverage(True, "", sum(hi - lo for lo, hi in spans), len(spans), frozenset(aside), n_aside)


def trace_completeness(snap: Mapping[str, Any], device: int = 0) -> tuple[bool, str]:
    """Whether the trace covers the allocator's whole life (so a replay starts from the same,
    empty, state): (complete, reason when not)."""
    cov = trace_coverage(snap, device)
    if cov.whole:
        return True, ""
    return False, cov.reason or cov.describe()


# ---------------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class SnapshotComparison:
    """A recorded snapshot replayed through the simulator."""

    complete: bool
    """The trace (less any segments reserved before recording) can be compared."""
    reason: str
    """Why the trace cannot be compared ('' when complete)."""
    conf: str
    conf_source: str
    events: int
    recorded_segment_events: int
    simulated_segment_events: int
    matching: int
    first_mismatch_index: int
    first_mismatch: str
    recorded_peak_reserved: int
    simulated_peak_reserved: int
    recorded_final_reserved: int
    simulated_final_reserved: int
    layout_match: bool
    """The final segments have the same block layout (sizes and states, segment by segment;
    addresses aside) as the snapshot's ``segments``."""
    result: ReplayResult
    notes: tuple[str, ...] = ()
    addresses_match: bool = False
    """Every final block sits at its recorded address (the simulation is seeded with the
    recorded segment addresses; not checked with expandable segments)."""
    reserved_before_recording: int = 0
    """Bytes of segments reserved before recording began: left out of both sides (the
    recorded peak and final reserved above are those of the rest)."""
    allocations_set_aside: int = 0
    """Recorded allocations in those segments, left out of the replay."""

    @property
    def coverage(self) -> str:
        """"complete", "complete except N bytes reserved before recording", or "incomplete"."""
        if not self.complete:
            return "incomplete"
        if self.reserved_before_recording:
            return f"complete except {self.reserved_before_recording:,} bytes reserved before recording"
        return "complete"

    @property
    def verdict(self) -> str:
        """One line: how the replay compares with the recording."""
        if not self.complete:
            return f"not comparable: {self.reason}"
        scope = " on the rest" if self.reserved_before_recording else ""
        if self.match and self.layout_match:
            return "exact match" + scope
        if self.match:
            return "segment events and peak match; final block layout differs" + scope
        return "mismatch" + scope

    @property
    def match(self) -> bool:
        """Complete, every segment event identical and the reserved peak equal."""
        return (self.complete and self.first_mismatch_index < 0
                and self.matching == self.recorded_segment_events == self.simulated_segment_events
                and self.recorded_peak_reserved == self.simulated_peak_reserved)

    def to_dict(self) -> dict[str, Any]:
        return {
            "complete": self.complete, "coverage": self.coverage, "reason": self.reason,
            "match": self.match, "verdict": self.verdict,
            "reserved_before_recording": self.reserved_before_recording,
            "allocations_set_aside": self.allocations_set_aside,
            "conf": self.conf, "conf_source": self.conf_source, "events": self.events,
            "recorded_segment_events": self.recorded_segment_events,
            "simulated_segment_events": self.simulated_segment_events,
            "matching": self.matching, "first_mismatch_index": self.first_mismatch_index,
            "first_mismatch": self.first_mismatch,
            "recorded_peak_reserved": self.recorded_peak_reserved,
            "simulated_peak_reserved": self.simulated_peak_reserved,
            "recorded_final_reserved": self.recorded_final_reserved,
            "simulated_final_reserved": self.simulated_final_reserved,
            "layout_match": self.layout_match, "addresses_match": self.addresses_match,
            "notes": list(self.notes),
        }


def compare_with_recorded(snap: Mapping[str, Any], conf: AllocatorConfig | str | None = None, *,
                          device: int = 0, capacity: int | None = None) -> SnapshotComparison:
    """Replay the snapshot's trace and compare the segment events and the reserved peak.

    ``conf`` None: the snapshot's own ``allocator_settings``. ``capacity``: the device memory the
    allocator could use when recording; with it, release runs that precede an allocation are
    left to the simulated OOM path instead of being read as ``empty_cache()``.
    """
    if conf is None:
        cfg, source = snapshot_conf(snap)
    else:
        cfg, source = as_config(conf), "given"
    cov = trace_coverage(snap, device)
    tr = convert_trace(snap, device, releases_as_empty_cache=capacity is None,
                       set_aside=cov.set_aside if cov.complete else frozenset())
    cap_note = ""
    if capacity is not None and cov.complete and cov.reserved_before:
        capacity = max(0, capacity - cov.reserved_before)  # what the rest could reserve
        cap_note = (f"the capacity is less the {cov.reserved_before:,} bytes reserved before recording "
                    f"({capacity:,} B for the rest)")
    plan = [(e.addr, e.size) for e in tr.segment_events if e.action == "segment_alloc"]
    result = replay(tr.log, cfg, capacity=capacity, record_segments=True, segment_addresses=plan)
    sim = result.segment_events or ()
    cmp: EventsComparison = compare_segment_events(tr.segment_events, sim)
    recorded_segs = [s for s in snap.get("segments", []) if s.get("device", device) == device]
    if cov.complete and cov.reserved_before:  # compare the rest
        traced = [(e.addr, e.addr + e.size) for e in tr.segment_events if e.action == "segment_alloc"]
        recorded_segs = [s for s in recorded_segs if s.get("is_expandable", False) or "address" not in s
                         or _overlaps(traced, s["address"], s["address"] + s["total_size"])]
    final = sum(s["total_size"] for s in recorded_segs)
    simulated_segs = final_segments(tr.log, cfg, capacity=capacity, segment_addresses=plan)
    layout = Counter((s["total_size"], tuple((b["size"], b["state"]) for b in s["blocks"]))
                     for s in recorded_segs)
    sim_layout = Counter((s.size, tuple((b.size, b.state) for b in s.blocks)) for s in simulated_segs)
    addresses = not cfg.expandable_segments and sorted(
        (b.get("address", -1), b["size"], b["state"]) for sg in recorded_segs for b in sg["blocks"]
    ) == sorted((b.addr, b.size, b.state) for sg in simulated_segs for b in sg.blocks)
    notes = list(tr.notes) + list(result.notes)
    if cov.complete and cov.reserved_before:
        notes.append(f"{cov.describe()}; peaks and final reserved compare the rest")
    if cap_note:
        notes.append(cap_note)
    if not cov.complete:
        notes.append("incomplete trace: the replay starts from an empty allocator, the recording "
                     "did not, so differences are expected")
    return SnapshotComparison(
        complete=cov.complete, reason=cov.reason, conf=cfg.text, conf_source=source,
        events=len(tr.log), recorded_segment_events=cmp.recorded,
        simulated_segment_events=cmp.simulated, matching=cmp.matching,
        first_mismatch_index=cmp.first_mismatch_index, first_mismatch=cmp.first_mismatch,
        recorded_peak_reserved=peak_reserved(tr.segment_events),
        simulated_peak_reserved=result.max_reserved,
        recorded_final_reserved=final, simulated_final_reserved=result.final_reserved,
        layout_match=layout == sim_layout, result=result, notes=tuple(notes),
        addresses_match=addresses,
        reserved_before_recording=cov.reserved_before if cov.complete else 0,
        allocations_set_aside=cov.allocations_set_aside if cov.complete else 0,
    )
