"""vramplan.snapshot: PyTorch memory snapshots — read safely, convert, compare with the simulator."""

from .reader import (
    SnapshotComparison,
    TraceCoverage,
    compare_with_recorded,
    is_snapshot,
    load_snapshot,
    loads_snapshot,
    snapshot_to_events,
    strip_frames,
    trace_completeness,
    trace_coverage,
)

__all__ = [
    "SnapshotComparison", "TraceCoverage", "compare_with_recorded", "is_snapshot", "load_snapshot",
    "loads_snapshot", "snapshot_to_events", "strip_frames", "trace_completeness", "trace_coverage",
]
