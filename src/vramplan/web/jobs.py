"""Run the page's slow work (traces, searches) off the event loop: cached, cancellable, bounded.

Traces run in worker *processes* by default: a trace is CPU-bound Python, and in a thread
it would hold the GIL while the analytic answers to the user's next inputs wait; a worker
that dies (out of memory, a crash in native code) takes no request handler with it, and a
worker can be stopped in the middle of a job, which a thread cannot.

- Equal requests share one job, and each result is cached (LRU).
- A job nobody waits for any more is cancelled: the page aborts its requests when the user
  changes an input, so the server drops the job if it still waits for a worker and kills
  its worker (replaced at once) if it runs. A burst of changes leaves one job, the last.
- A new job of a kind (``trace``, ``fit``, ``plan``, ``rank``, ``snapshot``) also drops the
  earlier job of that kind that has not started (a client that does not abort, e.g. curl).
- Each job has a time budget (``budget_s``): past it the worker is killed and the request
  answers a one-line error that names the budget (a 400: the input asks for too much work).

Workers are forked from a fork server that imported torch and transformers once (the
``forkserver`` start method; ``spawn`` where there is none), so a replacement is ready in
milliseconds instead of the seconds an import of torch takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .work import Outcome

DEFAULT_BUDGET_S = 60.0
"""Seconds of work one request may cost on the page (the CLI has no such limit)."""
PRELOAD = ("torch", "transformers", "vramplan.trace.run", "vramplan.web.jobs")
"""Imported once by the fork server: every worker forked from it starts with them."""


class Stale(Exception):
    """The job was cancelled: a newer request replaced it, or nobody waits for it any more."""


@dataclass(eq=False)
class _Job:
    kind: str
    key: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future[Outcome | None]
    """The outcome; None when the job was cancelled (its waiters get :class:`Stale`)."""
    waiters: int = 0
    task: asyncio.Task[None] | None = None
    """The coroutine running the job (None while it waits for a worker)."""


@dataclass
class _Counts:
    started: int = 0
    finished: int = 0
    dropped: int = 0
    """Cancelled while waiting for a worker."""
    killed: int = 0
    """Cancelled while running: its worker was killed."""
    over_budget: int = 0


class Jobs:
    """The job queue over a pool of ``workers`` processes (or an injected executor)."""

    def __init__(self, executor: cf.Executor | None = None, *, workers: int = 2, cache_size: int = 64,
                 budget_s: float = DEFAULT_BUDGET_S) -> None:
        self._backend: _Processes | _Executor = _Processes(workers) if executor is None else _Executor(executor)
        self._slots = workers if executor is None else max(1, int(getattr(executor, "_max_workers", workers)))
        self.budget_s = budget_s
        self._cache: OrderedDict[str, Outcome] = OrderedDict()
        self._cache_size = cache_size
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Job] = []
        self._running: set[_Job] = set()
        self.counts = _Counts()

    # ------------------------------------------------------------------ cache
    def cached(self, key: str) -> Outcome | None:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return hit

    def remember(self, key: str, out: Outcome) -> None:
        """Cache a result (user mistakes too: they are as deterministic; bugs and results over
        the time budget, which depend on the machine's load, are not cached)."""
        if out.bug or out.over_budget:
            return
        self._cache[key] = out
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    # ------------------------------------------------------------------ jobs
    async def run(self, kind: str, key: str, fn: Callable[..., Any], *args: Any) -> Outcome:
        """The outcome of ``fn(*args)`` in a worker; raises :class:`Stale` when the job was
        cancelled. Cancelling the caller (its client went away) cancels the job once nobody
        else waits for it."""
        hit = self.cached(key)
        if hit is not None:
            return hit
        job = self._jobs.get(key)
        if job is None:
            for other in [j for j in self._queue if j.kind == kind]:
                self._drop(other)  # the user moved on: only the newest of a kind waits
            job = _Job(kind, key, fn, args, asyncio.get_running_loop().create_future())
            self._jobs[key] = job
            self._queue.append(job)
            self._dispatch()
        job.waiters += 1
        try:
            out = await asyncio.shield(job.done)
        except asyncio.CancelledError:
            job.waiters -= 1
            if job.waiters == 0 and not job.done.done():
                self._cancel(job)
            raise
        job.waiters -= 1
        if out is None:
            raise Stale(kind)
        return out

    def _dispatch(self) -> None:
        while self._queue and len(self._running) < self._slots:
            job = self._queue.pop()  # newest first
            self._running.add(job)
            self.counts.started += 1
            job.task = asyncio.ensure_future(self._execute(job))

    async def _execute(self, job: _Job) -> None:
        out: Outcome | None
        try:
            out = await self._backend.run(job.fn, job.args, self.budget_s)
        except asyncio.CancelledError:
            out = None
        except Exception as e:  # pragma: no cover - the backends answer an Outcome
            out = Outcome(error=f"internal error ({e.__class__.__name__}: {e})".split("\n")[0], bug=True)
        finally:
            self._running.discard(job)
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
        if out is not None:
            self.counts.finished += 1
            if out.over_budget:
                self.counts.over_budget += 1
            self.remember(job.key, out)
        if not job.done.done():
            job.done.set_result(out)
        self._dispatch()

    def _drop(self, job: _Job) -> None:
        """Cancel a job that waits for a worker."""
        self._queue.remove(job)
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        self.counts.dropped += 1
        if not job.done.done():
            job.done.set_result(None)

    def _cancel(self, job: _Job) -> None:
        if job in self._queue:
            self._drop(job)
        elif job.task is not None and not job.task.done():
            self.counts.killed += 1
            job.task.cancel()  # the backend kills the worker (a thread cannot be stopped: abandoned)

    # ------------------------------------------------------------------ pool
    def warm(self, fn: Callable[[], Any]) -> None:
        """Start the workers now (in the background) and run ``fn`` once in each."""
        self._backend.warm(fn)

    def status(self) -> dict[str, Any]:
        """Workers warmed, and what happened to the jobs so far."""
        warming, warmed = self._backend.warmth()
        c = self.counts
        return {"warming": warming, "warmed": warmed, "cached": len(self._cache),
                "running": len(self._running), "queued": len(self._queue), "started": c.started,
                "finished": c.finished, "dropped": c.dropped, "killed": c.killed, "over_budget": c.over_budget,
                "budget_s": self.budget_s}

    def close(self) -> None:
        """Stop now: a job still running is not waited for (its worker is killed)."""
        self._backend.close()


def over_budget(budget_s: float) -> Outcome:
    return Outcome(error=f"this request needs more than {budget_s:g} s of work, the page's limit per request "
                         "(run the same command line in a terminal: it has no such limit)", over_budget=True)


# ---------------------------------------------------------------------- backends
class _Executor:
    """An injected executor (tests use threads): a running job cannot be stopped, only abandoned."""

    def __init__(self, executor: cf.Executor) -> None:
        self._ex = executor
        self._warming: list[cf.Future[Any]] = []

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], budget_s: float) -> Outcome:
        fut = self._ex.submit(fn, *args)
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(fut), budget_s)
        except asyncio.TimeoutError:
            fut.cancel()
            return over_budget(budget_s)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as e:
            return Outcome(error=f"internal error ({e.__class__.__name__}: {e})".split("\n")[0], bug=True)
        return out if isinstance(out, Outcome) else Outcome(value=out)

    def warm(self, fn: Callable[[], Any]) -> None:
        self._warming.append(self._ex.submit(fn))

    def warmth(self) -> tuple[int, int]:
        done = sum(f.done() for f in self._warming)
        return len(self._warming) - done, done

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Worker:
    proc: Any
    conn: Any


class _Processes:
    """``workers`` long-lived processes, each running one job at a time; one that is killed
    (its job cancelled or over budget) or dies is replaced by a fresh fork."""

    def __init__(self, workers: int) -> None:
        methods = multiprocessing.get_all_start_methods()
        self._ctx: Any = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if "forkserver" in methods:
            self._ctx.set_forkserver_preload(list(PRELOAD))
        self._size = workers
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._warming = 0
        self._warmed = 0
        self._closed = False

    def _spawn(self) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(theirs, os.getpid()), name="vramplan-web-worker",
                                 daemon=True)
        proc.start()
        theirs.close()
        w = _Worker(proc, ours)
        with self._lock:
            self._all.add(w)
        if self._closed:
            self._kill(w)
        return w

    def warm(self, fn: Callable[[], Any]) -> None:
        with self._lock:
            todo = self._size - len(self._all) - self._warming
            self._warming += max(todo, 0)
        for _ in range(max(todo, 0)):
            threading.Thread(target=self._warm_one, args=(fn,), name="vramplan-web-warm", daemon=True).start()

    def _warm_one(self, fn: Callable[[], Any]) -> None:
        try:
            w = self._spawn()
            w.conn.send((fn, ()))
            w.conn.recv()
        except Exception:  # the pool closed meanwhile, or the worker died: replaced on demand
            return
        finally:
            with self._lock:
                self._warming -= 1
        with self._lock:
            self._warmed += 1
        self._release(w)

    def warmth(self) -> tuple[int, int]:
        with self._lock:
            return self._warming, self._warmed

    async def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.proc.is_alive():
                    return w
                self._all.discard(w)
        return await asyncio.get_running_loop().run_in_executor(None, self._spawn)

    async def run(self, fn: Callable[..., Any], args: tuple[Any, ...], budget_s: float) -> Outcome:
        loop = asyncio.get_running_loop()
        w = await self._take()
        try:
            w.conn.send((fn, args))
        except Exception as e:  # the worker died while idle, or the arguments do not pickle
            self._replace(w)
            return Outcome(error=f"internal error ({e.__class__.__name__}: {e})".split("\n")[0], bug=True)
        try:
            out = await asyncio.wait_for(loop.run_in_executor(None, w.conn.recv), budget_s)
        except asyncio.TimeoutError:
            self._replace(w)
            return over_budget(budget_s)
        except asyncio.CancelledError:
            self._replace(w)
            raise
        except (EOFError, OSError):
            self._replace(w)
            return Outcome(error="the worker process stopped (out of memory?); try again", bug=True)
        self._release(w)
        return out if isinstance(out, Outcome) else Outcome(value=out)

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and fork a fresh worker in its place (in the background)."""
        self._kill(w)
        if not self._closed:
            threading.Thread(target=self._refill, name="vramplan-web-refill", daemon=True).start()

    def _refill(self) -> None:
        with self._lock:
            if self._closed or len(self._all) >= self._size:
                return
        try:
            w = self._spawn()
        except OSError:  # pragma: no cover - no process can be started now: the next job tries again
            return
        self._release(w)

    def _release(self, w: _Worker) -> None:
        """``w`` is free: kept for the next job, or stopped when the pool is closed or full."""
        with self._lock:
            keep = not self._closed and w in self._all and len(self._all) <= self._size
            if keep:
                self._idle.append(w)
        if not keep:
            self._kill(w)

    def _kill(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
            if w in self._idle:
                self._idle.remove(w)
        if w.proc.is_alive():
            w.proc.kill()  # its end of the pipe closes: a thread waiting on ours gets EOFError
        threading.Thread(target=w.proc.join, args=(5,), name="vramplan-web-reap", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
        for w in workers:
            self._kill(w)


def _worker_main(conn: Any, server: int) -> None:
    """A worker: run each job sent on ``conn``, send back its Outcome, until the server is gone.
    Ctrl+C in the terminal is the server's to handle (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(server)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = fn(*args)
        except BaseException as e:  # noqa: BLE001 - a job never ends the worker
            first = (str(e).strip().splitlines() or [""])[0][:300]
            out = Outcome(error=f"internal error ({e.__class__.__name__}: {first})", bug=True)
        if not isinstance(out, Outcome):
            out = Outcome(value=out)
        try:
            conn.send(out)
        except (EOFError, OSError):
            return
        except Exception as e:  # a result that does not pickle
            conn.send(Outcome(error=f"internal error (cannot send the result: {e.__class__.__name__})", bug=True))


def _exit_with_parent(server: int) -> None:
    """In each worker: leave when the server is gone, however it went (even SIGKILL), so that
    no worker outlives it holding a GiB of torch. (A forked worker's parent is the fork
    server, which itself ends with the server.)"""
    import time

    parent = os.getppid()

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        if sys.platform == "win32":  # os.kill(pid, 0) would end the process there
            return False
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if gone():
                os._exit(0)

    threading.Thread(target=watch, name="vramplan-parent-watch", daemon=True).start()
