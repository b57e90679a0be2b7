"""Where in the user's code the trace is: the innermost frame outside torch, the Python
standard library and vramplan (for messages that name ``file:line``)."""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

_INTERNAL = tuple(
    os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__))
) + (sysconfig.get_paths()["stdlib"] + os.sep,)


def user_frame_of(exc: BaseException) -> str | None:
    """``path:line`` of the innermost user frame in ``exc``'s traceback, or None."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_INTERNAL) and not f.filename.startswith("<")]
    if not frames:
        return None
    f = frames[-1]
    rel = os.path.relpath(f.filename) if os.path.isabs(f.filename) else f.filename
    return f"{f.filename if rel.startswith('..') else rel}:{f.lineno}"


def user_frame(skip: int = 1) -> str:
    """``path:line`` of the innermost user frame (relative to the working directory when
    below it), or ``<unknown>``."""
    f = sys._getframe(skip)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_INTERNAL) and not fn.startswith("<"):
            try:
                rel = os.path.relpath(fn)
            except ValueError:
                rel = fn
            return f"{fn if rel.startswith('..') else rel}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>"
