"""The C key set of the compiled core (``allocator/_keyset.c``) answers as a sorted list does, and
as :class:`vramplan.allocator.freelist.Blocked` does, operation by operation: the same keys in
the same order, the same best fit taken, the same errors for misuse.

Skipped where the compiled core is not built (the Python source then runs, and
``test_allocator_freelist.py`` covers it); ``make test`` builds it, and
``test_allocator_core.py`` fails if a build that was recorded is not in use.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramplan.allocator import core, freelist
from vramplan.allocator.blocks import SHIFT
from vramplan.allocator.check import _long_problems
from vramplan.allocator.freelist import Blocked

KeySet = core.keyset()
pytestmark = pytest.mark.skipif(KeySet is None, reason="the compiled core is not built (pip install -e . builds it)")

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# keys as the allocator makes them (size << SHIFT | addr), from small to past 2**64, and a few
# ranges dense enough that hundreds of keys split and merge runs
sizes = st.sampled_from([512, 1024, 2 << 20, 20 << 20, 3 << 40])
keys_st = st.one_of(st.integers(0, 3000), st.builds(lambda s, a: (s << SHIFT) | a, sizes, st.integers(0, 4000)))


def check(keys, model: list[int]) -> None:
    assert list(keys) == model and keys.tolist() == model and len(keys) == len(model) and keys == model
    assert _long_problems(keys) == []


@SETTINGS
@given(start=st.lists(keys_st, unique=True, max_size=400),
       ops=st.lists(st.tuples(st.sampled_from(["add", "remove", "ge", "lt", "take"]), keys_st, sizes), max_size=600))
def test_keyset_behaves_as_a_sorted_list_and_as_blocked(start, ops):
    model = sorted(start)
    ks, bl = KeySet(model), Blocked(list(model))
    check(ks, model)
    for kind, x, limit in ops:
        if kind == "add" and x not in model:
            insort(model, x)
            ks.add(x)
            bl.add(x)
        elif kind == "remove" and model:
            k = model.pop(x % len(model))
            ks.remove(k)
            bl.remove(k)
        elif kind == "ge":
            i = bisect_left(model, x)
            assert ks.ge(x) == bl.ge(x) == (model[i] if i < len(model) else -1)
        elif kind == "lt":
            i = bisect_left(model, x)
            assert ks.lt(x) == bl.lt(x) == (model[i - 1] if i else -1)
        elif kind == "take":
            size = x >> SHIFT if x >> SHIFT else x
            i = bisect_left(model, size << SHIFT)
            want = model[i] if i < len(model) and model[i] >> SHIFT < limit else -1
            assert ks.take(size, limit) == bl.take(size, limit) == want
            if want >= 0:
                model.remove(want)
        check(ks, model)
        assert list(bl) == model


def test_runs_split_and_merge_through_thousands_of_keys():
    """Ascending, descending and interleaved inserts past many runs, then removals that empty
    runs and join short ones; the invariants hold at every step."""
    model: list[int] = []
    ks = KeySet()
    order = list(range(0, 6000, 3)) + list(range(5999, 0, -3)) + list(range(1, 6000, 3))
    for i, k in enumerate(order):
        ks.add(k)
        insort(model, k)
        if i % 97 == 0:
            check(ks, model)
    check(ks, model)
    assert len(ks.run_lengths()) > 6000 // core_run_max()
    for i, k in enumerate(list(range(0, 6000, 2)) + list(range(5999, 3000, -2))):
        ks.remove(k)
        model.remove(k)
        if i % 89 == 0:
            check(ks, model)
    check(ks, model)
    for x in range(0, 6002, 7):
        i = bisect_left(model, x)
        assert ks.ge(x) == (model[i] if i < len(model) else -1)
        assert ks.lt(x) == (model[i - 1] if i else -1)


def core_run_max() -> int:
    from vramplan.allocator import _keyset

    return _keyset.RUN_MAX


def test_misuse_is_an_error_not_a_wrong_answer():
    ks = KeySet([1, 5, 9])
    with pytest.raises(KeyError):
        ks.remove(4)
    with pytest.raises(ValueError, match="already held"):
        ks.add(5)
    with pytest.raises((ValueError, OverflowError)):
        ks.add(-1)
    with pytest.raises(OverflowError):
        ks.add(1 << 128)
    with pytest.raises(TypeError):
        ks.add("7")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sorted and distinct"):
        KeySet([3, 2])
    with pytest.raises(ValueError, match="sorted and distinct"):
        KeySet([2, 2])
    assert ks == [1, 5, 9]  # (unchanged by the refused calls)
    with pytest.raises(TypeError):
        hash(ks)


def test_take_saturates_a_limit_past_64_bits():
    """``max_split_size`` unset is 2**64 - 1, and ``rsize + max_non_split_rounding`` may pass it."""
    big = (5 << 40) << SHIFT
    ks = KeySet([big])
    assert ks.take(5 << 40, freelist_no_limit() + (6 << 40)) == big and len(ks) == 0


def freelist_no_limit() -> int:
    from vramplan.allocator.constants import NO_LIMIT

    return NO_LIMIT


def test_the_allocator_makes_long_lists_keysets_when_built():
    from vramplan.allocator.blocks import Pool

    pool = Pool(False, 0)
    for k in range(freelist.HIGH + 5, 0, -1):
        freelist.add(pool, k)
    assert type(pool.keys) is KeySet and list(pool.keys) == list(range(1, freelist.HIGH + 6))
