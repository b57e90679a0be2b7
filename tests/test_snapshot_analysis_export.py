"""Predicted snapshots (vramplan.snapshot.export) open in PyTorch's viewers and say what the
allocator simulation says."""

from __future__ import annotations

import io
import pickle
import pickletools

import pytest
import torch.cuda._memory_viz as viz

from show_fixtures import MiB, training_log
from vramplan.allocator import replay
from vramplan.errors import VramplanError
from vramplan.events import Category, EventLog
from vramplan.snapshot.analyze import analyze
from vramplan.snapshot.export import predicted_snapshot, write_predicted_snapshot

# Opcodes that the JavaScript unpickler of pytorch.org/memory_viz (MemoryViz.js) reads.
JS_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "APPEND", "APPENDS", "LIST", "TUPLE", "EMPTY_TUPLE", "TUPLE1",
    "TUPLE2", "TUPLE3", "EMPTY_DICT", "EMPTY_LIST", "DICT", "SETITEM", "SETITEMS", "NEWTRUE",
    "NEWFALSE", "NONE", "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE",
    "BINUNICODE", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "predicted.pickle"
    log = training_log()
    write_predicted_snapshot(log, path)
    return log, path, path.read_bytes()


def test_pickle_uses_only_opcodes_the_browser_viewer_reads(written):
    _, _, data = written
    used = {op.name for op, _arg, _pos in pickletools.genops(io.BytesIO(data))}
    assert used <= JS_OPCODES, used - JS_OPCODES
    assert data[1] == 4  # protocol 4


def test_torch_memory_viz_renders_it(written):
    _, _, data = written
    snap = pickle.loads(data)
    text = viz.segsum(snap)  # asserts its own byte accounting
    assert "total_reserved" in text
    assert "cudaMalloc" in viz.trace(snap)
    for html in (viz.trace_plot(snap), viz.trace_plot(snap, plot_segments=True), viz.segment_plot(snap)):
        assert "add_local_files" in html and len(html) > 1000
    lines = viz.segments(snap, format_flamegraph=lambda s: s)
    assert "exp_avg" in lines  # blocks carry their frames
    assert viz.memory(snap, format_flamegraph=lambda s: s)


def test_entries_name_module_category_and_phase(written):
    log, _, data = written
    snap = pickle.loads(data)
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    assert len(allocs) == sum(1 for a in log.action if a == 0)
    first = allocs[0]
    assert first["frames"][0] == {"filename": "model.embed", "line": 0, "name": "parameter: init f32[10485760]"}
    assert first["frames"][1]["name"] == "phase: setup"
    assert first["category"] == "weights"
    cats = {e.get("category") for e in snap["device_traces"][0]}
    # the viewer's legend code breaks unless 'unknown' is among the categories
    assert "unknown" in cats and {"weights", "activations", "optimizer"} <= cats


def _viewer_walk(snap):
    """PyTorch's viewer (MemoryViz.js: annotate_snapshot + MemoryView.simulate_memory), in
    Python: walk back from the end state to before the first entry and check at each step
    that the state the viewer would draw is consistent (it crashes otherwise)."""
    entries = []
    for t in snap["device_traces"][0]:
        prev = entries[-1] if entries else None
        if t["action"] == "free_completed" and prev and prev["action"] == "free_requested" and prev["addr"] == t["addr"]:
            entries[-1] = {**prev, "action": "free"}
            continue
        entries.append(t)
    segs = sorted([s["address"], s["total_size"], s["stream"]] for s in snap["segments"] if s["device"] == 0)
    blocks = {}
    for s in snap["segments"]:
        addr = s["address"]
        for b in s["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["requested_size"]
            addr += b["size"]

    def check():
        for addr in blocks:
            assert any(a <= addr < a + n for a, n, _ in segs), f"block {addr:#x} outside every segment"

    check()
    for e in reversed(entries):
        act, addr, size = e["action"], e.get("addr"), e.get("size")
        if act in ("free", "free_completed"):
            blocks[addr] = size
        elif act == "free_requested":
            assert addr in blocks, "free_requested of a block the viewer does not know"
        elif act == "alloc":
            assert blocks.pop(addr, None) is not None, "alloc of a block that is not live"
        elif act == "segment_free":
            segs.append([addr, size, e["stream"]])
        elif act == "segment_alloc":
            hit = [s for s in segs if s[0] == addr]
            assert hit, "segment_alloc of a segment that is not there"
            segs.remove(hit[0])
        elif act == "segment_unmap":  # walking back: map it again, merging with neighbours
            segs.append([addr, size, e["stream"]])
            segs.sort()
            merged = []
            for s in segs:
                if merged and merged[-1][0] + merged[-1][1] == s[0] and merged[-1][2] == s[2]:
                    merged[-1][1] += s[1]
                else:
                    merged.append(list(s))
            segs[:] = merged
        elif act == "segment_map":  # walking back: unmap it from the range holding it
            hold = [s for s in segs if s[0] <= addr and addr + size <= s[0] + s[1]]
            assert hold, "segment_map of a range that is not mapped"
            a, n, st = hold[0]
            segs.remove(hold[0])
            if addr > a:
                segs.append([a, addr - a, st])
            if addr + size < a + n:
                segs.append([addr + size, a + n - addr - size, st])
        segs.sort()
        check()
    assert not blocks and not segs, "the trace does not start from an empty device"


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:30"])
def test_viewer_can_walk_the_whole_trace(conf):
    _viewer_walk(predicted_snapshot(training_log(), conf=conf))


def test_expandable_segments_use_map_events():
    snap = predicted_snapshot(training_log(), conf="expandable_segments:True")
    actions = {e["action"] for e in snap["device_traces"][0]}
    assert "segment_map" in actions and "segment_alloc" not in actions
    assert all(s["is_expandable"] for s in snap["segments"])
    assert snap["allocator_settings"]["expandable_segments"] is True


def test_snapshot_and_replay_agree():
    log = training_log()
    res = replay(log)
    a = analyze(predicted_snapshot(log), simulate=False)
    assert a.peak_reserved == res.max_reserved
    assert a.peak_allocated == res.max_allocated  # sizes here round to whole blocks
    assert a.end.reserved == res.final_reserved
    assert a.breakdown_at_peak["optimizer"] == 86 * MiB
    assert set(a.rules) == {"vp"}  # every block's category comes from vramplan's frames


def test_unsplit_remainders_are_not_in_a_trace():
    """A 43 MiB request gets a 44 MiB segment whose 1 MiB remainder is too small to split: the
    block counts 44 MiB in max_memory_allocated, but a trace records only the 43 MiB asked."""
    log = training_log(foreach_temp=43 * MiB)
    a = analyze(predicted_snapshot(log), simulate=False)
    assert replay(log).max_allocated - a.peak_allocated == MiB


def test_out_of_memory_entries():
    log = EventLog()
    log.alloc(1, 30 * MiB, category=Category.PARAMETER)
    log.alloc(2, 50 * MiB, category=Category.ACTIVATION)  # does not fit in 64 MiB
    log.free(1)
    snap = predicted_snapshot(log, capacity=64 * MiB)
    ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["size"] == 50 * MiB
    assert ooms[0]["device_free"] == 64 * MiB - 30 * MiB
    assert "raise OutOfMemoryError" in viz.trace(snap)
    assert len(analyze(snap).ooms) == 1


def test_report_provenance_and_bad_inputs(tmp_path):
    from show_fixtures import fake_report

    snap = predicted_snapshot(training_log(1), report=fake_report())
    assert snap["vramplan"]["predicted"] is True and snap["vramplan"]["model"] == "toy-1b"
    with pytest.raises(VramplanError, match="cudaMallocAsync"):
        predicted_snapshot(training_log(1), conf="backend:cudaMallocAsync")
    with pytest.raises(VramplanError, match="does not exist"):
        write_predicted_snapshot(training_log(1), tmp_path / "missing" / "x.pickle")
    bad = EventLog()
    bad.free(7)
    with pytest.raises(VramplanError, match="not allocated"):
        predicted_snapshot(bad)


@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
def test_reader_replays_a_predicted_snapshot_exactly(conf):
    """The reader turns the exported trace back into events; replaying them reproduces every
    segment event the export wrote (export and reader agree on the format)."""
    sim = analyze(predicted_snapshot(training_log(), conf=conf)).simulated
    assert sim is not None and sim.complete and sim.match, sim
