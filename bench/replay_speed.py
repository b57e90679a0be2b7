"""Speed of the allocator replay: ≥ 1,000,000 events in ≤ 3 s (target), pure Python.

Builds a synthetic transformer-like training trace (parameters and optimizer state once, then
steps of forward activations, short-lived temporaries, backward gradients and an optimizer
update, with small- and large-pool sizes and a varying sequence length), replays it with the
default config and with expandable segments, and prints events/s and the ratio to the target.

Then the replay of real trace logs (Llama-3.1-8B training steps traced here, with and without
checkpointing, and Llama-3.1-70B generating 128 tokens), as the estimate pipeline used to replay
them (timeline at every event plus a second pass for the segment map at the peak), with the
allocator's methods, through the fused event loop, and as it replays them now (from 100,000
events, uncapped: the pools apart and repeated stretches fast-forwarded, :mod:`vramplan.allocator.periodic`):
events/s of each, target ≥ 800,000 events/s.

The synthetic trace's rates are those of the event loop (the fast-forward is switched off for
them: the target is the loop's); one more line gives the default replay as it runs now.

With ``--moe``, also the log of DeepSeek-V3's training step (what ``vramplan estimate deepseek-v3
--task train`` replays: 2.4 M events, ~55,000 segments, up to 32,000 free blocks in one pool),
replayed by the Python source with every free list a plain sorted list (as the replay kept them
before :mod:`vramplan.allocator.freelist`), by the Python source as it runs now (long free lists
blocked), and by the compiled core (:mod:`vramplan.allocator.core`), each in a process of its own,
best of 3 each, target ≥ 800,000 events/s; every figure of the three compared.

    .venv/bin/python bench/replay_speed.py [--events 1000000] [--profile] [--no-real] [--moe]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import random
import time
from collections.abc import Iterator

from vramplan.allocator import replay
from vramplan.events import Action, Category, EventLog

TARGET_EVENTS = 1_000_000
TARGET_SECONDS = 3.0


def synthetic_trace(min_events: int, *, layers: int = 24, hidden: int = 2048, seed: int = 0) -> EventLog:
    """A transformer-ish train step repeated until ``min_events`` events exist."""
    rng = random.Random(seed)
    log = EventLog()
    ids = iter(range(1, 1 << 62))
    live_params: list[int] = []

    def alloc(size: int, cat: Category) -> int:
        i = next(ids)
        log.append(Action.ALLOC, i, size, category=cat)
        return i

    def free(i: int) -> None:
        log.append(Action.FREE, i)

    for _ in range(layers):  # bf16 weights: qkv, o, mlp up/gate/down, two norms
        for shape in (3 * hidden * hidden, hidden * hidden, 4 * hidden * hidden,
                      4 * hidden * hidden, 4 * hidden * hidden, hidden, hidden):
            live_params.append(alloc(2 * shape, Category.PARAMETER))
    grads: list[int] = []
    step = 0
    while len(log) < min_events:
        seq = rng.choice((512, 768, 1024, 1536))  # variable length: the fragmenting kind
        tokens = 2 * seq
        saved: list[int] = []
        for _ in range(layers):  # forward
            x = alloc(2 * tokens * hidden, Category.ACTIVATION)
            saved.append(x)
            for _ in range(6):  # small temporaries (bias, stats, masks, scalars)
                free(alloc(rng.choice((4, 64, 512, 2048, 4 * tokens)), Category.TEMPORARY))
            qkv = alloc(2 * tokens * 3 * hidden, Category.ACTIVATION)
            scores = alloc(2 * tokens * seq * 2, Category.TEMPORARY)
            free(scores)
            saved.append(qkv)
            up = alloc(2 * tokens * 4 * hidden, Category.ACTIVATION)
            act = alloc(2 * tokens * 4 * hidden, Category.ACTIVATION)
            saved.extend((up, act))
        loss = alloc(4 * tokens * 32000, Category.TEMPORARY)
        free(loss)
        for _ in range(layers):  # backward, in reverse
            for i in (saved.pop(), saved.pop(), saved.pop(), saved.pop()):
                tmp = alloc(2 * tokens * 4 * hidden, Category.TEMPORARY)
                free(i)
                free(tmp)
            for _ in range(4):
                free(alloc(rng.choice((512, 4096, 2 * hidden)), Category.TEMPORARY))
        if not grads:
            grads = [alloc(log.size[k], Category.GRADIENT) for k in range(len(live_params))]
        for _ in range(len(live_params) // 8):  # foreach optimizer temporaries
            free(alloc(rng.choice((2 * hidden * hidden, 8 * hidden * hidden)), Category.TEMPORARY))
        step += 1
    return log


def measure(log: EventLog, conf: str, repeats: int = 3) -> tuple[float, float]:
    """Best of ``repeats`` (wall, CPU) seconds of the default ``replay`` (incl. the segment-map
    pass). On a shared machine the CPU time is the fairer figure."""
    wall = cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        replay(log, conf)
        wall = min(wall, time.perf_counter() - t)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


REAL_TARGET = 800_000
_REPLAY = importlib.import_module("vramplan.allocator.replay")


@contextlib.contextmanager
def event_by_event() -> Iterator[None]:
    """Replays within switch the fast-forward of repeats off (every event through the loop)."""
    keep = _REPLAY.PERIODIC_MIN_EVENTS
    _REPLAY.PERIODIC_MIN_EVENTS = 1 << 62
    try:
        yield
    finally:
        _REPLAY.PERIODIC_MIN_EVENTS = keep


def real_logs() -> list[tuple[str, EventLog]]:
    from vramplan.hardware.catalog import get_gpu
    from vramplan.hardware.target import device_profile
    from vramplan.models.catalog import resolve
    from vramplan.trace.run import trace_workload
    from vramplan.workload import Workload

    out = []
    dev = device_profile(get_gpu("h100-sxm"))
    for ckpt in ("none", "full"):
        w = Workload(task="train", precision="bf16-mixed", batch=1, seq=4096, checkpointing=ckpt)
        r = trace_workload(resolve("llama-3.1-8b"), w, device=dev)
        out.append((f"llama-3.1-8b train, checkpointing {ckpt}", r.events))
    # what `vramplan estimate llama-3.1-70b --task generate --gpu h100-sxm` replays (twice)
    w = Workload(task="generate", precision="bf16", batch=1, seq=512, new_tokens=128)
    out.append(("llama-3.1-70b generate, 128 tokens", trace_workload(resolve("llama-3.1-70b"), w, device=dev).events))
    return out


def cpu_best(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        c = time.process_time()
        fn()
        best = min(best, time.process_time() - c)
    return best


def real(args: argparse.Namespace) -> None:
    from vramplan.allocator.native import CachingAllocator
    from vramplan.allocator.replay import _run_plain

    print(f"\nreal trace logs (CPU seconds, best of 5; target ≥ {REAL_TARGET:,} events/s): the replay as the "
          "pipeline ran it first (timeline + segment-map pass), its plain pass with the allocator's methods, "
          "the event loop through allocator/fused.py, and now (repeats fast-forwarded where they apply)")
    from vramplan.allocator import periodic
    from vramplan.allocator.config import as_config

    for what, log in real_logs():
        before = cpu_best(lambda log=log: replay(log, record_timeline=True, full_timeline=True))
        methods = cpu_best(lambda log=log: _run_plain(log, CachingAllocator(), fused=False))
        with event_by_event():
            loop = cpu_best(lambda log=log: replay(log, segment_map=False))
            ref = replay(log, segment_map=False)
        after = cpu_best(lambda log=log: replay(log, segment_map=False))
        now = replay(log, segment_map=False)
        same = (now.max_allocated, now.max_reserved, now.peak_reserved_index, now.reserved_changes) == (
            ref.max_allocated, ref.max_reserved, ref.peak_reserved_index, ref.reserved_changes)
        fig = periodic.run(log, as_config("")) if len(log) >= _REPLAY.PERIODIC_MIN_EVENTS else None
        how = f"{fig.skipped:,} events fast-forwarded" if fig else "event by event"
        n = len(log)
        print(f"{what:<38} {n:>9,} events  first {n / before:>9,.0f} ev/s  methods {n / methods:>9,.0f} ev/s  "
              f"loop {n / loop:>9,.0f} ev/s  now {n / after:>10,.0f} ev/s ({how}; {loop / after:4.2f}x the loop, "
              f"figures {'identical' if same else 'DIFFERENT'}; ratio to target {n / after / REAL_TARGET:4.2f}x)")


def moe() -> None:
    """DeepSeek-V3's training log, replayed by the Python source (free lists plain, then long ones
    blocked) and by the compiled core, each in a process of its own (the choice is made at import:
    ``VRAMPLAN_PURE_PYTHON``), on one log traced here and handed over in a file."""
    import json
    import os
    import pickle
    import subprocess
    import sys
    import tempfile

    from vramplan.allocator import core
    from vramplan.models.catalog import resolve
    from vramplan.trace.run import trace_workload
    from vramplan.workload import Workload

    log = trace_workload(resolve("deepseek-v3"), Workload(task="train")).events
    n = len(log)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "log.pkl")
        with open(path, "wb") as f:
            pickle.dump(log, f)
        got = {}
        for mode in ("plain", "source", "compiled"):
            env = {**os.environ, core.PURE_ENV: "1" if mode != "compiled" else ""}
            out = subprocess.run([sys.executable, __file__, "--moe-child", path, mode], env=env,
                                 capture_output=True, text=True, check=True).stdout
            got[mode] = json.loads(out.strip().splitlines()[-1])
    src, comp = got["source"], got["compiled"]
    same = got["plain"]["figures"] == src["figures"] == comp["figures"]
    print(f"{'deepseek-v3 train (estimate default)':<38} {n:>9,} events (CPU seconds, best of {MOE_REPEATS}); "
          f"figures {'identical' if same else 'DIFFERENT'} in all three")
    print(f"  Python source, plain free lists      {n / got['plain']['cpu']:>10,.0f} ev/s")
    print(f"  Python source, long lists blocked    {n / src['cpu']:>10,.0f} ev/s")
    print(f"  compiled core                        {n / comp['cpu']:>10,.0f} ev/s ({src['cpu'] / comp['cpu']:4.2f}x the "
          f"source; ratio to target {n / comp['cpu'] / REAL_TARGET:4.2f}x; {comp['core']})")


MOE_REPEATS = 3


def moe_child(path: str, mode: str) -> None:
    """One mode of :func:`moe`, in its own process: prints the best CPU time and the figures."""
    import json
    import pickle

    from vramplan.allocator import core, freelist

    with open(path, "rb") as f:
        log = pickle.load(f)
    if mode == "plain":
        freelist.HIGH = 1 << 62  # (no list is ever made long)
    cpu = cpu_best(lambda: replay(log, segment_map=False), repeats=MOE_REPEATS)
    r = replay(log, segment_map=False)
    figures = [r.max_allocated, r.max_reserved, r.peak_allocated_index, r.peak_reserved_index, r.reserved_changes]
    parts = ", ".join(f"{p.name} {p.state}" for p in core.parts())
    print(json.dumps({"cpu": cpu, "figures": figures, "core": parts}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=TARGET_EVENTS)
    ap.add_argument("--profile", action="store_true", help="cProfile one replay")
    ap.add_argument("--no-real", action="store_true", help="skip the real trace logs")
    ap.add_argument("--moe", action="store_true", help="also DeepSeek-V3's training log: the Python source (plain, "
                    "then blocked free lists) and the compiled core")
    ap.add_argument("--moe-child", nargs=2, metavar=("LOG", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.moe_child:
        moe_child(*args.moe_child)
        return
    t = time.perf_counter()
    log = synthetic_trace(args.events)
    print(f"synthetic trace: {len(log):,} events (built in {time.perf_counter() - t:.1f} s)")
    if args.profile:
        import cProfile
        import pstats

        cProfile.runctx("replay(log)", globals(), {"log": log, "replay": replay}, "/tmp/replay.prof")
        pstats.Stats("/tmp/replay.prof").sort_stats("tottime").print_stats(12)
        return
    budget = TARGET_SECONDS * len(log) / TARGET_EVENTS
    print(f"target: {TARGET_EVENTS:,} events in {TARGET_SECONDS:.0f} s; ratio = time budget / time "
          "taken (>= 1 meets it)")
    for conf in ("", "expandable_segments:True", "max_split_size_mb:128"):
        with event_by_event():
            wall, cpu = measure(log, conf)
            res = replay(log, conf)
        print(f"conf {conf or '(default)':<26} wall {wall:5.2f} s ({len(log) / wall:>9,.0f} events/s, "
              f"ratio {budget / wall:4.2f}x)  cpu {cpu:5.2f} s ({len(log) / cpu:>9,.0f} events/s, "
              f"ratio {budget / cpu:4.2f}x)  max_reserved {res.max_reserved / 2**30:.2f} GiB")
    wall, cpu = measure(log, "")
    res = replay(log, "")
    print(f"conf (default), as it runs now   wall {wall:5.2f} s ({len(log) / wall:>9,.0f} events/s)  cpu {cpu:5.2f} s "
          f"({len(log) / cpu:>9,.0f} events/s)  max_reserved {res.max_reserved / 2**30:.2f} GiB "
          "(repeats fast-forwarded where the small pool's state repeats)")
    if not args.no_real:
        real(args)
    if args.moe:
        moe()


if __name__ == "__main__":
    main()
