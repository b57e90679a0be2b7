"""Ground truth: memory snapshots recorded on real GPUs (tests/data/snapshots/, sources in its
README and DATA_SOURCES.md) must replay exactly — every recorded segment event, the reserved
peak, the final block layout and every block's address.

``RECORDED`` pins what each committed file records (read from the file, not from the
simulator), so that a fixture that changes or loses entries fails here too."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from vramplan.cli.main import main
from vramplan.snapshot import (
    compare_with_recorded,
    load_snapshot,
    trace_completeness,
    trace_coverage,
)
from vramplan.snapshot.reader import convert_trace, snapshot_conf

DATA = Path(__file__).parent / "data" / "snapshots"
NOT_SNAPSHOTS = {"README.md", "summary.json"}
FILES = sorted(p for p in DATA.iterdir() if p.is_file() and p.name not in NOT_SNAPSHOTS)
SUMMARY = json.loads((DATA / "summary.json").read_text()) if (DATA / "summary.json").exists() else {}

RECORDED = {
    # file: (trace entries, segment events, reserved peak in bytes, final segments)
    "decomfl_memory.pickle.gz": (23_105, 61, 1_897_922_560, 61),
}
"""Recorded figures of the public snapshots (see tests/data/snapshots/README.md)."""


def test_public_snapshots_are_committed():
    assert {p.name for p in FILES} >= set(RECORDED), "a public snapshot fixture is missing"


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
    assert c.match and c.verdict == "exact match"
    assert c.addresses_match or c.conf and "expandable_segments:True" in c.conf
    if path.name in RECORDED:
        entries, seg_events, peak, segments = RECORDED[path.name]
        assert len(snap["device_traces"][0]) == entries
        assert c.recorded_segment_events == seg_events and c.recorded_peak_reserved == peak
        assert len(snap["segments"]) == segments
    workload = SUMMARY.get("workloads", {}).get(path.name.split(".")[0])
    if workload and "max_memory_reserved" in workload:
        assert c.simulated_peak_reserved == workload["max_memory_reserved"]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_block_lands_at_its_recorded_address(path):
    """Seeded with the recorded cudaMalloc addresses, the simulation places every block of the
    final state at the address PyTorch did (best fit by size, then address)."""
    from vramplan.allocator.replay import final_segments

    snap = load_snapshot(path)
    cfg, _ = snapshot_conf(snap)
    if cfg.expandable_segments:
        pytest.skip("expandable segments map pages at simulated addresses")
    tr = convert_trace(snap)
    plan = [(e.addr, e.size) for e in tr.segment_events if e.action == "segment_alloc"]
    sim = final_segments(tr.log, cfg, segment_addresses=plan)
    recorded = sorted((b["address"], b["size"], b["state"]) for s in snap["segments"] for b in s["blocks"])
    simulated = sorted((b.addr, b.size, b.state) for s in sim for b in s.blocks)
    assert simulated == recorded


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_json_twin_replays_like_the_pickle(path, tmp_path, capsys):
    """The same dict as JSON (what json.dump writes; tuples become lists) loads by content —
    under a misleading name — and replays to the same comparison, in the API and the CLI."""
    snap = load_snapshot(path)
    twin = tmp_path / "looks_like.pickle"
    twin.write_text(json.dumps(snap))
    loaded = load_snapshot(twin)
    assert json.loads(json.dumps(snap)) == loaded
    assert compare_with_recorded(loaded).to_dict() == compare_with_recorded(snap).to_dict()
    outs = []
    for f in (path, twin):
        assert main(["replay", str(f), "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["kind"] == "snapshot"
        d.pop("file")
        outs.append(d)
    assert outs[0] == outs[1]
    cmp = outs[0]["comparison"]
    assert cmp["matching"] == cmp["recorded_segment_events"] and cmp["match"]
    assert cmp["simulated_peak_reserved"] == cmp["recorded_peak_reserved"] == outs[0]["max_reserved"]


def test_replay_table_states_the_comparison(capsys):
    path = DATA / "decomfl_memory.pickle.gz"
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "exact match" in out and "61 of 61 recorded match (61 simulated)" in out
    assert "recorded 1.768 GiB (1,897,922,560 B), predicted 1.768 GiB (1,897,922,560 B)" in out
    assert main(["snapshot", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["simulated"]["match"] and d["simulated"]["recorded_segment_events"] == 61


def test_segment_reserved_before_recording_is_set_aside(capsys, tmp_path):
    """The DeComFL trace as if its first small-pool segment (2 MiB, trace entry 4) had been
    reserved before recording began: the 2,397 allocations that landed in it are left out and
    the rest still replays exactly — PyTorch picks the best fit over every free block, so a
    request that went to another segment had no better fit in that one."""
    snap = load_snapshot(DATA / "decomfl_memory.pickle.gz")
    assert snap["device_traces"][0][4]["action"] == "segment_alloc"
    assert snap["device_traces"][0][4]["size"] == 2 * 1024**2
    cut = copy.deepcopy(snap)
    del cut["device_traces"][0][4]
    cov = trace_coverage(cut)
    assert cov.complete and not cov.whole
    assert (cov.reserved_before, cov.segments_before, cov.allocations_set_aside) == (2_097_152, 1, 2_397)
    assert cov.describe().startswith("complete except 2,097,152 bytes reserved before recording")
    assert not trace_completeness(cut)[0]
    c = compare_with_recorded(cut)
    assert c.complete and c.match and c.layout_match and c.addresses_match
    assert c.reserved_before_recording == 2_097_152 and c.allocations_set_aside == 2_397
    assert c.matching == c.recorded_segment_events == 60
    assert c.recorded_peak_reserved == c.simulated_peak_reserved == 1_897_922_560 - 2_097_152
    assert c.verdict == "exact match on the rest"
    p = tmp_path / "cut.json"
    p.write_text(json.dumps(cut))
    assert main(["replay", str(p)]) == 0
    out = capsys.readouterr().out
    assert "complete except 2,097,152 bytes reserved before recording" in out
    assert "60 of 60 recorded match" in out and "every block at its recorded address" in out


def test_extra_untouched_segment_in_the_final_state(capsys):
    """Final segments holding more than the trace accounts for — an extra small-pool segment
    nobody allocated in during the trace — are reported, not called a mismatch."""
    snap = load_snapshot(DATA / "decomfl_memory.pickle.gz")
    extra = 2 * 1024**2
    free_addr = max(s["address"] + s["total_size"] for s in snap["segments"]) + 64 * extra
    snap["segments"].append({
        "device": 0, "address": free_addr, "total_size": extra, "allocated_size": 0, "active_size": 0,
        "requested_size": 0, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
        "is_expandable": False, "blocks": [{"address": free_addr, "size": extra, "requested_size": 0,
                                            "state": "inactive"}]})
    c = compare_with_recorded(snap)
    assert c.complete and c.match and c.layout_match and c.allocations_set_aside == 0
    assert c.reserved_before_recording == extra and c.coverage == f"complete except {extra:,} bytes reserved before recording"
    assert c.recorded_final_reserved == c.simulated_final_reserved == 1_897_922_560
