"""The estimate core: between the planner (which searches) and the methods (which predict).

:func:`estimate` (catalog models and configs) and :func:`trace` (a user's own model) run a
method (:mod:`.methods`: analytic formulas or trace + allocator replay), add the GPU's share
(:mod:`.verdict`), and find the largest batch that fits (:mod:`.boundary`, calibrated to a
traced point by :mod:`.calibration`). Exported from the package root as
``vramplan.estimate`` and ``vramplan.trace``.
"""

from __future__ import annotations

from .boundary import MAX_BATCH_LIMIT, max_batch_analytic
from .methods import replay_trace
from .pipeline import estimate
from .resolve import resolve_gpu, resolve_model
from .user_model import trace
from .verdict import overhead_items

__all__ = ["estimate", "trace", "max_batch_analytic", "MAX_BATCH_LIMIT", "replay_trace",
           "resolve_model", "resolve_gpu", "overhead_items"]
