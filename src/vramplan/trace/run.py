"""Entry points: trace a user's model, or a catalog model under a workload.

Both build (or copy) the model on ``meta``, apply the workload's features, run
``iterations`` steps under a :class:`~vramplan.trace.session.TraceSession` and read the
figures from the event log.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..emulate.construct import fake_construction
from ..emulate.facts import DeviceFacts, facts_of
from ..emulate.tensors import raw_device
from ..errors import TraceError, VramplanError, WorkloadError
from ..events import Category, EventLog
from ..models.build import quiet
from ..models.spec import ModelSpec
from ..results import HOST_ACTIVATIONS
from ..target import DEFAULT_PROFILE, DeviceProfile
from ..workload import Attention, Float8, Loss, Objective, Peft, Quant, Task, Workload
from . import (
    context_parallel,
    dist,
    features,
    forked,
    grpo,
    offload,
    pipeline_parallel,
    ppo,
    preference,
    replicate,
    reuse,
    summary,
    tensor_parallel,
)
from .dist import rank_session
from .experts import ExpertLoops
from .host import HostMemory
from .layout import (
    Layout,
    LocalShardOptimizer,
    apply_layout,
    apply_reference_layout,
    layout_of,
    pipeline_layout,
    sharded_params,
)
from .loss import loss_note
from .metacache import MetaCache
from .optim import make_optimizer
from .options import FULL_TRACE_ENV as FULL_TRACE_ENV
from .options import TraceOptions
from .recorder import resolve_categories
from .result import TraceResult
from .sac import Policy
from .session import TraceSession
from .steps import RUNNERS, Batch, LossFn, StepPlan, grpo_step, register_in_backward
from .usererror import SHAPE_HINT, shape_mismatch
from .values import SHADOW_LIMIT
from .where import user_frame_of

FORK_FROM = 0.2
"""Seconds the first reduced trace must take for the other two to run side by side
(:func:`.forked.map_forked`): Llama-3.1-8B's train traces (~0.1 s each) gained nothing from a
fork on a 2-core machine (3.07 vs 3.04 s end to end, medians of 10, alternating), DeepSeek-V3's
(~0.9 s each) gain most of one trace."""


@dataclass
class Prepared:
    model: nn.Module
    batch: Batch
    params: int
    trainable: int
    notes: list[str]
    root: str
    compiler: Any = None
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    """Entered around the traced iterations (loss-parallel cross-entropy, ring attention)."""
    mesh: Any = None
    """The fake world's ``DeviceMesh`` the model was laid out on (TP, CP; TP × FSDP/DDP: the
    whole ``(dp, tp)`` mesh, whose data-parallel dimensions the trace shards over), or None."""
    reference: nn.Module | None = None
    """DPO's frozen reference model (``reference=model``): a copy of the model before PEFT."""
    critic: nn.Module | None = None
    """PPO's value model (:mod:`.ppo`): a copy of the backbone before PEFT with a scalar head."""
    reward_model: nn.Module | None = None
    """GRPO/PPO ``reward_model``: a frozen copy of the backbone with a scalar head."""
    layout: Layout | None = None
    """A pipeline rank's data-parallel layout (:func:`.layout.pipeline_layout`; other layouts
    come from the workload, :func:`data_layout`)."""


# --------------------------------------------------------------------------- public
def trace_model(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    inputs: Any,
    *,
    workload: Workload,
    optimizer: Callable[[list[nn.Parameter]], Any] | None = None,
    loss_fn: LossFn | None = None,
    device: DeviceProfile | None = None,
    iterations: int = 2,
    options: TraceOptions | None = None,
    checkpoint_policy: Policy | None = None,
    facts: DeviceFacts | None = None,
) -> TraceResult:
    """Trace one step (``iterations`` times) of any ``nn.Module`` on fake tensors.

    ``model_or_factory``: a module (copied onto ``meta``; its weights are never touched) or
    a function building one (called under ``torch.device("meta")`` with ``.cuda()`` emulated,
    see :mod:`.construct`). ``inputs``: a tensor, a
    tuple of positional arguments, a dict of keyword arguments, or a function returning one
    of these. ``optimizer``: ``params -> torch.optim.Optimizer`` (default: the workload's).
    ``loss_fn(output[, *inputs])``: default the output's ``.loss``, else ``output.sum()``.
    ``checkpoint_policy``: a selective-checkpointing policy for PyTorch's
    ``create_selective_checkpoint_contexts`` (a function ``(ctx, op, *args, **kwargs) ->
    CheckpointPolicy`` or a list of ops to save) run on the checkpointed layers (every
    ``checkpoint_every``-th; implies checkpointing), see :mod:`.sac`.
    """
    _check_iterations(iterations)
    opts = options or TraceOptions()
    if isinstance(optimizer, str):  # a workload optimizer name (e.g. "adamw"), not a factory
        workload = workload.replace(optimizer=optimizer)
        optimizer = None
    if optimizer is not None and not callable(optimizer):
        raise TraceError(f"optimizer must be a function params -> torch.optim.Optimizer, got {optimizer!r}")
    parallel = _parallel_notes(workload)
    if workload.parallel.pp > 1 or workload.parallel.cp > 1:
        raise TraceError("pipeline and context parallelism are traced for catalog models (`vramplan estimate`), "
                         "whose layers and inputs vramplan lays out; a model passed in is traced on one GPU or "
                         "one tensor-parallel rank", hint="drop `pp`/`cp`, or use `method=analytic` on a catalog model")
    model, notes = _materialize(model_or_factory, facts or _facts(device or DEFAULT_PROFILE))
    notes += parallel
    if callable(inputs) and not isinstance(inputs, (torch.Tensor, nn.Module)):
        inputs = inputs()
    batch, shadows = _to_batch(inputs, features.param_dtype(workload))
    root = type(model).__name__
    with parallel_world(workload, rank=opts.rank) as mesh:
        if mesh is not None and workload.parallel.sp:
            kwargs, pos_shadows = tensor_parallel.position_ids(batch[1])
            batch, shadows = (batch[0], kwargs), shadows + pos_shadows
        prepared = _prepare(model, batch, workload, notes, root, device, checkpoint_policy, mesh)
        return _trace(prepared, workload, device, iterations, opts, optimizer=optimizer, loss_fn=loss_fn,
                      shadows=shadows)


def trace_workload(
    spec: ModelSpec, w: Workload, *, device: DeviceProfile | None = None, iterations: int = 2,
    options: TraceOptions | None = None, checkpoint_policy: Policy | None = None,
    models: reuse.ModelStore | None = None,
) -> TraceResult:
    """Trace a catalog model under workload ``w``: build on meta, synthetic inputs,
    the workload's checkpointing, PEFT, quantisation, precision and optimizer.

    ``models``: a store of prepared models to borrow from and give back to, so that traces
    differing only in batch or sequence build each model once (:mod:`.reuse`)."""
    _check_iterations(iterations)
    opts = options or TraceOptions()
    fallback: list[str] = []
    if opts.replicate_layers and w.parallel.pp == 1:
        why = _replication_refused(spec, w, opts, checkpoint_policy)
        if why is None:
            got = _trace_replicated(spec, w, device, iterations, opts, checkpoint_policy, models)
            if isinstance(got, TraceResult):
                return got
            fallback.append(f"identical layers not replicated ({got}): every layer traced")
        if _experts_refused(spec, w, opts) is None:
            # (layers that differ, e.g. gpt-oss's sliding/full pattern: each layer's experts still repeat)
            quick = dataclasses.replace(opts, replicate_layers=False)
            result, note = _trace_experts(spec, w, device, iterations, quick, checkpoint_policy, set(), MetaCache(),
                                          models)
            return dataclasses.replace(result, notes=(*result.notes, *fallback, *([note] if note else [])))
    result = _trace_catalog(spec, w, device, iterations, opts, checkpoint_policy, models=models)
    return dataclasses.replace(result, notes=(*result.notes, *fallback)) if fallback else result


def _replication_refused(spec: ModelSpec, w: Workload, opts: TraceOptions, policy: Policy | None) -> str | None:
    try:
        layout = None if _model_parallel(w) else layout_of(w, rank=opts.rank)
    except VramplanError:
        return "layout"  # (the full trace reports it)
    return replicate.refusal(spec, w, model_parallel=_model_parallel(w), layout=layout, checkpoint_policy=policy)


def _experts_refused(spec: ModelSpec, w: Workload, opts: TraceOptions) -> str | None:
    try:
        layout = None if _model_parallel(w) else layout_of(w, rank=opts.rank)
    except VramplanError:
        return "layout"  # (the full trace reports it)
    return replicate.experts_refusal(spec, w, model_parallel=_model_parallel(w), layout=layout)


def _trace_replicated(spec: ModelSpec, w: Workload, device: DeviceProfile | None, iterations: int,
                      opts: TraceOptions, policy: Policy | None,
                      models: reuse.ModelStore | None = None) -> TraceResult | str:
    """Three reduced traces extrapolated to the model's layers (:mod:`.replicate`), or why not."""
    quick = dataclasses.replace(opts, replicate_layers=False)
    cache = MetaCache()  # (the three models run the same ops on the same shapes)
    expert_notes: list[str] = []

    def tracer(reduced: ModelSpec) -> tuple[replicate.Traced, str | None]:
        paths: set[str] = set()
        r, note = _trace_experts(reduced, w, device, iterations, quick, policy, paths, cache, models)
        return replicate.Traced(result=r, paths=frozenset(paths), layers=reduced.layers), note

    # (independent: side by side where a CPU is spare and they take long enough, see :mod:`.forked`;
    # the model's code is imported first, so that the first trace's time is the trace's)
    from ..models.build import import_code

    import_code(spec)
    traced = replicate.reduced_layers(spec)
    outs = forked.map_forked(tracer, [replicate.reduced_spec(spec, n) for n in traced], fork_from=FORK_FROM)
    for _, note in outs:
        if note is not None and note not in expert_notes:
            expert_notes.append(note)
    got = replicate.extrapolate([t for t, _ in outs], spec.layers)
    if isinstance(got, str):
        return got
    note = (f"identical layers traced once: the model traced with {', '.join(map(str, traced))} of its "
            f"{spec.layers} layers, the other layers' events written from their exact progression "
            "(verified on the third trace; `replicate_layers=False` traces every layer)")
    return summarize_log(got.events, got.paths, params=got.params, trainable=got.trainable, flops=got.flops,
                         notes=[*got.notes, *expert_notes, note])


def _trace_experts(spec: ModelSpec, w: Workload, device: DeviceProfile | None, iterations: int,
                   opts: TraceOptions, policy: Policy | None, paths: set[str], cache: MetaCache,
                   models: reuse.ModelStore | None = None) -> tuple[TraceResult, str | None]:
    """``spec`` traced with its MoE experts loops cut to 2, 3 and 4 experts and the other
    experts' events written (:mod:`.experts`, :func:`.replicate.extrapolate_experts`), and a
    note; the trace of every expert where no loop is cut (None: no note) or the check fails."""
    first = replicate.EXPERTS
    if _experts_refused(spec, w, opts) is not None:
        return _trace_catalog(spec, w, device, iterations, opts, policy, paths, cache, models=models), None
    results: list[TraceResult] = []
    cuts: list[ExpertLoops] = []
    for k in (first, first + 1, first + 2):
        cut = ExpertLoops(k)
        r = _trace_catalog(spec, w, device, iterations, opts, policy, paths, cache, cut, models)
        if not cut.loops:  # (no eager experts loop: grouped_mm, or a model of its own)
            return r, None
        results.append(r)
        cuts.append(cut)
    why = next((c.unsafe for c in cuts if c.unsafe), None)
    runs = set().union(*(c.runs for c in cuts))
    if why is None and (len({c.loops for c in cuts}) != 1 or len(runs) != 1):
        why = "the cut traces ran different experts loops"
    got = why or replicate.extrapolate_experts(results, runs.pop())
    if isinstance(got, str):
        full = _trace_catalog(spec, w, device, iterations, opts, policy, paths, cache, models=models)
        return full, f"identical experts not replicated ({got}): every expert traced"
    n = next(iter(cuts[0].runs))
    note = (f"identical experts traced once: each MoE experts loop run for {first}, {first + 1}, {first + 2} of "
            f"its {n} experts, the other experts' events written from their exact progression (verified on the "
            "third trace)")
    return summarize_log(got.events, paths, params=got.params, trainable=got.trainable, flops=got.flops,
                         notes=list(got.notes)), note


def _trace_catalog(spec: ModelSpec, w: Workload, device: DeviceProfile | None, iterations: int,
                   opts: TraceOptions, checkpoint_policy: Policy | None,
                   paths: set[str] | None = None, cache: MetaCache | None = None,
                   experts: ExpertLoops | None = None, models: reuse.ModelStore | None = None) -> TraceResult:
    from ..models.build import attention_used, build_model

    attention = "sdpa" if w.attention is Attention.FLASH else str(w.attention)
    notes: list[str] = _parallel_notes(w)
    if w.parallel.pp > 1:
        return _trace_pipeline(spec, w, device, iterations, opts, notes, checkpoint_policy)
    if w.parallel.cp > 1 and not w.training and opts.rank == 0:
        # a forward-only ring peaks highest on the last cp rank, rank 0 the lightest
        # (:func:`context_parallel.heaviest_rank`): the per-GPU figure is that rank's (dp and tp rank 0)
        opts = dataclasses.replace(opts, rank=context_parallel.heaviest_rank(w.parallel.cp, False) * w.parallel.tp)
    if models is not None and reuse.reusable(w, model_parallel=_model_parallel(w), layout=data_layout(w, rank=opts.rank),
                                             checkpoint_policy=checkpoint_policy):
        return _trace_lent(spec, w, device, iterations, opts, notes, attention, models, paths, cache, experts)
    model = build_model(spec, task=w.task, attention=attention, device="meta", dtype=features.param_dtype(w))
    notes += _build_notes(spec, w, model, attention)
    if w.parallel.cp > 1:
        used = attention_used(model)
        context_parallel.check_model(used, spec.sliding_window if spec.sliding_layers else None, w.seq)
        context_parallel.check_kernel(device or DEFAULT_PROFILE, features.compute_dtype(w), spec.heads,
                                      spec.shape.head_dim, w.seq, w.parallel.cp)
    batch_kwargs, shadows = _catalog_inputs(spec, w)
    if w.objective is not Objective.SFT:
        batch_kwargs = _objective_inputs(batch_kwargs, w)
    with parallel_world(w, rank=opts.rank) as mesh:
        if mesh is not None and (w.parallel.sp or w.parallel.cp > 1):
            batch_kwargs, more = tensor_parallel.position_ids(batch_kwargs)
            shadows += more
        prepared = _prepare(model, ((), batch_kwargs), w, notes, spec.name, device, checkpoint_policy, mesh)
        if w.parallel.cp > 1:
            ring = functools.partial(context_parallel.ring_attention, submesh(mesh, "cp"), batch_kwargs)
            prepared.step_context = ring if prepared.step_context is None else functools.partial(
                _both, ring, prepared.step_context)  # TP × CP: ring attention and the loss-parallel loss
            prepared.notes.append(
                f"context parallelism traced as rank {submesh(mesh, 'cp').get_local_rank()} of cp={w.parallel.cp}: "
                f"PyTorch's context_parallel ring attention over {w.seq // w.parallel.cp:,} of {w.seq:,} tokens per "
                "rank (contiguous shards)")
        return _trace(prepared, w, device, iterations, opts, shadows=shadows, paths=paths, cache=cache,
                      experts=experts)


def _catalog_inputs(spec: ModelSpec, w: Workload) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The batch of a catalog model's step on ``meta``, and the values it carries (a
    vision-language model's token ids and image grid: the model reads them)."""
    from ..models import vlm
    from ..models.build import example_inputs, is_video_denoiser

    labels = w.task is Task.TRAIN
    dtype = features.compute_dtype(w) if not w.mixed else torch.float32
    if vlm.is_vlm(spec):
        width, height = w.image_hw
        return vlm.inputs(spec, batch=w.sequences, seq=w.seq, images=w.images, width=width, height=height,
                          device="meta", labels=labels, dtype=dtype, videos=w.videos, frames=w.video_frames)
    if w.videos:
        raise vlm.no_videos(spec)
    if is_video_denoiser(spec):  # WanPipeline's own size unless one is given (as for its whole pipeline)
        base = Workload()
        own = (w.image_size, w.image_height) == (base.image_size, base.image_height)
        return example_inputs(spec, batch=w.sequences, image_size=None if own else w.image_size,
                              image_height=0 if own else w.image_height, frames=w.frames, device="meta",
                              labels=labels, dtype=dtype), []
    return example_inputs(spec, batch=w.sequences, seq=w.seq, image_size=w.image_size, device="meta",
                          labels=labels, dtype=dtype, images=w.images, image_height=w.image_height), []


def _objective_inputs(kwargs: dict[str, Any], w: Workload) -> dict[str, Any]:
    """The batch the objective's trainer feeds its step (GRPO: none; its rollout makes them)."""
    return grpo.inputs(kwargs, w) if w.rl else preference.preference_inputs(kwargs, w)


def _build_notes(spec: ModelSpec, w: Workload, model: nn.Module, attention: str) -> list[str]:
    """What the built model tells about the attention it runs."""
    from ..models import vlm
    from ..models.build import attention_used, is_video_denoiser, wan_video

    notes = []
    if (w.images or w.videos) and vlm.is_vlm(spec):
        notes.append(vlm.describe(spec, w.images, *w.image_hw, w.seq, w.videos, w.video_frames))
    if is_video_denoiser(spec):
        own = (w.image_size, w.image_height) == (Workload().image_size, Workload().image_height)
        video = wan_video(None if own else w.image_size, 0 if own else w.image_height, w.frames)
        notes.append(video.describe())
    if w.attention is Attention.FLASH:
        notes.append("attention=flash traced as SDPA (the flash kernel wherever the GPU and shapes allow it)")
    used = attention_used(model)
    if used not in ("none", attention):
        notes.append(f"{spec.name} runs attention '{used}' in transformers (asked: {attention})")
    return notes


def _trace_lent(spec: ModelSpec, w: Workload, device: DeviceProfile | None, iterations: int, opts: TraceOptions,
                notes: list[str], attention: str, models: reuse.ModelStore, paths: set[str] | None,
                cache: MetaCache | None, experts: ExpertLoops | None = None) -> TraceResult:
    """:func:`_trace_catalog` on a model borrowed from ``models`` (built and prepared when there
    is none), given back after the trace if the trace left it as it was (:mod:`.reuse`)."""
    from ..models.build import build_model

    key = reuse.key(w, attention, device)
    lent: reuse.Lent | None = models.take(spec, key)
    model = None
    if lent is None:  # (the same order as a fresh trace: build, inputs, prepare)
        model = build_model(spec, task=w.task, attention=attention, device="meta", dtype=features.param_dtype(w))
        notes += _build_notes(spec, w, model, attention)
    batch_kwargs, shadows = _catalog_inputs(spec, w)
    if w.objective is not Objective.SFT:
        batch_kwargs = _objective_inputs(batch_kwargs, w)
    if lent is None:
        assert model is not None
        prepared = _prepare(model, ((), {}), w, notes, spec.name, device)
        lent = reuse.Lent(prepared=dataclasses.replace(prepared, notes=list(prepared.notes)),
                          state=reuse.state(prepared.model), modules=sum(1 for _ in prepared.model.modules()))
    p = dataclasses.replace(lent.prepared, batch=((), batch_kwargs), notes=list(lent.prepared.notes))
    result = _trace(p, w, device, iterations, opts, shadows=shadows, paths=paths, cache=cache, experts=experts)
    reuse.settle(p.model)
    if reuse.state(p.model) == lent.state:
        models.give(spec, key, lent)
    return result


def trace_pipeline_stages(spec: ModelSpec, w: Workload, *, device: DeviceProfile | None = None,
                          iterations: int = 2, options: TraceOptions | None = None,
                          notes: list[str] | None = None,
                          checkpoint_policy: Policy | None = None) -> list[tuple[int, TraceResult]]:
    """(pipeline rank, its trace) for each stage that differs (:mod:`.pipeline_parallel`)."""
    from ..models.build import attention_used, build_model

    _check_iterations(iterations)
    opts = options or TraceOptions()
    p = w.parallel
    pp = p.pp
    bounds = p.stage_bounds(spec.layers)
    attention = "sdpa" if w.attention is Attention.FLASH else str(w.attention)
    results: list[tuple[int, TraceResult]] = []

    @functools.cache
    def whole_trainable() -> int:
        """The adapters of the whole model (LoRA), as a one-GPU trace counts them."""
        full = build_model(spec, task=w.task, attention=attention, device="meta", dtype=features.param_dtype(w))
        with quiet():
            lora, _ = features.apply_peft(full, w)
        return sum(q.numel() for q in lora.parameters() if q.requires_grad)

    for rank in p.pipeline_ranks():
        parts, specs = [], []
        params = 0
        for index in p.stage_ids(rank):
            full = build_model(spec, task=w.task, attention=attention, device="meta", dtype=features.param_dtype(w))
            params = sum(q.numel() for q in full.parameters())
            if p.cp > 1:  # ring attention replaces SDPA only: refuse what it cannot run (as without pp)
                context_parallel.check_model(attention_used(full), spec.sliding_window if spec.sliding_layers else None,
                                             w.seq)
                context_parallel.check_kernel(device or DEFAULT_PROFILE, features.compute_dtype(w), spec.heads,
                                              spec.shape.head_dim, w.seq, p.cp)
            part, st = pipeline_parallel.split(full, index, bounds)
            # torchtitan applies activation checkpointing per model part (each part's own block list)
            part_notes = features.apply_checkpointing(part, w, checkpoint_policy)
            parts.append(part)
            specs.append(st)
        model = pipeline_parallel.Chunks(parts)
        layout = pipeline_layout(w, pp_rank=rank)
        # the hidden states a stage hands on: FSDP2's mixed precision computes in 16-bit, no autocast
        act = features.compute_dtype(w) if layout is not None else features.param_dtype(w)
        out = features.compute_dtype(w) if w.mixed else act
        # torchtitan's mesh, (pp, [dp_replicate,] dp, [cp,] tp); the traced rank is dp and tp rank 0, and the
        # heaviest cp rank (:func:`context_parallel.heaviest_rank`)
        world = layout.world if layout is not None else dist.World(
            (("pp", pp),) + tuple((k, n) for k, n in (("cp", p.cp), ("tp", p.tp)) if n > 1),
            rank=(rank * p.cp + context_parallel.heaviest_rank(p.cp, w.training)) * p.tp)
        seq = w.seq // p.cp  # context parallelism: each rank's sequence shard (context_parallel.ring_dispatcher)
        with dist.fake_world(world) as mesh:
            group = submesh(mesh, "pp").get_group() if len(world.dims) > 1 else None
            tp_notes: list[str] = []
            if p.tp > 1:  # torchtitan's parallelize_fn on each part: TP first (then AC, FSDP)
                tp_notes = pipeline_parallel.tensor_parallelise(model, submesh(mesh, "tp"), sp=p.sp, seq=seq)
            if p.cp > 1:  # the shard's own positions (transformers would take the hidden states' length)
                pipeline_parallel.shard_positions(model, seq)
            runner = pipeline_parallel.make_runner(
                model, specs, schedule=p.pp_schedule, micro=w.batch, microbatches=w.grad_accum, seq=seq,
                hidden=spec.hidden, vocab=spec.vocab, act_dtype=act, out_dtype=out, training=w.training, group=group,
                tp=p.tp, sp=p.sp)
            pipeline_parallel.p2p_on_meta(group)
            prepared = _prepare(model, ((), {}), w.replace(checkpointing="none"),
                                [*(notes or ()), *tp_notes, *part_notes], f"{spec.name} rank {rank}", device)
            prepared.params = prepared.trainable = params  # the whole model's, as a one-GPU trace reports
            if w.peft is not Peft.NONE:
                prepared.trainable = whole_trainable()
            if layout is not None or p.tp > 1:
                prepared.mesh, prepared.layout = mesh, layout
            contexts: list[Callable[[], contextlib.AbstractContextManager[Any]]] = []
            if p.cp > 1:  # ring attention over mesh["cp"] on the cp-local inputs, as torchtitan's step runs it
                contexts.append(functools.partial(context_parallel.ring_dispatcher, submesh(mesh, "cp")))
            if p.tp > 1:  # the last stage's loss-parallel cross-entropy; whole-length masks under SP
                contexts.append(tensor_parallel.loss_parallel)
                if p.sp:
                    contexts.append(functools.partial(tensor_parallel.full_length_masks, seq))
            if contexts:
                if prepared.step_context is not None:  # (the model's own, e.g. float8 kernel stand-ins)
                    contexts.append(prepared.step_context)
                prepared.step_context = functools.partial(_both, *contexts)
            results.append((rank, _trace(prepared, w.replace(grad_accum=1), device, iterations, opts, runner=runner)))
    return results


def _trace_pipeline(spec: ModelSpec, w: Workload, device: DeviceProfile | None, iterations: int,
                    opts: TraceOptions, notes: list[str], checkpoint_policy: Policy | None = None) -> TraceResult:
    """The worst traced pipeline rank, every traced rank's peak in its notes."""
    p = w.parallel
    results = trace_pipeline_stages(spec, w, device=device, iterations=iterations, options=opts, notes=notes,
                                    checkpoint_policy=checkpoint_policy)
    rank, worst = max(results, key=lambda r: r[1].peak_allocated)
    bounds = p.stage_bounds(spec.layers)

    def holds(r: int) -> str:
        ids = p.stage_ids(r)
        parts = [f"layers {lo}–{hi - 1}" if hi - lo > 1 else f"layer {lo}" if hi > lo else "no layers"
                 for lo, hi in (bounds[i] for i in ids)]
        if 0 in ids:
            parts.append("embeddings")
        if p.pp * p.stages_per_rank - 1 in ids:
            parts.append("head + loss" if w.training else "head")
        return ", ".join(parts)

    stages = "stage" if p.stages_per_rank == 1 else f"{p.stages_per_rank} stages per rank"
    peaks = "; ".join(f"rank {r} ({holds(r)}) {t.peak_allocated:,} B" for r, t in results)
    run = (f"{p.pp_schedule} over {w.grad_accum} micro-batches of {w.batch}" if w.training else
           f"GPipe forward-only over one micro-batch of {w.batch} (no_grad; stages hand on hidden states, no KV cache)")
    extra = (f"pipeline parallelism traced per rank ({stages}): PyTorch's torch.distributed.pipelining "
             f"{run} on a fake process group; "
             f"peak allocated {peaks}; the report shows rank {rank}, the worst; stages split as torchtitan "
             f"splits them (embeddings counted as {p.pp_first_less} layer(s), the head as {p.pp_last_less})"
             + ("; ranks after rank 1 hold no more layers and no more micro-batches in flight" if p.pp > 3 else "")
             + (f"; context parallelism as torchtitan runs it under pp: each rank's {w.seq // p.cp:,}-token shard of "
                f"{w.seq:,} through its stages (cp-local hidden states handed on), PyTorch's ring attention over "
                f"cp={p.cp} in every block (load-balanced rounds), cp rank "
                f"{context_parallel.heaviest_rank(p.cp, w.training)} traced (the heaviest)" if p.cp > 1 else ""))
    return dataclasses.replace(worst, notes=(extra, *worst.notes))


# --------------------------------------------------------------------------- internals
def _check_iterations(iterations: int) -> None:
    if not isinstance(iterations, int) or iterations < 1:
        raise WorkloadError(f"iterations must be a positive integer, got {iterations!r}")


def _parallel_notes(w: Workload) -> list[str]:
    """Layouts the trace cannot run are refused up front rather than misreported."""
    p = w.parallel
    if not _model_parallel(w):
        layout_of(w)  # data parallelism (FSDP2 / DDP): trace.layout decides
        if p.dp > 1 and not w.training and p.zero != 3:
            return [f"dp={p.dp} inference: every rank runs the same unsharded model (one traced)"]
        return []
    if p.ep > 1:
        raise TraceError(f"expert parallelism (`ep={p.ep}`) is not traced for catalog models: PyTorch has no "
                         "expert-parallel API, and the catalog's MoE models are transformers' modules, which "
                         "torchtitan's expert sharding (its own MoE module and all-to-all dispatcher) does not "
                         "apply to; torchtitan's EP is traced as torchtitan runs it, under `vramplan run -- torchrun "
                         "--nproc-per-node N -m torchtitan.train --module qwen3 --config qwen3_moe_debug "
                         "--parallelism.expert_parallel_degree N …` (README, torchtitan); the analytic method "
                         "divides the experts by `ep`", hint="use `method=analytic`")
    sharded = p.zero or p.offload_optimizer or p.offload_params or (p.dp > 1 and w.training)
    if p.pp > 1:
        pipeline_layout(w, pp_rank=0)  # FSDP2 on each stage, as torchtitan runs it: trace.layout decides
    elif sharded:
        data_layout(w)  # TP × FSDP2 / DDP on a (dp, tp) mesh: trace.layout decides what it runs
    if p.cp > 1 and w.task is Task.GENERATE:
        raise TraceError(f"context parallelism is traced for training and one-pass inference; `cp={p.cp}` with "
                         "generation is not", hint="use `method=analytic`")
    if p.pp > 1 and (w.task is Task.GENERATE or w.peft is Peft.QLORA or w.quant is not Quant.NONE):
        raise TraceError(f"pipeline parallelism is traced for training (full weights or LoRA) and one-pass "
                         f"inference; `pp={p.pp}` with this workload is not (torch's pipelining has no generation "
                         "loop; quantised or QLoRA stages are not traced)", hint="use `method=analytic`")
    if p.pp > 1 and p.tp > 1 and w.peft is not Peft.NONE:
        raise TraceError(
            f"pipeline × tensor parallelism is traced for full-weight training and one-pass inference, as torchtitan "
            f"runs them (checked against a real gloo run); `pp={p.pp}` with `tp={p.tp}` and `peft={w.peft}` is not: "
            "LoRA under TP is traced as transformers + peft run it, and transformers' own pipeline × tensor "
            "parallelism does not load (transformers 5.24, from_pretrained(distributed_config=DistributedConfig("
            "pp_size, tp_size)): the pipeline split replaces the other stages' layers before the tensor-parallel plan, "
            "resolved for every layer, is applied, which raises KeyError on their weights, run on 4 gloo processes), "
            "and its pipeline is forward-only (with pp alone the output has no loss and no gradient reaches an earlier "
            "stage); torchtitan 0.3.0 runs LoRA under pp × tp as its own LoRALinear, converted into its model's "
            "config before the build (components/lora.py), not on transformers' and peft's modules, and wants a GPU "
            "to run (not checked here)", hint="use `method=analytic`, or drop `tp`")
    if p.pp > 1 and not w.training and p.stages_per_rank > 1:
        raise TraceError(f"pipeline inference is traced with one stage per rank; {p.pp_schedule} holds "
                         f"{p.stages_per_rank}", hint="use `pp_schedule=1F1B` (or GPipe) for inference, or "
                                                      "`method=analytic`")
    if (p.tp > 1 or p.pp > 1) and w.training and (w.loss is not Loss.FULL or w.optimizer_in_backward):
        knob = f"`loss={w.loss}`" if w.loss is not Loss.FULL else "`optimizer_in_backward`"
        raise TraceError(f"{knob} is not traced with tensor or pipeline parallelism (the loss-parallel "
                         "cross-entropy / the pipeline schedule own the loss and the step)", hint="use `method=analytic`")
    if p.tp > 1 and w.peft is not Peft.NONE:
        _lora_tp_refusal(w)
    elif p.tp > 1 and w.quant is not Quant.NONE:
        raise TraceError(f"tensor parallelism is traced for full-weight models and LoRA; `quant={w.quant}` with "
                         f"`tp={p.tp}` is not (torchtitan's plan shards bf16/fp32 linears, not quantised storage)",
                         hint="use `method=analytic`")
    if p.dp > 1 and not w.training and p.zero != 3:
        return [f"dp={p.dp} inference: every replica runs the same model-parallel layout (one rank traced)"]
    return []


def _lora_tp_refusal(w: Workload) -> None:
    """LoRA under TP is traced as transformers + peft run it (:func:`_lora_tp`): training on a
    tensor-parallel mesh alone. The rest is refused with its cause."""
    p = w.parallel
    if w.quant is not Quant.NONE and w.peft is not Peft.QLORA:
        raise TraceError(f"`quant={w.quant}` with LoRA and `tp={p.tp}` is not traced: the trace's quantised linears are "
                         "its own emulation, not the layers transformers' tp_plan shards", hint="use `method=analytic`")
    if w.peft is Peft.QLORA:
        knob = f"`peft={w.peft}`"
        raise TraceError(
            f"{knob} with `tp={p.tp}` is not traced: LoRA under TP is traced as transformers shards it "
            "(from_pretrained(distributed_config=...) with the model's tp_plan), and transformers' bitsandbytes "
            "integration has no tensor-parallel path (its TP styles shard dense weights; quantizer_bnb_4bit / "
            "integrations/bitsandbytes name no DTensor or tp_plan, transformers 5.24) — not run here, with no "
            "bitsandbytes installed", hint="use `method=analytic`, or `peft=lora` without `quant`")
    if p.dp > 1 or p.zero or p.offload_optimizer or p.offload_params:
        _lora_tp_fsdp_refusal(w)
    other = [k for k, on in (("sp", p.sp), ("pp", p.pp > 1), ("cp", p.cp > 1)) if on]
    if other:
        raise TraceError(
            f"LoRA under tensor parallelism is traced on a tensor-parallel mesh alone; with {', '.join(other)} it is "
            "not (transformers' Llama tp_plan has no sequence parallelism; its FSDP/pipeline loading is not traced)",
            hint="use `method=analytic`, or drop the other parallel dimensions")
    if w.objective is not Objective.SFT:  # (PEFT is for training: the workload refuses other tasks)
        raise TraceError(
            f"LoRA under tensor parallelism is traced for supervised training (checked against a real gloo run); "
            f"`objective={w.objective}` is not (its reference model or rollout would have to be laid out too)",
            hint="use `method=analytic`")


def _lora_tp_fsdp_refusal(w: Workload) -> None:
    """LoRA × TP × FSDP2 / DDP: refused, because no Hugging Face stack trains it with the installed
    versions (run on 4 gloo processes, dp 2 × tp 2; ``docs/research/lora-under-tp.md``)."""
    p = w.parallel
    knobs = ", ".join(f"`{k}={v}`" for k, v, on in (
        ("dp", p.dp, p.dp > 1), ("zero", p.zero, bool(p.zero)), ("offload_optimizer", True, p.offload_optimizer),
        ("offload_params", True, p.offload_params)) if on)
    raise TraceError(
        f"LoRA under tensor parallelism (`tp={p.tp}`) with {knobs} is not traced: no Hugging Face stack trains it "
        "with transformers 5.24, peft 0.21 and accelerate 1.16 (run on 4 gloo processes): accelerate's ND "
        "parallelism (ParallelismConfig(dp_shard_size, tp_size) with FSDP2) loads the model with "
        "from_pretrained(tp_size=..., tp_plan=\"auto\"), which builds transformers' own tensor-parallel mesh and "
        "wants `tp` processes in all (\"The parallel mesh requires 2 processes, but world_size is 4\"), and its "
        "prepare() imports transformers.integrations.tensor_parallel.ReplicateParallel, which transformers 5.24 "
        "no longer has; transformers' own from_pretrained(distributed_config=DistributedConfig(tp_size, "
        "fsdp_size)) shards the weights over (fsdp, tp), peft sizes the adapters by that doubly sharded local "
        "shard (tuners_utils.py _get_in_out_features) and the LoRA forward fails (\"shape ... is invalid\")",
        hint="use `method=analytic`, or LoRA with `tp` alone, or LoRA with `dp`/`zero` without `tp`")


def _lora_tp(w: Workload) -> bool:
    """LoRA under tensor parallelism: transformers' own plan, then peft (:func:`_lora_tp_refusal`)."""
    return w.parallel.tp > 1 and w.peft is not Peft.NONE


def _model_parallel(w: Workload) -> bool:
    """Tensor / pipeline / context / expert parallelism: traced by this package's own modules
    (:mod:`.tensor_parallel`, :mod:`.pipeline_parallel`, :mod:`.context_parallel`), not by
    :mod:`.layout` (FSDP2 / DDP)."""
    p = w.parallel
    return p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1 or p.sp


def data_layout(w: Workload, *, rank: int = 0) -> Layout | None:
    """The FSDP2 / DDP layout the trace runs for ``w`` (None: no data-parallel sharding or
    buckets): plain data parallelism, or TP × FSDP / DDP on a 2-D ``(dp, tp)`` mesh (HSDP × TP
    on ``(dp_replicate, dp, tp)``), CP × FSDP2 on ``(dp, cp[, tp])`` (sharded over dp × cp).
    Pipeline / expert layouts are laid out by their own modules."""
    p = w.parallel
    if p.pp > 1 or p.ep > 1:
        return None
    return layout_of(w, rank=rank)


@contextlib.contextmanager
def parallel_world(w: Workload, *, rank: int = 0) -> Iterator[Any]:
    """The fake process group and mesh a model-parallel layout is traced on (None for one GPU
    or data parallelism alone, whose world :func:`~.dist.rank_session` sets up). With TP ×
    FSDP/DDP the mesh has the data-parallel dimensions too (torchtitan's ``world_mesh``): the
    model is tensor-parallelised on ``mesh["tp"]`` first, then sharded over ``mesh["dp"]``."""
    tp, cp = w.parallel.tp, w.parallel.cp
    if tp == 1 and cp == 1:
        yield None
        return
    if _lora_tp(w):  # transformers' own mesh (tensor_parallel.apply_transformers_tensor_parallel)
        with dist.fake_world(tensor_parallel.transformers_world(tp, rank)) as mesh:
            yield mesh
        return
    layout = data_layout(w, rank=rank)
    # (the traced rank: context-parallel ranks run different ring rounds; without it every rank was rank 0)
    world = layout.world if layout is not None else dataclasses.replace(dist.world_of(tp=tp, cp=cp), rank=rank)
    with dist.fake_world(world) as mesh:
        yield mesh


@contextlib.contextmanager
def _both(*contexts: Callable[[], contextlib.AbstractContextManager[Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for make in contexts:
            stack.enter_context(make())
        yield


def submesh(mesh: Any, name: str) -> Any:
    """Dimension ``name`` of ``mesh`` (the mesh itself when it has only that one)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    return mesh if names == (name,) else mesh[name]


def _facts(d: DeviceProfile) -> DeviceFacts:
    return facts_of(d.name, d.sm, d.usable, d.overhead_bytes)


def _materialize(model_or_factory: Any, facts: DeviceFacts | None = None) -> tuple[nn.Module, list[str]]:
    """The model (a factory is called under :func:`fake_construction`, ``torch.cuda`` answering
    as ``facts`` say)."""
    notes: list[str] = []
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    elif callable(model_or_factory):
        try:
            with fake_construction(facts):
                model = model_or_factory()
        except VramplanError:
            raise
        except Exception as e:
            raise TraceError(f"building the model failed: {type(e).__name__}: {_line(e)}") from e
    else:
        raise TraceError(f"expected an nn.Module or a function returning one, got {type(model_or_factory).__name__}")
    if not isinstance(model, nn.Module):
        raise TraceError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    orig = getattr(model, "_orig_mod", None)
    if isinstance(orig, nn.Module):
        notes.append("torch.compile ignored: the eager step is traced (compiled graphs may fuse away temporaries)")
        model = orig
    return _meta_copy(model), notes


def _meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose tensors are ``meta`` (the original is untouched)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = torch.empty_like(v, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise TraceError(f"cannot copy {type(model).__name__} onto fake tensors ({type(e).__name__}: {_line(e)})",
                         hint="pass a function that builds the model instead of the model") from e


def _to_batch(inputs: Any, float_dtype: torch.dtype) -> tuple[Batch, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(args, kwargs) on meta, plus (meta tensor, real values) for small host tensors.

    Floating-point inputs take the model's dtype under pure bf16/fp16 (as a training script
    casts its batch); mixed precision keeps them (autocast casts at each op)."""
    shadows: list[tuple[torch.Tensor, torch.Tensor]] = []

    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dtype = float_dtype if x.is_floating_point() and float_dtype != torch.float32 else x.dtype
            m = torch.empty_strided(x.shape, x.stride(), dtype=dtype, device="meta")
            if x.requires_grad:
                m.requires_grad_(True)
            if (raw_device(x).type == "cpu") and x.numel() <= SHADOW_LIMIT:
                shadows.append((m, x.detach().to(dtype)))
            return m
        if isinstance(x, (list, tuple)):
            return type(x)(conv(v) for v in x)
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x

    if isinstance(inputs, dict):
        return ((), conv(inputs)), shadows
    if isinstance(inputs, (list, tuple)):
        return (tuple(conv(list(inputs))), {}), shadows
    if inputs is None:
        return ((), {}), shadows
    return ((conv(inputs),), {}), shadows


def _prepare(model: nn.Module, batch: Batch, w: Workload, notes: list[str], root: str,
             device: DeviceProfile | None, policy: Policy | None = None, mesh: Any = None) -> Prepared:
    with quiet():
        return _prepare_quietly(model, batch, w, notes, root, device, policy, mesh)


def _prepare_quietly(model: nn.Module, batch: Batch, w: Workload, notes: list[str], root: str,
                     device: DeviceProfile | None, policy: Policy | None, mesh: Any) -> Prepared:
    step_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    try:
        notes += features.apply_precision(model, w)
        params = sum(p.numel() for p in model.parameters())  # the model's own (adapters not counted)
        reference = preference.reference_copy(model, w)
        critic = ppo.value_copy(model, w, trained=True) if ppo.is_ppo(w) else None
        reward = ppo.value_copy(model, w, trained=False) if w.rl and w.reward_model and w.training else None
        notes += features.freeze_vision(model, w)
        lora_tp = mesh is not None and _lora_tp(w)
        if lora_tp:  # from_pretrained shards the model, then get_peft_model reads its plan
            notes += tensor_parallel.apply_transformers_tensor_parallel(model, mesh)
        model, peft_notes = features.apply_peft(model, w)
        notes += peft_notes
        if lora_tp:
            _check_lora_tp(model)
        features.to_trace_device(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if w.training else 0
        notes += features.apply_quant(model, w, device or DEFAULT_PROFILE)
        notes += features.apply_float8(model, w, device or DEFAULT_PROFILE)
        if w.float8 is Float8.MXFP8:  # torchao's sm100 casts, stood in for during the step only
            from .mxfp8 import kernel_stand_ins

            step_context = kernel_stand_ins
        features.to_trace_device(model)
        if mesh is not None and w.parallel.tp > 1 and not lora_tp:  # torchtitan's order: TP, then checkpointing
            if w.compile and w.training:
                raise tensor_parallel.compile_refusal()
            notes += tensor_parallel.apply_tensor_parallel(model, submesh(mesh, "tp"), sp=w.parallel.sp)
            if tensor_parallel.find_layout(model).head is not None:
                step_context = tensor_parallel.loss_parallel if step_context is None else functools.partial(
                    _both, tensor_parallel.loss_parallel, step_context)
            seq = _sequence_length(batch) // w.parallel.cp
            if w.parallel.sp and seq:
                masks = functools.partial(tensor_parallel.full_length_masks, seq)
                step_context = masks if step_context is None else functools.partial(_both, masks, step_context)
        notes += features.apply_checkpointing(model, w, policy)
        compiler, compile_notes = features.apply_compile(model, w, policy)
        notes += compile_notes
        notes += features.apply_experts_impl(model, (device or DEFAULT_PROFILE).sm)
    except VramplanError:
        raise
    except Exception as e:
        raise TraceError(f"preparing the model for the workload failed: {type(e).__name__}: {_line(e)}") from e
    model.train(w.training)
    if reference is not None:
        features.to_trace_device(reference)
        notes.append(preference.reference_note(reference, w))
    for extra in (critic, reward):
        if extra is not None:
            features.to_trace_device(extra)
    if critic is not None:
        notes += [n.replace("the model", "the critic") for n in features.apply_checkpointing(critic.backbone, w, policy)]
        critic.train(True)
    return Prepared(model=model, batch=batch, params=params, trainable=trainable, notes=notes, root=root,
                    compiler=compiler, step_context=step_context, mesh=mesh, reference=reference, critic=critic,
                    reward_model=reward)


def _lay_out_value_model(m: nn.Module | None, name: str, layout: Layout, ctx: Any,
                         w: Workload) -> tuple[nn.Module | None, str]:
    """PPO's critic (or a reward model) laid out as the policy is, on the same ranks: verl 0.7.0's
    ``CriticWorker`` and ``RewardModelWorker`` wrap their own FSDP modules over the same device mesh
    in the same process (fsdp_workers.py L1431-L1466, L1744-L1773; docs/research/rl-frameworks.md).
    Returns (the module to call, its layout note)."""
    if m is None:
        return None, ""
    out, notes = _laid_out(m, name, layout, ctx, w)
    return out, f"{name}: " + "; ".join(notes)


def _laid_out(m: nn.Module, name: str, layout: Layout, ctx: Any, w: Workload,
              apply: Any = apply_layout) -> tuple[nn.Module, list[str]]:
    """``apply`` (:func:`apply_layout`, or :func:`.layout.apply_reference_layout` for a reference
    model) in the compute dtype; a failure that is not ours named as the layout's."""
    try:
        out: tuple[nn.Module, list[str]] = apply(m, layout, ctx, w, features.compute_dtype(w))
        return out
    except VramplanError:
        raise
    except Exception as e:
        raise TraceError(f"laying the {name} out as {layout.kind} failed on torch {torch.__version__}: "
                         f"{type(e).__name__}: {_line(e)}") from e


def _check_lora_tp(model: nn.Module) -> None:
    """Refuse the LoRA layers that the real stack cannot train under TP (:func:`.tensor_parallel.lora_rowwise_mismatch`)."""
    bad = tensor_parallel.lora_rowwise_mismatch(model)
    if bad is None:
        return
    import peft
    import transformers

    name, local, width = bad
    leaf = name.rsplit(".", 1)[-1]
    raise TraceError(
        f"LoRA on `{leaf}` under tensor parallelism does not train with peft {peft.__version__} and transformers "
        f"{transformers.__version__}: `{leaf}` is row-sharded in transformers' tp_plan, peft builds its lora_A "
        f"{local} wide (the local shard) while transformers' RowwiseParallel reads the adapter's in_features as the "
        f"whole input ({width}), so the real forward fails (\"shape ... is invalid\"); the column-sharded layers train",
        hint="set `lora_targets` to column-sharded layers (q_proj,k_proj,v_proj or gate_proj,up_proj), "
             "or use `method=analytic`")


def _compiled_chunk_ce(w: Workload, loss_fn: LossFn | None) -> nn.Module | None:
    """torchtune's ``compile_loss`` under ``compile``: the chunked loss's per-chunk upcast and
    cross-entropy compiled (AOTAutograd + the partitioner, as the model's blocks are)."""
    if not (w.compile and w.training and w.loss is Loss.CHUNKED and loss_fn is None):
        return None
    from .compile import BlockCompiler, paused_dispatch
    from .loss import CompiledChunkCrossEntropy

    ce = CompiledChunkCrossEntropy()
    BlockCompiler(paused_dispatch).wrap(ce)
    return ce


def _sequence_length(batch: Batch) -> int:
    """The token sequence length of a batch (``input_ids``, else the first 2-D positional tensor; 0 if none)."""
    ids = batch[1].get("input_ids")
    if not isinstance(ids, torch.Tensor):
        ids = next((x for x in batch[0] if isinstance(x, torch.Tensor) and x.dim() == 2), None)
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _flat_tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _flat_tensors(x)]
    return []


def _trace(p: Prepared, w: Workload, device: DeviceProfile | None, iterations: int, opts: TraceOptions, *,
           optimizer: Callable[[list[nn.Parameter]], Any] | None = None, loss_fn: LossFn | None = None,
           shadows: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
           runner: Callable[[TraceSession, StepPlan], None] | None = None,
           paths: set[str] | None = None, cache: MetaCache | None = None,
           experts: ExpertLoops | None = None) -> TraceResult:
    """``paths``: filled with the traced module paths; ``cache``: a meta cache shared with
    other traces; ``experts``: MoE experts loops cut short (all for :mod:`.replicate`)."""
    profile = device or DEFAULT_PROFILE  # the target, as the estimate core built it
    if not opts.workspaces:
        profile = profile.without_workspaces()
    sess = TraceSession(profile, autocast_dtype=features.autocast_dtype(w))
    if cache is not None:
        sess.dispatch.cache = cache
    sess.dispatch.cache.enabled = opts.meta_cache
    sess.values.routing_skew = w.routing_skew
    notes = list(p.notes)
    ledger = offload.HostLedger()
    offloaded = w.activation_offload and w.training
    layout = p.layout if p.layout is not None else data_layout(w, rank=opts.rank)
    host_side = HostMemory(sess.rec) if layout is not None and layout.cpu_offload else None
    sess.rec.host = host_side
    host_parts: tuple[tuple[str, int], ...] = ()
    with quiet(), _collect_deterministically(), contextlib.ExitStack() as stack:
        model = p.model
        critic: tuple[nn.Module | None, str] = (p.critic, "")
        reward_model: tuple[nn.Module | None, str] = (p.reward_model, "")
        reference = p.reference
        if layout is None:
            stack.enter_context(sess)
            if p.mesh is not None:  # TP / CP alone: DTensor's sharding propagation is not the GPU's
                stack.enter_context(dist.dtensor_metadata_unrecorded())
        else:
            ctx = stack.enter_context(rank_session(sess, layout.world, mesh=p.mesh))
            if layout.kind == "fsdp1" and host_side is not None:  # FSDP1 compares devices to offload
                stack.enter_context(host_side.reporting())
            model, layout_notes = _laid_out(model, "model", layout, ctx, w)
            notes += layout_notes
            critic, reward_model = (_lay_out_value_model(m, name, layout, ctx, w) for m, name in (
                (p.critic, "critic"), (p.reward_model, "reward model")))
            notes += [n for n in (critic[1], reward_model[1]) if n]
            if reference is not None:  # (TRL's prepare_fsdp: its own FSDP units on the same ranks)
                reference, ref_notes = _laid_out(reference, "reference model", layout, ctx, w, apply_reference_layout)
                notes += ref_notes
        trainable = [q for q in model.parameters() if q.requires_grad]
        if offloaded:
            stack.enter_context(offload.offloading(
                model, ledger, lambda t: sess.label_tensors([t], Category.ACTIVATION)))
        sess.add_model(p.model, p.root)  # (DDP wraps it; FSDP2 shards it in place)
        if p.reference is not None:
            sess.add_model(p.reference, "reference")
        if p.critic is not None:
            sess.add_model(p.critic, "critic")
        if p.reward_model is not None:
            sess.add_model(p.reward_model, "reward_model")
        if experts is not None:
            experts.attach(p.model, sess.modules.name_of)
            stack.callback(experts.detach)
            sess.dispatch.experts = experts
        sess.add_inputs(_flat_tensors(p.batch))
        for meta, real in shadows or ():
            sess.values.set_shadow(meta, real)
        opt: Any = None
        in_backward: dict[nn.Parameter, Any] | None = None
        if w.training and w.optimizer_in_backward:
            in_backward = {}
            for q in trainable:
                in_backward[q] = optimizer([q]) if optimizer is not None else make_optimizer(w, [q])[0]
            register_in_backward(sess, in_backward)
            notes.append(f"optimizer in backward: {len(in_backward)} per-parameter optimizers stepped from "
                         "post-accumulate-grad hooks, each gradient freed after its step (torchtune optimizer_in_bwd)")
        elif w.training:
            if optimizer is not None:
                make = optimizer
            else:
                def make(params: list[nn.Parameter]) -> Any:
                    made, opt_notes = make_optimizer(w, params)
                    notes.extend(opt_notes)
                    return made
            # FSDP2's Shard(0) parameters step on their local shards; tensor-parallel ones keep
            # DTensor's optimizer (a RowwiseParallel embedding's gradient is Replicate)
            local = layout is not None and sharded_params(trainable)
            groups = tensor_parallel.mesh_groups(trainable) if p.mesh is not None and not local else None
            if groups is not None:  # (LoRA under TP: plain lora_A, DTensor lora_B of a column-sharded layer)
                notes.append(f"optimizer parameter groups split by device mesh as transformers' Trainer splits them "
                             f"({' + '.join(str(len(g['params'])) for g in groups)} tensors): a foreach/fused kernel "
                             "refuses a mix of DTensor and Tensor")
            opt = LocalShardOptimizer(trainable, make) if local else make(groups or trainable)  # type: ignore[arg-type]
        plan = StepPlan(
            model=model, batch=p.batch, task=str(w.task), loss_fn=loss_fn, optimizer=opt,
            grad_accum=w.grad_accum, autocast=w.mixed, grad_scaler=w.precision.value == "fp16-mixed",
            new_tokens=w.new_tokens, cache=opts.cache, trainable=trainable, kv_dtype=w.kv_dtype,
            compute_dtype=features.compute_dtype(w), extrapolate_decode=opts.extrapolate_decode,
            extrapolate_accum=(opts.extrapolate_accum and layout is None and p.mesh is None and not offloaded
                               and host_side is None),
            keep_grads=w.keep_grads, keep_outputs=w.keep_outputs, loss=w.loss, loss_chunks=w.loss_chunks,
            sm=profile.sm, in_backward=in_backward, chunk_ce=_compiled_chunk_ce(w, loss_fn),
            objective=w.objective, reference=reference, reference_source=w.reference_source, prompt=w.prompt,
            micro_batch=w.batch, completion=w.completion,
            engine=profile.rollout if w.rl else None, critic=critic[0], reward_model=reward_model[0],
        )
        if critic[0] is not None:
            own = [q for q in critic[0].parameters() if q.requires_grad]

            def make_critic(params: list[nn.Parameter]) -> Any:
                return make_optimizer(w, params)[0]

            # (FSDP: the critic's optimizer steps on its local shards, as the policy's)
            plan.critic_optimizer = LocalShardOptimizer(own, make_critic) if sharded_params(own) else \
                make_critic(own)
        if w.training and w.objective is not Objective.SFT:
            step_note = {Objective.GRPO: grpo.step_note, Objective.PPO: ppo.step_note}.get(
                w.objective, preference.step_note)
            notes.append(step_note(w) if loss_fn is None else f"objective={w.objective} ignored: the given loss_fn runs")
        elif w.training and w.loss is not Loss.FULL:
            notes.append(loss_note(w) if loss_fn is None else f"loss={w.loss} ignored: the given loss_fn runs")
        if runner is None and w.training and w.rl and loss_fn is None:
            runner = grpo_step
            plan.runner_name = "grpo"
        runner = runner or RUNNERS[str(w.task)]
        with p.step_context() if p.step_context is not None else contextlib.nullcontext():
            for it in range(1, iterations + 1):
                sess.start_iteration(it)
                sess.dispatch.count_flops = opts.count_flops and it == 1
                try:
                    runner(sess, plan)
                    gc.collect()  # storages kept only by reference cycles die at the iteration end
                except VramplanError:
                    raise
                except Exception as e:
                    at = user_frame_of(e)
                    hint = SHAPE_HINT if shape_mismatch(e) else (
                        "the model's step must run on fake (meta) tensors: change that line to depend on shapes, "
                        "not values, or register a fake kernel for a custom op")
                    raise TraceError(f"tracing failed in {_where(sess)}{f' at {at}' if at else ''} on torch "
                                     f"{torch.__version__}: {type(e).__name__}: {_line(e)}", hint=hint) from e
        if host_side is not None:  # (the optimizer still holds its states: read them now)
            host_parts = host_side.parts()
    notes += plan.notes
    notes += _emulation_notes(sess, profile.name, profile.cublas_workspace)
    if p.compiler is not None:
        from .compile import notes as compile_notes

        notes += compile_notes(p.compiler)
    if offloaded:
        notes.append(f"activation offload (torchtune OffloadActivations emulated): {ledger.tensors // iterations:,} "
                     f"saved tensors per step copied to pinned CPU memory, {ledger.reserved:,} B of pinned host RAM "
                     "(CachingHostAllocator power-of-two blocks); the output head and the loss stay on the GPU")
    if host_parts:
        notes.append(f"{'FSDP1' if layout is not None and layout.kind == 'fsdp1' else 'FSDP2'} CPU offload: host RAM " + ", ".join(f"{name} {n:,} B" for name, n in host_parts)
                     + " (pinned blocks in the CachingHostAllocator's power-of-two classes); the optimizer "
                     "step runs on the CPU")
    if offloaded:
        host_parts = (*host_parts, (HOST_ACTIVATIONS, ledger.reserved))
    if paths is not None:
        paths.update(sess.modules.paths)
    result = summarize(sess, params=p.params, trainable=p.trainable,
                       flops=sess.dispatch.flops if opts.count_flops else None, notes=notes)
    if plan.runner_name == "grpo":
        parts = ppo.parts_of(sess.rec.log, plan.spans)
        limit = grpo.limit_note(result.phases) if p.critic is None and p.reward_model is None \
            else ppo.limit_note(w, parts)
        result = dataclasses.replace(result, notes=(*result.notes, limit), step_parts=tuple(parts.items()))
    if not host_parts:
        return result
    return dataclasses.replace(result, host_memory=sum(n for _, n in host_parts), host_parts=host_parts)


@contextlib.contextmanager
def _collect_deterministically() -> Iterator[None]:
    """Storages kept alive only by reference cycles die when the garbage collector runs, and
    automatic collections run after a count of allocations that depends on everything the
    process did before (imports, earlier traces): their FREE events would move from one run
    to the next. During a trace automatic collection is off and a full collection runs at
    each iteration's end; objects from before the trace are frozen (``gc.freeze``) so that
    collection only scans the trace's own objects.

    ``torch._dynamo`` is imported first: torch's Python kernels import it on their first call,
    and inside a traced op that import leaves a frame cycle that pins every frame below it until
    the next collection (the step's locals with it: a sampler's sort buffers counted at a later
    peak in a fresh process, not in one that had imported it; see :func:`vramplan.emulate.emulated_gpu`)."""
    import torch._dynamo  # noqa: F401

    enabled = gc.isenabled()
    freeze = gc.get_freeze_count() == 0  # (someone else's frozen objects stay frozen)
    gc.disable()
    if freeze:
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if enabled:
            gc.enable()


def _where(sess: TraceSession) -> str:
    s = sess.rec.log.strings
    mod = s[sess.rec.module] or "<top level>"
    return f"module {mod} (last op {s[sess.rec.op] or '-'})"


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _emulation_notes(sess: TraceSession, device: str, cublas: int) -> list[str]:
    from .datadep import RULE_TEXT

    out = [f"CUDA emulation for {device}"]
    if sess.functions.backends:
        used = ", ".join(f"{k} ×{v}" for k, v in sorted(sess.functions.backends.items()))
        out.append(f"SDPA kernels: {used}")
    if cublas:
        out.append(f"cuBLAS workspace {cublas:,} B per (thread, stream), forward and backward threads")
    if sess.dispatch.flops_skipped:
        ops = ", ".join(f"{k} ×{v}" for k, v in sorted(sess.dispatch.flops_skipped.items()))
        out.append(f"FLOPs not counted for {ops}: torch {torch.__version__}'s flop formula rejected their "
                   "shapes (the FLOP total is low; memory is unaffected)")
    for rule, n in sorted(sess.dispatch.rules_used.items()):
        out.append(f"data-dependent {rule} ×{n}: {RULE_TEXT[rule]}")
    routed = {"eq_mask", "mask_count", "bincount", "nonzero", "routing_map"} & set(sess.dispatch.rules_used)
    if routed and sess.values.routing_skew != 1.0:
        out.append(f"routing skew {sess.values.routing_skew:g}: each expert's share is {sess.values.routing_skew:g}x "
                   "the uniform k/n (capped at every token)")
    return out


def summarize(sess: TraceSession, *, params: int, trainable: int, flops: int | None, notes: list[str]) -> TraceResult:
    """Resolve categories and read every figure from the session's event log."""
    return summarize_log(sess.rec.log, sess.modules.paths, params=params, trainable=trainable, flops=flops,
                         notes=notes)


def summarize_log(log: EventLog, paths: Collection[str], *, params: int, trainable: int, flops: int | None,
                  notes: list[str]) -> TraceResult:
    """Resolve categories and read every figure from an event log (``paths``: the module paths
    of the model, for per-module attribution)."""
    resolve_categories(log)
    return summary.summarize_resolved(log, paths, params=params, trainable=trainable, flops=flops, notes=notes)
