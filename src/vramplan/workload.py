"""The typed description of a job, validated up front.

A :class:`Workload` says *what* runs (task, shapes, precision, optimizer, memory savings,
quantisation, parallelism); it knows nothing of how memory is estimated. Checks that need
the model's shape (heads divisible by TP, layers by PP) live in :func:`check_against_model`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from dataclasses import field
from enum import Enum
from typing import Any, TypeVar

from vramplan._dataclass import dataclass

from .errors import WorkloadError


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return self.value


class Task(_StrEnum):
    TRAIN = "train"
    INFER = "infer"
    GENERATE = "generate"


class Precision(_StrEnum):
    FP32 = "fp32"
    FP16_MIXED = "fp16-mixed"  # fp32 master weights + autocast fp16
    BF16_MIXED = "bf16-mixed"  # fp32 master weights + autocast bf16
    BF16 = "bf16"  # pure bf16 weights, grads, optimizer states
    FP16 = "fp16"  # pure fp16


class Optimizer(_StrEnum):
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAMW_8BIT = "adamw-8bit"
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"
    ADAFACTOR = "adafactor"
    LION = "lion"


class OptimizerImpl(_StrEnum):
    FOREACH = "foreach"  # the default on CUDA: whole-list temporaries
    FUSED = "fused"
    FOR_LOOP = "for-loop"


class Checkpointing(_StrEnum):
    NONE = "none"
    FULL = "full"  # every layer (or every k-th: `checkpoint_every`)
    SELECTIVE = "selective"  # Megatron-style: attention core recomputed
    OP = "op"  # torchtitan's op-level selective AC (save list + every other matmul)


class Loss(_StrEnum):
    FULL = "full"  # transformers' ForCausalLMLoss: full-vocabulary logits upcast to fp32
    CHUNKED = "chunked"  # torchtune's CEWithChunkedOutputLoss: logits in `loss_chunks` chunks
    LIGER = "liger"  # Liger Kernel's fused linear + cross-entropy (chunked over tokens)
    CCE = "cce"  # Cut Cross-Entropy: logits never materialised
    TRL = "trl"  # TRL's fused LM head: log-probabilities in [4096 tokens, 32768 vocabulary] tiles


class Objective(_StrEnum):
    """What a training step optimises (``vramplan.trace.preference`` for the preference ones)."""

    SFT = "sft"  # next-token prediction: the model's loss (or `loss`'s implementation) on one batch
    DPO = "dpo"  # direct preference optimisation: chosen and rejected sequences, a frozen reference
    KTO = "kto"  # Kahneman-Tversky optimisation: unpaired labelled sequences, a KL batch, a reference
    GRPO = "grpo"  # group relative policy optimisation: a rollout (generate), then the policy-gradient step
    PPO = "ppo"  # PPO with a value model (critic): a rollout, the critic's values, its update, then the policy's


class Reference(_StrEnum):
    """Where the reference log-probabilities of a preference or RL objective come from."""

    AUTO = "auto"  # TRL's choice: DPO/KTO: the adapters disabled under PEFT, else a frozen copy; GRPO, PPO: none
    MODEL = "model"  # a frozen copy of the model in the policy's dtype (TRL `ref_model`)
    ADAPTERS = "adapters"  # the policy itself with its LoRA adapters disabled (no second model)
    PRECOMPUTED = "precomputed"  # read from the dataset (TRL `precompute_ref_log_probs=True`)
    NONE = "none"  # no reference: GRPO with TRL's default `beta=0.0` (no KL term)


class Rollout(_StrEnum):
    """What generates GRPO's completions (TRL ``use_vllm`` / ``vllm_mode``)."""

    HF = "hf"  # the policy's own `generate` in the trainer (TRL's default, use_vllm=False)
    VLLM = "vllm"  # a colocated vLLM engine in the trainer's process (use_vllm=True, vllm_mode="colocate")


def auto_checkpointing(peft: Peft | str, task: Task | str) -> Checkpointing:
    """``checkpointing=auto`` (the CLI's and the page's default): full for PEFT fine-tuning (TRL's
    ``SFTConfig`` turns ``gradient_checkpointing`` on, trl/trainer/base_config.py), none otherwise."""
    peft_on = as_enum(Peft, peft, "peft") is not Peft.NONE
    return Checkpointing.FULL if peft_on and as_enum(Task, task, "task") is Task.TRAIN else Checkpointing.NONE


TRL_TOKEN_TILE = 4096
"""``loss=trl``: tokens per tile, trl 1.16 trl/kernels/chunked_logprob.py ``TOKEN_CHUNK_SIZE``."""
TRL_VOCAB_TILE = 32768
"""``loss=trl``: vocabulary entries per tile, trl 1.16 trl/trainer/utils.py ``_CHUNKED_LOGPROB_CHUNK_SIZE``."""


class Recipe(_StrEnum):
    """A framework's training loop as a bundle of knob defaults (``vramplan.recipes``)."""

    PLAIN = "plain"  # vramplan's own loop: the Workload defaults
    HF_TRAINER = "hf-trainer"
    TRL_SFT = "trl-sft"
    TRL_DPO = "trl-dpo"
    TRL_KTO = "trl-kto"
    TRL_GRPO = "trl-grpo"
    VERL_GRPO = "verl-grpo"
    VERL_PPO = "verl-ppo"
    OPENRLHF_PPO = "openrlhf-ppo"
    OPENRLHF_GRPO = "openrlhf-grpo"
    ACCELERATE = "accelerate"
    LIGHTNING = "lightning"
    TORCHTUNE = "torchtune"
    TORCHTITAN = "torchtitan"
    DEEPSPEED = "deepspeed"
    UNSLOTH = "unsloth"


class DtypeChoice(_StrEnum):
    AUTO = "auto"
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class Peft(_StrEnum):
    NONE = "none"
    LORA = "lora"
    QLORA = "qlora"  # NF4 base weights with double quantisation + LoRA adapters


class Quant(_StrEnum):
    NONE = "none"
    INT8 = "int8"  # bitsandbytes LLM.int8 storage
    INT4 = "int4"  # bitsandbytes FP4 / generic 4-bit
    NF4 = "nf4"
    FP8 = "fp8"
    # other libraries' formats (inference; vramplan.quantformats holds what each one stores)
    AWQ = "awq"  # AutoAWQ GEMM, 4-bit, group 128
    GPTQ = "gptq"  # GPTQModel / auto-gptq ExLlamaV2, 4-bit, group 128
    HQQ = "hqq"  # hqq HQQLinear, 4-bit, group 64
    AO_INT4 = "ao-int4"  # torchao Int4WeightOnlyConfig
    AO_INT8 = "ao-int8"  # torchao Int8WeightOnlyConfig
    AO_INT8_DYN = "ao-int8-dyn"  # torchao Int8DynamicActivationInt8WeightConfig
    AO_FP8 = "ao-fp8"  # torchao Float8WeightOnlyConfig
    AO_FP8_DYN = "ao-fp8-dyn"  # torchao Float8DynamicActivationFloat8WeightConfig
    CT_W4A16 = "ct-w4a16"  # compressed-tensors (llm-compressor) checkpoints under transformers
    CT_W8A8 = "ct-w8a8"
    CT_FP8 = "ct-fp8"


BNB_QUANTS = frozenset({Quant.INT8, Quant.INT4, Quant.NF4})


class Float8(_StrEnum):
    """torchao float8 training recipes (``Float8LinearConfig.from_recipe_name``)."""

    NONE = "none"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_GW_HP = "rowwise-gw-hp"  # torchao's "rowwise_with_gw_hp"
    MXFP8 = "mxfp8"  # torchao's MXFP8Linear on every linear (torchtitan's quantize.linear.mx), sm100+


class Attention(_StrEnum):
    EAGER = "eager"
    SDPA = "sdpa"
    FLASH = "flash"


class CpuOffload(_StrEnum):
    """diffusers' offload of a whole pipeline's models to host RAM."""

    NONE = "none"  # pipe.to("cuda"): every model resident
    MODEL = "model"  # enable_model_cpu_offload: each model brought in for its call, the previous put back
    SEQUENTIAL = "sequential"  # enable_sequential_cpu_offload: each layer's weights brought in for its call


class KVDtype(_StrEnum):
    AUTO = "auto"  # the compute dtype
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"


class Engine(_StrEnum):
    AUTO = "auto"  # DDP without ZeRO; DeepSpeed accounting for ZeRO-1/2, FSDP for ZeRO-3
    DDP = "ddp"  # torch DistributedDataParallel (no sharding)
    FSDP = "fsdp"  # FSDP2 fully_shard (ZeRO-3 = reshard after forward, ZeRO-2 = keep gathered)
    FSDP1 = "fsdp1"  # FullyShardedDataParallel, flat parameters (ZeRO-3 FULL_SHARD, 2 SHARD_GRAD_OP, 0 NO_SHARD)
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO 1/2/3 with its bucket buffers and host RAM


class Fsdp1Prefetch(_StrEnum):
    """FSDP1's ``backward_prefetch`` (``torch.distributed.fsdp.BackwardPrefetch``)."""

    BACKWARD_PRE = "backward-pre"  # torch's default; `accelerate config`'s first choice; TRL's fsdp1.yaml
    BACKWARD_POST = "backward-post"
    NONE = "none"  # accelerate's plugin and Trainer's fsdp_config when the key is absent (NO_PREFETCH)

    @property
    def config_name(self) -> str:
        """The name torch's ``BackwardPrefetch`` and accelerate's / Trainer's FSDP configs use
        (``NO_PREFETCH`` for none: torch takes ``None``)."""
        return "NO_PREFETCH" if self is Fsdp1Prefetch.NONE else self.value.upper().replace("-", "_")


class Method(_StrEnum):
    AUTO = "auto"
    ANALYTIC = "analytic"
    TRACE = "trace"


class Phase(_StrEnum):
    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    PREFILL = "prefill"
    DECODE = "decode"


LORA_DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

BNB_VERSION = "0.50.2"
"""The newest bitsandbytes whose 8-bit optimizer storage was read (the default `bnb_version`)."""


def bnb_optim_block(version: str) -> int:
    """Elements per fp32 absmax of bitsandbytes' blockwise 8-bit optimizer states at ``version``:
    2,048 up to 0.43.x (``optim/optimizer.py`` ``Optimizer2State.init_state``, 0.43.3 L458-462,
    ``blocks = n // 2048``), 256 from 0.44.0 (L480-484, ``n // 256``; PR #1365 "Change 8bit
    optimizer blocksize 2048->256"), still 256 at 0.50.1 (L524-529, ``blocksize = 256``)."""
    parts = str(version).strip().split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise WorkloadError(f"`bnb_version` must be a bitsandbytes version such as 0.43.3, got {version!r}",
                            hint=f"e.g. `bnb_version=0.43.3` for a run before 0.44, default {BNB_VERSION}",
                            field="bnb_version") from None
    return 2048 if (major, minor) < (0, 44) else 256

ALL_LINEAR = "all-linear"

E = TypeVar("E", bound=Enum)


def as_enum(cls: type[E], value: Any, field: str) -> E:
    """Turn a user string into an enum member, or raise a one-line error listing choices.

    ``field`` is the name of the keyword or Workload field the value was given as."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).strip().lower())
    except ValueError:
        choices = " | ".join(str(m.value) for m in cls)  # type: ignore[attr-defined]
        raise WorkloadError(f"invalid `{field}` {value!r}", hint=f"choose one of {choices}", field=field) from None


PP_SCHEDULES: tuple[str, ...] = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                 "ZBVZeroBubble")
"""Pipeline schedules vramplan traces, spelled as ``torch.distributed.pipelining.schedules.
get_schedule_class`` spells them (torch 2.13); each needs its class in the installed torch."""
PP_LOOPED: tuple[str, ...] = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules with several stages per rank (``PipelineScheduleMulti``)."""
PP_V_SHAPED: tuple[str, ...] = ("ZBVZeroBubble",)
"""Two stages per rank laid out in a V: rank 0 holds the first and the last stage."""


def pp_schedule_name(value: Any) -> str:
    """A schedule name in torch's spelling (matched without case, as torch matches it)."""
    text = str(value).strip()
    for name in PP_SCHEDULES:
        if name.lower() == text.lower():
            return name
    raise WorkloadError(f"unknown pipeline schedule `pp_schedule={value!r}`", hint=f"choose one of {' | '.join(PP_SCHEDULES)}",
                        field="pp_schedule")


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """How the job is spread over GPUs. All sizes are counts of GPUs (ranks)."""

    dp: int = 1
    """Data-parallel size (number of model replicas / FSDP shards)."""
    zero: int = 0
    """ZeRO stage 0-3 (= FSDP NO_SHARD / SHARD_GRAD_OP(2) / FULL_SHARD(3); stage 1 shards optimizer states)."""
    tp: int = 1
    """Tensor-parallel size (Megatron-style column/row splits of attention and MLP)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    microbatches: int = 0
    """Micro-batches in flight on the first pipeline rank, overriding the analytic count (0 = as
    the `pp_schedule` runs a step's `grad_accum` micro-batches: pp under 1F1B)."""
    sp: bool = False
    """Megatron sequence parallelism (shards norm/dropout activations over the TP group)."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks, ring attention)."""
    ep: int = 1
    """Expert-parallel size for MoE models."""
    offload_optimizer: bool = False
    """Keep optimizer states (and fp32 master weights) in CPU memory."""
    offload_params: bool = False
    """Keep parameters in CPU memory, gathered per layer (ZeRO-3 / FSDP offload)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB (DistributedDataParallel's `bucket_cap_mb`; the first bucket is 1 MiB)."""
    gradient_as_bucket_view: bool = False
    """DDP gradients are views into its all-reduce buckets (no second copy of the gradients)."""
    dp_shard: int = 0
    """HSDP: ranks per shard group of the data-parallel ranks (0 = all of them, plain FSDP/ZeRO;
    8 = shard inside a node and replicate across nodes)."""
    engine: Engine = Engine.AUTO
    """Data-parallel engine: auto (DDP, DeepSpeed ZeRO-1/2, FSDP for ZeRO-3), ddp, fsdp (FSDP2),
    fsdp1 (``FullyShardedDataParallel``, what accelerate and HF Trainer run by default) or
    deepspeed (ZeRO buffers and host RAM as DeepSpeed allocates them)."""
    fsdp1_prefetch: Fsdp1Prefetch = Fsdp1Prefetch.BACKWARD_PRE
    """FSDP1's backward prefetch (`engine=fsdp1`): backward-pre gathers the next unit before the
    current one's gradient is computed (torch's default, one more unit gathered in the backward),
    backward-post after it, none waits (accelerate's and Trainer's default without a config key)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule as torch.distributed.pipelining names it: GPipe, 1F1B, Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble; a step's `grad_accum` micro-batches run through it."""
    pp_virtual: int = 0
    """Pipeline stages per rank of the looped schedules (Interleaved1F1B, LoopedBFS,
    InterleavedZeroBubble; 0 = 2, torchtitan's default; ZBVZeroBubble takes exactly 2); GPipe and 1F1B hold 1."""
    pp_first_less: int = 1
    """Decoder layers the first pipeline stage holds fewer, for its embeddings (torchtitan's
    `pipeline_parallel_first_stage_less_layers`, default 1; 0 with `pp_last_less=0` splits evenly)."""
    pp_last_less: int = 1
    """Decoder layers the last pipeline stage holds fewer, for its norm and head (torchtitan's
    `pipeline_parallel_last_stage_less_layers`, default 1)."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_cap_mb, bool) or not isinstance(self.bucket_cap_mb, (int, float)) \
                or not self.bucket_cap_mb > 0:
            raise WorkloadError(f"`bucket_cap_mb` must be a positive number of MiB, got {self.bucket_cap_mb!r}",
                                hint="DDP's default is 25", field="bucket_cap_mb")
        object.__setattr__(self, "engine", as_enum(Engine, self.engine, "engine"))
        object.__setattr__(self, "fsdp1_prefetch", as_enum(Fsdp1Prefetch, self.fsdp1_prefetch, "fsdp1_prefetch"))
        if not isinstance(self.dp_shard, int) or isinstance(self.dp_shard, bool) or self.dp_shard < 0:
            raise WorkloadError(f"`dp_shard` must be 0 (all data-parallel ranks) or a positive integer, "
                                f"got {self.dp_shard!r}", field="dp_shard")
        for name in ("dp", "tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkloadError(f"`{name}` must be a positive integer, got {v!r}", field=name)
        if self.zero not in (0, 1, 2, 3):
            raise WorkloadError(f"invalid ZeRO stage `zero={self.zero!r}`", hint="use 0, 1, 2 or 3", field="zero")
        if self.microbatches < 0:
            raise WorkloadError("`microbatches` must be >= 0 (0 means one per pipeline stage)", field="microbatches")
        if self.sp and self.tp == 1:
            raise WorkloadError("sequence parallelism needs tensor parallelism", hint="set `tp=2` or more, or drop `sp`",
                                field="sp")
        if self.offload_params and self.zero != 3:
            raise WorkloadError("parameter offload needs ZeRO stage 3 / FSDP FULL_SHARD", hint="set `zero=3`",
                                field="offload_params")
        if self.dp_shard:
            if self.dp % self.dp_shard:
                raise WorkloadError(f"`dp_shard={self.dp_shard}` does not divide `dp={self.dp}`",
                                    hint="dp = replicas × shard-group size: use a divisor of dp, or 0", field="dp_shard")
            if self.zero == 0:
                raise WorkloadError("`dp_shard` (HSDP) shards within groups of data-parallel ranks; "
                                    "with ZeRO stage 0 nothing is sharded", hint="set `zero=3` (or 2), or drop `dp_shard`",
                                    field="dp_shard")
            if self.engine is Engine.DEEPSPEED:
                raise WorkloadError("`dp_shard` (HSDP) is FSDP's hybrid sharding; DeepSpeed's counterpart "
                                    "(MiCS / hpZ) is not modelled", hint="use `engine=fsdp`, or drop `dp_shard`",
                                    field="dp_shard")
        if self.engine is Engine.DDP and self.zero:
            raise WorkloadError(f"DDP does not shard: `engine=ddp` with `zero={self.zero}`",
                                hint="use `engine=fsdp` or deepspeed, or `zero=0`", field="engine")
        if self.engine in (Engine.FSDP, Engine.FSDP1) and self.zero == 1:
            raise WorkloadError("FSDP has no ZeRO-1 (optimizer states only)",
                                hint="use `zero=2` (reshard_after_forward=False) or 3, or `engine=deepspeed`",
                                field="zero")
        if self.engine in (Engine.FSDP, Engine.FSDP1) and self.offload_optimizer and not self.offload_params:
            raise WorkloadError("FSDP's CPUOffloadPolicy offloads parameters, gradients and optimizer together",
                                hint="add `offload_params` (with `zero=3`), or use `engine=deepspeed`",
                                field="offload_optimizer")
        object.__setattr__(self, "pp_schedule", pp_schedule_name(self.pp_schedule))
        for name in ("pp_first_less", "pp_last_less"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise WorkloadError(f"`{name}` must be 0 or a positive number of layers, got {v!r}", field=name)
        if not isinstance(self.pp_virtual, int) or isinstance(self.pp_virtual, bool) or self.pp_virtual < 0:
            raise WorkloadError(f"`pp_virtual` must be 0 (the schedule's default) or a positive number of stages "
                                f"per rank, got {self.pp_virtual!r}", field="pp_virtual")
        looped = self.pp_schedule in PP_LOOPED
        if self.pp_virtual > 1 and not looped:
            raise WorkloadError(f"the {self.pp_schedule} schedule runs one stage per rank; `pp_virtual="
                                f"{self.pp_virtual}` needs a looped schedule",
                                hint=f"use `pp_schedule={PP_LOOPED[0]}`, or drop `pp_virtual`", field="pp_virtual")
        if self.pp_schedule in PP_V_SHAPED and self.pp_virtual not in (0, 2):
            raise WorkloadError(f"{self.pp_schedule} runs exactly 2 stages per rank (a V), not {self.pp_virtual}",
                                hint="drop `pp_virtual` (or set 2)", field="pp_virtual")
        if self.ep > 1 and self.dp % self.ep:
            raise WorkloadError(f"expert-parallel size {self.ep} must divide the data-parallel size {self.dp}",
                                hint=f"use `dp={self.ep}` or a multiple of it", field="ep")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def fsdp1_strategy(self) -> str:
        """FSDP1's ``ShardingStrategy`` for this layout: ZeRO-3 ``FULL_SHARD``, ZeRO-2
        ``SHARD_GRAD_OP``, 0 ``NO_SHARD``; under HSDP (``dp_shard``) ``HYBRID_SHARD`` /
        ``_HYBRID_SHARD_ZERO2``."""
        hybrid = 0 < self.dp_shard < self.dp
        if self.zero == 3:
            return "HYBRID_SHARD" if hybrid else "FULL_SHARD"
        if self.zero == 2:
            return "_HYBRID_SHARD_ZERO2" if hybrid else "SHARD_GRAD_OP"
        return "NO_SHARD"

    @property
    def shard_group(self) -> int:
        """Ranks that ZeRO/FSDP shards over: the shard group under HSDP, else every data-parallel
        rank — times the context-parallel ranks, which hold the same parameters (torchtitan shards
        over the flattened ``dp_shard × cp`` mesh, ``parallel_dims.py`` ``dp_shard_cp``)."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def framework(self) -> Engine:
        """The engine that runs this layout (``auto`` resolved)."""
        if self.engine is not Engine.AUTO:
            return self.engine
        if self.zero == 0:
            return Engine.DDP
        if self.zero in (1, 2) or (self.offload_optimizer and not self.offload_params):
            return Engine.DEEPSPEED
        return Engine.FSDP

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds (``pp_virtual`` resolved: 2 for the looped schedules)."""
        if self.pp_schedule not in PP_LOOPED:
            return 1
        return self.pp_virtual or 2

    def stage_bounds(self, layers: int) -> tuple[tuple[int, int], ...]:
        """[start, stop) of the decoder layers of each of the ``pp × stages_per_rank`` pipeline
        stages, as torchtitan splits a model (``generate_llm_fqn_per_model_part``,
        torchtitan/distributed/pipeline_parallel.py): the embeddings count as ``pp_first_less``
        layers and the norm and head as ``pp_last_less``; the effective layers are spread evenly,
        the remainder one each to the first stages; the first and last stages then hold that many
        decoder layers fewer. Raises where torchtitan raises."""
        stages = self.pp * self.stages_per_rank
        if stages == 1:
            return ((0, layers),)
        first, last = self.pp_first_less, self.pp_last_less
        effective = layers + first + last
        per, extra = divmod(effective, stages)
        if stages > effective or per == 0:
            raise WorkloadError(f"{stages} pipeline stages cannot be cut from {layers} layers (with the embeddings as "
                                f"{first} and the head as {last}: {effective} to share, torchtitan's rule)",
                                hint=f"use at most {effective} stages (`pp` × stages per rank)", field="pp")
        if first > per or last > per:
            raise WorkloadError(f"`pp_first_less={first}` / `pp_last_less={last}` exceed the {per} layers per stage "
                                f"of {stages} stages over {layers} layers (torchtitan refuses it)",
                                hint=f"use at most {per}", field="pp_first_less" if first > per else "pp_last_less")
        out = []
        lo = 0
        for i in range(stages):
            n = per + (i < extra) - (first if i == 0 else 0) - (last if i == stages - 1 else 0)
            hi = min(layers, lo + max(0, n))
            out.append((lo, hi))
            lo = hi
        return tuple(out)

    def pipeline_ranks(self) -> tuple[int, ...]:
        """The pipeline ranks whose memory bounds the others': the first (embeddings, the most
        micro-batches in flight), rank 1 (under torchtitan's split the middle stages hold the
        most layers, rank 1 the most of them and no fewer micro-batches in flight than the ranks
        after it, under every schedule) and the last (head, logits, loss)."""
        if self.pp == 1:
            return (0,)
        return (0, self.pp - 1) if self.pp == 2 else (0, 1, self.pp - 1)

    def stage_ids(self, rank: int) -> tuple[int, ...]:
        """The pipeline stages (of ``pp × stages_per_rank``) rank ``rank`` holds: torch's
        ``generate_stage_to_rank_mapping``, loop style (``rank, rank + pp, …``), or the V of
        ZBVZeroBubble (``rank`` and ``2 pp − 1 − rank``)."""
        if self.pp_schedule in PP_V_SHAPED:
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + k * self.pp for k in range(self.stages_per_rank))

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations are alive at once on the first rank under 1F1B
        (``microbatches``, else the pipeline's depth); other schedules: :func:`vramplan.analytic.
        parallel.chunks_in_flight`."""
        if self.pp == 1:
            return 1
        return self.microbatches or self.pp


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Everything that decides a job's GPU memory, apart from the model and the GPU."""

    task: Task = Task.TRAIN
    """What one step does: train (forward, backward, optimizer step), infer (forward) or
    generate (prefill, then one decode step per new token)."""
    batch: int = 1
    """Micro-batch size per GPU (per data-parallel rank)."""
    seq: int = 2048
    """Sequence length in tokens (for generate: the prompt length). Ignored for CNNs."""
    new_tokens: int = 0
    """Tokens generated after the prompt (task=generate, where 0 means 128)."""
    grad_accum: int = 1
    """Gradient accumulation steps (memory of one micro-batch; gradients kept across steps)."""
    precision: Precision = "auto"  # type: ignore[assignment]
    """Numeric precision; auto is bf16-mixed for training and bf16 for inference/generation
    (serving keeps no fp32 master weights)."""
    optimizer: Optimizer = Optimizer.ADAMW
    """Optimizer whose states are kept (8-bit ones are bitsandbytes')."""
    optimizer_impl: OptimizerImpl = OptimizerImpl.FOREACH
    """torch.optim implementation: foreach (the CUDA default, whole-list temporaries), fused or for-loop."""
    checkpointing: Checkpointing = Checkpointing.NONE
    """Activation checkpointing: none; full (each layer keeps its input and is recomputed);
    selective (Megatron-style: matmul and attention outputs kept, the rest recomputed); op
    (torchtitan's op-level SAC: its save list, every second matmul recomputed)."""
    checkpoint_fraction: float = 1.0
    """Fraction of layers checkpointed when checkpointing is on (1.0 = all)."""
    checkpoint_every: int = 1
    """Checkpoint every k-th layer, those whose 1-based index is a multiple of k (torchtitan's
    `selective_ac_option=k`; 1 = every layer)."""
    activation_offload: bool = False
    """Offload saved activations to CPU memory during forward (torchtune/Unsloth style);
    the host RAM they take is reported."""
    keep_grads: bool = False
    """Gradients survive between steps, zeroed in place (`zero_grad(set_to_none=False)`);
    by default they are freed after the optimizer step (`set_to_none=True`)."""
    keep_outputs: bool = False
    """The step's outputs (logits) stay alive through backward (a loop that holds `out`)."""
    loss: Loss = Loss.FULL
    """Loss implementation: full (transformers, fp32 full-vocabulary logits), chunked
    (torchtune's chunked cross-entropy), liger (fused linear + cross-entropy) or cce (Cut
    Cross-Entropy, logits never materialised); the last three for causal language models."""
    loss_chunks: int = 8
    """Chunks of the chunked cross-entropy (torchtune's `num_output_chunks`)."""
    objective: Objective = Objective.SFT
    """What training optimises: sft (the next-token loss), dpo (direct preference optimisation:
    `batch` pairs, each a chosen and a rejected sequence of `seq` tokens run as one batch of
    2 x `batch`, and a reference forward without gradients) or kto (`batch` labelled sequences,
    a KL batch of as many mismatched ones and the reference's forwards, without gradients) or
    grpo (a rollout: `batch` x `grad_accum` completions of `seq - prompt` tokens generated after
    `prompt` tokens, then `grad_accum` policy-gradient micro-steps of `batch` completions each)
    or ppo (the same rollout scored by a value model, a copy of the policy's backbone with a scalar
    head, trained in its own `grad_accum` micro-steps with its own gradients and optimizer states
    before the policy's); causal language models, as TRL's trainers (PPO: verl's and OpenRLHF's)
    run them."""
    prompt: int = 0
    """Tokens at the start of each sequence that are prompt, not scored by the preference
    objective's head (TRL scores the completion tokens only); 0: every position but the first,
    as if the completion filled the sequence (an upper bound). GRPO generates after it: at least 1."""
    generations: int = 8
    """GRPO's completions per prompt (TRL `num_generations`); the generation batch (`batch` x
    data-parallel ranks x `grad_accum`) must hold whole groups of them."""
    rollout: Rollout = Rollout.HF
    """What generates GRPO's completions: hf (the policy's own `generate`, TRL's default) or vllm
    (a colocated vLLM engine sharing the GPU: its budget is `vllm_memory` x the GPU's memory,
    its weights, KV cache and CUDA graphs beside the trainer's; needs a GPU)."""
    vllm_memory: float = 0.3
    """`rollout=vllm`: the fraction of the GPU's memory vLLM takes (TRL GRPOConfig
    `vllm_gpu_memory_utilization`, default 0.3)."""
    vllm_max_len: int = 0
    """`rollout=vllm`: vLLM's context length (TRL `vllm_max_model_length`); 0: the model's
    maximum positions, as vLLM infers it when TRL passes none (its KV pool must hold one such
    sequence, or vLLM refuses to start)."""
    vllm_sleep: bool = False
    """`rollout=vllm`: sleep mode (TRL `vllm_enable_sleep_mode`): vLLM's weights and KV cache are
    released after each generation (`sleep(level=2)`) and mapped again before the next."""
    reward_model: bool = False
    """`objective=grpo` or ppo: a frozen reward model (the policy's backbone with a scalar head, in
    16 bits: the compute dtype, bf16 under fp32, as verl and OpenRLHF load it) scores each completion under no_grad after the rollout (verl
    `reward_model.enable`, OpenRLHF `--reward.model_name_or_path`); False: rule-based rewards."""
    reference: Reference = Reference.AUTO
    """The objective's reference: auto (as TRL: DPO/KTO: the policy with adapters disabled under
    PEFT, else a frozen copy; GRPO, PPO: none, TRL's `beta=0.0`), model, adapters, precomputed
    (log-probabilities read from the dataset; DPO/KTO) or none (GRPO without a KL term)."""
    optimizer_in_backward: bool = False
    """The optimizer steps each parameter from its gradient hook during backward, and the
    gradient is freed right after (torchtune's `optimizer_in_bwd`; not with gradient
    accumulation or fp16-mixed)."""
    compile: bool = False
    """torch.compile each layer (torchtitan-style): the trace keeps what AOTAutograd's partitioner
    saves for backward; the analytic method counts eager activations."""
    peft: Peft = Peft.NONE
    """Parameter-efficient fine-tuning: LoRA adapters on frozen weights, or QLoRA (NF4 base)."""
    lora_rank: int = 16
    """Rank r of the LoRA adapters."""
    lora_targets: tuple[str, ...] = LORA_DEFAULT_TARGETS
    """Module names LoRA wraps (a tuple, or one comma-separated string); all-linear for every
    linear layer but the head."""
    lora_dora: bool = False
    """DoRA (peft's `use_dora`): a trainable magnitude per output feature of each adapted layer,
    and in every forward the weight-norm path (the adapted weight rebuilt and normed) and the
    base and adapter outputs it saves. Traced (peft's own code); the analytic method refuses it."""
    lora_rslora: bool = False
    """rsLoRA (peft's `use_rslora`): adapters scaled by alpha/sqrt(r) instead of alpha/r (no
    memory of its own)."""
    lora_modules_to_save: tuple[str, ...] = ()
    """Modules peft trains in full beside the adapters (`modules_to_save`, e.g. lm_head,
    embed_tokens, a classifier head): a trainable copy of each, with its gradients and optimizer
    states. Traced; the analytic method refuses it."""
    peft_base_dtype: DtypeChoice = DtypeChoice.AUTO
    """Storage dtype of the frozen base under LoRA (auto: the compute dtype; fp32 for a
    base loaded in fp32 and run under autocast)."""
    quant: Quant = Quant.NONE
    """Weight quantisation of the base model (inference, or the frozen base under PEFT)."""
    bnb_compute_dtype: DtypeChoice = DtypeChoice.AUTO
    """bitsandbytes 4-bit compute dtype (auto: the workload's compute dtype; transformers'
    `BitsAndBytesConfig` defaults to fp32)."""
    bnb_single_quant: bool = False
    """bitsandbytes 4-bit without double quantisation of the absmax constants (QLoRA uses
    double quantisation)."""
    bnb_version: str = BNB_VERSION
    """bitsandbytes version whose 8-bit AdamW state layout is modelled (`optimizer=adamw-8bit` /
    paged-adamw-8bit): from 0.44 an fp32 absmax per 256-element block, before it per 2,048
    (bitsandbytes PR #1365). Give the old version to reproduce a run of that time."""
    float8: Float8 = Float8.NONE
    """FP8 training: torchao's ``convert_to_float8_training`` with this recipe (its
    ``Float8Linear`` for each linear but the output head and those with a dimension not a
    multiple of 16, as torchtitan filters them); ``mxfp8``: torchao's ``MXFP8Linear`` on every
    linear, the head included (torchtitan's ``quantize.linear.mx``), sm100+ and bf16 only. Traced
    by running torchao itself (installed beside vramplan), on sm89+ GPUs; the analytic method
    refuses it."""
    float8_fsdp_all_gather: bool = False
    """torchao's ``enable_fsdp_float8_all_gather`` (tensorwise only): FSDP2 all-gathers the
    weights cast to fp8."""
    kv_dtype: KVDtype = KVDtype.AUTO
    """Storage dtype of the KV cache (auto: the compute dtype)."""
    attention: Attention = Attention.SDPA
    """Attention kernel: eager (materialised scores), sdpa (PyTorch's fused kernels) or flash."""
    parallel: Parallel = field(default_factory=Parallel)
    image_size: int = 224
    """Input resolution for vision models (pixels; for vision-language models the images' width,
    with ``image_height``: ``--image-size 1024x768``)."""
    image_height: int = 0
    """Height of the images of a vision-language model (0: square, ``image_size``)."""
    images: int = 0
    """Images per sequence for a vision-language model (Qwen2-VL, Qwen2.5-VL): each becomes the
    image tokens its processor makes, in front of ``seq`` text tokens."""
    videos: int = 0
    """Videos per sequence for Qwen2-VL / Qwen2.5-VL: each of ``video_frames`` frames of
    ``image_size`` × ``image_height`` pixels becomes the video tokens its video processor makes
    (after the images, in front of the ``seq`` text tokens)."""
    video_frames: int = 16
    """Frames of each video as given to the processor (already sampled; padded to an even count)."""
    freeze_vision: bool = False
    """Training a vision-language model: its vision tower (with the merger that projects image
    tokens into the language model) frozen, only the language model trained."""
    denoising_steps: int = 0
    """A diffusers pipeline's ``num_inference_steps`` (0: the pipeline's default, FLUX.1's 28,
    SDXL's 50); two are traced, the rest repeat them (the peak does not grow with steps)."""
    cpu_offload: CpuOffload = CpuOffload.NONE
    """A diffusers pipeline's offload: none (``pipe.to("cuda")``), model
    (``enable_model_cpu_offload``) or sequential (``enable_sequential_cpu_offload``); the weights
    wait in host RAM."""
    vae_tiling: bool = False
    """A diffusers pipeline's VAE decodes tile by tile (``pipe.vae.enable_tiling()``)."""
    frames: int = 0
    """Frames of the video a text-to-video pipeline makes (its ``num_frames``; 0: the pipeline's
    default, WanPipeline's 81). Wan rounds it as diffusers does: ``num_frames - 1`` a multiple of
    the VAE's temporal compression (4)."""
    routing_skew: float = 1.0
    """Traced data-dependent routing (MoE): the load of each expert relative to uniform
    routing (1.0: top-k of n experts sends k/n of the tokens to each; 1.25: every expert
    receives 1.25x that, as at a capacity factor of 1.25 with every expert full)."""
    recipe: Recipe = Recipe.PLAIN
    """Training framework whose loop defaults fill the knobs not given (hf-trainer, trl-sft, trl-dpo,
    trl-kto, trl-grpo, verl-grpo, verl-ppo, openrlhf-ppo, openrlhf-grpo, accelerate, lightning, torchtune,
    torchtitan, deepspeed, unsloth; plain: vramplan's own loop); explicit values win. `vramplan.recipes` cites each default's source."""

    @property
    def image_hw(self) -> tuple[int, int]:
        """(width, height) of a vision-language model's images."""
        return self.image_size, self.image_height or self.image_size

    def __post_init__(self) -> None:
        # Coerce strings to enums so that Workload(task="train") works.
        if isinstance(self.precision, str) and self.precision.strip().lower() == "auto":
            task = as_enum(Task, self.task, "task")
            object.__setattr__(self, "precision", Precision.BF16_MIXED if task is Task.TRAIN else Precision.BF16)
        for name, cls in (
            ("task", Task), ("precision", Precision), ("optimizer", Optimizer),
            ("optimizer_impl", OptimizerImpl), ("checkpointing", Checkpointing), ("peft", Peft),
            ("quant", Quant), ("kv_dtype", KVDtype), ("attention", Attention), ("loss", Loss),
            ("peft_base_dtype", DtypeChoice), ("bnb_compute_dtype", DtypeChoice), ("recipe", Recipe),
            ("float8", Float8), ("objective", Objective), ("reference", Reference),
            ("rollout", Rollout), ("cpu_offload", CpuOffload),
        ):
            object.__setattr__(self, name, as_enum(cls, getattr(self, name), name))
        for name in ("lora_targets", "lora_modules_to_save"):
            v = getattr(self, name)
            if isinstance(v, str):
                object.__setattr__(self, name, tuple(t.strip() for t in v.split(",") if t.strip()))
            elif not isinstance(v, tuple):
                object.__setattr__(self, name, tuple(v))
        for name in ("batch", "seq", "grad_accum", "lora_rank", "image_size", "checkpoint_every", "loss_chunks",
                     "generations"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkloadError(f"`{name}` must be a positive integer, got {v!r}", field=name)
        for name in ("images", "image_height", "videos", "denoising_steps", "frames"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise WorkloadError(f"`{name}` must be an integer >= 0, got {v!r}", field=name)
        if not isinstance(self.video_frames, int) or isinstance(self.video_frames, bool) or self.video_frames < 1:
            raise WorkloadError(f"`video_frames` must be a positive integer, got {self.video_frames!r}",
                                field="video_frames")
        if self.videos and self.objective in (Objective.GRPO, Objective.PPO, Objective.KTO, Objective.DPO):
            raise WorkloadError(f"`objective={self.objective}` with videos is not modelled: supervised training, "
                                "inference and generation take videos", hint="drop `videos`", field="videos")
        if self.images and self.objective in (Objective.GRPO, Objective.PPO, Objective.KTO):
            raise WorkloadError(f"`objective={self.objective}` with images is not modelled (GRPO's rollout makes its own "
                                "prompts; KTO's KL batch of mismatched pairs): DPO and supervised training take images",
                                hint="drop `images`, or use `objective=dpo`", field="images")
        if not isinstance(self.new_tokens, int) or self.new_tokens < 0:
            raise WorkloadError(f"`new_tokens` must be >= 0, got {self.new_tokens!r}", field="new_tokens")
        if not isinstance(self.prompt, int) or isinstance(self.prompt, bool) or not 0 <= self.prompt < self.seq:
            raise WorkloadError(f"`prompt` must be 0 or a number of tokens below `seq={self.seq}`, got {self.prompt!r}",
                                hint="the prompt and the completion share the sequence", field="prompt")
        if isinstance(self.routing_skew, bool) or not isinstance(self.routing_skew, (int, float)) \
                or not (1.0 <= float(self.routing_skew) <= 64.0):
            raise WorkloadError(f"`routing_skew` must be a number in [1, 64], got {self.routing_skew!r}",
                                hint="1.0 is uniform expert load; 1.25 gives every expert 25 % more tokens",
                                field="routing_skew")
        object.__setattr__(self, "routing_skew", float(self.routing_skew))
        if isinstance(self.vllm_memory, bool) or not isinstance(self.vllm_memory, (int, float)) \
                or not 0.0 < self.vllm_memory < 1.0:
            raise WorkloadError(f"`vllm_memory` is a fraction of the GPU's memory in (0, 1), got {self.vllm_memory!r}",
                                hint="TRL's default is 0.3", field="vllm_memory")
        if not isinstance(self.vllm_max_len, int) or isinstance(self.vllm_max_len, bool) or self.vllm_max_len < 0:
            raise WorkloadError(f"`vllm_max_len` must be 0 (the model's positions) or a number of tokens, got "
                                f"{self.vllm_max_len!r}", field="vllm_max_len")
        bnb_optim_block(self.bnb_version)  # validates the version
        if not (0.0 < self.checkpoint_fraction <= 1.0):
            raise WorkloadError(f"`checkpoint_fraction` must be in (0, 1], got {self.checkpoint_fraction!r}",
                                field="checkpoint_fraction")
        if self.task is Task.GENERATE and self.new_tokens == 0:
            object.__setattr__(self, "new_tokens", 128)
        if self.peft is Peft.QLORA:
            if self.precision is Precision.FP32:
                raise WorkloadError(
                    "QLoRA computes in 16-bit; fp32 is not a QLoRA setting",
                    hint="use `precision=bf16-mixed` (or bf16)", field="precision",
                )
            if self.quant not in (Quant.NONE, Quant.NF4):
                raise WorkloadError(f"QLoRA stores the base weights in NF4, not {self.quant}", hint="drop `quant`",
                                    field="quant")
            object.__setattr__(self, "quant", Quant.NF4)
        if self.lora_dora and self.peft is not Peft.NONE and self.quant is not Quant.NONE:
            raise WorkloadError(
                f"DoRA over {self.quant} base weights (QDoRA) is not modelled: peft dequantises the base weight "
                "with bitsandbytes in every forward, which the trace's own quantised layers do not emulate",
                hint="use `peft=lora` with `lora_dora`, or drop `lora_dora`", field="lora_dora")
        if self.peft is not Peft.NONE and self.task is not Task.TRAIN:
            raise WorkloadError("PEFT (LoRA/QLoRA) applies to training", hint="use `task=train`, or drop `peft`",
                                field="task")
        if self.objective is not Objective.SFT and self.task is not Task.TRAIN:
            raise WorkloadError(f"`objective={self.objective}` is a training objective",
                                hint="use `task=train`, or drop `objective`", field="objective")
        if self.rl:
            self._check_grpo()
        elif self.reference is Reference.NONE and self.objective is not Objective.SFT:
            raise WorkloadError(f"`objective={self.objective}` needs a reference (its loss compares with it)",
                                hint="use `reference=model`, adapters (with `peft=lora`) or precomputed",
                                field="reference")
        if self.reference is Reference.ADAPTERS and (self.objective is not Objective.SFT and self.peft is Peft.NONE):
            raise WorkloadError("`reference=adapters` disables the policy's adapters, and there are none",
                                hint="add `peft=lora`, or use `reference=model`", field="reference")
        if self.quant is not Quant.NONE and self.task is Task.TRAIN and self.peft is Peft.NONE:
            raise WorkloadError(
                f"full training of {self.quant}-quantised weights is not supported",
                hint="add `peft=lora` (QLoRA-style) or drop `quant`", field="quant",
            )
        if self.quant not in (Quant.NONE, Quant.FP8) and self.quant not in BNB_QUANTS \
                and self.precision is Precision.FP32:
            raise WorkloadError(f"{self.quant} models run in 16-bit (AWQ loads in fp16; the others' scales and kernels "
                                "take the model's 16-bit dtype)", hint="use `precision=bf16` (or fp16)", field="precision")
        if self.peft is not Peft.NONE and self.quant not in (Quant.NONE, Quant.FP8) and self.quant not in BNB_QUANTS:
            raise WorkloadError(
                f"LoRA over {self.quant} base weights is not modelled (the {self.quant} format is traced for "
                "inference: its library's backward through the quantised kernels is not emulated)",
                hint="use `peft=qlora` (NF4, bitsandbytes) for adapters over a 4-bit base, or `task=infer`",
                field="quant")
        if self.float8 is not Float8.NONE:
            self._check_float8()
        if self.optimizer_impl is OptimizerImpl.FUSED and self.optimizer not in (
            Optimizer.ADAM, Optimizer.ADAMW, Optimizer.SGD, Optimizer.SGD_MOMENTUM
        ):
            raise WorkloadError(f"torch has no fused {self.optimizer}", hint="use `optimizer_impl=foreach`",
                                field="optimizer_impl")
        if self.peft is not Peft.NONE and self.peft_base_dtype is not DtypeChoice.AUTO:
            self._check_peft_base_dtype()
        if self.optimizer_in_backward and self.task is Task.TRAIN:
            if self.grad_accum > 1:  # torchtune refuses it too (recipes: "Gradient accumulation is not supported")
                raise WorkloadError("the optimizer cannot step inside backward while gradients accumulate",
                                    hint="use `grad_accum=1` with `optimizer_in_backward`", field="grad_accum")
            if self.precision is Precision.FP16_MIXED:
                raise WorkloadError("fp16-mixed unscales all gradients before the step; the optimizer cannot step "
                                    "inside backward", hint="use `precision=bf16-mixed` with `optimizer_in_backward`",
                                    field="precision")
        if self.task is not Task.TRAIN:
            p = self.parallel
            if p.zero or p.offload_optimizer:
                raise WorkloadError("ZeRO stages and optimizer offload apply to training",
                                    hint="drop `zero` and `offload_optimizer`", field="zero")
        if self.precision in (Precision.FP16, Precision.BF16) and self.optimizer in (
            Optimizer.ADAMW_8BIT, Optimizer.PAGED_ADAMW_8BIT
        ):
            pass  # bitsandbytes supports 8-bit states on 16-bit params

    def _check_float8(self) -> None:
        if self.task is not Task.TRAIN:
            raise WorkloadError("`float8` is a training recipe (torchao's Float8Linear)",
                                hint="use `task=train`, or `quant=ao-fp8`/`ao-fp8-dyn` for fp8 inference", field="float8")
        if self.peft is not Peft.NONE or self.quant is not Quant.NONE:
            raise WorkloadError("`float8` trains the whole model in fp8 matmuls; with PEFT or quantised weights it is "
                                "not modelled", hint="drop `peft`/`quant`, or drop `float8`", field="float8")
        if self.parallel.tp > 1:
            raise WorkloadError("`float8` with tensor parallelism (torchao's Float8ColwiseParallel/RowwiseParallel) "
                                "is not modelled", hint="use `tp=1` (FSDP/DDP), or drop `float8`", field="float8")
        if self.float8_fsdp_all_gather and self.float8 is not Float8.TENSORWISE:
            raise WorkloadError("`float8_fsdp_all_gather` exists for the tensorwise recipe only (torchao asserts it)",
                                hint="use `float8=tensorwise`", field="float8_fsdp_all_gather")

    def _check_peft_base_dtype(self) -> None:
        base, p = self.peft_base_dtype, self.precision
        if p is Precision.FP32:
            if base is not DtypeChoice.FP32:
                raise WorkloadError(f"a {base} base cannot run fp32 matmuls without autocast",
                                    hint="use `precision=bf16-mixed` (or drop `peft_base_dtype`)", field="peft_base_dtype")
            return
        half = DtypeChoice.BF16 if p in (Precision.BF16, Precision.BF16_MIXED) else DtypeChoice.FP16
        if base is DtypeChoice.FP32 and not self.mixed:
            raise WorkloadError(f"an fp32 base under pure {p} has no autocast to run its matmuls in {half}",
                                hint=f"use `precision={half}-mixed` for an fp32 base", field="peft_base_dtype")
        if base not in (DtypeChoice.FP32, half):
            raise WorkloadError(f"a {base} base under {p}: the base is stored in the compute dtype or in fp32",
                                hint=f"use `peft_base_dtype={half}` or fp32", field="peft_base_dtype")

    # --- settings that do not apply -------------------------------------------------
    def setting_notes(self, given: Collection[str] = ()) -> tuple[str, ...]:
        """One sentence per setting that differs from its default but does not apply to this
        workload (the estimate ignores it), and for sizes beyond any real job. Contradictory
        pairs are errors in ``__post_init__``; these are not wrong, only without effect.

        ``given``: fields the user set explicitly (a command line's flags); they count as set
        even at their default value (``optimizer=adamw`` for inference is as ignored as sgd)."""
        notes: list[str] = []
        task, p = self.task, self.parallel

        def set_(name: str, default: object) -> bool:
            return name in given or getattr(self, name) != default

        if task is not Task.TRAIN:
            for name, default in (("optimizer", Optimizer.ADAMW), ("optimizer_impl", OptimizerImpl.FOREACH),
                                  ("checkpointing", Checkpointing.NONE), ("grad_accum", 1),
                                  ("checkpoint_every", 1), ("activation_offload", False), ("keep_grads", False),
                                  ("keep_outputs", False), ("optimizer_in_backward", False)):
                if set_(name, default):
                    notes.append(f"`{name}` applies to training; ignored for `task={task}`")
        if set_("new_tokens", 0) and task is not Task.GENERATE:
            notes.append(f"`new_tokens` applies to `task=generate`; ignored for `task={task}`")
        if set_("kv_dtype", KVDtype.AUTO) and task is not Task.GENERATE:
            notes.append(f"`kv_dtype` sets the KV cache of `task=generate`; ignored for `task={task}`")
        if self.peft is Peft.NONE:
            if set_("lora_rank", 16):
                notes.append("`lora_rank` applies with `peft=lora` or qlora; ignored without `peft`")
            if "lora_targets" in given or tuple(self.lora_targets) != LORA_DEFAULT_TARGETS:
                notes.append("`lora_targets` applies with `peft=lora` or qlora; ignored without `peft`")
            for name in ("lora_dora", "lora_rslora", "lora_modules_to_save"):
                if getattr(self, name):
                    notes.append(f"`{name}` applies with `peft=lora` or qlora; ignored without `peft`")
        if self.checkpointing is Checkpointing.NONE and self.checkpoint_fraction != 1.0:
            notes.append("`checkpoint_fraction` applies with `checkpointing`; ignored without it")
        if self.checkpointing is Checkpointing.NONE and self.checkpoint_every != 1:
            notes.append("`checkpoint_every` applies with `checkpointing`; ignored without it")
        if task is not Task.TRAIN and self.loss is not Loss.FULL:
            notes.append(f"`loss` applies to training; ignored for `task={task}`")
        if self.objective is Objective.SFT and (self.reference is not Reference.AUTO or self.prompt):
            notes.append("`reference` and `prompt` apply with `objective=dpo`, kto or grpo; ignored otherwise")
        if not self.rl and self.generations != 8:
            notes.append("`generations` applies with `objective=grpo` or ppo; ignored otherwise")
        if not self.rl and self.rollout is not Rollout.HF:
            notes.append("`rollout` applies with `objective=grpo` or ppo; ignored otherwise")
        if not self.rl and self.reward_model:
            notes.append("`reward_model` applies with `objective=grpo` or ppo; ignored otherwise")
        if self.rollout is not Rollout.VLLM and (self.vllm_memory != 0.3 or self.vllm_sleep or self.vllm_max_len):
            notes.append("`vllm_memory`, `vllm_max_len` and `vllm_sleep` apply with `rollout=vllm`; ignored otherwise")
        if self.objective is not Objective.SFT and self.loss not in (Loss.FULL, Loss.TRL):
            notes.append(f"`loss={self.loss}` is not {self.objective}'s: `objective={self.objective}` scores with "
                         "TRL's fused head (`loss=trl`)")
        if self.keep_grads and self.optimizer_in_backward and task is Task.TRAIN:
            notes.append("`keep_grads` has no effect with `optimizer_in_backward`: each gradient is freed by its "
                         "parameter's step inside backward")
        if self.loss is not Loss.CHUNKED and self.loss_chunks != 8:
            notes.append("`loss_chunks` applies with `loss=chunked`; ignored otherwise")
        if self.peft is Peft.NONE and self.peft_base_dtype is not DtypeChoice.AUTO:
            notes.append("`peft_base_dtype` applies with `peft=lora`; ignored without `peft`")
        if self.quant not in (Quant.INT4, Quant.NF4) and (
                self.bnb_compute_dtype is not DtypeChoice.AUTO or self.bnb_single_quant):
            notes.append("`bnb_compute_dtype` and `bnb_single_quant` apply to 4-bit quantisation "
                         "(`quant=nf4`/`int4`, or qlora); ignored otherwise")
        if set_("bnb_version", BNB_VERSION) and self.optimizer not in (Optimizer.ADAMW_8BIT,
                                                                        Optimizer.PAGED_ADAMW_8BIT):
            notes.append("`bnb_version` sets the state layout of `optimizer=adamw-8bit` / paged-adamw-8bit; "
                         "ignored otherwise")
        if self.float8_fsdp_all_gather and (self.float8 is Float8.NONE or p.dp == 1):
            notes.append("`float8_fsdp_all_gather` applies to float8 training under FSDP; ignored otherwise")
        if p.pp == 1 and (p.pp_first_less != 1 or p.pp_last_less != 1):
            notes.append("`pp_first_less` and `pp_last_less` apply to pipeline parallelism; ignored without `pp`")
        if p.pp == 1 and (p.pp_schedule != "1F1B" or p.pp_virtual):
            notes.append("`pp_schedule` and `pp_virtual` apply to pipeline parallelism; ignored without `pp` of 2 or more")
        if p.microbatches and p.pp == 1:
            notes.append("`microbatches` applies to pipeline parallelism; ignored without `pp` of 2 or more")
        if p.fsdp1_prefetch is not Fsdp1Prefetch.BACKWARD_PRE and (p.engine is not Engine.FSDP1 or p.dp == 1):
            notes.append("`fsdp1_prefetch` applies to FSDP1 (`engine=fsdp1` with `dp` of 2 or more); ignored otherwise")
        if p.engine is not Engine.AUTO and p.dp == 1:
            notes.append(f"`engine={p.engine}` runs data parallelism: with `dp=1` it changes nothing (add `dp=N`)")
        if p.dp_shard and p.dp_shard == p.dp:
            notes.append("`dp_shard` equal to `dp` is plain FSDP (one shard group): no replicas")
        if p.zero and p.dp == 1 and p.cp == 1:
            notes.append(f"ZeRO stage {p.zero} shards over data-parallel (and context-parallel) ranks: with `dp=1` "
                         "nothing is sharded (add `dp=N` for N GPUs)")
        if self.tokens > PLAUSIBLE_TOKENS:
            notes.append(f"a micro-batch of {self.tokens:,} tokens (batch {self.batch:,} x seq {self.seq:,}) is far "
                         f"beyond any real job (the largest published global batches are ~{PLAUSIBLE_TOKENS // 2**20}M "
                         "tokens): the figure is arithmetic, not a plan")
        return tuple(notes)

    # --- convenience ---------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.task is Task.TRAIN

    @property
    def checkpointed_share(self) -> float:
        """Share of the layers under checkpointing: ``checkpoint_fraction / checkpoint_every``
        (0 without checkpointing or outside training) — what recompute time scales with."""
        if self.checkpointing is Checkpointing.NONE or not self.training:
            return 0.0
        return self.checkpoint_fraction / self.checkpoint_every

    @property
    def mixed(self) -> bool:
        return self.precision in (Precision.FP16_MIXED, Precision.BF16_MIXED)

    def _check_grpo(self) -> None:
        if self.prompt < 1:
            raise WorkloadError(f"`objective={self.objective}` generates each completion after a prompt: `prompt` must be set",
                                hint=f"give `prompt=N` with N below `seq={self.seq}` (the completion is `seq - prompt`)",
                                field="prompt")
        if self.reference is Reference.PRECOMPUTED:
            raise WorkloadError("GRPO's reference scores completions generated during training: they cannot be "
                                "precomputed", hint="use `reference=none` (beta=0), model or adapters",
                                field="reference")
        if self.rollout is Rollout.VLLM:
            if self.vllm_max_len and self.vllm_max_len < self.seq:
                raise WorkloadError(f"`vllm_max_len={self.vllm_max_len}` is shorter than a prompt and its completion "
                                    f"(`seq={self.seq}`): vLLM would stop every completion early",
                                    hint=f"give `vllm_max_len` of {self.seq} or more (TRL: the longest prompt plus "
                                    "`max_completion_length`)", field="vllm_max_len")
            p = self.parallel
            if p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1:
                raise WorkloadError("`rollout=vllm` is modelled with data parallelism only (each rank its own "
                                    "colocated vLLM engine)", hint="use `rollout=hf`, or drop tp/pp/cp/ep",
                                    field="rollout")
        if self.objective is Objective.PPO:
            self._check_ppo()
            return
        gen = self.batch * self.parallel.dp * self.grad_accum
        if self.generations < 2 or gen % self.generations:
            raise WorkloadError(f"the generation batch ({self.batch} x {self.parallel.dp} ranks x {self.grad_accum} "
                                f"accumulation steps = {gen}) must hold whole groups of `generations={self.generations}` "
                                "completions, and GRPO needs at least 2 (TRL GRPOConfig.__post_init__)",
                                hint="make `batch` x `grad_accum` a multiple of `generations`", field="generations")

    def _check_ppo(self) -> None:
        p = self.parallel
        if p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1:
            raise WorkloadError("`objective=ppo` is modelled with data parallelism only (verl 0.7.0's FSDP workers: "
                                "the policy and the critic each sharded over the same ranks); the value model "
                                "split by tensor, pipeline, context or expert parallelism is not",
                                hint="drop tp/pp/cp/ep: `dp=N` with `zero=3` (FSDP)", field="objective")
        if p.dp > 1 and p.framework is not Engine.FSDP:
            how = {Engine.DDP: "DDP", Engine.FSDP1: "FSDP1 (`engine=fsdp1`: the policy's fused head through its "
                   "flat parameters is not checked)"}.get(p.framework, f"DeepSpeed ZeRO-{p.zero}")
            raise WorkloadError(f"`objective=ppo` over data-parallel ranks is modelled with FSDP2 (verl 0.7.0's "
                                f"workers shard the critic beside the policy); under {how} it is not",
                                hint="use `zero=3` (FSDP2, as verl's fsdp2 strategy shards)", field="zero")
        if p.offload_params or p.offload_optimizer:
            raise WorkloadError("`objective=ppo` with CPU offload is not modelled: the policy's and the critic's "
                                "shards on the host are not checked (verl moves each model's FSDP shards to the host "
                                "between its phases instead, `param_offload` / `optimizer_offload`, off by default)",
                                hint="drop `offload_params` / `offload_optimizer`", field="offload_params")
        if self.generations < 1 or (self.batch * self.grad_accum) % self.generations:
            raise WorkloadError(f"the generation batch ({self.batch} x {self.grad_accum} accumulation steps) must "
                                f"hold whole groups of `generations={self.generations}` completions",
                                hint="make `batch` x `grad_accum` a multiple of `generations` (PPO's default is 1)",
                                field="generations")

    @property
    def rl(self) -> bool:
        """Whether the objective generates its own completions (grpo, ppo)."""
        return self.objective in (Objective.GRPO, Objective.PPO)

    @property
    def batch_step(self) -> int:
        """The smallest valid change of ``batch`` (GRPO: the generation batch holds whole groups
        of ``generations``; 1 otherwise)."""
        if not self.rl:
            return 1
        import math

        return self.generations // math.gcd(self.generations, self.parallel.dp * self.grad_accum)

    @property
    def completion(self) -> int:
        """Tokens a GRPO rollout generates per completion (``seq - prompt``)."""
        return self.seq - self.prompt

    @property
    def sequences(self) -> int:
        """Sequences the model runs per micro-batch: ``batch``, or twice it for DPO (each pair's
        chosen and rejected sequences concatenated into one batch, as TRL does)."""
        return 2 * self.batch if self.objective is Objective.DPO else self.batch

    @property
    def reference_source(self) -> Reference:
        """The preference objective's reference with ``auto`` resolved as TRL resolves it (adapters
        under PEFT)."""
        if self.reference is not Reference.AUTO:
            return self.reference
        if self.rl:
            return Reference.NONE  # (GRPOConfig `beta=0.0`: "the reference model is not needed")
        return Reference.ADAPTERS if self.peft is not Peft.NONE else Reference.MODEL

    def check_reference_model(self, *, traced: bool = False) -> None:
        """Refuse what the method does not model: a preference objective's frozen reference copy
        under parallelism (frameworks prepare and shard it with the policy) or quantisation.
        ``traced``: the trace's question, which lays the reference out as TRL 1.16.0 does under
        ZeRO-3 and ZeRO-2 with FSDP1 or FSDP2 (:func:`vramplan.trace.layout.apply_reference_layout`)
        and under DDP (a replica per rank); the analytic method models FSDP2's and DDP's
        (docs/research/trl-reference-fsdp.md)."""
        p = self.parallel
        if self.objective is Objective.SFT or self.reference_source is not Reference.MODEL:
            return
        # (ZeRO-2: FSDP2's `reshard_after_forward=False`, FSDP1's SHARD_GRAD_OP: the accelerate plugin's setting, which
        # prepare_fsdp passes to the reference too)
        fsdp = p.zero == 3 and p.engine.value in ("auto", "fsdp", "fsdp1") or p.zero == 2 and p.engine.value in ("fsdp", "fsdp1")
        plain = not (p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1 or self.quant is not Quant.NONE)
        trl = self.objective in (Objective.DPO, Objective.KTO, Objective.GRPO)  # (PPO's stack is verl's)
        offload = p.offload_params or p.offload_optimizer
        if trl and plain and p.dp > 1 and p.framework is Engine.DDP and not offload:
            return  # (TRL: `accelerator.prepare_model(ref, evaluation_mode=True)`: no DDP wrapper, a replica per rank)
        sharded = trl and plain and p.dp > 1 and fsdp and not (offload or p.dp_shard)
        if sharded and (traced or p.engine.value != "fsdp1"):
            return  # (the analytic method: FSDP2's one unit over the whole reference, analytic/estimate.py, grpo.py)
        if p.dp > 1 or p.tp > 1 or p.pp > 1 or p.cp > 1 or self.quant is not Quant.NONE:
            # (TRL 1.16.0 wraps it as it wraps the policy: `prepare_fsdp`, trl/models/utils.py:292-342,
            # called from dpo_trainer.py:984-990 and grpo_trainer.py:1182-1188)
            if not trl:
                why = ("PPO's reference is verl's own FSDP worker, whose layout is not traced")
                hint = "use `reference=none` (beta=0), or `dp=1`"
            elif plain and p.dp > 1 and p.framework is Engine.DEEPSPEED:
                why = ("under DeepSpeed TRL prepares it with `prepare_deepspeed` (trl/models/utils.py:246-289: "
                       f"ZeRO-1/2 a stage-0 engine, a whole replica cast to the engine's 16-bit dtype; ZeRO-3 a "
                       f"ZeRO-3 engine sharding it); the trace runs no DeepSpeed engine (the policy's `zero={p.zero}` "
                       "is not traced either) and the analytic method does not model the reference beside it")
                hint = "use `zero=0` (DDP), `zero=3` with `engine=fsdp` or `engine=fsdp1`, `reference=adapters` " \
                       "with `peft=lora`, or `reference=precomputed`"
            elif not sharded:
                why = ("only DDP's replica and its ZeRO-3 and ZeRO-2 layouts with FSDP1 or FSDP2 over one data-parallel "
                       "group, without CPU offload, are traced (TRL's `prepare_model(evaluation_mode=True)` and "
                       "`prepare_fsdp`; DeepSpeed's engine is not)")
                hint = "use `zero=0` (DDP), `zero=3` or `zero=2` with `engine=fsdp` or `engine=fsdp1`, " \
                       "`reference=adapters` with `peft=lora`, or `reference=precomputed`"
            else:  # (FSDP1's units: the trace lays them out, the analytic method has FSDP2's formulas)
                why = ("the analytic method models it under DDP (a replica) and FSDP2 (TRL shards it with its own FSDP "
                       "unit and gathers it for its forward); under FSDP1 the trace does")
                hint = "use `method=trace`, `reference=adapters` with `peft=lora`, or `reference=precomputed`"
            raise WorkloadError(f"a preference reference model under data or model parallelism or quantisation: {why}",
                                hint=hint, field="reference")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def replace(self, **changes: Any) -> Workload:
        """A copy with some fields changed (validated again)."""
        if "parallel" not in changes:
            pchanges = {k: changes.pop(k) for k in list(changes) if k in _PARALLEL_FIELDS}
            if pchanges:
                changes["parallel"] = dataclasses.replace(self.parallel, **pchanges)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        from ._json import jsonable

        return dict(jsonable(d))


PLAUSIBLE_TOKENS = 1 << 24
"""16 Mi tokens: about the largest global batch published for LLM pretraining (Llama 3: 16M
tokens per step, arXiv 2407.21783 §3.4.1); one GPU's micro-batch beyond it is a typo."""

_PARALLEL_FIELDS = {f.name for f in dataclasses.fields(Parallel)}


def _plain(x: Any) -> Any:
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source), one line each.

    These are the one description of a field: the CLI's ``--help`` is built from them. The
    module's source is parsed once per process (``inspect.getsource`` tokenizes the file on
    every call: ~10 ms each, and every subcommand's parser asks twice)."""
    return dict(_module_field_docs(cls.__module__).get(cls.__qualname__, {}))


@functools.cache
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """Class name → field → docstring for every top-level class of ``module``."""
    import ast
    import sys

    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:  # pragma: no cover - source not shipped
        return {}
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: dict[str, dict[str, str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        docs = out.setdefault(cls.name, {})
        for node, nxt in zip(cls.body, cls.body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return out
