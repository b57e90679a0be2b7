"""FSDP2 CPU offload (``CPUOffloadPolicy(pin_memory=True)``) traced on the fake process group:
host RAM per part equals the analytic figure exactly; the GPU keeps no parameter, gradient or
optimizer state between steps."""

from __future__ import annotations

import dataclasses

import pytest

from test_trace_agreement import _optimizer_states, _small, estimate
from vramplan.analytic.host import pinned_bytes
from vramplan.errors import TraceError, WorkloadError
from vramplan.events import Action, Category
from vramplan.models.catalog import resolve
from vramplan.trace.host import GRADIENTS, PARAMETERS, STATES, STEP, HostMemory
from vramplan.trace.recorder import Recorder
from vramplan.trace.run import TraceOptions, trace_workload
from vramplan.workload import Parallel, Workload

FAST = TraceOptions(count_flops=False)


def _w(**kw) -> Workload:
    par = {k: kw.pop(k) for k in list(kw) if k in Parallel.__dataclass_fields__}
    return Workload(**{"task": "train", "batch": 2, "seq": 128, "precision": "bf16-mixed", **kw}).replace(
        **{"dp": 8, "zero": 3, "offload_params": True, **par})


def _parts(parts) -> dict[str, int]:
    return dict(parts)


@pytest.mark.parametrize("kw", [{}, {"peft": "lora"}, {"grad_accum": 2}, {"precision": "bf16"}, {"dp": 64}],
                         ids=["full", "lora", "accum2", "bf16", "dp64"])
def test_small_llama_host_parts_equal_analytic(kw: dict) -> None:
    spec = _small("llama-3.1-8b")
    w = _w(**kw)
    r = trace_workload(spec, w, iterations=2, options=FAST)
    a = estimate(spec, w)
    traced, formula = _parts(r.host_parts), _parts(a.host_parts)
    for part in (PARAMETERS, GRADIENTS, STATES):
        assert traced[part] == formula[part], (part, traced, formula)
    assert traced[STEP] == pytest.approx(formula[STEP], rel=0.01)
    assert r.host_memory == sum(traced.values())
    # nothing of the model's states stays on the GPU
    assert _optimizer_states(r) == (0, 0, 0) == (a.states.weights, a.states.gradients, a.states.optimizer)
    assert any("CPUOffloadPolicy(pin_memory=True)" in n for n in r.notes)
    assert abs(r.peak_allocated - a.peak.allocated) / a.peak.allocated < 0.08, (r.peak_allocated, a.peak.allocated)


def test_offload_moves_the_states_off_the_gpu_and_copies_shards_up() -> None:
    """Against the same layout without offload: the GPU no longer holds the sharded parameters,
    gradients and optimizer states; each all-gather first copies its fp32 shards to the GPU on the
    copy-in stream; the reduce-scattered gradient shard dies on the GPU once copied down."""
    spec = _small("llama-3.1-8b")
    w = _w()
    on = trace_workload(spec, w, iterations=1, options=FAST)
    off = trace_workload(spec, w.replace(offload_params=False), iterations=1, options=FAST)
    params, grads, states = _optimizer_states(off)
    host = _parts(on.host_parts)
    assert host[STATES] == states  # the same states, on the other side of the PCIe link
    assert host[PARAMETERS] >= params and host[GRADIENTS] >= grads  # (power-of-two pinned blocks)

    def by_stream(r, cat):
        log = r.events
        out: dict[int, int] = {}
        for k in range(len(log)):
            if log.action[k] == Action.ALLOC and log.category[k] == int(cat):
                out[log.stream[k]] = out.get(log.stream[k], 0) + log.size[k]
        return out

    copy_in = min(s for s in by_stream(on, Category.TEMPORARY) if s)  # the all-gather copy-in stream
    # forward + backward gather every shard once each: the fp32 H2D copies are 2 × the shards
    extra = by_stream(on, Category.TEMPORARY)[copy_in] - by_stream(off, Category.TEMPORARY)[copy_in]
    assert extra == 2 * params
    assert Category.GRADIENT not in {Category(c) for c in on.events.category}
    assert on.peak_allocated < off.peak_allocated


def test_llama_8b_times_8_host_ram_equals_analytic_exactly() -> None:
    spec = resolve("llama-3.1-8b")
    w = Workload(task="train", batch=1, seq=256, precision="bf16-mixed").replace(dp=8, zero=3, offload_params=True)
    r = trace_workload(spec, w, iterations=1, options=FAST)
    a = estimate(spec, w)
    traced, formula = _parts(r.host_parts), _parts(a.host_parts)
    for part in (PARAMETERS, GRADIENTS, STATES):
        assert traced[part] == formula[part]
    # 8.03e9 B of fp32 shards: Adam's two states are exactly 2 × the shards; pinned blocks round up
    assert formula[STATES] == 8_030_261_248
    assert formula[PARAMETERS] == 4_429_318_144 > formula[STATES] // 2


def test_fsdp_offload_params_implies_the_whole_policy() -> None:
    """FSDP2 has one CPUOffloadPolicy: ``offload_params`` alone gives the same estimate as both
    flags (accelerate / torchtitan readers set both)."""
    spec = _small("llama-3.1-8b")
    one, both = _w(), _w(offload_optimizer=True)
    a1, a2 = estimate(spec, one), estimate(spec, both)
    assert a1.peak.allocated == a2.peak.allocated and a1.host_parts == a2.host_parts


def test_optimizer_only_offload_is_deepspeeds() -> None:
    spec = _small("llama-3.1-8b")
    w = Workload(task="train", batch=1, seq=64, precision="bf16-mixed").replace(dp=8, zero=3, offload_optimizer=True)
    with pytest.raises(TraceError, match="optimizer-only offload is DeepSpeed"):
        trace_workload(spec, w, iterations=1, options=FAST)
    ds = w.replace(engine="deepspeed", offload_params=True)
    with pytest.raises(TraceError, match="DeepSpeed's CPU offload"):
        trace_workload(spec, ds, iterations=1, options=FAST)
    with pytest.raises(WorkloadError, match="offloads parameters, gradients and optimizer together"):
        Parallel(dp=8, zero=3, engine="fsdp", offload_optimizer=True)


def test_host_ledger_pins_in_power_of_two_classes_and_reuses_blocks() -> None:
    import gc

    import torch

    rec = Recorder()
    host = HostMemory(rec)
    with host.scope(PARAMETERS):
        a = torch.empty(3000, device="meta")  # 12,000 B → a 16 KiB block
        host.adopt(a)
    g1 = torch.empty(3000, device="meta")
    host.adopt(g1, part=GRADIENTS, pinned=True)
    del g1
    gc.collect()
    g2 = torch.empty(3000, device="meta")  # the cached block is reused
    host.adopt(g2, part=GRADIENTS, pinned=True)
    s = torch.empty(1000, device="meta")
    host.adopt(s, part=STATES, pinned=False)
    t = torch.empty(500, device="meta")
    host.adopt(t, pinned=False)
    del t
    gc.collect()
    assert host.pinned(PARAMETERS) == host.pinned(GRADIENTS) == 16384 == pinned_bytes(12000)
    assert dict(host.parts()) == {PARAMETERS: 16384, GRADIENTS: 16384, STATES: 4000, STEP: 2000}
    assert host.is_host(a) and host.is_host(s) and not host.is_host(torch.empty(3, device="meta"))
    assert rec.log.action.__len__() == 0  # nothing of it is GPU memory


@pytest.mark.parametrize("fmt", ["fsdp", "accelerate", "torchtitan"])
def test_emitted_offload_layout_round_trips_with_host_ram(fmt: str) -> None:
    from vramplan.planner.emit import emit
    from vramplan.planner.layout import read_layout
    from vramplan.planner.plan import plan

    spec = resolve("llama-3.2-1b")
    template = plan(spec, Workload(seq=1024), gpu="h100", max_gpus=8, method="analytic", confirm=0).plans[0]
    w = Workload(seq=1024).replace(dp=8, zero=3, engine="fsdp", offload_params=True)
    p = dataclasses.replace(template, workload=w, num_gpus=8)
    out = emit(p, fmt)
    base = w.replace(zero=0, offload_params=False, engine="auto")
    back = read_layout(fmt, out.text, base).workload
    assert back.parallel.offload_params
    a, b = estimate(spec, w), estimate(spec, back)
    assert (a.peak.allocated, a.host_parts) == (b.peak.allocated, b.host_parts)
    assert a.host_memory > 0
