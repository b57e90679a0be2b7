"""The largest micro-batch that fits: a search over the analytic batch curve."""

from __future__ import annotations

from ..errors import VramplanError
from ..hardware.gpu import GPU
from ..models.spec import ModelSpec
from ..workload import Workload
from .methods import analytic_core

MAX_BATCH_LIMIT = 1 << 16


def analytic_device_used(spec: ModelSpec, w: Workload, overhead: int, g: GPU | None = None) -> int | None:
    try:
        core = analytic_core(spec, w, g)
    except VramplanError:
        return None
    return core.reserved + overhead


def max_batch_analytic(spec: ModelSpec, w: Workload, usable: int, overhead: int, *, scale: float = 1.0,
                       offset: float = 0.0, gpu: GPU | None = None) -> int | None:
    """Largest micro-batch whose analytic device_used (× ``scale`` + ``offset``, a calibration
    from a trace) fits in ``usable``. Doubling then bisection: O(log batch) evaluations."""

    def fits(b: int) -> bool:
        used = analytic_device_used(spec, w.replace(batch=b), overhead, gpu)
        return used is not None and used * scale + offset <= usable

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= MAX_BATCH_LIMIT and fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_BATCH_LIMIT:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["MAX_BATCH_LIMIT", "max_batch_analytic", "analytic_device_used"]
