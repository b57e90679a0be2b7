"""Where in the user's code the trace is: the innermost frame outside torch, the Python
standard library and vramplan (for messages that name ``file:line``)."""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

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
    f = _user(sys._getframe(skip))
    return _path_line(f) if f is not None else "<unknown>"


def frame_location(frame: FrameType | None) -> str | None:
    """``path:line in function`` of the innermost user frame at or above ``frame`` (e.g. the
    frame a signal interrupted), or None when every frame is torch's, vramplan's or Python's."""
    f = _user(frame)
    return f"{_path_line(f)} in {f.f_code.co_name}" if f is not None else None


def _user(f: FrameType | None) -> FrameType | None:
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_INTERNAL) and not fn.startswith("<"):
            return f
        f = f.f_back
    return None


def _path_line(f: FrameType) -> str:
    fn = f.f_code.co_filename
    try:
        rel = os.path.relpath(fn)
    except ValueError:
        rel = fn
    return f"{fn if rel.startswith('..') else rel}:{f.f_lineno}"
