"""The recipes: each framework's training-loop defaults, read from its source (version named
in every link). Only what the framework sets by itself is a default; what a user chooses in
the framework (batch, sequence, PEFT, precision flags) stays the user's.

Precision is a default only where the framework converts the model itself (torchtune's
``dtype: bf16``, torchtitan's FSDP/autocast ``mixed_precision_param``). Trainer, TRL,
accelerate, Lightning, DeepSpeed and Unsloth compute in the dtype the model was loaded in
unless mixed precision is switched on (transformers 5 loads a checkpoint in its config's
dtype: ``from_pretrained`` ``dtype="auto"``, modeling_utils.py L4187, v5.24.0), which the
recipe cannot know: ``precision`` stays as given (``auto``: bf16-mixed).
"""

from __future__ import annotations

from collections.abc import Callable

from ..workload import (
    Checkpointing,
    Engine,
    Fsdp1Prefetch,
    Loss,
    Objective,
    OptimizerImpl,
    Parallel,
    Peft,
    Precision,
    Recipe,
    Reference,
    Rollout,
    Workload,
)
from ..workload import Optimizer as Opt
from ._model import Default, RecipeSpec, Restriction, RolloutRules

_HF = "https://github.com/huggingface/transformers/blob/v5.24.0/src/transformers"
_TRL = "https://github.com/huggingface/trl/blob/v1.16.0/trl"
_ACC = "https://github.com/huggingface/accelerate/blob/v1.15.0/src/accelerate"
_PL = "https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.6/src/lightning/pytorch"
_TT = "https://github.com/pytorch/torchtune/blob/v0.6.1"
_TITAN_CFG = ("https://github.com/pytorch/torchtitan/blob/000204a4a8bf3d0f31adc44fc29855fbb6ea13d8/"
              "torchtitan/config/job_config.py")
_TITAN_8B = ("https://github.com/pytorch/torchtitan/blob/01424cb254492cd6f5924e26d28227d75913e122/"
             "torchtitan/models/llama3/train_configs/llama3_8b.toml")
_TITAN_LOSS = "https://github.com/pytorch/torchtitan/blob/000204a4a8bf3d0f31adc44fc29855fbb6ea13d8/torchtitan/components/loss.py"
_DS = "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed"
_UNSLOTH = "https://github.com/unslothai/unsloth/blob/015bdef0d94a241bcd94eec7a405b1700632180d/unsloth/models/llama.py"
_UNSLOTH_ZOO = "https://github.com/unslothai/unsloth-zoo/blob/ce232d6cef9cb8cd34cd3727906131622177436b/unsloth_zoo"

_SET_TO_NONE_TORCH = ("torch.optim.Optimizer.zero_grad(set_to_none=True) and nn.Module.zero_grad(set_to_none=True) "
                      "are torch's defaults since 2.0")
_NOT_PRECISION = ("`precision` is not set by the {fw} recipe: it computes in the dtype the model was loaded in "
                  "unless mixed precision is switched on; vramplan uses `precision={p}`")

# --- Hugging Face Trainer -------------------------------------------------------------
_HF_ZERO_GRAD = f"{_HF}/trainer.py#L1954 (`model.zero_grad()`: set_to_none=True)"
_HF_OPTIM = f"{_HF}/training_args.py#L806-L813 (`optim` = adamw_torch_fused on torch >= 2.8, else adamw_torch)"
_HF_LOSS = (f"{_HF}/trainer.py#L2130-L2217 (`compute_loss`: the model's own loss, ForCausalLMLoss; only the loss "
            "is returned, so the outputs are freed before `backward` at trainer.py#L2126)")


# --- accelerate's FSDP plugin (what HF Trainer's `fsdp` and TRL run through) ----------------
_ACC_PLUGIN = "https://github.com/huggingface/accelerate/blob/v1.14.0/src/accelerate/utils/dataclasses.py"
# (read at v1.14.0; the same code 3 lines lower at main 16cb6eb, 1.15.0.dev0)


_ACC_PARALLELISM = ("https://github.com/huggingface/accelerate/blob/v1.14.0/src/accelerate/parallelism_config.py"
                    "#L379-L386 (`ParallelismConfig`, accelerate's tensor and context parallelism, with FSDP only "
                    "under `fsdp_version: 2`)")


def _model_parallel(p: Parallel) -> bool:
    return p.tp * p.pp * p.cp * p.ep > 1


def _fsdp_sharded(p: Parallel) -> bool:
    """A ZeRO-3 layout over several ranks that FSDP runs (given `engine=fsdp`/`fsdp1`, or `auto`'s FSDP),
    without tensor, pipeline, context or expert parallelism (accelerate's FSDP beside those is FSDP2)."""
    return p.dp > 1 and p.zero == 3 and not _model_parallel(p) and (
        p.engine in (Engine.FSDP, Engine.FSDP1) or p.framework is Engine.FSDP)


def _is_fsdp1(p: Parallel) -> bool:
    return p.dp > 1 and p.framework is Engine.FSDP1


def _accelerate_fsdp1(dp: int) -> tuple[Default, ...]:
    """accelerate's ``FullyShardedDataParallelPlugin`` defaults (FSDP1 unless `fsdp_version: 2`): the engine
    under ZeRO-3 over several GPUs, and its backward prefetch under FSDP1."""
    if dp < 2:
        return ()
    return (
        Default("engine", Engine.FSDP1, f"{_ACC_PLUGIN}#L1820-L1821 (`fsdp_version` None: FSDP_VERSION, default "
                f"'1': FullyShardedDataParallel; #L1835-L1836 `sharding_strategy` FULL_SHARD; with tensor or context "
                f"parallelism FSDP2: {_ACC_PARALLELISM})", _fsdp_sharded),
        Default("fsdp1_prefetch", Fsdp1Prefetch.NONE, f"{_ACC_PLUGIN}#L1882-L1885 (`backward_prefetch` None: "
                "FSDP_BACKWARD_PREFETCH unset, no prefetch)", _is_fsdp1),
    )


def _hf_trainer(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("optimizer", Opt.ADAMW, _HF_OPTIM),
        Default("optimizer_impl", OptimizerImpl.FUSED, _HF_OPTIM),
        Default("checkpointing", Checkpointing.NONE,
                f"{_HF}/training_args.py#L908 (`activation_checkpointing` default None: off)"),
        Default("keep_grads", False, _HF_ZERO_GRAD),
        Default("keep_outputs", False, _HF_LOSS),
        Default("loss", Loss.FULL, _HF_LOSS),
        Default("optimizer_in_backward", False, f"{_HF}/trainer.py#L1945-L1954 (step after backward, then zero_grad)"),
        Default("compile", False, f"{_HF}/training_args.py#L940 (`torch_compile` default False)"),
        Default("activation_offload", False, f"{_HF}/training_args.py#L916-L925 (offload only with "
                "`activation_checkpointing_kwargs={'offload': True}`)"),
        *_accelerate_fsdp1(dp),
    )


# --- TRL SFTTrainer ---------------------------------------------------------------------
_TRL_HEAD = (f"{_TRL}/trainer/sft_trainer.py#L1141-L1146 (`add_fused_lm_head`: log-probs in tiles of "
             f"{_TRL}/kernels/chunked_logprob.py#L31 TOKEN_CHUNK_SIZE=4096 tokens by 32,768 vocabulary entries, "
             "logits never materialised)")


def _trl_sft(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("optimizer", Opt.ADAMW, _HF_OPTIM),
        Default("optimizer_impl", OptimizerImpl.FUSED, _HF_OPTIM),
        Default("checkpointing", Checkpointing.FULL,
                f"{_TRL}/trainer/base_config.py#L62 (`gradient_checkpointing` default True)"),
        Default("keep_grads", False, _HF_ZERO_GRAD),
        Default("keep_outputs", False, _HF_LOSS),
        Default("loss", Loss.TRL, _TRL_HEAD),
        Default("optimizer_in_backward", False, f"{_HF}/trainer.py#L1945-L1954 (Trainer's loop)"),
        Default("compile", False, f"{_HF}/training_args.py#L940"),
        Default("activation_offload", False, f"{_TRL}/trainer/sft_config.py#L291 (`activation_offloading` False)"),
        *_accelerate_fsdp1(dp),
    )


def _trl_dpo(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        *(d for d in _trl_sft(peft, dp) if d.field != "loss"),
        Default("loss", Loss.TRL, f"{_TRL}/trainer/dpo_trainer.py#L953-L962 (`add_fused_lm_head` on the policy, with "
                "log-probs, entropy, mean logits and top-1, and on the reference)"),
        Default("objective", Objective.DPO, f"{_TRL}/trainer/dpo_trainer.py#L1285-L1335 (`_compute_loss`: chosen and "
                "rejected concatenated, the reference forward under no_grad)"),
        Default("reference", Reference.AUTO, f"{_TRL}/trainer/dpo_trainer.py#L907-L928 (no `ref_model`: the adapters "
                f"disabled under PEFT, else a copy loaded in the policy's dtype; {_TRL}/trainer/dpo_config.py#L227 "
                "`precompute_ref_log_probs` False)"),
    )


def _trl_kto(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        *(d for d in _trl_sft(peft, dp) if d.field != "loss"),
        Default("loss", Loss.TRL, f"{_TRL}/trainer/kto_trainer.py#L965-L972 (`add_fused_lm_head` on the policy, with "
                "log-probs, entropy and mean logits, and on the reference)"),
        Default("objective", Objective.KTO, f"{_TRL}/trainer/kto_trainer.py#L1337-L1440 (`_compute_kl_logps` and "
                "`_compute_loss`: the KL batch and the reference's forwards under no_grad; loss_type 'kto' computes "
                f"the KL term, {_TRL}/trainer/kto_trainer.py#L815)"),
        Default("reference", Reference.AUTO, f"{_TRL}/trainer/kto_trainer.py#L919-L938 (no `ref_model`: the adapters "
                "disabled under PEFT, else a copy loaded in the policy's dtype)"),
    )


def _trl_grpo(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        *(d for d in _trl_sft(peft, dp) if d.field != "loss"),
        Default("loss", Loss.TRL, f"{_TRL}/trainer/grpo_trainer.py#L1066-L1073 (`add_fused_lm_head` on the policy, "
                "with log-probs and entropy)"),
        Default("objective", Objective.GRPO, f"{_TRL}/trainer/grpo_trainer.py#L1763-L1890 (`_generate_single_turn`: "
                f"`generate` without vLLM, {_TRL}/trainer/grpo_config.py#L587-L588 `use_vllm` False) and "
                f"{_TRL}/trainer/grpo_trainer.py#L3020 (`_compute_loss`, {_TRL}/trainer/grpo_config.py#L801-L802 "
                "`loss_type` 'dapo')"),
        Default("reference", Reference.AUTO, f"{_TRL}/trainer/grpo_config.py#L681-L682 (`beta` 0.0) and "
                f"{_TRL}/trainer/grpo_trainer.py#L983-L990 (beta 0: no reference model)"),
        Default("generations", 8, f"{_TRL}/trainer/grpo_config.py#L480-L481 (`num_generations` 8)"),
        Default("rollout", Rollout.HF, f"{_TRL}/trainer/grpo_config.py#L587-L588 (`use_vllm` False; with it, "
                f"#L594-L595 `vllm_mode` 'colocate': rollout=vllm)"),
        Default("vllm_memory", 0.3, f"{_TRL}/trainer/grpo_config.py#L656-L657 (`vllm_gpu_memory_utilization` 0.3)"),
        Default("vllm_max_len", 0, f"{_TRL}/trainer/grpo_config.py#L664-L665 (`vllm_max_model_length` None: "
                "vLLM takes the model's)"),
        Default("vllm_sleep", False, f"{_TRL}/trainer/grpo_config.py#L612-L613 (`vllm_enable_sleep_mode` False)"),
    )


# --- verl 0.7.0 (FSDP workers, hybrid engine: actor, rollout, reference, critic in one process per GPU) ----
_VERL = "https://github.com/volcengine/verl/blob/v0.7.0"
_VERL_CFG = f"{_VERL}/verl/trainer/config/_generated_ppo_trainer.yaml"
_VERL_ROLLOUT = f"{_VERL}/verl/trainer/config/rollout/rollout.yaml"
_VERL_GRPO = f"{_VERL}/examples/grpo_trainer/run_qwen3-8b.sh"
_VERL_RULES = RolloutRules(
    "verl 0.7.0 hybrid engine", "0.12.0", 8192, 1024, False,
    f"{_VERL}/setup.py#L52 (`vllm>=0.8.5,<=0.12.0`: the newest release it allows), {_VERL_ROLLOUT}#L62 "
    f"(`max_num_batched_tokens: 8192`), #L68 (`max_num_seqs: 1024`)")


def _verl_ppo(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("precision", Precision.BF16_MIXED, f"{_VERL_CFG}#L36 (actor `model_dtype: fp32`) and "
                f"{_VERL}/verl/workers/fsdp_workers.py#L487 (FSDP `param_dtype` bf16)"),
        Default("optimizer", Opt.ADAMW, f"{_VERL_CFG}#L10-L11 (`optimizer: AdamW`, `optimizer_impl: torch.optim`)"),
        Default("optimizer_impl", OptimizerImpl.FOREACH, f"{_VERL_CFG}#L11 (torch.optim.AdamW without `fused`: "
                "foreach on CUDA)"),
        Default("checkpointing", Checkpointing.FULL, f"{_VERL_CFG}#L294 (actor `enable_gradient_checkpointing: "
                "true`), #L407 (critic's)"),
        Default("keep_grads", False, f"{_VERL}/verl/workers/actor/dp_actor.py (`self.actor_optimizer.zero_grad()` "
                f"before each mini-batch; {_SET_TO_NONE_TORCH})"),
        Default("objective", Objective.PPO, f"{_VERL_CFG} `algorithm.adv_estimator: gae` (L553): a critic "
                "(`critic.enable` null: on with gae)"),
        Default("generations", 1, f"{_VERL_ROLLOUT}#L142 (`n: 1`)"),
        Default("reference", Reference.NONE, f"{_VERL_CFG}#L74 (`use_kl_loss: false`) and `algorithm."
                "use_kl_in_reward: false` (L555): no reference worker"),
        Default("reward_model", False, f"{_VERL_CFG}#L469 (`reward_model.enable: false`: rule-based reward)"),
        Default("rollout", Rollout.VLLM, f"{_VERL_CFG}#L190 (`rollout.name` required; vllm in every example) and "
                "L309 `hybrid_engine: true` (colocated)"),
        Default("vllm_memory", 0.5, f"{_VERL_ROLLOUT}#L32 (`gpu_memory_utilization: 0.5`)"),
        Default("vllm_max_len", 0, f"{_VERL}/verl/workers/rollout/vllm_rollout/vllm_async_server.py#L198 "
                "(`max_model_len` None: the model's `max_position_embeddings`)"),
        Default("vllm_sleep", True, f"{_VERL_ROLLOUT}#L47 (`free_cache_engine: True`) and "
                f"{_VERL}/verl/workers/config/rollout.py#L220 (`enable_sleep_mode: True`; level 2 from vLLM 0.8.5, "
                f"{_VERL}/verl/third_party/vllm/__init__.py#L48-L49)"),
        Default("seq", 1024, f"{_VERL_CFG}#L320-L321 (`max_prompt_length` 512 + `max_response_length` 512)"),
        Default("prompt", 512, f"{_VERL_CFG}#L320 (`max_prompt_length: 512`)"),
        *([Default("zero", 3, f"{_VERL_CFG}#L33-L34, #L386-L387 (`reshard_after_forward: true`, `fsdp_size: -1`: "
                   f"every model FULL_SHARD over all ranks, {_VERL}/verl/workers/fsdp_workers.py#L109-L121)")]
          if dp > 1 else []),
    )


def _verl_grpo(peft: Peft, dp: int) -> tuple[Default, ...]:
    keep = {"objective", "generations", "reference"}
    return (
        *(d for d in _verl_ppo(peft, dp) if d.field not in keep),
        Default("objective", Objective.GRPO, f"{_VERL_GRPO}#L7 (`algorithm.adv_estimator=grpo`: no critic)"),
        Default("generations", 5, f"{_VERL_GRPO}#L31 (`rollout.n=5`; the config's default 1 is no group)"),
        Default("reference", Reference.MODEL, f"{_VERL_GRPO}#L20 (`use_kl_loss=True`: a reference worker, "
                f"{_VERL}/verl/trainer/ppo/ray_trainer.py `need_reference_policy`)"),
    )


def _verl_caveats(w: Workload) -> tuple[str, ...]:
    out = ["verl computes the policy's log-probabilities from the full-vocabulary logits of the micro-batch's "
           "tokens (verl/workers/actor/dp_actor.py `_forward_micro_batch`, padding removed); the estimate scores "
           "them through TRL's fused head in tiles: it leaves out up to tokens x vocabulary x 6 B (bf16 logits, fp32 "
           "log-softmax) per micro-batch",
           "verl's rollout runs vLLM with `tensor_model_parallel_size: 2` (rollout.yaml L50); the estimate sizes one "
           "engine per GPU (tensor parallel 1): the same budget (`vllm_memory` of the GPU), split with more weights "
           "and less KV cache",
           "verl's colocated vLLM allocates through its own CuMemAllocator pool, not the trainer's caching "
           "allocator; the estimate places its blocks in the trainer's (same bytes, no shared cached blocks)",
           _NOT_PRECISION.format(fw="verl", p=w.precision).replace("is not set by", "follows").split(":")[0]
           + ": FSDP keeps fp32 parameters and computes in bf16 (bf16-mixed)"]
    if w.reference_source is Reference.MODEL:
        out.append("verl's GRPO example offloads the reference's parameters to the CPU between its forwards "
                   f"(`ref.fsdp_config.param_offload=True`, {_VERL_GRPO}#L33) and loads it in bf16 "
                   "(fsdp_workers.py L326); the estimate keeps a frozen copy in the policy's dtype resident: an "
                   "upper bound")
    if w.reward_model:
        out.append("verl loads the reward model in bf16 (fsdp_workers.py L1729-L1741), as the estimate does, and "
                   "FULL_SHARD-wraps it over every rank with its parameters offloaded to the CPU (`CPUOffload("
                   "offload_params=True)`, L1758; FSDP2 `CPUOffloadPolicy`, L1764), gathered only for its forward; "
                   "with the config's `reward_model.use_reward_loop: true` (gen.yaml L514) it is served instead by a "
                   "colocated vLLM engine asleep outside its scoring (ray_trainer.py L819-L845, "
                   "verl/experimental/reward_loop/reward_model.py). The estimate keeps its bf16 shards resident on the "
                   "GPU: an upper bound")
    if w.parallel.dp > 1:
        out.append("verl's default `strategy: fsdp` is FSDP1 (flat parameters, gen.yaml L45, L398); the estimate "
                   "shards the actor and the critic with FSDP2 (verl's `strategy=fsdp2`, fsdp_utils.py `apply_fsdp2`): "
                   "the same shards; verl's FSDP2 also wraps an untied embedding on its own (L523-L524)")
    if w.objective is Objective.PPO:
        out.append("verl updates the critic before the actor (ray_trainer.py `fit`: `update_critic`, then "
                   "`update_actor`); its critic is AutoModelForTokenClassification with one label "
                   "(fsdp_workers.py L1310): the backbone and a scalar head, no LM head")
    return tuple(out)


# --- OpenRLHF 0.11.0 (Ray, DeepSpeed; the hybrid-engine layout: every model on the same GPUs) ---------
_ORL = "https://github.com/OpenRLHF/OpenRLHF/blob/v0.11.0"
_ORL_CLI = f"{_ORL}/openrlhf/cli/train_ppo_ray.py"
_ORL_HYBRID = f"{_ORL}/examples/scripts/train_ppo_ray_hybrid_engine.sh"
_ORL_RULES = RolloutRules(
    "OpenRLHF 0.11.0 --train.colocate_all", "0.27.1", None, None, False,
    f"{_ORL}/setup.py#L77 (`vllm==0.27.1`); {_ORL}/openrlhf/trainer/ray/vllm_engine.py#L266-L282 (no "
    "max_num_seqs or max_num_batched_tokens: vLLM's defaults)")


def _openrlhf_ppo(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("precision", Precision.BF16_MIXED, f"{_ORL_CLI}#L311-L317 (`--ds.param_dtype bf16`: DeepSpeed's "
                "bf16 optimizer, fp32 master weights)"),
        Default("optimizer", Opt.ADAMW, f"{_ORL_CLI}#L448 (`--actor.optim adam`/`--critic.optim adam`: DeepSpeed "
                "FusedAdam with weight decay)"),
        Default("optimizer_impl", OptimizerImpl.FUSED, f"{_ORL_CLI}#L448 (DeepSpeed FusedAdam: multi-tensor, no "
                "whole-list temporaries)"),
        Default("checkpointing", Checkpointing.NONE, f"{_ORL_CLI}#L309 (`--actor.gradient_checkpointing_enable` "
                "off)"),
        Default("keep_grads", False, f"{_DS}/runtime/engine.py#L3495-L3500 (`zero_grad`: `param.grad = None`)"),
        Default("objective", Objective.PPO, f"{_ORL_CLI}#L477-L482 (`--algo.advantage.estimator gae`) and "
                f"#L601-L606 (the critic initialised from the reward model)"),
        Default("generations", 1, f"{_ORL_CLI}#L413-L415 (`--rollout.n_samples_per_prompt 1`)"),
        Default("reference", Reference.MODEL, f"{_ORL_CLI}#L419 (`--algo.kl.init_coef 0.01`) and #L93-L103 "
                "(a reference model when it is above 0)"),
        Default("reward_model", True, f"{_ORL_CLI}#L518 (`--reward.model_name_or_path`: PPO scores with a reward "
                "model unless `--reward.remote_url` is given)"),
        Default("rollout", Rollout.VLLM, f"{_ORL_HYBRID}#L14 (`--train.colocate_all`: the vLLM engines on the "
                "trainer's GPUs)"),
        Default("vllm_memory", 0.5, f"{_ORL_HYBRID}#L15 (`--vllm.gpu_memory_utilization 0.5`; the CLI's default "
                f"0.95, {_ORL_CLI}#L250-L255, leaves the colocated trainer nothing)"),
        Default("vllm_max_len", 2048, f"{_ORL_CLI}#L53, #L74 (`max_model_len` = `--data.max_len`, 2048) and "
                f"{_ORL}/openrlhf/trainer/ray/vllm_engine.py#L273"),
        Default("vllm_sleep", True, f"{_ORL_HYBRID}#L40 (`--vllm.enable_sleep`; off by default, {_ORL_CLI}#L244-L249)"),
        Default("seq", 2048, f"{_ORL_CLI}#L379 (`--data.max_len 2048`: prompt and response)"),
        *([Default("zero", 2, f"{_ORL_CLI}#L308 (`--ds.zero_stage 2`)")] if dp > 1 else []),
    )


def _openrlhf_grpo(peft: Peft, dp: int) -> tuple[Default, ...]:
    keep = {"objective", "generations", "reward_model"}
    return (
        *(d for d in _openrlhf_ppo(peft, dp) if d.field not in keep),
        Default("objective", Objective.GRPO, f"{_ORL_CLI}#L477-L482 (`--algo.advantage.estimator group_norm`: "
                "GRPO's group-normalised advantage) and #L601-L602 (no critic for it)"),
        Default("reward_model", True, f"{_ORL_CLI}#L518 (`--reward.model_name_or_path`)"),
    )


def _openrlhf_caveats(w: Workload) -> tuple[str, ...]:
    out = ["OpenRLHF puts actor, critic, reference, reward model and vLLM engines on separate GPUs unless "
           f"`--train.colocate_all` ({_ORL_CLI}#L223-L228); this is the colocated layout of "
           "train_ppo_ray_hybrid_engine.sh: every model on each GPU. Each is its own Ray process there (its own "
           "CUDA context and caching allocator); the estimate places them in one",
           "DeepSpeed's bf16 optimizer keeps bf16 weights and an fp32 master copy (plus bf16 gradients); the "
           "estimate counts bf16-mixed (fp32 weights and gradients, bf16 compute): within 2 B per parameter",
           "OpenRLHF's actor computes log-probabilities from the full-vocabulary logits (openrlhf/models/actor.py); "
           "the estimate scores through TRL's fused head in tiles",
           "`--ds.enable_sleep` (DeepSpeed models offloaded to the CPU while vLLM generates) is not modelled: the "
           "trainer's states stay on the GPU through the generation (an upper bound for it)"]
    if w.objective is Objective.GRPO and w.generations == 8:
        out.append(f"OpenRLHF's `--rollout.n_samples_per_prompt` defaults to 1, which group_norm refuses "
                   f"({_ORL_CLI}#L612-L615); `generations=8` is vramplan's default: give yours")
    return tuple(out)


_RL_LOSS = Restriction("loss", (Loss.TRL, Loss.FULL), "the policy's log-probabilities of the completion tokens "
                       "(scored here through TRL's fused head)")


# --- accelerate and Lightning: the user's own loop ---------------------------------------
def _accelerate(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("keep_grads", False, f"{_ACC}/optimizer.py#L112-L118 (`AcceleratedOptimizer.zero_grad`: "
                "set_to_none None -> True)"),
        Default("compile", False, f"{_ACC}/accelerator.py#L255 (`dynamo_backend` defaults to 'no')"),
        *_accelerate_fsdp1(dp),
    )


def _accelerate_fsdp(w: Workload) -> tuple[str, ...]:
    """What of accelerate's FSDP plugin (which Trainer and TRL run through) the estimate takes as given."""
    p = w.parallel
    if p.dp < 2:
        return ()
    if p.framework is Engine.FSDP1:
        return ("FSDP1 as an `accelerate config` FSDP file sets it up: one unit per decoder block and the root "
                "(TRANSFORMER_BASED_WRAP; the bare plugin's default is NO_WRAP, one unit: "
                f"{_ACC_PLUGIN}#L1899-L1900), `limit_all_gathers` True, `use_orig_params=True` (the plugin's default "
                "False: the same bytes, the optimizer's states on the flat shards); `engine=fsdp` for FSDP2 "
                "(`fsdp_version: 2`)",)
    if p.zero >= 2 and p.framework is Engine.FSDP and _model_parallel(p):
        return (f"FSDP2, as accelerate runs FSDP beside tensor or context parallelism ({_ACC_PARALLELISM})",)
    if p.zero >= 2 and p.framework is Engine.FSDP:
        return (f"this estimate is FSDP2's (`fsdp_version: 2`); accelerate's FSDP plugin runs FSDP1 without it "
                f"({_ACC_PLUGIN}#L1820-L1821, FSDP_VERSION default '1'): `engine=fsdp1`, this recipe's default "
                "under `zero=3`",)
    return ()


def _lightning(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("keep_grads", False, f"{_PL}/core/module.py#L1391 (`optimizer_zero_grad` calls "
                f"`optimizer.zero_grad()`; {_SET_TO_NONE_TORCH})"),
        Default("keep_outputs", False, f"{_PL}/loops/optimization/automatic.py#L62-L73 (`training_step` "
                "returns the loss; the closure keeps only it for backward)"),
    )


# --- torchtune ------------------------------------------------------------------------------
_TT_FULL = f"{_TT}/recipes/configs/llama3_1/8B_full_single_device.yaml"
_TT_LORA = f"{_TT}/recipes/configs/llama3_1/8B_lora_single_device.yaml"
_TT_QLORA = f"{_TT}/recipes/configs/llama3_1/8B_qlora_single_device.yaml"
_TT_CHUNKS = f"{_TT}/torchtune/modules/loss/ce_chunked_output_loss.py#L30 (num_output_chunks=8)"


def _torchtune(peft: Peft, dp: int) -> tuple[Default, ...]:
    if peft is Peft.NONE:
        cfg = _TT_FULL
        return (
            Default("precision", Precision.BF16, f"{cfg}#L78 (`dtype: bf16`: weights, grads, states in bf16)"),
            Default("optimizer", Opt.PAGED_ADAMW_8BIT, f"{cfg}#L60 (bitsandbytes.optim.PagedAdamW8bit)"),
            Default("optimizer_in_backward", True, f"{cfg}#L66 (`optimizer_in_bwd: True`)"),
            Default("loss", Loss.CHUNKED, f"{cfg}#L63 (CEWithChunkedOutputLoss)"),
            Default("loss_chunks", 8, _TT_CHUNKS),
            Default("checkpointing", Checkpointing.FULL, f"{cfg}#L74 (`enable_activation_checkpointing: True`)"),
            Default("activation_offload", False, f"{cfg}#L75"),
            Default("compile", False, f"{cfg}#L68"),
            Default("keep_grads", False, f"{_TT}/recipes/full_finetune_single_device.py#L713 "
                    "(`zero_grad(set_to_none=True)`)"),
        )
    cfg = _TT_LORA if peft is Peft.LORA else _TT_QLORA
    lines = {"precision": 89, "opt": 62, "loss": 71, "ckpt": 92, "off": 93, "compile": 78} if peft is Peft.LORA \
        else {"precision": 88, "opt": 61, "loss": 70, "ckpt": 91, "off": 92, "compile": 77}
    return (
        Default("precision", Precision.BF16, f"{cfg}#L{lines['precision']} (`dtype: bf16`)"),
        Default("optimizer", Opt.ADAMW, f"{cfg}#L{lines['opt'] - 1}-L{lines['opt'] + 1} (torch.optim.AdamW, fused)"),
        Default("optimizer_impl", OptimizerImpl.FUSED, f"{cfg}#L{lines['opt'] + 1} (`fused: True`)"),
        Default("optimizer_in_backward", False, f"{_TT}/recipes/lora_finetune_single_device.py (no optimizer_in_bwd)"),
        Default("loss", Loss.CHUNKED, f"{cfg}#L{lines['loss']} (CEWithChunkedOutputLoss)"),
        Default("loss_chunks", 8, _TT_CHUNKS),
        Default("checkpointing", Checkpointing.FULL, f"{cfg}#L{lines['ckpt']}"),
        Default("activation_offload", False, f"{cfg}#L{lines['off']}"),
        Default("compile", False, f"{cfg}#L{lines['compile']}"),
        Default("keep_grads", False, f"{_TT}/recipes/lora_finetune_single_device.py#L717 "
                "(`zero_grad(set_to_none=True)`)"),
    )


# --- torchtitan -----------------------------------------------------------------------------
def _torchtitan(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("precision", Precision.BF16_MIXED, f"{_TITAN_CFG} (`Training.mixed_precision_param` 'bfloat16' "
                "via fully_shard or autocast; fp32 parameters)"),
        Default("optimizer", Opt.ADAMW, f"{_TITAN_CFG} (`Optimizer.name` 'AdamW')"),
        Default("optimizer_impl", OptimizerImpl.FUSED, f"{_TITAN_CFG} (`Optimizer.implementation` 'fused')"),
        Default("optimizer_in_backward", False, f"{_TITAN_CFG} (`Optimizer.early_step_in_backward` False)"),
        Default("checkpointing", Checkpointing.OP, f"{_TITAN_8B} ([activation_checkpoint] mode 'selective', "
                "selective_ac_option 'op')"),
        Default("loss", Loss.FULL, f"{_TITAN_LOSS} (`cross_entropy_loss`: `pred.flatten(0, 1).float()`)"),
        Default("compile", False, f"{_TITAN_8B} ([training] compile = false)"),
        *([Default("zero", 3, f"{_TITAN_CFG} (`Parallelism.data_parallel_shard_degree` -1: FSDP2 over every "
                   "rank)")] if dp > 1 else []),
        Default("keep_grads", False, "https://github.com/pytorch/torchtitan/blob/e9f53473bd120ca46cd5d34f15e7725287c35c66/"
                "torchtitan/train.py (`train_step` starts with `self.optimizers.zero_grad()`; " + _SET_TO_NONE_TORCH + ")"),
    )


def _torchtitan_caveats(w: Workload) -> tuple[str, ...]:
    out = ["this is torchtitan main of its llama3_8b.toml (SDPA, fp32 logits for the whole sequence, fused AdamW); "
           "torchtitan 0.3.0, the release on PyPI, runs otherwise by default: a loss in 8 sequence chunks whose "
           "backward runs chunk by chunk before the model's (`ChunkedLossWrapper`), compiled FlexAttention, foreach "
           "AdamW, and the forward-backward captured in a CUDA graph. For 0.3.0, trace torchtitan itself: "
           "`vramplan run -- torchrun --nproc-per-node N -m torchtitan.train --module llama3 --config llama3_8b`"]
    if w.parallel.dp == 1:
        out.append("torchtitan shards the model with FSDP2 over all GPUs (`data_parallel_shard_degree=-1`); on one "
                   "GPU it applies no FSDP and mixed precision by autocast: give `dp=N` for N GPUs")
    if w.parallel.zero == 3 and w.parallel.dp > 1:
        out.append("torchtitan's FSDP2 is `dp=N` with `zero=3`: the trace runs `fully_shard` on a fake process "
                   "group; the analytic method counts it as ZeRO-3 sharding")
    return tuple(out)


# --- DeepSpeed ------------------------------------------------------------------------------
def _deepspeed(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("keep_grads", False, f"{_DS}/runtime/engine.py#L3495-L3500 (`zero_grad`: `param.grad = None`)"),
        Default("zero", 0, f"{_DS}/runtime/zero/config.py#L95 (`stage` default 0)"),
        Default("optimizer_in_backward", False, f"{_DS}/runtime/engine.py#L3382-L3567 (`backward()`, then "
                "`step()`)"),
    )


def _deepspeed_caveats(w: Workload) -> tuple[str, ...]:
    return ("DeepSpeed's engine specifics are not modelled (contiguous gradient and reduce buckets, "
            "`reduce_bucket_size`/`allgather_bucket_size`, the BF16/FP16 optimizer's fp32 gradient copies): "
            "ZeRO stages follow vramplan's ZeRO semantics",)


# --- Unsloth ----------------------------------------------------------------------------------
def _unsloth(peft: Peft, dp: int) -> tuple[Default, ...]:
    return (
        Default("checkpointing", Checkpointing.FULL, f"{_UNSLOTH}#L3061-L3079 (`FastLlamaModel.get_peft_model`: "
                "`use_gradient_checkpointing=\"unsloth\"`)"),
        Default("activation_offload", True, f"{_UNSLOTH_ZOO}/gradient_checkpointing.py#L259-L282 "
                "(`Unsloth_Offloaded_Gradient_Checkpointer`: each checkpointed layer's input to CPU and back)"),
        Default("loss", Loss.LIGER, f"{_UNSLOTH_ZOO}/fused_losses/cross_entropy_loss.py#L535 "
                "(`unsloth_fused_ce_loss`: linear + cross-entropy chunked over tokens)"),
        Default("optimizer", Opt.ADAMW, _HF_OPTIM + " (Unsloth trains with TRL's SFTTrainer)"),
        Default("optimizer_impl", OptimizerImpl.FUSED, _HF_OPTIM),
        Default("keep_grads", False, _HF_ZERO_GRAD),
    )


def _unsloth_caveats(w: Workload) -> tuple[str, ...]:
    return ("Unsloth's fused CE (chunked over tokens) is estimated as Liger's fused linear cross-entropy "
            "(`loss=liger`); its Triton kernels (RoPE, RMSNorm, LoRA MLP) save activations like the model's "
            "own code here",)


_NO_OPT_IN_BWD = Restriction(
    "optimizer_in_backward", (False,),
    "the Trainer steps the optimizer after backward (transformers trainer.py L1945-L1954, v5.24.0)")
_NO_OP_SAC_TRAINER = Restriction(
    "checkpointing", (Checkpointing.NONE, Checkpointing.FULL),
    "the Trainer checkpoints whole decoder layers (`activation_checkpointing`, training_args.py L908, v5.24.0)")
_TRAINER_LOSS = Restriction(
    "loss", (Loss.FULL, Loss.LIGER, Loss.CCE, Loss.TRL),
    "the model's own loss, Liger's (`use_liger_kernel`) or a fused head; torchtune's chunked loss is not a Trainer option")

def _trl(recipe: Recipe, trainer: str, summary: str, defaults: Callable[[Peft, int], tuple[Default, ...]]) -> RecipeSpec:
    """A TRL trainer's recipe: the Trainer's restrictions and TRL's precision caveat."""
    return RecipeSpec(
        recipe, f"TRL {trainer} 1.16.0 on transformers 5.24.0", summary, defaults,
        (_NO_OPT_IN_BWD, _NO_OP_SAC_TRAINER, _TRAINER_LOSS),
        lambda w: (_NOT_PRECISION.format(fw=recipe.value, p=w.precision)
                   + " (TRL's `bf16` defaults to True: mixed bf16 when the model is loaded in fp32)",
                   *_accelerate_fsdp(w)))


_ORL_RESTRICTIONS = (
    Restriction("peft", (Peft.NONE, Peft.LORA), "OpenRLHF trains LoRA adapters or all weights (`--ds.lora.rank`)"),
    Restriction("offload_optimizer", (False,), "`--ds.adam_offload` is not modelled with a rollout"), _RL_LOSS)
_VERL_RESTRICTIONS = (
    Restriction("peft", (Peft.NONE, Peft.LORA), "verl trains LoRA adapters or all weights (`lora_rank`)"),
    Restriction("offload_optimizer", (False,), "`optimizer_offload` (FSDP CPU offload of the optimizer) is not "
                "modelled with a rollout"), _RL_LOSS)

CATALOG: dict[Recipe, RecipeSpec] = {
    Recipe.PLAIN: RecipeSpec(Recipe.PLAIN, "vramplan's own loop",
                             "zero_grad(set_to_none=True), logits freed before backward, full-vocabulary fp32 loss",
                             lambda peft, dp: ()),
    Recipe.HF_TRAINER: RecipeSpec(
        Recipe.HF_TRAINER, "Hugging Face transformers Trainer 5.24.0",
        "fused AdamW, no checkpointing, the model's full-vocabulary loss, gradients freed after the step",
        _hf_trainer, (_NO_OPT_IN_BWD, _NO_OP_SAC_TRAINER, _TRAINER_LOSS),
        lambda w: (_NOT_PRECISION.format(fw="hf-trainer", p=w.precision), *_accelerate_fsdp(w))),
    Recipe.TRL_SFT: _trl(Recipe.TRL_SFT, "SFTTrainer",
                         "gradient checkpointing on, a fused LM head that never materialises the logits, fused AdamW",
                         _trl_sft),
    Recipe.TRL_DPO: _trl(Recipe.TRL_DPO, "DPOTrainer",
                         "DPO on chosen/rejected pairs with a reference forward (adapters disabled under PEFT, else a "
                         "frozen copy), TRL's fused LM head, gradient checkpointing on, fused AdamW", _trl_dpo),
    Recipe.TRL_KTO: _trl(Recipe.TRL_KTO, "KTOTrainer",
                         "KTO on labelled sequences with a KL batch and the reference's forwards (adapters disabled "
                         "under PEFT, else a frozen copy), TRL's fused LM head, gradient checkpointing on, fused AdamW",
                         _trl_kto),
    Recipe.TRL_GRPO: _trl(Recipe.TRL_GRPO, "GRPOTrainer",
                          "GRPO: a rollout with `generate` on the training model, then micro-steps through TRL's "
                          "fused LM head with the dapo loss; no reference (beta 0), gradient checkpointing on, fused "
                          "AdamW", _trl_grpo),
    Recipe.VERL_PPO: RecipeSpec(
        Recipe.VERL_PPO, "verl 0.7.0 ppo_trainer.yaml (FSDP, hybrid engine)",
        "PPO with a critic (gae), colocated vLLM 0.12 in sleep mode at 0.5 of the GPU, no reference, gradient "
        "checkpointing, bf16-mixed FSDP, AdamW", _verl_ppo,
        _VERL_RESTRICTIONS,
        _verl_caveats, _VERL_RULES),
    Recipe.VERL_GRPO: RecipeSpec(
        Recipe.VERL_GRPO, "verl 0.7.0 ppo_trainer.yaml with examples/grpo_trainer/run_qwen3-8b.sh",
        "GRPO (5 generations), a reference for the KL loss, colocated vLLM 0.12 in sleep mode at 0.5 of the GPU, "
        "gradient checkpointing, bf16-mixed FSDP, AdamW", _verl_grpo,
        _VERL_RESTRICTIONS,
        _verl_caveats, _VERL_RULES),
    Recipe.OPENRLHF_PPO: RecipeSpec(
        Recipe.OPENRLHF_PPO, "OpenRLHF 0.11.0 train_ppo_ray (DeepSpeed; colocated as its hybrid-engine example)",
        "PPO with a critic and a reward model, a reference (KL 0.01), colocated vLLM 0.27.1 in sleep mode at 0.5, "
        "no gradient checkpointing, DeepSpeed bf16, fused Adam", _openrlhf_ppo,
        _ORL_RESTRICTIONS,
        _openrlhf_caveats, _ORL_RULES),
    Recipe.OPENRLHF_GRPO: RecipeSpec(
        Recipe.OPENRLHF_GRPO, "OpenRLHF 0.11.0 train_ppo_ray --algo.advantage.estimator group_norm",
        "GRPO (group_norm, no critic) with a reward model and a reference, colocated vLLM 0.27.1 in sleep mode at "
        "0.5, DeepSpeed bf16, fused Adam", _openrlhf_grpo,
        _ORL_RESTRICTIONS,
        _openrlhf_caveats, _ORL_RULES),
    Recipe.ACCELERATE: RecipeSpec(
        Recipe.ACCELERATE, "accelerate 1.15.0, your own loop", "gradients freed by zero_grad; the rest is your loop",
        _accelerate, (), lambda w: (_NOT_PRECISION.format(fw="accelerate", p=w.precision)
                                    + " (`mixed_precision` default 'no')", *_accelerate_fsdp(w))),
    Recipe.LIGHTNING: RecipeSpec(
        Recipe.LIGHTNING, "Lightning 2.6.6, automatic optimization",
        "gradients freed by zero_grad, the loss returned from training_step", _lightning, (),
        lambda w: (_NOT_PRECISION.format(fw="lightning", p=w.precision) + " (Trainer `precision` default '32-true')",)),
    Recipe.TORCHTUNE: RecipeSpec(
        Recipe.TORCHTUNE, "torchtune 0.6.1, llama3_1 single-device configs",
        "pure bf16; full: paged 8-bit AdamW stepped in backward; LoRA: fused AdamW; chunked cross-entropy, "
        "activation checkpointing", _torchtune,
        (Restriction("checkpointing", (Checkpointing.NONE, Checkpointing.FULL),
                     "single-device recipes checkpoint whole layers (`enable_activation_checkpointing`)"),),
        lambda w: ()),
    Recipe.TORCHTITAN: RecipeSpec(
        Recipe.TORCHTITAN, "torchtitan main, llama3_8b.toml",
        "op-level selective checkpointing, fused AdamW, FSDP2 bf16 mixed precision, fp32 loss", _torchtitan,
        (Restriction("peft", (Peft.NONE,), "torchtitan pre-trains and fine-tunes all weights; it has no LoRA"),
         Restriction("loss", (Loss.FULL,), "its loss is `cross_entropy_loss` on fp32 logits (components/loss.py)")),
        _torchtitan_caveats),
    Recipe.DEEPSPEED: RecipeSpec(
        Recipe.DEEPSPEED, "DeepSpeed 0.19.8 engine", "ZeRO stage from the config (default 0), gradients set to None",
        _deepspeed, (Restriction("optimizer_in_backward", (False,),
                                 "the engine steps the optimizer in `engine.step()` after backward"),),
        _deepspeed_caveats),
    Recipe.UNSLOTH: RecipeSpec(
        Recipe.UNSLOTH, "Unsloth (main) on TRL's SFTTrainer",
        "offloaded gradient checkpointing, fused chunked cross-entropy, fused AdamW", _unsloth,
        (_NO_OPT_IN_BWD, _NO_OP_SAC_TRAINER),
        lambda w: (*_unsloth_caveats(w), _NOT_PRECISION.format(fw="unsloth", p=w.precision))),
}

