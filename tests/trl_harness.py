"""What the TRL comparisons (``test_preference.py``, ``test_grpo.py``) run TRL's code inside."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vramplan.trace.session import TraceSession


@contextlib.contextmanager
def accelerate_autocast() -> Iterator[None]:
    """accelerate's ``prepare_model``: ``torch.autocast`` around each forward call, so the region
    (and its weight-cast cache) ends with the call; the step's own region is left for the call."""
    sess = TraceSession.current()
    ac = sess.autocast if sess is not None else None
    if ac is None or not ac.enabled:
        yield
        return
    ac.exit()
    ac.enter()
    try:
        yield
    finally:
        ac.exit()
        ac.enter()
