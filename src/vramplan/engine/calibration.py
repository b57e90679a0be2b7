"""Calibrating the analytic batch curve to a traced point."""

from __future__ import annotations

from ..errors import VramplanError
from ..hardware.gpu import GPU
from ..models.spec import ModelSpec
from ..results import Breakdown
from ..workload import Workload
from .methods import analytic_core


def calibrate(spec: ModelSpec, w: Workload, g: GPU | None, oh: int, traced_used: int,
              traced_states: Breakdown | None) -> tuple[float, float, str]:
    """Map analytic device_used(batch) onto the traced point: the persistent part (model
    states + overhead) is taken from the trace, and the batch-dependent rest of the analytic
    curve is scaled by the traced/analytic ratio at this batch (``used·scale + offset``).
    Falls back to a constant offset when the ratio is not meaningful."""
    try:
        ana_core = analytic_core(spec, w, g)
    except VramplanError:
        return 1.0, 0.0, "no analytic curve"
    ana = ana_core.reserved + oh
    fixed_t = (traced_states.total if traced_states is not None else 0) + oh
    fa = (ana_core.model_states.total if ana_core.model_states is not None else 0) + oh
    var_t, var_a = traced_used - fixed_t, ana - fa
    if var_a > 0 and var_t > 0 and 0.25 <= var_t / var_a <= 4.0:
        k = var_t / var_a
        return k, fixed_t - k * fa, f"batch-dependent part ×{k:.2f}"
    return 1.0, float(traced_used - ana), "constant offset"


__all__ = ["calibrate"]
