"""The GPU side of an estimate: memory outside the allocator, usable capacity, the verdict."""

from __future__ import annotations

from ..hardware.gpu import GPU
from ..results import OverheadItem
from ..workload import Workload


def overhead_items(gpu: GPU | None, w: Workload) -> tuple[OverheadItem, ...]:
    """Memory outside the caching allocator (CUDA context, kernels, NCCL), per GPU; the same
    items as the device profile's (``hardware.target.device_profile(gpu).overhead``)."""
    from ..hardware.overhead import device_overhead

    return tuple(device_overhead(gpu, world_size=w.parallel.world_size))


__all__ = ["overhead_items"]
