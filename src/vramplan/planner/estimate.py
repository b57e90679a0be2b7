"""The estimate pipeline: model + workload (+ GPU) → :class:`~vramplan.results.MemoryReport`.

method=analytic  closed-form formulas (milliseconds; transformer families only)
method=trace     the real model run on fake tensors → event log → caching-allocator replay
method=auto      trace when the model can be built and traced, else analytic (the report says so)

Whatever the method, the report carries all three predicted numbers: allocated
(``max_memory_allocated``), reserved (``max_memory_reserved``) and device_used (nvidia-smi),
plus the verdict against a GPU and the largest batch that fits.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TraceError, VramplanError, WorkloadError
from ..hardware.gpu import GPU
from ..models.spec import Family, ModelSpec
from ..results import (
    AllocatorSummary,
    Breakdown,
    Fallback,
    IterationPeak,
    MemoryReport,
    OverheadItem,
    Peak,
    PhasePeak,
    Timeline,
    Verdict,
)
from ..workload import Attention, Method, Phase, Precision, Task, Workload, as_enum

if TYPE_CHECKING:
    from ..trace.result import TraceResult

ANALYTIC_RESERVE_SLACK = 0.05
"""Analytic method only: reserved is taken as allocated × (1 + this), the caching allocator's
typical slack (rounding to 2 MiB segments, cached free blocks). The trace method simulates it."""

MAX_BATCH_LIMIT = 1 << 16
FULL_TIMELINE_EVENTS = 2_000_000


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    from ..models.catalog import resolve

    return resolve(model)


def resolve_gpu(gpu: str | GPU | None) -> GPU | None:
    if gpu is None or isinstance(gpu, GPU):
        return gpu
    from ..hardware.catalog import get_gpu

    return get_gpu(gpu)


def overhead_items(gpu: GPU | None, w: Workload) -> tuple[OverheadItem, ...]:
    """Memory outside the caching allocator (CUDA context, kernels, NCCL), per GPU."""
    from ..hardware.overhead import device_overhead

    return tuple(device_overhead(gpu, world_size=w.parallel.world_size))


# --------------------------------------------------------------------------- analytic
@dataclass(frozen=True)
class _Core:
    """What a method produces before the GPU-dependent parts are added."""

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
    extra: Mapping[str, Any]
    iterations: tuple[IterationPeak, ...] = ()
    trace: TraceResult | None = None
    timeline: Timeline | None = None
    model_states: Breakdown | None = None


def _analytic_core(spec: ModelSpec, w: Workload, g: GPU | None = None) -> _Core:
    from .. import analytic

    est = analytic.estimate(spec, _kernel_workload(w, g))
    allocated = est.peak.allocated
    reserved = int(allocated * (1 + ANALYTIC_RESERVE_SLACK))
    notes = tuple(est.notes) + (
        f"analytic method: reserved assumed = allocated × {1 + ANALYTIC_RESERVE_SLACK:.2f} "
        "(use --method trace to simulate the caching allocator)",
    )
    summary = AllocatorSummary(
        backend="none (analytic: allocated + assumed slack)", conf="", segments=0,
        fragmentation_at_peak=1 - allocated / reserved if reserved else 0.0,
    )
    return _Core(
        breakdown=est.peak.breakdown, allocated=allocated, reserved=reserved,
        peak_phase=est.peak.phase, phases=tuple(est.phases), params=est.params,
        trainable_params=est.trainable_params, method=Method.ANALYTIC, allocator=summary,
        notes=notes, extra={"flops_per_step": est.flops_per_step},
        model_states=Breakdown(weights=est.states.weights, gradients=est.states.gradients,
                               optimizer=est.states.optimizer),
    )


# --------------------------------------------------------------------------- trace
def replay_trace(tr: TraceResult, alloc_conf: str | None, capacity: int | None = None) -> Any:
    """Replay a trace's events through the allocator simulation (a ``ReplayResult``)."""
    from ..allocator import parse_conf, replay

    conf = parse_conf(alloc_conf or "")
    return replay(tr.events, conf, capacity=capacity, record_timeline=tr.timeline is not None,
                  full_timeline=len(tr.events) <= FULL_TIMELINE_EVENTS)


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


def _with_reserved(tl: Timeline | None, rt: Any) -> Timeline | None:
    """Add the simulated reserved bytes to the trace's (decimated) timeline."""
    if tl is None or rt is None or not len(rt.index):
        return tl
    idx = list(rt.index)
    res = rt.reserved
    reserved = []
    for i in tl.index:  # last replay point at or before trace event i
        k = bisect.bisect_right(idx, i) - 1
        reserved.append(int(res[k]) if k >= 0 else 0)
    return dataclasses.replace(tl, reserved=tuple(reserved))


def _trace_core(tr: TraceResult, w: Workload, alloc_conf: str | None, pool_capacity: int | None) -> _Core:
    """Replay uncapped (what the step needs); where that exceeds the GPU's allocator capacity,
    replay again within it, as PyTorch would run: freeing cached blocks and retrying may make
    it fit (then those figures are reported), or it runs out of memory (then the uncapped
    figures say how much it would need)."""
    res = replay_trace(tr, alloc_conf)
    notes = list(tr.notes)
    summary: AllocatorSummary | None = None
    if pool_capacity is not None and res.max_reserved > pool_capacity:
        capped = replay_trace(tr, alloc_conf, pool_capacity)
        if capped.ooms == 0:
            notes.append(
                f"the step would reserve {res.max_reserved:,} B with unlimited memory; within the GPU's "
                f"{pool_capacity:,} B the allocator frees its cache and retries ({capped.alloc_retries}×) "
                "and the step fits (cudaMalloc retries cost time)"
            )
            res = capped
        else:
            notes.append(
                f"replayed within the GPU's {pool_capacity:,} B for the allocator: {capped.ooms} "
                f"out-of-memory error(s) after {capped.alloc_retries} retries; figures show what the "
                "step needs without a limit"
            )
            summary = dataclasses.replace(_summary(res, alloc_conf), ooms=capped.ooms,
                                          alloc_retries=capped.alloc_retries)
    if summary is None:
        summary = _summary(res, alloc_conf)
    allocated, reserved = int(res.max_allocated), int(res.max_reserved)
    traced = tr.breakdown_at_peak.total
    breakdown = tr.breakdown_at_peak
    if allocated != traced:
        notes.append(
            f"allocator rounding (512-byte multiples, unsplit block remainders) adds {allocated - traced:,} B "
            "at the allocated peak over the traced tensor bytes; counted under temporaries"
        )
        breakdown = _breakdown_to_total(breakdown, allocated)
    return _Core(
        breakdown=breakdown, allocated=allocated, reserved=max(reserved, allocated),
        timeline=_with_reserved(tr.timeline, res.timeline),
        peak_phase=tr.peak_phase, phases=tuple(tr.phases), params=tr.params,
        trainable_params=tr.trainable_params, method=Method.TRACE, allocator=summary,
        notes=tuple(notes), extra={"events": tr.events, "flops_per_step": tr.flops},
        iterations=tuple(tr.iterations), trace=tr, model_states=_traced_states(tr),
    )


def _traced_states(tr: TraceResult) -> Breakdown:
    """Model states of a traced training step: at the optimizer step all of them exist."""
    for p in tr.phases:
        if p.phase is Phase.OPTIMIZER:
            b = p.breakdown
            return Breakdown(weights=b.weights, gradients=b.gradients, optimizer=b.optimizer)
    return Breakdown(weights=tr.breakdown_at_peak.weights)


# --------------------------------------------------------------------------- verdict
def _usable(gpu: GPU) -> tuple[int, str]:
    from ..hardware.catalog import usable_capacity

    return usable_capacity(gpu)


def _pool_capacity(g: GPU | None, w: Workload) -> int | None:
    """What PyTorch's allocator can get: usable capacity minus the memory outside it."""
    if g is None:
        return None
    return _usable(g)[0] - sum(o.bytes for o in overhead_items(g, w))


def _kernel_workload(w: Workload, g: GPU | None) -> Workload:
    """The workload as the analytic formulas should see it on ``g``: SDPA has no fused bf16
    kernel before Ampere, so the math path runs and materialises the attention matrices
    like eager attention does (the trace emulates the kernel choice itself)."""
    from .space import supports_bf16

    if (g is not None and not supports_bf16(g) and w.attention is not Attention.EAGER
            and w.precision in (Precision.BF16, Precision.BF16_MIXED)):
        return w.replace(attention=Attention.EAGER)
    return w


def _analytic_device_used(spec: ModelSpec, w: Workload, overhead: int, g: GPU | None = None) -> int | None:
    try:
        core = _analytic_core(spec, w, g)
    except VramplanError:
        return None
    return core.reserved + overhead


def max_batch_analytic(spec: ModelSpec, w: Workload, usable: int, overhead: int, *, scale: float = 1.0,
                       offset: float = 0.0, gpu: GPU | None = None) -> int | None:
    """Largest micro-batch whose analytic device_used (× ``scale`` + ``offset``, a calibration
    from a trace) fits in ``usable``. Doubling then bisection: O(log batch) evaluations."""

    def fits(b: int) -> bool:
        used = _analytic_device_used(spec, w.replace(batch=b), overhead, gpu)
        return used is not None and used * scale + offset <= usable

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH_LIMIT and fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_BATCH_LIMIT:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------- public API
def estimate(
    model: str | ModelSpec,
    workload: Workload | None = None,
    *,
    gpu: str | GPU | None = None,
    method: str | Method = Method.AUTO,
    alloc_conf: str | None = None,
    num_gpus: int = 1,
    search_max_batch: bool = True,
    **workload_fields: Any,
) -> MemoryReport:
    """Predict one workload's per-GPU memory.

    ``workload`` fields may also be given as keywords: ``estimate("llama-3.1-8b", batch=4)``.
    """
    w = workload.replace(**workload_fields) if workload is not None else Workload(**workload_fields)
    spec = resolve_model(model)
    g = resolve_gpu(gpu)
    m = as_enum(Method, method, "method")
    if alloc_conf:
        from ..allocator import parse_conf

        parse_conf(alloc_conf)  # fail early on a bad string
    _check(spec, w)

    notes: list[str] = []
    length = w.seq + (w.new_tokens if w.task is Task.GENERATE else 0)
    if spec.max_positions and spec.family not in (Family.VIT, Family.OTHER) and length > spec.max_positions:
        notes.append(f"{length:,} tokens exceed the {spec.max_positions:,} positions {spec.name} was configured "
                     "for (max_position_embeddings): memory is predicted as if it runs, quality is not")
    core: _Core
    fallback: Fallback | None = None
    capacity = _pool_capacity(g, w)
    if m is Method.ANALYTIC:
        core = _analytic_core(spec, w, g)
    else:
        try:
            core = _trace_core(_trace_spec(spec, w, g), w, alloc_conf, capacity)
        except TraceError as e:
            if m is Method.TRACE or not _has_analytic(spec):
                raise
            notes.append(f"trace failed ({e}); analytic estimate instead")
            fallback = Fallback(requested=m, used=Method.ANALYTIC, reason=str(e))
            core = _analytic_core(spec, w, g)
    notes += _bf16_notes(g, w, core.method)
    if alloc_conf and core.method is Method.ANALYTIC:
        notes.append(f"--alloc-conf {alloc_conf} is not simulated by the analytic method: reserved is "
                     "allocated plus an assumed slack (use --method trace)")
    report = _finish(core, spec.name, w, g, notes=notes, spec=spec, search_max_batch=search_max_batch,
                     num_gpus=num_gpus)
    return report if fallback is None else report.replace(fallback=fallback)


def _bf16_notes(g: GPU | None, w: Workload, method: Method) -> list[str]:
    """bf16 on a GPU without it (Turing, Volta…): PyTorch runs it slowly and SDPA has no fused
    bf16 kernel there (math fallback, attention matrices materialised)."""
    from .space import supports_bf16

    if g is None or supports_bf16(g) or w.precision not in (Precision.BF16, Precision.BF16_MIXED):
        return []
    text = (f"{g.key} ({g.arch}) has no native bf16: PyTorch emulates it slowly and SDPA falls back to "
            "its math kernel, which materialises the attention matrices")
    if method is Method.ANALYTIC and w.attention is not Attention.EAGER:
        text += "; the analytic method therefore counts attention as eager (materialised scores)"
    return [text + "; --precision fp16-mixed is what this GPU runs well"]


def _has_analytic(spec: ModelSpec) -> bool:
    return spec.family is not Family.OTHER


def _check(spec: ModelSpec, w: Workload) -> None:
    if spec.family is Family.OTHER:
        if w.task is Task.GENERATE and not spec.vocab:
            raise WorkloadError(f"{spec.name} takes no token ids and does not generate text",
                                hint="use `task=infer` or `task=train`", field="task")
        return
    from ..analytic import check_against_model

    check_against_model(spec, w)


def _trace_spec(spec: ModelSpec, w: Workload, g: GPU | None) -> TraceResult:
    from ..trace.run import trace_workload

    return trace_workload(spec, w, gpu=g)


def _calibrate(spec: ModelSpec, w: Workload, g: GPU | None, oh: int, traced_used: int,
               traced_states: Breakdown | None) -> tuple[float, float, str]:
    """Map analytic device_used(batch) onto the traced point: the persistent part (model
    states + overhead) is taken from the trace, and the batch-dependent rest of the analytic
    curve is scaled by the traced/analytic ratio at this batch (``used·scale + offset``).
    Falls back to a constant offset when the ratio is not meaningful."""
    try:
        ana_core = _analytic_core(spec, w, g)
    except VramplanError:
        return 1.0, 0.0, "no analytic curve"
    ana = ana_core.reserved + oh
    fixed_t = (traced_states.total if traced_states is not None else 0) + oh
    fa = (ana_core.model_states.total if ana_core.model_states is not None else 0) + oh
    var_t, var_a = traced_used - fixed_t, ana - fa
    if var_a > 0 and var_t > 0 and 0.25 <= var_t / var_a <= 4.0:
        k = var_t / var_a
        return k, fixed_t - k * fa, f"batch-dependent part ×{k:.2f}"
    return 1.0, float(traced_used - ana), "constant offset"


def _finish(core: _Core, name: str, w: Workload, g: GPU | None, *, notes: list[str],
            spec: ModelSpec | None, search_max_batch: bool, num_gpus: int = 1) -> MemoryReport:
    overhead = overhead_items(g, w)
    oh = sum(o.bytes for o in overhead)
    peak = Peak(allocated=core.allocated, reserved=core.reserved, device_used=core.reserved + oh)
    verdict = None
    if g is not None:
        usable, usable_src = _usable(g)
        mb: int | None = None
        if search_max_batch and spec is not None and _has_analytic(spec):
            scale, offset = 1.0, 0.0
            if core.method is Method.TRACE:
                scale, offset, how = _calibrate(spec, w, g, oh, peak.device_used, core.model_states)
                notes.append(f"max_batch: analytic batch curve calibrated to the traced peak ({how})")
            mb = max_batch_analytic(spec, w, usable, oh, scale=scale, offset=offset, gpu=g)
        verdict = Verdict(
            gpu=g.key, gpu_name=g.name, capacity=g.capacity, usable=usable,
            fits=peak.device_used <= usable, headroom=usable - peak.device_used, max_batch=mb,
            num_gpus=num_gpus, capacity_source=usable_src,
        )
    timeline = core.timeline
    return MemoryReport(
        model=name, params=core.params, trainable_params=core.trainable_params, workload=w,
        method=core.method, breakdown=core.breakdown, overhead=overhead, peak=peak,
        peak_phase=core.peak_phase, phases=core.phases, verdict=verdict, allocator=core.allocator,
        notes=tuple(notes) + core.notes,
        top_modules=core.trace.top_modules if core.trace is not None else (),
        top_tensors=core.trace.top_tensors if core.trace is not None else (),
        iterations=core.iterations, timeline=timeline, extra=dict(core.extra),
        model_states=core.model_states,
    )


def trace(
    build_model: Callable[[], Any] | Any,
    inputs: Any = None,
    *,
    workload: Workload | None = None,
    task: str = "train",
    optimizer: Callable[[Any], Any] | str | None = None,
    loss_fn: Callable[..., Any] | None = None,
    gpu: str | GPU | None = None,
    alloc_conf: str | None = None,
    iterations: int = 2,
    name: str | None = None,
    **workload_fields: Any,
) -> MemoryReport:
    """Trace a user's own model (an ``nn.Module`` or a factory returning one) on fake tensors.

    ``inputs``: a tensor, tuple of tensors or dict of keyword tensors for ``model(...)``.
    ``optimizer``: a factory such as ``lambda params: torch.optim.AdamW(params, lr=1e-4)``, or
    the name of a workload optimizer (``"adamw-8bit"``); default: the workload's optimizer.
    ``workload`` or keywords: :class:`~vramplan.workload.Workload` fields (precision,
    checkpointing, ...).
    """
    from ..trace.run import trace_model

    factory = optimizer if callable(optimizer) else None
    if isinstance(optimizer, str):
        workload_fields["optimizer"] = optimizer
    if workload is not None:
        w = workload.replace(**workload_fields) if workload_fields else workload
    else:
        w = Workload(task=as_enum(Task, task, "task"), **workload_fields)
    g = resolve_gpu(gpu)
    if alloc_conf:
        from ..allocator import parse_conf

        parse_conf(alloc_conf)
    tr = trace_model(build_model, inputs, workload=w, optimizer=factory, loss_fn=loss_fn, gpu=g,
                     iterations=iterations)
    core = _trace_core(tr, w, alloc_conf, _pool_capacity(g, w))
    label = name or getattr(build_model, "__name__", None) or type(build_model).__name__
    core = dataclasses.replace(core, extra={**core.extra, "user_model": True})
    return _finish(core, label, w, g, notes=[], spec=None, search_max_batch=False)


__all__ = ["estimate", "trace", "max_batch_analytic", "replay_trace", "WorkloadError"]
