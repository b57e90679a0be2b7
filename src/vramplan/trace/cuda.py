"""What the target GPU changes in a trace: the device profile the CUDA emulation reads.

A trace runs on ``meta`` tensors (fake CUDA tensors cannot survive autograd without a GPU),
so every choice CUDA would make differently from a CPU run is emulated from this profile:

- SDPA kernel choice (:mod:`.sdpa`) follows PyTorch's ``sdp_utils.cpp`` by compute capability:
  flash needs sm80–sm121, memory-efficient sm50–sm121, cuDNN attention sm80–sm121 and is tried
  *first* on sm90/sm10x (Hopper, datacenter Blackwell) as in PyTorch ≥ 2.10 with cuDNN > 9.15.
- cuBLAS workspace (:mod:`.dispatch`): one per (cuBLAS handle, stream), taken through the
  caching allocator on first use; handles are per thread, and the autograd engine runs CUDA
  backward on its own device thread, so forward and backward each take one.
- Generations assumed when ``gpu`` is None: an sm80 (A100-class) NVIDIA GPU.
- AMD Instinct (CDNA2/3): flash and memory-efficient attention through AOTriton, no cuDNN.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.gpu import GPU
from ..units import MiB

CUBLAS_WORKSPACE_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8
"""8,519,680 B: ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``, PyTorch's default before sm90."""
CUBLAS_WORKSPACE_HOPPER = 32 * MiB
"""32 MiB: ``:4096:8``, PyTorch's default on sm90 and newer."""
DEFAULT_SM = (8, 0)


@dataclass(frozen=True)
class DeviceProfile:
    """The CUDA facts a trace depends on."""

    name: str
    sm: tuple[int, int]
    """Compute capability (major, minor); AMD/Intel get an equivalent for kernel support."""
    vendor: str = "nvidia"
    cublas_workspace: int = CUBLAS_WORKSPACE_PRE_HOPPER
    """Bytes per cuBLAS (handle, stream) workspace; 0 turns the emulation off."""
    prefer_cudnn_attention: bool = False
    """cuDNN attention goes first in the SDPA priority order (sm90 / sm10x)."""
    has_cudnn_attention: bool = True
    cudnn_conv_workspace: bool = True
    """Emit a per-call cuDNN convolution workspace (see :func:`conv_workspace_bytes`)."""

    @property
    def bf16(self) -> bool:
        return self.sm >= (8, 0)


def _cc(gpu: GPU) -> tuple[int, int]:
    if gpu.compute_capability:
        major, _, minor = gpu.compute_capability.partition(".")
        return int(major), int(minor or 0)
    if gpu.vendor == "amd":
        return (9, 0)  # CDNA: flash/efficient via AOTriton, bf16 capable
    return DEFAULT_SM


def profile_for(gpu: GPU | None, *, workspaces: bool = True) -> DeviceProfile:
    """The device profile of ``gpu`` (None: an sm80 A100-class GPU)."""
    if gpu is None:
        ws = _cublas_bytes(None) if workspaces else 0
        return DeviceProfile(name="sm80 (assumed)", sm=DEFAULT_SM, cublas_workspace=ws,
                             cudnn_conv_workspace=workspaces)
    sm = _cc(gpu)
    nvidia = gpu.vendor == "nvidia"
    return DeviceProfile(
        name=gpu.key, sm=sm, vendor=gpu.vendor,
        cublas_workspace=_cublas_bytes(gpu) if workspaces else 0,
        prefer_cudnn_attention=nvidia and sm[0] in (9, 10),
        has_cudnn_attention=nvidia,
        cudnn_conv_workspace=workspaces and nvidia,
    )


def _cublas_bytes(gpu: GPU | None) -> int:
    try:
        from ..hardware.overhead import cublas_workspace_bytes
    except ImportError:  # hardware module not present: PyTorch's defaults
        if gpu is not None and _cc(gpu)[0] >= 9:
            return CUBLAS_WORKSPACE_HOPPER
        return CUBLAS_WORKSPACE_PRE_HOPPER
    return int(cublas_workspace_bytes(gpu))


CONV_WORKSPACE_CAP = 256 * MiB


def conv_workspace_bytes(input_bytes: int, output_bytes: int) -> int:
    """Documented estimate of one cuDNN convolution call's workspace.

    With ``cudnn.benchmark=False`` PyTorch asks cuDNN's heuristics for an algorithm and
    allocates its workspace through the caching allocator for the duration of the call
    (Conv_v8.cpp). The implicit-precomputed-GEMM family usually chosen needs a workspace of
    the order of the larger operand; we take ``max(input, output)`` capped at 256 MiB.
    """
    return min(max(input_bytes, output_bytes), CONV_WORKSPACE_CAP)
