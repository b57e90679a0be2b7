"""A time limit and a progress heartbeat for running user code (a trace can loop forever).

``with deadline(600, on_progress=cb): ...`` raises :class:`~vramplan.errors.TraceTimeoutError`
once 600 s have passed, naming the line the code was running, and calls ``cb(elapsed_s)``
every ``every`` seconds meanwhile (the CLI prints it on stderr; the core never prints).

It uses ``SIGALRM`` (``signal.setitimer``), so it works in the main thread of a POSIX
process; elsewhere (a worker thread, Windows) the code runs without a limit. A signal is
handled between Python bytecodes: a loop in Python stops within a tick; a single long C call
(one huge kernel on the CPU) stops when it returns.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from ..errors import TraceTimeoutError

TICK_S = 0.25
SWALLOWED_AFTER_S = 1.0
"""Still inside the limit this long after raising: the code caught it; raise again."""


@contextlib.contextmanager
def deadline(seconds: float | None, *, what: str = "the trace",
             on_progress: Callable[[float], None] | None = None, every: float = 30.0) -> Iterator[None]:
    if not seconds or seconds <= 0 or not hasattr(signal, "setitimer") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    state: dict[str, object] = {"expired": None, "next": every, "raised_at": None}

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        elapsed = now - start
        if elapsed >= seconds:
            if _in_finaliser(frame):
                return  # an exception in a finaliser is only printed ("Exception ignored"): next tick
            last = state["raised_at"]
            if isinstance(last, float) and now - last < SWALLOWED_AFTER_S:
                return  # unwinding: let cleanup code (finally blocks) run undisturbed
            if state["expired"] is None:
                state["expired"] = _where(frame)
            state["raised_at"] = now  # raised again later if the code swallowed it
            raise TraceTimeoutError(_message(what, seconds, state["expired"]))
        nxt = state["next"]
        if on_progress is not None and isinstance(nxt, float) and elapsed >= nxt:
            state["next"] = nxt + every
            on_progress(elapsed)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TICK_S, TICK_S)
    try:
        yield
    except BaseException as e:
        where = state["expired"]
        if where is not None and not isinstance(e, TraceTimeoutError):
            # the code under the limit caught our exception and raised its own (a wrapper)
            raise TraceTimeoutError(_message(what, seconds, where)) from None
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)


def _in_finaliser(frame: FrameType | None) -> bool:
    f = frame
    while f is not None:
        if f.f_code.co_name == "__del__":
            return True
        f = f.f_back
    return False


def _where(frame: FrameType | None) -> str:
    if frame is None:
        return ""
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


def _message(what: str, seconds: float, where: object) -> str:
    at = f" (it was running {where})" if where else ""
    return f"{what} did not finish within {seconds:g} s{at}"
