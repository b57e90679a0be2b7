"""The compiled core (:mod:`vramplan.allocator.core`): what was built is what runs, a build older
than its source never runs, and the compiled replay equals the Python source's on every figure.

The comparison replays the same logs in this process (compiled, where built) and in a child
process with ``VRAMPLAN_PURE_PYTHON=1`` (the Python source), and compares every figure of each
result: peaks, their indices, the reserved changes, the segment map at the peak and the counters.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from vramplan.allocator import blocks, core, fused, replay
from vramplan.events import EventLog

ALLOC = Path(core.__file__).parent
BUILT = core._built()


def test_what_the_build_recorded_is_what_runs():
    """Where ``setup.py`` recorded a compiled part, it is the one imported (unless turned off)."""
    if os.environ.get(core.PURE_ENV):
        pytest.skip(f"{core.PURE_ENV} is set")
    states = {p.name: p.state for p in core.parts()}
    for name in BUILT:
        assert states[name] == "compiled", f"{core.parts()}: rebuild it (`make test` does; or pip install -e .)"
    if "loop" in BUILT:
        assert not fused.__file__.endswith(".py") and not blocks.__file__.endswith(".py")
    else:
        assert fused.__file__.endswith(".py")


def test_a_build_older_than_its_source_is_stale(monkeypatch):
    monkeypatch.delenv(core.PURE_ENV, raising=False)
    monkeypatch.setattr(core, "_extension", lambda module: ALLOC / f"{module}.so")
    now = core._digest(core.LOOP_SOURCES)
    assert core._judge("loop", core.LOOP, core.LOOP_SOURCES, {"loop": now}).state == "compiled"
    old = {**now, "fused.py": "0" * 64}
    part = core._judge("loop", core.LOOP, core.LOOP_SOURCES, {"loop": old})
    assert part.state == "stale" and "reinstall" in part.detail
    assert core._judge("loop", core.LOOP, core.LOOP_SOURCES, {}).state == "stale"  # (built, not recorded)
    monkeypatch.setenv(core.PURE_ENV, "1")
    assert core._judge("loop", core.LOOP, core.LOOP_SOURCES, {"loop": now}).state == "pure"
    monkeypatch.delenv(core.PURE_ENV)
    monkeypatch.setattr(core, "_extension", lambda module: None)
    assert core._judge("loop", core.LOOP, core.LOOP_SOURCES, {"loop": now}).state == "not built"


def test_the_environment_switch_loads_the_python_source():
    code = ("from vramplan.allocator import core, fused, blocks, freelist; "
            "print(fused.__file__.endswith('.py'), blocks.__file__.endswith('.py'), "
            "type(freelist.lengthen([1, 2])).__name__, [p.state for p in core.parts()])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, core.PURE_ENV: "1"},
                         capture_output=True, text=True, check=True).stdout.split(maxsplit=3)
    assert out[:3] == ["True", "True", "Blocked"] and "compiled" not in out[3]


# the logs: random churn under every allocator option (test_allocator_freelist's), and the case
# the key set is for (thousands of segment tails in one free list)
_LOGS = r'''
import random, sys
sys.path.insert(0, {tests!r})
from test_allocator_freelist import CONF_ALL, churn_log
from vramplan.allocator import replay
from vramplan.events import EventLog
MiB = 1 << 20

def tails():
    log = EventLog(); n = 0
    for _ in range(4000):
        log.alloc(n, 9 * MiB); n += 1
    for step in range(3):
        acts = []
        for j in range(300):
            log.alloc(n, (1 + (j * 37 + step) % 9) * MiB // 2 + 512); acts.append(n); n += 1
        for i in acts[::-1]:
            log.free(i)
    return log

out = []
for seed in range(40):
    r = random.Random(seed)
    log = churn_log(r, r.randint(100, 600))
    conf = CONF_ALL[seed % len(CONF_ALL)]
    capacity = r.choice([None, r.randint(40, 600) * MiB])
    try:
        res = replay(log, conf, capacity=capacity, segment_map=True, record_segments=seed % 2 == 0)
        out.append(repr(res))
    except Exception as e:
        out.append("error " + str(e))
out.append(repr(replay(tails(), "", segment_map=True)))
out.append(repr(replay(tails(), "max_split_size_mb:64", segment_map=True)))
print("\n".join(out))
'''


def _figures(pure: bool) -> list[str]:
    env = {**os.environ}
    env.pop(core.PURE_ENV, None)
    if pure:
        env[core.PURE_ENV] = "1"
    code = _LOGS.format(tests=str(Path(__file__).parent))
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout.splitlines()


@pytest.mark.skipif(not BUILT, reason="the compiled core is not built: nothing to compare")
def test_compiled_and_python_source_replays_are_equal_on_every_figure():
    compiled, pure = _figures(False), _figures(True)
    assert len(compiled) == len(pure) == 42
    assert sum(line.startswith("error") for line in compiled) < 20  # (most replays ran to the end)
    for i, (a, b) in enumerate(zip(compiled, pure, strict=True)):
        assert a == b, f"log {i}: compiled and Python source differ"


def test_the_replay_in_this_process_equals_a_fresh_one_of_the_source():
    """The same in-process: one log replayed here equals the child's pure replay (guards against
    a compiled module that imports but computes on stale state)."""
    log = EventLog()
    r = random.Random(7)
    live = []
    for i in range(3000):
        if live and r.random() < .45:
            log.free(live.pop(r.randrange(len(live))))
        else:
            log.alloc(i, r.choice([512, 4096, 3 << 20, 25 << 20]) + r.randint(0, 511))
            live.append(i)
    here = repr(replay(log, "", segment_map=True))
    code = ("import sys, json; from vramplan.allocator import replay; from vramplan.events import EventLog; "
            "log = EventLog(); [log.alloc(i, s) if a == 0 else log.free(i) for a, i, s in json.load(sys.stdin)]; "
            "print(repr(replay(log, '', segment_map=True)))")
    rows = [(int(a), int(i), int(s)) for a, i, s in zip(log.action, log.id, log.size, strict=True)]
    env = {**os.environ, core.PURE_ENV: "1"}
    got = subprocess.run([sys.executable, "-c", code], input=json.dumps(rows), env=env, capture_output=True,
                         text=True, check=True)
    assert got.stdout.strip() == here
