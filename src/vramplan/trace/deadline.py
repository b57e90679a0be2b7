"""Limits and a progress heartbeat for running user code (a trace can loop forever, or keep
growing the process's memory).

``with deadline(600, max_rss=8 << 30, on_progress=cb): ...`` raises
:class:`~vramplan.errors.TraceTimeoutError` once 600 s have passed, and :class:`TraceMemoryError`
once the process's resident memory exceeds 8 GiB, each naming the line of the user's code that
was running; it calls ``cb(elapsed_s)`` every ``every`` seconds meanwhile (the CLI prints it on
stderr; the core never prints).

It uses ``SIGALRM`` (``signal.setitimer``), so it works in the main thread of a POSIX
process; elsewhere (a worker thread, Windows) the code runs without a limit. A signal is
handled between Python bytecodes: a loop in Python stops within a tick; a single long C call
(one huge kernel on the CPU) stops when it returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from ..errors import TraceError, TraceTimeoutError
from ..units import fmt_bytes

TICK_S = 0.25
SWALLOWED_AFTER_S = 1.0
"""Still inside the limit this long after raising: the code caught it; raise again."""
IMPORT_GRACE_S = 10.0
"""How long a limit waits for an import to finish before it interrupts it anyway. An exception
raised while a module's body runs leaves its package half-initialised for the rest of the
process ("partially initialized module 'torch._dynamo'": torch imports it on a trace's first
ops); see also ``script.runner._deadline``."""


class TraceMemoryError(TraceError):
    """User code under a trace grew the process's memory past its budget (``max_memory``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, hint="check the code for a loop that never ends or keeps tensors alive; raise "
                         "`max_memory`, or lower `timeout` to stop such a loop sooner")


@contextlib.contextmanager
def deadline(seconds: float | None, *, what: str = "the trace",
             on_progress: Callable[[float], None] | None = None, every: float = 30.0,
             max_rss: int | None = None) -> Iterator[None]:
    """``seconds`` (0 or None: no time limit) and ``max_rss`` (bytes of resident memory; None:
    no memory limit) bound the code run inside."""
    limited = bool(seconds and seconds > 0) or bool(max_rss)
    if not (limited or on_progress) or not hasattr(signal, "setitimer") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    state: dict[str, object] = {"failure": None, "next": every, "raised_at": None}

    def failure(frame: FrameType | None, elapsed: float) -> TraceError | None:
        if seconds and seconds > 0 and elapsed >= seconds:
            return TraceTimeoutError(_message(what, f"did not finish within {seconds:g} s", _where(frame)))
        if max_rss:
            rss = current_rss()
            if rss is not None and rss > max_rss:
                return TraceMemoryError(_message(
                    what, f"grew the process to {fmt_bytes(rss)} of memory after {elapsed:.0f} s, past its budget "
                    f"of {fmt_bytes(max_rss)}", _where(frame)))
        return None

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        elapsed = now - start
        err = state["failure"]
        if err is None:
            err = failure(frame, elapsed)
        if isinstance(err, TraceError):
            if _in_finaliser(frame):
                return  # an exception in a finaliser is only printed ("Exception ignored"): next tick
            if _importing(frame):
                seen = state.setdefault("importing_since", now)
                if isinstance(seen, float) and now - seen < IMPORT_GRACE_S:
                    state["failure"] = err
                    return  # never inside an import (it would leave the package half-initialised): next tick
            last = state["raised_at"]
            if isinstance(last, float) and now - last < SWALLOWED_AFTER_S:
                return  # unwinding: let cleanup code (finally blocks) run undisturbed
            state["failure"] = err
            state["raised_at"] = now  # raised again later if the code swallowed it
            raise _again(err)
        nxt = state["next"]
        if on_progress is not None and isinstance(nxt, float) and elapsed >= nxt:
            state["next"] = nxt + every
            on_progress(elapsed)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    try:
        yield
    except BaseException as e:
        err = state["failure"]
        if isinstance(err, TraceError) and not isinstance(e, type(err)):
            # the code under the limit caught our exception and raised its own (a wrapper)
            raise _again(err) from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)


def _again(err: TraceError) -> TraceError:
    """A fresh exception with the same message (one that was raised carries its traceback)."""
    return type(err)(err.message)


def current_rss() -> int | None:
    """This process's resident memory in bytes (Linux: now; elsewhere: its peak so far), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if sys.platform == "darwin" else int(peak) * 1024
    except (ImportError, OSError, ValueError):
        return None


def physical_memory() -> int | None:
    """Bytes of RAM in this machine, or None when the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import (a frame of Python's import machinery on its stack)."""
    f = frame
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        f = f.f_back
    return False


def _in_finaliser(frame: FrameType | None) -> bool:
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            return True
        f = f.f_back
    return False


def _where(frame: FrameType | None) -> str:
    """The user's line the code was running: the innermost frame outside torch, vramplan and
    Python's library (a loop in ``forward`` spends its time in the trace's dispatch), else the
    innermost frame."""
    if frame is None:
        return ""
    from .where import frame_location  # torch is loaded: the code under the limit is a trace

    return frame_location(frame) or f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _message(what: str, happened: str, where: str) -> str:
    at = f" (it was running {where})" if where else ""
    return f"{what} {happened}{at}"
