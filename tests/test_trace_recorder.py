"""resolve_categories (trace.recorder), vectorised, decides every category as the event-by-event rule does."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from vramplan.events import Category, EventLog
from vramplan.trace.recorder import FORWARD_LIKE, UNDECIDED, resolve_categories


def _reference(log: EventLog) -> None:
    """The rule one event at a time (the implementation before numpy)."""
    n = len(log)
    action, ids, cat, phase, it = log.action, log.id, log.category, log.phase, log.iteration
    span = [0] * n
    s = 0
    for k in range(1, n):
        if phase[k] != phase[k - 1] or it[k] != it[k - 1]:
            s += 1
        span[k] = s
    alloc_at: dict[int, int] = {}
    free_at: dict[int, int] = {}
    for k in range(n):
        if action[k] == 0:
            alloc_at[ids[k]] = k
        elif action[k] == 1:
            free_at[ids[k]] = k
    for eid, k in alloc_at.items():
        if cat[k] != UNDECIDED:
            continue
        f = free_at.get(eid)
        forward = phase[k] in FORWARD_LIKE and (f is None or span[f] != span[k])
        cat[k] = int(Category.ACTIVATION) if forward else int(Category.TEMPORARY)
    for eid, f in free_at.items():
        k2 = alloc_at.get(eid)
        if k2 is not None:
            cat[f] = cat[k2]


_EVENT = st.tuples(st.sampled_from([0, 0, 1, 1, 5]), st.integers(0, 12),
                   st.sampled_from([UNDECIDED, UNDECIDED, int(Category.PARAMETER), int(Category.GRADIENT)]),
                   st.integers(0, 6), st.integers(0, 2))


def _log(events: list[tuple[int, int, int, int, int]]) -> EventLog:
    log = EventLog()
    for a, i, c, p, it in events:
        log.action.append(a)
        log.id.append(i)
        log.size.append(512)
        log.stream.append(0)
        log.category.append(c)
        log.phase.append(p)
        log.module.append(0)
        log.op.append(0)
        log.desc.append(0)
        log.iteration.append(it)
    return log


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENT, max_size=60))
def test_resolved_as_event_by_event(events: list[tuple[int, int, int, int, int]]) -> None:
    """Random logs: ids allocated or freed twice or never, frees without allocations, marks."""
    got, want = _log(events), _log(events)
    resolve_categories(got)
    _reference(want)
    assert got.category == want.category
    assert isinstance(got.category, array)


def test_resolving_twice_changes_nothing() -> None:
    log = _log([(0, 1, UNDECIDED, 1, 1), (0, 2, UNDECIDED, 1, 1), (1, 2, UNDECIDED, 1, 1), (5, 0, UNDECIDED, 2, 1),
                (1, 1, UNDECIDED, 2, 1)])
    resolve_categories(log)
    assert list(log.category) == [int(Category.ACTIVATION), int(Category.TEMPORARY), int(Category.TEMPORARY),
                                  UNDECIDED, int(Category.ACTIVATION)]
    once = array("b", log.category)
    resolve_categories(log)
    assert log.category == once
