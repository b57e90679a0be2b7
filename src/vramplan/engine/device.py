"""What a GPU's capabilities change in an estimate (bf16 support, SDPA kernel choice)."""

from __future__ import annotations

from ..hardware.gpu import GPU
from ..workload import Attention, Method, Precision, Workload


def kernel_workload(w: Workload, g: GPU | None) -> Workload:
    """The workload as the analytic formulas should see it on ``g``: SDPA has no fused bf16
    kernel before Ampere, so the math path runs and materialises the attention matrices
    like eager attention does (the trace emulates the kernel choice itself)."""
    from ..planner.space import supports_bf16

    if (g is not None and not supports_bf16(g) and w.attention is not Attention.EAGER
            and w.precision in (Precision.BF16, Precision.BF16_MIXED)):
        return w.replace(attention=Attention.EAGER)
    return w


def bf16_notes(g: GPU | None, w: Workload, method: Method) -> list[str]:
    """bf16 on a GPU without it (Turing, Volta…): PyTorch runs it slowly and SDPA has no fused
    bf16 kernel there (math fallback, attention matrices materialised)."""
    from ..planner.space import supports_bf16

    if g is None or supports_bf16(g) or w.precision not in (Precision.BF16, Precision.BF16_MIXED):
        return []
    text = (f"{g.key} ({g.arch}) has no native bf16: PyTorch emulates it slowly and SDPA falls back to "
            "its math kernel, which materialises the attention matrices")
    if method is Method.ANALYTIC and w.attention is not Attention.EAGER:
        text += "; the analytic method therefore counts attention as eager (materialised scores)"
    return [text + "; --precision fp16-mixed is what this GPU runs well"]


__all__ = ["kernel_workload", "bf16_notes"]
