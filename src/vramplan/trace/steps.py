"""Step runners: what one traced iteration does, phase by phase.

- training: ``grad_accum`` × (forward + loss under autocast, backward), then the optimizer
  step and ``zero_grad(set_to_none=True)``; the model outputs are dropped before backward
  (as a training loop that keeps only the loss does). The loop knobs of the workload change
  exactly these places: ``keep_outputs`` holds the outputs until after ``backward()``;
  ``keep_grads`` zeroes the gradients in place (``set_to_none=False``), so that from the
  second iteration on they exist through the forward and the backward accumulates into
  them; ``loss`` ≠ full runs the backbone and one of :mod:`.loss`'s implementations on its
  hidden states; ``optimizer_in_backward`` steps each parameter from its
  post-accumulate-grad hook and frees its gradient there (torchtune 0.6.1
  ``training/memory.py`` ``register_optim_in_bwd_hooks``: ``optim_dict[p].step();
  optim_dict[p].zero_grad()``), so no optimizer phase follows;
- inference: one forward under ``torch.inference_mode()``;
- generation: prefill + ``new_tokens − 1`` decode steps with a real transformers cache
  (:mod:`.kvcache`: ``DynamicCache`` by default, ``StaticCache`` on request, quantised by
  the KV dtype), logits of the last position only (``logits_to_keep=1``, as ``generate``
  does), greedy next token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from ..events import Category
from ..workload import KVDtype, Loss, Objective, Phase, Reference
from .decode import MODEL_STEPS, DecodeExtrapolator, eligible
from .kvcache import make_cache
from .loss import forward_and_loss
from .microsteps import TRACED as ACCUM_TRACED
from .microsteps import MicrostepRepeater
from .session import TraceSession

Batch = tuple[tuple[Any, ...], dict[str, Any]]
LossFn = Callable[..., torch.Tensor]


@dataclass
class StepPlan:
    """Everything a runner needs besides the session."""

    model: nn.Module
    batch: Batch
    task: str = "train"
    loss_fn: LossFn | None = None
    optimizer: Any = None
    grad_accum: int = 1
    autocast: bool = False
    grad_scaler: bool = False
    """fp16 mixed precision: scale the loss, unscale gradients in place before the step."""
    new_tokens: int = 0
    cache: str = "dynamic"
    kv_dtype: KVDtype = KVDtype.AUTO
    compute_dtype: torch.dtype = torch.bfloat16
    extrapolate_decode: bool = True
    """Trace the first decode steps and write the rest from their exact progression
    (:mod:`.decode`); False traces every step."""
    extrapolate_accum: bool = False
    """Trace the first gradient-accumulation micro-steps and write the rest as copies once two
    repeat exactly (:mod:`.microsteps`); False traces every micro-step."""
    notes: list[str] = field(default_factory=list)
    trainable: list[nn.Parameter] = field(default_factory=list)
    keep_grads: bool = False
    """``zero_grad(set_to_none=False)``: gradients are zeroed in place, never freed."""
    keep_outputs: bool = False
    """The loop holds the model's outputs until after ``backward()``."""
    loss: Loss = Loss.FULL
    loss_chunks: int = 8
    sm: tuple[int, int] = (9, 0)
    """Compute capability of the target (Liger's sm80+ in-place ``addmm``)."""
    chunk_ce: nn.Module | None = None
    """The chunked loss's per-chunk cross-entropy compiled (``compile``: torchtune's ``compile_loss``)."""
    in_backward: dict[nn.Parameter, Any] | None = None
    """``optimizer_in_backward``: one optimizer per parameter, stepped from its gradient hook."""
    objective: Objective = Objective.SFT
    reference: nn.Module | None = None
    """DPO's frozen reference model (``reference=model``), or None."""
    reference_source: Reference = Reference.MODEL
    prompt: int = 0
    """Prompt tokens per sequence a preference objective does not score (``Workload.prompt``)."""
    micro_batch: int = 0
    """GRPO: completions per micro-step (``Workload.batch``)."""
    completion: int = 0
    """GRPO: tokens generated per completion (``Workload.completion``)."""
    runner_name: str = ""
    """"grpo" when :func:`grpo_step` runs (its report names the limiting phase)."""
    held: list[Any] = field(default_factory=list)
    """GRPO: the generation window's buffered micro-batches (TRL's ``_buffered_inputs``), alive
    until the next window replaces them."""
    engine: Any = None
    """GRPO ``rollout=vllm``: the colocated engine (:class:`vramplan.target.RolloutEngine`)."""
    engine_blocks: dict[str, int] = field(default_factory=dict)
    """Its blocks alive in the trainer's allocator (event ids by part)."""
    critic: nn.Module | None = None
    """PPO's value model (:mod:`.ppo`), trained with ``critic_optimizer``."""
    critic_optimizer: Any = None
    reward_model: nn.Module | None = None
    """A frozen reward model scoring the window (``reward_model``), or None."""
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """GRPO/PPO: the event spans of the step's parts (generation, critic, actor), the last iteration's."""


def call_model(model: nn.Module, batch: Batch) -> Any:
    args, kwargs = batch
    return model(*args, **kwargs)


def loss_of(out: Any, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """The user's loss, else the model's ``.loss``, else ``output.sum()`` (a stand-in whose
    gradient is output-shaped, like any loss's)."""
    if loss_fn is not None:
        args, kwargs = batch
        try:
            return loss_fn(out, *args, **kwargs) if len(inspect.signature(loss_fn).parameters) > 1 else loss_fn(out)
        except (TypeError, ValueError):
            return loss_fn(out)
    loss = getattr(out, "loss", None)
    if isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    t = _first_tensor(out)
    if t is None:
        raise TraceError("the model returned no tensor to take a loss of", hint="pass loss_fn=")
    return t.float().sum() if t.is_floating_point() else t.sum()


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        vals = list(out.values())
    elif isinstance(out, (list, tuple)):
        vals = list(out)
    elif hasattr(out, "to_tuple"):
        vals = list(out.to_tuple())
    else:
        return None
    for v in vals:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def forward_loss(plan: StepPlan, sess: TraceSession | None = None,
                 batch: Batch | None = None) -> tuple[Any, torch.Tensor]:
    """(the model's outputs, the loss) as the workload's loss implementation computes them."""
    if per_call_autocast(plan) and plan.objective in (Objective.GRPO, Objective.PPO):
        from . import grpo

        assert sess is not None and batch is not None
        dtype, region = _per_call(sess, plan)
        return grpo.forward_loss(plan.model, batch[1], steps=plan.grad_accum, autocast=dtype, region=region)
    if per_call_autocast(plan):
        from .preference import dpo_forward_loss, kto_forward_loss

        assert sess is not None
        step = kto_forward_loss if plan.objective is Objective.KTO else dpo_forward_loss
        dtype, region = _per_call(sess, plan)
        return step(plan.model, plan.reference, plan.reference_source, plan.batch, dtype, region, plan.prompt)
    if plan.loss is Loss.FULL or plan.loss_fn is not None:
        out = call_model(plan.model, plan.batch)
        return out, loss_of(out, plan.batch, plan.loss_fn)
    dtype = sess.autocast.dtype if sess is not None and sess.autocast is not None and sess.autocast.enabled else None
    return forward_and_loss(plan.model, plan.batch, plan.loss, plan.loss_chunks, autocast_dtype=dtype, sm=plan.sm,
                            chunk_ce=plan.chunk_ce)


def _per_call(sess: TraceSession, plan: StepPlan) -> tuple[torch.dtype | None, Callable[[], Any]]:
    """(the autocast dtype or None, a region per model call) for :func:`per_call_autocast` steps."""
    ac = sess.autocast if plan.autocast else None

    def region() -> Any:  # accelerate's prepare_model: torch.autocast around each forward call
        return sess.autocast_region(plan.autocast)

    return (ac.dtype if ac is not None else None), region


def per_call_autocast(plan: StepPlan) -> bool:
    """Whether each model call runs in its own autocast region (the preference trainers, whose
    models accelerate wraps: ``model.forward`` under ``torch.autocast``, the loss outside it)
    instead of one region around the step's forward and loss. It matters beyond where the loss is
    computed: a region's weight-cast cache lives until it exits, and a cast made under
    ``no_grad`` (a reference or KL forward) must not serve a later forward with gradients."""
    return plan.objective is not Objective.SFT and plan.loss_fn is None


def register_in_backward(sess: TraceSession, optimizers: dict[nn.Parameter, Any]) -> None:
    """torchtune's ``register_optim_in_bwd_hooks``: each parameter's optimizer steps as soon as
    its gradient is accumulated, then frees it (``zero_grad()``, ``set_to_none=True``)."""

    def step(param: nn.Parameter) -> None:
        opt = optimizers[param]
        if param.grad is not None:
            sess.label_tensors([param.grad], Category.GRADIENT)
        opt.step()
        sess.label_optimizer(opt)
        opt.zero_grad(set_to_none=True)

    for p in optimizers:
        p.register_post_accumulate_grad_hook(step)


def train_step(sess: TraceSession, plan: StepPlan, batches: list[Batch] | None = None) -> None:
    scale = None
    repeat = (MicrostepRepeater(sess.rec, sess.dispatch)
              if plan.extrapolate_accum and plan.grad_accum > ACCUM_TRACED else None)
    for i in range(plan.grad_accum):
        if repeat is not None and i > 0:
            repeat.begin()
        with sess.phase(Phase.FORWARD), sess.autocast_region(plan.autocast and not per_call_autocast(plan)):
            out, loss = forward_loss(plan, sess, batches[i] if batches is not None else None)
            _label_model_cache(sess, out)
            if not plan.keep_outputs:
                del out
                out = None
            if plan.grad_scaler:
                if scale is None:
                    scale = torch.full((), 65536.0, dtype=torch.float32, device="meta")
                loss = loss.float() * scale
        if not loss.requires_grad:
            raise TraceError("the loss does not require grad: no trainable parameter takes part in it",
                             hint="check requires_grad / the PEFT target modules")
        with sess.backward():
            loss.backward()
        del loss, out
        sess.label_grads(plan.trainable)
        if repeat is not None and i > 0 and repeat.finish(remaining=plan.grad_accum - 1 - i):
            note = (f"gradient accumulation: micro-steps {i + 2}–{plan.grad_accum} of each iteration written as "
                    f"copies of micro-step {i + 1}, which recorded the same events as micro-step {i} (see "
                    "vramplan.trace.microsteps)")
            if note not in plan.notes:
                plan.notes.append(note)
            break
    if plan.in_backward is not None:
        return  # stepped and freed inside backward
    with sess.phase(Phase.OPTIMIZER):
        if plan.grad_scaler:
            grads = [p.grad for p in plan.trainable if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / 65536.0)
        if plan.optimizer is not None:
            plan.optimizer.step()
            sess.label_optimizer(plan.optimizer)
            plan.optimizer.zero_grad(set_to_none=not plan.keep_grads)
        else:
            for p in plan.trainable:
                if plan.keep_grads and p.grad is not None:
                    p.grad.zero_()
                else:
                    p.grad = None


def grpo_step(sess: TraceSession, plan: StepPlan) -> None:
    """One GRPO optimizer step (:mod:`.grpo`): the rollout of the window, then its micro-steps."""
    from . import grpo

    # Boolean reads without values read False, as under ``vramplan run``: transformers' "no
    # padding?" check (``fast_all(padding_mask)``) on masks too large to keep values for (a
    # window above vramplan.trace.values.SHADOW_LIMIT elements) answers as the smaller ones do:
    # there is padding, the 4-D mask is built
    sess.dispatch.bool_reads = False
    dtype, region = _per_call(sess, plan)
    log = sess.rec.log
    start = len(log)
    if plan.engine is not None:
        window = grpo.engine_rollout(sess, plan.model, plan.reference, plan.reference_source, plan.engine,
                                     plan.engine_blocks, micro_batch=plan.micro_batch, steps=plan.grad_accum,
                                     prompt=plan.prompt, completion=plan.completion, autocast=dtype, region=region,
                                     critic=plan.critic, reward=plan.reward_model)
    else:
        window = grpo.rollout(sess, plan.model, plan.reference, plan.reference_source, micro_batch=plan.micro_batch,
                              steps=plan.grad_accum, prompt=plan.prompt, completion=plan.completion, autocast=dtype,
                              region=region, cache_kind=plan.cache, kv_dtype=plan.kv_dtype,
                              compute=plan.compute_dtype, notes=plan.notes, critic=plan.critic,
                              reward=plan.reward_model)
    plan.held[:] = window  # (the previous window's buffer dies here)
    del window
    plan.spans = {"generation": [(start, len(log))]}
    if plan.critic is not None:  # verl's order: update_critic, then update_actor
        from .ppo import critic_update

        start = len(log)
        critic_update(sess, plan.critic, plan.critic_optimizer, plan.held, region)
        plan.spans["critic"] = [(start, len(log))]
    start = len(log)
    train_step(sess, plan, [((), b) for b in plan.held])
    plan.spans["actor"] = [(start, len(log))]


def infer_step(sess: TraceSession, plan: StepPlan) -> None:
    with torch.inference_mode(), sess.phase(Phase.FORWARD), sess.autocast_region(plan.autocast):
        out = call_model(plan.model, plan.batch)
        _label_model_cache(sess, out)
        del out


def _label_model_cache(sess: TraceSession, out: Any) -> None:
    """A transformers model called with ``use_cache`` fills a cache of its own: kv_cache."""
    if isinstance(out, tuple) and not hasattr(out, "past_key_values"):
        for o in out:
            _label_model_cache(sess, o)
        return
    cache = getattr(out, "past_key_values", None)
    if cache is not None and not isinstance(cache, torch.Tensor):
        sess.label_cache(cache)


PREFILL_ONLY = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                          "second_per_grid_ts", "mm_token_type_ids", "token_type_ids", "aspect_ratio_ids",
                          "aspect_ratio_mask"})
"""Inputs of a vision-language model's prompt: the images and videos the prefill encodes (Qwen-VL's
token types and video time scale give the prompt's multimodal RoPE positions; decode steps add
the positions' stored offset, ``compute_3d_position_ids``), Gemma 3's token types, which mark the prompt's image tokens; ``Gemma3ForConditionalGeneration.
prepare_inputs_for_generation`` passes them to the first step only; Llama 3.2 Vision's aspect
ratios likewise)."""
DECODE_LAST_ROW = frozenset({"cross_attention_mask"})
"""Per-token inputs a decode step takes one row of: Llama 3.2 Vision's cross-attention mask
(``MllamaForConditionalGeneration`` extends it by its last row per new token and
``prepare_inputs_for_generation`` slices it to the step)."""


def generate_step(sess: TraceSession, plan: StepPlan) -> None:
    args, kwargs = plan.batch
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        raise TraceError("generation needs a causal language model and token ids (an integer "
                         "[batch, prompt] tensor) as example inputs",
                         hint="pass inputs={'input_ids': ...}, or use task infer/train for other models")
    extra = {k: v for k, v in kwargs.items() if k not in ("input_ids", "labels", "attention_mask")}
    # a vision-language model's images go into the prefill only (transformers'
    # prepare_inputs_for_generation drops them once the cache holds the prompt)
    decode_extra = {k: v for k, v in extra.items() if k not in PREFILL_ONLY}
    for k in DECODE_LAST_ROW.intersection(decode_extra):  # (a row per token: the step's own)
        decode_extra[k] = decode_extra[k][:, -1:]
    prompt = ids.shape[1]
    keep = _accepts(plan.model, "logits_to_keep")
    cache_kw = "cache" if _accepts(plan.model, "cache") else "past_key_values"
    if not (_takes(plan.model, "use_cache") and _takes(plan.model, cache_kw)):
        raise TraceError(
            f"generation needs a model whose forward takes use_cache and {cache_kw} (a transformers "
            f"causal LM); {type(plan.model).__name__}.forward does not",
            hint="use task infer to trace one forward pass",
        )
    config: Any = getattr(plan.model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if (isinstance(limit, int) and limit > 0 and prompt + plan.new_tokens > limit
            and getattr(config, "model_type", "") in LEARNED_POSITIONS):
        raise TraceError(
            f"{prompt} prompt + {plan.new_tokens} new tokens exceed the model's {limit} learned positions",
            hint=f"keep prompt + new tokens at {limit} or less",
        )
    with torch.inference_mode():
        cache, what = make_cache(config, kind=plan.cache, max_len=prompt + plan.new_tokens,
                                 kv_dtype=plan.kv_dtype, compute=plan.compute_dtype)
        if what not in plan.notes:
            plan.notes.append(what)
        with sess.phase(Phase.PREFILL), sess.autocast_region(plan.autocast):
            pos = torch.arange(prompt, device=ids.device)
            kw = {"logits_to_keep": 1} if keep else {}
            kw[cache_kw] = cache
            out = plan.model(input_ids=ids, use_cache=True, cache_position=pos, **kw, **extra)
            nxt = _last_logits(out).argmax(-1)
            del out
            sess.label_cache(cache)
        fast = None
        if plan.extrapolate_decode and eligible(cache, config, prompt + plan.new_tokens):
            fast = DecodeExtrapolator(sess.rec, sess.dispatch)
        for step in range(1, plan.new_tokens):
            if fast is not None:
                fast.begin_step()
            with sess.phase(Phase.DECODE), sess.autocast_region(plan.autocast):
                pos = torch.arange(prompt + step - 1, prompt + step, device=ids.device)
                out = plan.model(input_ids=nxt, use_cache=True, cache_position=pos, **{cache_kw: cache},
                                 **decode_extra)
                nxt = _last_logits(out).argmax(-1)
                del out
                sess.label_cache(cache)
            if fast is not None and fast.finish(remaining=plan.new_tokens - 1 - step):
                note = (f"decode steps {step + 1}–{plan.new_tokens - 1} written from the exact progression of "
                        f"steps {step - MODEL_STEPS + 1}–{step} (every event; see vramplan.trace.decode)")
                if note not in plan.notes:
                    plan.notes.append(note)
                break
        del cache, nxt


def _last_logits(out: Any) -> torch.Tensor:
    """The last position's logits, whole: under tensor parallelism the head's output is a
    vocabulary-sharded DTensor, all-gathered as transformers' TP generation gathers its logits
    (``colwise_gather_output``). (DTensor's own ``argmax(-1)`` over ``Shard(-1)`` fails in torch
    2.13, for real too: ``all_gather_single`` with a negative ``gather_dim`` builds a wrong view.)"""
    logits = out.logits[:, -1:]
    full = getattr(logits, "full_tensor", None)
    return full() if full is not None else logits


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _takes(model: nn.Module, name: str) -> bool:
    """``forward`` accepts keyword ``name``, by name or through ``**kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: let the call decide
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt"})
"""Decoders with a learned absolute position table: past it, the embedding lookup fails on a GPU."""


RUNNERS: dict[str, Callable[[TraceSession, StepPlan], None]] = {
    "train": train_step, "infer": infer_step, "generate": generate_step,
}
