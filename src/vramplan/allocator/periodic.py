"""Replay of a long uncapped log with its repeated stretches fast-forwarded, exactly.

A generation log repeats itself: within a decode step every transformer layer asks the
small pool for the same sizes in the same order (70B: 80 layers × ~170 events, 128 steps),
and once the pool has settled each layer leaves it as it found it. Replaying those
stretches event by event is most of an estimate's replay time. This module gives the same
figures as :func:`.replay._run_plain` while simulating each such stretch only until the
pool's state is seen to repeat.

Why the figures are the same (every step is checked, none is assumed):

1. **Pools apart.** Without a capacity the allocator never fails a cudaMalloc, so it never
   frees cached segments to retry, and the small pool (requests ≤ 1 MiB) and the large pool
   never touch each other's blocks: each is replayed alone, on an allocator of its own.
   Segment addresses come from a bump pointer in creation order, so equal-size ties break
   the same way in a pool replayed alone. A small block is always exactly the rounded
   request (every size is a multiple of 512, so any remainder is split off), so the small
   pool's allocated bytes are a sum over the log; the large pool's block sizes come from its
   replay. The totals (allocated, requested, reserved, segments) are put back together per
   event with numpy, and their peaks read as the event loop reads them.
2. **Repeats found, not assumed.** In the small pool's log each event gets a signature: an
   allocation its rounded size and stream, a free the distance back to its allocation.
   Stretches where the signature repeats with a period ``d`` are found with numpy.
3. **State compared.** In such a stretch, the pool is replayed a period at a time, and its
   whole state at two period boundaries ``b`` and ``b + d`` is compared: every segment and
   block, free or allocated, with each allocated block named by its age if allocated in the
   last period and by its allocation (the same block) if older. Equal states and equal
   events give equal decisions, so every further period of the stretch leaves the state as
   it found it, with the last period's blocks renamed to the corresponding allocations:
   those periods are skipped, the live blocks renamed, and the replay goes on. Where the
   states differ after three tries, the stretch is replayed event by event.

It applies to the native allocator without expandable segments, garbage collection or
power-of-two rounding, without a capacity, on a log of allocations and frees only (no
deferred frees, syncs or ``empty_cache``) that pairs every free with a live allocation;
:func:`run` returns None otherwise and the caller replays event by event.
``tests/test_allocator_periodic.py`` checks every figure against the event-by-event replay.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import fused
from .constants import MIN_BLOCK_SIZE, SMALL_SIZE
from .native import CachingAllocator
from .vaspace import VA_BASE, VA_LIMIT

GRAM = 32
"""Signatures hashed in runs of this many events to find the candidate periods."""
TRIES = 3
"""Periods replayed in a stretch before giving up on its state repeating."""
COVER = 0.25
"""Repeats must span this share of the log, or the event loop replays it."""
GIVE_UP = 3
"""Stretches in a row whose state does not repeat before the event loop takes over."""


@dataclass(frozen=True)
class Figures:
    """What :func:`.replay._run_plain` computes, and the allocator's counters the result reads."""

    max_allocated: int
    peak_allocated_index: int
    max_reserved: int
    peak_reserved_index: int
    allocated_at_peak: int
    segments_at_peak: int
    reserved_changes: list[tuple[int, int]]
    max_active: int
    max_requested: int
    max_segments: int
    final_allocated: int
    final_reserved: int
    skipped: int
    """Events of the small pool not replayed one by one (their periods repeat)."""


def applies(al: Any) -> bool:
    """Whether :func:`run` may answer for this allocator: native without expandable segments,
    garbage collection, power-of-two rounding, a capacity or recorded segment addresses."""
    return (type(al) is CachingAllocator and al.capacity is None and al.allowed is None
            and not (al._es or al._gc or al._any_div or al._plan))  # noqa: SLF001 - the package's own


def run(log: Any, conf: Any) -> Figures | None:
    """The figures of an uncapped replay of ``log`` under ``conf`` (see the module's text), or
    None where this replay does not apply (the caller replays event by event)."""
    n = len(log)
    if n == 0:
        return None
    if not applies(CachingAllocator(conf)):
        return None
    act = np.frombuffer(log.action, dtype=np.int8)
    if not np.isin(act, (0, 1, 5)).all():  # deferred frees, syncs, empty_cache
        return None
    ids = np.frombuffer(log.id, dtype=np.int64)
    size = np.frombuffer(log.size, dtype=np.int64)
    stream = np.frombuffer(log.stream, dtype=np.int32)
    paired = _pair(act, ids)
    if paired is None:
        return None
    src, alloc_ix, free_ix = paired
    # rounded sizes; zero-byte storages take no block and are left out
    sized = np.zeros(n, dtype=bool)
    sized[alloc_ix] = size[alloc_ix] > 0
    sized[free_ix] = sized[src[free_ix]]
    rsize = np.zeros(n, dtype=np.int64)
    rsize[alloc_ix] = np.maximum(MIN_BLOCK_SIZE, (size[alloc_ix] + 511) & ~511)
    rsize[free_ix] = rsize[src[free_ix]]
    small = sized & (rsize <= SMALL_SIZE)
    large = sized & ~small
    is_alloc = act == 0
    si = np.flatnonzero(small)
    sig = _signature(si, act, src, rsize, stream)
    stretches = _stretches(sig)
    if _covered(stretches) < COVER * n:  # (too little repeats: the event loop is faster)
        return None

    # the small pool first, its repeats fast-forwarded (it may give up: then nothing else is spent)
    sm = CachingAllocator(conf)
    got = _replay_small(sm, si, act, ids, size, stream, sig, stretches)
    if got is None:  # (its state never repeated: the event loop is faster)
        return None
    s_changes, skipped = got

    # the large pool, replayed alone
    big = CachingAllocator(conf)
    li = np.flatnonzero(large)
    bsize = np.zeros(n, dtype=np.int64)
    l_changes = _replay_large(big, li, act, ids, size, stream, bsize)
    big_free = li[~is_alloc[li]]
    bsize[big_free] = -bsize[src[big_free]]
    if (big._va._top - VA_BASE) + (sm._va._top - VA_BASE) > VA_LIMIT - VA_BASE:  # noqa: SLF001
        return None  # (the pools together outgrow the simulated address space: the event loop raises)

    # the totals per event, and their peaks as the event loop reads them
    d_alloc = np.where(small, np.where(is_alloc, rsize, -rsize), bsize)
    allocated = np.cumsum(d_alloc)
    req = np.where(sized & is_alloc, size, 0)
    req[free_ix] = -np.where(sized[free_ix], size[src[free_ix]], 0)
    requested = np.cumsum(req)
    k = int(np.argmax(allocated))
    max_a = int(allocated[k])
    if max_a <= 0:
        max_a, k = 0, -1
    merged = sorted([(i, 1, r) for i, r in s_changes] + [(i, 0, r) for i, r in l_changes])
    changes: list[tuple[int, int]] = []
    totals = [0, 0]
    max_r, ir, alloc_at_peak, segs_at_peak = 0, -1, 0, 0
    segs = 0
    for i, pool, r in merged:
        totals[pool] = r
        segs += 1  # (without a capacity every change is one more segment: none is freed)
        total = totals[0] + totals[1]
        changes.append((i, total))
        if total > max_r:
            max_r, ir, alloc_at_peak, segs_at_peak = total, i, int(allocated[i]), segs
    return Figures(
        max_allocated=max_a, peak_allocated_index=k, max_reserved=max_r, peak_reserved_index=ir,
        allocated_at_peak=alloc_at_peak, segments_at_peak=segs_at_peak, reserved_changes=changes,
        max_active=max_a, max_requested=max(0, int(requested.max())), max_segments=segs,
        final_allocated=int(allocated[-1]), final_reserved=totals[0] + totals[1], skipped=skipped,
    )


def _pair(act: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """For each free, the index of its allocation (``src``), and the indices of the allocations
    and frees; None unless every id alternates allocation, free, allocation… starting with an
    allocation (what the event loop accepts without a deferred free)."""
    alloc_ix, free_ix = np.flatnonzero(act == 0), np.flatnonzero(act == 1)
    src = np.full(len(act), -1, dtype=np.int64)
    alloc_ids = ids[alloc_ix]
    if len(alloc_ids) and (np.diff(alloc_ids) > 0).all():  # (each id allocated once: the tracer's)
        freed = ids[free_ix]
        if alloc_ids[-1] - alloc_ids[0] == len(alloc_ids) - 1:  # (consecutive, as the tracer numbers them)
            at = freed - alloc_ids[0]
            ok = (at >= 0) & (at < len(alloc_ids))
        else:
            at = np.searchsorted(alloc_ids, freed)
            ok = at < len(alloc_ids)
        if not ok.all() or (alloc_ids[at] != freed).any() or (alloc_ix[at] > free_ix).any() \
                or np.bincount(at, minlength=len(alloc_ids)).max(initial=0) > 1:
            return None
        src[free_ix] = alloc_ix[at]
        return src, alloc_ix, free_ix
    mem = np.flatnonzero(act != 5)
    order = np.lexsort((mem, ids[mem]))
    ix = mem[order]
    a = act[ix]
    same = np.zeros(len(ix), dtype=bool)
    same[1:] = ids[ix[1:]] == ids[ix[:-1]]
    prev_alloc = np.zeros(len(ix), dtype=bool)
    prev_alloc[1:] = a[:-1] == 0
    if ((a == 1) & ~(same & prev_alloc)).any() or ((a == 0) & same & prev_alloc).any():
        return None
    f = np.flatnonzero(a == 1)
    src[ix[f]] = ix[f - 1]
    return src, alloc_ix, free_ix


def _replay_large(al: CachingAllocator, li: np.ndarray, act: np.ndarray, ids: np.ndarray, size: np.ndarray,
                  stream: np.ndarray, bsize: np.ndarray) -> list[tuple[int, int]]:
    """Replay the large pool's events (indices ``li`` of the log) through the fused loop; the
    block size of each allocation into ``bsize``; the reserved changes (log index, bytes)."""
    got = array("q")
    changes = fused.run(al, array("b", act[li].tobytes()), array("q", ids[li].tobytes()),
                        array("q", size[li].tobytes()), array("i", stream[li].tobytes()), 0,
                        block_sizes=got)[7]
    bsize[li[act[li] == 0]] = np.frombuffer(got, dtype=np.int64) if len(got) else 0
    return [(int(li[i]), r) for i, r in changes]


def _signature(si: np.ndarray, act: np.ndarray, src: np.ndarray, rsize: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Each event of the small pool's sub-log (indices ``si`` of the log): an allocation its
    rounded size and stream, a free minus its distance back to its allocation in the sub-log."""
    m = len(si)
    ks = np.arange(m)
    pos = np.empty(len(act), dtype=np.int64)  # (read only at the small pool's allocations, which are set)
    pos[si] = ks
    frees = act[si] == 1
    back = np.zeros(m, dtype=np.int64)
    back[frees] = ks[frees] - pos[src[si[frees]]]
    st = stream[si].astype(np.int64)
    if (st >> 16).any():  # (streams beyond 16 bits: no signature repeats)
        return np.arange(m, dtype=np.int64) + (1 << 40)
    return np.where(frees, -back, (rsize[si] << 16) | (st & 0xFFFF))


def _covered(stretches: list[tuple[int, int, int]]) -> int:
    """Events in the union of the stretches."""
    total = end = 0
    for r0, r1, _ in stretches:
        if r1 > end:
            total += r1 - max(r0, end)
            end = r1
    return total


def _replay_small(al: CachingAllocator, si: np.ndarray, act: np.ndarray, ids: np.ndarray, size: np.ndarray,
                  stream: np.ndarray, sig: np.ndarray,
                  stretches: list[tuple[int, int, int]]) -> tuple[list[tuple[int, int]], int] | None:
    """Replay the small pool's events (indices ``si`` of the log) through the fused loop a piece
    at a time, skipping the periods of the ``stretches`` whose state repeats; the reserved
    changes (log index, bytes) and the number of events skipped; None after :data:`GIVE_UP`
    stretches in a row whose state did not repeat, before any did."""
    m = len(si)
    s_act = act[si]
    cols = (array("b", s_act.tobytes()), array("q", ids[si].tobytes()), array("q", size[si].tobytes()),
            array("i", stream[si].astype(np.int32).tobytes()))
    live: dict[int, Any] = {}
    changes: list[tuple[int, int]] = []
    sub_ids = cols[1]

    def piece(lo: int, hi: int) -> None:
        if hi > lo:
            got = fused.run(al, cols[0][lo:hi], cols[1][lo:hi], cols[2][lo:hi], cols[3][lo:hi], 0,
                            tag=True, live=live, offset=lo)[7]
            changes.extend(got)

    done = 0
    skipped = 0
    failed = 0
    for r0, r1, d in stretches:
        if any(d2 < d and r0 <= q0 < r0 + (TRIES + 2) * d for q0, _, d2 in stretches):
            continue  # (shorter repeats inside: replaying these periods would pass them by)
        r0 = max(r0, done)
        if r1 - r0 < 3 * d:
            continue
        piece(done, r0)
        done = r0
        seen: list[tuple[Any, ...]] = []
        for i in range(TRIES + 2):
            now = _state(al, done, 2 * d)
            # the state one period back (period d), or two (2d: two buffers taking turns)
            p = d if i >= 1 and now == seen[i - 1] else 2 * d if i >= 2 and now == seen[i - 2] else 0
            if p:
                periods = (r1 - done) // p
                _rename(live, done, 2 * d, periods * p, sub_ids)
                done += periods * p
                skipped += periods * p
                break
            if done + d > r1:
                break
            seen.append(now)
            piece(done, done + d)
            done += d
        if not p:
            failed += 1
            if failed >= GIVE_UP and not skipped:
                return None
    piece(done, m)
    return [(int(si[i]), r) for i, r in changes], skipped


def _stretches(sig: np.ndarray) -> list[tuple[int, int, int]]:
    """Stretches ``[r0, r1)`` of the signature with period ``d`` (``sig[k] == sig[k - d]``
    for every k in it) at least three periods long, by start; periods are the distances back
    to the previous run of :data:`GRAM` equal signatures that recur most."""
    m = len(sig)
    if m < 4 * GRAM:
        return []
    h = sig.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    w = 1
    mult = np.uint64(0xBF58476D1CE4E5B9)
    while w < GRAM:  # hash of sig[k : k + 2w] from those of length w
        h = h[:-w] * mult + (h[w:] ^ (h[w:] >> np.uint64(29)))
        w *= 2
    # grams sampled by their hash (1 in 64): equal grams are all kept or all dropped, so the
    # distances between kept equal grams are the distances back to each one's previous run
    kept = np.flatnonzero((h & np.uint64(63)) == 0)
    rate = 64
    if len(kept) < 4096:  # (few distinct grams, or a short log: keep them all)
        kept, rate = np.arange(len(h)), 1
    order = kept[np.argsort(h[kept], kind="stable")]
    hs = h[order]
    same = hs[1:] == hs[:-1]
    dist = (order[1:] - order[:-1])[same]
    if len(dist) == 0:
        return []
    values, counts = np.unique(dist, return_counts=True)
    out: list[tuple[int, int, int]] = []
    top = np.argsort(-counts, kind="stable")[:4]
    for d, c in zip(values[top].tolist(), counts[top].tolist(), strict=True):
        if d <= 0 or rate * c < 2 * d:
            continue
        eq = np.zeros(m, dtype=bool)
        eq[d:] = sig[d:] == sig[:-d]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], eq.view(np.int8), [0]))))
        for r0, r1 in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            if r1 - r0 >= 3 * d:
                out.append((r0, r1, d))
    out.sort()
    return out


def _state(al: CachingAllocator, b: int, window: int) -> tuple[Any, ...]:
    """The small pool's state at sub-log index ``b``: every block of every segment, segments in
    the order they were made (without a capacity none is freed, so also address order), with
    its size and what it holds (free; allocated within the last ``window``
    events, by age; allocated before, by its allocation's index)."""
    out: list[Any] = [al.reserved]
    for seg in al._segments.values():  # noqa: SLF001 - the allocator's own package
        x = seg.head
        while x is not None:
            if x.allocated:
                t = b - x.ev if x.ev >= b - window else -1 - x.ev
            else:
                t = 0
            out.append((x.addr, x.size, t))
            x = x.next
    return tuple(out)


def _rename(live: dict[int, Any], b: int, window: int, shift: int, sub_ids: array) -> None:
    """After skipping ``shift`` events from ``b``: each block allocated in the ``window``
    events before ``b`` now holds the allocation ``shift`` events later (the state repeats,
    its blocks renamed)."""
    recent = [(eid, x) for eid, x in live.items() if x.ev >= b - window]
    for eid, _ in recent:
        del live[eid]
    for _, x in recent:
        x.ev += shift
        live[sub_ids[x.ev]] = x


__all__ = ["Figures", "applies", "run"]
