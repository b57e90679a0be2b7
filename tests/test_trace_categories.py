"""The vectorised ``resolve_categories`` equals the event-by-event rule (``test_trace_recorder._reference``) on
logs with deferred frees, syncs, repeated ids and every phase."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from test_trace_recorder import _reference
from vramplan.events import PHASES, Action, Category, EventLog
from vramplan.trace.recorder import UNDECIDED, resolve_categories

_CATS = (UNDECIDED, int(Category.PARAMETER), int(Category.KV_CACHE), int(Category.ACTIVATION))


@st.composite
def logs(draw: st.DrawFn, unique: bool) -> EventLog:
    """ALLOC/FREE/FREE_DEFERRED/SYNC events over a few phases and iterations; ``unique=False``
    lets ids repeat (the reference's last-ALLOC/last-FREE pairing)."""
    log = EventLog()
    n = draw(st.integers(0, 60))
    next_id = 1
    live: list[int] = []
    for _ in range(n):
        kind = draw(st.integers(0, 5))
        phase, it = draw(st.integers(0, len(PHASES) - 1)), draw(st.integers(0, 2))
        cat = Category(draw(st.sampled_from(_CATS)))
        if kind <= 2 or not live:
            ident = next_id if unique else draw(st.integers(1, 6))
            next_id += 1
            log.append(Action.ALLOC, ident, draw(st.integers(0, 4096)), category=cat, phase=phase, iteration=it)
            live.append(ident)
        elif kind <= 4:
            ident = live.pop(draw(st.integers(0, len(live) - 1)))
            action = Action.FREE if kind == 3 else Action.FREE_DEFERRED
            log.append(action, ident, category=cat, phase=phase, iteration=it)
        else:
            log.append(Action.SYNC, phase=phase, iteration=it)
    if not unique and draw(st.booleans()) and n:
        log.append(Action.FREE, draw(st.integers(1, 6)))  # a FREE of an id never allocated, or twice
    return log


@settings(max_examples=300, deadline=None)
@given(st.booleans().flatmap(logs))
def test_vectorised_equals_reference(log: EventLog) -> None:
    ref = copy.deepcopy(log)
    _reference(ref)
    resolve_categories(log)
    assert list(log.category) == list(ref.category)
    log.append(Action.SYNC)  # the log's arrays still grow (no numpy view left holding them)


def test_activation_and_temporary() -> None:
    prefill = PHASES.index("prefill")  # storages that outlive the prefill span are activations
    log = EventLog()
    log.append(Action.ALLOC, 1, 512, phase=prefill)
    log.append(Action.ALLOC, 2, 512, phase=prefill)
    log.append(Action.FREE, 2, phase=prefill)
    log.append(Action.FREE, 1, phase=prefill + 1)
    resolve_categories(log)
    assert list(log.category) == [int(Category.ACTIVATION), int(Category.TEMPORARY),
                                  int(Category.TEMPORARY), int(Category.ACTIVATION)]
