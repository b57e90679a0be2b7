"""What a snapshot's trace says about each block and segment over time.

The pieces of :mod:`vramplan.snapshot.analyze` that walk the trace: block lifetimes
(``alloc`` → ``free_requested``, with blocks older than the trace taken from the end state),
and the segments present after a given entry (the end state with later segment events undone).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramplan.errors import SnapshotError

from .categorize import Frame

ROUND = 512
"""The allocator's minimum block size and rounding step."""

_SEG_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def rounded(n: int) -> int:
    """Requested bytes rounded as the allocator rounds them (a block is at least 512 B)."""
    return max(ROUND, -(-int(n) // ROUND) * ROUND)


@dataclass(frozen=True)
class SegmentState:
    """A segment (cudaMalloc'd range) at the reserved peak."""

    address: int
    size: int
    stream: int
    allocated: int
    """Bytes of live blocks in it (requested sizes rounded to 512 B)."""
    blocks: int
    largest_free: int
    """The largest contiguous free range in it."""


def int_field(e: Mapping[str, Any], key: str, where: str) -> int:
    """``e[key]`` as an int, or a SnapshotError naming ``where``."""
    try:
        return int(e[key])
    except (KeyError, TypeError, ValueError):
        raise SnapshotError(f"malformed snapshot: {where} has no integer '{key}'") from None


def frames_of(x: Any) -> list[Frame]:
    """The frame dicts of an entry or block (none when absent or malformed)."""
    return [f for f in x if isinstance(f, Mapping)] if isinstance(x, list) else []


@dataclass
class Lifetime:
    """One block from its ``alloc`` (-1: before the trace) to its ``free_requested`` (None: alive at the end)."""

    addr: int
    size: int
    stream: int
    alloc_index: int
    free_index: int | None = None
    alloc_frames: list[Frame] = field(default_factory=list)
    free_frames: list[Frame] | None = None
    label: str = ""
    """The alloc entry's own ``category`` field, when it has one."""


def walk_trace(entries: Sequence[Mapping[str, Any]]) -> tuple[list[Lifetime], list[int], list[int]]:
    """Forward pass: block lifetimes, segment deltas per entry, OOM entries."""
    live: dict[int, Lifetime] = {}
    recs: list[Lifetime] = []
    seg_delta = [0] * len(entries)
    ooms: list[int] = []
    for i, e in enumerate(entries):
        if not isinstance(e, Mapping):
            raise SnapshotError(f"malformed snapshot: trace entry {i} is not a dict")
        action = e.get("action")
        if action in _SEG_DELTA:
            seg_delta[i] = _SEG_DELTA[action] * int_field(e, "size", f"trace entry {i}")
        elif action == "alloc":
            addr = int_field(e, "addr", f"trace entry {i}")
            old = live.pop(addr, None)
            if old is not None:  # an alloc at a live address: its free was not recorded
                old.free_index = i
                old.free_frames = []
            r = Lifetime(addr, int_field(e, "size", f"trace entry {i}"), int(e.get("stream", 0) or 0), i,
                     alloc_frames=frames_of(e.get("frames")), label=str(e.get("category") or ""))
            live[addr] = r
            recs.append(r)
        elif action in ("free_requested", "free"):
            addr = int_field(e, "addr", f"trace entry {i}")
            found = live.pop(addr, None)
            if found is None:  # allocated before the trace started
                r = Lifetime(addr, int_field(e, "size", f"trace entry {i}"), int(e.get("stream", 0) or 0), -1)
                recs.append(r)
            else:
                r = found
            r.free_index = i
            r.free_frames = frames_of(e.get("frames"))
        elif action == "oom":
            ooms.append(i)
    return recs, seg_delta, ooms


def blocks_of(segs: Sequence[Mapping[str, Any]]) -> list[tuple[int, Mapping[str, Any], Mapping[str, Any]]]:
    """(address, block, segment) of every block, addresses from the segment start when absent."""
    out = []
    for s in segs:
        addr = int_field(s, "address", "a segment")
        for b in s.get("blocks", []):
            out.append((int(b.get("address", addr)), b, s))
            addr += int_field(b, "size", "a block")
    return out


def add_preexisting(recs: list[Lifetime], segs: Sequence[Mapping[str, Any]]) -> None:
    """Blocks alive in the end state that the trace never allocated."""
    alive = {r.addr for r in recs if r.free_index is None}
    for addr, b, s in blocks_of(segs):
        if b.get("state") == "active_allocated" and addr not in alive:
            recs.append(Lifetime(addr, int(b.get("requested_size", b["size"])), int(s.get("stream", 0) or 0),
                             -1, alloc_frames=frames_of(b.get("frames"))))


def segments_at(
    segs: Sequence[Mapping[str, Any]], entries: Sequence[Mapping[str, Any]], index: int,
    live: Sequence[tuple[int, int]],
) -> tuple[SegmentState, ...]:
    """Segments after trace entry ``index`` (the end state with later segment events undone),
    filled with the ``live`` blocks given as (address, bytes); largest first."""
    ranges = [[int_field(s, "address", "a segment"), int(s["total_size"]), int(s.get("stream", 0) or 0)]
              for s in segs]
    for e in reversed(entries[index + 1:]):
        act = e.get("action")
        if act in ("segment_alloc", "segment_map"):
            _remove(ranges, int(e["addr"]), int(e["size"]))
        elif act in ("segment_free", "segment_unmap"):
            ranges.append([int(e["addr"]), int(e["size"]), int(e.get("stream", 0) or 0)])
    ranges.sort()
    blocks = sorted(live)
    out = []
    j = 0
    for addr, size, stream in ranges:
        while j < len(blocks) and blocks[j][0] < addr:
            j += 1
        inside = []
        while j < len(blocks) and blocks[j][0] < addr + size:
            inside.append(blocks[j])
            j += 1
        cursor, largest, used = addr, 0, 0
        for b_addr, b_size in inside:
            largest = max(largest, b_addr - cursor)
            cursor = max(cursor, b_addr + b_size)
            used += b_size
        largest = max(largest, addr + size - cursor)
        out.append(SegmentState(address=addr, size=size, stream=stream, allocated=used,
                                blocks=len(inside), largest_free=max(largest, 0)))
    return tuple(sorted(out, key=lambda s: (-s.size, s.address)))


def _remove(ranges: list[list[int]], addr: int, size: int) -> None:
    """Take [addr, addr+size) out of whichever range holds it (splitting it if needed)."""
    for k, (a, s, st) in enumerate(ranges):
        if a <= addr and addr + size <= a + s:
            del ranges[k]
            if addr > a:
                ranges.append([a, addr - a, st])
            if addr + size < a + s:
                ranges.append([addr + size, a + s - addr - size, st])
            return


