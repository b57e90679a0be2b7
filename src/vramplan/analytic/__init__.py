"""vramplan.analytic — closed-form GPU memory of transformer workloads, per rank.

``estimate(spec, workload)`` returns an :class:`AnalyticEstimate` (per-phase peak instants
with their breakdowns, in milliseconds, no torch); ``check_against_model(spec, workload)``
raises :class:`~vramplan.errors.WorkloadError` for sizes that do not fit the model.

The names are imported on first use: a traced estimate checks the workload against the
model (:mod:`.parallel`) without loading the formulas. ``estimate`` is the function, as
when this module imported it eagerly, although :mod:`.estimate` is a submodule too: the
import system's binding of the submodule to that name is ignored.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .estimate import estimate
    from .parallel import check_against_model
    from .result import AnalyticEstimate, ModelStates

_LAZY = {"estimate": ".estimate", "check_against_model": ".parallel", "AnalyticEstimate": ".result",
         "ModelStates": ".result"}

__all__ = ["AnalyticEstimate", "ModelStates", "check_against_model", "estimate"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if name == "estimate" and isinstance(value, types.ModuleType):
            return  # (the submodule, bound by the import system: the function keeps the name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
