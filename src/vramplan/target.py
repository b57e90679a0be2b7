"""The device profile: every fact about the target GPU that an estimate reads, built once.

``hardware.target.device_profile(gpu, world_size=…)`` builds it from a catalog
:class:`~vramplan.hardware.gpu.GPU`; the estimate core hands the same profile to the trace (its
CUDA emulation: SDPA kernel choice, cuBLAS/cuDNN workspaces) and to the analytic formulas
(workspace, bf16 kernels), and takes the verdict's capacities from it. The trace reads only
this value and never the GPU catalog.
"""

from __future__ import annotations

import dataclasses

from vramplan._dataclass import dataclass

from .errors import WorkloadError
from .results import OverheadItem

CUBLAS_WORKSPACE_PRE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8
"""8,519,680 B: ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``, PyTorch's default before sm90
(aten/src/ATen/cuda/CublasHandlePool.cpp, ``getChosenWorkspaceSize``)."""
CUBLAS_WORKSPACE_HOPPER = 32 * 1024 * 1024
"""32 MiB: ``:4096:8``, PyTorch's default on sm90 and newer (same file)."""
DEFAULT_SM = (8, 0)


@dataclass(frozen=True)
class RolloutEngine:
    """A rollout engine colocated in the trainer's process (GRPO ``rollout=vllm``): the blocks it
    takes from the same caching allocator, as its own start-up sizing decides them."""

    engine: str
    """The engine and the version whose rules sized it ("vLLM 0.10.1.1")."""
    budget: int
    """What it allows itself: ``gpu_memory_utilization`` x the GPU's total."""
    weights: int
    """Its own copy of the policy's weights (the trainer pushes its weights into it)."""
    kv_pool: int
    """The KV cache pool: the budget less weights and the profile run's peak."""
    graphs: int
    """The CUDA graphs' private pool (captured after the pool; outside the budget)."""
    activations: int
    """The profile run's peak above the weights: the most one of its forwards takes (a bound on
    the eager prefill chunks of a generation)."""
    sleep: bool
    """Sleep mode: weights and KV cache released after each generation (``sleep(level=2)``),
    mapped again before the next."""
    refusal: str = ""
    """The engine's own start-up error on this GPU, verbatim (empty: it starts)."""
    summary: str = ""
    """One line: the settings it was sized with."""

    @property
    def resident(self) -> int:
        """Bytes it holds between generations."""
        return self.graphs + (0 if self.sleep else self.weights + self.kv_pool)


def rollout_unsized() -> WorkloadError:
    """``rollout=vllm`` asked of an estimate without a GPU (the engine's budget is a fraction of it)."""
    return WorkloadError("`rollout=vllm` sizes vLLM by the GPU's memory (`vllm_memory` x its total)",
                         hint="add `gpu=NAME` (see `vramplan gpus`), or use `rollout=hf`", field="rollout")


@dataclass(frozen=True)
class DeviceProfile:
    """The target GPU as the estimate sees it (defaults: an sm80, A100-class NVIDIA GPU)."""

    name: str = "sm80 (assumed)"
    sm: tuple[int, int] = DEFAULT_SM
    """Compute capability (major, minor); AMD/Intel get an equivalent for kernel support."""
    vendor: str = "nvidia"
    arch: str = "ampere"
    sm_count: int = 108
    """Streaming multiprocessors (kernels that size scratch per SM: Marlin's fp32 reduce buffer)."""
    bf16: bool = True
    """Native bf16 (Ampere and newer, CDNA): fused bf16 SDPA kernels exist."""
    fp8: bool = False
    """fp8 tensor cores (Ada, Hopper, Blackwell, CDNA3)."""
    cublas_workspace: int = CUBLAS_WORKSPACE_PRE_HOPPER
    """Bytes per cuBLAS (handle, stream) workspace, through the caching allocator; 0: none."""
    prefer_cudnn_attention: bool = False
    """cuDNN attention goes first in the SDPA priority order (sm90 / sm10x)."""
    has_cudnn_attention: bool = True
    cudnn_conv_workspace: bool = True
    """A per-call cuDNN convolution workspace is taken through the caching allocator."""
    usable: int | None = None
    """Bytes a process can use (None: no GPU given, no verdict)."""
    usable_source: str = ""
    overhead: tuple[OverheadItem, ...] = ()
    """Memory outside the caching allocator (CUDA context, kernels, NCCL) for this world size."""
    rollout: RolloutEngine | None = None
    """A rollout engine sharing the process (GRPO ``rollout=vllm``), sized for this GPU and workload."""

    @property
    def overhead_bytes(self) -> int:
        return sum(o.bytes for o in self.overhead)

    @property
    def allocator_capacity(self) -> int | None:
        """What PyTorch's allocator can get: usable bytes minus the memory outside it."""
        return None if self.usable is None else self.usable - self.overhead_bytes

    def without_workspaces(self) -> DeviceProfile:
        """The same device with the library workspaces' emulation off (tests, comparisons)."""
        return dataclasses.replace(self, cublas_workspace=0, cudnn_conv_workspace=False)


DEFAULT_PROFILE = DeviceProfile()

__all__ = ["DeviceProfile", "DEFAULT_PROFILE", "RolloutEngine", "rollout_unsized", "CUBLAS_WORKSPACE_PRE_HOPPER", "CUBLAS_WORKSPACE_HOPPER"]
