"""Independent traces run side by side, in forked copies of this process.

The reduced traces of :mod:`.replicate` (a model with 2, 3 and 4 of its layers) do not depend
on each other, and each is a single-threaded Python loop; on a machine with a spare CPU they
can run at once. A forked child starts with everything this process has imported (torch,
transformers, vramplan: ~2.5 s to import afresh, as a ``spawn``-ed worker would), so it
begins tracing at once. :func:`map_forked` runs the first item here (it imports the model's code
and warms the caches the children then inherit), the last items in children and the
ones between here, and reads the children's results back, pickled into an anonymous temporary file
that only this process and its child hold (the pickle never leaves the two; nothing from
outside is unpickled).

A child's result is what this process would have computed: the trace is deterministic and
reads nothing a fork changes (``tests/test_trace_forked.py`` compares the two). A child runs
CPU ops on one thread (GNU OpenMP's thread pool does not survive a fork; PyTorch's DataLoader
sets the same in its forked workers). A child's stdout and stderr go to ``/dev/null``: the
items traced here print the same warnings. Where a child fails (an exception, a crash) or
takes far longer than the items run here (:data:`PATIENCE`: it is stuck), its item is run
again here, so an error is raised exactly as in a serial run; where a child cannot even be
forked (too many processes or descriptors, no memory), every item runs here.

What ``fn`` does besides returning its result stays in the child: a trace's model built there
is given to the child's copy of the process's model store (:mod:`.reuse`), so the store keeps
the models of the items traced here (a later trace builds the others again, in ~10 ms).

Everything runs here, one item after another, where forking is not safe or not possible:
not Linux (macOS forks badly once system frameworks are loaded; Windows has no fork),
another Python thread is running (it could hold a lock the child would wait on forever),
CUDA is initialised (a forked child cannot use it),
a single CPU, inside a child, or ``VRAMPLAN_TRACE_WORKERS=1``.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Generic, TypeVar

WORKERS_ENV = "VRAMPLAN_TRACE_WORKERS"
"""Processes :func:`map_forked` may use at most (1: this process only); default: the CPUs this
process may run on."""

PATIENCE = (30.0, 10.0)
"""A child is given up (killed, its item run here) once it has run ``a + b × t`` seconds, ``t``
the longest item run here: the items are traces of one model with a layer more or less."""

T = TypeVar("T")
R = TypeVar("R")

_in_child = False


def _cuda_initialized() -> bool:
    """CUDA is initialised in this process (never where torch is not even imported: a ``fit``
    answered from the on-disk store imports no torch)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def workers() -> int:
    """How many processes :func:`map_forked` uses at most, here and now (1: no fork)."""
    if _in_child or sys.platform != "linux" or not hasattr(os, "fork") or threading.active_count() > 1 \
            or _cuda_initialized():
        return 1
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            return 1
    return len(os.sched_getaffinity(0))


class _Child(Generic[R]):
    """One item computed in a forked child; :meth:`result` waits for it."""

    def __init__(self, fn: Callable[[T], R], item: T) -> None:
        """Fork the child; OSError where that fails (no fork, pipe or temporary file: too many
        processes or descriptors, no memory), with nothing left open."""
        self._pid = 0
        self._done = -1
        self._file: IO[bytes] = tempfile.TemporaryFile()
        end = -1
        try:
            self._done, end = os.pipe()  # (end-of-file here once the child has exited)
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    with contextlib.suppress(Exception):  # (a closed or broken stream: nothing to flush)
                        stream.flush()
            self._pid = os.fork()
        except BaseException:
            for fd in (self._done, end):
                if fd >= 0:
                    os.close(fd)
            self._done = -1
            self._file.close()
            raise
        if self._pid == 0:  # the child: never returns
            os.close(self._done)
            _run_child(fn, item, self._file)
        os.close(end)

    def result(self, give_up_at: float) -> tuple[bool, R | None]:
        """(True, the result), or (False, None) where the child failed or is still running at
        ``give_up_at`` (``time.monotonic()``; it is killed)."""
        try:
            done = select.poll()  # (not select.select: it takes no descriptor from 1,024 on)
            done.register(self._done, select.POLLIN | select.POLLHUP)
            if not done.poll(max(0, math.ceil(1000 * (give_up_at - time.monotonic())))):
                self.kill()
                return False, None
            _, status = os.waitpid(self._pid, 0)
            self._pid = 0
            if os.waitstatus_to_exitcode(status) != 0:
                return False, None
            self._file.seek(0)
            return True, pickle.load(self._file)  # (written by our own child, see the module docstring)
        finally:
            self._close()

    def _close(self) -> None:
        self._file.close()
        if self._done >= 0:
            os.close(self._done)
            self._done = -1

    def kill(self) -> None:
        """Stop the child and reap it (given up, or this process is leaving with an error)."""
        if self._pid:
            try:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            except OSError:
                pass
            self._pid = 0
        self._close()


def _run_child(fn: Callable[[T], R], item: T, out: IO[bytes]) -> None:
    global _in_child
    _in_child = True
    code = 1
    try:
        # GNU OpenMP's thread pool does not survive a fork: a parallel CPU op (a host tensor's
        # real values) would wait forever for the parent's threads. One thread, as PyTorch's
        # DataLoader sets in its forked workers.
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        pickle.dump(fn(item), out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()
        code = 0
    except BaseException:  # noqa: BLE001 (the parent runs the item again and raises)
        pass
    finally:
        os._exit(code)


def map_forked(fn: Callable[[T], R], items: Sequence[T], *, processes: int | None = None,
               fork_from: float = 0.0) -> list[R]:
    """``[fn(x) for x in items]``; where :func:`workers` allows more than one process
    (``processes``: at most that many instead), the first item runs here first (it imports
    what the others need, the model's code, and warms this process's caches, which the
    children inherit), then the last items run in forked children while this process runs
    the ones between. ``fn``'s results must pickle; ``fn`` must not rely on side effects in
    this process for the children's items (they happen in the child).

    ``fork_from``: the seconds the first item must take for the others to be forked (else all
    run here): a fork costs a large Python process tens of milliseconds of copy-on-write page
    faults, in the child and here, which short items do not win back."""
    n = min(len(items), processes if processes is not None else workers())
    if n <= 1 or _in_child:
        return [fn(x) for x in items]
    start = time.monotonic()
    out = [fn(items[0])]
    longest = time.monotonic() - start
    if longest < fork_from:
        return out + [fn(x) for x in items[1:]]
    here = max(1, len(items) - (n - 1))
    children: list[_Child[R]] = []
    try:
        start = time.monotonic()
        for x in items[here:]:
            try:
                children.append(_Child(fn, x))
            except OSError:  # (no child can be forked now: every item runs here)
                for child in children:
                    child.kill()
                return out + [fn(x) for x in items[1:]]
        for x in items[1:here]:
            t = time.monotonic()
            out.append(fn(x))
            longest = max(longest, time.monotonic() - t)
        give_up_at = start + PATIENCE[0] + PATIENCE[1] * longest
        for child, x in zip(children, items[here:], strict=True):
            ok, got = child.result(give_up_at)
            out.append(got if ok else fn(x))  # type: ignore[arg-type]
        return out
    except BaseException:
        for child in children:
            child.kill()
        raise


class Ahead:
    """Work done ahead in forked children for what it leaves behind — traces and replays written
    to the on-disk store (:mod:`vramplan.engine.store`) — while this process goes on; this
    process then runs the same work itself, one item after another as a serial run does, and
    finds each trace stored: the answers are a serial run's by construction (a stored trace is
    the trace), only sooner. ``fit`` searches the sequence here while it searches the batch;
    ``plan`` confirms finalists ahead. The items are shared among up to ``workers() - 1``
    children, each running its share one after another.

    Nothing is forked where :func:`workers` allows one process; the caller forks nothing where
    the store is off (``VRAMPLAN_NO_CACHE``: a child's work would be lost). :meth:`wait` waits for the children
    (killed past ``PATIENCE``, scaled by the seconds this process worked meanwhile); a child
    that failed or was killed leaves fewer stored traces, which this process then makes itself.
    """

    def __init__(self, fn: Callable[[T], object], items: Sequence[T]) -> None:
        self._children: list[_Child[object]] = []
        self._start = time.monotonic()
        n = min(len(items), max(0, workers() - 1))
        for k in range(n):  # (child k runs items k, k + n, …, one after another)
            try:
                self._children.append(_Child(_quiet(fn), list(items)[k::n]))
            except OSError:
                break
        self.forked = len(self._children)
        """Children forked (0: nothing runs ahead)."""

    def wait(self) -> None:
        worked = time.monotonic() - self._start
        give_up_at = time.monotonic() + PATIENCE[0] + PATIENCE[1] * worked
        children, self._children = self._children, []
        for child in children:
            child.result(give_up_at)

    def cancel(self) -> None:
        """Stop the children (their work is not needed); what they stored stays stored."""
        children, self._children = self._children, []
        for child in children:
            child.kill()

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.cancel()
        else:
            self.wait()


def _quiet(fn: Callable[[T], object]) -> Callable[[list[T]], None]:
    """``fn`` run on each item for its side effects (no result is sent back)."""

    def run(xs: list[T]) -> None:
        for x in xs:
            fn(x)

    return run

