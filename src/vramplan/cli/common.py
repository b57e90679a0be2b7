"""Flags shared by several subcommands, and their mapping to library keywords."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from ..errors import VramplanError
from ..units import parse_bytes
from ..workload import (
    Attention,
    Checkpointing,
    KVDtype,
    Method,
    Optimizer,
    OptimizerImpl,
    Parallel,
    Peft,
    Precision,
    Quant,
    Task,
    Workload,
)


def _choices(cls: Any) -> list[str]:
    return [m.value for m in cls]


def add_output_args(p: argparse.ArgumentParser, plot: bool = True, plot_help: str | None = None) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--format", choices=["table", "json", "markdown"], default="table",
                   help="report format (default: table)")
    g.add_argument("--json", action="store_const", const="json", dest="format",
                   help="same as --format json (integer bytes)")
    if plot:
        g.add_argument("--plot", metavar="FILE", help=plot_help or "write a plot (.png, .svg or .html)")


def add_workload_args(p: argparse.ArgumentParser, *, gpu: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--task", choices=_choices(Task), default="train")
    g.add_argument("--batch", type=int, default=1, help="micro-batch size per GPU (default 1)")
    g.add_argument("--seq", type=int, default=2048, help="sequence length / prompt tokens (default 2048)")
    g.add_argument("--new-tokens", type=int, default=0, help="tokens to generate (task=generate; default 128)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    g.add_argument("--precision", choices=["auto", *_choices(Precision)], default="auto",
                   help="auto (default): bf16-mixed for train, bf16 for infer/generate")
    g.add_argument("--optimizer", choices=_choices(Optimizer), default="adamw")
    g.add_argument("--optimizer-impl", choices=_choices(OptimizerImpl), default="foreach")
    g.add_argument("--checkpointing", choices=_choices(Checkpointing), default="none")
    g.add_argument("--checkpoint-fraction", type=float, default=1.0,
                   help="fraction of layers checkpointed (default 1.0)")
    g.add_argument("--peft", choices=_choices(Peft), default="none")
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                   help="comma-separated module names, or all-linear")
    g.add_argument("--quant", choices=_choices(Quant), default="none", help="base-weight quantisation")
    g.add_argument("--kv-dtype", choices=_choices(KVDtype), default="auto")
    g.add_argument("--attention", choices=_choices(Attention), default="sdpa")
    g.add_argument("--image-size", type=int, default=224, help="input resolution for vision models")
    g.add_argument("--routing-skew", type=float, default=1.0,
                   help="traced MoE routing: each expert's load relative to uniform top-k routing "
                        "(1.25 = every expert 25%% over its k/n share, as a full capacity factor 1.25)")
    par = p.add_argument_group("parallelism (per-GPU memory is reported)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel size")
    par.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (FSDP: 2=SHARD_GRAD_OP, 3=FULL_SHARD)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    par.add_argument("--microbatches", type=int, default=0, help="micro-batches in flight (pipeline; 0 = pp)")
    par.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (needs --tp)")
    par.add_argument("--cp", type=int, default=1, help="context-parallel size")
    par.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    par.add_argument("--offload-optimizer", action="store_true", help="optimizer states in CPU memory")
    par.add_argument("--offload-params", action="store_true", help="parameters in CPU memory (ZeRO-3)")
    if gpu:
        h = p.add_argument_group("target")
        h.add_argument("--gpu", help="catalog GPU to check the fit against (see `vramplan gpus`)")
        h.add_argument("--alloc-conf", default=None,
                       help="PYTORCH_CUDA_ALLOC_CONF string for the allocator simulation")
        h.add_argument("--method", choices=_choices(Method), default="auto",
                       help="trace the real model on fake tensors, or use closed-form formulas "
                       "(auto: trace when the model can be built, else analytic)")


def workload_from_args(args: argparse.Namespace) -> Workload:
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    parallel = Parallel(
        dp=args.dp, zero=args.zero, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
        sp=args.sp, cp=args.cp, ep=args.ep, offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
    )
    return Workload(
        task=args.task, batch=args.batch, seq=args.seq, new_tokens=args.new_tokens,
        grad_accum=args.grad_accum, precision=args.precision, optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl, checkpointing=args.checkpointing,
        checkpoint_fraction=args.checkpoint_fraction, peft=args.peft, lora_rank=args.lora_rank,
        lora_targets=targets, quant=args.quant, kv_dtype=args.kv_dtype, attention=args.attention,
        image_size=args.image_size, routing_skew=getattr(args, "routing_skew", 1.0), parallel=parallel,
    )


def size_arg(text: str) -> int:
    """A memory size with its unit. A bare number (bytes to parse_bytes) is nearly always a
    forgotten unit on the command line (``--min-memory 24``), so it is refused, except 0."""
    try:
        n = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(n):
            raise argparse.ArgumentTypeError(f"invalid size {text!r} (write e.g. 80GiB, 24GB or 512MiB)")
        if n != 0:
            raise argparse.ArgumentTypeError(f"size {text!r} has no unit (write e.g. {text}GiB or {text}GB)")
    try:
        return parse_bytes(text)
    except VramplanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def hint(msg: str) -> None:
    """Hints and progress go to stderr; data goes to stdout."""
    sys.stderr.write(msg.rstrip() + "\n")
