"""Ground truth: real snapshots recorded on a GPU (bench/record_snapshots.py) must replay
exactly — every recorded segment event, the reserved peak and the final block layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramplan.snapshot import compare_with_recorded, load_snapshot, trace_completeness

DATA = Path(__file__).parent / "data" / "snapshots"
FILES = sorted(p for p in DATA.glob("*.pickle*") if p.suffix in (".pickle", ".gz"))
SUMMARY = json.loads((DATA / "summary.json").read_text()) if (DATA / "summary.json").exists() else {}


@pytest.mark.skipif(not FILES, reason="no recorded snapshots in tests/data/snapshots "
                    "(run bench/record_snapshots.py on a GPU machine to add them)")
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_recorded_snapshot_replays_exactly(path):
    snap = load_snapshot(path)
    complete, why = trace_completeness(snap)
    assert complete, f"{path.name}: {why}"
    c = compare_with_recorded(snap)
    assert c.first_mismatch == "", f"{path.name}: {c.first_mismatch} (conf {c.conf!r})"
    assert c.matching == c.recorded_segment_events == c.simulated_segment_events
    assert c.simulated_peak_reserved == c.recorded_peak_reserved
    assert c.simulated_final_reserved == c.recorded_final_reserved
    assert c.layout_match, f"{path.name}: final block layout differs"
    assert c.match
    workload = SUMMARY.get("workloads", {}).get(path.name.split(".")[0])
    if workload and "max_memory_reserved" in workload:
        assert c.simulated_peak_reserved == workload["max_memory_reserved"]
