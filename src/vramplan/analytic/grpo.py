"""GRPO (:mod:`vramplan.trace.grpo`): a generation window, then training micro-steps.

The training micro-steps are the next-token step of ``batch`` sequences of ``seq`` tokens
through TRL's fused head, scoring the ``seq - prompt`` completion tokens (the estimate of
``objective=sft, loss=trl`` with the same prompt). The generation window is ``generate`` of
``batch x grad_accum`` completions after ``prompt``-token prompts, in the compute dtype, on the
training model as it stands between steps: its weights and optimizer states (gradients freed by
``zero_grad``, unless ``keep_grads``), autocast's 16-bit weight copies under mixed precision, and
the sampling's fp32 probabilities and ``multinomial``'s temporary of the same size, and the
backward thread's cuBLAS workspace (cached since the first backward). A frozen
reference (``reference=model``) adds its weights to every phase; its no-grad scoring forwards are
bounded by the policy's training forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vramplan.errors import WorkloadError
from vramplan.models.spec import ModelSpec
from vramplan.precision import precision_model
from vramplan.results import Breakdown, PhasePeak
from vramplan.workload import (
    Checkpointing,
    Loss,
    Objective,
    Peft,
    Phase,
    Precision,
    Reference,
    Rollout,
    Task,
    Workload,
)

from ..target import CUBLAS_WORKSPACE_PRE_HOPPER as CUBLAS_WORKSPACE
from ..target import RolloutEngine, rollout_unsized
from .result import AnalyticEstimate

_COMPUTE = {Precision.BF16_MIXED: Precision.BF16, Precision.FP16_MIXED: Precision.FP16}


def estimate_grpo(spec: ModelSpec, w: Workload, workspace_bytes: int | None,
                  estimate: Callable[..., AnalyticEstimate], engine: RolloutEngine | None = None) -> AnalyticEstimate:
    if not spec.is_decoder:
        raise WorkloadError(f"`objective={w.objective}` trains a causal language model; {spec.name} is not one",
                            hint="drop `objective`", field="objective")
    if w.objective is Objective.PPO or w.reward_model:
        return _with_value_models(spec, w, workspace_bytes, estimate, engine)
    return _grpo(spec, w, workspace_bytes, estimate, engine)


def _with_value_models(spec: ModelSpec, w: Workload, workspace_bytes: int | None,
                       estimate: Callable[..., AnalyticEstimate], engine: RolloutEngine | None) -> AnalyticEstimate:
    """GRPO's phases with the value models of :mod:`vramplan.trace.ppo` beside them: the reward model's
    weights (frozen, the backbone and a scalar head, 16-bit) resident; PPO's critic (the same shape, trained in
    full) resident with its weights and optimizer states, its gradients during its own update, which
    runs before the policy's with the policy's gradients freed: the training step of the backbone with a
    scalar value head (:func:`.decoder.value_head`, ``estimate(..., value_head=True)``), beside the policy's
    weights and optimizer states.

    The critic is its own model, not the LM step less its head: under FSDP2 its root unit (the embeddings,
    the final norm, the ``[1, hidden]`` score) has no LM head, whose gradient the LM step's root
    reduce-scatter counts (torch 2.13 ``fsdp/_fully_shard/_fsdp_param_group.py`` ``post_backward``,
    ``_fsdp_collectives.py`` ``foreach_reduce``: the unit's unsharded gradients beside the reduce-scatter
    input), and its loss reads one value per token, not the vocabulary's logits."""
    base = _grpo(spec, w.replace(reward_model=False), workspace_bytes, estimate, engine)
    # the critic's own step (verl's ``compute_value_loss`` on the values: the loss of one output per token)
    crit_w = w.replace(objective=Objective.SFT, reference=Reference.AUTO, loss=Loss.FULL, generations=8,
                       peft=Peft.NONE, reward_model=False)
    # (its update reads the window's padded prompts too: trace.ppo's critic passes their mask)
    full = estimate(spec, crit_w, workspace_bytes=workspace_bytes, value_head=True, padded=True)
    fs = full.states
    # the reward model in 16 bits (trace.ppo.reward_dtype: verl and OpenRLHF load it in bf16), the critic's
    # shape, sharded as the critic's weights are
    rm = int(fs.weights * 2 / precision_model(crit_w).weight) if w.reward_model else 0
    critic = Breakdown(weights=fs.weights, optimizer=fs.optimizer) if w.objective is Objective.PPO else Breakdown()
    held = Breakdown(weights=rm) + critic

    def more(ph: PhasePeak) -> PhasePeak:
        return PhasePeak(ph.phase, ph.allocated + held.total, ph.breakdown + held)

    phases = [more(ph) for ph in base.phases]
    parts = {"generation": max((p.allocated for p in phases if p.phase in (Phase.PREFILL, Phase.DECODE)), default=0),
             "actor": max((p.allocated for p in phases if p.phase not in (Phase.PREFILL, Phase.DECODE)), default=0)}
    if w.objective is Objective.PPO:
        s = base.states
        engine_keep = engine.resident if engine is not None else 0
        # the critic's update: its own full step beside the policy's weights and
        # optimizer states (gradients freed by the last step's zero_grad), the reference's and reward model's
        # weights, the engine's blocks, and the window's per-token tensors (values, returns, advantages, fp32)
        beside = Breakdown(weights=s.weights + rm, optimizer=s.optimizer,
                           temporaries=engine_keep + w.batch * w.grad_accum * w.completion * 4 * 3)
        crit = []
        for ph in full.phases:
            out = ph.breakdown + beside
            crit.append(PhasePeak(ph.phase, out.total, out))
        parts = {"generation": parts["generation"], "critic": max(p.allocated for p in crit), "actor": parts["actor"]}
        merged: dict[Phase, PhasePeak] = {p.phase: p for p in phases}
        for p in crit:
            if p.phase not in merged or p.allocated > merged[p.phase].allocated:
                merged[p.phase] = p
        phases = list(merged.values())
    names = {"generation": "generation (and scoring)", "critic": "critic training", "actor": "actor training"}
    top = max(parts, key=lambda k: parts[k])
    limit = (f"{str(w.objective).upper()} peaks: " + "; ".join(f"{names[k]} {v / 2**30:,.2f} GiB" for k, v in parts.items())
             + f" allocated: the step's peak is {names[top]}'s")
    what = []
    if w.objective is Objective.PPO:
        what.append(f"a critic (the backbone and a scalar head, {critic.weights / 2**30:,.2f} GiB of weights, "
                    f"{critic.optimizer / 2**30:,.2f} GiB of optimizer states, trained in full before the policy)")
    if w.reward_model:
        what.append(f"a frozen reward model ({rm / 2**30:,.2f} GiB)")
    note = f"{str(w.objective).upper()}: the GRPO window and policy step above, with " + " and ".join(what)
    states = dataclasses.replace(base.states, weights=base.states.weights + held.weights)
    tup = tuple(phases)
    return dataclasses.replace(base, phases=tup, peak=max(tup, key=lambda ph: ph.allocated),
                               notes=(*base.notes, note, limit), states=states, step_parts=tuple(parts.items()))


def _grpo(spec: ModelSpec, w: Workload, workspace_bytes: int | None,
          estimate: Callable[..., AnalyticEstimate], engine: RolloutEngine | None = None) -> AnalyticEstimate:
    w.check_reference_model()
    sft = w.replace(objective=Objective.SFT, reference=Reference.AUTO, loss=Loss.TRL, generations=8, reward_model=False)
    # TRL pads prompts of different lengths, so the training forwards pass a 4-D mask (Ctx.padded)
    train = estimate(spec, sft, workspace_bytes=workspace_bytes, padded=True)
    ref_est = estimate(spec, sft.replace(peft=Peft.NONE), workspace_bytes=workspace_bytes) \
        if w.reference_source is Reference.MODEL else None
    ref = ref_est.states.weights if ref_est is not None else 0  # (its shard, under ZeRO-3)
    from .estimate import fsdp2_reshard_off, reference_gathered_bytes
    from .regime import regime

    kept = reference_gathered_bytes(ref_est, w)  # (FSDP2 ZeRO-2: gathered from its first scoring forward on)
    if fsdp2_reshard_off(w) and train.forward_end is not None:
        # FSDP2 ZeRO-2: the rollout's no-grad forwards leave the policy's units gathered (below), so the
        # training forward's unshards are no-ops (torch 2.13 _fsdp_param_group.py L375-L376): no first gathers
        end = train.forward_end
        train = dataclasses.replace(train, phases=tuple(end if ph.phase is Phase.FORWARD else ph for ph in train.phases),
                                    forward_end=None)
    window = w.batch * w.grad_accum
    if w.rollout is Rollout.VLLM:
        if engine is None:
            raise rollout_unsized()
        return _with_engine(train, w, engine, ref + kept, workspace_bytes, window)  # (ZeRO-2: kept gathered)
    gen_w = Workload(task=Task.GENERATE, batch=window, seq=w.prompt, new_tokens=w.completion,
                     precision=_COMPUTE.get(w.precision, w.precision), attention=w.attention, kv_dtype=w.kv_dtype,
                     quant=w.quant, checkpointing=Checkpointing.NONE)
    gen = estimate(spec, gen_w, workspace_bytes=workspace_bytes)
    casts = _casts(spec, sft) if w.mixed else 0
    sampling = window * spec.vocab * 8  # fp32 probabilities and multinomial's exponential draws
    # the backward thread's cuBLAS workspace, cached since the first step's backward
    backward_ws = CUBLAS_WORKSPACE if workspace_bytes is None else workspace_bytes
    s = train.states
    # FSDP2 ZeRO-2 (reshard_after_forward=False): the generation's no-grad forwards leave each of the
    # policy's units gathered (torch 2.13 _fsdp_param_group.py reshard, L499-L502) until the training
    # backward's post-backward reshards them
    policy_kept = train.params * regime(sft).compute if fsdp2_reshard_off(w) and w.parallel.pp == 1 else 0
    resident = Breakdown(weights=s.weights + policy_kept, gradients=s.gradients if w.keep_grads else 0,
                         optimizer=s.optimizer)

    def rollout(ph: PhasePeak) -> PhasePeak:
        b = ph.breakdown
        out = resident + Breakdown(activations=b.activations, kv_cache=b.kv_cache,
                                   temporaries=b.temporaries + casts + sampling + backward_ws)
        return PhasePeak(ph.phase, out.total, out)

    def more(ph: PhasePeak) -> PhasePeak:
        b = dataclasses.replace(ph.breakdown, weights=ph.breakdown.weights + ref + kept)
        return PhasePeak(ph.phase, ph.allocated + ref + kept, b)

    phases = tuple(more(ph) for ph in (*(rollout(ph) for ph in gen.phases), *train.phases))
    note = (f"GRPO (TRL 1.16 GRPOTrainer, use_vllm=False): generation of {window:,} completions of {w.completion:,} "
            f"tokens after {w.prompt:,}-token prompts on the training model (its weights and optimizer states, "
            f"{'autocast weight copies, ' if casts else ''}fp32 sampling), then {w.grad_accum} micro-step(s) of "
            f"{w.batch:,} sequences through TRL's fused head scoring the completion tokens; reference: "
            f"{_SOURCE[w.reference_source]}")
    if ref_est is not None and w.parallel.dp > 1 and w.parallel.zero == 3:
        scoring = _sharded_reference_scoring(spec, w, resident, ref, ref_est.params, backward_ws)
        phases = tuple(scoring if ph.phase is Phase.FORWARD and scoring.allocated > ph.allocated else ph
                       for ph in phases)
        note += ("; the reference sharded by FSDP2 as one unit (TRL 1.16 prepare_fsdp: fully_shard on its root), so "
                 f"each of its scoring forwards (chunks of {w.batch:,} completions, in the rollout) gathers all of it: "
                 "the all-gather output, held through the forward, and the parameters copied out of it, 2 x its "
                 "parameters in the gathered dtype, beside the policy's shards and optimizer states")
    if kept:
        # the first step's scoring forward: the flat all-gather output beside the copied-out parameters,
        # before AdamW's first step has created the optimizer's states
        first = _sharded_reference_scoring(spec, w, dataclasses.replace(resident, optimizer=0), ref, ref_est.params
                                           if ref_est is not None else 0, backward_ws)
        phases = tuple(first if ph.phase is Phase.FORWARD and first.allocated > ph.allocated else ph for ph in phases)
        note += ("; the reference sharded by FSDP2 as one unit with reshard_after_forward=False (ZeRO-2; TRL 1.16 "
                 "prepare_fsdp passes accelerate's setting): its first scoring forward gathers all of it and, with no "
                 "backward to reshard it, it stays gathered for the run (its shard and its whole weights in the "
                 "gathered dtype in every phase)")
    return dataclasses.replace(_finish(train, phases, note, s.weights + ref + kept), kv_cache=gen.kv_cache)


def _sharded_reference_scoring(spec: ModelSpec, w: Workload, resident: Breakdown, ref_shard: int, ref_params: int,
                               workspace: int) -> PhasePeak:
    """The rollout's reference forward when FSDP2 shards the reference as one unit (TRL 1.16
    ``prepare_fsdp``, docs/research/trl-reference-fsdp.md): it scores the window in chunks of
    ``batch`` completions under no_grad (grpo_trainer.py:2710-2721) after the generation, the
    policy's gradients freed. Each chunk's forward all-gathers the whole reference into one flat
    buffer (torch 2.13 ``_fsdp_collectives.py`` ``foreach_all_gather``, L351) and copies it out into
    each parameter's storage (``foreach_all_gather_copy_out``, L431-L490); in forward the flat
    buffer is kept in the all-gather state for the next unit's copy-out (``_fsdp_param_group.py``
    L477-L486) and freed at the root's post-forward (``_fsdp_state.py`` L333-L342), so with one
    unit it lives through the whole forward:
    two copies of the reference in the compute dtype, with the largest no-grad layer working set of
    one chunk (``batch x seq`` tokens) on top, and the cuBLAS workspaces of the main and the
    autograd threads (cached since the first step)."""
    from .activations import infer_layer
    from .blocks import Ctx
    from .estimate import build_arch
    from .parallel import stages
    from .regime import regime, trainable

    arch: Any = build_arch(spec)
    rg = regime(w)
    ctx = Ctx(rg, trainable(arch, w), w.attention, training=False)
    stage = stages(arch, w)[0]
    layer = infer_layer(stage, w, ctx, arch.hidden, w.batch * w.seq, w.seq)
    gathered = ref_params * rg.compute
    out = resident + Breakdown(weights=ref_shard + gathered, temporaries=gathered + layer + 2 * workspace)
    return PhasePeak(Phase.FORWARD, out.total, out)


def _with_engine(train: AnalyticEstimate, w: Workload, e: RolloutEngine, ref: int, workspace_bytes: int | None,
                 window: int) -> AnalyticEstimate:
    """GRPO with a colocated vLLM engine: its generation on the trainer's resident states (its
    weights and KV cache awake, its CUDA graphs' pool, its forward's activations), then the
    scoring and training micro-steps beside what the engine keeps (all but its activations;
    its graphs' pool alone in sleep mode) and the window's old and sampling log-probabilities."""
    s = train.states
    backward_ws = CUBLAS_WORKSPACE if workspace_bytes is None else workspace_bytes
    gen = Breakdown(weights=s.weights + ref + e.weights, gradients=s.gradients if w.keep_grads else 0,
                    optimizer=s.optimizer, activations=e.activations, kv_cache=e.kv_pool,
                    temporaries=e.graphs + backward_ws)
    held = window * w.completion * 4 * 2  # old_per_token_logps and sampling_per_token_logps, fp32
    keep = Breakdown(weights=ref + (0 if e.sleep else e.weights), kv_cache=0 if e.sleep else e.kv_pool,
                     temporaries=e.graphs + held)

    def more(ph: PhasePeak) -> PhasePeak:
        return PhasePeak(ph.phase, ph.allocated + keep.total, ph.breakdown + keep)

    phases = (PhasePeak(Phase.DECODE, gen.total, gen), *(more(ph) for ph in train.phases))
    note = (f"GRPO (TRL 1.16 GRPOTrainer, use_vllm=True, vllm_mode=colocate): {e.engine} generates {window:,} "
            f"completions of {w.completion:,} tokens after {w.prompt:,}-token prompts beside the training model's "
            f"states, then the policy's old log-probabilities (no_grad) and {w.grad_accum} micro-step(s) of "
            f"{w.batch:,} sequences through TRL's fused head; reference: {_SOURCE[w.reference_source]}")
    return _finish(train, phases, note, s.weights + ref + (0 if e.sleep else e.weights))


_SOURCE = {Reference.MODEL: "a frozen copy of the model", Reference.ADAPTERS: "the policy with adapters disabled",
           Reference.NONE: "none (beta=0)"}


def _finish(train: AnalyticEstimate, phases: tuple[PhasePeak, ...], note: str, weights: int) -> AnalyticEstimate:
    """The SFT step's estimate with GRPO's phases, its note, and the weights resident through it."""
    return dataclasses.replace(
        train, phases=phases, peak=max(phases, key=lambda ph: ph.allocated), notes=(*train.notes, note),
        states=dataclasses.replace(train.states, weights=weights))


def _casts(spec: ModelSpec, w: Workload) -> int:
    """Autocast's 16-bit copies of the weights one forward uses (cached for the call)."""
    from .estimate import build_arch
    from .parallel import stages
    from .regime import regime, trainable
    from .states import stage_states

    arch: Any = build_arch(spec)
    rg, tr = regime(w), trainable(arch, w)
    return max(stage_states(arch, st, w, rg, tr).casts_all for st in stages(arch, w))
