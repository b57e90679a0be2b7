"""Device memory outside PyTorch's caching allocator, and library workspaces inside it.

nvidia-smi's "used" = CUDA context + kernel images + library handles + NCCL buffers +
the caching allocator's reserved pool. :func:`device_overhead` predicts everything but the
pool, item by item, each with its source; :func:`cublas_workspace_bytes` is the cuBLAS
workspace that PyTorch takes *through* the caching allocator (so the allocator simulation
counts it, not this module).

The model (all figures in :data:`CONTEXT_MEASUREMENTS` and the constants below):

* context + kernel images = a measured base for the PyTorch era and module-loading mode,
  calibrated on the card it was measured on, after removing that card's stack reservation;
* stack reservation = SMs × max resident threads per SM × 1 KiB (``cudaLimitStackSize``
  default): CUDA reserves local memory for every thread that can be resident, so this part
  scales with the GPU's size;
* cuBLAS/cuBLASLt handle and GEMM kernels, cuDNN handle (opt-in): stated assumptions;
* NCCL (world size > 1): one item per communicator (process group) of the mesh, from NCCL's
  buffer sizes (:mod:`vramplan.hardware.nccl`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vramplan._dataclass import dataclass
from vramplan.errors import VramplanError
from vramplan.results import OverheadItem
from vramplan.target import CUBLAS_WORKSPACE_HOPPER, CUBLAS_WORKSPACE_PRE_HOPPER
from vramplan.units import GiB, KiB, MiB

from .nccl import (
    GPUS_PER_NODE,
    LL128_BUFFSIZE,
    LL_BUFFSIZE,
    SIMPLE_BUFFSIZE,
    Communicator,
    communicator_items,
)

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU

STACK_BYTES_PER_THREAD = 1 * KiB
"""``cudaLimitStackSize`` default (CUDA Runtime API, cudaDeviceSetLimit)."""

MAX_THREADS_PER_SM: dict[str, int] = {
    "7.0": 2048, "7.5": 1024, "8.0": 2048, "8.6": 1536, "8.7": 1536, "8.9": 1536,
    "9.0": 2048, "10.0": 2048, "10.3": 2048, "12.0": 1536,
}
"""Maximum resident threads per SM by compute capability (CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability")."""

ALLOCATOR_FIRST_SEGMENT = 2 * MiB
"""``torch.ones(1).cuda()`` also creates one 2 MiB small-pool segment; measurements taken
that way include it, and it belongs to the allocator's reserved pool, so it is removed."""


@dataclass(frozen=True)
class ContextMeasurement:
    """Device memory used right after ``torch.ones(1).cuda()``."""

    gpu: str
    sm_count: int
    compute_capability: str
    torch: str
    lazy: bool
    bytes: int
    source: str


CONTEXT_MEASUREMENTS: tuple[ContextMeasurement, ...] = (
    ContextMeasurement("v100-sxm2-16gb", 80, "7.0", "1.x", False, 1343 * MiB,
                       "HF transformers model_memory_anatomy: 1,343 MB nvidia-smi after "
                       "torch.ones((1,1)).to('cuda') on V100-SXM2 16GB, driver 460, CUDA 11.2 "
                       "(shared/data/calibration/hf-bert-large-v100.md)"),
    ContextMeasurement("a100-sxm4-80gb", 108, "8.0", "1.10", False, int(1.78 * GiB),
                       "Stas Bekman, ml-engineering: A100, pytorch 1.10.2, CUDA_MODULE_LOADING=EAGER: "
                       "used=1.78 GiB (total − free)"),
    ContextMeasurement("a100-sxm4-80gb", 108, "8.0", "1.13", False, int(0.90 * GiB),
                       "Stas Bekman, ml-engineering: A100, pytorch 1.13.1, EAGER: used=0.90 GiB"),
    ContextMeasurement("a100-sxm4-80gb", 108, "8.0", "2.1", False, int(0.92 * GiB),
                       "Stas Bekman, ml-engineering: A100, pytorch 2.1.1, EAGER: used=0.92 GiB"),
    ContextMeasurement("a100-sxm4-80gb", 108, "8.0", "2.1", True, int(0.47 * GiB),
                       "Stas Bekman, ml-engineering: A100, pytorch 2.1.1, lazy module loading: used=0.47 GiB"),
)

LAZY_SINCE = (1, 13)
"""PyTorch sets CUDA_MODULE_LOADING=LAZY when unset (aten/src/ATen/cuda/detail/CUDAHooks.cpp,
``maybe_set_cuda_module_loading("LAZY")``); lazy loading itself needs CUDA ≥ 11.7."""

CUBLAS_HANDLE_EAGER = 95 * MiB
CUBLAS_HANDLE_EAGER_SOURCE = ("95 MB on the GPU at cublasCreate with eager module loading "
                              "(mtazzari/galario#82, CUDA 8/9 era)")
CUBLAS_HANDLE_LAZY = 64 * MiB
CUBLAS_HANDLE_LAZY_SOURCE = ("assumption (no public measurement found): with lazy loading only the "
                             "GEMM kernels a run uses are loaded; order of magnitude, calibrate on a GPU")
CUDNN_HANDLE_EAGER = 256 * MiB
CUDNN_HANDLE_LAZY = 64 * MiB
CUDNN_SOURCE = ("assumption (no public measurement found): cudnnCreate plus the convolution kernels "
                "used; eager loading of all cuDNN sub-libraries costs several times more")

NCCL_SIMPLE_BUFFSIZE = SIMPLE_BUFFSIZE
NCCL_LL_BUFFSIZE = LL_BUFFSIZE
NCCL_LL128_BUFFSIZE = LL128_BUFFSIZE
"""NCCL's per-connection buffer sizes (defined with their sources in :mod:`.nccl`)."""

def _parse_version(v: str | None) -> tuple[int, int] | None:
    if v is None:
        return None
    m = re.match(r"^\s*(\d+)\.(\d+)", v)
    if not m:
        raise VramplanError(f"invalid torch version {v!r}", hint="write e.g. 2.4 or 2.4.1+cu121")
    return int(m.group(1)), int(m.group(2))


def stack_reservation(gpu: GPU | None) -> int:
    """SMs × max resident threads per SM × 1 KiB (0 where the GPU's figures are unknown)."""
    if gpu is None or gpu.vendor != "nvidia" or not gpu.sm_count:
        return 0
    threads = MAX_THREADS_PER_SM.get(gpu.compute_capability or "")
    return gpu.sm_count * threads * STACK_BYTES_PER_THREAD if threads else 0


def _measurement(gpu: GPU | None, version: tuple[int, int] | None, lazy: bool) -> ContextMeasurement:
    old = version is not None and version < LAZY_SINCE
    if old:
        if gpu is not None and gpu.arch == "volta":
            return CONTEXT_MEASUREMENTS[0]
        return CONTEXT_MEASUREMENTS[1]
    if lazy:
        return CONTEXT_MEASUREMENTS[4]
    if version is not None and version < (2, 0):
        return CONTEXT_MEASUREMENTS[2]
    return CONTEXT_MEASUREMENTS[3]


def _measured_stack(m: ContextMeasurement) -> int:
    return m.sm_count * MAX_THREADS_PER_SM[m.compute_capability] * STACK_BYTES_PER_THREAD

def device_overhead(
    gpu: GPU | None,
    *,
    world_size: int = 1,
    torch_version: str | None = None,
    lazy_loading: bool = True,
    cudnn: bool = False,
    nccl_channels: int | None = None,
    communicators: Sequence[Communicator] | None = None,
    nvls: bool | None = None,
) -> tuple[OverheadItem, ...]:
    """Memory nvidia-smi counts that the caching allocator does not, per GPU (rank).

    ``torch_version`` None means a current PyTorch (≥ 2.0). ``lazy_loading`` is
    CUDA_MODULE_LOADING=LAZY, PyTorch's default since 1.13 (ignored for older versions).
    ``cudnn`` adds the cuDNN handle (convolution models). ``world_size`` > 1 adds one NCCL
    communicator over the world; ``communicators`` (:func:`vramplan.hardware.nccl.mesh_communicators`)
    lists them instead, one per process group of the mesh. ``nvls`` forces NVLink SHARP
    buffers on or off (None: where the GPU has NVSwitch multicast).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise VramplanError(f"`world_size` must be a positive integer, got {world_size!r}",
                            hint="use `world_size=1` for one GPU, or the number of GPUs of the job", field="world_size")
    if nccl_channels is not None and nccl_channels < 1:
        raise VramplanError(f"NCCL channels must be >= 1, got {nccl_channels!r}")
    version = _parse_version(torch_version)
    old = version is not None and version < LAZY_SINCE
    lazy = lazy_loading and not old
    m = _measurement(gpu, version, lazy)
    stack = stack_reservation(gpu) if gpu is not None else _measured_stack(m)
    base = m.bytes - ALLOCATOR_FIRST_SEGMENT - _measured_stack(m)
    on = gpu.key if gpu is not None else "no GPU given: the measured card"
    caveat = ""
    if gpu is not None and gpu.vendor != "nvidia":
        caveat = f"; no public measurement for {gpu.vendor} — NVIDIA figure used as a placeholder"
    elif gpu is not None and gpu.key != m.gpu:
        caveat = f"; measured on {m.gpu}, applied to {gpu.key}"
    items = [
        OverheadItem(
            f"CUDA context + kernel images ({'lazy' if lazy else 'eager'} loading)", base,
            f"{m.source}, minus its stack reservation ({_measured_stack(m) // MiB} MiB) and the "
            f"allocator's first 2 MiB segment{caveat}"),
    ]
    if stack:
        threads = MAX_THREADS_PER_SM.get(gpu.compute_capability or "", 0) if gpu else 2048
        sms = gpu.sm_count if gpu else m.sm_count
        items.append(OverheadItem(
            "thread stack reservation", stack,
            f"{sms} SMs × {threads} threads/SM × 1 KiB (cudaLimitStackSize default; CUDA "
            f"reserves local memory for every resident thread) — {on}"))
    elif gpu is not None and gpu.vendor == "nvidia":
        items.append(OverheadItem(
            "thread stack reservation", _measured_stack(m),
            f"SM count or threads/SM of {gpu.key} not in the catalog: the {m.gpu}'s "
            f"{m.sm_count} SMs × 2048 threads × 1 KiB used as a placeholder"))
    items.append(OverheadItem(
        "cuBLAS/cuBLASLt handle + GEMM kernels",
        CUBLAS_HANDLE_LAZY if lazy else CUBLAS_HANDLE_EAGER,
        CUBLAS_HANDLE_LAZY_SOURCE if lazy else CUBLAS_HANDLE_EAGER_SOURCE))
    if cudnn:
        items.append(OverheadItem("cuDNN handle + convolution kernels",
                                  CUDNN_HANDLE_LAZY if lazy else CUDNN_HANDLE_EAGER, CUDNN_SOURCE))
    if communicators is None:
        communicators = (Communicator("world", world_size, min(world_size, GPUS_PER_NODE)),) if world_size > 1 else ()
    items.extend(communicator_items(gpu, communicators, channels=nccl_channels, nvls=nvls))
    return tuple(items)


# --- workspaces allocated through the caching allocator --------------------------------

CUBLAS_WORKSPACE_DEFAULT = CUBLAS_WORKSPACE_PRE_HOPPER
"""8,519,680 B = ``:4096:2:16:8`` (aten/src/ATen/cuda/CublasHandlePool.cpp); seen as the
8,519,680 B that stays allocated after the first matmul (pytorch/pytorch#95668)."""
CUBLAS_WORKSPACE_LARGE = CUBLAS_WORKSPACE_HOPPER
"""32 MiB = ``:4096:8``: PyTorch's default for compute capability 9.x, 10.x, 11.x and 12.x
(Hopper and Blackwell) in current CublasHandlePool.cpp; releases before Blackwell support
applied it to sm_90 only."""
HIPBLAS_WORKSPACE_DEFAULT = 32 * MiB
HIPBLAS_WORKSPACE_GFX94 = 128 * MiB
"""ROCm: 32 MiB default, 128 MiB for gfx942/gfx950 (MI300X/MI325X/MI355X)."""
CUBLASLT_WORKSPACE_DEFAULT = 1 * MiB
"""``CUBLASLT_WORKSPACE_SIZE`` default 1024 KiB (pytorch/pytorch#73328)."""
HIPBLASLT_WORKSPACE_DEFAULT = 76 * MiB


def parse_cublas_workspace_config(config: str) -> int:
    """Bytes of a ``CUBLAS_WORKSPACE_CONFIG`` string such as ``:4096:8`` or ``:4096:2:16:8``."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        raise VramplanError(f"cannot parse CUBLAS_WORKSPACE_CONFIG {config!r}",
                            hint="write :SIZE_KIB:COUNT pairs, e.g. :4096:8")
    return sum(int(size) * KiB * int(count) for size, count in pairs)


def cublas_workspace_bytes(gpu: GPU | None, *, config: str | None = None) -> int:
    """cuBLAS workspace per (handle, stream), taken through the caching allocator on first use.

    ``config`` is a ``CUBLAS_WORKSPACE_CONFIG`` value; ``gpu`` None means a pre-Hopper GPU.
    Non-CUDA accelerators (Gaudi) have none (0); AMD uses hipBLAS's defaults.
    """
    if config is not None:
        return parse_cublas_workspace_config(config)
    if gpu is None:
        return CUBLAS_WORKSPACE_DEFAULT
    if gpu.vendor == "amd":
        return HIPBLAS_WORKSPACE_GFX94 if gpu.arch == "cdna3" else HIPBLAS_WORKSPACE_DEFAULT
    if gpu.vendor != "nvidia":
        return 0
    major = gpu.sm[0] if gpu.sm else 0
    return CUBLAS_WORKSPACE_LARGE if major in (9, 10, 11, 12) else CUBLAS_WORKSPACE_DEFAULT


def cublaslt_workspace_bytes(gpu: GPU | None) -> int:
    """cuBLASLt workspace per (handle, stream) through the caching allocator.

    CUDA: min(1 MiB, cuBLAS workspace); current PyTorch shares the cuBLAS workspace instead
    when TORCH_CUBLASLT_UNIFIED_WORKSPACE applies. ROCm: 76 MiB (hipBLASLt).
    """
    if gpu is not None and gpu.vendor == "amd":
        return HIPBLASLT_WORKSPACE_DEFAULT
    if gpu is not None and gpu.vendor != "nvidia":
        return 0
    return min(CUBLASLT_WORKSPACE_DEFAULT, cublas_workspace_bytes(gpu))
