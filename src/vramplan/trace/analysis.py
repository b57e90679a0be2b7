"""Figures read from an event log: peaks, breakdowns, top tensors and modules, timeline."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..events import PHASES, Category, EventLog
from ..results import (
    BREAKDOWN_KEYS,
    Breakdown,
    IterationPeak,
    ModuleStat,
    PhasePeak,
    TensorStat,
    Timeline,
)
from ..workload import Phase

TIMELINE_POINTS = 5000
_BUCKET_OF_CATEGORY = np.array([BREAKDOWN_KEYS.index(Category(c).bucket) for c in range(len(Category))], dtype=np.int64)
_DESC = re.compile(r"^([A-Za-z0-9_]+)\[([0-9,]*)\]$")


@dataclass(frozen=True)
class Arrays:
    """Numpy views of a log plus the running total."""

    action: np.ndarray
    cat: np.ndarray
    phase: np.ndarray
    module: np.ndarray
    iteration: np.ndarray
    delta: np.ndarray
    total: np.ndarray
    alloc_idx: np.ndarray
    """Event index of each ALLOC."""
    free_idx: np.ndarray
    """Event index of each ALLOC's FREE (n = never freed)."""


def arrays(log: EventLog) -> Arrays:
    n = len(log)
    action = np.frombuffer(log.action, dtype=np.int8, count=n).astype(np.int64)
    ids = np.frombuffer(log.id, dtype=np.int64, count=n)
    size = np.frombuffer(log.size, dtype=np.int64, count=n)
    is_alloc = action == 0
    is_free = action == 1
    alloc_idx = np.nonzero(is_alloc)[0]
    alloc_ids = ids[alloc_idx]
    order = np.argsort(alloc_ids, kind="stable")
    sorted_ids = alloc_ids[order]
    free_idx_ev = np.nonzero(is_free)[0]
    pos = np.searchsorted(sorted_ids, ids[free_idx_ev])
    pos = np.clip(pos, 0, max(len(sorted_ids) - 1, 0))
    matched = (len(sorted_ids) > 0) & (sorted_ids[pos] == ids[free_idx_ev]) if len(sorted_ids) else np.zeros(0, bool)
    delta = np.where(is_alloc, size, 0)
    owner = alloc_idx[order[pos[matched]]]
    delta[free_idx_ev[matched]] = -size[owner]
    free_of_alloc = np.full(n, n, dtype=np.int64)
    free_of_alloc[owner] = free_idx_ev[matched]
    return Arrays(
        action=action,
        cat=np.frombuffer(log.category, dtype=np.int8, count=n).astype(np.int64),
        phase=np.frombuffer(log.phase, dtype=np.int8, count=n).astype(np.int64),
        module=np.frombuffer(log.module, dtype=np.int32, count=n).astype(np.int64),
        iteration=np.frombuffer(log.iteration, dtype=np.int16, count=n).astype(np.int64),
        delta=delta, total=np.cumsum(delta), alloc_idx=alloc_idx, free_idx=free_of_alloc[alloc_idx],
    )


def breakdown_at(a: Arrays, k: int) -> Breakdown:
    """Bytes live after event ``k``, by breakdown bucket."""
    per_cat = np.bincount(a.cat[: k + 1], weights=a.delta[: k + 1], minlength=len(Category))
    per_bucket = np.bincount(_BUCKET_OF_CATEGORY, weights=per_cat[: len(Category)], minlength=len(BREAKDOWN_KEYS))
    return Breakdown(**{key: int(round(per_bucket[i])) for i, key in enumerate(BREAKDOWN_KEYS)})


def peak_of(a: Arrays, mask: np.ndarray | None = None) -> int:
    """Index of the (first) highest running total, optionally among ``mask``ed events."""
    if mask is None:
        return int(np.argmax(a.total))
    idx = np.nonzero(mask)[0]
    return int(idx[np.argmax(a.total[idx])])


def _distinct(x: np.ndarray) -> np.ndarray:
    """The sorted distinct values of an integer array (``np.unique(x)``). numpy >= 2.3's
    ``np.unique`` without ``return_*`` asks ``np.ma.is_masked`` and so imports ``numpy.ma``
    (~20 ms of every trace's start-up); a count per value does not."""
    if x.size == 0:
        return x[:0]
    lo, hi = int(x.min()), int(x.max())
    if hi - lo <= x.size:  # phases, iterations: a count per value
        return (np.flatnonzero(np.bincount(x.astype(np.int64) - lo)) + lo).astype(x.dtype)
    s = np.sort(x)
    return s[np.concatenate(([True], s[1:] != s[:-1]))]


def phase_peaks(a: Arrays) -> tuple[PhasePeak, ...]:
    out = []
    for p in _distinct(a.phase):
        k = peak_of(a, a.phase == p)
        out.append(PhasePeak(phase=Phase(PHASES[int(p)]), allocated=int(a.total[k]), breakdown=breakdown_at(a, k)))
    return tuple(out)


def iteration_peaks(a: Arrays) -> tuple[IterationPeak, ...]:
    out = []
    for it in _distinct(a.iteration):
        if it < 1:
            continue
        k = peak_of(a, a.iteration == it)
        out.append(IterationPeak(iteration=int(it), allocated=int(a.total[k]), phase=Phase(PHASES[int(a.phase[k])])))
    return tuple(out)


def _parse_desc(desc: str) -> tuple[tuple[int, ...], str]:
    m = _DESC.match(desc)
    if not m:
        return (), ""
    shape = tuple(int(s) for s in m.group(2).split(",") if s)
    return shape, m.group(1)


def live_at(a: Arrays, k: int) -> np.ndarray:
    """Event indices of the allocations live after event ``k``."""
    sel = (a.alloc_idx <= k) & (a.free_idx > k)
    return a.alloc_idx[sel]


def top_tensors(log: EventLog, a: Arrays, k: int, n: int = 20) -> tuple[TensorStat, ...]:
    live = live_at(a, k)
    sizes = a.delta[live]
    order = np.argsort(-sizes, kind="stable")[:n]
    s = log.strings
    out = []
    for i in live[order]:
        shape, dtype = _parse_desc(s[log.desc[i]])
        out.append(TensorStat(
            nbytes=int(a.delta[i]), category=Category(int(a.cat[i])).label, module=s[log.module[i]],
            op=s[log.op[i]], shape=shape, dtype=dtype or s[log.desc[i]],
        ))
    return tuple(out)


def top_modules(log: EventLog, a: Arrays, k: int, known: set[str], n: int = 20) -> tuple[ModuleStat, ...]:
    """Per-module peaks (while the module or a submodule ran) and own bytes live at the peak."""
    if len(a.total) == 0:
        return ()
    mods = a.module
    peaks = np.full(len(log.strings), -1, dtype=np.int64)
    np.maximum.at(peaks, mods, a.total)
    s = log.strings
    by_path: dict[str, int] = {}
    for mid in np.nonzero(peaks >= 0)[0]:
        path = s[int(mid)]
        if not path:
            continue
        val = int(peaks[mid])
        for anc in _ancestors(path, known):
            if by_path.get(anc, -1) < val:
                by_path[anc] = val
    live = live_at(a, k)
    own_arr = np.bincount(mods[live], weights=a.delta[live], minlength=len(s))
    stats = [ModuleStat(module=p, peak=v, own=int(round(own_arr[log.intern(p)]))) for p, v in by_path.items()]
    stats.sort(key=lambda m: (-m.peak, -m.module.count("."), m.module))
    return tuple(stats[:n])


def _ancestors(path: str, known: set[str]) -> list[str]:
    out = [path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        anc = ".".join(parts[:i])
        if anc in known:
            out.append(anc)
    return out


def window_argmax(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """For each window ``[starts[i], ends[i])`` (contiguous, increasing, non-empty, covering
    ``values``), the index of its first largest value: ``np.argmax`` per window, vectorised."""
    top = np.maximum.reduceat(values, starts)
    hits = np.flatnonzero(values == np.repeat(top, ends - starts))
    window = np.searchsorted(starts, hits, side="right") - 1
    _, first = np.unique(window, return_index=True)
    return hits[first].astype(np.int64)


def timeline(a: Arrays, points: int = TIMELINE_POINTS) -> Timeline:
    n = len(a.total)
    if n == 0:
        return Timeline(index=(), series={k: () for k in BREAKDOWN_KEYS})
    if n <= points:
        idx = np.arange(n)
    else:
        edges = np.linspace(0, n, points, endpoint=False).astype(np.int64)
        edges = _distinct(edges)
        starts = edges
        ends = np.append(edges[1:], n)
        # within each window keep the event with the highest total (peaks survive decimation)
        idx = window_argmax(a.total, starts, ends)
    bucket = _BUCKET_OF_CATEGORY[a.cat]
    series = {}
    for b, key in enumerate(BREAKDOWN_KEYS):
        cum = np.cumsum(np.where(bucket == b, a.delta, 0))
        series[key] = tuple(int(v) for v in cum[idx])
    cuts = np.concatenate(([0], np.nonzero(np.diff(a.phase))[0] + 1, [n]))
    spans = [(int(s), int(e - 1), PHASES[int(a.phase[s])]) for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
    return Timeline(index=tuple(int(i) for i in idx), series=series, phases=tuple(spans))
