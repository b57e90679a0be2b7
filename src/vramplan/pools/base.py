"""What every inference engine's own sizing reads: weights and a forward's peak on one rank
(:class:`Forward`, measured by :mod:`vramplan.engine.forward`), the serving dtype and the
quantisation names, and the memory outside PyTorch: the
:func:`vramplan.hardware.overhead.device_overhead` items, the CUDA context + kernel images +
thread stacks (present before an engine's first memory snapshot) and the cuBLAS handle + NCCL
buffers (created after it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.hardware.overhead import device_overhead
from vramplan.models.spec import ModelSpec
from vramplan.results import OverheadItem

QUANTIZATIONS = ("none", "fp8", "awq", "gptq", "bitsandbytes", "mxfp4")
"""``mxfp4``: gpt-oss's MXFP4 experts, vLLM only (:mod:`vramplan.pools.mxfp4`)."""
AWQ_BYTES_PER_WEIGHT = 0.5 + 2 / 128 + 0.5 / 128
"""4-bit packed weight + fp16 scale and 4-bit zero point per group of 128."""


@dataclass(frozen=True)
class Forward:
    """Weights and the forward's activation peak on one rank (bytes)."""

    weights: int
    activation_peak: int
    """Allocated above the weights at the forward's peak (no KV pool)."""
    tokens: int
    method: str
    expert_elems: int = 0
    """Elements of the routed experts in the whole model (MoE; what expert parallelism splits)."""


def serving_dtype(spec: ModelSpec, dtype: str) -> str:
    """``auto``: the checkpoint's 16-bit dtype; fp32 checkpoints are served in bf16 (vLLM
    ``_get_and_verify_dtype`` downcasts float32 to 16 bit)."""
    d = dtype.strip().lower()
    if d == "auto":
        return "fp16" if spec.dtype in ("float16", "fp16") else "bf16"
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    d = aliases.get(d, d)
    if d not in ("bf16", "fp16"):
        raise WorkloadError(f"invalid serving dtype {dtype!r}", hint="use auto, bf16 or fp16")
    return d


def check_quant(quant: str) -> str:
    q = (quant or "none").strip().lower()
    if q not in QUANTIZATIONS:
        raise WorkloadError(f"invalid quantization {quant!r}", hint=f"choose one of {' | '.join(QUANTIZATIONS)}")
    return q


@dataclass(frozen=True)
class Outside:
    """Device memory outside PyTorch's allocator on one rank."""

    context: int
    """CUDA context + kernel images + thread stacks (exists before the engine's first snapshot)."""
    later: int
    """cuBLAS handle + NCCL buffers (created after it)."""
    cublas: int = 0
    """The cuBLAS/cuBLASLt handle's part of ``later`` (the rest is NCCL's)."""


def context_bytes(items: Iterable[OverheadItem]) -> int:
    """The CUDA context + kernel images + thread stacks among ``items`` (present before an
    engine's first memory snapshot)."""
    return sum(i.bytes for i in items if i.name.startswith(("CUDA context", "thread stack")))


def outside(gpu: GPU, world: int) -> Outside:
    items = device_overhead(gpu, world_size=world)
    context = context_bytes(items)
    later = sum(i.bytes for i in items) - context
    cublas = sum(i.bytes for i in items if i.name.startswith("cuBLAS"))
    return Outside(context=context, later=later, cublas=cublas)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
