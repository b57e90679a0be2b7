"""``vramplan.run_script``: a user's unmodified script → MemoryReport (see :mod:`vramplan.script`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import VramplanError
from ..hardware.gpu import GPU
from ..results import MemoryReport
from ..workload import Task, Workload
from .methods import trace_core
from .pipeline import finish
from .resolve import resolve_gpu
from .verdict import overhead_items, pool_capacity, usable


def run_script(
    path: str | Path,
    argv: Sequence[str] = (),
    *,
    gpu: str | GPU | None = "h100-sxm",
    steps: int = 2,
    timeout: float | None = 300.0,
    gpus: int = 1,
    alloc_conf: str | None = None,
    progress: Callable[[str], None] | None = None,
    workspaces: bool = True,
) -> MemoryReport:
    """Run the script at ``path`` (with ``argv``) on an emulated ``gpu`` until ``steps``
    optimizer steps (or forward calls, for inference) and predict its memory.

    The script sees ``torch.cuda`` of the target GPU (``gpus`` of them); its memory queries
    are answered by the allocator simulation. Weights are never read. ``workspaces=False``
    leaves out the CUDA-only library workspaces (cuBLAS, cuDNN), e.g. to compare with a CPU run.
    """
    from ..script.device import DeviceFacts
    from ..script.runner import trace_script
    from ..trace.cuda import profile_for

    if gpus < 1:
        raise VramplanError(f"gpus must be at least 1, got {gpus}", hint="--gpus 1")
    g = resolve_gpu(gpu)
    if g is None:
        raise VramplanError("vramplan run needs a target GPU to emulate", hint="--gpu h100-sxm")
    profile = profile_for(g, workspaces=workspaces)
    base = Workload(task=Task.TRAIN)
    outside = sum(o.bytes for o in overhead_items(g, base))
    facts = DeviceFacts(name=g.name, sm=profile.sm, total_memory=usable(g)[0], outside_allocator=outside,
                        sm_count=g.sm_count or 0, count=gpus)
    tr, run = trace_script(path, argv, profile=profile, facts=facts, steps=steps, timeout=timeout,
                           alloc_conf=alloc_conf, progress=progress)
    w = base if run.steps > 0 else Workload(task=Task.INFER)
    core = trace_core(tr, w, alloc_conf, pool_capacity(g, w))
    core = dataclasses.replace(core, extra={**core.extra, "user_model": True, "script": str(path)})
    return finish(core, Path(path).name, w, g, notes=[], spec=None, search_max_batch=False)


__all__ = ["run_script"]
