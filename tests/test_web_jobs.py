"""The page's job queue (``vramplan.web.jobs``) with real worker processes: work nobody waits
for any more is stopped, a job past its time budget is stopped, and the pool stays ready."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import threading
import time

import pytest

pytest.importorskip("starlette")

from vramplan.web import work  # noqa: E402
from vramplan.web.app import _while_connected  # noqa: E402
from vramplan.web.jobs import Jobs, Stale  # noqa: E402


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _until(cond, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _worker_pids(jobs: Jobs) -> set[int]:
    return {w.proc.pid for w in jobs._backend._all}


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc to see the worker processes")


@needs_proc
def test_a_job_nobody_waits_for_is_killed_and_its_worker_replaced():
    jobs = Jobs(workers=1)

    async def scenario():
        # two requests share the job (the estimate and the timeline of one page)
        a = asyncio.ensure_future(jobs.run("trace", "slow", time.sleep, 600))
        b = asyncio.ensure_future(jobs.run("trace", "slow", time.sleep, 600))
        await asyncio.sleep(0)
        assert await asyncio.to_thread(_until, lambda: jobs.status()["running"] == 1 and _worker_pids(jobs), 60)
        pid = next(iter(_worker_pids(jobs)))
        a.cancel()  # one page aborted: the other still waits, the job goes on
        await asyncio.sleep(0.3)
        assert _alive(pid) and jobs.status()["killed"] == 0
        b.cancel()  # nobody waits any more: the worker is killed
        assert await asyncio.to_thread(_until, lambda: not _alive(pid), 10)
        t0 = time.monotonic()
        out = await jobs.run("trace", "next", work.Outcome, 5)  # a fresh worker answers at once
        return pid, out, time.monotonic() - t0

    try:
        pid, out, took = asyncio.run(scenario())
        st = jobs.status()
    finally:
        jobs.close()
    assert out.value == 5 and took < 30
    assert st["killed"] == 1 and st["running"] == 0 and st["finished"] == 1
    assert jobs.cached("slow") is None


@needs_proc
def test_a_job_past_its_budget_is_stopped():
    jobs = Jobs(workers=1, budget_s=0.5)

    async def scenario():
        t0 = time.monotonic()
        over = await jobs.run("trace", "slow", time.sleep, 600)
        took = time.monotonic() - t0
        ok = await jobs.run("trace", "ok", work.Outcome, 7)
        return over, took, ok

    try:
        over, took, ok = asyncio.run(scenario())
        st = jobs.status()
    finally:
        jobs.close()
    assert over.over_budget and not over.bug and "more than 0.5 s of work" in over.error
    assert took < 30  # (the first worker forks from a fork server that imports torch first)
    assert ok.value == 7
    assert st["over_budget"] == 1 and jobs.cached("slow") is None  # a load-dependent answer is not cached


def test_a_request_whose_client_went_away_cancels_its_job():
    gate = threading.Event()
    pool = cf.ThreadPoolExecutor(max_workers=1)
    jobs = Jobs(pool, workers=1)
    gone = asyncio.Event()

    class Request:  # what _while_connected reads of a Starlette request
        async def receive(self):
            if not hasattr(self, "sent"):
                self.sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

    def slow(x):
        gate.wait(10)
        return work.Outcome(value=x)

    async def scenario():
        asked = asyncio.ensure_future(_while_connected(Request(), jobs.run("trace", "a", slow, 1)))
        await asyncio.sleep(0.1)
        assert jobs.status()["running"] == 1
        gone.set()  # the page aborted its request
        try:
            await asked
        except Stale:
            return "stale"
        return "answered"

    try:
        got = asyncio.run(scenario())
        st = jobs.status()
    finally:
        gate.set()
        pool.shutdown()
    assert got == "stale"
    assert st["killed"] == 1 and st["running"] == 0  # (a thread cannot be stopped: it is abandoned)


def test_a_connected_request_gets_its_answer():
    pool = cf.ThreadPoolExecutor(max_workers=1)
    jobs = Jobs(pool, workers=1)

    class Request:
        async def receive(self):
            if not hasattr(self, "sent"):
                self.sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(3600)

    async def scenario():
        return await _while_connected(Request(), jobs.run("trace", "a", work.Outcome, 3))

    try:
        out = asyncio.run(scenario())
    finally:
        pool.shutdown()
    assert out.value == 3 and jobs.status()["killed"] == 0
