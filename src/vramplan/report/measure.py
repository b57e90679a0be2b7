"""Doc builder for a :class:`~vramplan.measure.record.MeasureRecord` (``vramplan measure``)."""

from __future__ import annotations

from vramplan.measure.record import METRICS, MeasureRecord
from vramplan.report.doc import Doc, KeyValues, Notes, Table
from vramplan.units import fmt_bytes

_WHAT = {
    "allocated": "allocated (max_memory_allocated)",
    "reserved": "reserved (max_memory_reserved)",
    "device_used": "device used (NVML − baseline)",
}


def _b(n: int | None) -> str:
    return "n/a" if n is None else fmt_bytes(n, "GiB", 3)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def to_doc(rec: MeasureRecord) -> Doc:
    m, env = rec.measured, rec.env
    w = rec.workload
    doc = Doc(
        title=f"vramplan measure: {rec.model} on {env.gpu_name or 'no GPU'}",
        subtitle=f"task {w.task} · batch {w.batch} · seq {w.seq} · {w.precision} · "
        + (f"{w.optimizer} ({w.optimizer_impl}) · checkpointing {w.checkpointing} · " if w.training else "")
        + (f"{w.peft} r={w.lora_rank} · " if str(w.peft) != "none" else "")
        + "GiB = 2^30 B · error = (predicted − measured) / measured",
    )
    errs = rec.errors()
    preds = [p for p in rec.predicted if p.ok]
    cols = ["metric", "measured"]
    for p in preds:
        cols += [p.method, "error"]
    rows = []
    for k in METRICS:
        row = [_WHAT[k], _b(getattr(m, k)) if m is not None else "n/a"]
        for p in preds:
            row += [_b(getattr(p, k)), _pct(errs.get(p.method, {}).get(k))]
        rows.append(row)
    doc.add(Table(cols, rows, title="Peak memory"))
    kv: list[tuple[str, str]] = []
    if m is not None:
        if m.oom:
            kv.append(("result", "CUDA OUT OF MEMORY (peaks are those reached before it)"))
        if m.step_time_s is not None:
            kv.append(("step time", f"{m.step_time_s * 1000:,.1f} ms median of {m.iterations} "
                                    f"(after {m.warmup} warm-up)"))
        kv.append(("CUDA context", _b(m.context)))
        kv.append(("other processes (baseline)", _b(m.device_used_baseline)))
        kv.append(("active / requested peaks", f"{_b(m.active)} / {_b(m.requested)}"))
        if m.alloc_retries or m.ooms:
            kv.append(("allocator", f"{m.alloc_retries} retries, {m.ooms} OOMs"))
        if m.snapshot:
            kv.append(("snapshot", f"{m.snapshot} (open at pytorch.org/memory_viz, or `vramplan snapshot`)"))
    kv.append(("environment", f"driver {env.driver or '?'} · CUDA {env.cuda or '?'} · torch {env.torch or '?'} · "
                              f"transformers {env.transformers or '?'} · vramplan {env.vramplan or '?'}"))
    doc.add(KeyValues(kv))
    notes = [f"{p.method}: no prediction ({p.error})" for p in rec.predicted if not p.ok]
    notes += [f"{p.method} prediction took {p.seconds:.1f} s (peak in {p.peak_phase})" for p in preds]
    if rec.failure:
        notes.append(f"measurement failed: {rec.failure}")
    doc.add(Notes(notes))
    return doc
