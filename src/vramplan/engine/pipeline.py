"""The estimate pipeline: model + workload (+ GPU) → :class:`~vramplan.results.MemoryReport`.

method=analytic  closed-form formulas (milliseconds; transformer families only)
method=trace     the real model run on fake tensors → event log → caching-allocator replay
method=auto      trace when the model can be built and traced, else analytic (the report says so)

Whatever the method, the report carries all three predicted numbers: allocated
(``max_memory_allocated``), reserved (``max_memory_reserved``) and device_used (nvidia-smi),
plus the verdict against a GPU and the largest batch that fits.
"""

from __future__ import annotations

from typing import Any

from ..errors import TraceError, WorkloadError
from ..hardware.gpu import GPU
from ..models.spec import Family, ModelSpec
from ..results import MemoryReport, Peak, Verdict
from ..workload import Method, Task, Workload, as_enum
from .boundary import max_batch_analytic
from .calibration import calibrate
from .device import bf16_notes
from .methods import MethodCore, analytic_core, trace_catalog_model, trace_core
from .resolve import resolve_gpu, resolve_model
from .verdict import overhead_items, pool_capacity, usable


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
    core: MethodCore
    capacity = pool_capacity(g, w)
    if m is Method.ANALYTIC:
        core = analytic_core(spec, w, g)
    else:
        try:
            core = trace_core(trace_catalog_model(spec, w, g), w, alloc_conf, capacity)
        except TraceError as e:
            if m is Method.TRACE or not has_analytic(spec):
                raise
            notes.append(f"trace failed ({e}); analytic estimate instead")
            core = analytic_core(spec, w, g)
    notes += bf16_notes(g, w, core.method)
    if alloc_conf and core.method is Method.ANALYTIC:
        notes.append(f"--alloc-conf {alloc_conf} is not simulated by the analytic method: reserved is "
                     "allocated plus an assumed slack (use --method trace)")
    return finish(core, spec.name, w, g, notes=notes, spec=spec, search_max_batch=search_max_batch,
                  num_gpus=num_gpus)


def has_analytic(spec: ModelSpec) -> bool:
    return spec.family is not Family.OTHER


def _check(spec: ModelSpec, w: Workload) -> None:
    if spec.family is Family.OTHER:
        if w.task is Task.GENERATE and not spec.vocab:
            raise WorkloadError(f"{spec.name} takes no token ids and does not generate text",
                                hint="use --task infer or --task train")
        return
    from ..analytic import check_against_model

    check_against_model(spec, w)


def finish(core: MethodCore, name: str, w: Workload, g: GPU | None, *, notes: list[str],
           spec: ModelSpec | None, search_max_batch: bool, num_gpus: int = 1) -> MemoryReport:
    """Add the GPU-dependent parts (overhead, verdict, largest batch) to a method's result."""
    overhead = overhead_items(g, w)
    oh = sum(o.bytes for o in overhead)
    peak = Peak(allocated=core.allocated, reserved=core.reserved, device_used=core.reserved + oh)
    verdict = None
    if g is not None:
        use, usable_src = usable(g)
        mb: int | None = None
        if search_max_batch and spec is not None and has_analytic(spec):
            scale, offset = 1.0, 0.0
            if core.method is Method.TRACE:
                scale, offset, how = calibrate(spec, w, g, oh, peak.device_used, core.model_states)
                notes.append(f"max_batch: analytic batch curve calibrated to the traced peak ({how})")
            mb = max_batch_analytic(spec, w, use, oh, scale=scale, offset=offset, gpu=g)
        verdict = Verdict(
            gpu=g.key, gpu_name=g.name, capacity=g.capacity, usable=use,
            fits=peak.device_used <= use, headroom=use - peak.device_used, max_batch=mb,
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


__all__ = ["estimate", "finish", "has_analytic"]
