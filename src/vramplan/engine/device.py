"""What the target's capabilities change in an estimate (bf16 support, SDPA kernel choice).

The facts come from the one :class:`~vramplan.target.DeviceProfile` the pipeline builds per
estimate (``hardware.target.device_profile``), the same one the trace's CUDA emulation reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..target import DeviceProfile
from ..workload import Attention, Method, Precision, Workload

if TYPE_CHECKING:
    from vramplan.hardware.gpu import GPU


def profile(g: GPU | None, w: Workload) -> DeviceProfile:
    """The device profile of ``g`` for ``w``'s layout (NCCL buffers depend on its process groups)."""
    from ..hardware.target import device_profile
    from .verdict import communicators

    return device_profile(g, world_size=w.parallel.world_size, communicators=communicators(w))


def kernel_workload(w: Workload, dev: DeviceProfile) -> Workload:
    """The workload as the analytic formulas should see it on ``dev``: SDPA has no fused bf16
    kernel before Ampere, so the math path runs and materialises the attention matrices
    like eager attention does (the trace emulates the kernel choice itself)."""
    if (not dev.bf16 and w.attention is not Attention.EAGER
            and w.precision in (Precision.BF16, Precision.BF16_MIXED)):
        return w.replace(attention=Attention.EAGER)
    return w


def bf16_notes(dev: DeviceProfile, w: Workload, method: Method) -> list[str]:
    """bf16 on a GPU without it (Turing, Volta…): PyTorch runs it slowly and SDPA has no fused
    bf16 kernel there (math fallback, attention matrices materialised)."""
    if dev.bf16 or w.precision not in (Precision.BF16, Precision.BF16_MIXED):
        return []
    text = (f"{dev.name} ({dev.arch}) has no native bf16: PyTorch emulates it slowly and SDPA falls back to "
            "its math kernel, which materialises the attention matrices")
    if method is Method.ANALYTIC and w.attention is not Attention.EAGER:
        text += "; the analytic method therefore counts attention as eager (materialised scores)"
    return [text + "; `precision=fp16-mixed` is what this GPU runs well"]


__all__ = ["profile", "kernel_workload", "bf16_notes"]
