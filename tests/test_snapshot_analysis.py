"""vramplan.snapshot.analyze / categorize on hand-made snapshots whose answers are known."""

from __future__ import annotations

import copy

import pytest

from show_fixtures import BWD, FWD, SEG, W_FRAMES, GiB, MiB, frames, recorded_snapshot
from vramplan.errors import SnapshotError
from vramplan.snapshot.analyze import analyze
from vramplan.snapshot.categorize import categorize, user_frames


def test_peaks_and_end_state():
    a = analyze(recorded_snapshot())
    assert a.entries == 9
    assert a.peak_allocated == 14 * MiB  # 4 + 8 + (2 MiB − 100 rounded up to 512 B)
    assert a.peak_allocated_index == 3
    assert a.peak_reserved == 20 * MiB
    # ties at the reserved peak go to the instant with the most allocated
    assert a.peak_reserved_index == 3
    assert a.fragmentation_at_peak == pytest.approx(1 - 14 / 20)
    assert (a.end.allocated, a.end.reserved, a.end.segments) == (4 * MiB, 20 * MiB, 1)
    assert (a.start_allocated, a.start_reserved) == (0, 0)


def test_categories_at_peak_sum_to_peak():
    a = analyze(recorded_snapshot())
    assert a.breakdown_at_peak["weights"] == 4 * MiB
    assert a.breakdown_at_peak["activations"] == 8 * MiB  # freed in backward
    assert a.breakdown_at_peak["temporaries"] == 2 * MiB  # freed in forward
    assert sum(a.breakdown_at_peak.values()) == a.peak_allocated
    assert dict(a.rules) == {"fwd": 2, "init": 1}


def test_timeline_series_sum_to_allocated():
    tl = analyze(recorded_snapshot()).timeline
    assert tl.index[0] == -1 and len(tl.index) == 10
    for k in range(len(tl.index)):
        assert sum(v[k] for v in tl.by_category.values()) == tl.allocated[k]
        assert tl.reserved[k] >= tl.allocated[k]
    assert tl.fragmentation[4] == pytest.approx(0.3)


def test_largest_sites_segments_and_oom():
    a = analyze(recorded_snapshot(), top=2)
    assert [x.size for x in a.largest] == [8 * MiB, 4 * MiB]
    assert a.largest[0].where == ("model.py:1:forward",)  # torch frames filtered out
    assert a.largest[1].free_index is None
    assert a.sites_at_peak[0].where == "model.py:1:forward" and a.sites_at_peak[0].bytes == 8 * MiB
    seg = a.segments_at_peak[0]
    assert (seg.address, seg.size, seg.allocated, seg.blocks) == (SEG, 20 * MiB, 14 * MiB, 3)
    assert seg.largest_free == 6 * MiB
    (oom,) = a.ooms
    assert (oom.index, oom.size, oom.device_free) == (8, 100 * GiB, GiB)
    assert oom.allocated == 4 * MiB and oom.reserved == 20 * MiB
    assert any("out-of-memory" in n for n in a.notes)


def test_truncated_trace_is_anchored_on_the_end_state():
    """Drop the first two entries (as a max_entries ring buffer would): the weights block and
    its segment predate the trace, and the absolute peaks stay right."""
    snap = recorded_snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][2:]
    a = analyze(snap)
    assert (a.start_allocated, a.start_reserved) == (4 * MiB, 20 * MiB)
    assert a.peak_allocated == 14 * MiB and a.peak_reserved == 20 * MiB
    assert a.breakdown_at_peak["weights"] == 4 * MiB  # its frames survive in the end state
    assert any("before the first trace entry" in n for n in a.notes)


def test_segments_at_peak_undo_later_segment_events():
    """A 30 MiB segment allocated then released after the last block event: absent from the
    end state, yet present at the reserved peak."""
    snap = recorded_snapshot()
    extra = SEG + 64 * MiB
    tr = snap["device_traces"][0]
    tr.append({"action": "segment_alloc", "addr": extra, "size": 30 * MiB, "stream": 0, "frames": []})
    tr.append({"action": "segment_free", "addr": extra, "size": 30 * MiB, "stream": 0, "frames": []})
    a = analyze(snap)
    assert a.peak_reserved == 50 * MiB and a.peak_reserved_index == 9
    assert [(s.address, s.size) for s in a.segments_at_peak] == [(extra, 30 * MiB), (SEG, 20 * MiB)]
    assert a.segments_at_peak[0].allocated == 0 and a.segments_at_peak[1].allocated == 4 * MiB
    assert a.end.segments == 1 and a.start_reserved == 0


def test_snapshot_without_history_reports_the_end_state():
    snap = recorded_snapshot()
    snap["device_traces"] = [[]]
    a = analyze(snap)
    assert a.entries == 0
    assert a.peak_allocated == 4 * MiB and a.peak_reserved == 20 * MiB
    assert any("no allocation history" in n for n in a.notes)


def test_device_choice():
    snap = recorded_snapshot()
    snap["device_traces"] = [[], snap["device_traces"][0]]
    for s in snap["segments"]:
        s["device"] = 1
    assert analyze(snap).device == 1
    with pytest.raises(SnapshotError, match="no data for device 0"):
        analyze(snap, device=0)


@pytest.mark.parametrize("bad", [None, [], {"segments": "x"}, {"segments": [], "device_traces": [5]}])
def test_malformed_input_is_a_snapshot_error(bad):
    if bad == []:  # the legacy segments-only list is accepted
        assert analyze(bad).entries == 0
        return
    with pytest.raises(SnapshotError):
        analyze(bad)


def test_missing_size_is_a_snapshot_error():
    snap = copy.deepcopy(recorded_snapshot())
    del snap["device_traces"][0][1]["size"]
    with pytest.raises(SnapshotError, match="size"):
        analyze(snap)


# --------------------------------------------------------------------------- categorize rules
OPT = frames(("/x/torch/optim/adamw.py", "_multi_tensor_adamw"), ("train.py", "main"))
ZERO = frames(("/x/torch/optim/optimizer.py", "zero_grad"))


@pytest.mark.parametrize(("alloc", "free", "alive", "want"), [
    (OPT, None, True, ("optimizer", "opt")),
    (OPT, OPT, False, ("temporaries", "opt")),
    (BWD, ZERO, False, ("gradients", "bwd")),
    (BWD, None, True, ("gradients", "bwd")),
    (BWD, BWD, False, ("temporaries", "bwd")),
    (FWD, BWD, False, ("activations", "fwd")),
    (FWD, FWD, False, ("temporaries", "fwd")),
    (W_FRAMES, None, True, ("weights", "init")),
    (frames(("/x/transformers/cache_utils.py", "update")), None, True, ("kv_cache", "kv")),
    (frames(("/x/torch/utils/checkpoint.py", "recompute_fn")) + BWD, BWD, False, ("activations", "ckpt")),
    ([], None, True, ("unknown", "none")),
    (frames(("script.py", "main")), None, True, ("unknown", "other")),
    (frames(("model.layers.0.mlp", "activation: aten.mm bf16[2,4]")), None, False, ("activations", "vp")),
    (frames(("model.embed", "optimizer_state: exp_avg")), None, True, ("optimizer", "vp")),
])
def test_categorize_rules(alloc, free, alive, want):
    v = categorize(alloc, free, alive_at_end=alive)
    assert (v.category, v.rule) == want


def test_user_frames_prefer_code_outside_torch():
    fr = frames(("/x/torch/nn/functional.py", "linear"), ("/x/site-packages/transformers/llama.py", "forward"),
                ("train.py", "main"))
    assert user_frames(fr, 2) == ("llama.py:1:forward", "train.py:1:main")
    assert user_frames(frames(("/x/torch/optim/adamw.py", "step"))) == ("adamw.py:1:step",)
    assert user_frames([]) == ()


def test_allocator_replay_cross_check():
    sim = analyze(recorded_snapshot()).simulated
    assert sim is not None and sim.complete and sim.match
    assert sim.reserved == 20 * MiB and sim.allocated == 14 * MiB
    snap = recorded_snapshot()
    snap["device_traces"][0] = snap["device_traces"][0][2:]  # the segment and A: before recording
    sim = analyze(snap).simulated
    assert sim is not None and sim.complete and sim.reserved_before == 20 * MiB
    assert sim.recorded_segment_events == 0 and sim.reserved == 0  # nothing left to compare
    snap["device_traces"][0].insert(0, {"action": "alloc", "addr": 16, "size": 512, "stream": 0})
    sim = analyze(snap).simulated
    assert sim is not None and not sim.complete and "before the trace began" in sim.reason
    assert analyze(recorded_snapshot(), simulate=False).simulated is None


def test_profiler_frames_are_understood():
    prof = [{"filename": "none", "line": 0, "name": "torch/optim/adamw.py(500): _multi_tensor_adamw"},
            {"filename": "none", "line": 0, "name": "train.py(12): main"}]
    assert categorize(prof, None, alive_at_end=True) == categorize(OPT, None, alive_at_end=True)
    assert user_frames(prof) == ("train.py(12): main",)
    assert categorize([], None, alive_at_end=True, label="optimizer_state").category == "optimizer"


def test_snapshot_made_by_pytorch_memory_profiler():
    """torch.cuda._memory_viz turns a CPU memory profile into a snapshot: PyTorch's own output,
    with its categories on every entry and its frames in the profiler's form."""
    import torch
    from torch.cuda._memory_viz import _profile_to_snapshot
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    a = analyze(_profile_to_snapshot(p), simulate=False)
    assert a.entries > 0 and a.rules.get("entry", 0) > a.rules.get("none", 0)
    assert {"gradients", "optimizer", "activations"} <= {c for c, v in a.breakdown_at_peak.items() if v}
    assert sum(a.breakdown_at_peak.values()) == a.peak_allocated
    assert any(s.where.startswith("test_snapshot_analysis.py(") for s in a.sites_at_peak)
