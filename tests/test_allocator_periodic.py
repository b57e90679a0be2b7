"""The uncapped replay that fast-forwards repeats (:mod:`vramplan.allocator.periodic`) gives
every figure of the event-by-event replay: on random logs built of repeated stretches (with
buffers taking turns, growing large blocks, long-lived blocks, zero-byte storages, marks and
two streams), on traced generation logs, and through :func:`vramplan.allocator.replay`.
Where its conditions fail it answers None and the event loop replays."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vramplan.allocator import periodic, replay
from vramplan.allocator.config import as_config
from vramplan.allocator.replay import _run_plain, make_allocator
from vramplan.errors import WorkloadError
from vramplan.events import Action, EventLog

replay_mod = importlib.import_module("vramplan.allocator.replay")  # (the package exports the function)
MiB = 1 << 20
_RUN = ("max_allocated", "peak_allocated_index", "max_reserved", "peak_reserved_index",
        "allocated_at_peak", "segments_at_peak", "reserved_changes")
_STATE = ("max_active", "max_requested", "max_segments")


def _plain(log: EventLog, conf: str = "") -> dict:
    cfg = as_config(conf)
    al = make_allocator(cfg, None)
    run = _run_plain(log, al, fused=True)
    got = {f: getattr(run, f) for f in _RUN}
    got["reserved_changes"] = list(got["reserved_changes"])
    got |= {f: getattr(al, f) for f in _STATE}
    got |= {"final_allocated": al.allocated, "final_reserved": al.reserved}
    return got


@contextlib.contextmanager
def _always():
    """Fast-forward however little repeats (the bail-outs off), to test the machinery."""
    keep = periodic.COVER, periodic.GIVE_UP
    periodic.COVER, periodic.GIVE_UP = 0.0, 1 << 62
    try:
        yield
    finally:
        periodic.COVER, periodic.GIVE_UP = keep


def _fast(log: EventLog, conf: str = "") -> tuple[dict, int]:
    with _always():
        f = periodic.run(log, as_config(conf))
    assert f is not None
    got = {k: getattr(f, k) for k in (*_RUN, *_STATE, "final_allocated", "final_reserved")}
    got["reserved_changes"] = list(got["reserved_changes"])
    return got, f.skipped


small = st.sampled_from([0, 1, 512, 700, 4096, 16384, 65536, 200_000, MiB])
large = st.sampled_from([MiB + 1, 3 * MiB, 12 * MiB, 25 * MiB])
body_op = st.one_of(
    st.tuples(st.just("tmp"), st.one_of(small, small, large), st.integers(0, 1)),  # freed in the body
    st.tuples(st.just("carry"), small, st.just(0)),  # freed in the next repetition (turns)
    st.tuples(st.just("grow"), large, st.just(0)),  # a large block growing each repetition
    st.tuples(st.just("mark"), st.just(0), st.just(0)),
)


def build(prefix: list[int], body: list[tuple], reps: int, step: int, reuse: bool = False) -> EventLog:
    """``reuse``: a freed id is handed out again (a snapshot's addresses), else ids only grow."""
    log = EventLog()
    nxt = 0
    freed: list[int] = []

    def alloc(n: int, stream: int = 0) -> int:
        nonlocal nxt
        if reuse and freed:
            i = freed.pop()
        else:
            i, nxt = nxt, nxt + 1
        log.alloc(i, n, stream=stream)
        return i

    def free(i: int) -> None:
        log.append(Action.FREE, i)
        freed.append(i)

    for n in prefix:  # long-lived (weights)
        alloc(n)
    carried: list[int] = []
    grown: list[int] = []
    for r in range(reps):
        tmps: list[int] = []
        new_carried: list[int] = []
        new_grown: list[int] = []
        for kind, n, s in body:
            if kind == "tmp":
                tmps.append(alloc(n, s))
                if len(tmps) > 2:  # free one of the older temporaries: interleaved lifetimes
                    free(tmps.pop(len(tmps) % 2))
            elif kind == "carry":
                new_carried.append(alloc(n))
                if carried:
                    free(carried.pop(0))
            elif kind == "grow":
                new_grown.append(alloc(n + r * step))
                if grown:
                    free(grown.pop(0))
            else:
                log.append(Action.MARK)
        for i in tmps:
            free(i)
        carried, grown = new_carried, new_grown
    return log


@settings(max_examples=int(os.environ.get("PERIODIC_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prefix=st.lists(st.one_of(small, large), max_size=6), body=st.one_of(st.lists(body_op, min_size=1, max_size=8), st.lists(body_op, min_size=1, max_size=40)),
       reps=st.one_of(st.integers(1, 12), st.integers(20, 80)), step=st.sampled_from([0, 512, 2048]), reuse=st.booleans(),
       conf=st.sampled_from(["", "max_split_size_mb:20", "max_non_split_rounding_mb:32"]))
def test_equals_the_event_loop_on_repeated_logs(prefix, body, reps, step, reuse, conf) -> None:
    log = build(prefix, body, reps, step, reuse)
    if len(log) == 0:
        return
    got, skipped = _fast(log, conf)
    event("fast-forwarded" if skipped else "event by event")
    assert got == _plain(log, conf)


sizes_any = st.sampled_from([0, 1, 512, 513, 4096, 16384, 65536, 200_000, MiB - 1, MiB, MiB + 1, 3 * MiB, 25 * MiB])
# an allocation of the repeated body: size, stream, periods until its free (None: kept to the end),
# and where in that period it is freed (0..1 of the body)
item = st.tuples(sizes_any, st.sampled_from([0, 0, 0, 1]), st.sampled_from([0, 0, 0, 1, 1, 2, 3, None]),
                 st.floats(0, 1, allow_nan=False))
phase = st.tuples(st.lists(item, min_size=1, max_size=8), st.integers(1, 4),       # body, repeated inside (nested periods)
                  st.sampled_from([3, 8, 25, 60]),                                   # repetitions
                  st.sampled_from([0.0, 0.0, 0.0, 0.01, 0.05]),                      # rate of perturbation
                  st.sampled_from([0, 1, 1, 2]))                                     # longest lifetime (periods)


def build_phases(prefix, phases, shuffle, reuse, rnd) -> EventLog:
    ev: list[tuple[float, int, int, int]] = []  # (time, allocation key or -key-1 for its free, size, stream)
    key = 0
    for n in prefix:  # long-lived blocks, on either stream
        ev.append((-1.0, key, n, key % 2))
        if rnd.random() < 0.5:  # an old block freed somewhere later
            ev.append((rnd.uniform(0, 2000), -key - 1, 0, 0))
        key += 1
    t0 = 0.0
    for body, inner, reps, perturb, longest in phases:
        body = body * inner
        p = len(body)
        for r in range(reps):
            for a, (n, s, lag, f) in enumerate(body):
                if lag is None and longest < 2:
                    lag = 0  # (kept to the end: only where lifetimes are long anyway)
                if lag is not None and lag > longest:
                    lag, f = longest, f * a / p  # (freed before the same point of that period)
                if perturb and rnd.random() < perturb:
                    n, lag = rnd.choice([512, 8192, 2 * MiB]), rnd.choice([0, 1, None])
                t = t0 + r * p + a
                ev.append((t, key, n, s))
                if lag is not None:
                    at = t0 + (r + lag) * p + f * p + (rnd.uniform(-0.4, 0.4) if shuffle else 0.0)
                    ev.append((max(at, t + 0.01), -key - 1, 0, 0))
                key += 1
        t0 += reps * p
    ev.sort(key=lambda e: e[0])
    log = EventLog()
    ids: dict[int, int] = {}
    freed: list[int] = []
    nxt = 0
    for _, k, n, s in ev:
        if k >= 0:
            i = freed.pop() if reuse and freed else nxt
            nxt += i == nxt
            ids[k] = i
            log.alloc(i, n, stream=s)
            if k % 11 == 0:
                log.append(Action.MARK)
        elif -k - 1 in ids:
            i = ids.pop(-k - 1)
            log.append(Action.FREE, i)
            freed.append(i)
    return log


@settings(max_examples=int(os.environ.get("PERIODIC_EXAMPLES", "120")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prefix=st.lists(sizes_any, max_size=5), phases=st.lists(phase, min_size=1, max_size=3),
       shuffle=st.sampled_from([False, False, True]), reuse=st.booleans(), seed=st.integers(0, 2**32),
       conf=st.sampled_from(["", "max_split_size_mb:20", "max_non_split_rounding_mb:32"]))
def test_equals_the_event_loop_on_overlapping_lifetimes(prefix, phases, shuffle, reuse, seed, conf) -> None:
    """Lifetimes of 0-3 periods, frees in a different order each period, rare perturbations,
    nested periods, phases of other periods one after the other, and old blocks freed mid-stretch."""
    log = build_phases(prefix, phases, shuffle, reuse, random.Random(seed))
    if len(log) == 0:
        return
    got, skipped = _fast(log, conf)
    event("fast-forwarded" if skipped else "event by event")
    assert got == _plain(log, conf)


def test_it_declines_where_the_pools_together_run_out_of_address_space() -> None:
    # apart, each pool fits the simulated address space; together (the event loop) they do not
    log = EventLog()
    log.alloc(0, (1 << 47) - (1 << 32) - 2 * MiB)
    for i in range(1, 201):
        log.alloc(i, 4096)
        log.append(Action.FREE, i)
    for i in range(201, 204):
        log.alloc(i, MiB)
    with pytest.raises(WorkloadError):
        _plain(log)
    assert periodic.run(log, as_config("")) is None


def _decode_like(layers: int, steps: int) -> EventLog:
    """A decode loop's shape: per step, per layer, temporaries, a hidden state handed to the next
    layer, and a KV block per layer that grows each step (large pool)."""
    body = [("carry", 16384, 0), ("tmp", 4096, 0), ("tmp", 65536, 0), ("tmp", 16384, 0), ("tmp", 512, 0),
            ("tmp", 200_000, 0), ("tmp", 4096, 0)] * 4
    log = EventLog()
    nxt = 0
    kv: dict[int, int] = {}
    hidden = None
    for s in range(steps):
        for layer in range(layers):
            ids = []
            for kind, n, _ in body:
                log.alloc(nxt, n)
                ids.append(nxt)
                nxt += 1
                if kind == "carry":
                    if hidden is not None:
                        log.append(Action.FREE, hidden)
                    hidden = ids.pop()
            log.alloc(nxt, 3 * MiB + s * 2048)  # this layer's KV block, one token longer
            if layer in kv:
                log.append(Action.FREE, kv[layer])
            kv[layer] = nxt
            nxt += 1
            for i in ids:
                log.append(Action.FREE, i)
        log.append(Action.MARK)
    return log


def test_a_decode_loop_is_fast_forwarded_and_exact() -> None:
    log = _decode_like(layers=40, steps=12)
    got, skipped = _fast(log)
    assert skipped > len(log) // 2  # most of it is not replayed event by event
    assert got == _plain(log)
    f = periodic.run(log, as_config(""))  # (with the bail-outs on, the same)
    assert f is not None and f.skipped == skipped


def test_it_declines_where_little_repeats() -> None:
    # a log without repeats: nothing to fast-forward, the event loop is faster
    log = build([3 * MiB], [("tmp", 512 * (1 + k % 1999), 0) for k in range(400)], 1, 0)
    assert periodic.run(log, as_config("")) is None
    # repeats whose state never does (a block kept from each period): given up after three
    log = EventLog()
    ids = iter(range(1 << 40))
    for phase in range(8):
        for _ in range(500):
            log.alloc(next(ids), 4096)
            log.alloc(k := next(ids), 8192)
            log.append(Action.FREE, k)
        for n in range(40):  # (a different stretch each phase)
            log.alloc(k := next(ids), 512 * (3 + phase * 40 + n))
            log.append(Action.FREE, k)
    with _always():
        f = periodic.run(log, as_config(""))
    assert f is not None and f.skipped == 0
    assert periodic.run(log, as_config("")) is None


def test_a_traced_generation_log_gives_the_same_figures() -> None:
    from vramplan.models.catalog import resolve
    from vramplan.models.normalize import spec_from_config
    from vramplan.trace.run import trace_workload
    from vramplan.workload import Workload

    # Llama-3.1-8B's width with 8 layers: each layer's KV block is in the large pool (> 1 MiB)
    spec = spec_from_config({**resolve("llama-3.1-8b").config, "num_hidden_layers": 8}, name="llama-8b-8-layers",
                            source="llama-3.1-8b's config, 8 layers")
    tr = trace_workload(spec, Workload(task="generate", precision="bf16", batch=1, seq=600, new_tokens=16),
                        iterations=1)
    got, skipped = _fast(tr.events)
    assert skipped > 0
    assert got == _plain(tr.events)


def test_replay_takes_it_for_long_logs_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _decode_like(layers=40, steps=12)
    monkeypatch.setattr(replay_mod, "PERIODIC_MIN_EVENTS", 1)
    calls = []
    real = periodic.run
    monkeypatch.setattr(periodic, "run", lambda *a: calls.append(1) or real(*a))
    fast = replay(log, "", segment_map=True)
    monkeypatch.setattr(replay_mod, "PERIODIC_MIN_EVENTS", 10**12)
    slow = replay(log, "", segment_map=True)
    assert calls and dataclasses.asdict(fast) == dataclasses.asdict(slow)
    # with a capacity, a timeline or segment events it does not apply
    calls.clear()
    monkeypatch.setattr(replay_mod, "PERIODIC_MIN_EVENTS", 1)
    replay(log, "", capacity=10**12, segment_map=False)
    replay(log, "", record_timeline=True, segment_map=False)
    replay(log, "", record_segments=True, segment_map=False)
    replay(log, "expandable_segments:True", segment_map=False)
    assert not calls


@pytest.mark.parametrize("extra", ["deferred", "sync", "empty", "double", "unknown"])
def test_logs_it_cannot_take_are_left_to_the_event_loop(extra: str) -> None:
    log = _decode_like(layers=4, steps=2)
    n = 10**9
    if extra == "deferred":
        log.alloc(n, 4096)
        log.append(Action.FREE_DEFERRED, n)
    elif extra == "sync":
        log.append(Action.SYNC)
    elif extra == "empty":
        log.append(Action.EMPTY_CACHE)
    elif extra == "double":
        log.alloc(n, 4096)
        log.alloc(n, 4096)
    else:
        log.append(Action.FREE, n)
    assert periodic.run(log, as_config("")) is None
    for conf in ("expandable_segments:True", "roundup_power2_divisions:4"):
        assert not periodic.applies(make_allocator(as_config(conf), None))
    assert not periodic.applies(make_allocator(as_config(""), 80 * 2**30))
