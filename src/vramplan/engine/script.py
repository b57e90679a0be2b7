"""``vramplan.run_script``: a user's unmodified script → MemoryReport (see :mod:`vramplan.script`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import VramplanError
from ..hardware.gpu import GPU
from ..results import MemoryReport
from ..workload import Parallel, Task, Workload
from .device import profile
from .methods import trace_core
from .pipeline import finish
from .resolve import resolve_gpu


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
    online: bool = False,
    world: int = 1,
) -> MemoryReport:
    """Run the script at ``path`` (with ``argv``) on an emulated ``gpu`` until ``steps``
    optimizer steps (or forward calls, for inference) and predict its memory. ``online``: let
    Hugging Face libraries in the script reach the Hub (off by default: no network).

    The script sees ``torch.cuda`` of the target GPU (``gpus`` of them); its memory queries
    are answered by the allocator simulation. Weights are never read. ``workspaces=False``
    leaves out the CUDA-only library workspaces (cuBLAS, cuDNN), e.g. to compare with a CPU run.
    ``world`` > 1: the script is rank 0 of that many processes (``gpus`` per node), as
    ``torchrun`` / ``accelerate launch`` start it; the report is that rank's memory, with the
    NCCL communicator of the world.
    """
    from ..script.device import DeviceFacts
    from ..script.runner import trace_script

    if gpus < 1:
        raise VramplanError(f"`gpus` must be at least 1, got {gpus}", hint="use `gpus=1`", field="gpus")
    g = resolve_gpu(gpu)
    if g is None:
        raise VramplanError("running a script needs a target GPU to emulate", hint="e.g. `gpu=h100-sxm`", field="gpu")
    if not isinstance(world, int) or world < 1:
        raise VramplanError(f"the world must be a positive number of processes, got {world!r}")
    if world > 1 and world % gpus:
        raise VramplanError(f"a world of {world} processes does not fill nodes of {gpus} GPU(s)",
                            hint=f"declare nodes × {gpus} processes")
    base = Workload(task=Task.TRAIN, parallel=Parallel(dp=world))
    dev = profile(g, base)  # the one device profile: the emulation, torch.cuda's answers, the verdict
    if not workspaces:
        dev = dev.without_workspaces()
    assert dev.usable is not None
    facts = DeviceFacts(name=g.name, sm=dev.sm, total_memory=dev.usable, outside_allocator=dev.overhead_bytes,
                        sm_count=g.sm_count or 0, count=gpus)
    tr, run = trace_script(path, argv, profile=dev, facts=facts, steps=steps, timeout=timeout,
                           alloc_conf=alloc_conf, progress=progress, online=online, world=world)
    w = base if run.steps > 0 else Workload(task=Task.INFER, parallel=Parallel(dp=world))
    core = trace_core(tr, w, alloc_conf, dev.allocator_capacity)
    return finish(core, Path(path).name, w, g, dev, notes=[], user_model=True)


__all__ = ["run_script"]
