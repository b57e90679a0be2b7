"""Build the :class:`~vramplan.target.DeviceProfile` of a catalog GPU, once per estimate.

Every capability fact has its home here: compute capability (``GPU.sm``), bf16 and fp8
support, the SDPA kernels PyTorch can pick (``sdp_utils.cpp``, PyTorch 2.10+), the cuBLAS and
cuDNN workspaces (:func:`~vramplan.hardware.overhead.cublas_workspace_bytes`), the memory outside
the allocator (:func:`~vramplan.hardware.overhead.device_overhead`) and the usable capacity
(:func:`~vramplan.hardware.catalog.usable_capacity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..target import DEFAULT_PROFILE, DEFAULT_SM, DeviceProfile
from .nccl import Communicator

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU

NO_BF16_ARCHS = ("volta", "turing", "pascal")
"""No native bf16 (sm < 8.0): PyTorch emulates it, SDPA has no fused bf16 kernel."""
FP8_ARCHS = ("hopper", "blackwell", "ada", "cdna3")


def supports_bf16(gpu: GPU) -> bool:
    return gpu.arch.lower() not in NO_BF16_ARCHS


def supports_fp8(gpu: GPU) -> bool:
    return gpu.arch.lower() in FP8_ARCHS


def kernel_sm(gpu: GPU) -> tuple[int, int]:
    """The compute capability kernel support is judged by; CDNA counts as sm90-class
    (flash and memory-efficient attention through AOTriton, bf16 capable)."""
    if gpu.sm is not None:
        return gpu.sm
    return (9, 0) if gpu.vendor == "amd" else DEFAULT_SM


def device_profile(gpu: GPU | None, *, world_size: int = 1, workspaces: bool = True,
                   communicators: Sequence[Communicator] | None = None) -> DeviceProfile:
    """The profile of ``gpu`` (None: an sm80, A100-class GPU with no capacity, no verdict)."""
    from .overhead import cublas_workspace_bytes, device_overhead

    if gpu is None:
        p = DeviceProfile(cublas_workspace=cublas_workspace_bytes(None),
                          overhead=tuple(device_overhead(None, world_size=world_size, communicators=communicators)))
        return p if workspaces else p.without_workspaces()
    from .catalog import usable_capacity

    sm = kernel_sm(gpu)
    nvidia = gpu.vendor == "nvidia"
    usable, source = usable_capacity(gpu)
    p = DeviceProfile(
        name=gpu.key, sm=sm, vendor=gpu.vendor, arch=gpu.arch, sm_count=gpu.sm_count or 108, bf16=supports_bf16(gpu), fp8=supports_fp8(gpu),
        cublas_workspace=cublas_workspace_bytes(gpu), prefer_cudnn_attention=nvidia and sm[0] in (9, 10),
        has_cudnn_attention=nvidia, cudnn_conv_workspace=nvidia, usable=usable, usable_source=source,
        overhead=tuple(device_overhead(gpu, world_size=world_size, communicators=communicators)),
    )
    return p if workspaces else p.without_workspaces()


__all__ = ["device_profile", "supports_bf16", "supports_fp8", "kernel_sm", "DEFAULT_PROFILE"]
