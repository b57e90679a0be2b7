"""What the target GPU changes in a trace: the CUDA emulation reads a device profile.

A trace runs on ``meta`` tensors (fake CUDA tensors cannot survive autograd without a GPU),
so every choice CUDA would make differently from a CPU run is emulated from this profile:

- SDPA kernel choice (:mod:`.sdpa`) follows PyTorch's ``sdp_utils.cpp`` by compute capability:
  flash needs sm80–sm121, memory-efficient sm50–sm121, cuDNN attention sm80–sm121 and is tried
  *first* on sm90/sm10x (Hopper, datacenter Blackwell) as in PyTorch ≥ 2.10 with cuDNN > 9.15.
- cuBLAS workspace (:mod:`.dispatch`): one per (cuBLAS handle, stream), taken through the
  caching allocator on first use; handles are per thread, and the autograd engine runs CUDA
  backward on its own device thread, so forward and backward each take one.
- The profile (:class:`vramplan.target.DeviceProfile`) is built once from the catalog GPU by
  the estimate core (``hardware.target.device_profile``); without one, an sm80 (A100-class)
  NVIDIA GPU is assumed (``DEFAULT_PROFILE``). This package never reads the GPU catalog.
- AMD Instinct (CDNA2/3): flash and memory-efficient attention through AOTriton, no cuDNN.
"""

from __future__ import annotations

from ..target import (
    CUBLAS_WORKSPACE_HOPPER,
    CUBLAS_WORKSPACE_PRE_HOPPER,
    DEFAULT_PROFILE,
    DEFAULT_SM,
    DeviceProfile,
)
from ..units import MiB

CONV_WORKSPACE_CAP = 256 * MiB


def conv_workspace_bytes(input_bytes: int, output_bytes: int) -> int:
    """Documented estimate of one cuDNN convolution call's workspace.

    With ``cudnn.benchmark=False`` PyTorch asks cuDNN's heuristics for an algorithm and
    allocates its workspace through the caching allocator for the duration of the call
    (Conv_v8.cpp). The implicit-precomputed-GEMM family usually chosen needs a workspace of
    the order of the larger operand; we take ``max(input, output)`` capped at 256 MiB.
    """
    return min(max(input_bytes, output_bytes), CONV_WORKSPACE_CAP)


__all__ = ["DeviceProfile", "DEFAULT_PROFILE", "DEFAULT_SM", "CUBLAS_WORKSPACE_PRE_HOPPER",
           "CUBLAS_WORKSPACE_HOPPER", "conv_workspace_bytes", "CONV_WORKSPACE_CAP"]
