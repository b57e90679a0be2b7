"""vramplan's own predictions for a measured workload (trace and analytic), never raising."""

from __future__ import annotations

import time
from collections.abc import Sequence

from vramplan.errors import VramplanError
from vramplan.measure.record import Prediction
from vramplan.models.spec import ModelSpec
from vramplan.workload import Workload

METHODS = ("trace", "analytic")


def catalog_gpu(name: str | None, total: int | None = None) -> str | None:
    """The catalog key of a GPU reported by the driver (e.g. ``NVIDIA H200``), if known."""
    if not name:
        return None
    from vramplan.hardware.catalog import match_device_name

    g = match_device_name(name, total)
    return g.key if g is not None else None


def predict(
    model: str | ModelSpec, w: Workload, *, gpu: str | None = None, alloc_conf: str | None = None,
    methods: Sequence[str] = METHODS,
) -> tuple[Prediction, ...]:
    """One :class:`Prediction` per method; a method that cannot predict records why."""
    from vramplan.engine import estimate

    out = []
    for method in methods:
        t0 = time.perf_counter()
        try:
            r = estimate(model, w, gpu=gpu, method=method, alloc_conf=alloc_conf, search_max_batch=False)
        except VramplanError as e:
            out.append(Prediction(method=method, error=str(e), seconds=time.perf_counter() - t0))
            continue
        except Exception as e:  # a predictor bug must not lose a GPU measurement; it is recorded
            out.append(Prediction(method=method, error=f"internal error: {type(e).__name__}: {e}",
                                  seconds=time.perf_counter() - t0))
            continue
        out.append(Prediction(
            method=method, allocated=r.peak.allocated, reserved=r.peak.reserved,
            device_used=r.peak.device_used, peak_phase=str(r.peak_phase),
            seconds=time.perf_counter() - t0,
        ))
    return tuple(out)
