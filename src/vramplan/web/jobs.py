"""Run the page's slow work (traces, searches) off the event loop: cached, newest first.

Traces run in worker *processes* by default: a trace is CPU-bound Python, and in a thread
it would hold the GIL while the analytic answers to the user's next inputs wait; a worker
that dies (out of memory, a crash in native code) takes no request handler with it.

Each job has a kind (``trace``, ``fit``, ``plan``, ``rank``, ``snapshot``). A new job of a
kind cancels the earlier job of that kind that has not started yet — the user moved on, so
its answer would be stale. A job already running finishes and its result is cached (the
user may come back to those inputs). Equal requests share one job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .work import Outcome


class Stale(Exception):
    """The job was cancelled before it started: a newer request of its kind replaced it."""


class Jobs:
    def __init__(self, executor: cf.Executor | None = None, *, workers: int = 2, cache_size: int = 64) -> None:
        self._own = executor is None
        self._workers = workers
        self._executor = executor if executor is not None else self._new_pool()
        self._cache: OrderedDict[str, Outcome] = OrderedDict()
        self._cache_size = cache_size
        self._running: dict[str, tuple[asyncio.Future[Outcome], cf.Future[Outcome]]] = {}
        self._latest: dict[str, cf.Future[Outcome]] = {}
        self._warming: list[cf.Future[Any]] = []

    def _new_pool(self) -> cf.Executor:
        return cf.ProcessPoolExecutor(max_workers=self._workers, mp_context=multiprocessing.get_context("spawn"),
                                      initializer=_exit_with_parent, initargs=(os.getpid(),))

    def cached(self, key: str) -> Outcome | None:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def remember(self, key: str, out: Outcome) -> None:
        """Cache a result (user mistakes too: they are as deterministic; bugs are not cached)."""
        if out.bug:
            return
        self._cache[key] = out
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def run(self, kind: str, key: str, fn: Callable[..., Outcome], *args: Any) -> Outcome:
        """The outcome of ``fn(*args)`` in the pool; raises :class:`Stale` when superseded."""
        hit = self.cached(key)
        if hit is not None:
            return hit
        shared = self._running.get(key)
        if shared is not None:
            try:
                return await asyncio.shield(shared[0])
            except asyncio.CancelledError:
                if shared[1].cancelled():
                    raise Stale(kind) from None
                raise
        prev = self._latest.get(kind)
        if prev is not None and not prev.done():
            prev.cancel()  # only succeeds while it waits in the queue
        try:
            fut = self._executor.submit(fn, *args)
        except cf.BrokenExecutor:  # a worker died: start a fresh pool, once
            self._restart()
            fut = self._executor.submit(fn, *args)
        self._latest[kind] = fut
        wrapped = asyncio.wrap_future(fut)
        self._running[key] = (wrapped, fut)
        try:
            out = await asyncio.shield(wrapped)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise Stale(kind) from None
            raise
        except cf.BrokenExecutor:
            self._restart()
            return Outcome(error="the worker process stopped (out of memory?); try again", bug=True)
        finally:
            self._running.pop(key, None)
        self.remember(key, out)
        return out

    def _restart(self) -> None:
        if not self._own:
            return
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_pool()

    def warm(self, fn: Callable[[], Any]) -> None:
        """Start the workers now (each imports torch once) instead of on the first trace."""
        self._warming = [self._executor.submit(fn) for _ in range(self._workers if self._own else 1)]

    def status(self) -> dict[str, Any]:
        """How many warm-up jobs have finished (each worker imports torch once)."""
        done = sum(f.done() for f in self._warming)
        return {"warming": len(self._warming) - done, "warmed": done, "cached": len(self._cache)}

    def close(self) -> None:
        """Stop now: a trace still running is not waited for (its worker is terminated)."""
        ex = self._executor
        # ProcessPoolExecutor keeps its worker processes in _processes (pid → Process), CPython 3.10-3.14
        workers = list((getattr(ex, "_processes", None) or {}).values()) if self._own else []
        ex.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            if w.is_alive():
                w.terminate()
        for w in workers:
            w.join(timeout=5)


def _exit_with_parent(parent: int) -> None:
    """In each worker: leave when the server is gone, however it went (even SIGKILL), so that
    no worker outlives it holding a GiB of torch."""
    import threading
    import time

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="vramplan-parent-watch", daemon=True).start()
