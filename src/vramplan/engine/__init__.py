"""The estimate core: between the planner (which searches) and the methods (which predict).

:func:`estimate` (catalog models and configs) and :func:`trace` (a user's own model) run a
method (:mod:`.methods`: analytic formulas or trace + allocator replay), add the GPU's share
(:mod:`.verdict`), and find the largest batch that fits (:mod:`.boundary`, the one boundary
search that ``fit``, ``plan`` and the sweeps use too, shaped by the analytic curve calibrated
to confirmed points by :mod:`.calibration`). Exported from the package root as
``vramplan.estimate`` and ``vramplan.trace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .methods import replay_trace
from .pipeline import estimate
from .resolve import resolve_gpu, resolve_model
from .user_model import trace
from .verdict import overhead_items

if TYPE_CHECKING:
    from .boundary import MAX_BATCH, BoundarySearch, boundary_search

_BOUNDARY = frozenset({"MAX_BATCH", "BoundarySearch", "boundary_search"})


def __getattr__(name: str) -> Any:
    """The boundary search's names, imported when first asked for: an estimate without a GPU
    never searches (start-up)."""
    if name in _BOUNDARY:
        from . import boundary

        return getattr(boundary, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["estimate", "trace", "BoundarySearch", "boundary_search", "MAX_BATCH", "replay_trace",
           "resolve_model", "resolve_gpu", "overhead_items"]
