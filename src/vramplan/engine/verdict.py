"""The GPU side of an estimate: memory outside the allocator, usable capacity, the verdict."""

from __future__ import annotations

from ..hardware.gpu import GPU
from ..results import OverheadItem
from ..workload import Workload


def overhead_items(gpu: GPU | None, w: Workload) -> tuple[OverheadItem, ...]:
    """Memory outside the caching allocator (CUDA context, kernels, NCCL), per GPU."""
    from ..hardware.overhead import device_overhead

    return tuple(device_overhead(gpu, world_size=w.parallel.world_size))


def usable(gpu: GPU) -> tuple[int, str]:
    """Bytes a process can use on ``gpu`` and where that figure comes from."""
    from ..hardware.catalog import usable_capacity

    return usable_capacity(gpu)


def pool_capacity(g: GPU | None, w: Workload) -> int | None:
    """What PyTorch's allocator can get: usable capacity minus the memory outside it."""
    if g is None:
        return None
    return usable(g)[0] - sum(o.bytes for o in overhead_items(g, w))


__all__ = ["overhead_items", "usable", "pool_capacity"]
