"""A trace's figures read from its event log (categories already resolved); torch-free, so that
a log written without tracing (:mod:`.nearby`) is summarised in a process that never imports torch."""

from __future__ import annotations

from collections.abc import Collection

from ..errors import TraceError
from ..events import PHASES, EventLog
from ..workload import Phase
from . import analysis
from .result import TraceResult


def summarize_resolved(log: EventLog, paths: Collection[str], *, params: int, trainable: int, flops: int | None,
                       notes: list[str] | tuple[str, ...]) -> TraceResult:
    """Every figure of a :class:`TraceResult` from a log whose categories are resolved
    (``paths``: the model's module paths, for per-module attribution)."""
    a = analysis.arrays(log)
    if len(log) == 0:
        raise TraceError("the trace recorded no memory at all", hint="does the model have parameters or inputs?")
    k = analysis.peak_of(a)
    known = paths if isinstance(paths, set) else set(paths)
    return TraceResult(
        events=log,
        peak_allocated=int(a.total[k]),
        peak_index=k,
        breakdown_at_peak=analysis.breakdown_at(a, k),
        peak_phase=Phase(PHASES[int(a.phase[k])]),
        peak_module=log.strings[log.module[k]],
        phases=analysis.phase_peaks(a),
        iterations=analysis.iteration_peaks(a),
        top_tensors=analysis.top_tensors(log, a, k),
        top_modules=analysis.top_modules(log, a, k, known),
        params=params,
        trainable_params=trainable,
        flops=flops,
        timeline=analysis.timeline(a),
        notes=tuple(notes),
        paths=frozenset(known),
    )


__all__ = ["summarize_resolved"]
