"""vramplan.analytic — closed-form GPU memory of transformer workloads, per rank.

``estimate(spec, workload)`` returns an :class:`AnalyticEstimate` (per-phase peak instants
with their breakdowns, in milliseconds, no torch); ``check_against_model(spec, workload)``
raises :class:`~vramplan.errors.WorkloadError` for sizes that do not fit the model.
"""

from .estimate import estimate
from .parallel import check_against_model
from .result import AnalyticEstimate, ModelStates

__all__ = ["AnalyticEstimate", "ModelStates", "check_against_model", "estimate"]
