"""A whole diffusers pipeline (text encoders, denoising steps, VAE decode) → MemoryReport.

The pipeline is built from its configs (:mod:`vramplan.models.pipelines`: the catalog's or a local
folder) and called once by :mod:`vramplan.models.pipeline_run`, a script run as ``vramplan run``
runs one (:func:`vramplan.script.runner.trace_script`): the same emulated GPU, the same hooks for
diffusers' offload, the same report. Two denoising steps are traced: every step runs the
denoiser on the same shapes and frees what it made, so the peak does not grow with steps. The
report names the part of the call the peak falls in (text encoding, a denoising step, the VAE
decode) from the top-level model calls the run recorded.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..errors import WorkloadError
from ..results import MemoryReport
from ..workload import Attention, CpuOffload, Method, Parallel, Precision, Task, Workload
from .device import profile
from .methods import trace_core
from .pipeline import finish

if TYPE_CHECKING:
    from pathlib import Path

    from ..hardware.gpu import GPU
    from ..models.pipelines import PipelineConfigs

TRACED_STEPS = 2
"""Denoising steps the trace runs (the first and a repeat of it)."""
_DTYPE = {Precision.BF16: "bf16", Precision.FP16: "fp16", Precision.FP32: "fp32"}
_APPLIES = frozenset({"task", "batch", "precision", "image_size", "image_height", "attention", "parallel",
                      "denoising_steps", "cpu_offload", "vae_tiling", "frames"})
"""Workload fields a pipeline's inference reads; any other must keep its default."""
_PIPELINE_ONLY = ("denoising_steps", "cpu_offload", "vae_tiling", "frames")


def check_pipeline_fields(w: Workload, model: str, *, video: bool = False) -> None:
    """A model that is not a whole pipeline refuses the pipeline's own fields (``video``: a
    text-to-video denoiser, whose step takes ``frames``)."""
    from ..models.pipelines import pipeline_entries

    base = Workload()
    for name in _PIPELINE_ONLY:
        if video and name == "frames":
            continue
        if getattr(w, name) != getattr(base, name):
            raise WorkloadError(f"`{name}={getattr(w, name)}` applies to a whole diffusers pipeline, not {model}",
                                hint=f"estimate a pipeline: {', '.join(pipeline_entries())}, or a local folder "
                                     "with its model_index.json", field=name)


def estimate_pipeline(name: str, folder: Path, w: Workload, g: GPU | None, *, method: Method = Method.AUTO,
                      alloc_conf: str | None = None, timeout: float | None = 600.0,
                      workspaces: bool = True) -> MemoryReport:
    """Trace one call of the pipeline in ``folder`` (``name``: how the user named it) as ``w``
    describes it: ``batch`` images of ``image_size`` × ``image_height`` pixels in ``precision``,
    ``cpu_offload``, ``vae_tiling``, ``denoising_steps``. ``workspaces=False`` leaves out the
    CUDA-only library workspaces (to compare with a CPU run), as ``run_script``'s does."""
    from pathlib import Path  # (here: the analytic command's start-up imports no pathlib)

    from ..emulate.facts import facts_of
    from ..models.pipelines import pipeline_alias, pipeline_entries, read_pipeline
    from ..script.runner import trace_script

    if method is Method.ANALYTIC:
        raise WorkloadError(f"{name} is a whole pipeline: it is traced, it has no closed-form estimate",
                            hint="use `method=trace` (or auto)", field="method")
    _check(w, name)
    cfg = read_pipeline(folder, name)
    call = call_defaults(cfg)
    if w.frames and "num_frames" not in call:
        raise WorkloadError(f"`frames={w.frames}`: {cfg.pipeline_class} makes images, its call takes no num_frames",
                            hint="drop `frames` (it applies to a text-to-video pipeline such as WanPipeline)",
                            field="frames")
    steps = w.denoising_steps or _default_steps(cfg)
    traced = min(steps, TRACED_STEPS)
    width, height, own_size = _size(w, call)
    argv = [str(folder), "--size", str(width), "--height", str(height), "--steps", str(traced),
            "--batch", str(w.batch), "--dtype", _DTYPE[w.precision]]
    argv += ["--frames", str(w.frames)] if w.frames else []
    argv += ["--offload", str(w.cpu_offload)] if w.cpu_offload is not CpuOffload.NONE else []
    argv += ["--vae-tiling"] if w.vae_tiling else []
    dev = profile(g, w)
    if not workspaces:
        dev = dev.without_workspaces()
    facts = facts_of(g.name if g is not None else dev.name, dev.sm, dev.usable, dev.overhead_bytes,
                     sm_count=(g.sm_count or 0) if g is not None else 0)
    from ..models import pipeline_run

    # (steps: the run's own stopping rule never cuts the call short; the pipeline ends it)
    tr, run = trace_script(Path(pipeline_run.__file__), argv, profile=dev, facts=facts, steps=1 << 30,
                           timeout=timeout, alloc_conf=alloc_conf)
    core = trace_core(tr, w, alloc_conf, dev.allocator_capacity)
    alias = pipeline_alias(name)
    params = pipeline_entries()[alias].params if alias is not None else sum(_count(cfg).values())
    where = peak_part(run.calls, tr.peak_index, cfg, traced)
    how = {CpuOffload.NONE: 'pipe.to("cuda")', CpuOffload.MODEL: "enable_model_cpu_offload()",
           CpuOffload.SEQUENTIAL: "enable_sequential_cpu_offload()"}[w.cpu_offload]
    size = f"{width} × {height} pixels" + (" (the pipeline's default size)" if own_size else "")
    made = f"{w.batch} image(s) of {size}"
    if "num_frames" in call:
        made = f"{w.batch} video(s) of {_frames_text(cfg, w.frames, call['num_frames'])}, {size}"
    notes = [f"the peak is in {where}: {cfg.pipeline_class} called once ({made}, "
             f"{w.precision}, {how}{', vae.enable_tiling()' if w.vae_tiling else ''})",
             _steps_note(steps, traced, w.denoising_steps == 0)]
    host = 0
    parts: tuple[tuple[str, int], ...] = ()
    if w.cpu_offload is not CpuOffload.NONE:
        host = params * (4 if w.precision is Precision.FP32 else 2)
        parts = ((f"the pipeline's weights, where {_OFFLOAD[w.cpu_offload]} keeps them between calls", host),)
    core = dataclasses.replace(core, host_memory=host, host_parts=parts)
    report = finish(core, name, w, g, dev, notes=notes)
    return report.replace(params=params, trainable_params=0, has_sequence=False)


_OFFLOAD = {CpuOffload.MODEL: "enable_model_cpu_offload", CpuOffload.SEQUENTIAL: "enable_sequential_cpu_offload"}


def _check(w: Workload, name: str) -> None:
    if w.task is not Task.INFER:
        raise WorkloadError(f"{name} is a whole pipeline: its call is inference (`task=infer`), not {w.task}",
                            hint="use `task=infer`; a training step of the denoiser is its own entry's "
                                 "(e.g. flux.1-dev with `task=train`)", field="task")
    if w.precision not in _DTYPE:
        raise WorkloadError(f"`precision={w.precision}`: a pipeline runs in one dtype (bf16, fp16 or fp32)",
                            hint="use `precision=bf16`", field="precision")
    if w.attention is not Attention.SDPA:
        raise WorkloadError(f"`attention={w.attention}`: diffusers' pipelines run their default attention "
                            "processors (PyTorch's SDPA)", hint="use `attention=sdpa`", field="attention")
    if w.parallel != Parallel():
        raise WorkloadError("a pipeline runs on one GPU: no parallel layout", hint="drop the layout", field="dp")
    base = Workload(task=Task.INFER)
    for f in dataclasses.fields(Workload):
        if f.name not in _APPLIES and getattr(w, f.name) != getattr(base, f.name):
            raise WorkloadError(f"`{f.name}={getattr(w, f.name)}` does not apply to a pipeline's call",
                                hint=f"drop `{f.name}`", field=f.name)
    if w.image_size % 16 or (w.image_height and w.image_height % 16):
        raise WorkloadError(f"image {w.image_size}x{w.image_height or w.image_size}: a pipeline's sides are "
                            "multiples of 16 pixels (8x the VAE's latents, 2x2 patches)",
                            hint="e.g. `image_size=1024`", field="image_size")


def call_defaults(cfg: PipelineConfigs) -> dict[str, int | None]:
    """The pipeline's own call's defaults vramplan reads: ``height``, ``width``, ``num_frames``,
    ``num_inference_steps`` (each present if the call takes it; None where the pipeline computes
    it from its models, as FluxPipeline's size). WanPipeline: 480, 832, 81, 50."""
    import inspect

    import diffusers

    cls = getattr(diffusers, cfg.pipeline_class, None)
    if cls is None:
        return {}
    params = inspect.signature(cls.__call__).parameters
    return {k: (p.default if isinstance(p.default, int) and not isinstance(p.default, bool) else None)
            for k, p in params.items() if k in ("height", "width", "num_frames", "num_inference_steps")}


def _default_steps(cfg: PipelineConfigs) -> int:
    """The pipeline's own ``num_inference_steps`` default (FluxPipeline 28, SDXL 50, Wan 50)."""
    return call_defaults(cfg).get("num_inference_steps") or 50


def _size(w: Workload, call: dict[str, int | None]) -> tuple[int, int, bool]:
    """(width, height, whether they are the pipeline's own default): ``image_size`` and
    ``image_height`` as given, but at their defaults (224, square) a pipeline whose call names a
    size of its own (WanPipeline's 832 × 480) makes that size; give ``image_size=224,
    image_height=224`` for a 224-pixel square there."""
    base = Workload()
    own_w, own_h = call.get("width"), call.get("height")
    if (w.image_size, w.image_height) == (base.image_size, base.image_height) and own_w and own_h:
        return own_w, own_h, True
    return w.image_size, w.image_height or w.image_size, False


def _frames_text(cfg: PipelineConfigs, given: int, default: int | None) -> str:
    """The frames the call makes: ``given`` (0: the pipeline's default), rounded as WanPipeline
    rounds them (diffusers 0.42 pipeline_wan.py ``__call__``: ``num_frames - 1`` not a multiple of
    the VAE's ``scale_factor_temporal`` becomes ``num_frames // t * t + 1``, with a warning)."""
    frames = given or default or 0
    text = f"{frames} frames" + ("" if given else " (the pipeline's default)")
    if cfg.pipeline_class.startswith("Wan"):
        t = int(cfg.components.get("vae", ("", "", {}))[2].get("scale_factor_temporal", _WAN_TEMPORAL))
        if frames % t != 1:
            made = max(frames // t * t + 1, 1)
            text = (f"{made} frames (`frames={frames}` rounded as {cfg.pipeline_class} rounds it: "
                    f"num_frames - 1 a multiple of {t})")
    return text


_WAN_TEMPORAL = 4
"""AutoencoderKLWan's ``scale_factor_temporal`` default (diffusers 0.42 autoencoder_kl_wan.py),
for a VAE config that does not name it (the Wan 2.1 repositories' do not)."""


def _count(cfg: PipelineConfigs) -> dict[str, int]:
    from ..models.pipelines import count_component_params

    return count_component_params(cfg)


def _steps_note(steps: int, traced: int, default: bool) -> str:
    given = "the pipeline's default" if default else "given"
    if steps <= traced:
        return f"{steps} denoising step(s) ({given}), all traced"
    return (f"{steps} denoising steps ({given}): {traced} traced; each further step runs the denoiser on the "
            f"same shapes and frees what it made, so the peak does not grow with steps (only the scheduler's "
            f"timestep and sigma tables do, 4 B a step each)")


def peak_part(calls: list[tuple[str, int, int]], k: int, cfg: PipelineConfigs, steps: int = 0) -> str:
    """The part of the pipeline's call that event ``k`` (the peak) falls in, from the run's
    top-level model calls: a text encoder, a denoising step, the VAE decode (the calls after the
    denoising loop), or the pipeline's own code between two calls. ``steps``: the denoising steps
    run; where the denoiser ran more often (WanPipeline calls it for the prompt, then for the
    negative prompt), the label names the call within its step."""
    den_cls = cfg.components[cfg.denoiser][1]
    encoders = {cls: key for key, (_, cls, _) in cfg.components.items() if cfg.role(key) == "text encoding"}
    den_calls = sum(1 for c in calls if c[0] == den_cls)
    per = den_calls // steps if steps and den_calls % steps == 0 and den_calls > steps else 1
    n = 0
    step = 0
    before = ""
    for cls, first, end in calls:
        if cls == den_cls:
            n += 1
            step = (n - 1) // per + 1
        within = f", call {(n - 1) % per + 1} of {per}" if per > 1 else ""
        label = (f"denoising step {step} ({cls}{within})" if cls == den_cls else
                 f"text encoding ({cls}, {encoders[cls]})" if cls in encoders else
                 f"the VAE decode ({cls})" if step else cls)
        if first <= k and (end < 0 or k < end):
            return label
        if first > k:
            return f"the pipeline's own code between {before or 'its start'} and {label}"
        before = label
    return f"the pipeline's own code after {before}" if before else "the pipeline's own code"


__all__ = ["TRACED_STEPS", "call_defaults", "check_pipeline_fields", "estimate_pipeline", "peak_part"]
