"""Doc builder for ``vramplan replay``: an event stream through the caching-allocator simulation."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramplan.units import fmt_bytes

from .doc import Doc, KeyValues, Notes

if TYPE_CHECKING:
    from vramplan.allocator.result import ReplayResult
    from vramplan.snapshot.reader import SnapshotComparison


def replay_json(path: Path, kind: str, conf: str, source: str, capacity: int | None, res: ReplayResult,
                cmp: SnapshotComparison | None) -> dict[str, Any]:
    """``vramplan replay --json``: the result's own dict with the inputs that made it."""
    obj: dict[str, Any] = {"file": str(path), "kind": kind, **res.to_dict(), "conf": conf,
                           "conf_source": source, "capacity": capacity}
    if cmp is not None:
        obj["comparison"] = cmp.to_dict()
    return obj


def replay_doc(path: Path, kind: str, conf: str, source: str, capacity: int | None, res: ReplayResult,
               cmp: SnapshotComparison | None) -> Doc:
    """The simulated allocator statistics, and for a snapshot the comparison with its recording."""

    def b(n: int) -> str:
        return f"{fmt_bytes(n, 'GiB', 3)} ({n:,} B)"

    doc = Doc(f"Allocator replay: {path.name}",
              subtitle=f"{kind}, {res.events:,} events, backend {res.backend}; GiB = 2^30 bytes")
    doc.add(KeyValues([
        ("conf", f"{conf or '(defaults)'}  [{source}]"),
        ("capacity", b(capacity) if capacity is not None else "unlimited"),
        ("max_allocated", b(res.max_allocated)),
        ("max_reserved", b(res.max_reserved)),
        ("max_active", b(res.max_active)),
        ("segments", f"{res.segments} at the reserved peak (max {res.max_segments})"),
        ("fragmentation_at_peak", f"{res.fragmentation_at_peak:.1%} (1 − allocated/reserved)"),
        ("alloc_retries", str(res.alloc_retries)),
        ("ooms", str(res.ooms) + (f" (first at event {res.oom_indices[0]})" if res.oom_indices else "")),
    ], title="Simulated"))
    if cmp is not None:
        items = [
            ("verdict", cmp.verdict),
            ("trace", cmp.coverage + (f" ({cmp.allocations_set_aside:,} allocations in those segments "
                                      "left out)" if cmp.reserved_before_recording else "")),
            ("segment events", f"{cmp.matching} of {cmp.recorded_segment_events} recorded match "
                               f"({cmp.simulated_segment_events} simulated)"),
            ("peak reserved", f"recorded {b(cmp.recorded_peak_reserved)}, predicted "
                              f"{b(cmp.simulated_peak_reserved)}"),
            ("final reserved", f"recorded {b(cmp.recorded_final_reserved)}, simulated "
                               f"{b(cmp.simulated_final_reserved)}"),
        ]
        items.append(("final layout", "identical, every block at its recorded address" if cmp.addresses_match
                      else "same blocks (sizes, states) in each segment" if cmp.layout_match else "differs"))
        if cmp.first_mismatch:
            items.append(("first mismatch", cmp.first_mismatch))
        doc.add(KeyValues(items, title="Compared with the recorded trace"))
    notes = list(res.notes) + ([n for n in cmp.notes if n not in res.notes] if cmp is not None else [])
    if notes:
        doc.add(Notes(notes))
    return doc
