"""vramplan: predict the GPU memory of PyTorch workloads before you run them.

The public API is imported lazily so that ``import vramplan`` stays cheap::

    import vramplan
    w = vramplan.Workload(task="train", batch=4, seq=2048, precision="bf16-mixed")
    report = vramplan.estimate("llama-3.1-8b", w, gpu="h100-sxm")
    report = vramplan.trace(build_model, inputs=..., task="train", gpu="a100-80gb")
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Workload": "vramplan.workload",
    "Parallel": "vramplan.workload",
    "MemoryReport": "vramplan.results",
    "Breakdown": "vramplan.results",
    "VramplanError": "vramplan.errors",
    "estimate": "vramplan.planner.estimate",
    "trace": "vramplan.trace",
    "fit": "vramplan.planner.fit",
    "plan": "vramplan.planner.plan",
    "measure": "vramplan.measure",
    "get_gpu": "vramplan.hardware.catalog",
    "resolve_model": "vramplan.models.catalog",
    "serve_plan": "vramplan.serving",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'vramplan' has no attribute {name!r}")
    module = importlib.import_module(mod)
    if name in ("trace", "measure"):  # callable packages (see their __init__)
        return module
    return getattr(module, name if name != "resolve_model" else "resolve")
