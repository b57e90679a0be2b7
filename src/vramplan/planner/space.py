"""The space of workload variants the planner searches, and their names in words.

Training: precision × checkpointing (none / selective / torchtitan's op-level / every 2nd
layer / half / full) × optimizer (as given, fused, 8-bit, Adafactor) × the loop's memory
savings (as given, chunked cross-entropy, optimizer step in backward, activation offload)
× PEFT (only with ``allow_peft``) × sharding over the GPU count (DDP, ZeRO-1/2/3, optimizer
and parameter offload) × micro-batch / accumulation (the per-rank samples per step, or
``global_batch``, stay fixed). A workload's recipe limits the space to what its framework
can run (``vramplan.recipes.allows``). Inference: weight
quantisation × KV-cache dtype × tensor parallelism. Every variant is a validated
:class:`Workload`; invalid combinations are skipped, not guessed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from vramplan.errors import PlanError, VramplanError
from vramplan.hardware.gpu import GPU
from vramplan.hardware.target import supports_bf16, supports_fp8
from vramplan.models.shape import samples_per_rank, tokens
from vramplan.workload import (
    Attention,
    Checkpointing,
    Engine,
    KVDtype,
    Loss,
    Optimizer,
    OptimizerImpl,
    Parallel,
    Peft,
    Precision,
    Quant,
    Task,
    Workload,
)


@dataclass(frozen=True)
class Candidate:
    workload: Workload
    num_gpus: int


def for_gpu(w: Workload, gpu: GPU) -> Workload:
    """The workload as it can run on ``gpu``: bf16 becomes fp16 where there is no bf16."""
    if supports_bf16(gpu):
        return w
    swap = {Precision.BF16_MIXED: Precision.FP16_MIXED, Precision.BF16: Precision.FP16_MIXED}
    if w.precision in swap:
        return w.replace(precision=swap[w.precision])
    return w


def gpu_counts(max_gpus: int) -> list[int]:
    counts, n = [], 1
    while n < max_gpus:
        counts.append(n)
        n *= 2
    counts.append(max_gpus)
    return counts


def micro_batches(per_rank: int) -> list[int]:
    """Micro-batch sizes to try for ``per_rank`` samples per step: it, halves, and 1."""
    opts = {per_rank, 1}
    m = per_rank
    for _ in range(2):
        if m % 2:
            break
        m //= 2
        opts.add(m)
    return sorted((d for d in opts if per_rank % d == 0), reverse=True)


def _precisions(w: Workload, gpu: GPU) -> list[Precision]:
    p = for_gpu(w, gpu).precision
    alt = {Precision.BF16_MIXED: Precision.BF16, Precision.BF16: Precision.BF16_MIXED,
           Precision.FP32: Precision.BF16_MIXED if supports_bf16(gpu) else Precision.FP16_MIXED}.get(p)
    return [p] if alt is None else [p, alt]


def _checkpointing(w: Workload, compact: bool = False,
                   knobs: Collection[str] = ()) -> list[tuple[Checkpointing, float, int]]:
    opts = [(Checkpointing.NONE, 1.0, 1), (Checkpointing.FULL, 1.0, 1)] if compact else [
        (Checkpointing.NONE, 1.0, 1), (Checkpointing.SELECTIVE, 1.0, 1),
        *([(Checkpointing.OP, 1.0, 1)] if "op" in knobs else []),
        *([(Checkpointing.FULL, 1.0, 2)] if "every" in knobs else []),
        (Checkpointing.FULL, 0.5, 1), (Checkpointing.FULL, 1.0, 1)]
    on = w.checkpointing is not Checkpointing.NONE
    mine = (w.checkpointing, w.checkpoint_fraction if on else 1.0, w.checkpoint_every if on else 1)
    return opts if mine in opts else [mine, *opts]


def _loops(w: Workload, compact: bool = False, knobs: Collection[str] = ()) -> list[dict[str, object]]:
    """The loop's memory savings to try: as given, then chunked cross-entropy (torchtune's,
    a decoder's fp32 logits 1/8 at a time), the optimizer step inside backward (each gradient
    freed after its update; needs no accumulation) and activation offload to host RAM."""
    opts: list[dict[str, object]] = [{}]
    if w.loss is Loss.FULL and "loss" in knobs:
        opts.append({"loss": Loss.CHUNKED})
    if not w.optimizer_in_backward and "optimizer_in_backward" in knobs:
        opts.append({"optimizer_in_backward": True})
    if not w.activation_offload and not compact and "activation_offload" in knobs:
        opts.append({"activation_offload": True})
    return opts


def _optimizers(w: Workload, compact: bool = False) -> list[tuple[Optimizer, OptimizerImpl]]:
    opts = [(w.optimizer, w.optimizer_impl)]
    if w.optimizer in (Optimizer.ADAM, Optimizer.ADAMW, Optimizer.SGD, Optimizer.SGD_MOMENTUM) and not compact:
        opts.append((w.optimizer, OptimizerImpl.FUSED))
    if w.optimizer in (Optimizer.ADAM, Optimizer.ADAMW):
        opts.append((Optimizer.ADAMW_8BIT, OptimizerImpl.FOREACH))
        if not compact:
            opts.append((Optimizer.ADAFACTOR, OptimizerImpl.FOREACH))
    return list(dict.fromkeys(opts))


def _pefts(w: Workload, allow_peft: bool) -> list[Peft]:
    if w.peft is not Peft.NONE or not allow_peft:
        return [w.peft]
    return [Peft.NONE, Peft.LORA, Peft.QLORA]


GPUS_PER_NODE = 8
"""Tensor and context parallelism stay inside one node (NVLink); HSDP shards inside it."""
TP_SIZES = (2, 4, 8)
PP_SIZES = (2, 4, 8)
CP_SIZES = (2, 4)


def layouts(w: Workload, n: int) -> list[tuple[int, int, int]]:
    """(tp, pp, cp) model-parallel layouts for ``n`` training GPUs: the user's when given
    (any of them > 1), else none plus TP (inside a node), TP × PP and TP × CP that divide ``n``."""
    p = w.parallel
    if (p.tp, p.pp, p.cp) != (1, 1, 1):
        return [(p.tp, p.pp, p.cp)] if n % (p.tp * p.pp * p.cp) == 0 else []
    tps = [1, *(t for t in TP_SIZES if t <= GPUS_PER_NODE)]
    out = [(1, 1, 1)]
    out += [(t, 1, 1) for t in tps[1:] if n % t == 0]
    out += [(t, pp, 1) for pp in PP_SIZES for t in tps if n % (t * pp) == 0]
    out += [(t, 1, c) for c in CP_SIZES for t in tps if t * c <= GPUS_PER_NODE and n % (t * c) == 0]
    return list(dict.fromkeys(out))


PP_SEARCHED: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
"""Schedules the plan tries for a pipeline it lays out: 1F1B (least activation memory of the
bubble-free-ish ones), interleaved (bubble / v, more micro-batches in flight) and the V-shaped
zero-bubble one (nearly no bubble, two stages per rank). GPipe and LoopedBFS hold every
micro-batch in flight at 1F1B's and interleaved's bubble: never better, not searched."""


def pp_schedules(w: Workload, pp: int) -> list[dict[str, object]]:
    """``pp_schedule`` / ``pp_virtual`` settings to try for a ``pp``-stage pipeline: the
    user's when they named one, else :data:`PP_SEARCHED` (stages per rank: the schedule's default)."""
    p = w.parallel
    if pp == 1 or p.pp_schedule != "1F1B" or p.pp_virtual:
        return [{"pp_schedule": p.pp_schedule, "pp_virtual": p.pp_virtual}]
    return [{"pp_schedule": s, "pp_virtual": 0} for s in PP_SEARCHED]


def _shardings(w: Workload, n: int, compact: bool = False) -> Iterator[dict[str, object]]:
    """Parallel settings for ``n`` GPUs: data parallelism × the model-parallel layouts; HSDP
    (shard inside a node, replicate across nodes) where the data-parallel ranks span nodes."""
    p = w.parallel
    if w.task is not Task.TRAIN:
        model_par = p.tp * p.pp * p.cp
        if n % model_par == 0:
            yield {"dp": n // model_par, "zero": 0, "offload_optimizer": False, "offload_params": False}
        return
    for (tp, pp, cp), schedule in ((lay, s) for lay in layouts(w, n) for s in pp_schedules(w, lay[1])):
        dp = n // (tp * pp * cp)
        searched = (tp, pp, cp) != (p.tp, p.pp, p.cp)
        base: dict[str, object] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "sp": tp > 1 if searched else p.sp,
                                   "dp_shard": 0, "offload_optimizer": False, "offload_params": False, **schedule}
        if searched:  # a layout the search adds: the common shardings only
            for z in ([0] if dp == 1 else [1, 3]):
                yield {**base, "zero": z}
            continue
        stages = [0] if dp == 1 else ([0, 3] if compact else [0, 1, 2, 3])
        for z in stages:
            yield {**base, "zero": z}
        shard = GPUS_PER_NODE // (tp * cp)
        if dp > shard > 1 and dp % shard == 0:
            yield {**base, "zero": 3, "dp_shard": shard}
        yield {**base, "zero": 2, "offload_optimizer": True}
        if not compact:
            yield {**base, "zero": 3, "offload_optimizer": True}
            yield {**base, "zero": 3, "offload_optimizer": True, "offload_params": True}


def _per_rank(w: Workload, dp: int, global_batch: int | None) -> int | None:
    if global_batch is None:
        return tokens(w).samples_per_step
    return samples_per_rank(global_batch, dp)


def training_space(w: Workload, gpu: GPU, counts: list[int], *, allow_peft: bool,
                   global_batch: int | None, compact: bool = False,
                   knobs: Collection[str] = ()) -> Iterator[Candidate]:
    for n in counts:
        for sh in _shardings(w, n, compact):
            dp = int(sh["dp"])  # type: ignore[call-overload]
            per_rank = _per_rank(w, dp, global_batch)
            if per_rank is None:
                continue
            searched = (sh["tp"], sh["pp"], sh["cp"]) != (w.parallel.tp, w.parallel.pp, w.parallel.cp)
            small = compact or searched  # model-parallel layouts the user did not ask for: a compact product
            basic = {_checkpointing(w, True)[0], (Checkpointing.NONE, 1.0, 1), (Checkpointing.FULL, 1.0, 1)}
            for prec, (ck, frac, every), (opt, impl), loop, peft, mb in itertools.product(
                _precisions(w, gpu)[:1 if searched else None], _checkpointing(w, small, knobs),
                _optimizers(w, small), _loops(w, small, knobs),
                _pefts(w, allow_peft), micro_batches(per_rank)[:2 if small else None],
            ):
                if loop.get("optimizer_in_backward") and (per_rank // mb > 1 or sh["zero"] or sh["dp"] != 1):
                    continue  # a step per backward: no accumulation; per-parameter hooks, no sharded step
                if loop and ((opt, impl) != (w.optimizer, w.optimizer_impl) or (ck, frac, every) not in basic):
                    continue  # loop savings with the given optimizer and plain/full checkpointing: a small space
                if loop.get("optimizer_in_backward") and peft is not Peft.NONE:
                    continue  # adapters' gradients are tiny: nothing to free early
                if peft is not Peft.NONE and opt in (Optimizer.ADAFACTOR,):
                    continue  # adapters are tiny: optimizer choice does not matter, keep the space small
                changes: dict[str, object] = dict(
                    precision=prec, checkpointing=ck, checkpoint_fraction=frac, checkpoint_every=every,
                    optimizer=opt, optimizer_impl=impl, peft=peft, batch=mb, grad_accum=per_rank // mb, **loop,
                )
                if peft is Peft.QLORA:
                    changes["quant"] = Quant.NF4
                    if prec is Precision.FP32 or sh["offload_params"]:
                        continue  # 4-bit base weights are not offloaded by ZeRO-3/FSDP
                if peft is not Peft.NONE and sh["offload_optimizer"] and not sh["offload_params"]:
                    continue  # adapters' optimizer states are tiny: nothing to offload
                yield from _make(w, n, changes, sh)


def inference_space(w: Workload, gpu: GPU, counts: list[int]) -> Iterator[Candidate]:
    quants = [w.quant] + [q for q in (Quant.NONE, Quant.INT8, Quant.NF4) if q is not w.quant]
    if supports_fp8(gpu) and Quant.FP8 not in quants:
        quants.append(Quant.FP8)
    kvs = [w.kv_dtype] if w.task is Task.INFER else list(dict.fromkeys([w.kv_dtype, KVDtype.AUTO, KVDtype.FP8]))
    attns = [w.attention] if w.attention is not Attention.EAGER else [Attention.EAGER, Attention.SDPA]
    half = Precision.BF16 if supports_bf16(gpu) else Precision.FP16
    precs = list(dict.fromkeys([for_gpu(w, gpu).precision, half]))  # serve in 16-bit, not fp32 weights
    for n in counts:
        if w.parallel.pp * w.parallel.cp > 1 or w.parallel.dp > 1:
            shards = list(_shardings(w, n))
        else:
            shards = [{"tp": n, "dp": 1, "zero": 0, "offload_optimizer": False, "offload_params": False}]
        for sh, q, kv, at, pr in itertools.product(shards, quants, kvs, attns, precs):
            yield from _make(w, n, {"quant": q, "kv_dtype": kv, "attention": at, "precision": pr}, sh)


def _make(w: Workload, n: int, changes: dict[str, object], sharding: dict[str, object]) -> Iterator[Candidate]:
    from vramplan.recipes import allows, layout_defaults

    try:
        par = Parallel(**{**_parallel_fields(w.parallel), **sharding})  # type: ignore[arg-type]
        if w.task is Task.TRAIN:  # the recipe's framework's engine (accelerate, Trainer, TRL: FSDP1 under ZeRO-3)
            par = layout_defaults(w, par)
        if par.engine is Engine.AUTO and par.dp > 1 and w.task is Task.TRAIN:
            # a plan names the framework it runs on (what `emit` writes), and is predicted with its buffers
            par = dataclasses.replace(par, engine=par.framework)
        cand = w.replace(parallel=par, **changes)
    except VramplanError:
        return
    if allows(cand):  # what the recipe's framework can run
        yield Candidate(cand, n)


def _parallel_fields(p: Parallel) -> dict[str, object]:
    from dataclasses import fields

    return {f.name: getattr(p, f.name) for f in fields(p)}


def candidates(w: Workload, gpu: GPU, *, max_gpus: int = 1, allow_peft: bool = False,
               global_batch: int | None = None, counts: list[int] | None = None,
               compact: bool = False, knobs: Collection[str] = ()) -> list[Candidate]:
    """Every valid variant of ``w`` on 1…``max_gpus`` GPUs (or exactly ``counts``).

    ``knobs``: the loop's memory savings to search (``planner.knobs.KNOBS``; the plan passes
    those that lower this workload's predicted peak).

    ``compact``: a smaller space (no selective/partial checkpointing, fused or Adafactor
    optimizers, ZeRO-1/2 or ZeRO-3 offload) for models that must be screened by tracing.
    """
    if max_gpus < 1:
        raise PlanError(f"`max_gpus` must be at least 1, got {max_gpus}", field="max_gpus")
    if global_batch is not None and global_batch < 1:
        raise PlanError(f"`global_batch` must be a positive integer, got {global_batch}", field="global_batch")
    cs = counts or gpu_counts(max_gpus)
    space = training_space(w, gpu, cs, allow_peft=allow_peft, global_batch=global_batch, compact=compact,
                           knobs=knobs) \
        if w.task is Task.TRAIN else inference_space(w, gpu, cs)
    out = list(dict.fromkeys(space))
    if not out and global_batch is not None:
        raise PlanError(f"global batch {global_batch} cannot be split over {cs} GPU(s)",
                        hint="choose a global batch divisible by the GPU count")
    return out


# ---------------------------------------------------------------------------------- words
def describe(w: Workload, n: int) -> str:
    """The configuration in one phrase: ``bf16-mixed + full checkpointing + ZeRO-3 ×8, batch 4 × 2``."""
    parts = [str(w.precision)]
    if w.checkpointing is Checkpointing.FULL:
        frac = "" if w.checkpoint_fraction >= 1.0 else f"{w.checkpoint_fraction:.0%} "
        every = "" if w.checkpoint_every == 1 else f" of every {_ordinal(w.checkpoint_every)} layer"
        parts.append(f"{frac}full checkpointing{every}")
    elif w.checkpointing is Checkpointing.SELECTIVE:
        parts.append("selective checkpointing")
    elif w.checkpointing is Checkpointing.OP:
        parts.append("op-level selective checkpointing")
    if w.training:
        if w.loss is not Loss.FULL:
            parts.append(f"{w.loss} loss" if w.loss is not Loss.CHUNKED else f"chunked loss ({w.loss_chunks})")
        if w.optimizer_in_backward:
            parts.append("optimizer in backward")
        if w.activation_offload:
            parts.append("activation offload")
    if w.training:
        opt = str(w.optimizer)
        if w.optimizer_impl is OptimizerImpl.FUSED:
            opt = f"fused {opt}"
        if w.optimizer is not Optimizer.ADAMW or w.optimizer_impl is not OptimizerImpl.FOREACH:
            parts.append(opt)
    if w.peft is Peft.LORA:
        parts.append(f"LoRA r{w.lora_rank}")
    elif w.peft is Peft.QLORA:
        parts.append(f"QLoRA r{w.lora_rank}")
    elif w.quant is not Quant.NONE:
        parts.append(f"{w.quant} weights")
    if w.kv_dtype is not KVDtype.AUTO and w.task is Task.GENERATE:
        parts.append(f"{w.kv_dtype} KV cache")
    if w.attention is not Attention.SDPA:
        parts.append(f"{w.attention} attention")
    parts += _parallel_words(w, n)
    batch = f"batch {w.batch}" + (f" × {w.grad_accum} accum" if w.grad_accum > 1 else "")
    return " + ".join(parts) + f", {batch}"


def _ordinal(k: int) -> str:
    return f"{k}{'nd' if k % 10 == 2 and k % 100 != 12 else 'rd' if k % 10 == 3 and k % 100 != 13 else 'th'}"


def _parallel_words(w: Workload, n: int) -> list[str]:
    p = w.parallel
    words = []
    if p.dp > 1 and p.dp_shard and p.dp_shard < p.dp:
        words.append(f"HSDP {p.dp // p.dp_shard}×{p.dp_shard}")
    elif p.dp > 1:
        if p.engine is Engine.DEEPSPEED:
            kind = f"DeepSpeed ZeRO-{p.zero}"
        elif p.engine is Engine.FSDP:
            kind = "FSDP" if p.zero == 3 else "FSDP (no reshard)"
        elif p.engine is Engine.FSDP1:
            kind = f"FSDP1 {p.fsdp1_strategy}"
        else:
            kind = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}[p.zero]
        words.append(f"{kind} ×{p.dp}")
    elif p.zero:
        words.append(f"ZeRO-{p.zero}")
    if p.tp > 1:
        words.append(f"TP {p.tp}" + (" + SP" if p.sp else ""))
    if p.cp > 1:
        words.append(f"CP {p.cp}")
    if p.pp > 1:
        words.append(f"PP {p.pp}" + (f" {p.pp_schedule}" if p.pp_schedule != "1F1B" else ""))
    if p.offload_params:
        words.append("param + optimizer offload")
    elif p.offload_optimizer:
        words.append("optimizer offload")
    return words


def changes_from(base: Workload, w: Workload) -> tuple[str, ...]:
    """Field-level differences from the user's workload, as ``field: old → new`` (the values as
    :meth:`Workload.to_dict` writes them). Fields are compared as they are: only a changed one is
    converted (a plan search makes tens of thousands of candidates; two whole ``to_dict`` per
    candidate were most of ``plan --rank-gpus``'s time)."""
    out = []
    for f in dataclasses.fields(w):
        x, y = getattr(base, f.name), getattr(w, f.name)
        if f.name == "parallel":
            out += [f"{pf.name}: {_shown(getattr(x, pf.name))} → {_shown(getattr(y, pf.name))}"
                    for pf in dataclasses.fields(y) if getattr(x, pf.name) != getattr(y, pf.name)]
        elif x != y:
            out.append(f"{f.name}: {_shown(x)} → {_shown(y)}")
    return tuple(out)


def _shown(v: object) -> object:
    from vramplan._json import jsonable

    return jsonable(dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v)
