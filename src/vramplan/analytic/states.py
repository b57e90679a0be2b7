"""Weights, gradients and optimizer states of one rank (one pipeline stage), in bytes.

Quantised storage (bitsandbytes / fp8), for the linears inside the layers only — token
embeddings, the output head, norms and biases stay 16-bit (bnb skips ``lm_head``):

- int8 (LLM.int8): 1 B/param + an fp32 scale per output row (``SCB``).
- nf4 / int4: 0.5 B/param + an fp32 absmax per 64-element block (0.5 bit/param); with
  QLoRA's double quantisation the absmax is 8-bit with an fp32 scale per 256 blocks
  (0.127 bit/param, Dettmers et al. 2023).
- fp8: 1 B/param + an fp32 scale per output row.

Optimizer states per trainable element: sgd 0; sgd-momentum, lion 1 state; adam/adamw 2;
adamw-8bit (bitsandbytes) 2 × 1 B + an fp32 absmax per block (256 elements from bitsandbytes
0.44, 2,048 before: ``workload.bnb_optim_block``) for tensors of at least 4096 elements (smaller ones keep 32-bit states); adafactor (transformers'
defaults: no first moment) factored fp32 row + column second moments per matrix, full fp32
for vectors. Under DeepSpeed/FSDP mixed precision (ZeRO ≥ 1) the fp32 master weights are
optimizer state too.
"""

from __future__ import annotations

import dataclasses
import math

from vramplan._dataclass import dataclass
from vramplan.precision import fsdp_cpu_offload, fsdp_shards_quantised
from vramplan.workload import (
    Engine,
    Optimizer,
    OptimizerImpl,
    Peft,
    Quant,
    Workload,
    bnb_optim_block,
)

from . import deepspeed as ds
from . import fsdp1 as f1
from .arch import Arch, Linear
from .blocks import head_linear
from .parallel import Stage, fsdp_padding, local, local_adapters, local_small, stage_groups
from .regime import Regime, Trainable

BNB_MIN_8BIT = 4096
BNB_PAGED_MIN = 100_000


def quantised_bytes(elems: int, rows: int, q: Quant, *, double: bool = False) -> int:
    """Bytes of a quantised weight of ``elems`` elements and ``rows`` output rows."""
    if q in (Quant.INT8, Quant.FP8):
        return elems + 4 * rows
    blocks = math.ceil(elems / 64)
    absmax = blocks + 4 * math.ceil(blocks / 256) if double else 4 * blocks
    # bitsandbytes QuantState: the 16-entry fp32 code, and with double quantisation the
    # second level's 256-entry fp32 code and fp32 offset
    consts = 4 * 16 + (4 * 256 + 4 if double else 0)
    return math.ceil(elems / 2) + absmax + consts


@dataclass(frozen=True)
class States:
    """What one rank holds for the model, and the model-sized transients around it."""

    params: int
    """Parameters on this rank (elements; before ZeRO sharding)."""
    trainable: int
    weights: int
    gradients: int
    optimizer: int
    gathered: int = 0
    """ZeRO-3 / FSDP: 16-bit parameters gathered at once in a layer's backward. FSDP2 (ZeRO-3, no
    pipeline): the root unit's (embeddings, final norm, head: what no block holds) and the running
    block's (``gathered_block``); the prefetched block's all-gather output is ``prefetched``."""
    gathered_block: int = 0
    """FSDP2 ZeRO-3 without a pipeline: of ``gathered``, the running block's unsharded parameters,
    which the forward's end and the loss's backward do not hold (every block is resharded after its
    forward; there the last block's all-gather output is a temporary: ``forward_gather``,
    ``prefetched``). The root unit stays gathered from the root's pre-backward to its post-backward
    at the end of backward (torch 2.13 ``fsdp/_fully_shard/_fsdp_state.py:381-392`` ``_pre_backward``
    unshards it; the root's forward inputs, the token ids, need no gradient, so its post-backward
    runs from ``_root_post_backward_final_callback``, ``:408-413``, after every block's)."""
    gathered_root: int = 0
    """FSDP2 without a pipeline (unquantised, data-parallel): the root unit's unsharded parameters in
    ``param_dtype`` (embeddings, final norm, head, padded; :func:`_root_params`), gathered from the
    root's pre-backward to its post-backward at the end of backward, at ZeRO-2 and ZeRO-3 alike.
    Each step's forward gathers it first (every unit is resharded by the previous post-backward);
    its all-gather output, as large, outlives the first block's copy-out: ``wait_for_unshard``
    frees the previous unit's result only when it returns (torch 2.13
    ``fsdp/_fully_shard/_fsdp_param_group.py:430-432``: ``comm_ctx.all_gather_state = None``, but the
    walrus's local ``prev_all_gather_state`` still refers to it through the copy-out, ``:463-470``),
    so the first block's forward starts with the root's parameters and all-gather output and the
    block's (``forward_gather``) both."""
    gathered_end: int = 0
    """Of those, what is still gathered when backward reaches the first layer and the
    embeddings (FSDP2 ZeRO-2 reshards each unit after its backward: the last units only)."""
    head_grads: int = 0
    layer_grads: int = 0
    """Gradients of the largest layer, as held (sharded under ZeRO ≥ 2)."""
    unsharded_grads: int = 0
    """ZeRO ≥ 2: one layer's full gradients before the reduce-scatter."""
    ddp_buckets: int = 0
    """DDP's all-reduce buckets (as large as the gradients; kept for the whole run), or
    DeepSpeed's reduce buckets (``engine=deepspeed``)."""
    ddp_view: bool = False
    """``gradient_as_bucket_view``: the gradients are views into the buckets (no second copy)."""
    opt_temp: int = 0
    casts_all: int = 0
    """Autocast's 16-bit copies of every linear weight used in the forward."""
    casts_layer: int = 0
    dequant: int = 0
    """16-bit copy of the largest quantised matrix while it multiplies."""
    largest_grad: int = 0
    """Gradient bytes of the largest trainable tensor (``optimizer_in_backward`` holds one at a time)."""
    step_temp: int = 0
    """Temporaries of one optimizer step over that tensor alone (per-parameter optimizers)."""
    host_optimizer: int = 0
    """FSDP2 CPU offload: the optimizer states, on the host."""
    host_step: int = 0
    """FSDP2 CPU offload: the CPU optimizer step's temporaries."""
    embed_grad_full: int = 0
    """TP × FSDP2: the embedding's whole Replicate gradient (:func:`replicated_embedding_grad`),
    its TP-local copy and the head's unsharded gradient, alive at the embedding's backward
    until FSDP2 reduce-scatters the root unit."""
    embed_grad_new: int = 0
    """TP without data parallelism, gradients accumulated over micro-batches: the embeddings' new
    whole-table gradient (Replicate, :func:`replicated_embedding_grad`) of a later micro-batch,
    beside the kept one while AccumulateGrad adds it in place."""
    accumulated: int = 0
    """Pipeline × FSDP2 (:func:`pipeline_fsdp`): the stage's unsharded gradients in the reduce
    dtype, accumulated over the micro-batches until the end of the step."""
    accumulated_head: int = 0
    """Of those, the final norm's and the head's (made before the stage's last layer's backward)."""
    accumulated_layer: int = 0
    """Of those, the largest layer's, where they are autograd's own gradients (the reduce dtype
    is the parameters'): in the first micro-batch they are the fresh ones until the layer's
    post-backward keeps them; 0 where that post-backward casts a copy beside them."""
    fresh_first: int = 0
    """Pipeline × FSDP2: the gradients autograd makes for the layer whose backward runs, in the
    parameters' dtype, before FSDP2's post-backward keeps them (the first micro-batch)."""
    fresh_later: int = 0
    """The same in later micro-batches: the 16-bit gradients under mixed precision, added into
    the accumulated ones by the post-backward; in fp32 autograd adds each new gradient into the
    kept ``grad`` in place, one tensor at a time (the largest)."""
    fresh_head: int = 0
    """The same for the final norm and the head (their unit's backward, later micro-batches)."""
    fresh_head_first: int = 0
    """The final norm's and the head's gradients in the first micro-batch's backward."""
    head_cast: int = 0
    """Their accumulated copy, which the first micro-batch's post-backward casts beside them
    (0 where the reduce dtype is the parameters')."""
    fresh_embed: int = 0
    """The token embeddings' new gradient in the parameters' dtype (one tensor), every micro-batch."""
    accumulated_embed: int = 0
    """The token embeddings' accumulated gradient, where it is autograd's own (as ``accumulated_layer``)."""
    deferred: int = 0
    """Pipeline × FSDP2 under a zero-bubble schedule on a rank that holds the first and the last
    stage (ZBVZeroBubble's V): the last stage's weight gradients of its separate weight step, in
    the parameters' 16-bit dtype, kept as the unsharded parameters' ``grad`` until that stage's
    next backward (its post-backward casts or adds them): alive through the first stage's
    backward. 0 where the reduce dtype is the parameters' (autograd adds into the kept ones)."""
    prefetched: int = 0
    """FSDP2 ZeRO-3 (``reshard_after_forward=True``, not under a pipeline): the last layer's
    all-gather output in ``param_dtype``, which the root's pre-backward prefetches before the loss's
    backward runs and which lives until that layer's own pre-backward copies it out. torch 2.13
    ``fsdp/_fully_shard``: ``_fsdp_state.py:434-452`` hooks ``_pre_backward`` on the root's outputs
    (the loss, computed inside the causal LM's forward), ``_fsdp_param_group.py:576-585``
    ``pre_backward`` gathers the root's unit, then ``_backward_prefetch`` (``:795-831``) unshards the
    previous unit in forward order; ``_fsdp_collectives.py:351-354`` allocates the all-gather output
    (the world size × the unit's padded shard), freed after its copy-out (``_fsdp_param_group.py:489``)."""
    forward_gather: int = 0
    """FSDP2 without a pipeline: the last block's all-gather output at the end of the forward. With
    implicit prefetching each unit's all-gather result is kept until the next copy-out
    (``_fsdp_param_group.py:429-432``, ``:483``), the last block's until the root's post-forward frees
    it (``_fsdp_state.py:333-342``), after the head and the loss the causal LM computes inside its
    forward."""
    root_reduce: tuple[int, int] = (0, 0)
    """FSDP2 without a pipeline, full training: the root unit's post-backward, the end of backward
    (the root holds what no block holds: embeddings, final norm, head): (its unsharded gradients in
    ``param_dtype`` beside the reduce-scatter input it copies them into, in the reduce dtype; its
    gradient shard, made by that reduce-scatter). torch 2.13 ``fsdp/_fully_shard``:
    ``_fsdp_param_group.py`` ``post_backward`` reshards the unit, then ``foreach_reduce``
    (``_fsdp_collectives.py``) allocates the world size × padded shard input and copies the
    gradients in (``foreach_reduce_scatter_copy_in``)."""
    root_reduce_out: tuple[int, int] = (0, 0)
    """The same post-backward a moment later, when the reduce-scatter output is allocated: (the input
    plus the last root parameter's unsharded gradient in ``param_dtype`` — the head's, untied; the final
    norm's, tied —, the output). ``foreach_reduce`` clears its list of the unsharded gradients after the
    copy-in (torch 2.13 ``fsdp/_fully_shard/_fsdp_collectives.py:606``), but its loop over them
    (``:580-590``, for any world size > 1) leaves its loop variable bound to the last one until it
    returns: that gradient is alive beside the output (``:612``)."""
    tied_embed_grads: int = 0
    """FSDP2 without a pipeline, full training, a head tied to the embeddings: in the embeddings'
    backward, the head's gradient (waiting in autograd's input buffer of the shared parameter's
    AccumulateGrad), the embeddings' new one and their sum, made out of place (torch 2.13
    ``include/torch/csrc/autograd/input_buffer.h:4-6``: "avoid modifying the passed values in-place
    (adding an input twice will accumulate the result)"), in ``param_dtype``."""
    reduce: tuple[int, int, int] = (0, 0, 0)
    """Pipeline × FSDP2, the end of the step (``perform_reduce_grad``): the gathered bytes still
    held, the gradients and the reduce-scatter input at its highest instant."""
    fsdp1: f1.Fsdp1 | None = None
    """FSDP1 (``engine=fsdp1``): its flat parameters' sizes (:mod:`.fsdp1`); the backward's instants
    are FSDP1's own (``phases.training``)."""


def _largest(lins: list[tuple[Linear, int]], w: Workload) -> int:
    return max((local(lin, w) for lin, _ in lins), default=0)


def stage_states(arch: Arch, stage: Stage, w: Workload, rg: Regime, tr: Trainable) -> States:
    p, h = w.parallel, arch.hidden
    cpu = fsdp_cpu_offload(w)  # FSDP2 CPUOffloadPolicy: gradients and the optimizer on the host too
    off_opt = p.offload_optimizer or cpu
    lins = [(lin, n) for g, n in stage.groups for lin in g.linears]
    linear = sum(n * local(lin, w) for lin, n in lins)
    small = sum(n * local_small(g, w) for g, n in stage.groups)
    layer = max((sum(local(lin, w) for lin in g.linears) + local_small(g, w) for g, _ in stage.groups), default=0)
    embed = arch.embed_params // p.tp if stage.embed else 0
    head_lin = head_linear(arch.head, h)
    head_mats = list(arch.head.linears) if stage.head else []
    if stage.head and arch.head.tied and not stage.embed:  # a tied head on a later stage is a copy
        head_mats.append(head_lin)
    head = sum(local(lin, w) for lin in head_mats)
    head_used = head + (local(head_lin, w) if stage.head and arch.head.tied and stage.embed else 0)
    head_small = arch.head.small_params + arch.final_norm_params if stage.head else 0
    extra = arch.extra_params if stage.index == 0 else 0
    adapters = sum(n * tr.local_adapter_params(lin, w) for lin, n in lins)
    layer_adapters = max((sum(tr.local_adapter_params(lin, w) for lin in g.linears) for g, _ in stage.groups),
                         default=0)
    params = linear + small + embed + head + head_small + extra

    # --- weights -----------------------------------------------------------------------
    if w.quant is Quant.NONE:
        linear_b = linear * rg.weight
    else:
        double = w.peft is Peft.QLORA and not w.bnb_single_quant
        linear_b = sum(
            n * quantised_bytes(local(lin, w), local(lin, w) // max(1, lin.d_in), w.quant, double=double)
            for lin, n in lins
        )
    weights = linear_b + (params - linear) * rg.weight + adapters * rg.adapter
    gathered = gathered_block = pad = prefetched = forward_gather = 0
    # FSDP2 shards the parameters at ZeRO-2 too (reshard_after_forward=False keeps each unit's
    # gathered 16-bit parameters from its forward to its backward, then reshards), padding dim 0
    # of every tensor to a multiple of the shard group (analytic/parallel.py fsdp_padding)
    fsdp2 = p.framework is Engine.FSDP and p.zero >= 2 and w.training
    pipelined = pipeline_fsdp(w)
    unit_pad = (0, 0, 0)  # (largest layer, embedding, head): FSDP2 all-gathers padded shards
    if fsdp2 and w.quant is Quant.NONE:
        embed_rows = (arch.vocab // p.tp if p.tp > 1 else arch.vocab) if stage.embed else 0
        pad = fsdp_padding(lins, embed_rows, head_mats, h, w)
        unit_pad = (max((fsdp_padding([(lin, 1) for lin in g.linears], 0, [], h, w) for g, _ in stage.groups),
                        default=0), fsdp_padding([], embed_rows, [], h, w), fsdp_padding([], 0, head_mats, h, w))
    if (p.zero == 3 or fsdp2) and w.training:
        per_unit = p.zero == 3 and not pipelined  # a pipeline stage keeps every unit gathered (pipeline_fsdp)
        unit = max(layer + unit_pad[0], embed + unit_pad[1], head + unit_pad[2]) if per_unit else params + pad
        if pipelined:
            unit += adapters  # (the adapters are FSDP2 parameters too, gathered with their unit)
        gathered = (2 if per_unit else 1) * unit * min(rg.weight, rg.compute)  # FSDP2 gathers in param_dtype
        if fsdp2 and not pipelined:
            forward_gather = (layer + unit_pad[0] + layer_adapters) * min(rg.weight, rg.compute)
            if per_unit:  # (ZeRO-2 keeps the layers gathered from the forward: nothing to gather)
                prefetched = gathered_block = forward_gather
                # a unit per block and the root's (fully_shard on each block, then on the model): in a
                # block's backward the root's parameters, the block's and the next one's all-gather output
                # (prefetched, a temporary) — not 2 x the largest unit, which a tied head's root is
                gathered = _root_params(embed, head, head_small, extra, unit_pad) * min(rg.weight, rg.compute) \
                    + gathered_block
        weights = 0 if p.offload_params else (weights + pad * rg.weight) // p.shard_group
    if p.zero == 3 and fsdp_shards_quantised(w) and not p.offload_params:
        # FSDP-QLoRA: the packed 4-bit weights (Params4bit, bnb_4bit_quant_storage = the gather
        # dtype) are sharded per tensor along dim 0; their quant state stays whole on every rank
        qs = rg.compute if w.mixed else rg.weight
        shards = p.shard_group

        def packed(lin: Linear, per_rank: bool) -> int:
            rows = (local(lin, w) // max(1, lin.count) + 1) // (2 * qs)
            return lin.count * (-(-rows // shards) if per_rank else rows) * qs

        state = quant_state_bytes(arch, stage, w)
        rest = (params - linear) * rg.weight + adapters * rg.adapter
        weights = sum(n * packed(lin, True) for lin, n in lins) + state + rest // shards
        if w.training:
            unit = max((sum(packed(lin, False) + tr.local_adapter_params(lin, w) * rg.compute for lin in g.linears)
                        + local_small(g, w) * rg.compute for g, _ in stage.groups), default=0)
            gathered = 2 * max(unit, (embed + head) * min(rg.weight, rg.compute))
            prefetched = forward_gather = 0 if pipelined else unit
            if pipelined:  # every unit of the stage stays gathered (pipeline_fsdp)
                gathered = sum(n * sum(packed(lin, False) + tr.local_adapter_params(lin, w) * rg.compute for lin in g.linears)
                               + n * local_small(g, w) * rg.compute for g, n in stage.groups) \
                    + (embed + head + head_small) * min(rg.weight, rg.compute)

    # --- gradients and optimizer states -----------------------------------------------
    trainable = params if tr.full else adapters
    g_shard = p.shard_group if p.zero >= 2 else 1
    o_shard = p.shard_group if p.zero >= 1 else 1
    pad_trainable = pad if tr.full else 0
    gradients = (trainable + pad_trainable) * rg.grad // g_shard
    gradients += replicated_embedding_grad(arch, stage, w, rg, tr)
    if off_opt and p.zero >= 1:
        gradients = 0  # gradient partitions stream to CPU with the optimizer (ZeRO-Offload, FSDP2 offload)
    if tr.full:
        matrices = [(lin.d_in, lin.d_out, n * lin.count, lin.tp, lin.expert) for lin, n in lins]
        if embed:
            matrices.append((arch.vocab, h, 1, True, False))
        matrices += [(lin.d_in, lin.d_out, 1, lin.tp, False) for lin in head_mats]
        vectors = small + head_small + extra + max(0, embed - (arch.vocab * h // p.tp if embed else 0))
    else:
        matrices = [(e // tr.rank, tr.rank, n * lin.count, False, False) for lin, n in lins if tr.lora_on(lin)
                    for e in local_adapters(lin, tr.rank, w)]
        vectors = 0
    optimizer = _optimizer_bytes(w, rg, trainable + pad_trainable, matrices, vectors) // o_shard
    host_optimizer = optimizer if cpu else 0
    if off_opt:
        optimizer = 0
    largest = _largest(lins, w) if tr.full else max(
        (max(local_adapters(lin, tr.rank, w)) for lin, _ in lins if tr.lora_on(lin)), default=0)
    if tr.full:
        largest = max(largest, embed, head)
    opt_temp = 0 if off_opt else _optimizer_temp(w, rg, trainable // o_shard, largest)
    host_step = _optimizer_temp(w, rg, trainable // o_shard, largest) if cpu else 0

    casts_all = casts_layer = 0
    if rg.autocast and rg.weight == 4:  # fp32 weights: autocast caches a 16-bit copy of each
        # (quantised linears are not fp32 parameters: only the head and the adapters are cast)
        quantised = w.quant is not Quant.NONE
        casts_all = rg.compute * ((0 if quantised else linear) + head_used + adapters)
        casts_layer = rg.compute * (layer_adapters + (0 if quantised else max(
            (sum(local(lin, w) for lin in g.linears) for g, _ in stage.groups), default=0)))
    elif rg.autocast and adapters and not rg.param_cast:  # (FSDP2's param_dtype adapters: nothing to cast)
        casts_all, casts_layer = rg.compute * adapters, rg.compute * layer_adapters
    dequant = _dequant_bytes(w, rg) * _largest(lins, w) if w.quant is not Quant.NONE else 0

    per_layer = layer if tr.full else layer_adapters
    embed_grad_full = 0
    ddp_tp = p.dp > 1 and p.zero == 0 and p.framework is Engine.DDP
    # TP: the RowwiseParallel embedding's gradient is the whole table, Replicate (replicated_embedding_grad)
    whole_embed_grad = p.tp > 1 and tr.full and stage.embed and not (arch.head.tied and stage.head) and w.training
    if (fsdp2 or ddp_tp) and whole_embed_grad and not pipelined:
        # FSDPParam redistributes the Replicate gradient to the parameter's Shard(0) before the
        # reduce-scatter (_fsdp_param.py _get_grad_inner_tensor, torch 2.13), DDP × TP's
        # DTensor.from_local backward does the same: both live a moment (with FSDP2 the head's
        # unsharded 16-bit gradient too, reduce-scattered with the root unit after it)
        g = min(rg.weight, rg.compute) if fsdp2 else rg.grad
        embed_grad_full = (arch.vocab * h + arch.vocab * h // p.tp + (head if fsdp2 else 0)) * g
    embed_grad_new = arch.vocab * h * rg.grad if replicated_embedding_grad(arch, stage, w, rg, tr) else 0
    buckets = trainable * rg.grad if (p.dp > 1 and p.zero == 0 and w.training) else 0
    if p.engine is Engine.DEEPSPEED and w.training and p.zero:
        # DeepSpeed's own buffers and gathering granularity (analytic/deepspeed.py)
        buckets = ds.reduce_buckets(p.zero, rg.compute)
        if p.zero == 3:
            gathered = ds.gathered(max(_largest(lins, w), embed, head), min(rg.weight, rg.compute))
            if not p.offload_params:
                weights += ds.persistent(small + head_small, p.shard_group, rg.weight)
            if rg.master and not p.offload_optimizer:
                opt_temp = ds.step_fp32_grads(3, trainable // o_shard)
    gathered_end = gathered
    if fsdp2 and p.zero == 2 and not pipelined:
        gathered_end = (layer + embed + head + head_small) * min(rg.weight, rg.compute)
    accumulated = accumulated_head = accumulated_embed = accumulated_layer = head_cast = 0
    fresh_first = fresh_later = fresh_head = fresh_head_first = fresh_embed = deferred = 0
    reduce = (0, 0, 0)
    if pipelined:
        # under TP the embeddings' accumulated gradient is the whole table (Replicate), which
        # FSDPParam redistributes to the parameter's Shard(0) only at the reduce
        # (_fsdp_param.py:924-958 ``_get_grad_inner_tensor``, torch 2.13)
        embed_more = arch.vocab * h - arch.vocab * h // p.tp if whole_embed_grad else 0
        units = _reduce_units(arch, stage, w, rg, tr, head_mats, extra, embed_more)
        accumulated = sum(a for _, a, _, _ in units)
        accumulated_head = (sum(local(lin, w) for lin in head_mats) + head_small) * rg.grad if tr.full else 0
        g16 = min(rg.weight, rg.compute)
        # the reduce dtype is the parameters' (fp32): autograd's gradient is kept as it is, and
        # later ones are added into it in place; else the post-backward casts a copy beside it
        in_place = g16 == rg.grad
        if in_place:
            accumulated_layer = (layer if tr.full else layer_adapters) * rg.grad
            accumulated_embed = (embed + embed_more) * rg.grad if tr.full else 0
        fresh_first = (layer if tr.full else layer_adapters) * g16
        if tr.full:
            largest_layer = max((local(lin, w) // max(1, lin.count) for g, _ in stage.groups for lin in g.linears),
                                default=0)
            fresh_later = (largest_layer if in_place else layer) * g16
            heads = [local(lin, w) for lin in head_mats]
            fresh_head = (max(heads, default=0) if in_place else sum(heads) + head_small) * g16
            fresh_embed = (embed + embed_more) * g16
            fresh_head_first = (sum(heads) + head_small) * g16
            head_cast = 0 if in_place else accumulated_head
            # a zero-bubble schedule runs a stage's weight gradients (W) apart from its input
            # gradients (I): torch 2.13 pipelining/stage.py:1085-1092 (every stage but the first),
            # _backward.py:325-339 (``weight.grad = dw``), after FSDP2's post-backward of that
            # micro-batch ran in I; the next micro-batch's post-backward (_fsdp_param.py:802-821)
            # or the step's reduce takes them. On the V's first rank they outlive the first
            # stage's backward (the embeddings' new gradient beside them).
            if p.pp_schedule in ("InterleavedZeroBubble", "ZBVZeroBubble") and stage.embed and stage.head \
                    and not in_place:
                lo, hi = p.stage_bounds(arch.layers)[-1]
                deferred = fresh_head_first + (hi - lo) * layer * g16
        else:
            fresh_later = fresh_first
        reduce = _reduce_peak(units, gathered)
    root_reduce = root_reduce_out = (0, 0)
    if fsdp2 and not pipelined and tr.full and w.quant is Quant.NONE:
        root = _root_params(embed, head, head_small, extra, unit_pad)
        root_reduce = (root * (min(rg.weight, rg.compute) + rg.grad), 0 if cpu else root * rg.grad // p.shard_group)
        # the root group's parameters in module order: the embeddings, the final norm, the head last
        last = local(head_mats[-1], w) + unit_pad[2] if head_mats else arch.final_norm_params
        if p.shard_group > 1:
            root_reduce_out = (root * rg.grad + last * min(rg.weight, rg.compute), root * rg.grad // p.shard_group)
    tied_embed_grads = gathered_root = 0
    if fsdp2 and not pipelined and w.quant is Quant.NONE and p.shard_group > 1:
        gathered_root = _root_params(embed, head, head_small, extra, unit_pad) * min(rg.weight, rg.compute)
    if fsdp2 and not pipelined and tr.full and w.quant is Quant.NONE and arch.head.tied and stage.embed \
            and stage.head and p.tp == 1:
        tied_embed_grads = 3 * embed * min(rg.weight, rg.compute)
    states = States(
        params=params + adapters, trainable=trainable, weights=weights, gradients=gradients,
        optimizer=optimizer, gathered=gathered, gathered_block=gathered_block, gathered_end=gathered_end,
        # (FSDP2 CPU offload: each reduce-scattered shard is copied to the host and freed)
        head_grads=(head + head_small) * rg.grad // g_shard if tr.full and not cpu else 0,
        layer_grads=0 if cpu else per_layer * rg.grad // g_shard,
        unsharded_grads=0 if p.zero < 2 or pipelined else (per_layer + (unit_pad[0] if tr.full else 0)) * rg.grad,
        ddp_buckets=buckets,
        ddp_view=p.gradient_as_bucket_view and not (p.engine is Engine.DEEPSPEED and p.zero),
        opt_temp=opt_temp, casts_all=casts_all, casts_layer=casts_layer, dequant=dequant,
        largest_grad=largest * rg.trainable_bytes // g_shard,
        step_temp=0 if off_opt else _optimizer_temp(w, rg, largest, largest),
        host_optimizer=host_optimizer, host_step=host_step, embed_grad_full=embed_grad_full,
        embed_grad_new=embed_grad_new,
        accumulated=accumulated, accumulated_head=accumulated_head,
        accumulated_layer=accumulated_layer,
        fresh_first=fresh_first, fresh_later=fresh_later, fresh_head=fresh_head, fresh_embed=fresh_embed,
        fresh_head_first=fresh_head_first, head_cast=head_cast,
        accumulated_embed=accumulated_embed, deferred=deferred, reduce=reduce, prefetched=prefetched,
        root_reduce=root_reduce, root_reduce_out=root_reduce_out, tied_embed_grads=tied_embed_grads,
        gathered_root=gathered_root,
        forward_gather=forward_gather,
    )
    if f1.applies(w):
        return _fsdp1_states(states, arch, stage, w, rg, lins, matrices, vectors)
    return states


def _fsdp1_states(st: States, arch: Arch, stage: Stage, w: Workload, rg: Regime, lins: list[tuple[Linear, int]],
                  matrices: list[tuple[int, int, int, bool, bool]], vectors: int) -> States:
    """``st`` as FSDP1 holds it (:mod:`.fsdp1`; full training): flat parameters padded per unit, their gradient
    shards in the parameters' dtype, one all-gather output per gathered unit, no autocast copies
    (the gathered parameters are in ``param_dtype`` already)."""
    n = w.parallel.shard_group
    blocks = [sum(local(lin, w) for lin in g.linears) + local_small(g, w) for g, k in stage.groups for _ in range(k)]
    embed = arch.embed_params if stage.embed else 0
    head_mats = list(arch.head.linears) if stage.head else []
    head = sum(local(lin, w) for lin in head_mats)
    head_small = arch.head.small_params + arch.final_norm_params if stage.head else 0
    root = embed + head + head_small + (arch.extra_params if stage.index == 0 else 0)
    flat = sum(f1.padded(b, n) for b in blocks) + f1.padded(root, n)
    tied = embed if arch.head.tied and stage.head else 0
    sizes = f1.layout(w, blocks=blocks, root=root, head=head + head_small, tied=tied, weight_b=rg.grad,
                      gather_b=min(rg.weight, rg.compute))
    weights = flat * rg.weight // n
    gradients = flat * rg.grad // n
    optimizer = _optimizer_bytes(w, rg, flat, matrices, vectors) // n
    gathered = sizes.root + (sizes.blocks if sizes.keep_all else sizes.block)
    return dataclasses.replace(
        st, weights=weights, gradients=gradients, optimizer=optimizer, gathered=gathered,
        gathered_block=0 if sizes.keep_all else sizes.block, gathered_end=sizes.root + sizes.block,
        prefetched=0, forward_gather=0, casts_all=0, casts_layer=0, unsharded_grads=0, root_reduce=(0, 0),
        root_reduce_out=(0, 0), tied_embed_grads=0,
        opt_temp=_optimizer_temp(w, rg, flat // n, max(_largest(lins, w), embed, head)),
        fsdp1=sizes)


def _root_params(embed: int, head: int, head_small: int, extra: int, unit_pad: tuple[int, int, int]) -> int:
    """Elements of FSDP2's root unit (``fully_shard(model)`` after each block's): what no block
    holds — the embeddings, the final norm, the head (a tied head is the embeddings) — padded."""
    return embed + head + head_small + extra + unit_pad[1] + unit_pad[2]


def pipeline_fsdp(w: Workload) -> bool:
    """Whether a pipeline stage is trained under FSDP2 as torchtitan runs it: ``pipeline_llm``
    splits the model, then shards each part (torchtitan 0.3.0
    ``distributed/pipeline_parallel.py:108-121``) with ``reshard_after_forward=False`` — the
    ``"default"`` policy is ``not pp_enabled`` (``distributed/fsdp.py:54``), for ``zero=3`` and
    ``zero=2`` alike — and torch's ``PipelineStage`` runs every micro-batch's backward with
    resharding after backward and gradient sync off (torch 2.13
    ``torch/distributed/pipelining/stage.py:843-847``) until ``perform_reduce_grad`` after the
    last one (``stage.py:1164-1191``). So from the first forward to the end of the step the
    stage's parameters stay gathered in ``param_dtype``, and its gradients accumulate unsharded
    in the reduce dtype (``FSDPParam.unsharded_accumulated_grad``, ``_fsdp_param.py:802-820``;
    under fp32 the unsharded parameter's ``grad``), reduce-scattered only at the end
    (docs/research/pipeline-fsdp.md). Over one rank (``dp=1``) the pipeline is counted as without
    data parallelism."""
    p = w.parallel
    return p.pp > 1 and w.training and p.framework is Engine.FSDP and p.zero >= 2 and p.shard_group > 1


def _reduce_units(arch: Arch, stage: Stage, w: Workload, rg: Regime, tr: Trainable, head_mats: list[Linear],
                  extra: int, embed_more: int = 0) -> list[tuple[int, int, int, int]]:
    """The rank's FSDP2 units in the order ``perform_reduce_grad`` reduces them, each as
    (gathered bytes, accumulated gradient bytes, reduce-scatter input bytes, the gradient
    shard's bytes). Each stage (model part) reduces after its own last backward — on a rank
    that holds several, the later stage first (its last micro-batch's backward runs before the
    earlier stage's) — its units in the order of the modules: embeddings, layers, the final norm
    with the head, the root's own parameters. The reduce-scatter input is padded as the shards
    are (``foreach_reduce``, torch 2.13 ``_fsdp_collectives.py``); the accumulated gradients are not.
    ``embed_more``: elements the embeddings' accumulated gradient holds beyond the parameter's
    (under TP the whole table, Replicate)."""
    p, h = w.parallel, arch.hidden
    gather, quantised = min(rg.weight, rg.compute), w.quant is not Quant.NONE
    out: list[tuple[int, int, int, int]] = []

    def add(elems: int, adapters: int, pad: int, count: int = 1, more: int = 0) -> None:
        pad = 0 if quantised else pad
        trains = elems if tr.full else adapters
        rs = (trains + (pad if tr.full else 0)) * rg.grad
        out.extend([((elems + pad + adapters) * gather, (trains + more) * rg.grad, rs, rs // p.shard_group)] * count)

    ids = p.stage_ids(stage.index) if p.pp > 1 else (0,)
    last = p.pp * p.stages_per_rank - 1
    for i in sorted(ids, reverse=True):
        if i == 0:
            rows = arch.vocab // p.tp if p.tp > 1 else arch.vocab
            add(arch.embed_params // p.tp, 0, fsdp_padding([], rows, [], h, w), more=embed_more)
        for g, n in stage_groups(arch, w, i) if p.pp > 1 else stage.groups:
            add(sum(local(lin, w) for lin in g.linears) + local_small(g, w),
                sum(tr.local_adapter_params(lin, w) for lin in g.linears), fsdp_padding([(lin, 1) for lin in g.linears], 0, [], h, w), n)
        if i == last and stage.head:
            add(sum(local(lin, w) for lin in head_mats) + arch.head.small_params + arch.final_norm_params, 0,
                fsdp_padding([], 0, head_mats, h, w))
        if i == 0 and extra:
            add(extra, 0, 0)
    return out


def _reduce_peak(units: list[tuple[int, int, int, int]], gathered: int) -> tuple[int, int, int]:
    """(gathered bytes still held, gradients, reduce-scatter input) at the highest instant of
    ``perform_reduce_grad``: each unit's ``post_backward`` reshards it, copies its accumulated
    gradients into the reduce-scatter input (then freed) and makes its gradient shard; the
    previous unit's input is released first (``reduce_scatter_max_input_buffers`` 1,
    ``_fsdp_param_group.py``)."""
    best = (0, 0, 0)
    left = sum(a for _, a, _, _ in units)
    freed = shards = 0
    for g, a, rs, s in units:
        freed += g
        shards += s
        now = (max(0, gathered - freed), left + shards, rs)
        left -= a
        if sum(now) > sum(best):
            best = now
    return best


def quant_state_bytes(arch: Arch, stage: Stage, w: Workload) -> int:
    """Bytes of the 4-bit quant state (absmax, codes) of this stage's quantised linears: what
    FSDP-QLoRA keeps whole on every rank (the packed weights are sharded)."""
    if w.quant not in (Quant.NF4, Quant.INT4):
        return 0
    double = w.peft is Peft.QLORA and not w.bnb_single_quant
    return sum(n * (quantised_bytes(local(lin, w), local(lin, w) // max(1, lin.d_in), w.quant, double=double)
                    - -(-local(lin, w) // 2)) for g, n in stage.groups for lin in g.linears)


def replicated_embedding_grad(arch: Arch, stage: Stage, w: Workload, rg: Regime, tr: Trainable) -> int:
    """Bytes a tensor-parallel rank holds beyond its shard of the token-embedding gradient.

    DTensor's embedding backward has no row-wise (vocabulary) strategy
    (torch/distributed/tensor/_ops/_embedding_ops.py, ``embedding_dense_backward_strategy``,
    torch 2.13): the gradient of torchtitan's RowwiseParallel embedding is the whole table,
    Replicate, on every rank (the trace of ``parallelize_module`` shows it). Counted without
    ZeRO/FSDP sharding only, the layout the trace checks it on. A head tied to the embedding
    adds its vocabulary-sharded gradient first, and the sum keeps that sharding — on the stage
    that holds both: under pipeline parallelism the first stage's embeddings are untied (the
    last stage keeps its own copy of the table, :mod:`vramplan.analytic.parallel`). Under DDP
    (``dp > 1``) the parameters DDP holds are the TP-local tensors (``_pre_dp_module_transform``):
    ``DTensor.from_local``'s backward hands the local shard of that gradient to them, so only
    the moment of the embedding's backward holds the whole table (``States.embed_grad_full``)."""
    p = w.parallel
    if not (tr.full and stage.embed and p.tp > 1 and p.zero == 0 and p.dp == 1 and w.training) or (
            arch.head.tied and stage.head):
        return 0
    return (arch.vocab * arch.hidden - arch.vocab * arch.hidden // p.tp) * rg.grad


def _dequant_bytes(w: Workload, rg: Regime) -> int:
    """Bytes per element of the temporaries around one quantised matmul. 4-bit
    (bitsandbytes ``MatMul4Bit``): the weight dequantised to its load dtype, then
    ``.to(compute dtype)``; under autocast ``F.linear`` casts that to the autocast dtype."""
    if w.quant not in (Quant.NF4, Quant.INT4):
        return rg.compute
    load, cd = rg.weight, rg.bnb_bytes
    to_compute = load + (cd if rg.bnb_dtype != rg.weight_dtype else 0)
    cast = cd + (rg.compute if rg.autocast and rg.bnb_dtype != rg.compute_dtype else 0)
    return max(load, to_compute, cast)


def _optimizer_bytes(w: Workload, rg: Regime, trainable: int,
                     matrices: list[tuple[int, int, int, bool, bool]], vectors: int) -> int:
    o, s = w.optimizer, rg.state
    master = 4 * trainable if rg.master else 0
    if o is Optimizer.SGD:
        return master
    if o in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
        return master + trainable * s
    if o in (Optimizer.ADAM, Optimizer.ADAMW):
        return master + 2 * trainable * s
    p = w.parallel
    if o is Optimizer.ADAFACTOR:
        total = 4 * vectors
        for d_in, d_out, count, tp, expert in matrices:
            div = (p.tp if tp else 1) * (p.ep if expert else 1)
            total += 4 * count * (d_in + d_out) // div
        return master + total
    # adamw-8bit / paged-adamw-8bit: the paged variant's state buffers of tensors of at least
    # 1e5 elements live in CUDA unified memory, outside the caching allocator (bitsandbytes
    # optim/optimizer.py get_state_buffer); their absmax and smaller tensors' states do not
    paged = o is Optimizer.PAGED_ADAMW_8BIT
    block = bnb_optim_block(w.bnb_version)
    # the shared pair of 256-entry fp32 quantisation maps (name2qmap "dynamic", "udynamic")
    total = 8 * vectors + (2 * 4 * 256 if any(d_in * d_out >= BNB_MIN_8BIT for d_in, d_out, *_ in matrices) else 0)
    for d_in, d_out, count, tp, expert in matrices:
        div = (p.tp if tp else 1) * (p.ep if expert else 1)
        elems = count * d_in * d_out // div
        per = d_in * d_out // div
        if d_in * d_out >= BNB_MIN_8BIT:
            total += (0 if paged and per >= BNB_PAGED_MIN else 2 * elems) + 2 * 4 * math.ceil(elems / block)
        else:
            total += 0 if paged and per >= BNB_PAGED_MIN else 8 * elems
    return master + total


def paged_state_bytes(w: Workload, matrices: list[tuple[int, int, int, bool, bool]]) -> int:
    """Bytes of paged-adamw-8bit state buffers in CUDA unified memory (outside the allocator)."""
    if w.optimizer is not Optimizer.PAGED_ADAMW_8BIT:
        return 0
    p, total = w.parallel, 0
    for d_in, d_out, count, tp, expert in matrices:
        div = (p.tp if tp else 1) * (p.ep if expert else 1)
        per = d_in * d_out // div
        if per >= BNB_PAGED_MIN:
            total += count * per * (2 if d_in * d_out >= BNB_MIN_8BIT else 8)
    return total


def _optimizer_temp(w: Workload, rg: Regime, shard: int, largest: int) -> int:
    """Transients of ``optimizer.step()``.

    torch's ``_multi_tensor_adam`` (foreach, the CUDA default) computes
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`` for the whole parameter group at
    once: one state-sized tensor per parameter, alive together (bias corrections are Python
    floats unless ``capturable``). The for-loop path holds one such ``denom`` per parameter
    at a time; fused kernels hold none. transformers' Adafactor builds ``grad**2`` and the
    factored estimate for one parameter at a time (plus fp32 copies of 16-bit grad/param).
    DeepSpeed (ZeRO ≥ 1 under mixed precision) converts the averaged 16-bit gradient
    partition to fp32 for its fused optimizer.
    """
    o, impl = w.optimizer, w.optimizer_impl
    if rg.master:  # DeepSpeed's FusedAdam works in place on the fp32 gradient partition it builds
        return 4 * shard
    temp = 0
    if o in (Optimizer.ADAM, Optimizer.ADAMW):
        if impl is OptimizerImpl.FOREACH:
            temp = shard * rg.state
        elif impl is OptimizerImpl.FOR_LOOP:
            temp = largest * rg.state
    elif o is Optimizer.LION:
        temp = largest * rg.state
    elif o is Optimizer.ADAFACTOR:
        temp = largest * 4 * (2 if rg.grad == 4 else 4)
    return temp
