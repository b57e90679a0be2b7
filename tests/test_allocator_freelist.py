"""A pool's free list (:mod:`vramplan.allocator.freelist`): the blocked form of a long list
keeps the same keys in the same order, and the allocator decides exactly as with a plain list.

The thresholds are shrunk here (a free list turns blocked past 2 keys, runs split past 4), so
that the random logs of the allocator's property tests run on blocked lists throughout.
"""

from __future__ import annotations

import contextlib
import random
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_allocator_fused import _FIELDS, _STATE
from test_allocator_props import CONFS, MiB, ops_lists, run_ops
from vramplan.allocator import core, freelist
from vramplan.allocator.blocks import SHIFT
from vramplan.allocator.check import _blocked_problems, check_invariants
from vramplan.allocator.config import as_config
from vramplan.allocator.freelist import Blocked
from vramplan.allocator.native import CachingAllocator
from vramplan.allocator.replay import _run_plain, make_allocator, replay
from vramplan.errors import VramplanError
from vramplan.events import Action, EventLog

KEYSET = core.keyset()
"""The C key set where the compiled core is built (None otherwise: only :class:`Blocked` is tested)."""
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def thresholds(high: int, load: int, long: Callable[[list[int]], Any] = Blocked) -> Iterator[None]:
    """Free lists made long past ``high`` keys, as ``long`` (:class:`Blocked` with runs of
    ``load``, unless another kind is given: the C key set of the compiled core)."""
    old = freelist.HIGH, freelist.LOAD, freelist.lengthen
    freelist.HIGH, freelist.LOAD, freelist.lengthen = high, load, long
    try:
        yield
    finally:
        freelist.HIGH, freelist.LOAD, freelist.lengthen = old


def blocked_pools(al: CachingAllocator) -> int:
    """Pools whose free list is long (either kind)."""
    return sum(not isinstance(p.keys, list) for pools in (al._small_pools, al._large_pools) for p in pools.values())


@SETTINGS
@given(start=st.lists(st.integers(0, 500), unique=True, max_size=30),
       ops=st.lists(st.tuples(st.sampled_from(["add", "remove", "ge", "lt"]), st.integers(-1, 501)), max_size=200),
       load=st.integers(1, 8))
def test_blocked_behaves_as_a_sorted_list(start, ops, load):
    with thresholds(freelist.HIGH, load):
        model = sorted(start)
        keys = Blocked(list(model))
        for kind, x in ops:
            if kind == "add" and x >= 0 and x not in model:
                insort(model, x)
                keys.add(x)
            elif kind == "remove" and model:
                k = model.pop(x % len(model))
                keys.remove(k)
            elif kind == "ge":
                i = bisect_left(model, x)
                assert keys.ge(x) == (model[i] if i < len(model) else -1) == freelist.ge(model, x)
            elif kind == "lt":
                i = bisect_left(model, x)
                assert keys.lt(x) == (model[i - 1] if i else -1) == freelist.lt(model, x)
            assert list(keys) == model and len(keys) == len(model) and keys == model
            assert _blocked_problems(keys) == []


def test_a_list_turns_blocked_past_the_threshold_and_keeps_its_keys():
    from vramplan.allocator.blocks import Pool

    with thresholds(8, 2):
        pool = Pool(False, 0)
        for k in range(20, 0, -2):
            freelist.add(pool, k)
            assert isinstance(pool.keys, list) == (len(pool.keys) <= 8)
        assert isinstance(pool.keys, Blocked)
        assert list(pool.keys) == list(range(2, 21, 2))
        assert _blocked_problems(pool.keys) == []
        freelist.remove(pool.keys, 10)
        assert freelist.ge(pool.keys, 9) == 12 and freelist.lt(pool.keys, 12) == 8


@SETTINGS
@given(conf=st.sampled_from(CONFS), ops=ops_lists)
def test_allocator_rules_hold_on_blocked_free_lists(conf, ops):
    """The property test of the allocator (best fit by linear scan at every allocation, every
    invariant after every step), with every free list blocked from its first key."""
    with thresholds(0, 1):
        run_ops(conf, ops, capacity=None)


CONF_ALL = [*CONFS, "max_split_size_mb:20,max_non_split_rounding_mb:100",
            "garbage_collection_threshold:0.3,per_process_memory_fraction:0.5,max_split_size_mb:20"]


def churn_log(r: random.Random, n: int) -> EventLog:
    """Allocations of every size class on two streams, freed in random order (so free blocks
    pile up between live ones), deferred frees, syncs and now and then an ``empty_cache``."""
    log, live, pending, nxt = EventLog(), [], [], 0

    def size() -> int:
        c = r.random()
        return (r.randint(1, 4096) if c < .3 else r.randint(4096, MiB) if c < .6
                else r.randint(MiB, 30 * MiB) if c < .9 else r.randint(30 * MiB, 120 * MiB))

    for _ in range(n):
        c = r.random()
        if c < .55 or not live:
            log.alloc(nxt, size(), stream=r.choice([0, 0, 0, 1]))
            live.append(nxt)
            nxt += 1
        elif c < .88:
            i = live.pop(r.randrange(len(live)))
            if r.random() < .1:
                log.append(Action.FREE_DEFERRED, i)
                pending.append(i)
            else:
                log.free(i)
        elif c < .95 and pending:
            log.free(pending.pop(r.randrange(len(pending))))
        elif c < .98:
            log.append(Action.SYNC)
            pending.clear()
        else:
            log.append(Action.EMPTY_CACHE)
    return log


def replayed(log: EventLog, conf: str, capacity: int | None, high: int, load: int, use_fused: bool,
             first_oom: bool = False, long: Callable[[list[int]], Any] = Blocked) -> tuple[tuple, int]:
    """Every figure of the pass, every counter after it, the segment map and the GC counts (or
    the error raised), and how many pools ended blocked (``long``: the long lists' kind)."""
    with thresholds(high, load, long):
        al = make_allocator(as_config(conf), capacity)
        try:
            run = _run_plain(log, al, fused=use_fused and type(al) is CachingAllocator and not al._es,
                             first_oom=first_oom)
        except VramplanError as e:
            return ("error", str(e)), 0
        if isinstance(al, CachingAllocator):
            assert check_invariants(al) == []
        return ((tuple(getattr(run, f) for f in _FIELDS), tuple(getattr(al, f) for f in _STATE),
                 al.snapshot(), tuple(al._gc_calls)), blocked_pools(al) if isinstance(al, CachingAllocator) else 0)


def test_replay_on_blocked_lists_equals_plain_lists():
    """Random churning logs under every allocator option, with and without a capacity: the
    method loop and the fused loop on lists blocked from their first key (runs of 1–4 keys,
    split and emptied all the time) against the method loop on plain lists."""
    blocked = 0
    for seed in range(150):
        r = random.Random(seed)
        log = churn_log(r, r.randint(50, 500))
        conf = CONF_ALL[seed % len(CONF_ALL)]
        capacity = r.choice([None, None, r.randint(40, 600) * MiB])
        first_oom = r.random() < .2
        plain, _ = replayed(log, conf, capacity, 10**9, 512, False, first_oom)
        cases = [(10**9, 512, True, Blocked), (0, 1 + seed % 4, False, Blocked), (r.randint(0, 3), 1 + seed % 3, True, Blocked)]
        if KEYSET is not None:  # (the compiled core's key set, from the first key, in both loops)
            cases += [(0, 512, False, KEYSET), (r.randint(0, 3), 512, True, KEYSET)]
        for high, load, use_fused, long in cases:
            got, n = replayed(log, conf, capacity, high, load, use_fused, first_oom, long)
            assert got == plain, (seed, conf, capacity, high, load, use_fused, long)
            blocked += n > 0
    assert blocked > 250 * (len(cases) - 1) / 2  # (the long lists were there: most runs end with one)


def test_best_fit_at_the_split_limit_on_a_blocked_list():
    """``max_split_size_mb:20``: a 42 MiB request may take a cached block under 42 + 20 MiB only;
    the 61 MiB block is the best fit but 61 < 41.. + 20 decides, on either kind of list."""
    log = EventLog()
    for i in range(4):
        log.alloc(i, (61 + i) * MiB)
    for i in (2, 0, 3, 1):
        log.free(i)
    log.alloc(9, 42 * MiB)
    log.alloc(10, 40 * MiB)
    for use_fused in (False, True):
        plain, _ = replayed(log, "max_split_size_mb:20", None, 10**9, 512, use_fused)
        got, n = replayed(log, "max_split_size_mb:20", None, 0, 1, use_fused)
        assert n == 1 and got == plain


def test_the_expandable_walk_prefers_the_block_that_cannot_grow():
    """PyTorch's expandable best fit: a free block followed by unmapped space counts as the size
    it could grow to, so a larger free block between live ones wins. Here: a 2 MiB mapped tail
    (then the unmapped rest of the segment) and a 6 MiB hole; a 2 MiB request takes the hole."""
    for high in (10**9, 0):
        with thresholds(high, 1):
            al = CachingAllocator("expandable_segments:True")
            x = al.malloc(6 * MiB, 0)
            al.malloc(12 * MiB, 0)
            hole = x.addr
            al.free(x)
            assert sorted(k >> SHIFT for k in al._large_pools[0].keys) == [2 * MiB, 6 * MiB]
            assert al.malloc(2 * MiB, 0).addr == hole
            assert check_invariants(al) == []


def test_ge_and_lt_at_every_point_of_a_blocked_list():
    """Every query from below the first key to past the last, run maxima included."""
    for load in (1, 2, 3, 4, 6):
        with thresholds(freelist.HIGH, load):
            model = list(range(2, 41, 2))
            keys = Blocked(list(model))
            for k in (10, 2, 40, 24, 26):  # (emptied and shortened runs)
                model.remove(k)
                keys.remove(k)
            assert _blocked_problems(keys) == []
            for x in range(0, 43):
                i = bisect_left(model, x)
                assert keys.ge(x) == (model[i] if i < len(model) else -1)
                assert keys.lt(x) == (model[i - 1] if i else -1)


def test_many_segment_tails_replay_as_with_a_plain_list():
    """The case the blocked list is for: thousands of weights, each in a segment of its own
    with a free 2 MiB tail, then steps of activations allocated and freed among them."""
    log = EventLog()
    n = 0
    for _ in range(5000):  # two 9 MiB weights per 20 MiB segment: a 2 MiB tail each
        log.alloc(n, 9 * MiB)
        n += 1
    for step in range(3):
        acts = []
        for j in range(400):
            log.alloc(n, (1 + (j * 37 + step) % 9) * MiB // 2 + 512)
            acts.append(n)
            n += 1
        for i in acts[::-1]:
            log.free(i)
    with thresholds(10**9, freelist.LOAD):
        plain = replay(log, "", segment_map=True)
    al = make_allocator(as_config(""), None)
    _run_plain(log, al, fused=True)
    assert blocked_pools(al) >= 1
    assert replay(log, "", segment_map=True) == plain
    assert max(len(p.keys) for p in al._large_pools.values()) > freelist.HIGH
    assert all((k >> SHIFT) > 0 for p in al._large_pools.values() for k in p.keys)
