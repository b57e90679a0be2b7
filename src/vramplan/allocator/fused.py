"""The replay's hot loop for the native allocator: ``malloc`` and ``free`` inlined.

An estimate replays every event of a trace (0.9 M for 128 decode steps of a 70B model, twice
when the step does not fit the GPU); per event, the method calls and the attribute reads of
:meth:`CachingAllocator.malloc` / :meth:`CachingAllocator.free` cost more than the allocator's
decisions. :func:`run` walks the event columns once with the common paths of both written out
here — ``round_size`` with 512-byte granularity, ``get_free_block``'s best fit, ``should_split``
/ ``alloc_found_block``, ``free_block`` with ``try_merge_blocks`` — and the byte counters held in
locals. Everything else (no cached block fits: GC, cudaMalloc, release and retry, OOM;
deferred-free completion; ``synchronize``; ``empty_cache``) is the allocator's own method,
called with the counters written back first and read again after.

Only the native backend without expandable segments takes it (the default, and what an
estimate replays unless the user configures otherwise), for every pass without a per-event
timeline: the plain pass, and the tagged ones (the segment map at the peak, segment events).
The decisions are those of :mod:`.native`, line for line, and ``tests/test_allocator_fused.py``
checks that a pass through this loop equals the method-by-method pass
(:func:`vramplan.allocator.replay._run` with ``fused=False``) in every figure, counter, segment
event and in the segment map, on random logs under every allocator option.
"""

from __future__ import annotations

import gc
from array import array
from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from vramplan.errors import VramplanError

from . import freelist
from .blocks import SHIFT, Block, Pool, Segment
from .constants import SMALL_SIZE
from .native import CachingAllocator
from .sizes import allocation_size, round_size

if TYPE_CHECKING:
    from .freelist import Keys

_NOWHERE = Pool(False, -1)
_MISSING = Block(-1, 0, _NOWHERE, Segment(-1, 0, _NOWHERE, False))
"""What ``dict.pop`` returns for an id the replay does not hold: a block in no segment's chain
(a block, so that the loop's variables keep one type, which compiles best)."""


def eligible(al: object) -> bool:
    """Whether :func:`run` can replay on ``al`` (native backend, no expandable segments)."""
    return type(al) is CachingAllocator and not al._es  # noqa: SLF001 - the allocator's own package


def run(al: CachingAllocator, action: array[int], ident: array[int], size: array[int], stream: array[int],
        max_oom_indices: int, *, stop: int = -1,
        tag: bool = False, first_oom: bool = False, live: dict[int, Block | None] | None = None,
        offset: int = 0, block_sizes: array[int] | None = None) -> tuple[int, int, int, int, int, int, list[int], list[tuple[int, int]]]:
    """Replay the event columns on ``al``: (max allocated, its event index, max reserved, its
    event index, allocated at the reserved peak, segments at the reserved peak, the first
    ``max_oom_indices`` OOM'd event indices, the reserved changes ``(event index, bytes)``).
    ``stop`` ≥ 0 ends after that event; ``first_oom`` ends at the first ALLOC that runs out of
    memory (where PyTorch raises); ``tag`` stamps each allocated block with its event index
    (``Block.ev``) and each segment event with the event that caused it (``cur_event``).
    ``live`` (id → block) and ``offset`` (the index of the first row) continue a replay run
    in pieces (:mod:`.periodic`): the peaks and changes returned are then the piece's own.
    ``block_sizes`` gets the block size of each allocation that took one, in order."""
    collecting = gc.isenabled()
    gc.disable()  # (the blocks' prev/next links are cycles: a collection pass every few thousand
    try:          # new blocks would walk them all, to find nothing; they are collected after)
        return _loop(al, action, ident, size, stream, max_oom_indices, stop, tag, first_oom, live, offset,
                     block_sizes)
    finally:
        if collecting:
            gc.enable()


def _loop(al: CachingAllocator, action: array[int], ident: array[int], size: array[int], stream: array[int],
          max_oom_indices: int, stop: int, tag: bool, first_oom: bool, live: dict[int, Block | None] | None,
          offset: int, block_sizes: array[int] | None) -> tuple[int, int, int, int, int, int, list[int], list[tuple[int, int]]]:
    """:func:`run`'s loop, with the cyclic garbage collector paused."""
    # allocator state, read once (these objects are mutated in place, never replaced)
    conf = al.conf
    free_map: dict[int, Block] = al._free  # noqa: SLF001
    small_pools: dict[int, Pool] = al._small_pools  # noqa: SLF001
    large_pools: dict[int, Pool] = al._large_pools  # noqa: SLF001
    gc_on: bool = al._gc  # noqa: SLF001
    gc_calls: list[int] = al._gc_calls  # noqa: SLF001
    msplit: int = al._msplit  # noqa: SLF001
    nsr: int = al._nsr  # noqa: SLF001
    any_div: bool = al._any_div  # noqa: SLF001
    malloc_slow = al._malloc_slow  # noqa: SLF001
    allocated: int = al.allocated
    active: int = al.active
    requested: int = al.requested
    inactive_split: int = al.inactive_split
    reserved: int = al.reserved
    max_active: int = al.max_active
    max_requested: int = al.max_requested
    high: int = freelist.HIGH
    missing = _MISSING
    bisect = bisect_left  # (locals: a compiled loop reads globals from a dict on every use)
    put = insort

    if live is None:
        live = {}
    deferred: dict[int, Block | None] = {}
    oom_indices: list[int] = []
    changes: list[tuple[int, int]] = []
    max_a = max_r = 0
    last_r = reserved  # (0 for a fresh allocator; a piece of a run starts from where it stood)
    ia = ir = -1
    alloc_at_peak = segs_at_peak = 0
    k = offset - 1
    if stop >= 0:  # (copies of the first rows: the loop below stays a plain zip, which compiles best)
        action, ident, size, stream = action[:stop + 1], ident[:stop + 1], size[:stop + 1], stream[:stop + 1]
    b: Block | None
    keys: Keys
    # blocks merged into a neighbour (no list, map or chain holds them), reused by the next splits:
    # that saves allocating, and later collecting, a Python object per split
    spare: list[Block] = []
    for act, eid, nbytes, st in zip(action, ident, size, stream, strict=False):
        k += 1
        if act == 0:  # ALLOC
            if eid in live:
                raise VramplanError(f"event {k}: id {eid} allocated again before it was freed")
            if nbytes <= 0:  # takes no memory (PyTorch does not call the allocator)
                live[eid] = None
                continue
            # --- malloc (CachingAllocator.malloc, non-expandable) ---
            if nbytes <= 512:
                rsize = 512
            elif any_div:
                rsize = round_size(nbytes, conf)
            else:
                rsize = (nbytes + 511) & ~511
            small = rsize <= SMALL_SIZE
            pools = small_pools if small else large_pools
            pool = pools.get(st)
            if pool is None:
                pool = pools[st] = Pool(small, st)
            if gc_on:
                gc_calls[small] += 1
            b = None
            keys = pool.keys
            if isinstance(keys, list):
                i = bisect(keys, rsize << SHIFT)
                if i < len(keys):
                    key = keys[i]
                    bsize = key >> SHIFT
                    if (bsize < msplit) if rsize < msplit else (bsize < rsize + nsr):
                        del keys[i]
                        b = free_map.pop(key)
            else:  # (a long free list, :mod:`.freelist`: the same search, and the same limit)
                key = keys.take(rsize, msplit if rsize < msplit else rsize + nsr)
                if key >= 0:
                    b = free_map.pop(key)
            if b is None:
                al.allocated, al.active, al.requested, al.inactive_split = allocated, active, requested, inactive_split
                if tag:
                    al.cur_event = k
                b = malloc_slow(pool, rsize, allocation_size(rsize, conf))
                active, requested, inactive_split = al.active, al.requested, al.inactive_split
                reserved = al.reserved
            if b is None:
                if len(oom_indices) < max_oom_indices:
                    oom_indices.append(k)
                if first_oom:
                    break
            else:
                remaining = b.size - rsize
                if (remaining >= 512) if small else (rsize < msplit and remaining > SMALL_SIZE):
                    prev = b.prev
                    already_split = prev is not None or b.next is not None
                    if spare:  # (a block merged away earlier, its fields as Block() sets them)
                        nb = spare.pop()
                        nb.addr, nb.size, nb.pool, nb.seg = b.addr, rsize, pool, b.seg
                        nb.req = nb.events = nb.gc_base = 0
                        nb.allocated, nb.mapped, nb.ev = False, True, -1
                    else:
                        nb = Block(b.addr, rsize, pool, b.seg)
                    nb.prev = prev
                    if prev is None:
                        b.seg.head = nb
                    else:
                        prev.next = nb
                    nb.next = b
                    b.prev = nb
                    b.addr += rsize
                    b.size = remaining
                    key = (remaining << SHIFT) | b.addr
                    keys = pool.keys
                    if isinstance(keys, list):  # (made blocked, if long, at the next free)
                        put(keys, key)
                    else:
                        keys.put(key, remaining, b.addr)
                    free_map[key] = b
                    if gc_on:  # (without GC the count stays 0: so does every gc_base)
                        b.gc_base = gc_calls[small]
                    if already_split:
                        inactive_split -= rsize
                    else:
                        inactive_split += remaining
                    b = nb
                elif b.prev is not None or b.next is not None:
                    inactive_split -= b.size
                b.allocated = True
                b.req = nbytes
                bs = b.size
                if block_sizes is not None:
                    block_sizes.append(bs)
                allocated += bs
                active += bs
                if active > max_active:
                    max_active = active
                requested += nbytes
                if requested > max_requested:
                    max_requested = requested
                if tag:
                    b.ev = k
            live[eid] = b
            # --- peaks (replay._run_plain) ---
            if allocated > max_a:
                max_a = allocated
                ia = k
            if reserved != last_r:
                changes.append((k, reserved))
                last_r = reserved
                if reserved > max_r:
                    max_r = reserved
                    ir = k
                    alloc_at_peak = allocated
                    segs_at_peak = al.num_segments
        elif act == 1:  # FREE
            b = live.pop(eid, missing)
            if b is None:
                continue
            if b is missing:  # completes a deferred free, or is an error
                d = deferred.pop(eid, missing)
                if d is missing:
                    raise VramplanError(f"event {k}: free of id {eid}, which is not allocated")
                if d is None:  # a zero-byte or OOM'd storage: no block
                    continue
                al.allocated, al.active, al.requested, al.inactive_split = allocated, active, requested, inactive_split
                if tag:
                    al.cur_event = k
                al.complete(d)
                active, requested, inactive_split = al.active, al.requested, al.inactive_split
                continue
            # --- free + free_block (try_merge_blocks with both neighbours) ---
            b.allocated = False
            orig_size = b.size
            allocated -= orig_size
            pool = b.pool
            keys = pool.keys
            net = 0
            p = b.prev
            if p is not None and not p.allocated and not p.events:  # (every block is mapped)
                key = (p.size << SHIFT) | p.addr
                if isinstance(keys, list):
                    del keys[bisect(keys, key)]
                else:
                    keys.drop(p.size, p.addr)
                del free_map[key]
                b.addr = p.addr
                b.size += p.size
                net -= p.size
                pp = p.prev
                b.prev = pp
                if pp is None:
                    b.seg.head = b
                else:
                    pp.next = b
                p.prev = p.next = None
                spare.append(p)
            n = b.next
            if n is not None and not n.allocated and not n.events:
                key = (n.size << SHIFT) | n.addr
                if isinstance(keys, list):
                    del keys[bisect(keys, key)]
                else:
                    keys.drop(n.size, n.addr)
                del free_map[key]
                b.size += n.size
                net -= n.size
                nn = n.next
                b.next = nn
                if nn is not None:
                    nn.prev = b
                n.prev = n.next = None
                spare.append(n)
            key = (b.size << SHIFT) | b.addr
            if isinstance(keys, list):
                put(keys, key)
                if len(keys) > high:
                    pool.keys = freelist.lengthen(keys)  # (looked up here: tests swap it)
            else:
                keys.put(key, b.size, b.addr)
            free_map[key] = b
            if gc_on:
                b.gc_base = gc_calls[pool.small]
            if b.prev is not None or b.next is not None:
                net += b.size
            inactive_split += net
            active -= orig_size
            requested -= b.req
            b.req = 0
        elif act == 2:  # FREE_DEFERRED: CachingAllocator.free(b, deferred=True)
            b = live.pop(eid, missing)
            if b is missing:
                raise VramplanError(f"event {k}: deferred free of id {eid}, which is not allocated")
            if b is not None:
                b.allocated = False
                allocated -= b.size
                b.events += 1
                al._pending.append(b)  # noqa: SLF001
            deferred[eid] = b
        elif act == 3 or act == 4:  # SYNC / EMPTY_CACHE
            al.allocated, al.active, al.requested, al.inactive_split = allocated, active, requested, inactive_split
            if tag:
                al.cur_event = k
            if act == 3:
                al.synchronize()
                deferred.clear()
            else:
                al.empty_cache()
            active, requested, inactive_split = al.active, al.requested, al.inactive_split
            reserved = al.reserved
            if act == 4 and reserved != last_r:
                changes.append((k, reserved))
                last_r = reserved
    al.allocated, al.active, al.requested, al.inactive_split = allocated, active, requested, inactive_split
    al.max_active, al.max_requested = max_active, max_requested
    if tag and k >= 0:
        al.cur_event = k  # (the method loop stamps every event; only segment events read it)
    return max_a, ia, max_r, ir, alloc_at_peak, segs_at_peak, oom_indices, changes
