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

The same holds for the sequence length at a fixed batch, with two more conditions: the FLOPs
grow with ``seq²`` (attention), so they are the parabola through three traces, checked on a
fourth; and a size
rounded up to a multiple (an alignment, a chunk of tokens) is linear only across lengths of one
residue, so the four lengths must be congruent modulo :data:`SEQ_MODULUS` (128: the fit search's
steps and the lengths people ask for are multiples of it). Attention scores of eager attention
(``seq²``) are never collinear and are refused by the rule itself.

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
from fractions import Fraction

import numpy as np

from ..events import EventLog
from .result import TraceResult
from .summary import summarize_resolved

_DIGITS = re.compile(r"\d+")
"""Numbers of a dtype/shape text (``bf16[4,4096,4096]``: 16, 4, 4096, 4096)."""
NOTE_NUMBERS = re.compile(r"\d[\d,]*(?:\.\d+)?")
"""Numbers of a note (thousands separated by commas, as the notes print them)."""
SEQ_MODULUS = 128
"""Sequence lengths written from one another must be congruent modulo this: a size rounded up to
a multiple of any power of two up to 128 (an alignment, loss chunks of a token count) is then
linear in the length too, where between lengths of other residues it steps."""
_SAME = ("action", "id", "stream", "category", "phase", "iteration")


def _on_line(vals: Sequence[int], xs: Sequence[int], x: int) -> int | None:
    """The value at ``x`` of the line through every ``(xs[i], vals[i])``, or None (not
    collinear, or not an integer there)."""
    x0, x1, v0, v1 = xs[0], xs[1], vals[0], vals[1]
    if any((v - v0) * (x1 - x0) != (v1 - v0) * (xi - x0) for xi, v in zip(xs[2:], vals[2:], strict=True)):
        return None
    num = (v1 - v0) * (x - x0)
    if num % (x1 - x0):
        return None
    return v0 + num // (x1 - x0)


def _on_parabola(vals: Sequence[int], xs: Sequence[int], x: int) -> int | None:
    """The value at ``x`` of the parabola through the first three ``(xs[i], vals[i])``, checked on
    every further point, or None (no fourth point to check it, off it, or not an integer)."""
    if len(xs) < 4:
        return None

    def at(t: int) -> Fraction:
        total = Fraction(0)
        for i in range(3):
            term = Fraction(vals[i])
            for j in range(3):
                if j != i:
                    term *= Fraction(t - xs[j], xs[i] - xs[j])
            total += term
        return total

    if any(at(xi) != v for xi, v in zip(xs[3:], vals[3:], strict=True)):
        return None
    got = at(x)
    return int(got) if got.denominator == 1 else None


def text_on_line(texts: Sequence[str], xs: Sequence[int], x: int, pattern: re.Pattern[str]) -> str | None:
    """The texts (one per trace, at ``xs``) written at ``x``: equal but for numbers (``pattern``),
    each collinear along the axis and an integer at ``x`` (None where not; decimals must be
    equal). :mod:`.replicate` writes its notes with it too (layer copies 0, 1, 2)."""
    if all(t == texts[0] for t in texts):
        return texts[0]
    parts = [pattern.split(t) for t in texts]
    nums = [pattern.findall(t) for t in texts]
    if any(p != parts[0] for p in parts) or any(len(n) != len(nums[0]) for n in nums):
        return None
    out = [parts[0][0]]
    for i, column in enumerate(zip(*nums, strict=True)):
        if all(v == column[0] for v in column):
            out.append(column[0])
        else:
            if any("." in v for v in column):
                return None
            v = _on_line([int(t.replace(",", "")) for t in column], xs, x)
            if v is None:
                return None
            out.append(f"{v:,}" if any("," in t for t in column) else str(v))
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


def write_at(results: Sequence[TraceResult], xs: Sequence[int], x: int, axis: str = "batch") -> TraceResult | str:
    """The trace at ``x`` from the traces ``results`` at ``xs`` (three or more, increasing,
    ``xs[0] ≤ x ≤ xs[-1]``) of one axis (``batch``, or ``seq``: then every length congruent
    modulo :data:`SEQ_MODULUS`, and a fourth trace checks the FLOPs' parabola), or why it cannot
    be written (the caller then traces)."""
    n = len(results)
    if n < 3 or len(xs) != n or any(a >= b for a, b in zip(xs, xs[1:], strict=False)):
        return f"need three traces or more at increasing {axis} values"
    if not xs[0] <= x <= xs[-1]:
        return f"{axis} {x} is outside the traced {xs[0]}..{xs[-1]}"
    if axis == "seq" and len({v % SEQ_MODULUS for v in (*xs, x)}) != 1:
        return f"the lengths are not congruent modulo {SEQ_MODULUS}"
    logs = [r.events for r in results]
    m = len(logs[0])
    if any(len(g) != m for g in logs):
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
    # sizes: collinear event by event (at every point), integer at x
    s = [_column(g, "size").astype(np.int64) for g in logs]
    d1 = s[1] - s[0]
    for k in range(2, n):
        if not np.array_equal((s[k] - s[0]) * (xs[1] - xs[0]), d1 * (xs[k] - xs[0])):
            return f"a size is not linear in the {axis}"
    num = d1 * (x - xs[0])
    if np.any(num % (xs[1] - xs[0])):
        return f"a size is not an integer at this {axis}"
    size = s[0] + num // (xs[1] - xs[0])
    if np.any(size < 0):
        return f"a size is negative at this {axis}"
    # dtype/shape texts: each distinct combination written once
    uniq, inverse = _combinations([_column(g, "desc").astype(np.int64) for g in logs])
    out = EventLog()
    out.strings = list(logs[0].strings)
    out._index = {t: i for i, t in enumerate(out.strings)}
    desc_of = np.empty(len(uniq), np.int64)
    for k, ids in enumerate(uniq.tolist()):
        t = text_on_line([g.strings[i] for g, i in zip(logs, ids, strict=True)], xs, x, _DIGITS)
        if t is None:
            return f"the shape {logs[0].strings[ids[0]]!r} is not linear in the {axis}"
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
        counted = [int(f) for f in flops if f is not None]
        total_flops = _on_line(counted, xs, x)
        if total_flops is None and axis == "seq":  # (attention's FLOPs grow with seq²: checked on a fourth trace)
            total_flops = _on_parabola(counted, xs, x)
        if total_flops is None:
            return f"FLOPs are not linear in the {axis}"
    if len({len(r.notes) for r in results}) != 1:
        return "the notes differ"
    notes = []
    for texts in zip(*(r.notes for r in results), strict=True):  # (a text per trace)
        t = text_on_line(texts, xs, x, NOTE_NUMBERS)
        if t is None:
            return f"a note is not linear in the {axis}"
        notes.append(t)
    if len({tuple(name for name, _ in r.host_parts) for r in results}) != 1:
        return "the host-memory parts differ"
    host_parts = []
    for k, (name, _) in enumerate(results[0].host_parts):
        v = _on_line([r.host_parts[k][1] for r in results], xs, x)
        if v is None:
            return f"host memory is not linear in the {axis}"
        host_parts.append((name, v))
    got = summarize_resolved(out, results[0].paths, params=results[0].params,
                             trainable=results[0].trainable_params, flops=total_flops, notes=notes)
    if host_parts:
        got = dataclasses.replace(got, host_memory=sum(v for _, v in host_parts), host_parts=tuple(host_parts))
    return got


def _combinations(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of the stacked ``columns`` (one per log) and each event's row number:
    ``np.unique(..., axis=0, return_inverse=True)``, but by one column at a time on integers
    (a structured-row sort costs ~10x more on a 20,000-event log)."""
    code = columns[0]
    for col in columns[1:]:
        _, code = np.unique(code * (int(col.max(initial=0)) + 1) + col, return_inverse=True)
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    rows = np.stack([c[first] for c in columns], axis=1)
    return rows, np.asarray(inverse).reshape(-1)


def _array(typecode: str, values: np.ndarray) -> array:
    a = array(typecode)
    a.frombytes(np.ascontiguousarray(values, dtype={"q": np.int64, "i": np.int32}[typecode]).tobytes())
    return a


__all__ = ["write_at"]
