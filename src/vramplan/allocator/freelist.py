"""A pool's free list: its free blocks' keys ``size << SHIFT | addr``, sorted.

PyTorch keeps them in a ``std::set`` (a balanced tree: every insert and erase O(log n)).
Here a pool's keys are a plain sorted ``list`` searched with :mod:`bisect` while they are few,
the usual case: a step's temporaries cycle through tens to hundreds of free blocks, and
``bisect`` plus ``list.insert``/``del`` on a short list is the fastest thing Python has.

Inserting into or deleting from a sorted list moves every key after the position, though, and
some pools hold tens of thousands of free blocks: a DeepSeek-V3 training step replayed on one
GPU keeps up to 32,000 of them (mostly the 2 MiB tails of its ~55,000 weight segments), and its
1.7 M inserts moved ~10,000 keys each on average: most of a 2.4 M-event replay's time. Once a
pool holds more than :data:`HIGH` keys it is turned into a :class:`Blocked` list instead: the
same keys in sorted runs of at most ``2 × LOAD``, with each run's largest key, so that an
insert or delete moves at most a run (the idea of ``sortedcontainers.SortedList``; written
here because the replay's hot loop (:mod:`.fused`) inlines the plain-list case and calls these
few methods directly, where a library's general API would cost more than it saves). The
order, and so every decision the allocator takes, is unchanged; only the cost differs.

Where the package's compiled core is built (``setup.py``; see :mod:`.core`), a long list becomes
a :class:`._keyset.KeySet` instead: the same sorted set and methods, written in C with each key
compared as a 128-bit machine integer, ~4× faster per operation. ``tests/test_allocator_keyset.py``
checks that it answers as :class:`Blocked` does, operation by operation.

The functions below take any kind; :func:`add` does the conversion.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from itertools import chain
from typing import TYPE_CHECKING, TypeAlias

from . import core
from .blocks import SHIFT

if TYPE_CHECKING:
    from ._keyset import KeySet
    from .blocks import Pool

HIGH = 2048
"""A plain list longer than this becomes :class:`Blocked` (and stays so)."""
LOAD = 512
"""A :class:`Blocked` run is split in two when it grows past ``2 × LOAD`` keys."""


class Blocked:
    """Sorted distinct integers held in sorted runs; ``maxes[j]`` is ``runs[j][-1]``."""

    __slots__ = ("load", "maxes", "n", "runs")

    def __init__(self, keys: list[int]) -> None:
        self.load: int = LOAD
        """:data:`LOAD` when made (an attribute: a compiled method reads it without a dict lookup)."""
        load = self.load
        self.runs = [keys[i:i + load] for i in range(0, len(keys), load)]
        self.maxes = [r[-1] for r in self.runs]
        self.n = len(keys)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self.runs)

    def __eq__(self, other: object) -> bool:  # (as a list compares: same keys, same order)
        return isinstance(other, (list, Blocked)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # (mutable, as a list)

    def ge(self, x: int) -> int:
        """The smallest key ≥ ``x``; -1 if none."""
        maxes = self.maxes
        j = bisect_left(maxes, x)
        if j == len(maxes):
            return -1
        run = self.runs[j]
        return run[bisect_left(run, x)]

    def lt(self, x: int) -> int:
        """The largest key < ``x``; -1 if none."""
        j = bisect_left(self.maxes, x)
        if j < len(self.maxes):
            run = self.runs[j]
            i = bisect_left(run, x)
            if i:
                return run[i - 1]
        return self.maxes[j - 1] if j else -1

    def take(self, size: int, limit: int) -> int:
        """The best fit's key for ``size`` bytes, removed: the smallest key ≥ ``size << SHIFT``,
        taken only if its size is below ``limit``; -1 if none."""
        key = self.ge(size << SHIFT)
        if key < 0 or key >> SHIFT >= limit:
            return -1
        self.remove(key)
        return key

    def put(self, key: int, size: int, addr: int) -> None:
        """:meth:`add` of ``key == size << SHIFT | addr`` (the C key set reads the small ints)."""
        self.add(key)

    def drop(self, size: int, addr: int) -> None:
        """:meth:`remove` of ``size << SHIFT | addr``."""
        self.remove((size << SHIFT) | addr)

    def add(self, key: int) -> None:
        maxes = self.maxes
        runs = self.runs
        j = bisect_left(maxes, key)
        if j == len(maxes):
            if not runs:
                runs.append([key])
                maxes.append(key)
                self.n = 1
                return
            j -= 1
            run = runs[j]
            run.append(key)
            maxes[j] = key
        else:
            run = runs[j]
            insort(run, key)
        self.n += 1
        load = self.load
        if len(run) > 2 * load:
            runs.insert(j + 1, run[load:])
            del run[load:]
            maxes.insert(j, run[-1])

    def remove(self, key: int) -> None:
        """Remove ``key``, which is present."""
        maxes = self.maxes
        j = bisect_left(maxes, key)
        run = self.runs[j]
        i = bisect_left(run, key)
        del run[i]
        self.n -= 1
        if not run:
            del self.runs[j]
            del maxes[j]
            return
        if i == len(run):
            maxes[j] = run[-1]
        load = self.load
        if j and len(run) < load // 2:  # (a short run joins the one before, so runs stay ~load long)
            runs = self.runs
            prev = runs[j - 1]
            prev.extend(run)
            del runs[j]
            del maxes[j - 1]
            if len(prev) > 2 * load:
                runs.insert(j, prev[load:])
                del prev[load:]
                maxes.insert(j - 1, prev[-1])


if TYPE_CHECKING:
    Long: TypeAlias = Blocked | KeySet
    Keys: TypeAlias = list[int] | Long


def lengthen(keys: list[int]) -> Long:
    """The long form of a sorted free list: a :class:`._keyset.KeySet` where the compiled core is
    built and in use, else a :class:`Blocked`."""
    made = core.keyset()
    return Blocked(keys) if made is None else made(keys)


def ge(keys: Keys, x: int) -> int:
    """The smallest key ≥ ``x`` in ``keys``; -1 if none."""
    if isinstance(keys, list):
        i = bisect_left(keys, x)
        return keys[i] if i < len(keys) else -1
    return keys.ge(x)


def lt(keys: Keys, x: int) -> int:
    """The largest key < ``x`` in ``keys``; -1 if none."""
    if isinstance(keys, list):
        i = bisect_left(keys, x)
        return keys[i - 1] if i else -1
    return keys.lt(x)


def remove(keys: Keys, key: int) -> None:
    """Remove ``key``, which ``keys`` holds."""
    if isinstance(keys, list):
        del keys[bisect_left(keys, key)]
    else:
        keys.remove(key)


def add(pool: Pool, key: int) -> None:
    """Insert ``key`` into ``pool``'s free list (made :class:`Blocked` once it is long)."""
    keys = pool.keys
    if isinstance(keys, list):
        insort(keys, key)
        if len(keys) > HIGH:
            pool.keys = lengthen(keys)
    else:
        keys.add(key)
