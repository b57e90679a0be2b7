"""vramplan.runtime: step-time estimates (FLOPs and bytes against a GPU's rates).

Knows nothing of memory. Entry point: :func:`step_time` → :class:`StepTime`.
"""

from .rates import DEFAULT_EFFICIENCY, Efficiency
from .step import Bound, StepTime, step_time

__all__ = ["DEFAULT_EFFICIENCY", "Bound", "Efficiency", "StepTime", "step_time"]
