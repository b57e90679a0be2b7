"""Read a layout back from the configs ``emit`` writes (and that people keep): a DeepSpeed
JSON, an Accelerate YAML, the FSDP2 snippet, a torchtitan job TOML → a :class:`Workload`.

Each format carries only part of a job; :data:`CARRIES` says which fields. The rest comes
from ``base`` (the command line: model, ``seq``, checkpointing where the format has none).
Where a format cannot tell two settings apart (Accelerate's ``mixed_precision: bf16`` is
autocast over fp32 *or* bf16 weights), the base's setting is kept when it agrees with the
file. Settings the prediction does not model (non-default DeepSpeed bucket sizes) are
returned as notes, never silently dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramplan.analytic.deepspeed import DEFAULTS as DS_DEFAULTS
from vramplan.errors import PlanError, VramplanError
from vramplan.workload import (
    PP_LOOPED,
    PP_SCHEDULES,
    Checkpointing,
    Engine,
    Fsdp1Prefetch,
    Optimizer,
    OptimizerImpl,
    Precision,
    Workload,
    pp_schedule_name,
)

READ_FORMATS = ("deepspeed", "accelerate", "fsdp", "torchtitan")
CARRIES: dict[str, frozenset[str]] = {
    "deepspeed": frozenset({"batch", "grad_accum", "precision", "optimizer", "dp", "zero", "engine",
                            "offload_optimizer", "offload_params"}),
    "accelerate": frozenset({"dp", "zero", "engine", "offload_optimizer", "offload_params", "dp_shard",
                             "fsdp1_prefetch"}),
    "fsdp": frozenset({"batch", "grad_accum", "precision", "optimizer", "optimizer_impl", "dp", "zero", "engine",
                       "offload_optimizer", "offload_params", "dp_shard"}),
    "torchtitan": frozenset({"batch", "grad_accum", "precision", "seq", "optimizer", "optimizer_impl", "dp", "zero",
                             "engine", "dp_shard", "tp", "pp", "cp", "sp", "microbatches", "offload_optimizer",
                             "offload_params", "pp_schedule", "pp_first_less", "pp_last_less"}),
}
"""The Workload / Parallel fields each format states (the rest come from the base workload).
Accelerate's ``mixed_precision`` names the 16-bit type only: the base says pure or mixed."""


@dataclass(frozen=True)
class ReadLayout:
    workload: Workload
    format: str
    notes: tuple[str, ...] = ()


def _bad(fmt: str, what: str) -> PlanError:
    return PlanError(f"not a {fmt} config: {what}", hint=f"give the file `vramplan plan … --emit {fmt}` writes",
                     field="layout")


def _mixed(base: Workload, half: str) -> Precision:
    """A 16-bit setting: the base's when it is that half type (pure or mixed), else mixed."""
    pure, mixed = (Precision.BF16, Precision.BF16_MIXED) if half == "bf16" else (Precision.FP16, Precision.FP16_MIXED)
    return base.precision if base.precision in (pure, mixed) else mixed


def _dp(world: int, base: Workload, fmt: str) -> int:
    model = base.parallel.tp * base.parallel.pp * base.parallel.cp
    if world % model:
        raise PlanError(f"{fmt}: {world} processes are not a multiple of tp × pp × cp = {model}",
                        hint="give the same `tp`, `pp`, `cp` as when the config was written", field="layout")
    return world // model


def _apply(base: Workload, changes: dict[str, Any]) -> Workload:
    from vramplan.workload import Parallel

    par = {k: changes.pop(k) for k in list(changes) if k in Parallel.__dataclass_fields__}
    import dataclasses

    return base.replace(parallel=dataclasses.replace(base.parallel, **par), **changes)


# ------------------------------------------------------------------------------ DeepSpeed
def read_deepspeed(text: str, base: Workload) -> ReadLayout:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad("deepspeed", f"invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict) or "zero_optimization" not in cfg:
        raise _bad("deepspeed", "no zero_optimization block")
    z = cfg["zero_optimization"]
    notes: list[str] = []
    micro = int(cfg.get("train_micro_batch_size_per_gpu", base.batch))
    accum = int(cfg.get("gradient_accumulation_steps", 1))
    total = cfg.get("train_batch_size")
    dp = int(total) // (micro * accum) if total else base.parallel.dp
    if total and int(total) % (micro * accum):
        raise _bad("deepspeed", f"train_batch_size {total} is not micro-batch {micro} × accumulation {accum} × GPUs")
    changes: dict[str, Any] = {"batch": micro, "grad_accum": accum, "dp": dp, "zero": int(z.get("stage", 0)),
                               "engine": Engine.DEEPSPEED, "dp_shard": 0,
                               "offload_optimizer": (z.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"),
                               "offload_params": (z.get("offload_param") or {}).get("device") in ("cpu", "nvme")}
    if (cfg.get("bf16") or {}).get("enabled"):
        changes["precision"] = _mixed(base, "bf16")
    elif (cfg.get("fp16") or {}).get("enabled"):
        changes["precision"] = _mixed(base, "fp16")
    else:
        changes["precision"] = Precision.FP32
    opt = (cfg.get("optimizer") or {}).get("type", "")
    named = {"adamw": Optimizer.ADAMW, "adam": Optimizer.ADAM, "adafactor": Optimizer.ADAFACTOR}
    if opt.lower() == "sgd":
        momentum = (cfg["optimizer"].get("params") or {}).get("momentum", 0)
        changes["optimizer"] = Optimizer.SGD_MOMENTUM if momentum else Optimizer.SGD
    elif opt.lower() in named:
        changes["optimizer"] = named[opt.lower()]
    elif opt:
        notes.append(f"optimizer {opt!r} is not one vramplan models; kept `optimizer={base.optimizer}`")
    d = DS_DEFAULTS
    modelled = {"reduce_bucket_size": d.reduce_bucket_size, "stage3_prefetch_bucket_size": d.prefetch_bucket_size,
                "stage3_max_live_parameters": d.max_live_parameters, "contiguous_gradients": d.contiguous_gradients,
                "stage3_param_persistence_threshold": d.param_persistence_threshold,
                "sub_group_size": d.sub_group_size, "overlap_comm": d.overlap(changes["zero"])}
    for k, default in modelled.items():
        if k in z and z[k] != default and not (isinstance(z[k], float) and z[k] == float(default)):
            notes.append(f"zero_optimization.{k} = {z[k]!r}: the prediction assumes DeepSpeed's default {default!r}")
    return ReadLayout(_apply(base, changes), "deepspeed", tuple(notes))


# ------------------------------------------------------------------------------ Accelerate
_FSDP1_STRATEGIES: dict[str, tuple[int, bool]] = {
    "FULL_SHARD": (3, False), "SHARD_GRAD_OP": (2, False), "NO_SHARD": (0, False), "HYBRID_SHARD": (3, True),
    "_HYBRID_SHARD_ZERO2": (2, True), "1": (3, False), "2": (2, False), "3": (0, False), "4": (3, True),
    "5": (2, True)}
"""``fsdp_sharding_strategy`` (a name, or accelerate's 1-based index) → (ZeRO stage, hybrid: sharded
within each machine, replicated across machines)."""
_FSDP1_PREFETCH = {**{m.config_name: m.value for m in Fsdp1Prefetch}, "1": "backward-pre", "2": "backward-post"}
"""``fsdp_backward_prefetch`` → ``Parallel.fsdp1_prefetch`` (absent: accelerate's plugin takes None,
no prefetch)."""


def read_accelerate(text: str, base: Workload) -> ReadLayout:
    import yaml

    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _bad("accelerate", f"invalid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict) or "distributed_type" not in cfg:
        raise _bad("accelerate", "no distributed_type")
    kind = str(cfg["distributed_type"]).upper()
    n = int(cfg.get("num_processes", 1))
    changes: dict[str, Any] = {"dp": _dp(n, base, "accelerate"), "dp_shard": 0, "offload_optimizer": False,
                               "offload_params": False}
    if kind in ("NO", "MULTI_GPU"):
        changes.update(zero=0, engine=Engine.DDP if n > 1 else Engine.AUTO)
    elif kind == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        changes.update(zero=int(ds.get("zero_stage", 2)), engine=Engine.DEEPSPEED,
                       offload_optimizer=ds.get("offload_optimizer_device", "none") != "none",
                       offload_params=ds.get("offload_param_device", "none") != "none")
    elif kind == "FSDP":
        fs = cfg.get("fsdp_config") or {}
        off = bool(fs.get("fsdp_offload_params", False))
        if int(fs.get("fsdp_version", 1)) == 1:  # accelerate's default version (FSDP_VERSION, "1")
            strategy = _FSDP1_STRATEGIES.get(str(fs.get("fsdp_sharding_strategy", "FULL_SHARD")).upper())
            if strategy is None:
                raise _bad("accelerate", f"fsdp_sharding_strategy {fs.get('fsdp_sharding_strategy')!r} is not one "
                                         f"of FSDP1's ({', '.join(k for k in _FSDP1_STRATEGIES if not k.isdigit())})")
            zero, hybrid = strategy
            machines = int(cfg.get("num_machines", 1))
            prefetch = _FSDP1_PREFETCH.get(str(fs.get("fsdp_backward_prefetch", "NO_PREFETCH")).upper())
            if prefetch is None:
                raise _bad("accelerate", f"fsdp_backward_prefetch {fs.get('fsdp_backward_prefetch')!r} is not one of "
                                         "BACKWARD_PRE, BACKWARD_POST, NO_PREFETCH")
            changes.update(zero=zero, engine=Engine.FSDP1, offload_params=off, offload_optimizer=off,
                           dp_shard=n // machines if hybrid and machines > 1 else 0, fsdp1_prefetch=prefetch)
        else:
            changes.update(zero=3 if fs.get("fsdp_reshard_after_forward", True) else 2, engine=Engine.FSDP,
                           offload_params=off, offload_optimizer=off)
    else:
        raise _bad("accelerate", f"distributed_type {kind} is not one vramplan models (NO, MULTI_GPU, DEEPSPEED, FSDP)")
    mp = str(cfg.get("mixed_precision", "no")).lower()
    changes["precision"] = _mixed(base, mp) if mp in ("bf16", "fp16") else Precision.FP32
    return ReadLayout(_apply(base, changes), "accelerate")


# ------------------------------------------------------------------------------ FSDP2 snippet
_OPT_LINE = re.compile(r"(torch\.optim|bnb\.optim)\.(\w+)\(params[^)]*\)")


def read_fsdp(text: str, base: Workload) -> ReadLayout:
    if "fully_shard" not in text:
        raise _bad("fsdp", "no fully_shard call")

    def const(name: str) -> int | None:
        m = re.search(rf"^{name}\s*=\s*(\d+)", text, re.M)
        return int(m.group(1)) if m else None

    launch = re.search(r"--nnodes\s+(\d+)\s+--nproc_per_node\s+(\d+)", text)
    if not launch:
        raise _bad("fsdp", "no `torchrun --nnodes N --nproc_per_node M` line")
    world = int(launch.group(1)) * int(launch.group(2))
    reshard = re.search(r"reshard_after_forward=(True|False)", text)
    offload = "kwargs['offload_policy'] = CPUOffloadPolicy" in text
    hsdp = re.search(r"^REPLICATE, SHARD = (\d+), (\d+)", text, re.M)
    dp = _dp(world, base, "fsdp")
    zero = 3 if not reshard or reshard.group(1) == "True" else 2
    changes: dict[str, Any] = {"dp": dp, "zero": zero, "engine": Engine.FSDP, "offload_params": offload,
                               "offload_optimizer": offload, "dp_shard": int(hsdp.group(2)) if hsdp else 0}
    pdt = re.search(r"MixedPrecisionPolicy\(param_dtype=([\w.]+), reduce_dtype=([\w.]+)\)", text)
    if not pdt:
        raise _bad("fsdp", "no MixedPrecisionPolicy(param_dtype=…, reduce_dtype=…)")
    param, reduce = pdt.group(1), pdt.group(2)
    halves = {"torch.bfloat16": (Precision.BF16, Precision.BF16_MIXED), "torch.float16": (Precision.FP16,
                                                                                         Precision.FP16_MIXED)}
    if param in halves:  # fp32 gradient reduction: mixed precision (fp32 master weights); 16-bit: pure
        changes["precision"] = halves[param][1] if reduce == "torch.float32" else halves[param][0]
    else:
        changes["precision"] = Precision.FP32
    if (mb := const("MICRO_BATCH")) is not None:
        changes["batch"] = mb
    if (ga := const("GRAD_ACCUM")) is not None:
        changes["grad_accum"] = ga
    m = _OPT_LINE.search(text)
    if m:
        kind = {"AdamW": Optimizer.ADAMW, "Adam": Optimizer.ADAM, "Adafactor": Optimizer.ADAFACTOR,
                "AdamW8bit": Optimizer.ADAMW_8BIT, "PagedAdamW8bit": Optimizer.PAGED_ADAMW_8BIT,
                "Lion": Optimizer.LION}.get(m.group(2))
        if m.group(2) == "SGD":
            kind = Optimizer.SGD_MOMENTUM if "momentum=" in m.group(0) else Optimizer.SGD
        if kind is not None:
            changes["optimizer"] = kind
            changes["optimizer_impl"] = OptimizerImpl.FUSED if "fused=True" in m.group(0) else OptimizerImpl.FOREACH
    return ReadLayout(_apply(base, changes), "fsdp")


# ------------------------------------------------------------------------------ torchtitan
def read_torchtitan(text: str, base: Workload) -> ReadLayout:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise PlanError("reading a torchtitan TOML needs Python 3.11 or newer (tomllib)",
                        hint="run vramplan on Python 3.11+", field="layout") from None
    try:
        cfg = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _bad("torchtitan", f"invalid TOML ({e})") from None
    par, tr = cfg.get("parallelism"), cfg.get("training", {})
    if not isinstance(par, dict):
        raise _bad("torchtitan", "no [parallelism] table")
    replicate = int(par.get("data_parallel_replicate_degree", 1))
    shard = int(par.get("data_parallel_shard_degree", 1))
    if shard < 1:
        raise _bad("torchtitan", "data_parallel_shard_degree -1 (the rest of the GPUs): write the number")
    tp, pp, cp = (int(par.get(k, 1)) for k in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                                "context_parallel_degree"))
    dp = replicate * shard
    offload = bool(tr.get("enable_cpu_offload", False))
    changes: dict[str, Any] = {
        "dp": dp, "tp": tp, "pp": pp, "cp": cp, "sp": tp > 1,
        "zero": 0 if shard == 1 else (2 if par.get("fsdp_reshard_after_forward") == "never" else 3),
        "dp_shard": shard if replicate > 1 and shard > 1 else 0, "offload_params": offload, "offload_optimizer": offload,
    }
    changes["engine"] = Engine.FSDP if shard > 1 else (Engine.DDP if dp > 1 else Engine.AUTO)
    local = int(tr.get("local_batch_size", tr.get("batch_size", base.batch)))
    if pp > 1:
        mb = int(par.get("pipeline_parallel_microbatch_size", 1))
        changes.update(batch=mb, grad_accum=local // mb)
    else:
        gb = int(tr.get("global_batch_size", local * dp) or local * dp)
        if gb % (local * dp):
            raise _bad("torchtitan", f"global_batch_size {gb} is not local_batch_size {local} × {dp} DP ranks × steps")
        changes.update(batch=local, grad_accum=gb // (local * dp))
    if "seq_len" in tr:
        changes["seq"] = int(tr["seq_len"])
    dtype = tr.get("mixed_precision_param", "bfloat16")
    changes["precision"] = {"bfloat16": Precision.BF16_MIXED, "float16": Precision.FP16_MIXED}.get(dtype,
                                                                                                   Precision.FP32)
    ac = cfg.get("activation_checkpoint", {})
    mode, option = ac.get("mode", "none"), str(ac.get("selective_ac_option", "2"))
    if mode == "full":
        changes.update(checkpointing=Checkpointing.FULL, checkpoint_fraction=1.0, checkpoint_every=1)
    elif mode == "selective" and option == "op":
        changes.update(checkpointing=Checkpointing.OP)
    elif mode == "selective" and option.isdigit():
        k = int(option)
        if base.checkpointing is Checkpointing.FULL and round(1 / base.checkpoint_fraction) * base.checkpoint_every == k:
            pass  # the base says the same thing (every k-th layer) its own way
        else:
            changes.update(checkpointing=Checkpointing.FULL, checkpoint_fraction=1.0, checkpoint_every=k)
    else:
        changes["checkpointing"] = Checkpointing.NONE
    opt = cfg.get("optimizer", {})
    name = str(opt.get("name", "AdamW"))
    changes["optimizer"] = Optimizer.ADAMW if name == "AdamW" else Optimizer.ADAM
    changes["optimizer_impl"] = {"fused": OptimizerImpl.FUSED, "for-loop": OptimizerImpl.FOR_LOOP}.get(
        str(opt.get("implementation", "fused")), OptimizerImpl.FOREACH)
    notes: list[str] = []
    if pp > 1:
        changes["microbatches"] = base.parallel.microbatches
        for key, field in (("pipeline_parallel_first_stage_less_layers", "pp_first_less"),
                           ("pipeline_parallel_last_stage_less_layers", "pp_last_less")):
            changes[field] = int(par.get(key, 1))  # torchtitan's default: 1 each
        name = str(par.get("pipeline_parallel_schedule", "1F1B"))
        try:
            changes["pp_schedule"] = pp_schedule_name(name)
        except VramplanError:
            raise PlanError(f"torchtitan schedule {name!r} is not one vramplan predicts",
                            hint=f"use one of {', '.join(PP_SCHEDULES)}", field="layout") from None
        if "pipeline_parallel_layers_per_stage" in par:
            # stages per rank = layers / (pp × layers per stage): the model (not in the file) decides
            changes["pp_virtual"] = base.parallel.pp_virtual
            if not base.parallel.pp_virtual:
                notes.append("pipeline_parallel_layers_per_stage is set: give `pp_virtual` (layers / (pp × it)) "
                             "for its stages per rank; 2 assumed")
        elif changes["pp_schedule"] in PP_LOOPED:
            changes["pp_virtual"] = 0  # torchtitan's default for a looped schedule: 2 stages per rank
    return ReadLayout(_apply(base, changes), "torchtitan", tuple(notes))


READERS: dict[str, Callable[[str, Workload], ReadLayout]] = {
    "deepspeed": read_deepspeed, "accelerate": read_accelerate, "fsdp": read_fsdp, "torchtitan": read_torchtitan,
}


def read_layout(fmt: str, text: str, base: Workload) -> ReadLayout:
    """``base`` with the fields the ``fmt`` config states (:data:`CARRIES`) taken from ``text``."""
    if fmt not in READERS:
        raise PlanError(f"unknown layout format {fmt!r}", hint=f"choose one of {', '.join(READ_FORMATS)}",
                        field="layout")
    return READERS[fmt](text, base)


def sniff(path: Path, text: str) -> str:
    """The format of a config file, from its name and content."""
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "deepspeed"
    if suffix in (".yaml", ".yml"):
        return "accelerate"
    if suffix == ".toml":
        return "torchtitan"
    if suffix == ".py" or "fully_shard" in text:
        return "fsdp"
    raise PlanError(f"cannot tell the format of {path.name}",
                    hint="name it .json (DeepSpeed), .yaml (Accelerate), .toml (torchtitan) or .py (FSDP2)",
                    field="layout")


MAX_LAYOUT_BYTES = 1 << 20
"""A layout file larger than this is not one ``plan --emit`` wrote (they are a few KiB)."""


def read_file(path: str | Path, base: Workload) -> ReadLayout:
    p = Path(path)
    if not p.exists():
        raise PlanError(f"no such layout file: {p}", hint="give the path of a config `--emit` wrote", field="layout")
    if not p.is_file():
        raise PlanError(f"layout {p} is not a regular file", hint="give the path of a config `--emit` wrote",
                        field="layout")
    if p.stat().st_size > MAX_LAYOUT_BYTES:
        raise PlanError(f"layout file {p} is {p.stat().st_size:,} B; an emitted config is a few KiB",
                        hint="give the path of a config `--emit` wrote", field="layout")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"layout file {p} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})",
                        hint="give the path of a config `--emit` wrote (DeepSpeed .json, Accelerate .yaml, "
                        "torchtitan .toml or FSDP2 .py)", field="layout") from None
    except OSError as e:
        raise PlanError(f"cannot read layout file {p}: {e.strerror or e}", field="layout") from None
    return read_layout(sniff(p, text), text, base)


__all__ = ["CARRIES", "READ_FORMATS", "ReadLayout", "read_file", "read_layout", "sniff"]
