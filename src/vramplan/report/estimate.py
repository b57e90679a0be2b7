"""Doc builder for a :class:`~vramplan.results.MemoryReport` (estimate and trace)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..results import BREAKDOWN_KEYS, MemoryReport, ModuleStat
from ..units import GiB
from ..workload import Rollout, Workload
from .doc import Doc, KeyValues, Notes, Table

if TYPE_CHECKING:
    from ..planner.nextstep import Suggestion

_LABELS = {
    "weights": "weights (params + buffers)",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations (saved for backward, inputs)",
    "temporaries": "temporaries at the peak",
    "kv_cache": "KV cache",
}


def g(n: int | float) -> str:
    return f"{n / GiB:,.2f}"


def pct(n: int | float, total: int | float) -> str:
    return f"{100 * n / total:.1f} %" if total else "–"


def count(n: int) -> str:
    """Parameter counts: 8.030 B, 124.4 M, 75.3 K (decimal, as model cards write them)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:,.{3 if unit == 'B' else 1}f} {unit}"
    return str(n)


def workload_line(r: MemoryReport) -> str:
    if r.ran is not None:  # a script: what it did, not what vramplan would default to
        return r.ran.line()
    w = r.workload
    parts = [f"task {w.task}" + (f" ({w.objective.value.upper()})" if w.objective.value != "sft" else "")]
    if not r.user_model:  # a user's own inputs fix their own shapes
        dpo = w.objective.value == "dpo"
        parts.append(f"batch {w.batch} pairs ({w.sequences} sequences)" if dpo else f"batch {w.batch}")
        if r.has_sequence and w.objective.value == "grpo":
            parts.append(f"seq {w.seq} (prompt {w.prompt} + completion {w.completion}) · {w.generations} generations")
            if w.rollout is Rollout.VLLM:
                parts.append(f"vLLM colocated ({w.vllm_memory:g} of the GPU{', sleep mode' if w.vllm_sleep else ''})")
        elif r.has_sequence:
            parts.append(f"seq {w.seq}")
            if w.images:
                width, height = w.image_hw
                parts.append(f"{w.images} image{'s' if w.images > 1 else ''} {width}x{height} per sequence")
            if w.videos:
                width, height = w.image_hw
                parts.append(f"{w.videos} video{'s' if w.videos > 1 else ''} of {w.video_frames} frames {width}x{height}"
                             " per sequence")
        else:
            parts.append(f"image {w.image_size}" + (f"x{w.image_height}" if w.image_height else ""))
    if w.frames:
        parts.append(f"{w.frames} frames")
    if w.denoising_steps:
        parts.append(f"{w.denoising_steps} denoising steps")
    if w.cpu_offload.value != "none":
        parts.append(f"{w.cpu_offload} CPU offload")
    if w.vae_tiling:
        parts.append("VAE tiling")
    if w.task.value == "generate":
        parts.append(f"+{w.new_tokens} new tokens")
    parts.append(str(w.precision))
    if w.training:
        parts.append(f"{w.optimizer} ({w.optimizer_impl})")
        if w.grad_accum > 1:
            parts.append(f"grad-accum {w.grad_accum}")
        parts.append(f"checkpointing {w.checkpointing}")
    if w.peft.value != "none":
        parts.append(f"{w.peft} r={w.lora_rank}" + (" DoRA" if w.lora_dora else "") + (" rsLoRA" if w.lora_rslora else ""))
    if w.quant.value != "none":
        parts.append(f"{w.quant} weights")
    if r.has_attention:
        parts.append(f"attention {w.attention}")
    p = w.parallel
    par = []
    if p.dp > 1 or p.zero:
        par.append(f"dp {p.dp} ZeRO-{p.zero}")
    for k in ("tp", "pp", "cp", "ep"):
        if getattr(p, k) > 1:
            par.append(f"{k} {getattr(p, k)}")
    if p.pp > 1:
        par.append(p.pp_schedule + (f" {p.stages_per_rank}/rank" if p.stages_per_rank > 1 else ""))
    if p.sp:
        par.append("sp")
    if p.offload_optimizer:
        par.append("optimizer offload")
    if p.offload_params:
        par.append("param offload")
    if par:
        parts.append(", ".join(par))
    return " · ".join(parts)


def _knob(field: str, value: object) -> str:
    text = ("on" if value else "off") if isinstance(value, bool) else str(value)
    return f"{field.replace('_', '-')} {text}"


def loop_line(r: MemoryReport) -> str | None:
    """The report header's loop line (None: the plain loop with every default)."""
    text = loop_text(r.workload)
    return f"loop: {text}" if text else None


def loop_text(w: Workload) -> str | None:
    """The loop's knobs that differ from vramplan's defaults: the recipe and the defaults it
    applied, the values given instead of its defaults, and any other knob set (None: the
    plain loop with every default)."""
    from ..recipes import get, is_default, summary

    s = summary(w)
    if s.empty:
        return None
    parts = []
    applied = [_knob(k, v) for k, v in s.applied if not is_default(k, v)]
    if s.recipe.value != "plain":
        parts.append(f"recipe {s.recipe} ({get(s.recipe).framework})"
                     + (f" applied {', '.join(applied)}" if applied else " applied vramplan's defaults"))
    if s.overridden:
        parts.append("given instead of its defaults " + ", ".join(
            f"{_knob(k, v)} (recipe: {_knob(k, d).split(' ', 1)[1]})" for k, v, d in s.overridden))
    if s.other:
        parts.append(", ".join(_knob(k, v) for k, v in s.other))
    return " · ".join(parts)


def _outermost(mods: Sequence[ModuleStat]) -> list[ModuleStat]:
    """Drop a module nested in another listed one at about the same peak (the peak of
    ``model.layers.31.mlp`` is that of ``model.layers.31`` and of ``model``): one row per place."""
    out: list[ModuleStat] = []
    for m in mods:
        dup = any((m.module.startswith(o.module + ".") or not o.module) and abs(m.peak - o.peak) <= 0.01 * max(o.peak, 1)
                  for o in out)
        if not dup:
            out.append(m)
    return out


def to_doc(r: MemoryReport) -> Doc:
    doc = Doc(
        title=f"vramplan {'run' if r.ran is not None else 'trace' if r.user_model else 'estimate'}: {r.model} — "
        f"{count(r.params)} params"
        + (f" ({count(r.trainable_params)} trainable)" if r.trainable_params != r.params else ""),
        subtitle="\n".join(line for line in (
            workload_line(r), loop_line(r), f"method: {r.method} · sizes in GiB (2^30 bytes), per GPU") if line),
    )
    pk = r.peak
    b = r.breakdown
    rows = [[_LABELS[k], g(getattr(b, k)), pct(getattr(b, k), pk.device_used)]
            for k in BREAKDOWN_KEYS if getattr(b, k)]
    rows.append(["= allocated (max_memory_allocated)", g(pk.allocated), pct(pk.allocated, pk.device_used)])
    slack = pk.reserved - pk.allocated
    alloc_label = "allocator cache / fragmentation"
    if r.allocator is not None and r.allocator.backend.startswith("none"):
        alloc_label += " (assumed)"
    rows.append([alloc_label, g(slack), pct(slack, pk.device_used)])
    rows.append(["= reserved (max_memory_reserved)", g(pk.reserved), pct(pk.reserved, pk.device_used)])
    for o in r.overhead:
        rows.append([f"{o.name} (outside the allocator)", g(o.bytes), pct(o.bytes, pk.device_used)])
    where = "where the memory goes on GPU 0 (at its peak)" if r.gpus else "where the memory goes (at the peak)"
    doc.add(Table([where, "GiB", "share"], rows,
                  footer=["= device used (nvidia-smi)", g(pk.device_used), "100.0 %"]))
    if r.gpus:
        doc.add(_gpus_table(r))

    kv: list[tuple[str, str]] = [("peak phase", str(r.peak_phase))]
    if r.model_states is not None and r.workload.training:
        ms = r.model_states
        kv.append(("model states", f"{g(ms.total)} GiB persistent = weights {g(ms.weights)} + gradients "
                   f"{g(ms.gradients)} + optimizer {g(ms.optimizer)}"))
    if r.host_memory:
        parts = "; ".join(f"{name} {g(n)}" for name, n in r.host_parts) if r.host_parts else \
            "pinned, offloaded activations"
        kv.append(("host RAM", f"{g(r.host_memory)} GiB CPU memory per GPU ({parts})"))
    if r.iterations:
        kv.append(("per iteration", ", ".join(
            f"#{i.iteration}: {g(i.allocated)} GiB ({i.phase})" for i in r.iterations)))
    if r.allocator is not None and not r.allocator.backend.startswith("none"):
        a = r.allocator
        kv.append(("allocator", f"{a.backend}{' ' + a.conf if a.conf else ''}: {a.segments} segments, "
                   f"fragmentation at peak {a.fragmentation_at_peak:.1%}"
                   + (f"; when the GPU's memory ran out, it freed its cache and retried {a.alloc_retries} times, "
                      "an allocation still failed: CUDA out of memory (the job needs more than the GPU has)"
                      if a.ooms else f", cache flushes and retries {a.alloc_retries}" if a.alloc_retries else "")))
    v = r.verdict
    if v is not None:
        verdict = "FITS" if v.fits else "DOES NOT FIT"
        head = f"{g(abs(v.headroom))} GiB {'headroom' if v.headroom >= 0 else 'short'}"
        kv.append(("GPU", f"{v.gpu_name} ({v.gpu}): {g(v.capacity)} GiB, usable {g(v.usable)} GiB"
                   + (f" [{v.capacity_source}]" if v.capacity_source else "")))
        worst = r.worst_gpu
        by = f" on GPU {worst.gpu}, the fullest of {len(r.gpus)}" if worst is not None else ""
        kv.append(("verdict", f"{verdict} — {head}{by}" + (f"; refused at start-up: {v.refused}" if v.refused else "")))
        if v.max_batch is not None:
            kv.append(("largest batch that fits", str(v.max_batch) if v.max_batch else "none (batch 1 does not fit)"))
    doc.add(KeyValues(kv))

    if r.phases:
        doc.add(Table(
            ["phase", "allocated GiB", *[k for k in BREAKDOWN_KEYS]],
            [[str(p.phase), g(p.allocated), *[g(getattr(p.breakdown, k)) for k in BREAKDOWN_KEYS]]
             for p in r.phases],
            title="Peak of each phase (GiB)",
        ))
    if r.top_modules:
        doc.add(Table(["module", "peak GiB"], [[m.module or "(root)", g(m.peak)] for m in _outermost(r.top_modules)[:8]],
                      title="Modules with the highest memory while running"))
    if r.top_tensors:
        doc.add(Table(
            ["tensor", "category", "module", "op", "MiB"],
            [[f"{t.dtype}{list(t.shape)}", t.category, t.module or "–", t.op or "–", f"{t.nbytes / 2**20:,.1f}"]
             for t in r.top_tensors[:8]],
            title="Largest live tensors at the peak", align=["l", "l", "l", "l", "r"],
        ))
    sources = [f"{o.name}: {o.source}" for o in r.overhead]
    fallback = [r.fallback.sentence()] if r.fallback is not None else []
    doc.add(Notes(fallback + list(r.notes) + sources))
    return doc


def _gpus_table(r: MemoryReport) -> Table:
    """Each GPU's peak of a run spread over several GPUs (a device map), the fullest marked."""
    worst = r.worst_gpu
    usable = r.verdict.usable if r.verdict is not None else None
    rows = []
    for x in r.gpus:
        room = "" if usable is None else g(usable - x.device_used)
        rows.append([f"GPU {x.gpu}" + (" (fullest)" if worst is not None and x.gpu == worst.gpu and len(r.gpus) > 1
                                        else ""), g(x.allocated), g(x.reserved), g(x.device_used), room])
    return Table(["GPU", "allocated", "reserved", "device used (nvidia-smi)", "headroom"], rows,
                 title="Each GPU of the device map (GiB): its own allocations through the allocator simulation")


def answer(r: MemoryReport, fix: Suggestion | None, *, searched: bool = True) -> KeyValues | None:
    """The question the estimate answers, its verdict and (when it does not fit) the change
    that makes it fit, together, to end the report (None without a GPU). ``searched``: the
    planner's list of single changes was tried (``fix`` None then means none fits)."""
    v = r.verdict
    if v is None:
        return None
    n = r.workload.parallel.world_size
    gpus = f"{n}× {v.gpu_name} (per GPU)" if n > 1 else v.gpu_name
    items = [("question", f"does {r.model} ({workload_line(r)}) fit on {gpus}?")]
    worst = r.worst_gpu
    on = f" on GPU {worst.gpu}, the fullest of {len(r.gpus)}" if worst is not None else ""
    used = f"{g(r.device_used_worst)} GiB device used{on} ({r.method}) of {g(v.usable)} GiB usable"
    if v.fits and r.fallback is not None and v.max_batch is not None and v.max_batch < r.workload.batch:
        items.append(("answer", f"yes by the formulas ({used}), but within their margin, where a trace may not "
                      f"fit (see the notes); largest batch {v.max_batch} with the margin"))
    elif v.fits:
        batch = f"; largest batch {v.max_batch}" if v.max_batch else ""
        items.append(("answer", f"yes: {used}, {g(v.headroom)} GiB headroom{batch}"))
    else:
        short = (f"vLLM refuses to start ({used}): {v.refused}" if v.refused
                 else f"{used}, {g(-v.headroom)} GiB short")
        items.append(("answer", f"no: {short}"))
        if fix is not None:
            items.append(("to fit", fix.sentence()))
        elif searched:
            items.append(("to fit", f"no single change makes it fit: `vramplan plan {r.model} --gpu {v.gpu} "
                          "--allow-peft --gpus 8` searches combinations"))
    return KeyValues(items, title="Answer")
