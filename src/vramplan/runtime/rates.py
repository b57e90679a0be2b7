"""A GPU's peak rates for a workload's precision, and the efficiency factors we apply.

Every factor is an assumption, not a measurement; each names where it comes from so that
a user can override it (:class:`Efficiency` is a plain frozen dataclass).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramplan.errors import WorkloadError
from vramplan.hardware.gpu import GPU
from vramplan.workload import Precision, Workload


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of peak that real steps reach, and the overlap we assume.

    Sources: ``torch.distributed._tools.RuntimeEstimator`` models each op as
    ``max(bytes / bandwidth, flops / (0.75 · peak))`` (op-level, no launch or non-matmul
    overhead). End-to-end model-FLOPs utilisation reported for large dense training is
    lower: 46.2 % (PaLM, Chowdhery et al. 2022) and 52 % of A100 peak for Megatron-LM's
    1T-parameter run (Narayanan et al., SC'21). We take 0.5 for large GEMMs and scale it
    down for small token counts (tile quantisation) and narrow layers
    (``matmul_efficiency``): an 8B Llama at 8k tokens per micro-batch gets ~0.40.
    """

    mfu_large: float = 0.5
    """Fraction of dense peak reached by a large, matmul-dominated step (see class doc)."""
    tokens_half: int = 32
    """Tokens per micro-batch at which GEMM efficiency is half its large-matrix value."""
    width_half: int = 1024
    """Layer width (hidden ÷ TP) at which GEMM efficiency is half its large-matrix value."""
    bandwidth: float = 0.8
    """Fraction of peak HBM/GDDR bandwidth that streaming kernels reach (memcpy-like
    kernels typically measure 80–90 % of the datasheet figure)."""
    link: float = 0.8
    """Fraction of the per-direction link bandwidth a ring collective reaches (NCCL
    ``busbw`` in nccl-tests is typically 75–85 % of the link rate)."""
    collective_latency: float = 20e-6
    """Fixed cost of one collective call (NCCL small-message latency is ~10–30 µs)."""
    overlap_ddp: float = 0.8
    """Share of the backward pass that DDP's bucketed all-reduce can hide behind (the last
    bucket is always exposed)."""
    overlap_fsdp: float = 0.7
    """Share of a micro-batch's compute that FSDP/ZeRO-3 prefetching hides gathers behind."""
    overlap_offload: float = 0.5
    """Share of backward that gradient offload (device→host) can hide behind."""
    pcie: float = 0.8
    """Fraction of the nominal per-direction PCIe x16 rate that pinned copies reach."""
    cpu_adam_params_per_node_s: float = 2.0e9
    """Parameters per second a node's CPU optimizer updates, shared by its ranks. Derived,
    not measured: CPU Adam (DeepSpeed's vectorised CPU-Adam, ZeRO-Offload, Ren et al. 2021)
    is host-memory-bound at ~30 B read+written per parameter; ~100 GB/s sustained on a
    two-socket server gives ~3 G params/s, of which we assume two thirds."""
    gpus_per_node: int = 8
    inter_node_bw: float = 50e9
    """Per-GPU inter-node bandwidth in bytes/s (one 400 Gb/s InfiniBand NIC per GPU, as
    in DGX H100 / p5 nodes)."""
    tf32: bool = False
    """Whether fp32 matmuls use TF32 tensor cores (PyTorch's default
    ``torch.backends.cuda.matmul.allow_tf32`` is False since 1.12)."""


DEFAULT_EFFICIENCY = Efficiency()


@dataclass(frozen=True)
class Rate:
    flops: float
    """Peak dense FLOP/s used for matmuls."""
    name: str
    """Which figure of the catalog, e.g. ``bf16 dense tensor``."""
    note: str = ""


def compute_rate(gpu: GPU, w: Workload, eff: Efficiency = DEFAULT_EFFICIENCY) -> Rate:
    """The dense peak matmul rate for ``w``'s precision on ``gpu``."""
    p = w.precision
    tf = 1e12
    order: tuple[tuple[str, float | None], ...]
    if p in (Precision.BF16_MIXED, Precision.BF16):
        order = (("bf16", gpu.bf16_tflops), ("fp16", gpu.fp16_tflops))
    elif p in (Precision.FP16_MIXED, Precision.FP16):
        order = (("fp16", gpu.fp16_tflops), ("bf16", gpu.bf16_tflops))
    elif eff.tf32:
        order = (("tf32", gpu.tf32_tflops), ("fp32", gpu.fp32_tflops))
    else:
        order = (("fp32", gpu.fp32_tflops),)
    first = order[0][0]
    for name, value in order:
        if value:
            note = ""
            if name != first:
                note = f"{gpu.key} lists no {first} rate; used its {name} rate"
            kind = "dense tensor" if name != "fp32" else "dense (CUDA cores)"
            return Rate(value * tf, f"{name} {kind}", note)
    if gpu.fp32_tflops:
        return Rate(gpu.fp32_tflops * tf, "fp32 dense (CUDA cores)",
                    f"{gpu.key} has no {first} tensor rate in the catalog; assumed the fp32 rate")
    raise WorkloadError(f"GPU {gpu.key} has no FLOP rates in the catalog",
                        hint="choose another GPU (see `vramplan gpus`)")


def memory_bandwidth(gpu: GPU) -> float:
    bw = gpu.peak_bandwidth
    if not bw:
        raise WorkloadError(f"GPU {gpu.key} has no memory bandwidth in the catalog",
                            hint="choose another GPU (see `vramplan gpus`)")
    return float(bw)


def matmul_efficiency(tokens: int, width: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Fraction of peak FLOP/s for GEMMs with ``tokens`` rows and ``width`` columns.

    Saturating in both: ``mfu_large · t/(t + t½) · w/(w + w½)``. A 4096-token micro-batch
    of a 4096-wide model gets ~0.46; decode (1 token) is far below any useful rate, which
    is right: decode is memory-bound.
    """
    t = max(tokens, 1)
    wd = max(width, 1)
    return eff.mfu_large * t / (t + eff.tokens_half) * wd / (wd + eff.width_half)
