"""Consistency checks of a :class:`CachingAllocator`'s state (used by the tests).

Returns the problems found as sentences; an empty list means the state is consistent:
blocks tile every segment exactly, linked both ways; no two free (or two unmapped) blocks are
neighbours; every free block is in its pool's sorted free list under the right key and nothing
else is; the byte counters equal what the blocks add up to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import freelist
from .blocks import SHIFT, Block
from .freelist import Blocked
from .native import CachingAllocator

if TYPE_CHECKING:
    from .freelist import Long


def check_invariants(al: CachingAllocator) -> list[str]:
    problems: list[str] = []
    allocated = active = requested = reserved = inactive_split = 0
    free_seen: dict[int, Block] = {}
    unmapped_seen: dict[int, Block] = {}
    runs = 0
    for base, seg in al._segments.items():
        b = seg.head
        if b is None or b.addr != base or b.prev is not None:
            problems.append(f"segment {base:#x}: head block wrong")
            continue
        total = 0
        prev: Block | None = None
        split = b.next is not None
        while b is not None:
            if b.seg is not seg:
                problems.append(f"block {b.addr:#x} points to another segment")
            if b.prev is not prev:
                problems.append(f"block {b.addr:#x}: prev link broken")
            if prev is not None and prev.addr + prev.size != b.addr:
                problems.append(f"block {b.addr:#x}: gap or overlap after {prev.addr:#x}")
            if b.size <= 0:
                problems.append(f"block {b.addr:#x}: size {b.size}")
            free_now = not b.allocated and not b.events
            if prev is not None and free_now and not prev.allocated and not prev.events \
                    and prev.mapped == b.mapped:
                problems.append(f"blocks {prev.addr:#x} and {b.addr:#x} should have merged")
            if b.mapped:
                reserved += b.size
                if prev is None or not prev.mapped:
                    runs += 1
                if b.allocated:
                    allocated += b.size
                if b.allocated or b.events:
                    active += b.size
                    requested += b.req
                elif free_now:
                    free_seen[(b.size << SHIFT) | b.addr] = b
                    if split and not seg.expandable:
                        inactive_split += b.size
                if seg.expandable:
                    off = b.addr - base
                    if (prev is None or not prev.mapped) and off % seg.page:
                        problems.append(f"mapped range at {b.addr:#x} not page aligned")
            else:
                if b.allocated or b.events:
                    problems.append(f"unmapped block {b.addr:#x} is in use")
                unmapped_seen[b.addr] = b
            total += b.size
            prev = b
            b = b.next
        if total != seg.size:
            problems.append(f"segment {base:#x}: blocks add up to {total}, not {seg.size}")
    if set(free_seen) != set(al._free):
        problems.append(f"free list holds {len(al._free)} blocks, segments hold {len(free_seen)} free")
    for pools in (al._small_pools, al._large_pools):
        for pool in pools.values():
            keys = list(pool.keys)
            if keys != sorted(keys):
                problems.append(f"{pool.name} pool of stream {pool.stream}: keys not sorted")
            if not isinstance(pool.keys, list):
                problems += [f"{pool.name} pool of stream {pool.stream}: {p}" for p in _long_problems(pool.keys)]
            for key in keys:
                blk = al._free.get(key)
                if blk is None or blk.pool is not pool or blk.key != key:
                    problems.append(f"{pool.name} pool of stream {pool.stream}: stale key")
            for addr in pool.unmapped:
                if addr not in unmapped_seen or unmapped_seen[addr].pool is not pool:
                    problems.append(f"unmapped list: stale address {addr:#x}")
    if len(unmapped_seen) != len(al._unmapped_blocks):
        problems.append("unmapped block index out of date")
    counters = {
        "allocated": (al.allocated, allocated), "active": (al.active, active),
        "requested": (al.requested, requested), "reserved": (al.reserved, reserved),
        "segments": (al.num_segments, runs),
    }
    if not al.conf.expandable_segments:
        counters["inactive_split"] = (al.inactive_split, inactive_split)
    for name, (have, want) in counters.items():
        if have != want:
            problems.append(f"{name} counter is {have}, blocks add up to {want}")
    if al.capacity is not None and al.reserved > al.capacity:
        problems.append(f"reserved {al.reserved} exceeds capacity {al.capacity}")
    return problems


def _long_problems(keys: Long) -> list[str]:
    """What breaks a long free list's own invariants (:class:`.freelist.Blocked`, or the C
    :class:`._keyset.KeySet`: no empty run, none over its limit, the length their sum)."""
    if isinstance(keys, Blocked):
        return _blocked_problems(keys)
    from . import _keyset

    lengths = keys.run_lengths()
    out = []
    if any(n <= 0 for n in lengths):
        out.append("an empty run")
    if any(n > _keyset.RUN_MAX for n in lengths):
        out.append(f"a run longer than {_keyset.RUN_MAX}")
    if len(keys) != sum(lengths):
        out.append(f"length {len(keys)}, runs hold {sum(lengths)}")
    return out


def _blocked_problems(keys: Blocked) -> list[str]:
    """What breaks :class:`.freelist.Blocked`'s own invariants."""
    out = []
    if any(not run for run in keys.runs):
        out.append("an empty run")
    if any(len(run) > 2 * freelist.LOAD for run in keys.runs):
        out.append(f"a run longer than {2 * freelist.LOAD}")
    if keys.maxes != [run[-1] for run in keys.runs if run]:
        out.append("run maxima out of date")
    if keys.n != sum(map(len, keys.runs)):
        out.append(f"length {keys.n}, runs hold {sum(map(len, keys.runs))}")
    return out
