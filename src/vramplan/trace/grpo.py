"""GRPO as TRL 1.16's ``GRPOTrainer`` runs it with its own rollout (``use_vllm=False``:
``model.generate``), trl/trainer/grpo_trainer.py.

One optimizer step is one *generation window* (TRL's defaults: ``steps_per_generation =
gradient_accumulation_steps``, ``num_iterations = 1``):

1. **Rollout** (phases prefill and decode, gradients already freed by the previous step's
   ``zero_grad``): ``_generate_single_turn`` left-pads the window's ``batch x grad_accum`` prompts
   (``prompt`` tokens; prompts of different lengths, so there is padding and transformers builds
   a 4-D attention mask) and calls ``generate`` under ``no_grad``: a ``DynamicCache``, the prefill
   with ``logits_to_keep=1``, then per token transformers' ``_sample``: the last logits copied to
   fp32, softmax, ``multinomial``, the ids and the attention mask grown by one column. Every
   completion runs to ``seq - prompt`` tokens (the longest completion sets the padded width: an
   upper bound). Then ``_generate_and_score_completions``: prompt and completion ids and masks on
   the device, the reference's per-token log-probabilities under ``no_grad`` in chunks of
   ``batch`` (``reference=model``: the frozen copy's head; ``adapters``: the policy with its
   adapters disabled; ``none``, TRL's ``beta=0.0``: no reference forward), rewards and
   advantages, shuffled (an index copy) and split into ``grad_accum`` micro-batches (views).
2. **Training**: ``grad_accum`` micro-steps of ``batch`` completions: ``_compute_loss``: prompt
   and completion concatenated, the policy through TRL's fused LM head (log-probabilities and
   entropy of the completion tokens, :func:`.loss.trl_log_probs`), the ``dapo`` loss (TRL's
   default ``loss_type``) with the clipped ratio against the detached log-probabilities (TRL
   skips ``old_per_token_logps`` when steps and generation are aligned) and, with a reference,
   the KL term; the logged metrics' masked means; backward; after the last, the optimizer.

With ``rollout=vllm`` (``use_vllm=True``, ``vllm_mode="colocate"``) a vLLM engine in the same
process generates instead (:func:`engine_rollout`): its blocks (weights, KV cache pool, CUDA graph
pool, the activations of its forwards; sized by :mod:`vramplan.engine.rollout` by vLLM's own
start-up rules) sit in the trainer's allocator, released between generations in sleep mode; the
policy then scores the completions under ``no_grad`` (``old_per_token_logps``) for TRL's
importance-sampling correction, and the loss multiplies by its ratio.

A reward model (``reward_model``) and PPO's critic score the window too (:mod:`.ppo`).

Not modelled: ``num_iterations > 1`` / misaligned windows without vLLM (the ``old_per_token_logps``
forward), the weight push into vLLM (a LoRA merge's per-layer delta: one weight-sized
temporary), tool calls, the entropy bonus and top-entropy mask (off by default). Completions that stop early at EOS make every tensor of the window narrower: the
figure is for completions of the full length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..events import Action, Category
from ..workload import Phase, Reference, Rollout, Workload
from .kvcache import make_cache
from .loss import causal_lm_parts, fsdp1_root, through_root, trl_log_probs

POLICY_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy")
"""``add_fused_lm_head(model, outputs=("log_probs", "entropy"))`` (grpo_trainer.py L1068-L1073)."""
REF_OUTPUTS: tuple[str, ...] = ("log_probs",)
"""``add_fused_lm_head(self.ref_model, ...)``: the default field."""
EPSILON = 0.2
"""GRPOConfig ``epsilon`` (``epsilon_high`` defaults to it); values do not change memory."""
IS_CLIP_MAX = 3.0
"""GRPOConfig ``vllm_importance_sampling_clip_max`` (``clip_min`` None: no lower bound)."""
BETA = 0.04
"""The KL coefficient used when a reference is asked for (TRL's default ``beta`` is 0.0: none)."""

Region = Callable[[], contextlib.AbstractContextManager[Any]]


def inputs(kwargs: dict[str, Any], w: Workload) -> dict[str, Any]:
    """GRPO's dataloader yields prompts as text: nothing is on the device before the rollout."""
    del kwargs, w
    return {}


def step_note(w: Workload) -> str:
    ref = {Reference.NONE: "none (beta=0.0, TRL's default: no reference forward)",
           Reference.MODEL: "a frozen copy of the model, its log-probabilities under no_grad after the rollout",
           Reference.ADAPTERS: "the policy with its adapters disabled, under no_grad after the rollout"}[
        w.reference_source]
    window = w.batch * w.grad_accum
    if w.rollout is Rollout.VLLM:
        how = ("by the colocated vLLM engine (use_vllm=True, vllm_mode=colocate; its blocks in the trainer's "
               "allocator), the policy's old log-probabilities under no_grad for the importance-sampling correction")
    else:
        how = "through `generate` (use_vllm=False: DynamicCache, fp32 sampling)"
    return (f"GRPO step as TRL 1.16 GRPOTrainer runs it: a rollout of {window:,} completions "
            f"({window // w.generations:,} prompts x {w.generations} generations) of {w.completion:,} tokens after "
            f"{w.prompt:,}-token prompts {how}, then {w.grad_accum} "
            f"micro-step(s) of {w.batch:,} completions through TRL's fused LM head (log-probs, entropy) with the "
            f"dapo loss; reference: {ref}. Every completion runs to full length (an upper bound)")


def _hf(model: nn.Module) -> nn.Module:
    hf, _backbone, _head = causal_lm_parts(model)
    return hf


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise TraceError("objective=grpo needs a model with parameters")


@contextlib.contextmanager
def _no_checkpointing(hf: nn.Module) -> Any:
    """``gradient_checkpointing_disable()`` for the rollout, restored after (transformers turns
    ``use_cache`` off in checkpointed layers)."""
    flagged = [m for m in hf.modules() if getattr(m, "gradient_checkpointing", None) is True]
    for m in flagged:
        setattr(m, "gradient_checkpointing", False)  # noqa: B010 (a module attribute, not a submodule)
    try:
        yield
    finally:
        for m in flagged:
            setattr(m, "gradient_checkpointing", True)  # noqa: B010


def generate(sess: Any, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
             region: Region, cache_kind: str, kv_dtype: Any, compute: torch.dtype, notes: list[str],
             eos: bool = True) -> torch.Tensor:
    """``model.generate(input_ids, attention_mask, max_new_tokens=new_tokens, do_sample=True)``
    as transformers 5.24's ``_sample`` runs it, to ``new_tokens`` tokens (``eos``: with TRL's EOS
    stopping criterion and padding of finished sequences); returns the prompt-and-completion ids."""
    from .decode import MODEL_STEPS, DecodeExtrapolator, eligible
    from .steps import _accepts

    hf = _hf(model)  # (a PeftModel generates through its base model, the adapters active)
    config: Any = hf.config
    batch, prompt = ids.shape
    cache, what = make_cache(config, kind=cache_kind, max_len=prompt + new_tokens, kv_dtype=kv_dtype, compute=compute)
    if what not in notes:
        notes.append(what)
    cache_kw = "cache" if _accepts(hf, "cache") else "past_key_values"
    # _prepare_position_ids_for_generation
    pos = mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(mask == 0, 0)
    unfinished = torch.ones(batch, dtype=torch.long, device=ids.device)
    scores = probs = None
    fast = DecodeExtrapolator(sess.rec, sess.dispatch) \
        if getattr(sess, "extrapolate", True) and eligible(cache, config, prompt + new_tokens) else None
    for step in range(new_tokens):
        if fast is not None and step:
            fast.begin_step()
        with sess.phase(Phase.DECODE if step else Phase.PREFILL):
            with region():  # prepare_inputs_for_generation: the new positions sliced and cloned
                step_ids = (ids[:, -1:] if step else ids).clone(memory_format=torch.contiguous_format)
                step_pos = pos[..., -1:].clone(memory_format=torch.contiguous_format) if step else pos
                out = hf(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, use_cache=True,
                         logits_to_keep=1, **{cache_kw: cache})
                del step_ids, step_pos
                sess.label_cache(cache)
            # _update_model_kwargs_for_generation
            nxt_pos = torch.arange(1, dtype=pos.dtype, device=pos.device).view(1, -1) + pos[..., -1:] + 1
            pos = torch.cat([pos, nxt_pos], dim=-1)
            del nxt_pos
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=-1)
            # the last logits copied to fp32 (no logits processor at temperature 1 without top-k/top-p),
            # softmax, one draw; both stay alive (loop variables) until the next step replaces them
            scores = out.logits[:, -1].to(copy=True, dtype=torch.float32)
            probs = torch.softmax(scores, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1).squeeze(1)
            if eos:
                nxt = nxt * unfinished + 0 * (1 - unfinished)  # (pad id for finished sequences)
            ids = torch.cat([ids, nxt[:, None]], dim=-1)
            done = torch.full((batch,), False, dtype=torch.bool, device=ids.device)  # StoppingCriteriaList
            done = done | torch.full((batch,), False, dtype=torch.bool, device=ids.device)  # MaxLengthCriteria
            if eos:
                done = done | torch.isin(ids[:, -1], torch.tensor([0], device=ids.device))  # EosTokenCriteria
            unfinished = unfinished & ~done
            finished = unfinished.max() == 0  # (`this_peer_finished`, read on the host)
            del out, nxt, done, finished
        if fast is not None and step and fast.finish(remaining=new_tokens - 1 - step):
            note = (f"rollout decode steps {step + 1}–{new_tokens - 1} written from the exact progression of steps "
                    f"{step - MODEL_STEPS + 1}–{step} (every event; see vramplan.trace.decode)")
            if note not in notes:
                notes.append(note)
            break  # (the live tensors now stand for their last step's counterparts)
    del cache, mask, unfinished, pos, scores, probs
    return ids


def _logps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, completion: int, chunk: int,
           autocast: torch.dtype | None, region: Region, outputs: tuple[str, ...],
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_get_per_token_logps_and_entropies``: the completion tokens' log-probabilities (and
    entropies) in chunks of ``chunk`` sequences, concatenated."""
    hf, backbone, head = causal_lm_parts(model)
    all_logps, all_entropies = [], []
    fields: Any = None
    for start in range(0, ids.shape[0], chunk):
        ids_b, mask_b = ids[start:start + chunk], mask[start:start + chunk]
        labels = ids_b.masked_fill(mask_b == 0, -100)
        labels[:, :-completion] = -100

        def fused(ids_b: torch.Tensor = ids_b, mask_b: torch.Tensor = mask_b,
                  labels: torch.Tensor = labels) -> dict[str, torch.Tensor]:
            out = backbone(input_ids=ids_b, attention_mask=mask_b, use_cache=False)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            del out
            got, _m = trl_log_probs(hidden, head, labels, autocast, outputs)  # (labels with values: TRL's mask)
            return got

        with region():
            fields = through_root(hf, fused, model)
        all_logps.append(fields["log_probs"][:, -completion:])
        if entropy:
            all_entropies.append(fields["entropy"][:, -completion:])
        del labels, fused  # (its defaults hold the labels)
    logps = torch.cat(all_logps, dim=0)
    entropies = torch.cat(all_entropies, dim=0) if entropy else None
    del all_logps, all_entropies, fields
    return logps, entropies


def _reference(model: nn.Module, reference: nn.Module | None,
               source: Reference) -> tuple[contextlib.AbstractContextManager[Any], nn.Module, tuple[str, ...]]:
    if source is Reference.ADAPTERS:
        disable = getattr(model, "disable_adapter", None)
        if not callable(disable):
            raise TraceError("reference=adapters needs a PEFT model", hint="use `reference=model`")
        return disable(), model, POLICY_OUTPUTS
    if reference is None:
        raise TraceError("reference=model needs the reference model")
    return contextlib.nullcontext(), reference, REF_OUTPUTS


def _root_gathered(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Under FSDP1, TRL generates with the root unit's flat parameter gathered
    (``summon_full_params(model_wrapped, recurse=False)``, grpo_trainer.py:1861-1875, trl 1.16.0;
    trl/distributed.py:74-91): the embeddings, final norm and head whole for the rollout, each
    block's unit gathering itself in its forward."""
    root = fsdp1_root(model)
    if root is None:
        return contextlib.nullcontext()
    return type(root).summon_full_params(root, recurse=False)


def rollout(sess: Any, model: nn.Module, reference: nn.Module | None, source: Reference, *, micro_batch: int,
            steps: int, prompt: int, completion: int, autocast: torch.dtype | None, region: Region,
            cache_kind: str, kv_dtype: Any, compute: torch.dtype, notes: list[str],
            critic: nn.Module | None = None, reward: nn.Module | None = None) -> list[dict[str, torch.Tensor]]:
    """The generation window: ``generate``, the reference's log-probabilities, rewards and
    advantages; returns the ``steps`` micro-batches (views of the shuffled window)."""
    dev = _device(model)
    window = micro_batch * steps
    with torch.no_grad():
        # the left-padded prompts (one padded position: prompts differ in length) moved to the device
        ids = torch.zeros((window, prompt), dtype=torch.long, device=dev)
        mask = torch.ones((window, prompt), dtype=torch.long, device=dev)
        mask[0, 0] = 0
        with _no_checkpointing(_hf(model)), _root_gathered(model):  # (unwrap_model_for_generation turns it off)
            full = generate(sess, model, ids, mask, completion, region, cache_kind, kv_dtype, compute, notes)
        del ids, mask
        with sess.phase(Phase.FORWARD):
            # the completion ids go to the host (lists) and come back padded, with their masks
            del full
            return _score(model, reference, source, micro_batch=micro_batch, steps=steps, prompt=prompt,
                          completion=completion, autocast=autocast, region=region, engine=False, critic=critic,
                          reward=reward)


def engine_rollout(sess: Any, model: nn.Module, reference: nn.Module | None, source: Reference, e: Any,
                   blocks: dict[str, int], *, micro_batch: int, steps: int, prompt: int, completion: int,
                   autocast: torch.dtype | None, region: Region, critic: nn.Module | None = None,
                   reward: nn.Module | None = None) -> list[dict[str, torch.Tensor]]:
    """The generation window with a colocated vLLM engine (``use_vllm=True``, ``vllm_mode=
    "colocate"``): the engine generates (:func:`_engine_generate`), then the policy scores the
    completions under ``no_grad`` (``old_per_token_logps``: TRL always computes them with vLLM for
    its importance-sampling correction, ``vllm_importance_sampling_correction=True``), then as
    :func:`rollout`."""
    _engine_generate(sess, e, blocks)
    with torch.no_grad(), sess.phase(Phase.FORWARD):
        return _score(model, reference, source, micro_batch=micro_batch, steps=steps, prompt=prompt,
                      completion=completion, autocast=autocast, region=region, engine=True, critic=critic,
                      reward=reward)


def _engine_generate(sess: Any, e: Any, blocks: dict[str, int]) -> None:
    """The engine's blocks in the trainer's caching allocator around one generation.

    Started once (``LLM(...)`` in ``GRPOTrainer.__init__``): its CUDA graphs' pool, and without
    sleep mode its weights and KV cache, for good. With sleep mode (``sleep(level=2)`` right after
    start-up and after each generation) TRL calls ``empty_cache()`` and wakes the weights, then the
    KV cache, before generating, and puts both back to sleep after: released (modelled as freed and
    the cache emptied: vLLM's CuMemAllocator unmaps its own pool only, so the trainer's cached
    blocks would stay). The generation's eager forwards take at most the profile run's peak."""
    rec = sess.rec

    def take(size: int, cat: Category, desc: str, op: str) -> int | None:
        return rec.synthetic_alloc(size, cat, desc, op=op) if size > 0 else None

    parts = (("weights", e.weights, Category.PARAMETER, "vLLM weights (colocated engine)"),
             ("kv", e.kv_pool, Category.KV_CACHE, "vLLM KV cache pool (colocated engine)"))
    with sess.phase(Phase.DECODE):
        if "started" not in blocks:
            blocks["started"] = -1
            graphs = take(e.graphs, Category.WORKSPACE, "vLLM CUDA graph pool (colocated engine)", "vllm.capture")
            if graphs is not None:
                blocks["graphs"] = graphs
            if not e.sleep:
                for name, size, cat, desc in parts:
                    eid = take(size, cat, desc, "vllm.LLM")
                    if eid is not None:
                        blocks[name] = eid
        if e.sleep:
            rec.emit_action(Action.EMPTY_CACHE, "empty_cache before vllm wake_up")
            for name, size, cat, desc in parts:
                eid = take(size, cat, desc, "vllm.wake_up")
                if eid is not None:
                    blocks[name] = eid
        act = take(e.activations, Category.ACTIVATION, "vLLM forward activations (profile-run peak)", "vllm.generate")
        if act is not None:
            rec.synthetic_free(act, Category.ACTIVATION, op="vllm.generate")
        if e.sleep:
            for name, _size, cat, _desc in parts:
                if name in blocks:
                    rec.synthetic_free(blocks.pop(name), cat, op="vllm.sleep")
            rec.emit_action(Action.EMPTY_CACHE, "vllm sleep(level=2) releases its memory")


def _score(model: nn.Module, reference: nn.Module | None, source: Reference, *, micro_batch: int, steps: int,
           prompt: int, completion: int, autocast: torch.dtype | None, region: Region,
           engine: bool, critic: nn.Module | None = None,
           reward: nn.Module | None = None) -> list[dict[str, torch.Tensor]]:
    """``_generate_and_score_completions`` after the generation: the ids and masks on the device
    (with vLLM its sampling log-probabilities too), the policy's old log-probabilities and the
    importance-sampling ratio (vLLM), the reference's, rewards and advantages, shuffled (an index
    copy) and split into ``steps`` micro-batches (views)."""
    dev = _device(model)
    window = micro_batch * steps
    # the shuffle's permutation, drawn on the host with a fixed seed (the figure must not depend on
    # the draw), and one padded prompt position in every micro-batch it makes (prompts differ in
    # length: transformers builds the 4-D attention mask for each micro-step, not only for one)
    order = torch.randperm(window, generator=torch.Generator().manual_seed(0))
    prompt_ids = torch.zeros((window, prompt), dtype=torch.long, device=dev)
    prompt_mask = torch.ones((window, prompt), dtype=torch.long, device=dev)
    for i in range(steps):
        prompt_mask[int(order[i * micro_batch]), 0] = 0
    completion_ids = torch.zeros((window, completion), dtype=torch.long, device=dev)
    completion_mask = torch.ones((window, completion), dtype=torch.long, device=dev)
    sampling = torch.zeros((window, completion), dtype=torch.float32, device=dev) if engine else None
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    old = ratio = None
    if sampling is not None:
        old, _ = _logps(model, ids, mask, completion, micro_batch, autocast, region, POLICY_OUTPUTS, entropy=False)
        diff = torch.nan_to_num((old - sampling) * completion_mask, nan=0.0)
        ratio = torch.exp(diff.sum(dim=-1, keepdim=True))  # vllm_importance_sampling_mode="sequence_mask"
        del diff
        ratio = ratio.masked_fill((ratio < -math.inf) | (ratio > IS_CLIP_MAX), 0.0)
    ref_logps = None
    if source is not Reference.NONE:
        ctx, ref_model, outputs = _reference(model, reference, source)
        with ctx:
            ref_logps, _ = _logps(ref_model, ids, mask, completion, micro_batch, autocast, region, outputs,
                                  entropy=False)
    from . import ppo

    vals = ppo.values(critic, ids, mask, completion, micro_batch, region) if critic is not None else None
    scored = ppo.scores(reward, ids, mask, micro_batch, region) if reward is not None else None
    del ids, mask
    rewards = torch.zeros((window, 1), dtype=torch.float32, device=dev)  # (one reward function)
    if scored is not None:
        rewards = rewards + scored[:, None]
    returns = None
    if vals is not None:  # PPO: GAE per completion token
        advantages, returns = ppo.gae(rewards[:, 0], vals, completion_mask)
    else:
        advantages = rewards.sum(dim=1) - rewards.sum(dim=1).mean()
    num_items = completion_mask.sum()
    del rewards, scored
    if old is not None and sampling is not None:  # the logged |old - sampling| (its masked selection: at most all)
        delta = torch.abs(old - sampling)
        torch.mean(delta), torch.max(delta)
        del delta
    window_inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                     "completion_mask": completion_mask, "advantages": advantages, "num_items_in_batch": num_items}
    if old is not None and ratio is not None and sampling is not None:
        window_inputs.update(old_per_token_logps=old, importance_sampling_ratio=ratio,
                             sampling_per_token_logps=sampling)
    if ref_logps is not None:
        window_inputs["ref_per_token_logps"] = ref_logps
    if vals is not None and returns is not None:
        window_inputs.update(values=vals, returns=returns)
    del vals, returns
    del prompt_ids, prompt_mask, completion_ids, completion_mask, advantages, ref_logps, old, ratio, sampling
    perm = order.to(dev)  # shuffle_sequence_dict: an index copy of each
    shuffled = {k: (v if v.ndim == 0 else v[perm]) for k, v in window_inputs.items()}
    del perm, window_inputs, order
    return [{k: (v if v.ndim == 0 else v[i * micro_batch:(i + 1) * micro_batch]) for k, v in shuffled.items()}
            for i in range(steps)]


def forward_loss(model: nn.Module, batch: dict[str, torch.Tensor], *, steps: int, autocast: torch.dtype | None,
                 region: Region) -> tuple[Any, torch.Tensor]:
    """(what the loop holds, the loss) of one micro-batch: ``GRPOTrainer._compute_loss``."""
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    completion = completion_ids.shape[1]
    logps, entropies = _logps(model, ids, mask, completion, ids.shape[0], autocast, region, POLICY_OUTPUTS,
                              entropy=True)
    del ids, mask
    assert entropies is not None
    tmask = completion_mask
    advantages = batch["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (PPO: per token)
    old = batch.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    coef_1 = torch.exp(log_ratio)
    kl = None
    ref = batch.get("ref_per_token_logps")
    if ref is not None:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    del coef_2
    if "importance_sampling_ratio" in batch:  # (vLLM's correction, before the KL term)
        per_token_loss = per_token_loss * batch["importance_sampling_ratio"]
    if kl is not None:
        per_token_loss = per_token_loss + BETA * kl
    normalizer = batch["num_items_in_batch"].clamp(min=1.0) / 1
    normalizer = normalizer * steps / steps
    loss = (per_token_loss * tmask).sum() / normalizer
    del per_token_loss, normalizer

    def masked_mean(x: torch.Tensor) -> None:  # global_masked_mean: the sums, then `.item()` on the host
        s, n = (x * tmask).sum(), tmask.sum().float()
        torch.stack([s, n])

    with torch.no_grad():
        if kl is not None:
            masked_mean(kl)
        masked_mean(entropies)
        low = (coef_1 < 1 - EPSILON) & (advantages < 0)
        high = (coef_1 > 1 + EPSILON) & (advantages > 0)
        both = low | high
        for x in (low, high, both):
            masked_mean(x.float())
        for x in (low, high):
            (x.float() * tmask).sum(-1) / tmask.sum(-1)
        del low, high, both
    return (logps, entropies, kl), loss


def limit_note(phases: Any) -> str:
    """Which of GRPO's two parts sets the peak: the rollout (prefill, decode) or the training
    micro-steps (forward with the reference scoring, backward, recompute, optimizer)."""
    roll = max((p.allocated for p in phases if p.phase in (Phase.PREFILL, Phase.DECODE)), default=0)
    train = max((p.allocated for p in phases if p.phase not in (Phase.PREFILL, Phase.DECODE, Phase.SETUP)), default=0)
    part = "generation's" if roll > train else "scoring and training's"
    return (f"GRPO peaks: generation (prefill, decode) {roll / 2**30:,.2f} GiB allocated; scoring and training "
            f"(forward, backward, optimizer) {train / 2**30:,.2f} GiB: the step's peak is {part}")


__all__ = ["BETA", "EPSILON", "IS_CLIP_MAX", "POLICY_OUTPUTS", "REF_OUTPUTS", "engine_rollout", "forward_loss",
           "generate", "inputs", "limit_note", "rollout", "step_note"]
