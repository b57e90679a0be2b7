"""Peak instants of each phase of a step, for one rank.

Training (steady state: optimizer states exist; ``zero_grad(set_to_none=True)`` leaves no
gradients at the start of the forward unless gradient accumulation keeps them):

- forward — the end of the forward: all saved activations, autocast's 16-bit weight copies
  (cached until the autocast region exits), and the loss: 16-bit logits, their fp32 upcast
  (HF ``ForCausalLMLoss`` does ``logits.float()``) and the fp32 log-softmax output.
- backward — the highest of: the loss backward (log-softmax output + the fp32 gradients of
  the log-softmax output and of the logits: 12 bytes per logit), the last layer's backward
  (all activations + one layer recomputed + the first gradients), and the first layer's
  backward (all gradients + one layer's activations). Memory moves linearly between the
  last two, so the maximum is at one of them.
- optimizer — weights + gradients + states + the step's transients (foreach temporaries).

Inference: weights (+ HF's KV cache, built by default) + one layer's working set or the
logits. Generate: prefill (prompt KV cache, logits of the last position only — transformers
passes ``logits_to_keep=1``), decode (the full KV cache, ``torch.cat`` growth of one layer).
"""

from __future__ import annotations

import dataclasses

from vramplan.results import Breakdown, PhasePeak
from vramplan.workload import Checkpointing, Phase, Task, Workload

from . import kv
from .activations import StageActs, infer_layer
from .arch import Arch
from .blocks import Ctx
from .fsdp1 import Fsdp1
from .loss import LossMemory, loss_memory
from .parallel import Stage
from .states import States, pipeline_fsdp


def _peak(phase: Phase, *instants: Breakdown) -> PhasePeak:
    bd = max(instants, key=lambda b: b.total)
    return PhasePeak(phase=phase, allocated=bd.total, breakdown=bd)


def _with_buckets(st: States, grads: int) -> int:
    """Gradient memory with DDP's buckets: beside the gradients, or holding them
    (``gradient_as_bucket_view``)."""
    return max(grads, st.ddp_buckets) if st.ddp_view else grads + st.ddp_buckets


def training(st: States, a: StageActs, stage: Stage, w: Workload, ctx: Ctx, workspace: int,
             cache: int = 0, receive: int = 0, layer_ws: int = 0) -> tuple[PhasePeak, ...]:
    """``cache``: what HF's DynamicCache adds to the forward (dropped with the outputs unless
    the loop keeps them, ``keep_outputs``). ``receive``: one pipeline receive buffer (a
    micro-batch's hidden states), kept ``stage.receives`` times per micro-batch of the step.
    ``layer_ws``: a no-grad forward's working set of one layer (FSDP1: the last block's forward
    under full checkpointing, its parameters gathered)."""
    c = ctx.rg.compute
    classes = a.logits // a.positions if a.positions else 0
    # (the head weight as the loss reads it: under FSDP2's mixed precision the unsharded param_dtype
    # parameter, not the fp32 shard — TRL's fused head then casts its fp32 grad_weight back to it and
    # casts no weight slice; PrecisionModel.forward_weight)
    lm = loss_memory(w, tokens=a.positions, classes=classes, hidden=a.hidden, compute=c, stream=ctx.rg.stream,
                     head_weight=ctx.rg.forward_weight, head_trains=ctx.tr.full, autocast=ctx.rg.autocast,
                     softcap=a.softcap) if a.logits else LossMemory(0, 0, 0, 0)
    # keep_grads (set_to_none=False) and gradient accumulation keep every gradient through the forward
    held = st.gradients if (w.grad_accum > 1 or w.keep_grads) and not w.optimizer_in_backward else 0
    pipelined = pipeline_fsdp(w)
    # Pipeline × FSDP2 (states.pipeline_fsdp): the gradient shards exist from the step's final
    # reduce-scatter to zero_grad; before, the stage accumulates unsharded gradients from its first
    # backward on — all of them at a forward that follows a backward with as many in flight
    early = 0
    if pipelined:
        held = st.gradients if w.keep_grads else 0
        early = st.accumulated if stage.in_flight < w.grad_accum * stage.virtual else 0
    # a pipeline rank whose schedule runs every forward of the step before its first backward (GPipe; 1F1B
    # where m <= pp - rank) has no gradient yet at the end of its forwards (zero_grad set them to None)
    fwd_held = held
    if w.parallel.pp > 1 and not pipelined and not w.keep_grads and stage.in_flight >= w.grad_accum * stage.virtual:
        fwd_held = 0
    kept = (lm.logits_held + stage.held(cache)) if w.keep_outputs else 0
    # torch's pipelining keeps the last stage's output, the logits, through that micro-batch's whole
    # backward (torch 2.13 pipelining/stage.py:963-966: ``stage_output`` popped from ``fwd_cache``, alive
    # until ``backward_one_chunk`` returns), and a one-stage-per-rank schedule's loop keeps the latest
    # forward's output until the next forward's returns (schedules.py:912 GPipe, :1070/:1130 1F1B:
    # ``output = self._stage.forward_one_chunk(...)``): after the last one, through the step's reduce
    out = lm.logits_held if w.parallel.pp > 1 and stage.head and not w.keep_outputs else 0
    out_single = out if stage.virtual == 1 else 0
    w_live = st.weights + st.gathered
    # FSDP2 ZeRO-3: at the forward's end and in the loss's backward no block's parameters are unsharded (the
    # last block's all-gather output is a temporary there: forward_gather, prefetched)
    w_out = w_live - st.gathered_block
    # schedules that run several forwards of the last stage before its backward (GPipe,
    # LoopedBFS) keep each micro-batch's logits and loss inputs until then
    head_saved = a.head + lm.forward_saved
    earlier = (stage.head_in_flight - 1) * head_saved if stage.head else 0
    # what the next micro-batch's backward no longer holds: one chunk of the stage's activations (and, where
    # the schedule runs several forwards of the last stage first, one micro-batch's logits and loss inputs)
    # (the last layer's backward and the loss and head instants: on the rank with the last stage, that
    # stage's backward; Interleaved1F1B holds another mix of its stages' chunks there, Stage.held)
    at_last = stage.head
    fewer = stage.held(a.layers, last=at_last) - stage.held(a.layers, 1, last=at_last) + (head_saved if earlier else 0)
    recv = receive * stage.receives * w.grad_accum
    # torch's pipeline stage keeps each forward's output in ``fwd_cache`` until that micro-batch's
    # backward returns (torch 2.13 pipelining/stage.py:913-916, popped into a local at :963-966): a
    # stage before the last hands on its hidden states (the receive buffer's size), one per chunk in flight
    outs = stage.held_outputs(receive)
    acts = stage.held(a.layers, last=at_last) + a.embed + earlier + recv + stage.held_outputs(receive, last=at_last)
    # Autocast's cache dies when the forward's autocast region exits; a layer's 16-bit weight
    # copies survive into backward only where its linears saved them (layers not fully
    # checkpointed), plus the one layer being recomputed.
    casts_bwd = st.casts_all
    if w.checkpointing in (Checkpointing.FULL, Checkpointing.OP) and a.checkpointed:
        kept_casts = st.casts_all * (stage.layers - a.checkpointed) // max(1, stage.layers)
        casts_bwd = kept_casts + st.casts_layer
    # A pipeline stage's forward of each micro-batch runs in its own autocast region (as the
    # trace runs it): every micro-batch in flight keeps its own saved 16-bit copies
    casts_fwd = st.casts_all
    if w.parallel.pp > 1:
        casts_bwd += stage.held(casts_bwd, 1, uniform=True)
        casts_fwd = stage.held(st.casts_all, uniform=True)
    # a quantised layer's dequantised weight (only while a layer runs), and both cuBLAS workspaces: backward
    # runs on the autograd engine's device thread, with its own handle and so its own workspace, while the
    # forward's, cached on the main thread's handle, stays (docs/research/pipeline-fsdp.md, session 55)
    temps = st.dequant + 2 * workspace
    # optimizer_in_backward (torchtune optimizer_in_bwd): a gradient lives from its
    # accumulation to its parameter's step inside backward, with that step's temporaries
    step_temp = st.step_temp if w.optimizer_in_backward else 0
    all_grads = st.largest_grad if w.optimizer_in_backward else st.gradients
    last_grads = st.largest_grad if w.optimizer_in_backward else max(fwd_held, st.head_grads + st.layer_grads)
    fresh = 0
    if pipelined:  # (the layer's fresh gradients are temporaries until FSDP2's post-backward keeps them)
        all_grads, last_grads = held + st.accumulated, held + (early or st.accumulated_head)
        fresh = st.fresh_later if early else st.fresh_first

    forward = Breakdown(
        weights=w_out, gradients=_with_buckets(st, fwd_held + early), optimizer=st.optimizer,
        activations=acts + head_saved + a.mask,
        # the autograd thread's cuBLAS workspace, made by the previous step's backward, stays cached
        # (a zero-bubble V's last-stage weight gradients wait as 16-bit ``grad``s through later forwards too)
        temporaries=casts_fwd + lm.forward_transient + 2 * workspace + (st.deferred if early else 0)
        + st.forward_gather,
        kv_cache=stage.held(cache),
    )
    if st.fsdp1 is not None:
        start = Breakdown(weights=st.weights, gradients=st.gradients, optimizer=st.optimizer, temporaries=2 * workspace)
        # the last block's forward (FULL_SHARD: gathered until its post-forward), before the head and the loss
        last_block = Breakdown(weights=st.weights + st.fsdp1.root + st.fsdp1.block, optimizer=st.optimizer,
                               gradients=fwd_held, activations=acts + a.mask, temporaries=2 * workspace
                               + (layer_ws if w.checkpointing is Checkpointing.FULL and a.checkpointed else 0))
        return (_peak(Phase.FORWARD, forward, start, *([last_block] if stage.layers else [])),
                _peak(Phase.BACKWARD, *_fsdp1_backward(st, st.fsdp1, a, lm, stage, acts, kept, out, temps, held)),
                _peak(Phase.OPTIMIZER, Breakdown(weights=st.weights, gradients=st.gradients, optimizer=st.optimizer,
                                                 temporaries=st.opt_temp + 2 * workspace)))
    instants = [
        Breakdown(  # the last layer's backward (after the loss and head)
            weights=w_live, optimizer=st.optimizer,
            gradients=_with_buckets(st, last_grads + st.unsharded_grads),
            activations=acts + a.recompute + kept + out,
            # (FSDP2 ZeRO-3: its pre-backward prefetches the previous block, whose all-gather output waits)
            temporaries=casts_bwd + a.transient + temps + step_temp + fresh
            + (st.prefetched if st.gathered_block and stage.layers > 1 else 0),
        ),
        Breakdown(  # the first layer's backward
            weights=st.weights + st.gathered_end, optimizer=st.optimizer,
            gradients=_with_buckets(st, all_grads + st.unsharded_grads - (0 if early else st.accumulated_layer)),
            activations=stage.held(a.layers, 1) + a.embed + a.layer_full + kept + out_single + recv + outs,
            temporaries=st.casts_layer + a.transient + temps + step_temp + fresh,
        ),
    ]
    if fwd_held < held:  # the next micro-batch's last layer: one chunk fewer, every gradient accumulated
        instants.append(dataclasses.replace(
            instants[0], gradients=_with_buckets(st, max(held, st.head_grads + st.layer_grads) + st.unsharded_grads),
            activations=instants[0].activations - fewer))
    if pipelined:
        if not early:  # the next micro-batch's backward: one chunk fewer, every layer's gradients accumulated
            instants.append(Breakdown(
                weights=st.weights + st.gathered_end, optimizer=st.optimizer, gradients=held + st.accumulated,
                activations=stage.held(a.layers, 2) + a.embed + a.layer_full + kept + out_single + recv
                + stage.held_outputs(receive, 1),
                temporaries=st.casts_layer + a.transient + temps + st.fresh_later,
            ))
        instants.append(Breakdown(  # the end of the step: perform_reduce_grad reduce-scatters unit by unit
            weights=st.weights + st.reduce[0], optimizer=st.optimizer, gradients=held + st.reduce[1],
            activations=recv + out_single, temporaries=st.reduce[2] + 2 * workspace,
        ))
        if stage.embed and st.fresh_embed:  # the embeddings' backward: their new gradient beside the kept ones
            for less, acc in ((1, st.accumulated - (0 if early else st.accumulated_embed)),
                              *(((2, st.accumulated),) if not early else ())):
                instants.append(Breakdown(
                    weights=w_live, optimizer=st.optimizer, gradients=held + acc,
                    activations=stage.held(a.layers, less) + kept + recv
                    + stage.held_outputs(receive, less - 1),
                    temporaries=st.fresh_embed + st.deferred + 2 * workspace,
                ))
    if stage.head:
        instants.append(Breakdown(  # the loss backward (before any weight gradient exists)
            weights=w_out, optimizer=st.optimizer, gradients=_with_buckets(st, fwd_held + early),
            activations=acts + a.head + lm.backward_saved + kept + out,
            # (FSDP2 ZeRO-3: the last layer's all-gather, prefetched by the root's pre-backward)
            temporaries=casts_bwd + lm.backward_transient + 2 * workspace + st.prefetched,
        ))
        if fwd_held < held:  # the next micro-batch's, every gradient accumulated
            instants.append(dataclasses.replace(instants[-1], gradients=_with_buckets(st, held),
                                                activations=instants[-1].activations - fewer))
        if pipelined and st.fresh_head_first:  # the head's weight gradients, beside the kept ones
            # The head's MmBackward runs after the loss's backward: the log-softmax output it saved and
            # its fp32 gradients are freed; left is the logits' gradient it reads, in the compute dtype
            # (the fp32 upcast's ToCopyBackward casts it back)
            loss_bwd = head_bwd = instants[-1]
            if lm.logits_grad:  # (the fused losses have no logits: their head's gradient is the loss's own)
                head_bwd = dataclasses.replace(
                    loss_bwd, activations=loss_bwd.activations - lm.backward_saved,
                    temporaries=loss_bwd.temporaries - lm.backward_transient + lm.logits_grad)
            instants.append(dataclasses.replace(
                head_bwd, gradients=held + (early or st.head_cast),
                temporaries=head_bwd.temporaries + (st.fresh_head if early else st.fresh_head_first)))
            if not early:  # the next micro-batch's: one fewer in flight, every gradient accumulated
                instants.append(dataclasses.replace(
                    head_bwd, gradients=held + st.accumulated, activations=head_bwd.activations - fewer,
                    temporaries=head_bwd.temporaries + st.fresh_head))
    if st.root_reduce[0]:  # FSDP2: the root unit's post-backward reduce-scatter, every block's already done
        root_temp, root_shard = st.root_reduce
        # (the end of backward: the forward's cuBLAS workspace, cached on the main thread's handle, beside
        # the autograd thread's, as in the loss's backward; the trace's peak there holds both)
        instants.append(Breakdown(
            weights=st.weights, optimizer=st.optimizer,
            # (the root's shard is that reduce-scatter's output; it exists already where gradients are kept)
            gradients=_with_buckets(st, all_grads - (0 if held or w.optimizer_in_backward else root_shard)),
            activations=kept, temporaries=root_temp + 2 * workspace,
        ))
        if st.tied_embed_grads:  # a tied head: the embeddings' backward sums its two gradients, the root gathered
            # The first block's reduce-scatter input (its unsharded gradients in the reduce dtype) is still
            # alive: FSDP2 keeps each unit's input in ``reduce_scatter_states`` until the next unit's
            # post-backward pops it or the root's final callback clears it (torch 2.13
            # ``fsdp/_fully_shard/_fsdp_param_group.py:717-719`` appends, ``:647-659`` pops,
            # ``_fsdp_state.py:424-431`` clears), and the root's post-backward runs after the embeddings'.
            # Every block is resharded by then, under ZeRO-2 too: its post-backward reshards it whatever
            # reshard_after_forward says (torch 2.13 ``_fsdp_param_group.py:602`` POST_BACKWARD state,
            # ``:637-638`` ``reshard()``, which returns early only in FORWARD, ``:499-509``): the root's
            # parameters are the only gathered ones
            instants.append(Breakdown(
                weights=st.weights + st.gathered_root, optimizer=st.optimizer, activations=kept,
                gradients=_with_buckets(st, all_grads - (0 if held or w.optimizer_in_backward else root_shard)),
                temporaries=st.tied_embed_grads + st.unsharded_grads + 2 * workspace,
            ))
        in_last, out = st.root_reduce_out
        if in_last and not w.optimizer_in_backward:  # its output allocated, the last root gradient still alive
            instants.append(Breakdown(
                weights=st.weights, optimizer=st.optimizer, gradients=_with_buckets(st, all_grads), activations=kept,
                # (the output is the gradient shard; a temporary where one exists already, or under CPU offload)
                temporaries=in_last + (0 if root_shard and not held else out) + 2 * workspace,
            ))
    if st.embed_grad_full:
        instants.append(Breakdown(  # the embedding's backward under TP × FSDP2 (every block resharded)
            weights=st.weights + st.gathered_end - st.gathered_block, optimizer=st.optimizer,
            gradients=_with_buckets(st, all_grads + st.unsharded_grads),
            activations=stage.held(a.layers, 1) + kept,
            temporaries=st.embed_grad_full + temps,
        ))
    if st.embed_grad_new and w.grad_accum > 1 and not w.optimizer_in_backward:
        instants.append(Breakdown(  # a later micro-batch's embedding backward under TP: its new whole table
            weights=w_live, optimizer=st.optimizer, gradients=_with_buckets(st, all_grads),
            activations=stage.held(a.layers, 1) + kept,
            # (a pipeline's other micro-batches in flight keep their saved 16-bit weight copies)
            temporaries=(stage.held(st.casts_all, 1, uniform=True) if w.parallel.pp > 1 else 0) + st.embed_grad_new + temps,
        ))
    if w.optimizer_in_backward:
        return _peak(Phase.FORWARD, forward), _peak(Phase.BACKWARD, *instants)
    optimizer = Breakdown(
        weights=st.weights, gradients=_with_buckets(st, st.gradients), optimizer=st.optimizer,
        temporaries=st.opt_temp + 2 * workspace,
    )
    return (
        _peak(Phase.FORWARD, forward),
        _peak(Phase.BACKWARD, *instants),
        _peak(Phase.OPTIMIZER, optimizer),
    )


def with_forward_start(st: States, workspace: int, phases: tuple[PhasePeak, ...]) -> tuple[PhasePeak, ...]:
    """``training``'s phases with FSDP2's first gathers of each step's forward (:attr:`States.gathered_root`):
    the first block's unshard, the root's all-gather output still alive — both units' parameters and
    all-gather outputs, no activation yet — where that is higher than the end of the forward. (Kept
    apart from ``training``: a preference step's reference forwards build on the end of the forward.)"""
    if not (st.gathered_root and st.forward_gather):
        return phases
    out = []
    for ph in phases:
        if ph.phase is Phase.FORWARD:
            start = Breakdown(weights=st.weights + st.gathered_root + st.forward_gather,
                              gradients=ph.breakdown.gradients, optimizer=st.optimizer,
                              temporaries=st.gathered_root + st.forward_gather + 2 * workspace)
            ph = _peak(Phase.FORWARD, ph.breakdown, start)
        out.append(ph)
    return tuple(out)


def _fsdp1_backward(st: States, f: Fsdp1, a: StageActs, lm: LossMemory, stage: Stage, acts: int, kept: int,
                    out: int, temps: int, held: int = 0) -> list[Breakdown]:
    """FSDP1's backward instants (:mod:`.fsdp1`): the loss's; each block's twice — at its start (its
    activations whole, with its backward's working set) and when its original-parameter gradients
    are concatenated into its flat gradient (its activations freed); the root's at the end (the
    embeddings' gradient completes its flat gradient) and its reduce-scatter. Blocks are taken
    alike (the largest), the ``i`` earlier ones keeping their saved activations. ``held``: every
    gradient shard, where a later micro-batch (or ``zero_grad(set_to_none=False)``) finds them: each
    unit's post-backward adds its new shard into the kept one (``_saved_grad_shard``, torch 2.13
    ``_runtime_utils.py`` L918-L926) and ``_root_pre_forward`` resets none (an original parameter's
    ``grad`` is set)."""
    w, o, n = st.weights, st.optimizer, stage.layers
    layer_grads = f.block_fresh + f.block_flat
    per_layer = a.layers // max(1, n)
    out_b = [Breakdown(  # the loss's backward: the root gathered (the last block prefetched under BACKWARD_PRE)
        weights=w + f.root + ((f.blocks if f.keep_all else f.loss_prefetched) if n else 0), optimizer=o,
        gradients=held, activations=acts + a.head + lm.backward_saved + kept + out,
        temporaries=lm.backward_transient + temps)]
    for i in range(n - 1, -1, -1):  # block i's backward (i earlier blocks)
        gathered = f.root + (f.blocks * (i + 1) // n if f.keep_all else f.block + (f.prefetched if i else 0))
        done = f.head_fresh + (held or (n - 1 - i) * f.block_grad_shard)
        before = per_layer * i + a.embed + kept + (out if i == n - 1 else 0)
        out_b.append(Breakdown(weights=w + gathered, optimizer=o, gradients=done,
                               activations=before + per_layer + a.recompute, temporaries=a.transient + temps))
        out_b.append(Breakdown(weights=w + gathered, optimizer=o, gradients=done + layer_grads,
                               activations=before, temporaries=temps))
    out_b += [
        Breakdown(  # a tied head: the embeddings' backward sums the two gradients of the shared weight
            weights=w + f.root, optimizer=o, gradients=(held or n * f.block_grad_shard) + f.tied_sum,
            activations=kept, temporaries=temps),
        Breakdown(  # the root's flat gradient, every block's shard made
            weights=w + f.root, optimizer=o, gradients=(held or n * f.block_grad_shard) + f.root_fresh + f.root_flat,
            activations=kept, temporaries=temps),
        Breakdown(  # its reduce-scatter (the root resharded): the output, then its cast
            weights=w, optimizer=o, gradients=(held or n * f.block_grad_shard) + f.root_reduce,
            activations=kept, temporaries=temps),
    ]
    return out_b


def inference(arch: Arch, st: States, stage: Stage, w: Workload, ctx: Ctx, workspace: int,
              tokens: int, seq: int, positions: int, *, mask: int = 0) -> tuple[PhasePeak, ...]:
    c, r, h, p = ctx.rg.compute, ctx.rg.stream, arch.hidden, w.parallel
    temps = st.casts_all + st.dequant + workspace
    classes = arch.head.classes // (p.tp if arch.head.kind != "cls" else 1)
    head_ws = tokens * h * r + (positions * classes * c if stage.head else 0)
    if w.task is Task.INFER:
        cache = kv.cache(stage, w, c, seq) if arch.family.value in ("dense", "moe", "mla") else 0
        held = 0
        if p.pp > 1:
            # torch's pipelining runs a stage's forward with transformers' `use_cache=False` (the trace's
            # stage module, trace/pipeline_parallel.py `_Stage`; torchtitan's models keep no cache): no
            # KV cache; a receiving stage holds the hidden states it got (the stage's receive buffer,
            # the TP-local sequence shard under SP) through its forward
            cache = 0
            held = 0 if stage.embed else tokens * h * r // (p.tp if p.sp else 1)
            if stage.head and p.tp > 1 and p.sp:  # the final norm's local output beside the head's gathered input
                head_ws += tokens * h * r // p.tp
        ws = infer_layer(stage, w, ctx, h, tokens, seq)
        return (_peak(Phase.FORWARD, Breakdown(
            weights=st.weights, kv_cache=cache, activations=max(ws, head_ws) + held + mask, temporaries=temps)),)
    total = seq + w.new_tokens
    last = w.batch * classes * (c + 4) if stage.head else 0  # last-position logits + fp32 copy
    prefill = Breakdown(
        weights=st.weights, kv_cache=kv.cache(stage, w, c, seq),
        activations=max(infer_layer(stage, w, ctx, h, tokens, seq), tokens * h * r + last) + mask,
        temporaries=temps,
    )
    decode = Breakdown(
        weights=st.weights, kv_cache=kv.cache(stage, w, c, total),
        activations=max(infer_layer(stage, w, ctx, h, w.batch, total), w.batch * h * r + last),
        temporaries=temps + kv.grow_transient(stage, w, c, total) + kv.mla_expansion(stage, w, c, total),
    )
    return _peak(Phase.PREFILL, prefill), _peak(Phase.DECODE, decode)
