"""Trace a PyTorch step on fake tensors: every allocation and free the GPU would see.

Entry points: :func:`vramplan.trace.run.trace_workload` (catalog models) and
:func:`vramplan.trace.run.trace_model` (any ``nn.Module``) return a
:class:`~vramplan.trace.result.TraceResult`. The user-facing ``vramplan.trace(...)``, which
adds the allocator simulation and the GPU verdict, is
:func:`vramplan.planner.estimate.trace`; this package is callable as that function, because
importing a submodule binds ``vramplan.trace`` to the package.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from vramplan.planner.estimate import trace

        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
