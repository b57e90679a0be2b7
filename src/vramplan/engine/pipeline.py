"""The estimate pipeline: model + workload (+ GPU) → :class:`~vramplan.results.MemoryReport`.

method=analytic  closed-form formulas (milliseconds; transformer families only)
method=trace     the real model run on fake tensors → event log → caching-allocator replay
method=auto      trace when the model can be built and traced, else analytic (the report says so)

Whatever the method, the report carries all three predicted numbers: allocated
(``max_memory_allocated``), reserved (``max_memory_reserved``) and device_used (nvidia-smi),
plus the verdict against a GPU and the largest batch that fits.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..errors import TraceError, WorkloadError
from ..models.pipelines import pipeline_folder
from ..models.spec import Family, ModelSpec
from ..recipes import notes as recipe_notes
from ..results import Fallback, GpuPeak, MemoryReport, Peak, Verdict
from ..target import DeviceProfile
from ..workload import Method, Task, Workload, as_enum
from .device import bf16_notes, profile
from .methods import (
    MethodResult,
    analytic_core,
    analytic_device_used,
    trace_catalog_model,
    trace_core,
)
from .resolve import resolve_gpu, resolve_model

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU


def estimate(
    model: str | ModelSpec,
    workload: Workload | None = None,
    *,
    gpu: str | GPU | None = None,
    method: str | Method = Method.AUTO,
    alloc_conf: str | None = None,
    num_gpus: int = 1,
    search_max_batch: bool = True,
    checkpoint_policy: Any = None,
    **workload_fields: Any,
) -> MemoryReport:
    """Predict one workload's per-GPU memory.

    ``workload`` fields may also be given as keywords: ``estimate("llama-3.1-8b", batch=4)``.
    ``checkpoint_policy``: a selective-checkpointing policy for PyTorch's
    ``create_selective_checkpoint_contexts`` (a function or a list of ops to save), run on the
    checkpointed layers by the trace (the analytic method cannot evaluate one).
    """
    w = _workload(workload, workload_fields)
    m = as_enum(Method, method, "method")
    folder = pipeline_folder(model) if isinstance(model, str) else None
    if folder is not None and isinstance(model, str):  # a whole diffusers pipeline: its call traced as `vramplan run` runs a script
        from .diffusion import estimate_pipeline

        if checkpoint_policy is not None or num_gpus != 1:
            raise WorkloadError(f"{model} is a whole pipeline: one call on one GPU, no checkpoint policy",
                                hint="leave the checkpoint policy and the GPU count out")
        return estimate_pipeline(model.strip(), folder, w, resolve_gpu(gpu), method=m, alloc_conf=alloc_conf)
    spec = resolve_model(model)
    g = resolve_gpu(gpu)
    if alloc_conf:
        from ..allocator import parse_conf

        parse_conf(alloc_conf)  # fail early on a bad string
    _check(spec, w)
    if checkpoint_policy is not None:
        if m is Method.ANALYTIC:
            raise WorkloadError("a checkpoint_policy function runs only under the trace",
                                hint="use `method=trace` (or auto)", field="checkpoint_policy")
        m = Method.TRACE
    dev = profile(g, w)  # built once: the trace, the formulas and the verdict read it
    report = _report(spec, w, g, dev, m, alloc_conf, num_gpus, checkpoint_policy)
    # (a traced vision-language model is not confirmed at other batches: its traces loop over the
    # images, and its masks read values at batches its own trace did not run)
    if g is not None and search_max_batch and has_analytic(spec) and (
            spec.family is not Family.OTHER or report.method is Method.ANALYTIC):
        report = _with_largest_batch(report, spec, g, dev, alloc_conf, checkpoint_policy)
    return report


def _workload(workload: Workload | None, fields: dict[str, Any]) -> Workload:
    """The workload to estimate: ``workload`` with ``fields`` changed, or ``fields`` alone;
    ``recipe=NAME`` among the fields fills the knobs not given with that recipe's defaults."""
    if workload is not None:
        return workload.replace(**fields)
    recipe = fields.pop("recipe", None)
    if recipe is not None:
        from ..recipes import apply

        return apply(recipe, **fields)
    return Workload(**fields)


def _report(spec: ModelSpec, w: Workload, g: GPU | None, dev: DeviceProfile, m: Method,
            alloc_conf: str | None, num_gpus: int, checkpoint_policy: Any = None, *,
            confirmation: bool = False) -> MemoryReport:
    """One estimate of a checked workload, without the largest-batch search.

    ``confirmation``: the report only confirms a point of a boundary search (its device_used
    and whether it fits are read, then it is dropped): a traced step above the GPU's
    allocator capacity is not replayed a second time within it (see :func:`trace_core`)."""
    from .rollout import with_rollout

    dev = with_rollout(dev, spec, w, g)  # (a colocated rollout engine is sized per workload)
    notes: list[str] = []
    length = w.seq + (w.new_tokens if w.task is Task.GENERATE else 0)
    if spec.max_positions and spec.family not in (Family.VIT, Family.OTHER) and length > spec.max_positions:
        notes.append(f"{length:,} tokens exceed the {spec.max_positions:,} positions {spec.name} was configured "
                     "for (max_position_embeddings): memory is predicted as if it runs, quality is not")
    core: MethodResult
    fallback: Fallback | None = None
    if m is Method.ANALYTIC:
        core = analytic_core(spec, w, dev)
    else:
        try:
            core = trace_core(trace_catalog_model(spec, w, dev, checkpoint_policy), w, alloc_conf,
                              dev.allocator_capacity, within_capacity=not confirmation)
        except TraceError as e:
            if m is Method.TRACE or not has_analytic(spec):
                raise
            fallback = Fallback(requested=Method.TRACE, used=Method.ANALYTIC, reason=str(e))
            try:
                core = analytic_core(spec, w, dev)
            except WorkloadError:
                raise e from None  # (the analytic method refuses it too: the trace's reason is the one to fix)
    notes += bf16_notes(dev, w, core.method) if g is not None else []
    if alloc_conf and core.method is Method.ANALYTIC:
        notes.append(f"`alloc_conf={alloc_conf}` is not simulated by the analytic method: reserved is "
                     "allocated plus an assumed slack (use `method=trace`)")
    refused = ""
    if dev.rollout is not None:
        from .rollout import refusal

        refused = refusal(dev, core.model_states.weights if core.model_states is not None else 0, w)
        notes.append(dev.rollout.summary)
        if refused:
            notes.append(f"vLLM refuses to start on this GPU: {refused}")
    return finish(core, spec.name, w, g, dev, notes=notes, num_gpus=num_gpus, fallback=fallback, spec=spec,
                  refused=refused)


def _with_largest_batch(report: MemoryReport, spec: ModelSpec, g: GPU, dev: DeviceProfile,
                        alloc_conf: str | None, checkpoint_policy: Any = None) -> MemoryReport:
    """The verdict's largest batch, by the engine's one boundary search (the one ``fit``
    runs): the analytic curve shapes it, the report's own method confirms the boundary and
    the batch above it. A traced estimate therefore costs about two more traces."""
    w, v = report.workload, report.verdict
    assert v is not None
    if v.refused:  # (no batch starts the job: the framework's refusal does not depend on the bytes)
        return report.replace(verdict=dataclasses.replace(v, max_batch=0),
                              notes=("largest batch none: the job does not start on this GPU (see the verdict)",
                                     *report.notes))
    cache: dict[int, MemoryReport] = {w.batch: report}

    def confirm(wx: Workload) -> MemoryReport:
        if wx.batch not in cache:
            cache[wx.batch] = _report(spec, wx, g, dev, report.method, alloc_conf, v.num_gpus, checkpoint_policy,
                                      confirmation=True)
        return cache[wx.batch]

    def analytic(wx: Workload) -> int | None:
        from .rollout import with_rollout

        return analytic_device_used(spec, wx, with_rollout(dev, spec, wx, g))

    from .boundary import BoundarySearch
    from .margin import describe, margin_limit, margin_of

    exact = report.method is Method.ANALYTIC  # the curve is the answer: nothing to confirm
    # `auto` fell back to the formulas: the boundary keeps a measured margin below the usable bytes (as fit's)
    margin = margin_of(spec, w) if report.fallback is not None else None
    limit = v.usable if margin is None else margin_limit(v.usable, margin)
    bd = BoundarySearch(confirm, analytic, limit, exact=exact)
    if not exact and bd.analytic is not None and bd.analytic(w) is None:
        return report.replace(notes=("no analytic curve for this workload to shape a largest-batch search "
                                     "(`vramplan fit` searches with traces)", *report.notes))
    res = bd.largest_batch(w)
    extra = sum(1 for b in cache if b != w.batch)
    largest = f"largest batch {res.value}" if res.value > 0 else "largest batch none (batch 1 does not fit)"
    note = (f"{largest}: the engine's boundary search on the analytic curve (as `fit` runs it)"
            if exact else
            f"{largest}: the engine's boundary search (as `fit` runs it), confirmed with "
            f"the {report.method} method at the boundary and the batch above ({extra} more estimate(s))")
    if margin is not None:
        note += (f", because `method=auto` fell back to the formulas {describe(margin)}: {limit:,} of "
                 f"{v.usable:,} B")
        if v.fits and report.peak.device_used > limit:
            note += "; this batch fits by the formulas but within that margin, where a trace may not"
    verdict = dataclasses.replace(v, max_batch=max(res.value, 0))
    return report.replace(verdict=verdict, notes=(note, *report.notes))


def has_analytic(spec: ModelSpec) -> bool:
    from ..models.params import VLM_COUNTED  # (Qwen2.5-VL: vramplan.analytic.vlm)

    return spec.family is not Family.OTHER or spec.model_type in VLM_COUNTED


def _check(spec: ModelSpec, w: Workload) -> None:
    from ..recipes import check
    from .diffusion import check_pipeline_fields

    check(w)  # a knob the recipe's framework cannot run
    check_pipeline_fields(w, spec.name, video=spec.config.get("_class_name") == "WanTransformer3DModel")
    if spec.family is Family.OTHER:
        if w.task is Task.GENERATE and not spec.vocab:
            raise WorkloadError(f"{spec.name} takes no token ids and does not generate text",
                                hint="use `task=infer` or `task=train`", field="task")
        return
    from ..analytic import check_against_model

    check_against_model(spec, w)


def finish(core: MethodResult, name: str, w: Workload, g: GPU | None, dev: DeviceProfile, *,
           notes: list[str], num_gpus: int = 1, fallback: Fallback | None = None,
           user_model: bool = False, spec: ModelSpec | None = None, refused: str = "",
           gpus: tuple[tuple[int, int, int], ...] = ()) -> MemoryReport:
    """Add the device's share (overhead outside the allocator, the verdict) to a method's result.
    ``gpus``: (index, allocated, reserved) of each GPU other than 0 a run spread a model over (a
    device map), each with the same outside-the-allocator share: the verdict is the fullest GPU's."""
    overhead = dev.overhead
    peak = Peak(allocated=core.allocated, reserved=core.reserved, device_used=core.reserved + dev.overhead_bytes)
    per_gpu = (GpuPeak(0, peak.allocated, peak.reserved, peak.device_used),
               *(GpuPeak(i, a, r, r + dev.overhead_bytes) for i, a, r in gpus)) if gpus else ()
    verdict = None
    if g is not None and dev.usable is not None:
        use, usable_src = dev.usable, dev.usable_source
        verdict = Verdict(
            gpu=g.key, gpu_name=g.name, capacity=g.capacity, usable=use,
            fits=False, headroom=0, max_batch=None,
            num_gpus=num_gpus, capacity_source=usable_src, refused=refused,
        )
    timeline = core.timeline
    report = MemoryReport(
        model=name, params=core.params, trainable_params=core.trainable_params, workload=w,
        method=core.method, breakdown=core.breakdown, overhead=overhead, peak=peak,
        peak_phase=core.peak_phase, phases=core.phases, verdict=verdict, allocator=core.allocator,
        notes=tuple(notes) + recipe_notes(w) + core.notes,
        top_modules=core.top_modules, top_tensors=core.top_tensors,
        iterations=core.iterations, timeline=timeline, model_states=core.model_states,
        flops_per_step=core.flops_per_step, host_memory=core.host_memory, host_parts=core.host_parts, events=core.events, fallback=fallback, user_model=user_model,
        gpus=per_gpu,
        **_axes(spec),  # type: ignore[arg-type]
    )
    if verdict is not None:  # the one rule for "fits", also the boundary search's
        from .boundary import fits

        report = report.replace(verdict=dataclasses.replace(verdict, fits=fits(report, verdict.usable),
                                                            headroom=verdict.usable - report.device_used_worst))
    return report


def _axes(spec: ModelSpec | None) -> dict[str, bool]:
    """Which workload axes the model has, for the report's header (a CNN has no sequence)."""
    if spec is None:
        return {}
    return {"has_sequence": spec.family in (Family.DENSE, Family.MOE, Family.MLA, Family.ENCODER) or spec.vocab > 0,
            "has_attention": spec.family is not Family.OTHER or spec.heads > 0}


__all__ = ["estimate", "finish", "has_analytic"]
