"""Snapshot reading: safety of the unpickler, structure checks, trace conversion, comparison.

The synthetic traces below are written by hand in PyTorch's format; their segment events are
derived from the allocator rules in the comments (not produced by the simulator under test).
"""

from __future__ import annotations

import copy
import gzip
import os
import pickle

import pytest

from vramplan.errors import SnapshotError
from vramplan.events import Action
from vramplan.snapshot import (
    compare_with_recorded,
    load_snapshot,
    snapshot_to_events,
    trace_completeness,
    trace_coverage,
)
from vramplan.snapshot.reader import convert_trace, loads_snapshot, snapshot_conf

MiB = 1024**2
S1, S2, S3 = 0x7F0000000000, 0x7F0000200000, 0x7F0001600000  # made-up cudaMalloc addresses


def e(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0,
            "frames": []}


def seg(addr, total, blocks, stream=0, kind="large"):
    return {"device": 0, "address": addr, "total_size": total, "stream": stream,
            "segment_type": kind, "allocated_size": 0, "active_size": 0, "requested_size": 0,
            "is_expandable": False, "frames": [],
            "blocks": [{"address": addr, "size": s, "requested_size": s, "state": st, "frames": []}
                       for s, st in blocks]}


def hand_trace():
    """A native-allocator trace, derived by hand:

    0 alloc A 1000 B        -> 1024 B, small pool: cudaMalloc 2 MiB (S1)
    1 alloc B 3 MiB         -> large < 10 MiB: cudaMalloc 20 MiB (S2), split 3 + 17
    2 alloc C 30 MiB        -> >= 10 MiB: cudaMalloc 30 MiB (S3)
    3 free B                -> merges back: S2 is one free 20 MiB block
    4 alloc D 10 MiB        -> best fit: S2 (20 MiB), remainder 10 MiB > 1 MiB: split
    5 free C                -> S3 free
    6 empty_cache()         -> cudaFree S3 only (S1, S2 are split by live blocks)
    7 free A, used on another stream -> free_requested now, free_completed later
    8 alloc F 700 B         -> A's block is still pending: F takes the next 1024 B of S1
    9 alloc E 500 B         -> process_events completes A first (free_completed is recorded
                               just before); E takes A's 1024 B block, smallest fit (no segment)
    reserved: 2, 22, 52 (peak), 22 MiB at the end.
    """
    trace = [
        e("segment_alloc", S1, 2 * MiB), e("alloc", S1, 1000),
        e("segment_alloc", S2, 20 * MiB), e("alloc", S2, 3 * MiB),
        e("segment_alloc", S3, 30 * MiB), e("alloc", S3, 30 * MiB),
        e("free_requested", S2, 3 * MiB), e("free_completed", S2, 3 * MiB),
        e("alloc", S2, 10 * MiB),
        e("free_requested", S3, 30 * MiB), e("free_completed", S3, 30 * MiB),
        e("segment_free", S3, 30 * MiB),
        e("free_requested", S1, 1000),
        e("alloc", S1 + 1024, 700),
        e("free_completed", S1, 1000), e("alloc", S1, 500),
    ]
    segments = [seg(S1, 2 * MiB, [(512, "active_allocated"), (512, "inactive"),
                                  (1024, "active_allocated"), (2 * MiB - 2048, "inactive")], kind="small"),
                seg(S2, 20 * MiB, [(10 * MiB, "active_allocated"), (10 * MiB, "inactive")])]
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": 2**64 - 1,
                                   "garbage_collection_threshold": 0.0,
                                   "expandable_segments": False,
                                   "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}},
            "external_annotations": []}


# ---------------------------------------------------------------------------- safety
class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creates the marker file if ever unpickled


def test_malicious_pickle_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = {"segments": [], "device_traces": [[]], "x": _Payload(marker)}
    for name, data in (("evil.pickle", pickle.dumps(evil)),
                       ("evil.pickle.gz", gzip.compress(pickle.dumps(evil)))):
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(SnapshotError, match="refusing to load global") as err:
            load_snapshot(p)
        assert "\n" not in str(err.value)
        assert not marker.exists()
    # sanity: the same payload does run under the ordinary unpickler
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()


def test_os_system_payload_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Cmd:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with pytest.raises(SnapshotError):
        loads_snapshot(pickle.dumps({"segments": [Cmd()]}))
    assert not marker.exists()


@pytest.mark.parametrize("obj,match", [
    (42, "not a dict"),
    ({"device_traces": []}, "no 'segments'"),
    ({"segments": [{"blocks": []}]}, "missing 'total_size'"),
    ({"segments": [{"total_size": 5, "blocks": [{"size": "x", "state": "inactive"}]}]}, "integer 'size'"),
    ({"segments": [], "device_traces": [[{"action": "explode"}]]}, "unknown action"),
    ({"segments": [], "device_traces": [[{"action": "alloc", "size": 5}]]}, "'addr'"),
    ({"segments": [], "device_traces": "no"}, "not a list"),
])
def test_bad_structure_is_one_line(obj, match):
    with pytest.raises(SnapshotError, match=match) as err:
        loads_snapshot(pickle.dumps(obj), "f.pickle")
    assert "\n" not in str(err.value)


def test_not_a_pickle(tmp_path):
    p = tmp_path / "x.pickle"
    p.write_bytes(b"hello world")
    with pytest.raises(SnapshotError, match="x.pickle"):
        load_snapshot(p)
    with pytest.raises(SnapshotError, match="cannot read"):
        load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(SnapshotError, match="gzip"):
        loads_snapshot(b"\x1f\x8b garbage")


def test_plain_and_gzip_roundtrip(tmp_path):
    snap = hand_trace()
    (tmp_path / "a.pickle").write_bytes(pickle.dumps(snap))
    (tmp_path / "a.pickle.gz").write_bytes(gzip.compress(pickle.dumps(snap)))
    assert load_snapshot(tmp_path / "a.pickle") == load_snapshot(tmp_path / "a.pickle.gz") == snap


def test_old_list_form_is_wrapped():
    snap = loads_snapshot(pickle.dumps([seg(S1, 2 * MiB, [(2 * MiB, "inactive")])]))
    assert snap["device_traces"] == [] and len(snap["segments"]) == 1


# ---------------------------------------------------------------------------- conversion
def test_trace_to_events():
    log = snapshot_to_events(hand_trace())
    acts = [Action(a) for a in log.action]
    assert acts == [Action.ALLOC, Action.ALLOC, Action.ALLOC, Action.FREE, Action.ALLOC,
                    Action.FREE, Action.EMPTY_CACHE, Action.FREE_DEFERRED, Action.ALLOC,
                    Action.FREE, Action.ALLOC]
    assert list(log.size)[:3] == [1000, 3 * MiB, 30 * MiB]  # requested sizes, as recorded
    tr = convert_trace(hand_trace())
    # the recorded segment events, stamped with the log event they belong to
    assert [(s.action, s.event_index) for s in tr.segment_events] == [
        ("segment_alloc", 0), ("segment_alloc", 1), ("segment_alloc", 2), ("segment_free", 6)]


def test_streams_are_renumbered_in_handle_order():
    snap = {"segments": [], "device_traces": [[
        e("segment_alloc", S1, 20 * MiB, stream=94_000_000_000), e("alloc", S1, 3 * MiB, stream=94_000_000_000),
        e("segment_alloc", S2, 20 * MiB, stream=0), e("alloc", S2, 3 * MiB, stream=0),
    ]]}
    tr = convert_trace(snap)
    assert tr.stream_ids == (0, 94_000_000_000)
    assert list(tr.log.stream) == [1, 0]


def test_completeness():
    snap = hand_trace()
    assert trace_completeness(snap) == (True, "")
    cut = copy.deepcopy(snap)
    cut["device_traces"][0] = cut["device_traces"][0][2:]  # the ring buffer lost S1 and A
    ok, why = trace_completeness(cut)
    assert not ok and "complete except 2,097,152 bytes reserved before recording" in why
    cov = trace_coverage(cut)
    assert cov.complete and not cov.whole
    assert (cov.reserved_before, cov.segments_before, cov.allocations_set_aside) == (2 * MiB, 1, 2)
    stray = copy.deepcopy(snap)
    stray["device_traces"][0].insert(2, e("alloc", 0x1000, 512))  # in no segment at all
    ok, why = trace_completeness(stray)
    assert not ok and "entry 2: alloc in a segment reserved before the trace began" in why
    assert not trace_coverage(stray).complete
    wrong = copy.deepcopy(snap)
    wrong["segments"].pop()
    ok, why = trace_completeness(wrong)
    assert not ok and "final segments" in why
    assert trace_completeness({"segments": [], "device_traces": []}) == (True, "")
    assert not trace_completeness({"segments": snap["segments"], "device_traces": []})[0]


# ---------------------------------------------------------------------------- comparison
def test_hand_trace_matches_the_simulator():
    c = compare_with_recorded(hand_trace())
    assert c.complete and c.match, c.first_mismatch
    assert (c.recorded_segment_events, c.matching) == (4, 4)
    assert c.recorded_peak_reserved == c.simulated_peak_reserved == 52 * MiB
    assert c.recorded_final_reserved == c.simulated_final_reserved == 22 * MiB
    assert c.conf == "" and "allocator_settings" in c.conf_source
    assert c.layout_match  # F after A's pending block, E split from A's block: as recorded
    moved = hand_trace()
    moved["segments"][0]["blocks"] = [{"size": 2 * MiB, "state": "inactive"}]
    assert not compare_with_recorded(moved).layout_match


def test_mismatch_is_located():
    snap = hand_trace()
    snap["device_traces"][0][2]["size"] = 22 * MiB  # pretend cudaMalloc'd 22 MiB for B
    snap["device_traces"][0][11]["size"] = 30 * MiB
    c = compare_with_recorded(snap)
    assert not c.match and c.first_mismatch_index == 1
    assert "segment_alloc 23,068,672 B" in c.first_mismatch
    assert c.matching == 3


def test_wrong_conf_mismatches():
    # with roundup_power2_divisions:2, C (30 MiB, in [16, 32) MiB) rounds to 32 MiB
    c = compare_with_recorded(hand_trace(), "roundup_power2_divisions:2")
    assert not c.match and c.first_mismatch_index == 2 and c.conf_source == "given"


def test_expandable_hand_trace():
    """expandable_segments:True, large pool pages of 20 MiB:

    alloc 3 MiB -> map page 0 (segment_map base, 20 MiB); alloc 30 MiB -> 17 MiB free at the
    end + map page 1 (segment_map base+20 MiB); free both -> one free block [0, 40 MiB);
    empty_cache -> unmap both pages in one segment_unmap of 40 MiB."""
    base = 0x7F4000000000
    trace = [e("segment_map", base, 20 * MiB), e("alloc", base, 3 * MiB),
             e("segment_map", base + 20 * MiB, 20 * MiB), e("alloc", base + 3 * MiB, 30 * MiB),
             e("free_requested", base, 3 * MiB), e("free_completed", base, 3 * MiB),
             e("free_requested", base + 3 * MiB, 30 * MiB), e("free_completed", base + 3 * MiB, 30 * MiB),
             e("segment_unmap", base, 40 * MiB)]
    snap = {"segments": [], "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    c = compare_with_recorded(snap)
    assert c.complete and c.match, c.first_mismatch
    assert c.recorded_peak_reserved == 40 * MiB and c.conf == "expandable_segments:True"
    # the same trace replayed without expandable segments does not match
    assert not compare_with_recorded(snap, "").match


def test_conf_from_settings_fields():
    snap = {"segments": [], "allocator_settings": {
        "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": 128 * MiB, "expandable_segments": True,
        "garbage_collection_threshold": 0.5,
        "roundup_power2_divisions": {"1": 4, "2": 4, "4": 0}}}
    conf, source = snapshot_conf(snap)
    assert conf.max_split_size == 128 * MiB and conf.expandable_segments
    assert conf.garbage_collection_threshold == 0.5 and conf.divisions(MiB) == 4
    assert source == "allocator_settings (fields)"
    conf, source = snapshot_conf({"segments": []})
    assert conf.text == "" and "defaults" in source
    # asked for expandable segments on a platform without them: PyTorch ignored the option
    conf, source = snapshot_conf({"segments": [], "allocator_settings": {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "expandable_segments": False}})
    assert not conf.expandable_segments and "unsupported" in source


def test_oom_entries_have_no_event():
    snap = hand_trace()
    snap["device_traces"][0].insert(9, {"action": "oom", "device_free": 5, "size": 80 * MiB,
                                        "stream": 0, "time_us": 0, "frames": []})
    tr = convert_trace(snap)
    assert tr.ooms == 1 and len(tr.log) == len(snapshot_to_events(hand_trace()))


def test_capacity_leaves_out_memory_reserved_before_recording():
    """Recording began after S1 (2 MiB) was reserved: of a 52 MiB device the rest may use 50."""
    cut = hand_trace()
    cut["device_traces"][0] = cut["device_traces"][0][2:]
    c = compare_with_recorded(cut, capacity=52 * MiB)
    assert c.complete and c.match and c.result.ooms == 0  # S2 + S3 = 50 MiB fit in 50
    assert any("less the 2,097,152 bytes reserved before recording" in n for n in c.notes)
    c = compare_with_recorded(cut, capacity=51 * MiB)  # 49 MiB for the rest: S3 does not fit
    assert c.result.ooms == 1 and not c.match
