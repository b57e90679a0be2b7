"""Measure a workload on a real CUDA GPU and put vramplan's predictions beside the numbers.

    import vramplan
    rec = vramplan.measure("llama-3.2-1b", vramplan.Workload(batch=4, seq=1024), out="results.jsonl")
    rec.measured.reserved, rec.errors()["trace"]["reserved"]

Pieces: :mod:`.run` (:func:`measure`), :mod:`.harness` (the timed loop and memory counters), :mod:`.step` (building the
workload for real), :mod:`.env` (versions, NVML), :mod:`.predict` (trace and analytic
estimates), :mod:`.record` (one JSON line per run).
"""

from __future__ import annotations

from vramplan.measure.record import Measured, MeasureRecord, Prediction
from vramplan.measure.run import measure

__all__ = ["MeasureRecord", "Measured", "Prediction", "measure"]
