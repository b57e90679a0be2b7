"""vramplan.snapshot: PyTorch memory snapshots — read safely, convert, compare with the simulator."""

from .reader import (
    SnapshotComparison,
    compare_with_recorded,
    load_snapshot,
    snapshot_to_events,
    trace_completeness,
)

__all__ = [
    "SnapshotComparison", "compare_with_recorded", "load_snapshot", "snapshot_to_events",
    "trace_completeness",
]
