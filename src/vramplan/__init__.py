"""vramplan: predict the GPU memory of PyTorch workloads before you run them.

The public API is imported lazily so that ``import vramplan`` stays cheap::

    import vramplan
    w = vramplan.Workload(task="train", batch=4, seq=2048, precision="bf16-mixed")
    report = vramplan.estimate("llama-3.1-8b", w, gpu="h100-sxm")
    report = vramplan.trace(build_model, inputs=..., task="train", gpu="a100-80gb")

``vramplan.trace`` and ``vramplan.measure`` are plain functions although ``vramplan/trace/``
and ``vramplan/measure/`` are packages too: importing a submodule makes Python bind the
package as an attribute of its parent, so this module's class keeps those two names bound
to the functions (the packages stay reachable through ``import`` and ``sys.modules``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Workload": "vramplan.workload",
    "Parallel": "vramplan.workload",
    "MemoryReport": "vramplan.results",
    "Breakdown": "vramplan.results",
    "VramplanError": "vramplan.errors",
    "estimate": "vramplan.engine.pipeline",
    "trace": "vramplan.engine.user_model",
    "fit": "vramplan.planner.fit",
    "plan": "vramplan.planner.plan",
    "measure": "vramplan.measure.run",
    "run_script": "vramplan.engine.script",
    "get_gpu": "vramplan.hardware.catalog",
    "resolve_model": "vramplan.models.catalog",
}
_ATTR = {"resolve_model": "resolve"}
_SHADOWED = ("trace", "measure")
"""Functions named like a subpackage: they win over the subpackage as attributes."""

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), _ATTR.get(name, name))


def _function(name: str) -> property:
    def get(self: types.ModuleType) -> Any:
        return __getattr__(name)

    def set_(self: types.ModuleType, value: Any) -> None:
        # the import system binds a freshly imported subpackage here; keep the function
        if not isinstance(value, types.ModuleType):
            raise AttributeError(f"vramplan.{name} is a function and cannot be replaced")

    return property(get, set_, doc=f"``vramplan.{name}``: see :mod:`{_LAZY[name]}`.")


class _Root(types.ModuleType):
    trace = _function("trace")
    measure = _function("measure")


sys.modules[__name__].__class__ = _Root
