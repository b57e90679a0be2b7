"""The GPU side of an estimate: memory outside the allocator, usable capacity, the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hardware.nccl import Communicator, mesh_communicators
from ..results import OverheadItem
from ..workload import Workload

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU


def communicators(w: Workload) -> tuple[Communicator, ...]:
    """The NCCL communicators one rank of ``w``'s layout joins (one per process group)."""
    p = w.parallel
    return mesh_communicators(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp_shard=p.dp_shard)


def overhead_items(gpu: GPU | None, w: Workload) -> tuple[OverheadItem, ...]:
    """Memory outside the caching allocator (CUDA context, kernels, NCCL), per GPU; the same
    items as the device profile's (``hardware.target.device_profile(gpu).overhead``)."""
    from ..hardware.overhead import device_overhead

    return tuple(device_overhead(gpu, world_size=w.parallel.world_size, communicators=communicators(w)))


__all__ = ["communicators", "overhead_items"]
