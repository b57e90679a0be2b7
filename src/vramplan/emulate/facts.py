"""What a script may learn about the emulated GPU (handed in by the engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CUDA_VERSION = "12.8"
"""``torch.version.cuda`` on a CPU build of torch (the CUDA wheels of torch 2.9–2.14 default to 12.8);
a CUDA build reports its own."""
DEFAULT_NCCL_VERSION = (2, 27, 5)


@dataclass(frozen=True)
class DeviceFacts:
    """The emulated GPU as ``torch.cuda`` / ``torch.accelerator`` describe it."""

    name: str
    sm: tuple[int, int]
    total_memory: int
    """``get_device_properties().total_memory`` / ``mem_get_info()[1]``: what CUDA reports."""
    outside_allocator: int = 0
    """CUDA context and libraries: memory the allocator cannot get (``mem_get_info`` free)."""
    sm_count: int = 0
    count: int = 1
    """``device_count()``."""
    l2_cache: int = 0

    @property
    def bf16(self) -> bool:
        return self.sm >= (8, 0)

    @property
    def tf32(self) -> bool:
        return self.sm >= (8, 0)

    @property
    def cuda_version(self) -> str:
        return torch.version.cuda or DEFAULT_CUDA_VERSION

    @property
    def nccl_version(self) -> tuple[int, ...]:
        """``torch.cuda.nccl.version()``: this build's NCCL where it has one, else the NCCL the
        CUDA wheels of torch 2.13/2.14 bundle (nvidia-nccl-cu12 2.27)."""
        try:
            import torch.cuda.nccl as nccl

            v = nccl.version()
            if isinstance(v, tuple) and v:
                return v
        except Exception:  # noqa: BLE001 (a CPU build has no NCCL: its call raises)
            pass
        return DEFAULT_NCCL_VERSION


def facts_of(name: str, sm: tuple[int, int], usable: int | None, outside_allocator: int = 0, *,
             sm_count: int = 0, count: int = 1) -> DeviceFacts:
    """The facts of a device profile (``usable``: what CUDA reports as total memory; an unknown
    capacity reads as 80 GiB, the most common data-centre card's)."""
    return DeviceFacts(name=name, sm=sm, total_memory=usable if usable is not None else 80 << 30,
                       outside_allocator=outside_allocator, sm_count=sm_count, count=count)
