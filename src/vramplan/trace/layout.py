"""A workload's parallel layout applied to the model of one traced rank, with PyTorch's own
distributed code (no simulation of it):

- FSDP (``zero=3``, or ``zero=2`` with ``engine=fsdp``; :func:`vramplan.precision.dp_engine`): FSDP2 — ``fully_shard`` on each transformer block (the model's
  ``_no_split_modules`` classes, as accelerate's FSDP2 plugin wraps; else the blocks of its
  largest ``ModuleList``) and on the root, over the ``dp`` mesh dimension.
  ``reshard_after_forward`` is True for ZeRO-3 (FULL_SHARD), False for ZeRO-2
  (SHARD_GRAD_OP). Under ``*-mixed`` precision a ``MixedPrecisionPolicy(param_dtype=<16-bit>,
  reduce_dtype=float32)`` (torchtitan's default: 16-bit compute and all-gathers, fp32
  gradient reduce-scatter, fp32 sharded parameters, gradients and optimizer states).
- ``zero=0`` with ``dp > 1``: ``DistributedDataParallel`` with its gradient buckets
  (``bucket_cap_mb``, default 25 MiB; the first bucket 1 MiB) — the C++ ``Reducer`` allocates
  them on the device. The fake process group's all-reduce future carries no tensor, which the
  built-in hook requires, so the same all-reduce runs through a Python comm hook
  (``bucket.buffer()`` divided by the world size and all-reduced in place, as the built-in
  ``_AllReduceBySumCommHook`` does: no extra memory).
- HSDP (``dp_shard`` < ``dp``, where the workload has it): ``fully_shard`` over a 2-D
  ``(dp_replicate, dp)`` mesh — sharded within a group, all-reduced across replicas.
- DeepSpeed's ZeRO-1/2 (the default engine for those stages) is not PyTorch's: refused here.

- CPU offload (``offload_params``, FSDP only): ``CPUOffloadPolicy(pin_memory=True)`` as
  accelerate's ``cpu_offload`` and torchtitan's ``enable_cpu_offload`` pass it — FSDP2 has one
  policy: parameters, gradients and optimizer states all on the host (:mod:`.host`).
  ``offload_optimizer`` alone is DeepSpeed's ZeRO-Offload: refused here. With ``engine=fsdp1``
  FSDP1's ``CPUOffload(offload_params=True)`` (accelerate's ``fsdp_offload_params``, Trainer's
  ``fsdp="… offload"``): per unit a pinned flat shard and a pinned gradient buffer, each
  all-gather preceded by a copy of the shard to the GPU, the step on the host
  (docs/research/fsdp1-cpu-offload.md; :meth:`.host.HostMemory.reporting`).

Tensor / pipeline / context / expert parallelism are refused here with a hint
(they are traced by the modules that own them, or estimated analytically).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..precision import dp_engine
from ..workload import Fsdp1Prefetch, Peft, Quant, Workload
from .dist import RankContext, World, world_of
from .host import PARAMETERS

DDP_BUCKET_MB = 25
"""``DistributedDataParallel(bucket_cap_mb=None)`` → 25 MiB (torch/nn/parallel/distributed.py)."""


@dataclass(frozen=True)
class Layout:
    """How the traced rank's model is laid out."""

    world: World
    kind: str
    """``fsdp2``, ``fsdp1`` or ``ddp``."""
    reshard_after_forward: bool = True
    bucket_cap_mb: float = DDP_BUCKET_MB
    gradient_as_bucket_view: bool = False
    strategy: str = "FULL_SHARD"
    """FSDP1's ``ShardingStrategy`` (:attr:`vramplan.workload.Parallel.fsdp1_strategy`)."""
    prefetch: str = "backward-pre"
    """FSDP1's ``backward_prefetch`` (:class:`vramplan.workload.Fsdp1Prefetch`)."""
    cpu_offload: bool = False
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` / FSDP1's ``CPUOffload(offload_params=True)``:
    sharded parameters, gradients and the optimizer step on the host (:mod:`.host`)."""
    pipeline: bool = False
    """FSDP2 on a pipeline rank's model parts (:func:`pipeline_layout`): each part sharded as
    torchtitan shards it, the world's ``pp`` dimension outermost."""


def layout_of(w: Workload, *, rank: int = 0) -> Layout | None:
    """The layout the trace runs for ``w`` as rank ``rank`` (None: one unsharded GPU)."""
    p = w.parallel
    if p.pp > 1 or p.ep > 1:
        raise TraceError("pipeline / expert parallelism are not laid out with data parallelism here",
                         hint="use `method=analytic` for these layouts")
    engine = dp_engine(w)
    if p.cp > 1 and engine not in ("fsdp", "none"):
        raise TraceError(f"context parallelism is traced with FSDP2 (torchtitan shards over the flattened dp × cp "
                         f"mesh); with {engine} it is not", hint="use `engine=fsdp` with `zero=3` or 2, or "
                                                                 "`method=analytic`")
    offload = p.offload_params or p.offload_optimizer
    if offload and engine not in ("fsdp", "fsdp1"):
        raise TraceError(f"DeepSpeed's CPU offload (ZeRO-{p.zero}) is not traced (the trace runs FSDP2's "
                         "CPUOffloadPolicy and FSDP1's CPUOffload)",
                         hint="use `method=analytic` (DeepSpeed's host RAM estimators), or `offload_params` with "
                              "`zero=3` and `engine=fsdp` (or `engine=fsdp1`)")
    if offload and p.tp > 1:
        raise TraceError("FSDP CPU offload is traced without tensor parallelism (TP × FSDP with CPU offload "
                         "is not checked against the formulas yet)", hint="use `method=analytic`, or `tp=1`")
    if offload and not p.offload_params:
        raise TraceError("FSDP2's CPUOffloadPolicy offloads parameters, gradients and optimizer states together; "
                         "optimizer-only offload is DeepSpeed's ZeRO-Offload, which is not traced",
                         hint="add `offload_params` (FSDP2), or use `method=analytic` with `engine=deepspeed`")
    if engine == "none" or (not w.training and p.zero != 3):
        return None  # one GPU, or inference replicas: every rank runs the same unsharded model
    if getattr(w, "optimizer_in_backward", False):
        raise TraceError("the optimizer in backward is not traced with FSDP/DDP (its per-parameter hooks would "
                         "see unsharded gradients)", hint="use `method=analytic`, or drop `optimizer_in_backward`")
    shard = int(getattr(p, "dp_shard", 0) or 0)  # HSDP: shard within groups, replicate across them
    tp = {"tp": p.tp} if p.tp > 1 else {}  # TP × FSDP / DDP: a 2-D (dp, tp) mesh, TP innermost
    if p.cp > 1:  # CP × FSDP2: (dp, cp[, tp]), FSDP over dp × cp flattened (RankContext.shard_mesh)
        tp = {"cp": p.cp, **tp}
    if engine in ("fsdp", "fsdp1") and 0 < shard < p.dp:
        world = dataclasses.replace(world_of(dp_replicate=p.dp // shard, dp=shard, **tp), rank=rank)
    else:
        world = dataclasses.replace(world_of(dp=p.dp, **tp), rank=rank)
    if engine == "fsdp":
        return Layout(world, "fsdp2", reshard_after_forward=p.zero == 3, cpu_offload=offload)
    if engine == "fsdp1":
        return Layout(world, "fsdp1", reshard_after_forward=p.zero == 3, strategy=p.fsdp1_strategy,
                      prefetch=p.fsdp1_prefetch.value, cpu_offload=offload)
    if engine == "ddp":
        return Layout(world, "ddp", bucket_cap_mb=p.bucket_cap_mb, gradient_as_bucket_view=p.gradient_as_bucket_view)
    raise TraceError(f"DeepSpeed ZeRO-{p.zero} is not traced (the trace runs PyTorch's FSDP2 and DDP)",
                     hint="use `method=analytic`, " + ("`engine=fsdp` (FSDP2 SHARD_GRAD_OP) " if p.zero == 2 else "")
                     + "or `zero=3` (FSDP2)")


def pipeline_layout(w: Workload, *, pp_rank: int) -> Layout | None:
    """The data-parallel layout of pipeline rank ``pp_rank`` (None: the pipeline alone, one
    replica of it traced): FSDP2 over ``dp`` as torchtitan runs pipeline parallelism with data
    parallelism (``pipeline_llm``: the model split into stages, then ``parallelize_fn`` on each
    model part, which ends in ``apply_fsdp_to_decoder``; torchtitan 0.3.0
    ``distributed/pipeline_parallel.py``, ``models/llama3/parallelize.py``) on torchtitan's mesh,
    ``(pp, dp_replicate, dp_shard, cp, tp)``, each part tensor-parallelised first on ``tp``
    (:func:`.pipeline_parallel.tensor_parallelise`); with context parallelism sharded over
    ``dp × cp`` flattened, as torchtitan's ``fsdp`` mesh is (``distributed/parallel_dims.py``
    L278, L328–L333). The traced rank is data- (and tensor-)
    parallel rank 0 of its pipeline rank (FSDP2 pads every shard to the same size: the
    data-parallel ranks hold the same bytes).

    ``reshard_after_forward`` is False on every unit: torchtitan's ``fsdp_reshard_after_forward``
    policy ``"default"`` resolves to ``not pp_enabled`` (``distributed/fsdp.py``
    ``get_fsdp_reshard_after_forward_policy``), for ZeRO-3 and ZeRO-2 alike."""
    p = w.parallel
    offload = p.offload_params or p.offload_optimizer
    if not w.training:
        if p.zero or offload:
            raise TraceError(f"pipeline inference is traced on unsharded stages; `zero={p.zero}`"
                             f"{' with offload' if offload else ''} is not (torch's pipelining runs FSDP for "
                             "training: torchtitan's pipeline_llm)", hint="drop `zero`, or use `method=analytic`")
        return None  # inference replicas of the pipeline
    if not (p.zero or offload or p.dp > 1):
        return None  # the pipeline alone
    engine = dp_engine(w)
    if engine != "fsdp" or p.zero not in (2, 3):
        what = "DDP" if engine == "ddp" else "DeepSpeed" if engine == "deepspeed" else engine.upper()
        raise TraceError(f"pipeline parallelism with data parallelism is traced as torchtitan runs it, FSDP2 on each "
                         f"stage (`zero=3`, or `zero=2` with `engine=fsdp`); `dp={p.dp}` with {what} (`zero={p.zero}`) "
                         "is not", hint="use `zero=3`, or `method=analytic`")
    if offload:
        raise TraceError("CPU offload with pipeline parallelism is not traced (torchtitan's FSDP2 CPU offload "
                         "under `pp` is not checked against a real run)",
                         hint="use `method=analytic`, or drop `offload_params`/`offload_optimizer`")
    if p.ep > 1:
        raise TraceError(f"pipeline parallelism with FSDP2 is traced on a (pp, dp[, cp][, tp]) mesh; with `ep={p.ep}` "
                         "it is not yet (torchtitan's expert plan on each stage is not laid out here)",
                         hint="use `method=analytic` for this layout, or drop `ep`")
    if w.peft is not Peft.NONE or w.quant is not Quant.NONE:
        raise TraceError("pipeline parallelism with FSDP2 is traced for full-weight training; "
                         f"{'`peft=' + str(w.peft) + '`' if w.peft is not Peft.NONE else '`quant=' + str(w.quant) + '`'} "
                         "is not (not checked against a real run)", hint="use `method=analytic`, or `zero=0`")
    shard = p.dp_shard if 0 < p.dp_shard < p.dp else p.dp
    # (`dp=1`: torchtitan still applies fully_shard, over one rank: its mixed-precision policy)
    # `cp`: torchtitan's "fsdp" mesh is dp_shard × cp flattened (parallel_dims.py L278, L328–L333),
    # as RankContext.shard_mesh flattens it
    mesh: list[tuple[str, int]] = [("pp", p.pp), ("dp_replicate", p.dp // shard), ("dp", shard), ("cp", p.cp),
                                   ("tp", p.tp)]
    world = World(tuple(d for d in mesh if d[0] not in ("dp_replicate", "cp", "tp") or d[1] > 1))
    per_stage = world.size // p.pp
    return Layout(dataclasses.replace(world, rank=pp_rank * per_stage), "fsdp2", reshard_after_forward=False,
                  pipeline=True)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP wraps one by one: instances of the model's ``_no_split_modules``
    classes (transformers' decoder layers), else the children of its largest ``ModuleList``."""
    names: set[str] = set()
    for m in model.modules():
        ns = getattr(m, "_no_split_modules", None)
        if isinstance(ns, (list, tuple, set)):
            names.update(str(n) for n in ns)
    if names:
        blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if blocks:
            return blocks
    best: nn.ModuleList | None = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and (best is None or len(m) > len(best)):
            best = m
    return list(best) if best is not None else []


def apply_layout(model: nn.Module, layout: Layout, ctx: RankContext, w: Workload,
                 compute_dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """Lay ``model`` out on this rank; returns (the module to call, notes)."""
    if layout.kind == "fsdp2":
        return model, _fsdp2(model, layout, ctx, w, compute_dtype)
    if layout.kind == "fsdp1":
        return _fsdp1(model, layout, ctx, w, compute_dtype)
    return _ddp(model, layout, ctx)


def apply_reference_layout(ref: nn.Module, layout: Layout, ctx: RankContext, w: Workload,
                           compute_dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """A preference/RL objective's frozen reference model laid out as TRL 1.16.0's
    ``prepare_fsdp`` lays it out (trl/models/utils.py:292-339; docs/research/trl-reference-fsdp.md):

    - FSDP1: ``FullyShardedDataParallel`` with the accelerate plugin's own arguments, so the
      policy's units (``set_auto_wrap_policy``: the ``_no_split_modules`` blocks and the root), its
      sharding strategy and mixed precision; every parameter frozen (one flat parameter per unit).
      Under no_grad the root unit (embeddings, final norm, head) stays gathered after the forward
      (FSDP1 does not free the root's flat parameter after forward, for the backward that never
      comes), each block's is freed;
    - FSDP2: ``fully_shard(ref)`` on the root alone (no per-block call), the plugin's
      ``reshard_after_forward`` (a bool, so not the root's automatic "keep"): the whole model is one
      unit, all-gathered for each forward and freed after it;
    - DDP: left as it is, a whole replica on every rank. Without DeepSpeed or FSDP, TRL calls
      ``accelerator.prepare_model(ref, evaluation_mode=True)`` (dpo_trainer.py:984-990,
      grpo_trainer.py:1182-1188), which places it on the device but wraps it in
      ``DistributedDataParallel`` only ``if not evaluation_mode`` (accelerate 1.16.0
      accelerator.py:1854): no reducer, no buckets.

    Returns (the module to call, notes)."""
    if layout.kind == "ddp":
        if "tp" in layout.world.names:
            raise TraceError("a reference model under DDP with tensor parallelism is not traced",
                             hint="drop `tp`, or use `reference=precomputed`")
        return ref, [f"reference: a whole replica on each of the dp={layout.world.dim('dp')} ranks, not wrapped "
                     "(TRL's accelerator.prepare_model(ref, evaluation_mode=True): no DDP reducer)"]
    if layout.kind == "fsdp1":
        wrapped, notes = _fsdp1(ref, layout, ctx, w, compute_dtype, frozen=True)
        return wrapped, ["reference: " + notes[0].replace("FSDP1 (", "FSDP1 (TRL's prepare_fsdp; ", 1)]
    if layout.kind != "fsdp2" or layout.pipeline or layout.cpu_offload or "dp_replicate" in layout.world.names:
        raise TraceError(f"a reference model under the {layout.kind} layout is not traced",
                         hint="use `zero=3` with `engine=fsdp` or `engine=fsdp1`, or `reference=precomputed`")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": ctx.shard_mesh(), "reshard_after_forward": layout.reshard_after_forward}
    mp = ""
    if w.mixed:  # (accelerate's plugin policy, the policy's own)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        mp = f", MixedPrecisionPolicy(param_dtype={_name(compute_dtype)})"
    rec = ctx.streams.rec
    for p in ref.parameters():
        rec.ignore(_local(p))
    fully_shard(ref, **kw)
    return ref, [f"reference: FSDP2 (TRL's prepare_fsdp) over dp={layout.world.dim('dp')}: fully_shard on the root "
                 f"alone, reshard_after_forward={layout.reshard_after_forward}{mp}: the whole reference all-gathered "
                 f"for each of its forwards; rank {layout.world.rank} traced on the fake process group"]


def _on_the_device(module: nn.Module) -> None:
    """FSDP1's ``param_init_fn`` for the trace's model: its parameters are on the trace device
    already (``meta`` is the GPU here), so FSDP1 has nothing to materialise (without it, it would
    ``to_empty`` each unit and call ``reset_parameters``, which not every module has)."""


def _fsdp1(model: nn.Module, layout: Layout, ctx: RankContext, w: Workload,
           compute_dtype: torch.dtype, frozen: bool = False) -> tuple[nn.Module, list[str]]:
    """FSDP1 as accelerate's ``FullyShardedDataParallelPlugin`` and HF Trainer wrap it: one
    ``FullyShardedDataParallel`` unit per transformer block (``transformer_auto_wrap_policy`` on
    the ``_no_split_modules`` classes) and the root, ``use_orig_params=True`` (Trainer's
    default; accelerate's is False: the same bytes, flat optimizer states), ``limit_all_gathers=
    True``, the workload's backward prefetch (``fsdp1_prefetch``; torch's ``BACKWARD_PRE`` by
    default); under
    ``*-mixed`` precision accelerate's ``MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=
    <16-bit>)`` — fp32 flat shards, 16-bit all-gathers and reduce-scatters."""
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    hsdp = "dp_replicate" in layout.world.names
    strategy = layout.strategy
    if hsdp:  # (intra-node shard group, inter-node replicate group), as FSDP1 takes them
        group: Any = (ctx.submesh("dp").get_group(), ctx.submesh("dp_replicate").get_group())
    else:
        group = ctx.submesh("dp").get_group()
    rec = ctx.streams.rec
    for p in model.parameters():  # the unsharded meta model is not on the GPU: FSDP1 flattens each unit
        rec.ignore(p)
    kw: dict[str, Any] = {}
    mp = ""
    if w.mixed:
        kw["mixed_precision"] = MixedPrecision(param_dtype=compute_dtype, reduce_dtype=compute_dtype,
                                               buffer_dtype=compute_dtype)
        mp = f", MixedPrecision({_name(compute_dtype)} parameters, reduce and buffers)"
    blocks = transformer_blocks(model)
    classes = {type(b) for b in blocks}
    policy: Any = ModuleWrapPolicy(classes) if classes else None
    adapters = ""
    if not frozen and any(not p.requires_grad for p in model.parameters()):
        if w.peft.value != "lora":
            raise TraceError(f"{w.peft} under FSDP1 is not traced (its 4-bit storage needs FSDP1's mixed precision "
                             "in the quant-storage dtype, which is not checked yet)",
                             hint="use `engine=fsdp` (FSDP2 shards QLoRA's packed weights), or `peft=lora`")
        # Trainer and accelerate wrap a PEFT model with peft's own policy (transformers
        # update_fsdp_plugin_peft): the blocks, and each leaf with a trainable weight (the
        # adapters: one dtype per flat parameter) as its own unit
        from peft.utils.other import fsdp_auto_wrap_policy

        policy = fsdp_auto_wrap_policy(model)
        adapters = ", each LoRA adapter its own unit (peft's fsdp_auto_wrap_policy)"
    host = rec.host if layout.cpu_offload else None
    offload = ""
    if host is not None:
        from torch.distributed.fsdp import CPUOffload

        kw["cpu_offload"] = CPUOffload(offload_params=True)
        offload = (", CPUOffload(offload_params=True): pinned flat shards and gradient buffers, the optimizer step "
                   "on the host")
    name = Fsdp1Prefetch(layout.prefetch).config_name
    prefetch = None if name == "NO_PREFETCH" else BackwardPrefetch[name]
    # the trace's device tensors are on ``meta``, whose device module the rank session provides;
    # FSDP1 takes its compute device from ``device_handle.current_device()`` at construction
    handle = torch.meta  # type: ignore[attr-defined]
    saved = handle.current_device
    handle.current_device = lambda: torch.device("meta")
    try:
        with host.construction() if host is not None else contextlib.nullcontext():
            wrapped = FullyShardedDataParallel(
                model, process_group=group, sharding_strategy=getattr(ShardingStrategy, strategy),
                auto_wrap_policy=policy, device_id=torch.device("meta"), param_init_fn=_on_the_device,
                use_orig_params=True, limit_all_gathers=True, backward_prefetch=prefetch, **kw)
    finally:
        handle.current_device = saved
    n = layout.world.dim("dp")
    over = f"HSDP: {layout.world.dim('dp_replicate')} replicas × shards over {n}" if hsdp else f"dp={n}"
    return wrapped, [f"FSDP1 ({strategy}) over {over}: FullyShardedDataParallel units on {len(blocks)} blocks "
                     f"and the root{adapters}, flat parameters, use_orig_params=True, limit_all_gathers, backward prefetch "
                     f"{layout.prefetch}{mp}{offload}; rank "
                     f"{layout.world.rank} traced on the fake process group"]


def _fsdp2(model: nn.Module, layout: Layout, ctx: RankContext, w: Workload, compute_dtype: torch.dtype) -> list[str]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined,no-redef]
                MixedPrecisionPolicy,
                fully_shard,
            )
        except ImportError:
            raise TraceError(f"torch {torch.__version__} has no FSDP2 (fully_shard)",
                             hint="tracing ZeRO-2/3 layouts needs torch >= 2.4; `method=analytic` works without") from None
    hsdp = "dp_replicate" in layout.world.names
    mesh = ctx.shard_mesh()  # dp (× cp, flattened); a 2-D mesh under HSDP
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": layout.reshard_after_forward}
    mp = ""
    if w.mixed:
        # (torchtitan's policy casts no forward inputs: a pipeline stage's are its own dtype already)
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                               cast_forward_inputs=not layout.pipeline)
        mp = f", MixedPrecisionPolicy(param_dtype={_name(compute_dtype)}, reduce_dtype=float32)"
    rec = ctx.streams.rec
    for p in model.parameters():  # the unsharded meta model is not on the GPU: only the shards are
        rec.ignore(_local(p))  # (a tensor-parallel parameter: its TP-local shard, which FSDP shards)
    if layout.pipeline:
        from .pipeline_parallel import fsdp_units

        units = fsdp_units(model)
        for modules, reshard in units:
            fully_shard(modules, **{**kw, "reshard_after_forward": reshard})
        n, cp = layout.world.dim("dp"), layout.world.dim("cp")
        group = f"{n} × cp {cp} (the flattened dp × cp mesh)" if cp > 1 else f"{n}"
        over = (f"HSDP: {layout.world.dim('dp_replicate')} replicas × shards over {group}" if hsdp else
                f"dp {group}" if cp > 1 else f"dp={n}")
        return [f"FSDP2 over {over} on each model part of the pipeline rank, as torchtitan's apply_fsdp_to_decoder "
                f"shards it ({len(units)} units: the embeddings and the final norm with the head where the stage holds "
                f"them, each block, the part), "
                f"reshard_after_forward=False (torchtitan's default under pp){mp}; torch's pipeline stage holds "
                "gradient sync and resharding until the last micro-batch's backward; rank "
                f"{layout.world.rank} of {layout.world.size} (mesh {dict(layout.world.dims)}) traced on the fake "
                "process group"]
    blocks = transformer_blocks(model)
    host = rec.host if layout.cpu_offload else None
    offload = ""
    if host is not None:
        kw["offload_policy"] = _cpu_offload_policy()
        offload = ", CPUOffloadPolicy(pin_memory=True): sharded parameters, gradients and the optimizer step on the host"
    with host.scope(PARAMETERS) if host is not None else contextlib.nullcontext():  # pinned host shards
        for blk in blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
    n = layout.world.dim("dp")
    cp = layout.world.dim("cp")
    stage = "ZeRO-3 / FULL_SHARD" if layout.reshard_after_forward else "ZeRO-2 / SHARD_GRAD_OP"
    group = f"{n} × cp {cp} (the flattened dp × cp mesh)" if cp > 1 else f"{n}"
    over = f"HSDP: {layout.world.dim('dp_replicate')} replicas × shards over {group}" if hsdp else \
        (f"dp {group}" if cp > 1 else f"dp={n}")
    return [f"FSDP2 ({stage}) over {over}: fully_shard on {len(blocks)} blocks and the root"
            f"{mp}{offload}; rank {layout.world.rank} traced on the fake process group"]


def _cpu_offload_policy() -> Any:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy  # type: ignore[attr-defined,no-redef]
    return CPUOffloadPolicy(pin_memory=True)


def _ddp(model: nn.Module, layout: Layout, ctx: RankContext) -> tuple[nn.Module, list[str]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    group = ctx.submesh("dp").get_group()
    world = layout.world.dim("dp")
    # TP × DDP: DDP given the dp slice of a 2-D mesh runs PyTorch's own composition
    # (torch/nn/parallel/distributed.py → tensor/parallel/ddp.py ``_pre_dp_module_transform``:
    # DTensor parameters become local ones, rebuilt as DTensors around each forward)
    where: dict[str, Any] = {"device_mesh": ctx.submesh("dp")} if "tp" in layout.world.names else {
        "process_group": group}
    ddp = DistributedDataParallel(model, bucket_cap_mb=layout.bucket_cap_mb,
                                  gradient_as_bucket_view=layout.gradient_as_bucket_view, **where)

    def allreduce_hook(state: Any, bucket: Any) -> Any:
        buf = bucket.buffer()
        buf.div_(world)
        dist.all_reduce(buf, group=group)
        fut: Any = torch.futures.Future()
        fut.set_result(buf)
        return fut

    allreduce_hook.__annotations__.clear()  # DDP checks them against dist.GradBucket (not strings)
    ddp.register_comm_hook(None, allreduce_hook)
    note = (f"DDP over dp={world}: gradient buckets of {layout.bucket_cap_mb:g} MiB (first 1 MiB), "
            f"gradient_as_bucket_view={layout.gradient_as_bucket_view}; rank {layout.world.rank} traced "
            "on the fake process group")
    return ddp, [note]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LocalShardOptimizer:
    """The optimizer over the local shards of DTensor parameters (FSDP2).

    ``torch.optim`` over DTensors runs each ``_foreach_*`` op through DTensor's dispatch,
    which for ``Shard(0)`` parameters with ``Shard(0)`` gradients and states (FSDP2's layout)
    applies the same foreach op to the local tensors — no communication, the same
    allocations — after a sharding propagation that costs Python time linear in the number of
    parameters for every op (most of a Llama-8B trace). Here the optimizer runs on plain
    parameters that share the local shards' storage, with the local gradients handed over
    before each step: the memory is the same, without that bookkeeping."""

    def __init__(self, params: list[nn.Parameter], make: Any) -> None:
        self.params = params
        self.local = [_local_param(p) for p in params]
        self.inner = make(self.local)

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    def step(self, closure: Any = None) -> Any:
        for p, q in zip(self.params, self.local, strict=True):
            g = p.grad
            q.grad = None if g is None else _local(g)
        out = self.inner.step()
        for q in self.local:
            q.grad = None
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for q in self.local:
            q.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _local_param(p: nn.Parameter) -> nn.Parameter:
    local = _local(p)
    if local is p:
        return p
    return nn.Parameter(local.detach(), requires_grad=p.requires_grad)


def sharded_params(params: list[nn.Parameter]) -> bool:
    """Whether any parameter is a DTensor (the optimizer then runs on local shards)."""
    return any(_local(p) is not p for p in params)
