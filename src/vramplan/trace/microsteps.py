"""Gradient-accumulation micro-steps traced until they repeat, then written: the accumulation
fast path.

From the second micro-step of an iteration on, a training loop's micro-steps run the same
ops on the same shapes: the gradients exist (the first micro-step allocated them) and each
backward accumulates into them. Tracing 24 micro-steps of a model costs 24 forward and
backward passes; this module traces the first micro-steps, and once the last two traced ones
recorded the same events — same actions, sizes, streams, categories, phases, modules, ops and
shapes, and the same frees of the same allocations — and each is self-contained (every
storage it allocates it also frees, and it frees nothing allocated before it), writes the
remaining micro-steps of the iteration as copies of the last one, under fresh ids. The
allocator replay still sees every allocation and free of every micro-step.

Where the micro-steps differ (a lazily created buffer, routing that changes, storages kept
alive by a reference cycle until the iteration's garbage collection), nothing is written and
every micro-step is traced, as before.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..events import Action
from .recorder import Recorder

TRACED = 3
"""Micro-steps traced for real before the rest are written (the first allocates the
gradients; the second and third must repeat)."""

_ALLOC, _FREE, _FREE_DEFERRED = int(Action.ALLOC), int(Action.FREE), int(Action.FREE_DEFERRED)
_COLUMNS = ("action", "size", "stream", "category", "phase", "module", "op", "desc", "iteration")


@dataclass
class MicrostepRepeater:
    """Watches an iteration's micro-steps; once two repeat exactly, writes the rest."""

    rec: Recorder
    dispatch: Any
    """The trace mode: its ``flops`` counters are advanced with the written micro-steps."""
    starts: list[int] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    skipped: list[Counter[str]] = field(default_factory=list)

    def begin(self) -> None:
        self.starts.append(len(self.rec.log))
        self.flops.append(int(self.dispatch.flops))
        self.skipped.append(Counter(self.dispatch.flops_skipped))

    def finish(self, remaining: int) -> bool:
        """After a traced micro-step: write ``remaining`` more if the last two repeat (True)."""
        if remaining < 1 or len(self.starts) < TRACED - 1:
            return False
        end = len(self.rec.log)
        last = _relative_ids(self.rec.log, self.starts[-1], end)
        if last is None:
            return False
        before = _relative_ids(self.rec.log, self.starts[-2], self.starts[-1])
        if before is None or not np.array_equal(before, last) or not self._same_rows(self.starts[-2], self.starts[-1],
                                                                                        end):
            return False
        self._write(self.starts[-1], end, last, remaining)
        self.dispatch.flops += remaining * (int(self.dispatch.flops) - self.flops[-1])
        step_skipped = Counter(self.dispatch.flops_skipped)
        step_skipped.subtract(self.skipped[-1])
        for op, n in step_skipped.items():
            if n > 0:
                self.dispatch.flops_skipped[op] += remaining * n
        return True

    def _same_rows(self, a: int, b: int, end: int) -> bool:
        log = self.rec.log
        if b - a != end - b:
            return False
        return all(getattr(log, c)[a:b] == getattr(log, c)[b:end] for c in _COLUMNS)

    def _write(self, start: int, end: int, rel: np.ndarray, remaining: int) -> None:
        log, rec = self.rec.log, self.rec
        allocs = int(rel.max()) + 1 if len(rel) and rel.max() >= 0 else 0
        columns = {c: getattr(log, c)[start:end] for c in _COLUMNS}
        for _ in range(remaining):
            base = rec._next_id
            rec._next_id += allocs
            ids = np.where(rel >= 0, rel + base, 0).astype(np.int64)
            for c, values in columns.items():
                getattr(log, c).extend(values)
            log.id.extend(array("q", ids.tobytes()))


def _relative_ids(log: Any, start: int, end: int) -> np.ndarray | None:
    """Each event's id as the position of its allocation among the span's allocations (−1 for
    events without one), or None when the span is not self-contained: it frees a storage
    allocated before it, leaves one of its own alive, or allocates an id twice."""
    if end <= start:
        return None
    action = np.frombuffer(log.action, dtype=np.int8)[start:end]
    ids = np.frombuffer(log.id, dtype=np.int64)[start:end]
    is_alloc = action == _ALLOC
    is_free = (action == _FREE) | (action == _FREE_DEFERRED)
    alloc_ids = ids[is_alloc]
    if len(np.unique(alloc_ids)) != len(alloc_ids):
        return None
    freed = ids[is_free]
    if len(np.unique(freed)) != len(freed) or len(freed) != len(alloc_ids):
        return None
    order = np.argsort(alloc_ids, kind="stable")
    sorted_ids = alloc_ids[order]
    rel = np.full(end - start, -1, np.int64)
    rel[is_alloc] = np.arange(len(alloc_ids))
    if len(freed):
        pos = np.minimum(np.searchsorted(sorted_ids, freed), len(sorted_ids) - 1)
        if not np.array_equal(sorted_ids[pos], freed):
            return None  # frees something allocated before the span
        at_free = np.flatnonzero(is_free)
        alloc_pos = np.flatnonzero(is_alloc)[order[pos]]
        if np.any(alloc_pos >= at_free):
            return None  # (freed before its allocation: an id reused across spans)
        rel[at_free] = order[pos]
    return rel


__all__ = ["MicrostepRepeater", "TRACED"]
