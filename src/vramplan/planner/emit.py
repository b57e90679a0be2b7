"""What a user pastes to run a plan: DeepSpeed JSON, Accelerate YAML, an FSDP2 snippet,
HF ``TrainingArguments``, or the ``PYTORCH_CUDA_ALLOC_CONF`` line.

Pure text generation from a :class:`Plan`; nothing here imports the libraries named.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vramplan.analytic.deepspeed import DEFAULTS as DS_DEFAULTS
from vramplan.errors import PlanError
from vramplan.models.shape import tokens
from vramplan.units import GiB
from vramplan.workload import (
    PP_LOOPED,
    Checkpointing,
    Engine,
    Optimizer,
    OptimizerImpl,
    Peft,
    Precision,
    Workload,
)

from .results import Plan
from .space import GPUS_PER_NODE

FORMATS = ("deepspeed", "accelerate", "fsdp", "torchtitan", "trainer", "alloc-conf")
FRAGMENTATION_ADVICE = 0.05
"""Recommend expandable segments above this predicted fragmentation (1 − allocated/reserved)."""
TIGHT_FIT = 0.10
"""…or when the headroom is below this share of the usable memory."""


@dataclass(frozen=True)
class Emitted:
    format: str
    text: str
    filename: str
    """A suggested file name (``ds_config.json``)."""
    notes: tuple[str, ...] = ()
    """Things the text itself cannot say (JSON has no comments)."""


def emit(plan: Plan, fmt: str) -> Emitted:
    """Runnable configuration for ``plan`` in ``fmt`` (one of :data:`FORMATS`)."""
    makers = {"deepspeed": deepspeed, "accelerate": accelerate, "fsdp": fsdp, "trainer": trainer,
              "alloc-conf": alloc_conf, "torchtitan": torchtitan}
    if fmt not in makers:
        raise PlanError(f"unknown `emit` format {fmt!r}", hint=f"choose one of {', '.join(FORMATS)}")
    if fmt != "alloc-conf" and not plan.workload.training:
        raise PlanError(f"`emit={fmt}` writes a training configuration; this plan is for `task={plan.workload.task}`",
                        hint="use `emit=alloc-conf`, or `task=train`", field="emit")
    out = makers[fmt](plan)
    w = plan.workload
    if fmt != "alloc-conf" and w.float8.value != "none":
        gather = " with the FSDP float8 all-gather" if w.float8_fsdp_all_gather else ""
        how = ("torchao's MXFP8Linear on every linear (torchtitan's quantize.linear.mx converter)"
               if w.float8.value == "mxfp8" else
               "torchao's convert_to_float8_training (Float8LinearConfig.from_recipe_name) or torchtitan's float8 "
               "model converter")
        out = dataclasses.replace(out, notes=(*out.notes, (
            f"float8 training ({w.float8}{gather}) is not written: convert the model with {how}, as the estimate did")))
    return out


def _model_parallel_note(p: Any, where: str) -> str:
    """What a data-parallel config cannot say about the plan's model parallelism."""
    parts = [f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1]
    if p.pp > 1:
        parts.append(f"the {p.pp_schedule} pipeline schedule" + (f" ({p.stages_per_rank} stages per rank)"
                                                                 if p.stages_per_rank > 1 else ""))
    return f"{', '.join(parts)}: tensor / pipeline / context parallelism are not in {where}: see `emit=torchtitan`"


def backend(w: Workload) -> str:
    """none | ddp | deepspeed | fsdp: the framework the plan was predicted for (``engine``, or
    the one that runs this sharding best)."""
    p = w.parallel
    if p.zero == 0 and p.dp == 1 and p.engine is Engine.AUTO:
        return "none"
    return p.framework.value


def _nodes(n: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for ``n`` GPUs on nodes of 8."""
    return (1, n) if n <= GPUS_PER_NODE else (math.ceil(n / GPUS_PER_NODE), GPUS_PER_NODE)


def _header(plan: Plan) -> str:
    return (f"vramplan plan: {plan.label} on {plan.num_gpus}× {plan.gpu} "
            f"({plan.memory / GiB:.1f} GiB per GPU predicted)")


# ------------------------------------------------------------------------------ DeepSpeed
def deepspeed_config(plan: Plan) -> dict[str, Any]:
    w = plan.workload
    p = w.parallel
    cfg: dict[str, Any] = {
        "train_batch_size": tokens(w).global_batch,
        "train_micro_batch_size_per_gpu": w.batch,
        "gradient_accumulation_steps": w.grad_accum,
        "gradient_clipping": 1.0,
    }
    if w.precision in (Precision.BF16_MIXED, Precision.BF16):
        cfg["bf16"] = {"enabled": True}
    elif w.precision in (Precision.FP16_MIXED, Precision.FP16):
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    # DeepSpeed's own sizes, written out: the prediction assumed them (analytic/deepspeed.py)
    ds_ = DS_DEFAULTS
    zero: dict[str, Any] = {"stage": p.zero, "overlap_comm": ds_.overlap(p.zero),
                            "contiguous_gradients": ds_.contiguous_gradients,
                            "reduce_bucket_size": ds_.reduce_bucket_size, "allgather_bucket_size": ds_.allgather_bucket_size}
    if p.zero == 3:
        zero.update({"stage3_prefetch_bucket_size": ds_.prefetch_bucket_size,
                     "stage3_max_live_parameters": ds_.max_live_parameters,
                     "stage3_param_persistence_threshold": ds_.param_persistence_threshold,
                     "sub_group_size": ds_.sub_group_size})
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if p.zero == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    cfg["zero_optimization"] = zero
    ds_opt = {Optimizer.ADAMW: "AdamW", Optimizer.ADAM: "Adam"}.get(w.optimizer)
    if ds_opt:
        cfg["optimizer"] = {"type": ds_opt, "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                       "weight_decay": 0.01 if ds_opt == "AdamW" else 0.0}}
    elif w.optimizer in _TORCH_OPTIMIZERS and not p.offload_optimizer:  # offload needs DeepSpeed's CPU Adam
        # DeepSpeed builds any other type by name from torch.optim
        # (DeepSpeedEngine._configure_basic_optimizer: getattr(torch.optim, self.optimizer_name()))
        name, params = _TORCH_OPTIMIZERS[w.optimizer]
        cfg["optimizer"] = {"type": name, "params": params}
    cfg["wall_clock_breakdown"] = False
    return cfg


_TORCH_OPTIMIZERS: dict[Optimizer, tuple[str, dict[str, Any]]] = {
    Optimizer.SGD: ("SGD", {"lr": 1e-3}),
    Optimizer.SGD_MOMENTUM: ("SGD", {"lr": 1e-3, "momentum": 0.9}),
    Optimizer.ADAFACTOR: ("Adafactor", {"lr": 1e-2}),  # torch.optim.Adafactor, torch >= 2.5
}


def deepspeed(plan: Plan) -> Emitted:
    w = plan.workload
    notes = [_header(plan)]
    if w.precision in (Precision.BF16, Precision.FP16):
        notes.append(f"DeepSpeed keeps fp32 master weights: this config runs {w.precision}-mixed, not the pure "
                     f"{w.precision} the plan was predicted for")
    if backend(w) not in ("deepspeed", "none"):
        notes.append(f"this plan was predicted for {backend(w)}; DeepSpeed's buffers differ (re-plan with "
                     "`engine=deepspeed` for its figure)")
    if w.parallel.tp * w.parallel.pp * w.parallel.cp > 1:
        notes.append(_model_parallel_note(w.parallel, "a DeepSpeed JSON"))
    if w.optimizer in _TORCH_OPTIMIZERS and not w.parallel.offload_optimizer:
        notes.append(f"optimizer {w.optimizer}: DeepSpeed builds torch.optim.{_TORCH_OPTIMIZERS[w.optimizer][0]} "
                     "by name (Adafactor needs torch >= 2.5); set its lr in the JSON")
    elif w.optimizer not in (Optimizer.ADAMW, Optimizer.ADAM):
        notes.append(f"DeepSpeed has no built-in {w.optimizer}: create it in your script and pass "
                     "optimizer=... to deepspeed.initialize (the JSON has no optimizer block)")
    if w.checkpointing is not Checkpointing.NONE:
        notes.append("activation checkpointing is set on the model, not in this JSON: "
                     "model.gradient_checkpointing_enable() (HF) or torch.utils.checkpoint")
    if w.parallel.zero == 0 and w.parallel.dp > 1:
        notes.append("ZeRO stage 0 is plain data parallelism (DDP)")
    text = json.dumps(deepspeed_config(plan), indent=2) + "\n"
    return Emitted("deepspeed", text, "ds_config.json", tuple(notes))


# ------------------------------------------------------------------------------ Accelerate
def accelerate_config(plan: Plan) -> dict[str, Any]:
    w = plan.workload
    p = w.parallel
    kind = backend(w)
    n = plan.num_gpus
    machines = _nodes(n)[0]
    mixed = {Precision.BF16_MIXED: "bf16", Precision.BF16: "bf16", Precision.FP16_MIXED: "fp16",
             Precision.FP16: "fp16"}.get(w.precision, "no")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False,
        "distributed_type": {"none": "NO", "ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP",
                             "fsdp1": "FSDP"}[kind],
        "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main",
        "mixed_precision": mixed, "num_machines": machines, "num_processes": n,
        "rdzv_backend": "static", "same_network": True, "use_cpu": False,
    }
    if kind == "deepspeed":
        cfg["deepspeed_config"] = {
            "gradient_accumulation_steps": w.grad_accum, "gradient_clipping": 1.0,
            "offload_optimizer_device": "cpu" if p.offload_optimizer else "none",
            "offload_param_device": "cpu" if p.offload_params else "none",
            "zero3_init_flag": p.zero == 3, "zero3_save_16bit_model": p.zero == 3, "zero_stage": p.zero,
        }
    elif kind == "fsdp":
        cfg["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": w.checkpointing is not Checkpointing.NONE,
            "fsdp_cpu_ram_efficient_loading": True, "fsdp_offload_params": p.offload_params,
            "fsdp_reshard_after_forward": p.zero == 3, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
    elif kind == "fsdp1":  # what the trace ran (trace/layout.py _fsdp1)
        cfg["fsdp_config"] = {
            "fsdp_version": 1, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_activation_checkpointing": w.checkpointing is not Checkpointing.NONE,
            "fsdp_backward_prefetch": p.fsdp1_prefetch.config_name, "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_forward_prefetch": False, "fsdp_offload_params": p.offload_params,
            "fsdp_sharding_strategy": p.fsdp1_strategy, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_sync_module_states": True, "fsdp_use_orig_params": True,
        }
    return cfg


def n_per_machine(n: int) -> int:
    """Processes per machine when ``n`` GPUs are laid on nodes of 8."""
    return _nodes(n)[1]


def accelerate(plan: Plan) -> Emitted:
    text = f"# {_header(plan)}\n# accelerate launch --config_file accelerate.yaml train.py\n"
    text += to_yaml(accelerate_config(plan))
    notes = [f"micro-batch {plan.workload.batch} per GPU, gradient accumulation {plan.workload.grad_accum}: "
             "set them in your script / TrainingArguments"]
    p = plan.workload.parallel
    if p.tp * p.pp * p.cp > 1:
        notes.append(_model_parallel_note(p, "an Accelerate config"))
    if p.dp_shard and backend(plan.workload) != "fsdp1":
        notes.append("HSDP: set fsdp_sharding_strategy HYBRID_SHARD (FSDP1) or a 2-D mesh (see `emit=fsdp`)")
    elif p.dp_shard and p.dp_shard != n_per_machine(plan.num_gpus):
        notes.append(f"FSDP1's {p.fsdp1_strategy} shards within each machine ({n_per_machine(plan.num_gpus)} "
                     f"processes), not in groups of dp_shard={p.dp_shard}")
    return Emitted("accelerate", text, "accelerate.yaml", tuple(notes))


def to_yaml(d: Mapping[str, Any], indent: int = 0) -> str:
    """Block YAML for nested mappings of scalars (what Accelerate configs use)."""
    out = []
    pad = "  " * indent
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.append(f"{pad}{k}:\n" + to_yaml(v, indent + 1).rstrip("\n"))
        else:
            out.append(f"{pad}{k}: {_scalar(v)}")
    return "\n".join(out) + "\n"


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    plain = s and s.replace("_", "").replace("-", "").replace(".", "").isalnum() and s.lower() not in (
        "true", "false", "yes", "no", "null", "on", "off")
    return s if plain else json.dumps(s)


# ------------------------------------------------------------------------------ FSDP2
_DTYPE = {Precision.BF16_MIXED: "torch.bfloat16", Precision.BF16: "torch.bfloat16",
          Precision.FP16_MIXED: "torch.float16", Precision.FP16: "torch.float16"}


def _optimizer_line(w: Workload) -> tuple[list[str], str]:
    fused = ", fused=True" if w.optimizer_impl is OptimizerImpl.FUSED else ""
    lines = {
        Optimizer.ADAMW: ([], f"torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01{fused})"),
        Optimizer.ADAM: ([], f"torch.optim.Adam(params, lr=1e-4{fused})"),
        Optimizer.SGD: ([], f"torch.optim.SGD(params, lr=1e-2{fused})"),
        Optimizer.SGD_MOMENTUM: ([], f"torch.optim.SGD(params, lr=1e-2, momentum=0.9{fused})"),
        Optimizer.ADAFACTOR: ([], "torch.optim.Adafactor(params, lr=1e-2)"),
        Optimizer.ADAMW_8BIT: (["import bitsandbytes as bnb"], "bnb.optim.AdamW8bit(params, lr=1e-4)"),
        Optimizer.PAGED_ADAMW_8BIT: (["import bitsandbytes as bnb"], "bnb.optim.PagedAdamW8bit(params, lr=1e-4)"),
        Optimizer.LION: (["import bitsandbytes as bnb"], "bnb.optim.Lion(params, lr=1e-4)"),
    }
    return lines[w.optimizer]


def fsdp(plan: Plan) -> Emitted:
    w = plan.workload
    p = w.parallel
    imports, opt = _optimizer_line(w)
    dtype = _DTYPE.get(w.precision)
    reduce = "torch.float32" if w.mixed else (dtype or "torch.float32")
    every = max(1, round(1 / w.checkpoint_fraction)) if w.checkpointing is not Checkpointing.NONE else 0
    notes = [_header(plan)]
    if p.zero in (1, 2):
        notes.append("FSDP2 has no ZeRO-1; reshard_after_forward=False is its ZeRO-2 (SHARD_GRAD_OP)")
    if backend(w) not in ("fsdp", "none", "ddp"):
        notes.append(f"this plan was predicted for {backend(w)}; FSDP's buffers differ (re-plan with "
                     "`engine=fsdp` for its figure)")
    if p.tp * p.pp * p.cp > 1:
        notes.append(_model_parallel_note(w.parallel, "this snippet"))
    if p.offload_optimizer and not p.offload_params:
        notes.append("FSDP's CPUOffloadPolicy offloads parameters, gradients and optimizer together; "
                     "DeepSpeed (`emit=deepspeed`) offloads the optimizer alone")
    src = [
        f'"""{_header(plan)}',
        "",
        f"Launch: torchrun --nnodes {_nodes(plan.num_gpus)[0]} --nproc_per_node {_nodes(plan.num_gpus)[1]} "
        f"train.py  (micro-batch {w.batch}, gradient accumulation {w.grad_accum})",
        '"""',
        "from functools import partial",
        "",
        "import torch",
        "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper",
        "from torch.distributed.device_mesh import init_device_mesh",
        "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard",
        "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
        *imports,
        "",
        f"MICRO_BATCH = {w.batch}",
        f"GRAD_ACCUM = {w.grad_accum}",
        *([f"REPLICATE, SHARD = {p.dp // p.dp_shard}, {p.dp_shard}  # HSDP: shard inside a node, replicate across"]
          if p.dp_shard else []),
        "",
        "",
        "def _save_matmuls(ctx, op, *args, **kwargs):",
        "    # selective checkpointing: keep matmul outputs, recompute the cheap elementwise ops",
        "    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):",
        "        return CheckpointPolicy.MUST_SAVE",
        "    return CheckpointPolicy.PREFER_RECOMPUTE",
        "",
        "",
        "def shard(model: torch.nn.Module, layers: torch.nn.ModuleList) -> torch.nn.Module:",
        '    """Checkpoint and shard each transformer block, then the root (e.g. layers = model.model.layers)."""',
        f"    mp = MixedPrecisionPolicy(param_dtype={dtype or 'None'}, reduce_dtype={reduce})",
        "    kwargs = dict(mp_policy=mp, reshard_after_forward=" + ("True" if p.zero == 3 or p.zero == 0 else "False") + ")",
    ]
    if p.offload_params or p.offload_optimizer:
        src.append("    kwargs['offload_policy'] = CPUOffloadPolicy(pin_memory=True)")
    if p.dp_shard:
        src.append('    kwargs["mesh"] = init_device_mesh("cuda", (REPLICATE, SHARD), '
                   'mesh_dim_names=("dp_replicate", "dp_shard"))')
    src += ["    for i, block in enumerate(layers):"]
    if every:
        wrap = ("checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))"
                if w.checkpointing is Checkpointing.SELECTIVE else "checkpoint_wrapper(block)")
        if every == 1:
            src += [f"        block = {wrap}", "        layers[i] = block"]
        else:
            src += [f"        if i % {every} == 0:  # checkpoint 1 block in {every}",
                    f"            block = {wrap}", "            layers[i] = block"]
    src += [
        "        fully_shard(block, **kwargs)",
        "    fully_shard(model, **kwargs)",
        "    return model",
        "",
        "",
        "def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:",
        "    params = [p for p in model.parameters() if p.requires_grad]",
        f"    return {opt}",
    ]
    if w.peft is not Peft.NONE:
        notes.append(f"{w.peft}: wrap the model with peft.get_peft_model before shard() "
                     "(see `emit=trainer` for the LoraConfig)")
    return Emitted("fsdp", "\n".join(src) + "\n", "fsdp_setup.py", tuple(notes))


# ------------------------------------------------------------------------------ torchtitan
_TT_DTYPE = {Precision.BF16_MIXED: "bfloat16", Precision.FP16_MIXED: "float16", Precision.FP32: "float32"}


def torchtitan_config(plan: Plan) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """torchtitan's job config (``torchtitan/config/job_config.py``: [training], [parallelism],
    [activation_checkpoint], [optimizer]) for the plan, and what in the plan it cannot express."""
    w, p = plan.workload, plan.workload.parallel
    notes: list[str] = []
    if w.precision not in _TT_DTYPE:
        notes.append(f"torchtitan keeps fp32 sharded parameters and computes in mixed_precision_param: the plan's "
                     f"pure {w.precision} runs as {w.precision}-mixed")
    if w.optimizer not in (Optimizer.ADAM, Optimizer.ADAMW):
        notes.append(f"torchtitan builds Adam / AdamW: the plan's {w.optimizer} is written as AdamW")
    if w.checkpointing is Checkpointing.SELECTIVE:
        notes.append("torchtitan has no Megatron-style selective checkpointing: written as its op-level one")
    if w.peft is not Peft.NONE:
        notes.append(f"torchtitan has no {w.peft}: the config trains the full model")
    if p.zero == 1 or backend(w) == "deepspeed" or p.offload_optimizer != p.offload_params:
        notes.append("ZeRO-1/2 with optimizer-only offload is DeepSpeed's: torchtitan shards with FSDP2")
    if p.tp > 1 and not p.sp:
        notes.append("torchtitan's tensor parallelism always shards norms over the sequence (SP)")
    shard = (p.dp_shard or p.dp) if p.zero else 1  # (torchtitan flattens dp_shard × cp itself)
    replicate = p.dp // shard
    ac: dict[str, Any] = {"mode": "none"}
    if w.checkpointing is Checkpointing.FULL:
        every = max(1, round(1 / w.checkpoint_fraction)) * w.checkpoint_every
        ac = {"mode": "full"} if every == 1 else {"mode": "selective", "selective_ac_option": str(every)}
    elif w.checkpointing in (Checkpointing.OP, Checkpointing.SELECTIVE):
        ac = {"mode": "selective", "selective_ac_option": "op"}
    dtype = _TT_DTYPE.get(w.precision) or ("float16" if w.precision is Precision.FP16 else "bfloat16")
    training: dict[str, Any] = {"seq_len": w.seq, "mixed_precision_param": dtype,
                                "mixed_precision_reduce": "float32"}
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": "never" if p.zero == 2 else "default",
        "tensor_parallel_degree": p.tp, "context_parallel_degree": p.cp, "pipeline_parallel_degree": p.pp,
    }
    if p.pp > 1:
        training["local_batch_size"] = w.batch * w.grad_accum
        parallelism["pipeline_parallel_microbatch_size"] = w.batch
        parallelism["pipeline_parallel_schedule"] = p.pp_schedule
        parallelism["pipeline_parallel_first_stage_less_layers"] = p.pp_first_less
        parallelism["pipeline_parallel_last_stage_less_layers"] = p.pp_last_less
        if p.pp_virtual not in (0, 2) and p.pp_schedule in PP_LOOPED:  # torchtitan's default: 2 stages per rank
            notes.append(f"{p.pp_virtual} stages per rank: set pipeline_parallel_layers_per_stage to the model's "
                         f"layers / {p.pp * p.pp_virtual} (torchtitan infers 2 per rank for {p.pp_schedule}); read "
                         f"back, give `--pp-virtual {p.pp_virtual}` with `--layout`")
    else:
        training["local_batch_size"] = w.batch
        training["global_batch_size"] = w.batch * w.grad_accum * p.dp
    if p.offload_params:
        training["enable_cpu_offload"] = True
    impl = {OptimizerImpl.FUSED: "fused", OptimizerImpl.FOREACH: "foreach", OptimizerImpl.FOR_LOOP: "for-loop"}
    optimizer = {"name": "Adam" if w.optimizer is Optimizer.ADAM else "AdamW", "lr": 3e-4,
                 "implementation": impl[w.optimizer_impl]}
    return {"training": training, "parallelism": parallelism, "activation_checkpoint": ac,
            "optimizer": optimizer}, notes


def to_toml(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML for one level of tables of scalars (what a torchtitan job config needs)."""
    out = []
    for table, values in cfg.items():
        out.append(f"[{table}]")
        for k, v in values.items():
            out.append(f"{k} = {_toml_scalar(v)}")
        out.append("")
    return "\n".join(out)


def _toml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def torchtitan(plan: Plan) -> Emitted:
    nodes, per = _nodes(plan.num_gpus)
    head = (f"# {_header(plan)}\n# NGPU={per} torchrun --nnodes {nodes} --nproc_per_node {per} "
            "-m torchtitan.train --job.config_file job.toml  (add [model] name/flavor and [job])\n")
    cfg, caveats = torchtitan_config(plan)
    return Emitted("torchtitan", head + to_toml(cfg), "job.toml", (_header(plan), *caveats))


# ------------------------------------------------------------------------------ HF Trainer
_HF_OPTIM = {
    (Optimizer.ADAMW, OptimizerImpl.FUSED): "adamw_torch_fused", (Optimizer.ADAM, OptimizerImpl.FUSED): "adamw_torch_fused",
    Optimizer.ADAMW: "adamw_torch", Optimizer.ADAM: "adamw_torch", Optimizer.ADAMW_8BIT: "adamw_bnb_8bit",
    Optimizer.PAGED_ADAMW_8BIT: "paged_adamw_8bit", Optimizer.ADAFACTOR: "adafactor", Optimizer.SGD: "sgd",
    Optimizer.SGD_MOMENTUM: "sgd", Optimizer.LION: "lion_32bit",
}


def trainer(plan: Plan) -> Emitted:
    w = plan.workload
    p = w.parallel
    kind = backend(w)
    optim = _HF_OPTIM.get((w.optimizer, w.optimizer_impl)) or _HF_OPTIM[w.optimizer]
    src = [f"# {_header(plan)}"]
    if plan.num_gpus > 1:
        src.append(f"# launch: torchrun --nproc_per_node {min(plan.num_gpus, 8)} train.py")
    src += ["import torch", "from transformers import TrainingArguments"]
    if w.peft is not Peft.NONE:
        src.append("from peft import LoraConfig")
    if w.peft is Peft.QLORA:
        src.append("from transformers import BitsAndBytesConfig")
    src.append("")
    if w.peft is Peft.QLORA:
        src += [
            "bnb_config = BitsAndBytesConfig(",
            "    load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", bnb_4bit_use_double_quant=True,",
            f"    bnb_4bit_compute_dtype={_DTYPE.get(w.precision, 'torch.bfloat16')},",
            ")  # AutoModelForCausalLM.from_pretrained(..., quantization_config=bnb_config)",
        ]
    if w.peft is not Peft.NONE:
        targets = "\"all-linear\"" if "all-linear" in w.lora_targets else repr(list(w.lora_targets))
        variants = "".join(f"{k}=True, " for k, on in (("use_dora", w.lora_dora), ("use_rslora", w.lora_rslora)) if on)
        if w.lora_modules_to_save:
            variants += f"modules_to_save={list(w.lora_modules_to_save)!r}, "
        src += [f"lora_config = LoraConfig(r={w.lora_rank}, lora_alpha={2 * w.lora_rank}, "
                f"target_modules={targets}, {variants}task_type=\"CAUSAL_LM\")", ""]
    if w.precision in (Precision.BF16, Precision.FP16):
        src.append(f"# pure {w.precision}: load the model with torch_dtype={_DTYPE[w.precision]}")
    args = [
        "    output_dir=\"out\",",
        f"    per_device_train_batch_size={w.batch},",
        f"    gradient_accumulation_steps={w.grad_accum},",
    ]
    if w.precision in (Precision.BF16_MIXED, Precision.BF16):
        args.append("    bf16=True,")
    elif w.precision in (Precision.FP16_MIXED, Precision.FP16):
        args.append("    fp16=True,")
    if w.checkpointing is not Checkpointing.NONE:
        args += ["    gradient_checkpointing=True,", "    gradient_checkpointing_kwargs={\"use_reentrant\": False},"]
        if w.checkpointing is Checkpointing.SELECTIVE or w.checkpoint_fraction < 1:
            src.append("# the Trainer checkpoints every layer; for selective or partial checkpointing "
                       "see --emit fsdp")
    args.append(f"    optim=\"{optim}\",")
    if kind == "deepspeed" or (kind == "fsdp" and p.offload_optimizer and not p.offload_params):
        args.append("    deepspeed=\"ds_config.json\",  # vramplan plan ... --emit deepspeed > ds_config.json")
    elif kind == "fsdp":
        opts = "full_shard auto_wrap" + (" offload" if p.offload_params else "")
        args += [f"    fsdp=\"{opts}\",", "    fsdp_config={\"fsdp_version\": 2},"]
    elif kind == "fsdp1":  # Trainer's FSDP1 defaults use_orig_params; the prefetch the trace ran
        opts = f"{p.fsdp1_strategy.strip('_').lower()} auto_wrap" + (" offload" if p.offload_params else "")
        prefetch = p.fsdp1_prefetch.config_name
        args += [f"    fsdp=\"{opts}\",",
                 f"    fsdp_config={{\"fsdp_version\": 1, \"backward_prefetch\": \"{prefetch}\"}},"]
    src += ["args = TrainingArguments(", *args, ")"]
    return Emitted("trainer", "\n".join(src) + "\n", "training_args.py", (_header(plan),))


# ------------------------------------------------------------------------------ allocator
def alloc_conf(plan: Plan) -> Emitted:
    tight = plan.headroom < TIGHT_FIT * plan.usable
    fragmented = plan.confirmed and plan.method.value == "trace" and plan.fragmentation >= FRAGMENTATION_ADVICE
    if tight or fragmented:
        why = []
        if fragmented:
            why.append(f"predicted fragmentation {plan.fragmentation:.0%} at the peak")
        if tight:
            why.append(f"tight fit: {plan.headroom / GiB:.1f} GiB headroom")
        text = (f"# {'; '.join(why)}: expandable segments let freed blocks be reused across sizes\n"
                "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n")
    else:
        text = (f"# default allocator settings are fine: {plan.headroom / GiB:.1f} GiB headroom, "
                f"predicted fragmentation {plan.fragmentation:.0%}\n"
                "# export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # harmless if shapes vary\n")
    return Emitted("alloc-conf", text, "alloc_conf.sh", (_header(plan),))
