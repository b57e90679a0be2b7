"""``estimate(spec, workload)``: the closed-form prediction of one rank's peak allocated memory."""

from __future__ import annotations

import dataclasses

from vramplan.errors import WorkloadError
from vramplan.models.shape import tokens as token_counts
from vramplan.models.spec import Family, ModelSpec
from vramplan.models.vlm import is_vlm
from vramplan.precision import fsdp_cpu_offload
from vramplan.quantformats import format_of
from vramplan.results import HOST_ACTIVATIONS, PhasePeak
from vramplan.workload import (
    Attention,
    Engine,
    Loss,
    Objective,
    Peft,
    Phase,
    Reference,
    Task,
    Workload,
)

from ..target import CUBLAS_WORKSPACE_PRE_HOPPER, RolloutEngine
from . import decoder, kv
from .activations import TokenShape, infer_layer, size, stage_acts
from .arch import Arch
from .blocks import Ctx, block_saved
from .flops import step_flops
from .host import fsdp_offload_parts
from .notes import notes
from .parallel import Stage, check_against_model, check_ring_kernel, stages, tokens_per_rank
from .phases import inference, training, with_forward_start
from .regime import regime, trainable
from .result import AnalyticEstimate, ModelStates
from .states import stage_states

CUBLAS_WORKSPACE = CUBLAS_WORKSPACE_PRE_HOPPER
"""cuBLAS workspace when no device is given (PyTorch's pre-Hopper default); the estimate core
passes its device profile's (32 MiB on sm90+) as ``workspace_bytes``."""


def build_arch(spec: ModelSpec) -> Arch:
    if spec.family in (Family.DENSE, Family.MOE, Family.MLA):
        return decoder.build(spec)
    if spec.family is Family.ENCODER:
        from . import encoder

        return encoder.build(spec)
    if spec.family is Family.VIT:
        from . import vit

        return vit.build(spec)
    raise WorkloadError(f"{spec.name} is not a transformer the analytic method knows", hint="use `method=trace`")


def estimate(spec: ModelSpec, w: Workload, *, workspace_bytes: int | None = None,
             rollout: RolloutEngine | None = None, value_head: bool = False,
             padded: bool = False) -> AnalyticEstimate:
    """Per-rank peak allocated bytes of ``w`` on ``spec``, by phase and category.

    ``workspace_bytes``: the cuBLAS workspace the caching allocator holds (one per thread
    that runs matmuls: the forward's and autograd's backward thread); default 8,519,680 B
    (before Hopper) — the estimate core passes ``DeviceProfile.cublas_workspace``.
    ``rollout``: GRPO's colocated rollout engine (``DeviceProfile.rollout``), for ``rollout=vllm``.
    ``value_head``: the decoder with a scalar value head in place of its LM head (PPO's critic,
    :func:`.decoder.value_head`); an SFT step of it, whose loss reads one value per token.
    ``padded``: the batch carries a padding attention mask (GRPO's training step, :mod:`.grpo`):
    under SDPA each layer saves k and v repeated to every head and the additive mask (``Ctx.padded``).
    """
    if is_vlm(spec):
        from .vlm import estimate_vlm

        return estimate_vlm(spec, w, workspace_bytes, estimate)
    check_against_model(spec, w)
    if format_of(w.quant) is not None:
        raise WorkloadError(
            f"`quant={w.quant}`: the analytic method has bitsandbytes and fp8 storage only; {w.quant}'s "
            "kernels allocate what a formula does not see (decompression, dequantised copies, scratch)",
            hint="use `method=trace` (auto traces catalog models), which runs the format's own layer", field="quant")
    if w.float8.value != "none":
        raise WorkloadError(
            f"`float8={w.float8}`: the analytic method does not model torchao's Float8Linear (its fp8 casts of "
            "inputs, weights and gradients, and what it saves for backward)",
            hint="use `method=trace` with torchao installed (auto traces catalog models)", field="float8")
    if w.parallel.engine.value == "fsdp1" and w.parallel.dp > 1:
        from .fsdp1 import unsupported

        if missing := unsupported(w):
            raise WorkloadError(
                f"`engine=fsdp1`: the analytic method's FSDP1 formulas (flat parameters per block and the root) do "
                f"not model {missing}", hint="use `method=trace` (auto traces catalog models), which runs "
                "FullyShardedDataParallel itself, or `engine=fsdp` for FSDP2's figure", field="engine")
    if w.rl:
        from .grpo import estimate_grpo

        return estimate_grpo(spec, w, workspace_bytes, estimate, rollout)
    if w.objective is not Objective.SFT:
        return _preference(spec, w, workspace_bytes)
    if w.training and w.loss is not Loss.FULL and not spec.is_decoder:
        raise WorkloadError(f"`loss={w.loss}` replaces a causal language model's loss; {spec.name} is not one",
                            hint="use `loss=full`", field="loss")
    arch = build_arch(spec)
    if value_head:
        arch = decoder.value_head(arch)
    rg, tr = regime(w), trainable(arch, w)
    check_ring_kernel(w, rg.compute, max(g.attn.head_dim for g in arch.groups))
    ctx = Ctx(rg, tr, w.attention, training=w.training, ring=w.parallel.cp > 1,
              padded=padded and w.attention is Attention.SDPA)
    workspace = CUBLAS_WORKSPACE if workspace_bytes is None else workspace_bytes
    if workspace < 0:
        raise WorkloadError(f"workspace bytes must be >= 0, got {workspace}")
    counts = token_counts(w, arch.shape.tokens_per_sample(w))
    seq = counts.per_sample
    tokens = counts.per_rank if spec.family is not Family.VIT else counts.micro_batch
    positions = w.batch if arch.head.kind == "cls" else tokens

    best: tuple[Stage, tuple[PhasePeak, ...], ModelStates, int, tuple[PhasePeak, ...]] | None = None
    host: dict[int, tuple[tuple[str, int], ...]] = {}
    for stage in stages(arch, w):
        st = stage_states(arch, stage, w, rg, tr)
        host[stage.index] = fsdp_offload_parts(arch, stage, w, rg, tr, st) if fsdp_cpu_offload(w) else ()
        if w.training:
            acts = stage_acts(arch, stage, w, ctx, tokens, seq, positions)
            if acts.host:
                host[stage.index] += ((HOST_ACTIVATIONS, stage.held(acts.host)),)
            cache = kv.training_cache(stage, w, ctx, tokens) if spec.is_decoder else 0
            receive = tokens * arch.hidden * rg.stream // (w.parallel.tp if w.parallel.sp else 1)
            # (FSDP1: the last block's forward, gathered, under full checkpointing: a no-grad layer's working set)
            layer_ws = infer_layer(stage, w, ctx, arch.hidden, tokens, seq) if st.fsdp1 is not None else 0
            phases = training(st, acts, stage, w, ctx, workspace, cache, receive, layer_ws)
            ends = phases
            phases = with_forward_start(st, workspace, phases)
        else:
            gen_tokens = tokens if w.task is Task.INFER else counts.per_rank
            phases = ends = inference(arch, st, stage, w, ctx, workspace, gen_tokens, seq, positions,
                                      mask=_infer_mask(arch, w, seq))
        peak = max(p.allocated for p in phases)
        if best is None or peak > best[3]:
            best = (stage, phases, ModelStates(st.weights, 0 if w.optimizer_in_backward else st.gradients, st.optimizer), peak,
                    ends)
    assert best is not None  # stages() always yields one
    stage, phases, states, _, ends = best
    total_params = (spec.params if not value_head else 0) or arch.params
    trainable_params = total_params if tr.full else sum(
        tr.adapter_params(lin) * g.count for g in arch.groups for lin in g.linears)
    if w.task is not Task.TRAIN:
        trainable_params = 0
    shape = TokenShape(tokens, seq, w.parallel.tp, w.parallel.sp)
    per_layer = max(size(block_saved(g, ctx, arch.hidden), shape) for g in arch.groups) if w.training else 0
    cache = 0
    if spec.is_decoder and not w.training:
        cache = kv.cache(stage, w, rg.compute, seq + (w.new_tokens if w.task is Task.GENERATE else 0))
    return AnalyticEstimate(
        phases=phases, peak=max(phases, key=lambda p: p.allocated), params=total_params,
        trainable_params=trainable_params, flops_per_step=step_flops(arch, w, tr, seq),
        notes=notes(arch, w, rg, tr, stage.index, workspace) + _deepspeed_notes(arch, w, total_params),
        states=states,
        activations_per_layer=per_layer, kv_cache=cache, stage=stage.index,
        host_memory=sum(n for _, n in host.get(stage.index, ())), host_parts=host.get(stage.index, ()),
        forward_end=next((p for p in ends if p.phase is Phase.FORWARD), None) if ends != phases else None,
    )


def _preference(spec: ModelSpec, w: Workload, workspace_bytes: int | None) -> AnalyticEstimate:
    """DPO and KTO (:mod:`vramplan.trace.preference`): the policy's step is the next-token step of
    its sequences (DPO: ``2 × batch``; KTO: ``batch``) through TRL's fused head; the reference's
    forwards (and KTO's KL batch) run under no_grad, each holding one layer's temporaries and its
    own head's, no more than the policy's head held at the end of its forward;
    ``reference=model`` adds a frozen copy of the weights."""
    if not spec.is_decoder:
        raise WorkloadError(f"`objective={w.objective}` trains a causal language model; {spec.name} is not one",
                            hint="drop `objective`", field="objective")
    w.check_reference_model()
    model_ref = w.reference_source is Reference.MODEL
    sft = w.replace(objective=Objective.SFT, reference=Reference.AUTO, batch=w.sequences, loss=Loss.TRL)
    base = estimate(spec, sft, workspace_bytes=workspace_bytes)
    ref_est = estimate(spec, sft.replace(peft=Peft.NONE), workspace_bytes=workspace_bytes) if model_ref else None
    ref = ref_est.states.weights if ref_est is not None else 0  # (its shard, under ZeRO-3)
    kept = reference_gathered_bytes(ref_est, w)
    ws = CUBLAS_WORKSPACE if workspace_bytes is None else workspace_bytes

    def more(ph: PhasePeak) -> PhasePeak:
        b = dataclasses.replace(ph.breakdown, weights=ph.breakdown.weights + ref + kept)
        return PhasePeak(ph.phase, ph.allocated + ref + kept, b)

    phases = tuple(more(ph) for ph in base.phases)
    # (the reference's forwards follow the policy's: they build on the end of its forward, not on FSDP2's
    # first gathers at its start, which base's forward phase may be: AnalyticEstimate.forward_end)
    end = base.forward_end or next(ph for ph in base.phases if ph.phase is Phase.FORWARD)
    sharded = ref_est is not None and w.parallel.dp > 1 and w.parallel.zero == 3
    if ref_est is not None and sharded:
        gather = _sharded_reference_forward(more(end), base, ref, ref_est.params, regime(w).compute, ws)
        phases = tuple(gather if ph.phase is Phase.FORWARD and gather.allocated > ph.allocated else ph
                       for ph in phases)
    if kept:
        first = _first_gather(end, ref, kept, ws)
        phases = tuple(first if ph.phase is Phase.FORWARD and first.allocated > ph.allocated else ph
                       for ph in phases)
    source = {Reference.MODEL: "a frozen copy of the model", Reference.ADAPTERS: "the policy with adapters disabled",
              Reference.PRECOMPUTED: "log-probabilities from the dataset"}[w.reference_source]
    what = ("DPO (TRL 1.16 DPOTrainer): the step of {n} sequences (chosen and rejected)" if w.objective is Objective.DPO
            else "KTO (TRL 1.16 KTOTrainer): the step of {n} sequences (and a KL batch as large, under no_grad)")
    note = (what.format(n=w.sequences) + f" through TRL's fused head; reference: {source}, its forwards under no_grad "
            "bounded by the policy's head instant")
    if kept:
        note += ("; the reference sharded by FSDP2 as one unit with reshard_after_forward=False (ZeRO-2; TRL 1.16 "
                 "prepare_fsdp passes accelerate's setting): its first forward gathers all of it and, with no backward "
                 "to reshard it, it stays gathered for the run: its shard and its whole weights in the gathered dtype "
                 "in every phase (the first forward's all-gather output too, before the optimizer's states exist)")
    if sharded:
        note += ("; the reference sharded by FSDP2 as one unit (TRL 1.16 prepare_fsdp: fully_shard on its root), so its "
                 "forward, after the policy's, gathers all of it at once: the all-gather output and the copy out of "
                 "it into the parameters, 2 x its parameters in the gathered dtype, on top of the policy's saved "
                 "activations")
    return dataclasses.replace(
        base, phases=phases, peak=max(phases, key=lambda ph: ph.allocated), notes=(*base.notes, note),
        states=dataclasses.replace(base.states, weights=base.states.weights + ref))


def reference_kept_gathered(w: Workload) -> bool:
    """A reference model that FSDP2 shards with ``reshard_after_forward=False`` (``zero=2``, engine
    ``fsdp``): TRL 1.16 ``prepare_fsdp`` calls ``fully_shard(ref, reshard_after_forward=
    plugin.reshard_after_forward)`` (trl/models/utils.py:326-339), accelerate's bool. Its post-forward
    then keeps the unsharded parameters (torch 2.13 ``_fsdp_param_group.py`` ``reshard``, L499-L502),
    which only a post-backward would reshard (``post_backward``; its hook is not registered under
    no_grad, ``_fsdp_state.py`` ``_register_pre_backward_hook``/``_register_post_backward_hook``), and
    a later forward's ``unshard`` is a no-op (L375-L376): from its first forward on the reference
    holds its whole weights in the gathered dtype beside its shard (docs/research/trl-reference-fsdp.md)."""
    return w.reference_source is Reference.MODEL and w.objective is not Objective.SFT and fsdp2_reshard_off(w)


def fsdp2_reshard_off(w: Workload) -> bool:
    """FSDP2 sharding with ``reshard_after_forward=False`` (``zero=2``, engine ``fsdp``, ``dp > 1``)."""
    p = w.parallel
    return p.dp > 1 and p.zero == 2 and p.framework is Engine.FSDP


def reference_gathered_bytes(ref_est: AnalyticEstimate | None, w: Workload) -> int:
    """The reference's whole weights in the gathered dtype where it stays gathered
    (:func:`reference_kept_gathered`), else 0."""
    return ref_est.params * regime(w).compute if ref_est is not None and reference_kept_gathered(w) else 0


def _first_gather(ph: PhasePeak, ref_shard: int, gathered: int, workspace: int) -> PhasePeak:
    """The preference step's first reference forward under FSDP2 ZeRO-2 (:func:`reference_kept_gathered`):
    after the policy's forward (whose units ZeRO-2 keeps gathered, with its saved activations), the
    reference's flat all-gather output (torch 2.13 ``_fsdp_collectives.py`` ``foreach_all_gather``, L351)
    and the parameters copied out of it (L431-L490), alive together; the optimizer's states do not exist
    yet (AdamW creates them at its first step). ``ph``: the policy's forward phase."""
    b = ph.breakdown
    out = dataclasses.replace(b, weights=b.weights + ref_shard + gathered, optimizer=0,
                              temporaries=gathered + 2 * workspace)
    return PhasePeak(ph.phase, out.total, out)


def _sharded_reference_forward(ph: PhasePeak, base: AnalyticEstimate, ref_shard: int, ref_params: int,
                               gathered_b: int, workspace: int = 0) -> PhasePeak:
    """The forward phase of a preference step whose reference FSDP2 shards as one unit: the
    larger of the policy's own forward peak and the reference's gather. TRL runs the reference
    after the policy's forward (``_compute_loss``, as :mod:`vramplan.trace.preference` does), so
    the policy's saved activations are held; FSDP2 all-gathers the whole reference into one flat
    buffer (torch 2.13 ``_fsdp_collectives.py`` ``foreach_all_gather``, L351) and copies it out into
    each parameter's unsharded storage (``foreach_all_gather_copy_out``, L431-L490) while the flat
    buffer is still alive: two copies of the reference in the gathered (compute) dtype. The policy's
    own parameters are resharded by then (accelerate's ``reshard_after_forward=True``)."""
    b = ph.breakdown
    gathered = ref_params * gathered_b
    policy = base.states.weights  # (the policy's shard: its gathered weights are freed)
    # (and the cuBLAS workspaces of the main and the autograd threads, cached from the policy's forward and
    # the previous step's backward, as the policy's forward instant counts them)
    at_gather = dataclasses.replace(b, weights=policy + ref_shard + gathered, temporaries=gathered + 2 * workspace)
    total = at_gather.total
    return PhasePeak(ph.phase, total, at_gather) if total > ph.allocated else ph


def _deepspeed_notes(arch: Arch, w: Workload, total_params: int) -> tuple[str, ...]:
    p = w.parallel
    if p.engine is not Engine.DEEPSPEED or not w.training or not p.zero:
        return ()
    from vramplan.units import GiB

    from . import deepspeed as ds

    largest = max([arch.embed_params, *(lin.params for g in arch.groups for lin in g.linears)])
    host = ds.host_ram(w, total_params, largest)
    s = ds.DEFAULTS
    two = s.overlap(p.zero) and p.zero < 3
    buckets = (f"{'two reduce buckets (overlap_comm)' if two else 'one reduce bucket'} of "
               f"reduce_bucket_size {s.reduce_bucket_size:.0e} elements in the model dtype")
    extra = (f"; ZeRO-3 gathers per submodule plus stage3_prefetch_bucket_size {s.prefetch_bucket_size:.0e} "
             f"elements, parameters of <= {s.param_persistence_threshold:.0e} elements stay whole, the step's fp32 "
             f"gradient is at most sub_group_size {s.sub_group_size:.0e}") if p.zero == 3 else ""
    return (f"DeepSpeed ZeRO-{p.zero} (deepspeed 0.19.8 defaults): {buckets}{extra}.",
            f"Host RAM per node by DeepSpeed's estimate_zero{3 if p.zero == 3 else 2}_model_states_mem_needs: "
            f"{host / GiB:.1f} GiB (with its 1.5 buffer factor).")


def _infer_mask(arch: Arch, w: Workload, seq: int) -> int:
    """HF builds a 4-D additive float mask for eager attention (b × 1 × s × s)."""
    if w.attention is not Attention.EAGER or arch.head.kind != "lm":
        return 0
    return tokens_per_rank(w, seq) * seq * regime(w).stream

