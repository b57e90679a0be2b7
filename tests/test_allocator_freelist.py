"""A pool's free list (:mod:`vramplan.allocator.freelist`): the blocked form of a long list
keeps the same keys in the same order, and the allocator decides exactly as with a plain list.

The thresholds are shrunk here (a free list turns blocked past 2 keys, runs split past 4), so
that the random logs of the allocator's property tests run on blocked lists throughout.
"""

from __future__ import annotations

import contextlib
from bisect import bisect_left, insort
from collections.abc import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_allocator_fused import _FIELDS, _STATE, build_log
from test_allocator_fused import op as fused_op
from test_allocator_props import CONFS, MiB, ops_lists, run_ops
from vramplan.allocator import freelist
from vramplan.allocator.blocks import SHIFT
from vramplan.allocator.check import _blocked_problems, check_invariants
from vramplan.allocator.config import as_config
from vramplan.allocator.freelist import Blocked
from vramplan.allocator.native import CachingAllocator
from vramplan.allocator.replay import _run_plain, make_allocator, replay
from vramplan.events import EventLog

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def thresholds(high: int, load: int) -> Iterator[None]:
    old = freelist.HIGH, freelist.LOAD
    freelist.HIGH, freelist.LOAD = high, load
    try:
        yield
    finally:
        freelist.HIGH, freelist.LOAD = old


def blocked_pools(al: CachingAllocator) -> int:
    return sum(isinstance(p.keys, Blocked) for pools in (al._small_pools, al._large_pools) for p in pools.values())


@SETTINGS
@given(start=st.lists(st.integers(0, 500), unique=True, max_size=30),
       ops=st.lists(st.tuples(st.sampled_from(["add", "remove", "ge", "lt"]), st.integers(-1, 501)), max_size=200),
       load=st.integers(1, 4))
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
    invariant after every step), with every free list of more than two blocks blocked."""
    with thresholds(2, 2):
        run_ops(conf, ops, capacity=None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), ops=st.lists(fused_op, min_size=5, max_size=200),
       capacity=st.one_of(st.none(), st.integers(8, 300).map(lambda m: m * MiB)))
def test_replay_on_blocked_lists_equals_plain_lists(conf, ops, capacity):
    """Fused loop and method loop, on blocked lists, against the method loop on plain ones:
    every figure of the pass, every counter after it, the segment map, the GC counts."""
    log = build_log(ops)

    def one(high: int, use_fused: bool) -> tuple:
        with thresholds(high, 2):
            al = make_allocator(as_config(conf), capacity)
            run = _run_plain(log, al, fused=use_fused and type(al) is CachingAllocator and not al._es)
            if isinstance(al, CachingAllocator):
                assert check_invariants(al) == []
            return (tuple(getattr(run, f) for f in _FIELDS), tuple(getattr(al, f) for f in _STATE),
                    al.snapshot(), al._gc_calls)

    plain = one(10**9, False)
    assert one(2, False) == plain
    assert one(2, True) == plain


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
