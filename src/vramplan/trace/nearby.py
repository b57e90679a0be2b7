"""The trace at one batch written from traces at three others, where they prove how it varies.

``fit``, ``plan``, the estimate's largest-batch search and the web page ask one model many
questions that differ only in the batch: each used to trace again. A transformer step's event
log does not change shape with the batch — the same ops allocate and free the same storages in
the same order — and every requested size is a polynomial of low degree in it (``batch × seq ×
hidden × bytes``; attention scores ``batch × heads × seq²``): at most quadratic. Three traces
at batches ``x0 < x1 < x2`` therefore decide the log at any ``x`` between them when

1. the three logs are equal but for the sizes and the numbers in the dtype/shape texts (every
   action, id, stream, category, phase, iteration, module and op the same, event for event);
2. every size (and every number of a shape text, of a note, the FLOPs and the host-memory
   parts) takes collinear values at ``x0, x1, x2``: a polynomial of degree ≤ 2 through three
   collinear points is the line through them, so the value at ``x`` is on that line (and must
   be an integer);
3. ``x0 ≤ x ≤ x2``: a count that steps with the batch (loss chunks, a kernel chosen by size) is
   monotone, so equal at both ends means equal between them — outside them it may not be.

Where any of it does not hold, :func:`write_at` says why and the caller traces. The parameter
counts and module paths must be equal. The result is summarised exactly as a trace is
(:func:`.summary.summarize_resolved`); ``tests/test_trace_nearby.py`` compares it with a fresh
trace at the same batch on every figure.
"""

from __future__ import annotations

import dataclasses
import re
from array import array
from collections.abc import Sequence

import numpy as np

from ..events import EventLog
from .result import TraceResult
from .summary import summarize_resolved

_DIGITS = re.compile(r"\d+")
"""Numbers of a dtype/shape text (``bf16[4,4096,4096]``: 16, 4, 4096, 4096)."""
_NUM = re.compile(r"\d[\d,]*(?:\.\d+)?")
"""Numbers of a note (thousands separated by commas, as the notes print them)."""
_SAME = ("action", "id", "stream", "category", "phase", "iteration")


def _on_line(vals: Sequence[int], xs: Sequence[int], x: int) -> int | None:
    """The value at ``x`` of the line through ``(xs[i], vals[i])``, or None (not collinear,
    or not an integer there)."""
    (x0, x1, x2), (v0, v1, v2) = xs, vals
    if (v1 - v0) * (x2 - x0) != (v2 - v0) * (x1 - x0):
        return None
    num = (v1 - v0) * (x - x0)
    if num % (x1 - x0):
        return None
    return v0 + num // (x1 - x0)


def _text(texts: Sequence[str], xs: Sequence[int], x: int, pattern: re.Pattern[str]) -> str | None:
    """A text whose numbers are collinear in the batch, written at ``x`` (None where not)."""
    if texts[0] == texts[1] == texts[2]:
        return texts[0]
    parts = [pattern.split(t) for t in texts]
    nums = [pattern.findall(t) for t in texts]
    if not (parts[0] == parts[1] == parts[2]) or not (len(nums[0]) == len(nums[1]) == len(nums[2])):
        return None
    out = [parts[0][0]]
    for i, trio in enumerate(zip(*nums, strict=True)):
        if trio[0] == trio[1] == trio[2]:
            out.append(trio[0])
        else:
            if any("." in v for v in trio):
                return None
            v = _on_line([int(t.replace(",", "")) for t in trio], xs, x)
            if v is None or v < 0:
                return None
            out.append(f"{v:,}" if any("," in t for t in trio) else str(v))
        out.append(parts[0][i + 1])
    return "".join(out)


def _column(log: EventLog, name: str) -> np.ndarray:
    return np.frombuffer(getattr(log, name), dtype=getattr(log, name).typecode)


def _strings_equal(logs: Sequence[EventLog], name: str) -> bool:
    """The ``module``/``op`` column names the same string in each log, event for event."""
    first = logs[0]
    a = np.asarray(first.strings, dtype=object)[_column(first, name)]
    for log in logs[1:]:
        if log.strings == first.strings and getattr(log, name) == getattr(first, name):
            continue
        b = np.asarray(log.strings, dtype=object)[_column(log, name)]
        if not np.array_equal(a, b):
            return False
    return True


def write_at(results: Sequence[TraceResult], xs: Sequence[int], x: int) -> TraceResult | str:
    """The trace at batch ``x`` from the traces ``results`` at batches ``xs`` (three, increasing,
    ``xs[0] ≤ x ≤ xs[2]``), or why it cannot be written (the caller then traces)."""
    if len(results) != 3 or len(xs) != 3 or not xs[0] < xs[1] < xs[2]:
        return "need three traces at increasing batches"
    if not xs[0] <= x <= xs[2]:
        return f"batch {x} is outside the traced {xs[0]}..{xs[2]}"
    logs = [r.events for r in results]
    n = len(logs[0])
    if any(len(g) != n for g in logs):
        return "the logs differ in length"
    for name in _SAME:
        col = getattr(logs[0], name)
        if any(getattr(g, name) != col for g in logs[1:]):
            return f"the logs differ in {name}"
    for name in ("module", "op"):
        if not _strings_equal(logs, name):
            return f"the logs differ in {name}"
    if any(r.paths != results[0].paths for r in results[1:]):
        return "the module paths differ"
    for attr in ("params", "trainable_params"):
        if len({getattr(r, attr) for r in results}) != 1:
            return f"{attr} differ"
    # sizes: collinear event by event, integer at x
    s = [_column(g, "size").astype(np.int64) for g in logs]
    d1, d2 = s[1] - s[0], s[2] - s[0]
    if not np.array_equal(d1 * (xs[2] - xs[0]), d2 * (xs[1] - xs[0])):
        return "a size is not linear in the batch"
    num = d1 * (x - xs[0])
    if np.any(num % (xs[1] - xs[0])):
        return "a size is not an integer at this batch"
    size = s[0] + num // (xs[1] - xs[0])
    if np.any(size < 0):
        return "a size is negative at this batch"
    # dtype/shape texts: each distinct trio written once
    trio = np.stack([_column(g, "desc").astype(np.int64) for g in logs], axis=1)
    uniq, inverse = np.unique(trio, axis=0, return_inverse=True)
    out = EventLog()
    out.strings = list(logs[0].strings)
    out._index = {t: i for i, t in enumerate(out.strings)}
    desc_of = np.empty(len(uniq), np.int64)
    for k, (a, b, c) in enumerate(uniq.tolist()):
        t = _text((logs[0].strings[a], logs[1].strings[b], logs[2].strings[c]), xs, x, _DIGITS)
        if t is None:
            return f"the shape {logs[0].strings[a]!r} is not linear in the batch"
        desc_of[k] = out.intern(t)
    for name in ("action", "id", "stream", "category", "phase", "iteration", "module", "op"):
        col = getattr(logs[0], name)
        setattr(out, name, array(col.typecode, col))
    out.size = _array("q", size)
    out.desc = _array("i", desc_of[np.asarray(inverse).reshape(-1)])
    # the figures beside the log
    flops = [r.flops for r in results]
    if all(f is None for f in flops):
        total_flops = None
    elif any(f is None for f in flops):
        return "FLOPs counted in some traces only"
    else:
        total_flops = _on_line([int(f) for f in flops if f is not None], xs, x)
        if total_flops is None:
            return "FLOPs are not linear in the batch"
    if len({len(r.notes) for r in results}) != 1:
        return "the notes differ"
    notes = []
    for texts in zip(*(r.notes for r in results), strict=True):
        t = _text(texts, xs, x, _NUM)
        if t is None:
            return "a note is not linear in the batch"
        notes.append(t)
    if len({tuple(name for name, _ in r.host_parts) for r in results}) != 1:
        return "the host-memory parts differ"
    host_parts = []
    for k, (name, _) in enumerate(results[0].host_parts):
        v = _on_line([r.host_parts[k][1] for r in results], xs, x)
        if v is None:
            return "host memory is not linear in the batch"
        host_parts.append((name, v))
    got = summarize_resolved(out, results[0].paths, params=results[0].params,
                             trainable=results[0].trainable_params, flops=total_flops, notes=notes)
    if host_parts:
        got = dataclasses.replace(got, host_memory=sum(v for _, v in host_parts), host_parts=tuple(host_parts))
    return got


def _array(typecode: str, values: np.ndarray) -> array:
    a = array(typecode)
    a.frombytes(np.ascontiguousarray(values, dtype={"q": np.int64, "i": np.int32}[typecode]).tobytes())
    return a


__all__ = ["write_at"]
