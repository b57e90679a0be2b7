"""Doc builder for a :class:`~vramplan.snapshot.analyze.SnapshotAnalysis` (``vramplan snapshot``)."""

from __future__ import annotations

from vramplan.report.doc import Doc, KeyValues, Notes, Table
from vramplan.snapshot.analyze import SnapshotAnalysis
from vramplan.snapshot.categorize import CATEGORIES
from vramplan.units import fmt_bytes

RULES_NOTE = (
    "categories are inferred from each block's stack frames and lifetime: optimizer-step frames → "
    "optimizer states (or temporaries when freed); backward frames → gradients when kept until "
    "zero_grad/the optimizer, else temporaries; torch/nn/modules or forward frames → activations when "
    "freed in backward, else temporaries; model build/load frames → weights; cache_utils → KV cache; "
    "no frames → unknown (see vramplan.snapshot.categorize)"
)


def _b(n: int) -> str:
    return fmt_bytes(n, "auto")


def _at(i: int) -> str:
    return "before the trace" if i < 0 else f"entry {i:,}"


def to_doc(a: SnapshotAnalysis, source: str = "") -> Doc:
    doc = Doc(
        title=f"vramplan snapshot: {source}" if source else "vramplan snapshot",
        subtitle=f"device {a.device} · {a.entries:,} trace entries · allocated = requested sizes rounded "
        "to 512 B, reserved = segments (exact) · binary units (GiB = 2^30 B)",
    )
    kv = [
        ("peak allocated", f"{_b(a.peak_allocated)} at {_at(a.peak_allocated_index)}"),
        ("peak reserved", f"{_b(a.peak_reserved)} at {_at(a.peak_reserved_index)}"),
        ("fragmentation at the reserved peak", f"{a.fragmentation_at_peak:.1%} of reserved is not allocated"),
        ("when the snapshot was taken", f"allocated {_b(a.end.allocated)} · active {_b(a.end.active)} · "
                                        f"reserved {_b(a.end.reserved)} in {a.end.segments} segments"),
    ]
    if a.start_allocated or a.start_reserved:
        kv.append(("before the first entry", f"allocated {_b(a.start_allocated)} · reserved {_b(a.start_reserved)}"))
    if a.simulated is not None:
        s = a.simulated
        if not s.complete:
            verdict = f"not comparable: {s.reason}"
        elif s.match:
            verdict = f"reproduces all {s.recorded_segment_events} segment events"
        else:
            verdict = (f"{s.matching_segment_events} of {s.recorded_segment_events} segment events match; "
                       f"first difference: {s.reason}")
        if s.complete and s.reserved_before:
            verdict += f" (trace complete except {_b(s.reserved_before)} reserved before recording)"
        kv.append(("vramplan's allocator replay", f"allocated {_b(s.allocated)} · reserved {_b(s.reserved)} · "
                                                  f"{verdict}"))
    doc.add(KeyValues(kv, title="Peaks"))
    total = sum(a.breakdown_at_peak.values())
    rows = [[c, _b(v), f"{100 * v / total:.1f} %" if total else "–"]
            for c in CATEGORIES if (v := a.breakdown_at_peak.get(c, 0))]
    doc.add(Table(["category (inferred)", "bytes", "share"], rows,
                  title="At the allocated peak", footer=["total", _b(total), "100 %" if total else "–"]))
    if a.sites_at_peak:
        doc.add(Table(["allocated at", "category", "bytes", "blocks"],
                      [[s.where, s.category, _b(s.bytes), f"{s.count:,}"] for s in a.sites_at_peak],
                      title="Where the peak's memory was allocated", align=["l", "l", "r", "r"]))
    if a.largest:
        doc.add(Table(
            ["size", "category", "allocated", "freed", "where"],
            [[_b(x.size), x.category, _at(x.alloc_index), "not freed" if x.free_index is None else _at(x.free_index),
              " ← ".join(x.where) or "<no frames>"] for x in a.largest],
            title="Largest allocations", align=["r", "l", "r", "r", "l"],
        ))
    if a.segments_at_peak:
        shown = len(a.segments_at_peak)
        more = f" (largest {shown} of {a.segments_at_peak_count})" if shown < a.segments_at_peak_count else ""
        streams = any(s.stream for s in a.segments_at_peak)
        doc.add(Table(
            ["address", "size", "allocated", "largest free", "blocks", *(["stream"] if streams else [])],
            [[hex(s.address), _b(s.size), _b(s.allocated), _b(s.largest_free), str(s.blocks),
              *([str(s.stream)] if streams else [])] for s in a.segments_at_peak],
            title=f"Segments at the reserved peak{more}",
        ))
    if a.ooms:
        doc.add(Table(
            ["entry", "requested", "CUDA free", "allocated", "reserved", "where"],
            [[f"{o.index:,}", _b(o.size), _b(o.device_free), _b(o.allocated), _b(o.reserved),
              " ← ".join(o.where) or "<no frames>"] for o in a.ooms],
            title="Out-of-memory events", align=["r", "r", "r", "r", "r", "l"],
        ))
    doc.add(Notes([*a.notes, RULES_NOTE]))
    return doc
