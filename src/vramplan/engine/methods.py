"""The two methods behind an estimate, each producing a :class:`MethodResult`.

analytic  closed-form formulas (milliseconds; transformer families only)
trace     the real model run on fake tensors → event log → caching-allocator replay
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import TYPE_CHECKING, Any

from vramplan._dataclass import dataclass

from ..errors import VramplanError
from ..models.spec import ModelSpec
from ..results import (
    AllocatorSummary,
    Breakdown,
    IterationPeak,
    ModuleStat,
    PhasePeak,
    TensorStat,
    Timeline,
)
from ..target import DEFAULT_PROFILE, DeviceProfile
from ..workload import Method, Phase, Workload
from . import cache
from .device import kernel_workload

if TYPE_CHECKING:
    from ..events import EventLog
    from ..trace.result import TraceResult

ANALYTIC_RESERVE_SLACK = 0.05
"""Analytic method only: reserved is taken as allocated × (1 + this), the caching allocator's
typical slack (rounding to 2 MiB segments, cached free blocks). The trace method simulates it."""


@dataclass(frozen=True)
class MethodResult:
    """What a method (analytic or trace + replay) produces, before the GPU's share (overhead,
    verdict) is added; every field typed, nothing method-specific in an untyped bag."""

    breakdown: Breakdown
    allocated: int
    reserved: int
    peak_phase: Phase
    phases: tuple[PhasePeak, ...]
    params: int
    trainable_params: int
    method: Method
    allocator: AllocatorSummary | None
    notes: tuple[str, ...]
    flops_per_step: float | None = None
    iterations: tuple[IterationPeak, ...] = ()
    top_modules: tuple[ModuleStat, ...] = ()
    top_tensors: tuple[TensorStat, ...] = ()
    events: EventLog | None = None
    timeline: Timeline | None = None
    model_states: Breakdown | None = None
    host_memory: int = 0
    """Host RAM the step holds (offloaded activations, FSDP2 CPU offload)."""
    host_parts: tuple[tuple[str, int], ...] = ()
    """(part, bytes) of ``host_memory``."""


# --------------------------------------------------------------------------- analytic
def analytic_core(spec: ModelSpec, w: Workload, dev: DeviceProfile = DEFAULT_PROFILE) -> MethodResult:
    """The analytic formulas on ``dev``: its cuBLAS workspace and bf16 kernels, as the trace sees them."""
    from .. import analytic

    est = analytic.estimate(spec, kernel_workload(w, dev), workspace_bytes=dev.cublas_workspace, rollout=dev.rollout)
    allocated = est.peak.allocated
    reserved = int(allocated * (1 + ANALYTIC_RESERVE_SLACK))
    notes = tuple(est.notes) + (
        f"analytic method: reserved assumed = allocated × {1 + ANALYTIC_RESERVE_SLACK:.2f} "
        "(use `method=trace` to simulate the caching allocator)",
    )
    summary = AllocatorSummary(
        backend="none (analytic: allocated + assumed slack)", conf="", segments=0,
        fragmentation_at_peak=1 - allocated / reserved if reserved else 0.0,
    )
    return MethodResult(
        breakdown=est.peak.breakdown, allocated=allocated, reserved=reserved,
        peak_phase=est.peak.phase, phases=tuple(est.phases), params=est.params,
        trainable_params=est.trainable_params, method=Method.ANALYTIC, allocator=summary,
        notes=notes, flops_per_step=est.flops_per_step, host_memory=est.host_memory,
        host_parts=est.host_parts,
        model_states=Breakdown(weights=est.states.weights, gradients=est.states.gradients,
                               optimizer=est.states.optimizer),
    )


def analytic_device_used(spec: ModelSpec, w: Workload, dev: DeviceProfile = DEFAULT_PROFILE) -> int | None:
    """The analytic device_used of ``w`` on ``dev`` (None where the formulas refuse the workload)."""
    try:
        core = analytic_core(spec, w, dev)
    except VramplanError:
        return None
    return core.reserved + dev.overhead_bytes


# --------------------------------------------------------------------------- trace
def trace_catalog_model(spec: ModelSpec, w: Workload, dev: DeviceProfile,
                        checkpoint_policy: Any = None) -> TraceResult:
    """The trace of a catalog model under ``w``; without a checkpoint policy, the process's
    bounded cache or the disk store answers a workload traced before, or one written from
    traces at nearby batches (:mod:`.cache`, :mod:`.store`)."""
    from ..trace.options import TraceOptions

    opts = TraceOptions()  # the defaults, as the environment sets them (VRAMPLAN_FULL_TRACE)
    if checkpoint_policy is not None:  # a function: no key says what it does
        from ..trace.run import trace_workload

        return trace_workload(spec, w, device=dev, options=opts, checkpoint_policy=checkpoint_policy)

    def run() -> TraceResult:  # (torch is imported only here: a stored trace answers without it)
        from ..models.build import import_code
        from ..trace.run import trace_workload

        if cache._BEFORE_TRACE:
            import_code(spec)  # (what a child forked now inherits)
            cache.tracing()
        return trace_workload(spec, w, device=dev, options=opts, models=cache.MODELS)

    return cache.cached_trace(spec, w, dev, run, options=opts)


def replay_trace(tr: TraceResult, alloc_conf: str | None, capacity: int | None = None) -> Any:
    """Replay a trace's events through the allocator simulation (a ``ReplayResult``; the
    process's bounded cache answers a replay of the same trace object run before). Within a
    ``capacity`` the replay ends at the first allocation that fails even after the cache is
    freed: PyTorch raises ``OutOfMemoryError`` there, and nothing after it would run."""
    from ..allocator import parse_conf, replay

    conf = parse_conf(alloc_conf or "")
    # one plain pass: the report needs the peaks and the reserved curve (kept exactly, as sparse
    # changes), not a per-event timeline nor the segment map at the peak (a second pass)
    return cache.cached_replay(tr, alloc_conf, capacity,
                               lambda: replay(tr.events, conf, capacity=capacity, segment_map=False,
                                              first_oom=capacity is not None))


def replay_gpus(tr: TraceResult, alloc_conf: str | None, capacity: int | None = None,
                ) -> tuple[tuple[tuple[int, int, int], ...], list[str]]:
    """(index, allocated peak, reserved peak) of each GPU other than 0 of a run spread over several
    GPUs (:attr:`TraceResult.gpu_events`): each GPU's own events replayed through the allocator
    simulation, as GPU 0's are (uncapped: what each GPU needs). Where one GPU's need passes
    ``capacity`` (the allocator's bytes of one GPU), that GPU's events are replayed again within it,
    as GPU 0's are (:func:`trace_core`): the notes say, naming the GPU, whether freeing its cache and
    retrying would let it run or it would raise CUDA out of memory. Every GPU has a caching allocator
    of its own (``NativeCachingAllocator::device_allocator``, one ``DeviceCachingAllocator`` per
    device: its retry frees that device's cache only, and its OOM is that device's)."""
    from ..allocator import parse_conf, replay

    conf = parse_conf(alloc_conf or "")
    out, notes = [], []
    for i, log in tr.gpu_events:
        res = replay(log, conf, segment_map=False)
        out.append((i, int(res.max_allocated), max(int(res.max_reserved), int(res.max_allocated))))
        if capacity is not None and res.max_reserved > capacity:
            capped = replay(log, conf, capacity=capacity, segment_map=False, first_oom=True)
            notes.append(capacity_note(res, capped, capacity, log, gpu=i))
    return tuple(out), notes


def capacity_note(res: Any, capped: Any, capacity: int, log: Any, gpu: int | None = None) -> str:
    """What a replay within ``capacity`` (``capped``) says of a step whose uncapped replay
    (``res``) needs more: it runs only by freeing the cache and retrying, or it runs out of memory
    (where). ``gpu``: the GPU the events are of, named (a run over several GPUs)."""
    on = f" on GPU {gpu}" if gpu is not None else ""
    if capped.ooms == 0:
        return (f"the step needs {res.max_reserved:,} B reserved{on}, more than the GPU's {capacity:,} B for "
                f"the allocator; freeing its cache and retrying ({capped.alloc_retries}×) it might still run, "
                "slowly and with no margin, so the verdict counts what it needs")
    from ..events import PHASES  # (events imports pathlib: kept off the analytic path)

    k = capped.oom_indices[0] if capped.oom_indices else -1
    where = (f" at event {k:,} of {len(log):,} ({PHASES[log.phase[k]]}, asking for "
             f"{log.size[k]:,} B)") if 0 <= k < len(log) else ""
    return (f"the step needs more than the GPU's {capacity:,} B for the allocator: replayed "
            f"within it, it would raise CUDA out of memory{on}{where} even after freeing the cache "
            f"({capped.alloc_retries} retries before); the figures show what the step needs without a limit")


def _summary(res: Any, alloc_conf: str | None) -> AllocatorSummary:
    backend = str(getattr(res, "backend", "native"))
    label = backend if backend == "native" or "approx" in backend else f"{backend} (approximation)"
    return AllocatorSummary(
        backend=label, conf=alloc_conf or "", segments=res.segments,
        fragmentation_at_peak=float(res.fragmentation_at_peak),
        alloc_retries=res.alloc_retries, ooms=res.ooms,
    )


def _breakdown_to_total(b: Breakdown, total: int) -> Breakdown:
    """The trace counts requested bytes; the allocator counts whole blocks (512-byte rounding,
    unsplit remainders). Keep the traced categories and put the difference under temporaries
    (the caller says so in the notes), so that the categories sum to ``allocated``."""
    diff = total - b.total
    if diff == 0:
        return b
    d = b.as_dict()
    d["temporaries"] = d["temporaries"] + diff
    return Breakdown.from_mapping(d)


def _with_reserved(tl: Timeline | None, changes: tuple[tuple[int, int], ...]) -> Timeline | None:
    """Add the simulated reserved bytes to the trace's (decimated) timeline: at each of its
    points, reserved after the last change at or before that event."""
    if tl is None or not changes:
        return tl
    idx = [k for k, _ in changes]
    reserved = []
    for i in tl.index:
        k = bisect.bisect_right(idx, i) - 1
        reserved.append(changes[k][1] if k >= 0 else 0)
    return dataclasses.replace(tl, reserved=tuple(reserved))


def trace_core(tr: TraceResult, w: Workload, alloc_conf: str | None, pool_capacity: int | None, *,
               within_capacity: bool = True) -> MethodResult:
    """Replay uncapped: the figures are what the step needs, and the verdict (and every
    boundary search) compares that need with the GPU. Where it exceeds the GPU's allocator
    capacity, replay again within it, as PyTorch would run, and say what happens there:
    freeing cached blocks and retrying may let it run (too close to the limit to count on),
    or it runs out of memory. ``within_capacity=False`` skips that second replay (a search's
    confirmation reads only the uncapped figures and whether they fit): the report then says
    nothing of retries or OOMs at the limit."""
    res = replay_trace(tr, alloc_conf)
    notes = list(tr.notes)
    summary = _summary(res, alloc_conf)
    if within_capacity and pool_capacity is not None and res.max_reserved > pool_capacity:
        capped = replay_trace(tr, alloc_conf, pool_capacity)
        # (a run spread over several GPUs: the note names GPU 0, as the others' name theirs: replay_gpus)
        notes.append(capacity_note(res, capped, pool_capacity, tr.events, gpu=0 if tr.gpu_events else None))
        summary = dataclasses.replace(summary, ooms=capped.ooms, alloc_retries=capped.alloc_retries)
    allocated, reserved = int(res.max_allocated), int(res.max_reserved)
    traced = tr.breakdown_at_peak.total
    breakdown = tr.breakdown_at_peak
    if allocated != traced:
        notes.append(
            f"allocator rounding (512-byte multiples, unsplit block remainders) adds {allocated - traced:,} B "
            "at the allocated peak over the traced tensor bytes; counted under temporaries"
        )
        breakdown = _breakdown_to_total(breakdown, allocated)
    return MethodResult(
        breakdown=breakdown, allocated=allocated, reserved=max(reserved, allocated),
        timeline=_with_reserved(tr.timeline, res.reserved_changes),
        peak_phase=tr.peak_phase, phases=tuple(tr.phases), params=tr.params,
        trainable_params=tr.trainable_params, method=Method.TRACE, allocator=summary,
        notes=tuple(notes), flops_per_step=tr.flops, events=tr.events, iterations=tuple(tr.iterations),
        top_modules=tuple(tr.top_modules), top_tensors=tuple(tr.top_tensors), model_states=_traced_states(tr),
        host_memory=tr.host_memory, host_parts=tr.host_parts,
    )


def _traced_states(tr: TraceResult) -> Breakdown:
    """Model states of a traced training step: at the optimizer step all of them exist (with the
    optimizer in backward there is no such phase and no gradient persists: weights and states)."""
    for p in tr.phases:
        if p.phase is Phase.OPTIMIZER:
            b = p.breakdown
            return Breakdown(weights=b.weights, gradients=b.gradients, optimizer=b.optimizer)
    return Breakdown(weights=tr.breakdown_at_peak.weights, optimizer=tr.breakdown_at_peak.optimizer)


__all__ = ["MethodResult", "analytic_core", "analytic_device_used", "trace_core", "trace_catalog_model", "replay_trace",
           "replay_gpus", "capacity_note",
           "ANALYTIC_RESERVE_SLACK"]
