"""Small, hand-checkable inputs for the measure / snapshot / plot tests (not a test module)."""

from __future__ import annotations

from typing import Any

from vramplan.events import Action, Category, EventLog
from vramplan.results import (
    Breakdown,
    MemoryReport,
    OverheadItem,
    Peak,
    PhasePeak,
    Timeline,
    Verdict,
)
from vramplan.workload import Method, Phase, Workload

MiB = 1 << 20
GiB = 1 << 30
SEG = 0x7F0000000000


def frames(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"filename": f, "line": 1, "name": n} for f, n in pairs]


W_FRAMES = frames(("/env/lib/python3.11/site-packages/torch/nn/modules/module.py", "_apply"),
                  ("train.py", "main"))
FWD = frames(("/env/site-packages/torch/nn/modules/linear.py", "forward"), ("model.py", "forward"))
BWD = frames(("??", "torch::autograd::Engine::evaluate_function"))


def recorded_snapshot() -> dict[str, Any]:
    """One 20 MiB segment: weights A (4 MiB, kept), activation B (8 MiB, freed in backward),
    temporary C (2 MiB − 100 B, freed in forward), then an OOM.

    Peak allocated 14 MiB after entry 3; reserved 20 MiB from entry 0.
    """
    a, b, c = SEG, SEG + 4 * MiB, SEG + 12 * MiB
    csize = 2 * MiB - 100
    trace = [
        {"action": "segment_alloc", "addr": SEG, "size": 20 * MiB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": a, "size": 4 * MiB, "stream": 0, "frames": W_FRAMES},
        {"action": "alloc", "addr": b, "size": 8 * MiB, "stream": 0, "frames": FWD},
        {"action": "alloc", "addr": c, "size": csize, "stream": 0, "frames": frames(("model.py", "forward"))},
        {"action": "free_requested", "addr": c, "size": csize, "stream": 0, "frames": frames(("model.py", "forward"))},
        {"action": "free_completed", "addr": c, "size": csize, "stream": 0, "frames": []},
        {"action": "free_requested", "addr": b, "size": 8 * MiB, "stream": 0, "frames": BWD},
        {"action": "free_completed", "addr": b, "size": 8 * MiB, "stream": 0, "frames": []},
        {"action": "oom", "size": 100 * GiB, "device_free": GiB, "stream": 0, "frames": frames(("train.py", "main"))},
    ]
    segs = [{
        "device": 0, "address": SEG, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
        "allocated_size": 4 * MiB, "active_size": 4 * MiB, "requested_size": 4 * MiB,
        "blocks": [
            {"address": a, "size": 4 * MiB, "requested_size": 4 * MiB, "state": "active_allocated", "frames": W_FRAMES},
            {"address": b, "size": 16 * MiB, "requested_size": 0, "state": "inactive", "frames": []},
        ],
    }]
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {}}


def training_log(iterations: int = 2, layers: int = 4, foreach_temp: int = 42 * MiB) -> EventLog:
    """A training-shaped event log: weights, per-layer activations and temporaries, gradients,
    optimizer states created in the first step, and a final empty_cache."""
    log = EventLog()
    log.alloc(1, 40 * MiB, category=Category.PARAMETER, module="model.embed", op="init", desc="f32[10485760]")
    log.alloc(2, 3 * MiB, category=Category.PARAMETER, module="model.norm", op="init", desc="f32[786432]")
    nid = 100
    for it in range(iterations):
        log.append(Action.MARK, op="iteration", iteration=it, phase=1)
        acts = []
        for i in range(layers):
            log.alloc(nid, 8 * MiB + 123, category=Category.ACTIVATION, module=f"model.layers.{i}",
                      op="aten.mm", desc="bf16[4,1024,1024]", phase=1, iteration=it)
            acts.append(nid)
            log.alloc(nid + 1, 3000, category=Category.TEMPORARY, module=f"model.layers.{i}", op="aten.add",
                      phase=1, iteration=it)
            log.free(nid + 1, phase=1, iteration=it)
            nid += 2
        for a in reversed(acts):
            log.free(a, phase=2, iteration=it)
        log.alloc(nid, 40 * MiB, category=Category.GRADIENT, module="model.embed", op="grad", phase=2, iteration=it)
        log.alloc(nid + 1, 3 * MiB, category=Category.GRADIENT, module="model.norm", op="grad", phase=2, iteration=it)
        if it == 0:
            log.alloc(50, 80 * MiB, category=Category.OPTIMIZER_STATE, module="model.embed", op="exp_avg", phase=4)
            log.alloc(51, 6 * MiB, category=Category.OPTIMIZER_STATE, module="model.norm", op="exp_avg", phase=4)
        log.alloc(nid + 2, foreach_temp, category=Category.TEMPORARY, module="", op="_foreach_add", phase=4, iteration=it)
        log.free(nid + 2, phase=4, iteration=it)
        log.free(nid, phase=4, iteration=it)
        log.free(nid + 1, phase=4, iteration=it)
        nid += 3
    log.append(Action.EMPTY_CACHE)
    return log


def fake_report(*, timeline: bool = True, verdict: bool = True, fits: bool = True,
                method: Method = Method.TRACE, scale: int = GiB) -> MemoryReport:
    """Two training iterations (forward / backward / optimizer) with hand-made series."""
    n = 300
    series: dict[str, list[int]] = {k: [] for k in ("weights", "gradients", "optimizer", "activations", "temporaries")}
    reserved: list[int] = []
    phases = []
    for it in range(2):
        base = it * n // 2
        for k in range(n // 2):
            fwd, bwd = k < 60, 60 <= k < 120
            series["weights"].append(2 * scale)
            series["activations"].append(k * scale // 10 if fwd else (120 - k) * scale // 10 if bwd else 0)
            series["gradients"].append((k - 60) * scale // 30 if bwd else (2 * scale if k >= 120 or it else 0))
            series["optimizer"].append(4 * scale if (it or k >= 125) else 0)
            series["temporaries"].append(scale // 4 if k % 10 == 0 else 0)
            total = sum(v[-1] for v in series.values())
            reserved.append(max(total + scale // 8, reserved[-1] if reserved else 0))
        phases += [(base, base + 59, "forward"), (base + 60, base + 119, "backward"), (base + 120, base + n // 2 - 1, "optimizer")]
    totals = [sum(v[k] for v in series.values()) for k in range(n)]
    pk = max(range(n), key=totals.__getitem__)
    bd = Breakdown(**{c: v[pk] for c, v in series.items()})
    over = 600 * MiB
    peak = Peak(bd.total, max(reserved), max(reserved) + over)
    usable = (23 * scale) if fits else (peak.device_used // 2)
    v = Verdict(gpu="rtx-4090", gpu_name="NVIDIA GeForce RTX 4090", capacity=24 * scale, usable=usable,
                fits=fits, headroom=usable - peak.device_used, max_batch=8) if verdict else None
    return MemoryReport(
        model="toy-1b", params=1_000_000_000, trainable_params=1_000_000_000, workload=Workload(batch=4, seq=1024),
        method=method, breakdown=bd, overhead=(OverheadItem("CUDA context", over, "test"),), peak=peak,
        peak_phase=Phase.BACKWARD,
        phases=(PhasePeak(Phase.FORWARD, 10 * scale, Breakdown(weights=2 * scale, activations=6 * scale, gradients=2 * scale)),
                PhasePeak(Phase.BACKWARD, bd.total, bd),
                PhasePeak(Phase.OPTIMIZER, 9 * scale, Breakdown(weights=2 * scale, gradients=2 * scale, optimizer=4 * scale,
                                                                temporaries=scale))),
        verdict=v,
        timeline=Timeline(index=tuple(range(n)), series={k: tuple(v) for k, v in series.items()},
                          phases=tuple(phases), reserved=tuple(reserved)) if timeline else None,
    )
